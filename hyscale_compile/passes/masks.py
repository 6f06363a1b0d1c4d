"""Map the masks of a score to the cheapest kind the operator has that is provably equal.

A mask the model builds from positions (``arange(S)[None] <= arange(T)[:, None] + off``,
``full(-inf).triu(1)``, ``ones(bool).tril()``) becomes the causal kind with that offset: the kernel
computes it from indices and no mask tensor is read. A triangle of -inf *added* to the score stays
additive (``causal_additive``): behind it a NaN or +inf score is NaN, as in eager, where a replacing
mask (``masked_fill``, ``where``, a bool mask) gives the fill. Row windows built from per-row tensors
(``arange(S) >= ks[:, None]``) become ``starts``/``ends``. Any other mask is passed as a tensor,
read tile by tile: always correct, only less cheap.

Positions are handled as small affine forms over the mask's dimensions (counted from the right,
as broadcasting aligns them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .graph_ops import dtype, is_one, is_tensor, named_arg, op_name, shape, value, written_in_place
from .index_expr import Leaf, Score

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# affine positions and predicates


@dataclass(frozen=True)
class Affine:
    """sum(coef[d] * index along dim d) + sum(const) + sum(tensor terms); dims counted from the right (-1, -2…)."""

    coef: tuple[tuple[int, int], ...] = ()
    const: tuple = ()  # ints and SymInt-valued fx.Nodes
    tensors: tuple[tuple[int, fx.Node, tuple[int, ...]], ...] = ()  # (sign, node, its dims from the right)

    def c(self, d: int) -> int:
        return dict(self.coef).get(d, 0)

    def __add__(self, other: Affine) -> Affine:
        coef = dict(self.coef)
        for d, v in other.coef:
            coef[d] = coef.get(d, 0) + v
        return Affine(tuple(sorted((d, v) for d, v in coef.items() if v)), self.const + other.const,
                      self.tensors + other.tensors)

    def neg(self) -> Affine:
        return Affine(tuple((d, -v) for d, v in self.coef), tuple(_neg_term(t) for t in self.const),
                      tuple((-s, n, dims) for s, n, dims in self.tensors))

    def moved(self, mapping: dict[int, int | None]) -> Affine:
        if any(mapping[d] is None for d, _ in self.coef) or any(
                mapping[d] is None for _, _, dims in self.tensors for d in dims):
            raise _Unknown  # the value varies along a dim an integer index removed
        return Affine(tuple(sorted((mapping[d], v) for d, v in self.coef)), self.const,
                      tuple((s, n, tuple(mapping[d] for d in dims)) for s, n, dims in self.tensors))


@dataclass(frozen=True)
class _Neg:
    term: object


def _neg_term(t):
    if isinstance(t, int):
        return -t
    return t.term if isinstance(t, _Neg) else _Neg(t)


@dataclass(frozen=True)
class Pred:
    """A conjunction of ``expr <= 0`` (visible where all hold)."""

    leq_zero: tuple[Affine, ...]


class _Unknown(Exception):
    pass


def _affine_or_pred(node) -> Affine | Pred:
    """The positions or predicate ``node`` computes, read from how it is produced. Integer arithmetic is
    exact only in int64 (as Python ints are); anything written in place after it was made is unknown."""
    if isinstance(node, int) and not isinstance(node, bool):
        return Affine(const=(node,))
    if isinstance(node, fx.Node) and isinstance(value(node), torch.SymInt):
        return Affine(const=(node,))
    if not isinstance(node, fx.Node) or written_in_place(node):
        raise _Unknown
    name = op_name(node)
    if name in ("arange", "add", "sub", "mul") and dtype(node) != torch.int64:
        raise _Unknown  # positions in a narrower int or a float dtype round or wrap where ints do not
    if name == "arange":
        return _arange(node)
    if name in ("getitem", "unsqueeze", "reshape"):
        return _reindex(node)
    if name == "expand":  # broadcasting to a larger shape keeps every position's value
        return _affine_or_pred(node.args[0])
    if name in ("add", "sub"):
        if named_arg(node, "alpha", 1) != 1:
            raise _Unknown
        a, b = (_affine(x) for x in (node.args[0], node.args[1]))
        return a + (b.neg() if name == "sub" else b)
    if name == "mul":
        a, b = node.args[0], node.args[1]
        if isinstance(b, int):
            a, b = b, a
        if not isinstance(a, int) or isinstance(a, bool):
            raise _Unknown
        x = _affine(b)
        if x.tensors or any(not isinstance(t, int) for t in x.const):
            raise _Unknown
        return Affine(tuple((d, v * a) for d, v in x.coef if v * a), tuple(t * a for t in x.const))
    if name in ("le", "lt", "ge", "gt"):
        a, b = (_affine(x) for x in (node.args[0], node.args[1]))
        if name in ("ge", "gt"):
            a, b = b, a
        e = a + b.neg()  # a <= b  <=>  a - b <= 0 ; a < b  <=>  a - b + 1 <= 0
        return Pred((e + Affine(const=(1,)),) if name in ("lt", "gt") else (e,))
    if name == "and":
        a, b = (_affine_or_pred(x) for x in (node.args[0], node.args[1]))
        if not (isinstance(a, Pred) and isinstance(b, Pred)):
            raise _Unknown
        return Pred(a.leq_zero + b.leq_zero)
    if name == "invert":
        p = _affine_or_pred(node.args[0])
        if not isinstance(p, Pred) or len(p.leq_zero) != 1:
            raise _Unknown
        return Pred((p.leq_zero[0].neg() + Affine(const=(1,)),))  # not(e <= 0)  <=>  -e + 1 <= 0
    if name in ("triu", "tril"):
        return _triangle(node)
    if is_tensor(node) and dtype(node) in (torch.int32, torch.int64):  # narrower ints could wrap around
        dims = tuple(range(-len(shape(node)), 0))
        return Affine(tensors=((1, node, dims),))
    raise _Unknown


def _affine(node) -> Affine:
    x = _affine_or_pred(node)
    if not isinstance(x, Affine):
        raise _Unknown
    return x


def _arange(node: fx.Node) -> Affine:
    args = list(node.args)
    if len(args) == 1 and not node.kwargs.get("start") and node.kwargs.get("step", 1) == 1:
        return Affine(coef=((-1, 1),))
    if len(args) == 2 and node.kwargs.get("step", 1) == 1 and _integer(args[0]):
        return Affine(coef=((-1, 1),), const=(args[0],) if args[0] != 0 else ())
    raise _Unknown


def _integer(x) -> bool:
    """A Python int or a node holding a SymInt (a float start would make float positions)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, fx.Node) and isinstance(value(x), torch.SymInt))


