"""Map the masks of a score to the cheapest kind the operator has that is provably equal.

A mask the model builds from positions (``arange(S)[None] <= arange(T)[:, None] + off``,
``full(-inf).triu(1)``, ``ones(bool).tril()``) becomes the causal kind with that offset: the kernel
computes it from indices and no mask tensor is read. A triangle of -inf *added* to the score stays
additive (``causal_additive``): behind it a NaN or +inf score is NaN, as in eager, where a replacing
mask (``masked_fill``, ``where``, a bool mask) gives the fill. Row windows built from per-row tensors
(``arange(S) >= ks[:, None]``) become ``starts``/``ends``. A mask that is an AND of such a causal rule and
tensors that vary only over batch and key (HF's ``causal & padding``, built [B, 1, T, S] by its mask functions) is
split (``split_keep``): the causal rule becomes the range, the rest a key mask passed [B, 1, S] (broadcast over the
queries), never the [B, T, S] tensor. Any other mask is passed as a tensor, read tile by tile: always correct, only
less cheap.

What a mask built from positions says is read by ``positions``; this module decides the kind and emits the
op's mask arguments.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .attention_sites import CONSTANT_TENSORS, constant_fill, mask_op
from .dim_labels import VALUE_VIEWS, operand_labels, view_input_labels
from .graph_ops import Aliases, dtype, writes_after, written_in_place
from .index_expr import Leaf, Reject, Score
from .positions import Neg, Pred, additive_visible_where, neg_term, peel_not, visible_where

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# the plan
@dataclass
class MaskPlan:
    fill: float = NEG_INF
    causal: bool = False
    causal_additive: bool = False  # the causal part is a -inf triangle added to the score
    offset: object = 0  # int or an fx.Node holding a SymInt
    offset_terms: tuple = ()
    starts: fx.Node | None = None
    ends: fx.Node | None = None
    window_start: tuple | None = None  # (Leaf of an integer row tensor, constant terms added to it)
    window_end: tuple | None = None
    keep: list[Leaf] = field(default_factory=list)
    bias: list[Leaf] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return " + ".join(self.kinds) or "none"

    def emit(self, graph: fx.Graph, place, T, S) -> tuple[fx.Node | None, fx.Node | None]:
        """Insert the nodes computing the op's offset, windows, bool mask and bias; return (mask, bias).

        ``place(leaf, rest)`` lays a leaf's tensor out as [batch, *rest] (batch may broadcast).
        """
        self.offset = _emit_sum(graph, self.offset_terms)
        self.starts = _emit_row(graph, self.window_start, (T,), place)
        self.ends = _emit_row(graph, self.window_end, (T,), place)
        order = (T, S)
        mask = None
        for leaf in self.keep:
            leaf = peel_not(leaf) or leaf  # masked_fill(~visible, ...): use visible
            m = place(leaf, order)
            if leaf.negate:
                m = graph.call_function(torch.logical_not, (m,))
            mask = m if mask is None else graph.call_function(torch.logical_and, (mask, m))
        bias = None
        for leaf in self.bias:
            b = place(leaf, order)
            if leaf.cast is not None:  # the model's add converts an int or bool term to the score's dtype
                b = graph.call_method("to", (b, leaf.cast))
            if leaf.negate:  # score - x == score + (-x), NaN and infinities included
                b = graph.call_function(torch.neg, (b,))
            bias = b if bias is None else graph.call_function(torch.add, (bias, b))
        return mask, bias


def _emit_row(graph: fx.Graph, bound: tuple | None, rows: tuple, place) -> fx.Node | None:
    """A [B, T] (or broadcastable) int64 tensor: the row tensor plus its constant terms."""
    if bound is None:
        return None
    leaf, terms = bound
    node = place(leaf, rows)
    node = graph.call_method("to", (node, torch.int64))
    c = _emit_sum(graph, terms)
    if not (isinstance(c, int) and c == 0):
        node = graph.call_function(torch.add, (node, c))
    return node


def emit_sum(graph: fx.Graph, terms: tuple):
    """Insert the nodes adding up offset terms (ints and SymInt nodes, as ``causal_offset`` returns them)."""
    return _emit_sum(graph, terms)


def _emit_sum(graph: fx.Graph, terms: tuple):
    total, nodes = 0, []
    for t in terms:
        if isinstance(t, int):
            total += t
        else:
            nodes.append(t)
    out = total
    for t in nodes:
        if isinstance(t, Neg):
            out = graph.call_function(operator.sub, (out, t.term))
        else:
            out = graph.call_function(operator.add, (out, t)) if not (isinstance(out, int) and out == 0) else t
    return out


def _causal_offset(p: Pred, leaf: Leaf, sc: Score) -> tuple | None:
    """If ``p`` is exactly ``s - t + c <= 0`` on the score's key and query dims: the offset terms (-c)."""
    return causal_offset(p, leaf.labels, sc.key, sc.query)


def causal_offset(p: Pred, labels: tuple, key, query) -> tuple | None:
    """If ``p`` is exactly ``s - t + c <= 0`` where ``labels`` (one per dim of the mask ``p`` was read from)
    names ``key`` (s) and ``query`` (t): the offset terms (-c), for ``emit_sum``; else None."""
    if len(p.leq_zero) != 1:
        return None
    e = p.leq_zero[0]
    if e.tensors:
        return None
    n = len(labels)
    role = {}
    for d, _ in e.coef:
        if d < -n:
            return None
        role[d] = labels[n + d]
    coefs = {role[d]: v for d, v in e.coef}
    if coefs != {key: 1, query: -1}:
        return None
    return tuple(neg_term(t) for t in e.const)


def _window(p: Pred, leaf: Leaf, sc: Score) -> tuple | None:
    """``start(b, t) <= s < end(b, t)`` with per-row integer tensors: ((start terms), (end terms)) or None."""
    n = len(leaf.labels)
    starts, ends = [], []
    for e in p.leq_zero:
        if len(e.tensors) != 1 or any(d < -n for d, _ in e.coef):
            return None
        coefs = {leaf.labels[n + d]: v for d, v in e.coef}
        sign, node, dims = e.tensors[0]
        labels = tuple(leaf.labels[n + d] for d in dims)
        if set(labels) - {sc.query, None, *sc.batch_all} or coefs not in ({sc.key: -1}, {sc.key: 1}):
            return None
        row = Leaf(node, labels)
        if coefs[sc.key] == -1 and sign == 1:  # -s + X + c <= 0  <=>  s >= X + c
            starts.append((row, e.const))
        elif coefs[sc.key] == 1 and sign == -1:  # s - X + c <= 0  <=>  s < X - c + 1
            ends.append((row, tuple(neg_term(t) for t in e.const) + (1,)))
        else:
            return None
    if len(starts) > 1 or len(ends) > 1 or not (starts or ends):
        return None
    return (starts[0] if starts else None), (ends[0] if ends else None)


def plan(sc: Score) -> MaskPlan:
    out = MaskPlan(fill=NEG_INF if sc.fill is None else sc.fill)
    for leaf in sc.keep:
        p = visible_where(leaf)
        terms = _causal_offset(p, leaf, sc) if p is not None else None
        window = _window(p, leaf, sc) if p is not None and terms is None else None
        if terms is not None and not out.causal:
            out.causal, out.offset_terms = True, terms
            out.kinds.append("causal")
        elif window is not None and out.window_start is None and out.window_end is None:
            out.window_start, out.window_end = window
            out.kinds.append("window")
        elif (split := split_keep(leaf, sc, causal_taken=out.causal)) is not None:
            terms, keys = split
            if terms is not None:
                out.causal, out.offset_terms = True, terms
                out.kinds.append("causal")
            out.keep.extend(keys)
            out.kinds.extend(["key mask"] * bool(keys))
        else:
            out.keep.append(leaf)
            out.kinds.append("bool mask tensor")
    for leaf in sc.bias:
        p = additive_visible_where(leaf)
        terms = _causal_offset(p, leaf, sc) if p is not None else None
        if terms is not None and not out.causal:
            out.causal, out.causal_additive, out.offset_terms = True, True, terms
            out.kinds.append("causal (additive)")
        else:
            out.bias.append(leaf)
            out.kinds.append("additive mask tensor")
    if sc.fill is not None and sc.fill != NEG_INF:
        out.notes.append(f"masked picks carry the model's fill value {sc.fill}")
    return out


# ---------------------------------------------------------------------------------------------
# a bool mask that is causal AND per-key masks