def _reindex(node: fx.Node) -> Affine | Pred:
    src = node.args[0]
    old_nd, new_nd = len(shape(src)), len(shape(node))
    if op_name(node) == "unsqueeze":
        d = named_arg(node, "dim")
        d = d + new_nd if d < 0 else d
        keep = [i for i in range(new_nd) if i != d]
    elif op_name(node) == "reshape":  # only moves of size-1 dims: e.g. arange(n).view(1, 1, -1)
        real_in = [i for i, d in enumerate(shape(src)) if not is_one(d)]
        real_out = [j for j, d in enumerate(shape(node)) if not is_one(d)]
        if len(real_in) != len(real_out) or any(shape(src)[i] != shape(node)[j] for i, j in zip(real_in, real_out)):
            raise _Unknown
        keep = [None] * old_nd
        for i, j in zip(real_in, real_out):
            keep[i] = j
    else:
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        keep, pos = [], 0
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        for item in idx:
            if item is None:
                pos += 1
            elif item is Ellipsis:
                for _ in range(old_nd - n_real):
                    keep.append(pos)
                    pos += 1
            elif item == slice(None):
                keep.append(pos)
                pos += 1
            elif isinstance(item, int) and not isinstance(item, bool):
                keep.append(None)  # an integer index drops the dim: fine if the value does not vary along it
            else:
                raise _Unknown
        while len(keep) < old_nd:
            keep.append(pos)
            pos += 1
    mapping = {i - old_nd: (None if j is None else j - new_nd) for i, j in enumerate(keep)}
    x = _affine_or_pred(src)
    if isinstance(x, Pred):
        return Pred(tuple(e.moved(mapping) for e in x.leq_zero))
    return x.moved(mapping)