def split_keep(leaf: Leaf, sc: Score, causal_taken: bool) -> tuple[tuple | None, list[Leaf]] | None:
    """``(causal offset terms or None, key masks)`` where the visible-positions tensor of ``leaf`` is provably the
    AND of at most one causal rule ``s <= t + c`` and bool tensors that vary only over the batch and key dims (HF's
    ``causal & padding``); None where it is anything else (the mask is then passed whole, as before).

    Each key mask is a Leaf with no query label: ``MaskPlan.emit`` lays it out [batch, 1, S], so the op reads it per
    key, broadcast over the queries. Every value of the mask is that AND exactly: the walk goes through out-of-place
    ``&`` of bool tensors, views that keep every value (size-1 dims added, dropped or broadcast, a bool ``to``) and
    constant True tensors only, none of them written in place anywhere in the graph (the op reads the conjuncts
    where the selection runs, the model read the mask where it was made).
    """
    visible = peel_not(leaf) or leaf
    if visible.negate or dtype(visible.node) != torch.bool:
        return None  # masked_fill(hidden, ...) with hidden not a ~: a disjunction of hidden parts, not split
    terms = conjuncts(visible.node, visible.labels)
    if terms is None or len(terms) < 2:
        return None  # one term: the mask as it is (a key mask is passed per key already, see emit)
    free = {*sc.batch_all, sc.key}
    causal, keys = None, []
    for node, labels in terms:
        present = {lab for lab in labels if lab is not None}
        if present <= free:
            keys.append(Leaf(node, labels))
            continue
        p = visible_where(Leaf(node, labels))
        offset = causal_offset(p, labels, sc.key, sc.query) if p is not None else None
        if offset is None or causal is not None or causal_taken:
            return None
        causal = offset
    if causal is None and not keys:
        return None
    return causal, keys


def conjuncts(node: fx.Node, labels: tuple) -> list[tuple[fx.Node, tuple]] | None:
    """The bool tensors whose AND ``node`` is, each with the labels of its dims (right-aligned broadcasting), or
    None where ``node`` is not read that way (see ``split_keep``). Constant True tensors are dropped."""
    out: list[tuple[fx.Node, tuple]] = []
    seen: dict[fx.Node, tuple] = {}
    ok = _conjuncts(node, labels, out, seen)
    return out if ok else None


def _conjuncts(node, labels: tuple, out: list, seen: dict) -> bool:
    if not isinstance(node, fx.Node) or dtype(node) != torch.bool or written_in_place(node):
        return False
    if node in seen:
        return seen[node] == labels  # one tensor read in two roles is not a conjunct of one kind
    seen[node] = labels
    name, inplace = mask_op(node)
    if inplace:
        return False
    if name in CONSTANT_TENSORS:
        fill = constant_fill(node)  # of a bool tensor: True where nonzero
        return fill is not None and bool(fill)
    if name == "and":
        operands = node.args[:2]
        if len(operands) != 2 or node.kwargs or not all(isinstance(a, fx.Node) for a in operands):
            return False
        inner = [operand_labels(labels, a) for a in operands]
        return all(lab is not None and _conjuncts(a, lab, out, seen) for a, lab in zip(operands, inner))
    if name in VALUE_VIEWS and node.args and isinstance(node.args[0], fx.Node):
        inner = _view_input_labels(node, labels)
        if inner is not None:
            return _conjuncts(node.args[0], inner, out, seen)
    if _written_after(node):
        return False
    out.append((node, labels))
    return True


def _written_after(node: fx.Node) -> bool:
    """Whether a call after ``node`` may write its memory through any alias (``pad[:, 1:]`` is written by
    ``pad.fill_(...)``): the model read the term at its ``&``, the op would read it where the top-k stands."""
    written = writes_after(node)
    if written is None:
        return True
    aliases = Aliases(node.graph)
    return any(aliases.may_alias(t, node) for t in written)


def _view_input_labels(node: fx.Node, labels: tuple) -> tuple | None:
    """Labels of a bool view's input where the view keeps every value of a bool input, else None."""
    if dtype(node.args[0]) != torch.bool:  # a ``to`` into bool is a test of its own (nonzero), not a view
        return None
    try:
        return view_input_labels(node, labels)
    except Reject:
        return None