# Constant tensors a triangle is cut from: only their shape comes from elsewhere (``full_like(score, -inf)``).
_CONSTANT_BASES = ("ones", "full", "ones_like", "full_like", "new_ones", "new_full")


def _triangle(node: fx.Node) -> Pred:
    """ones/full(...).triu(d) as a predicate on where it is *nonzero*: col - row >= d (triu), <= d (tril)."""
    base = node.args[0]
    if op_name(base) not in _CONSTANT_BASES or written_in_place(node) or written_in_place(base):
        raise _Unknown
    if _fill_value(base) in (0, False, None):
        raise _Unknown
    d = _affine(named_arg(node, "diagonal", 0) or 0)  # an int or a symbolic size expression
    if d.coef or d.tensors:
        raise _Unknown
    col_minus_row = Affine(coef=((-2, -1), (-1, 1)))
    if op_name(node) == "triu":  # d - (col - row) <= 0
        return Pred((col_minus_row.neg() + d,))
    return Pred((col_minus_row + d.neg(),))  # col - row - d <= 0


def _fill_value(node: fx.Node):
    base = node
    while op_name(base) in ("triu", "tril"):
        base = base.args[0]
    if written_in_place(base):
        return None
    if op_name(base) in ("full", "full_like", "new_full"):
        v = named_arg(base, "fill_value")
        return v if isinstance(v, (int, float)) else None
    if op_name(base) in ("ones", "ones_like", "new_ones"):
        return 1
    return None


def peel_not(leaf: Leaf) -> Leaf | None:
    """``masked_fill(~visible, ...)``: the bool tensor of *visible* positions under the not, or None (the
    not of an integer tensor is no bool tensor of its own: ``logical_not(int_mask)``)."""
    if leaf.negate and op_name(leaf.node) == "invert" and dtype(leaf.node.args[0]) == torch.bool:
        return Leaf(leaf.node.args[0], leaf.labels)
    return None


def visible_where(leaf: Leaf) -> Pred | None:
    """The visibility a bool mask leaf expresses as a position predicate, if it has that form."""
    leaf = peel_not(leaf) or leaf
    try:
        p = _affine_or_pred(leaf.node)
    except (_Unknown, TypeError, KeyError, IndexError, AttributeError):
        return None
    if not isinstance(p, Pred):
        return None
    if leaf.negate:
        if len(p.leq_zero) != 1:
            return None
        return Pred((p.leq_zero[0].neg() + Affine(const=(1,)),))
    return p


def additive_visible_where(leaf: Leaf) -> Pred | None:
    """``full(-inf).triu(d)``-style additive masks: -inf where the triangle holds, 0 elsewhere."""
    node = leaf.node
    if leaf.negate or op_name(node) not in ("triu", "tril") or _fill_value(node) != NEG_INF:
        return None
    try:
        p = _triangle(node)
    except _Unknown:
        return None
    return Pred((p.leq_zero[0].neg() + Affine(const=(1,)),))


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
        if isinstance(t, _Neg):
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
    return tuple(_neg_term(t) for t in e.const)


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
            ends.append((row, tuple(_neg_term(t) for t in e.const) + (1,)))
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
