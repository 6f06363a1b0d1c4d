"""Step 2 of the attention pass: what the mask means, and whether the op computes the same attention.

The mask the attention reads is an expression over two kinds of inputs: the index mask (a constant written at
the picks into another constant: a function of P = "key s is one of row (b, t)'s picks") and the model's own
masks (causal, padding, ...: the *partner*, boolean tensors V1, V2, ... that do not depend on the picks). The
pass evaluates the expression on every combination of P and the V's, as PyTorch would (the dtype's rounding
included: ``finfo.min + finfo.min`` is ``-inf`` in float32), instead of matching spellings:

* a boolean mask (SDPA) must be ``P and V1 and V2 ...``: visible exactly where picked and visible;
* an additive mask (SDPA with a float mask, eager ``scores + mask``) must add 0 there, and a value that hides
  the key (``-inf`` or a huge negative such as ``finfo.min``) everywhere else.

What a row with no visible pick gives follows from the same evaluation: SDPA gives 0 under a boolean or ``-inf``
mask (``empty="zero"``); a softmax over scores that a ``finfo.min`` absorbed is the mean of v over all keys
(``empty="mean"``); an eager softmax over ``-inf`` gives NaN, which the op does not reproduce, so that is
rejected unless no row can be empty.

The partner masks are split into conjunctions and mapped to what the op has: a position predicate
``s <= t + c`` is the causal kind (``positions.visible_where``); a tensor that varies only over batch and key is
the [B, S] key mask (padding); anything else over (batch, query, key) is read at the picks, so the op sees it
as picks dropped from the indices. A mask that differs between heads cannot be expressed (one set of picks is
shared by the heads of a query).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import fx

from . import masks, positions
from .attention_sites import CONSTANT_TENSORS, MASK_ARITHMETIC, VIEWS, Site, constant_fill, differ, mask_op
from .dim_labels import VALUE_VIEWS, operand_labels, view_input_labels
from .graph_ops import arg, dtype, is_one, op_name, same_size, shape, source_line
from .index_expr import Leaf, Reject
from .legality import requires_grad
from .regions import region_input
from .report import input_name
from .sites import describe

DIMS = ("b", "h", "t", "s")  # the attention's [B, H, T, S]
_MAX_PARTNERS = 4
_MAX_READINGS = 64  # ways to read the partner masks (_polarities) tried at most

# Which fills hide a key exactly. The op gives a hidden key no weight at all; the model's softmax (in fp32, or on
# its 16-bit input upcast to fp32) gives it exp(x_h - m) / sum, with m the row's largest logit and x_h the hidden
# key's: the fill c itself where the mask replaces the score (masked_fill, where), fl(s_h + c) where it is added
# (``scores + mask``, SDPA's float mask), fl the rounding to the dtype dt the fill is written in (the softmax
# input, SDPA's mask). exp(y) is exactly 0 in fp32 for y < -103.98 (below half the smallest subnormal, 2^-150),
# and fp32 subtraction and the rounding to dt are monotone. Let the row have a visible key (an empty row is
# ``_empty_rule``'s) and its logits s be finite:
#
# * c = -inf: x_h = -inf (replaced, or -inf + finite s), exp(-inf - m) = 0 for any finite m. Exact.
# * c = finfo(dt).min = -M and every |s| <= M / 4 (fp32 and bf16: 8.5e37, fp16: 16376): m >= -M / 4, and
#   replaced x_h = -M, added x_h = fl(s_h - M) <= fl(-3M / 4) ~ -3M / 4, so x_h - m <= -M / 2 + rounding, far below
#   -104 (M >= 65504). Exact; past that bound (logits a quarter of the way to overflow) eager's own softmax can
#   let a hidden key through, as it can for NaN or inf scores (the README's differences by design).
# * any other finite c (BERT's -1e4, -1e9, -1e30): x_h - m = c - m > -104 as soon as a visible logit is below
#   c + 104 (-1e4: a logit of -9900), and the hidden key gets weight in eager; such logits are ordinary, so these
#   are rejected with a reason (use -inf or finfo.min).
#
# A row with nothing visible is a softmax over the hidden logits alone: the mean of v over all keys exactly when
# they are all equal, i.e. when the fill replaced every score or absorbed it: fl(s - M) = -M for |s| < ulp(M) / 2
# (fp32: 2^103 ~ 1e31, bf16: 2^119 ~ 6.6e35, the bound for such rows; fp16: 16, so an added fp16 finfo.min is not
# taken to absorb the score).
_ABSORBING = (torch.float32, torch.bfloat16)


def hides(c: torch.Tensor) -> bool:
    """A fill that hides a key exactly (above): -inf, or finfo(dtype).min of the dtype it is written in."""
    f = float(c)
    return f == float("-inf") or (c.dtype.is_floating_point and f == float(torch.finfo(c.dtype).min))


@dataclass(frozen=True)
class Score:
    """The attention score plus a constant (eager: ``q.k^T * scale + c``)."""

    c: torch.Tensor


@dataclass
class Term:
    node: fx.Node
    labels: tuple


@dataclass
class MaskPlan:
    empty: str = "zero"
    # empty="mean" behind a fill *added* to the scores: the model's autograd sends an empty row's q and k a
    # gradient (lowering.attention_rows), which the op alone does not
    eager_empty_grad: bool = False
    causal: bool = False
    offset_terms: tuple = ()
    nodes: list[fx.Node] = field(default_factory=list)  # the mask expression: what the evaluation read
    key_terms: list[Term] = field(default_factory=list)  # [B, S] (padding)
    pick_terms: list[Term] = field(default_factory=list)  # read at the picks
    kinds: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return " + ".join(self.kinds) or "none"


def _labels_for(out_labels: tuple, x) -> tuple:
    """Labels of operand ``x`` of an elementwise op (right-aligned broadcasting; size-1 dims are None); () for a
    number."""
    if shape(x) is None:
        return ()
    labels = operand_labels(out_labels, x)
    if labels is None:
        raise Reject("a mask operand has more dims than the attention scores")
    return labels


class _Expr:
    """The mask expression from the attention back to the scatter, the partner masks and the scores."""

    def __init__(self, site: Site):
        self.site = site
        att = site.attention
        self.root = att.mask
        self.labels: dict[fx.Node, tuple] = {}
        self.partners: list[Term] = []
        self.triangles: dict[fx.Node, positions.Pred] = {}  # additive partners: 0 where visible, -inf elsewhere
        self.consts: dict[fx.Node, object] = {}
        root_shape = shape(self.root)
        if root_shape is None or len(root_shape) > 4:
            raise Reject("the attention mask is not a tensor of at most 4 dims", site.scatter)
        sq, sk = shape(att.q), shape(att.k)
        scores = (sq[0], sq[1], sq[2], sk[2])[4 - len(root_shape):]
        if not all(is_one(d) or same_size(d, n) for d, n in zip(root_shape, scores)):
            raise Reject("the attention mask has a dim larger than the scores' (it broadcasts the output)",
                         site.scatter)
        self._visit(self.root, _labels_for(DIMS, self.root))

    def _visit(self, node: fx.Node, labels: tuple) -> None:
        site = self.site
        old = self.labels.get(node)
        if old is not None:
            if old != labels:
                raise Reject(f"the mask {node.name} is read with its dims in two different roles", site.scatter)
            return
        self.labels[node] = labels
        if node is site.scatter:
            self._check_scatter_labels(labels)
            return
        if node is site.attention.logits:
            return
        if node not in site.chain:
            self._leaf(node, labels)
            return
        name, _ = mask_op(node)
        if name in VIEWS or name in ("to", "float"):
            self._visit(node.args[0], view_input_labels(node, labels))
            return
        for a in node.all_input_nodes:
            self._visit(a, _labels_for(labels, a))

    def _leaf(self, node: fx.Node, labels: tuple) -> None:
        """A tensor not built from the scatter: a constant, or a boolean partner mask, or float arithmetic over
        those (``where(visible, 0, finfo.min)``)."""
        if constant_fill(node) is not None and op_name(node) in CONSTANT_TENSORS:
            self.consts[node] = constant_fill(node)
            return
        if dtype(node) == torch.bool:
            self.partners.append(Term(node, labels))
            return
        triangle = positions.additive_visible_where(Leaf(node, labels))
        if triangle is not None:  # full(-inf).triu(d): 0 where visible, -inf elsewhere
            self.partners.append(Term(node, labels))
            self.triangles[node] = triangle
            return
        name, inplace = mask_op(node)
        if name in ("where", "masked_fill", "add", "sub", "to", "float", "invert") or name in VIEWS or \
                name in MASK_ARITHMETIC:
            if inplace:
                raise Reject(f"the model's mask is updated in place ({node.name})", self.site.scatter)
            if name in VIEWS or name in ("to", "float"):
                self._visit(node.args[0], view_input_labels(node, labels))
            else:
                for a in node.all_input_nodes:
                    self._visit(a, _labels_for(labels, a))
            return
        raise Reject(_unreadable(node), self.site.scatter)

    def _check_scatter_labels(self, labels: tuple) -> None:
        if len(labels) < 2 or labels[-1] != "s" or labels[-2] not in ("t", None) or any(
                lab not in ("b", None) for lab in labels[:-2]):
            raise Reject("the index mask's dims do not land on the attention's (batch, query, key) dims",
                         self.site.scatter)

    # -- evaluation ------------------------------------------------------------------------------

    def evaluate(self, picked: bool, partners: dict[fx.Node, bool]):
        memo: dict[fx.Node, object] = {}
        return self._ev(self.root, picked, partners, memo)

    def _ev(self, node, picked, partners, memo):
        if not isinstance(node, fx.Node):
            return node
        if node in memo:
            return memo[node]
        memo[node] = out = self._ev_node(node, picked, partners, memo)
        logits = dtype(self.site.attention.logits)
        if isinstance(out, Score) and out.c.dtype not in (logits, torch.float32):
            # the op computes the scores in the product's dtype (or float32) and never rounds them to another
            raise Reject(f"the mask arithmetic rounds the attention scores ({logits}) to {out.c.dtype} "
                         f"({describe(node)} at {source_line(node)}) before the softmax, which the op does not",
                         self.site.scatter)
        return out

    def _ev_node(self, node: fx.Node, picked, partners, memo):
        site = self.site
        dt = dtype(node)
        if node is site.scatter:
            return _cast(site.picked if picked else site.fill, dt)
        if node is site.attention.logits:
            return Score(torch.zeros((), dtype=dt))
        if node in partners:
            if node in self.triangles:
                return _cast(0.0 if partners[node] else float("-inf"), dt)
            return partners[node]
        if node in self.consts:
            return _cast(self.consts[node], dt)
        name, _ = mask_op(node)
        ev = lambda x: self._ev(x, picked, partners, memo)  # noqa: E731
        if name in VIEWS:
            return ev(node.args[0])
        if name in ("to", "float"):
            return _cast(ev(node.args[0]), dt)
        if name == "invert":
            x = ev(node.args[0])
            if not isinstance(x, bool):
                raise Reject(f"~ of a non-boolean mask ({node.name})", site.scatter)
            return not x
        if name in ("and", "or"):
            a, b = ev(node.args[0]), ev(node.args[1])
            if not (isinstance(a, bool) and isinstance(b, bool)):
                raise Reject(f"& or | of non-boolean masks ({node.name})", site.scatter)
            return (a and b) if name == "and" else (a or b)
        if name == "masked_fill":
            cond = ev(arg(node, 1, "mask"))
            if not isinstance(cond, bool):
                raise Reject(f"masked_fill with a non-boolean mask ({node.name})", site.scatter)
            fill = _number(ev(arg(node, 2, "value")))
            if fill is None:
                raise Reject(f"masked_fill with a fill that is not a constant ({node.name})", site.scatter)
            return _cast(fill, dt) if cond else _cast(ev(node.args[0]), dt)
        if name == "where":
            cond = ev(arg(node, 0, "condition"))
            if not isinstance(cond, bool):
                raise Reject(f"where with a non-boolean condition ({node.name})", site.scatter)
            return _cast(ev(arg(node, 1, "input") if cond else arg(node, 2, "other")), dt)
        if name in ("add", "sub"):
            if arg(node, 2, "alpha", 1) != 1:
                raise Reject(f"add / sub with alpha in the mask ({node.name})", site.scatter)
            a, b = ev(node.args[0]), ev(node.args[1])
            return _add(a, b, name == "sub", dt, node, site.scatter)
        if name in MASK_ARITHMETIC:
            operands = node.args[:1 if name == "neg" else 2]
            return _arithmetic(name, [ev(x) for x in operands], operands, dt, node, site.scatter)
        raise Reject(f"the mask goes through {describe(node)} ({node.name}), which the pass does not read",
                     site.scatter)


def _unreadable(node: fx.Node) -> str:
    """Why a float operand of the mask is none the pass reads: a scalar is a fill or offset whose value is not
    known when the graph is compiled; anything larger is a bias the op has no input for."""
    src = node.args[0] if node.op == "call_method" and node.target == "item" and node.args else None
    if isinstance(src, fx.Node) and src.op == "placeholder":
        return (f"the mask's fill value is the graph input `{input_name(src)}`: a Python number Dynamo lifted to an "
                "input (floats are under dynamic=True), whose value is not known when the graph is compiled, so "
                "whether it hides a key cannot be checked; write the constant in the model (torch.finfo(dtype).min, "
                "float('-inf')) or compile without dynamic=True")
    if region_input(node):
        return (f"the attention mask adds `{node.target}`, a float tensor given to the checkpointed region the "
                "attention is in, which the pass does not follow out of the region to read it as visible / hidden "
                "(it follows only the indices): build the mask inside the region, or use SDPA attention "
                "(attn_implementation='sdpa'), whose boolean mask the pass reads at the picks")
    what = f"the graph input `{input_name(node)}`" if node.op == "placeholder" else \
        f"{describe(node)} ({node.name}, at {source_line(node)})"
    if shape(node) == ():
        when = "which may change from call to call" if node.op == "placeholder" else "computed when the model runs"
        return (f"the mask's fill value is {what}, {when}: whether it hides a key exactly cannot be checked (use "
                "-inf or torch.finfo(dtype).min)")
    return (f"the attention mask adds {what}, a float tensor the pass cannot read as visible / hidden (e.g. a "
            "learned bias): the op has no bias input")


def _number(x) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return float(x)
    return None


def _cast(x, dt):
    """A value as the tensor of dtype ``dt`` holds it (bool, a 0-d tensor, or the score plus a 0-d tensor)."""
    if isinstance(x, Score):
        return Score(x.c.to(dt)) if dt is not None and dt.is_floating_point else x
    if dt == torch.bool:
        if isinstance(x, torch.Tensor):
            return bool(x != 0)
        return bool(x)
    if dt is None:
        return x
    return torch.tensor(x, dtype=dt) if not isinstance(x, torch.Tensor) else x.to(dt)


_COMPUTE = {"mul": torch.mul, "neg": torch.neg, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
            "gt": torch.gt, "ge": torch.ge}


def _arithmetic(name: str, args: list, operands: tuple, dt, node: fx.Node, scatter: fx.Node):
    """A product, negation or comparison of mask values, computed as the model computes it: the same kernel on
    operands of the model's dtypes and kind (a tensor with dims, a 0-d tensor, a Python number), so the same
    promotion and rounding. The evaluation holds every value as a 0-d tensor, but torch promotes a 0-d tensor
    against a tensor with dims by category only: ``keep.half() <= torch.tensor(0.9999)`` compares in float16, where
    0.9999 is 1.0 (True at kept keys too), while two 0-d tensors compare in float32. So operands the model has with
    dims are computed with one dim. The scores are never an operand: scaling or comparing them is no mask."""
    if any(isinstance(x, Score) for x in args):
        raise Reject(f"the mask arithmetic ({node.name}: {name}) {'scales' if name in ('mul', 'neg') else 'compares'} "
                     "the scores themselves", scatter)
    # a tensor operand (a boolean mask evaluates to a bool) as a tensor: 0-d where the model's is, else of one dim
    values = [(torch.tensor(x) if isinstance(x, bool) else x).reshape(() if shape(a) == () else (1,))
              if isinstance(a, fx.Node) else x for x, a in zip(args, operands)]
    if not any(isinstance(x, torch.Tensor) for x in values):
        raise Reject(f"the mask arithmetic ({node.name}) has no tensor operand", scatter)
    return _cast(_COMPUTE[name](*values).reshape(()), dt)


def _add(a, b, subtract: bool, dt, node: fx.Node, scatter: fx.Node):
    sa, sb = isinstance(a, Score), isinstance(b, Score)
    if sa and sb or sb and subtract:
        raise Reject(f"the mask arithmetic ({node.name}) adds the scores twice or subtracts them", scatter)
    ca = a.c if sa else _cast(a, dt)
    cb = b.c if sb else _cast(b, dt)
    c = (ca.to(dt) - cb.to(dt)) if subtract else (ca.to(dt) + cb.to(dt))
    return Score(c) if sa or sb else c


# ---------------------------------------------------------------------------------------------


def plan(site: Site) -> MaskPlan:
    _check_scatter_shape(site)
    expr = _Expr(site)
    found = list({id(t.node): t for t in expr.partners}.values())
    if len(found) > _MAX_PARTNERS:
        raise Reject(f"the attention mask combines {len(found)} masks with the index mask", site.scatter)
    for reading in _polarities(expr, found):
        partners, through = reading
        table = _table(site, expr, partners)
        try:
            additive = _check_table(site, table)
        except Reject as err:
            error = err
            continue
        break
    else:
        raise error
    # what the evaluation read (the masks, and the operators between them and the model's mask, whose values it
    # computed from them): checked for writes after they are made, like the rest of the mask
    for t in partners + through:
        expr.labels.setdefault(t.node, t.labels)
    out = MaskPlan(nodes=list(expr.labels))
    for t in partners:
        if t.node in expr.triangles:
            _triangle(site, expr.triangles[t.node], t.labels, out)
        else:
            _split(site, t.node, t.labels, out)
    # With the model's own mask in play a row may have no visible pick; without it every row keeps its k picks.
    _empty_rule(site, table, additive, rows_can_be_empty=bool(partners), out=out)
    if out.pick_terms:
        out.notes.append("the model's mask varies over queries and keys in a way that is not a position rule: it is "
                         "read at the picks only, and picks it hides are dropped")
    return out


def _table(site: Site, expr: _Expr, partners: list[Term]) -> dict:
    """The mask's value for every combination of picked and the partners' values."""
    table = {}
    for picked, *vs in itertools.product((False, True), repeat=len(partners) + 1):
        env = {t.node: v for t, v in zip(partners, vs)}
        v = expr.evaluate(picked, env)
        if site.attention.kind == "sdpa" and isinstance(v, torch.Tensor):
            v = v.to(site.attention.dtype)  # SDPA adds its float mask in its dtype (autocast casts the mask too)
        table[(picked, *vs)] = v
    return table


def _polarities(expr: _Expr, found: list[Term]):
    """(the partner masks to evaluate the mask over, the operators read through to them): the masks as found, or
    a boolean combination of masks (``~causal``, ``~causal | ~pad``) read through its ``~``, ``&`` and ``|`` down
    to the masks it combines.
    ``~(~causal | hidden)`` (De Morgan's spelling of ``causal & ~hidden``) hides a key exactly where ``~causal``
    is True: as a function of ``~causal`` it is never "picked and visible", but as a function of ``causal`` it is.
    Every choice evaluates the same expression exactly (the operators are evaluated as written), so any choice
    whose table checks out is a proof. The combinations are read through first, where the model's masks are then
    position rules or key masks the op has an argument for; then as found (``~causal & ~hidden`` keeps the keys
    after the diagonal: ``~causal`` is the mask, read at the picks). Duplicates are merged."""
    options = [_readings(t) for t in found]
    for choice in itertools.islice(itertools.product(*options), _MAX_READINGS):
        atoms = [t for reading, _ in choice for t in reading]
        through = [t for _, nodes in choice for t in nodes]
        terms = _merged(atoms, expr.labels)
        if terms is None or _merged(terms + through, expr.labels) is None or len(terms) > _MAX_PARTNERS or \
                terms == found:
            continue
        yield terms, through
    yield found, []  # last: where no reading proves the mask, the reason describes the masks as the model wrote them


def _readings(t: Term) -> list[tuple[list[Term], list[Term]]]:
    """The ways to read a partner mask, each (the masks read, the operators read through): through its boolean
    operators down to at most 8, ..., 1 levels (``~(causal & pad)``: as ``causal``, ``pad``, where ``pad`` is
    itself ``a | b``)."""
    out = []
    for levels in range(8, 0, -1):
        through: list[Term] = []
        atoms = _atoms(t.node, t.labels, levels, through)
        if atoms is not None and [a.node for a in atoms] != [t.node] and \
                all([a.node for a in atoms] != [o.node for o in other] for other, _ in out):
            out.append((atoms, through))
    return out


def _atoms(node: fx.Node, labels: tuple, levels: int, through: list[Term]) -> list[Term] | None:
    """The boolean masks an out-of-place ``~`` / ``&`` / ``|`` combination of boolean tensors reads, ``levels``
    operators deep ([node] where it is none), each with its dims' labels; None where the combination reads
    something else. The operators read through are appended to ``through``."""
    name, inplace = mask_op(node)
    if inplace or name not in ("invert", "and", "or") or levels == 0:
        return [Term(node, labels)]
    through.append(Term(node, labels))
    out = []
    for a in node.args[:1] if name == "invert" else node.args[:2]:
        if isinstance(a, bool):
            continue
        if not isinstance(a, fx.Node) or dtype(a) != torch.bool:
            return None
        inner = _atoms(a, _labels_for(labels, a), levels - 1, through)
        if inner is None:
            return None
        out.extend(inner)
    return out


def _merged(terms: list[Term], labels: dict) -> list[Term] | None:
    """The terms, each mask once; None where a mask is read with its dims in two roles (here or elsewhere in the
    mask): the evaluation takes each mask as one value per (batch, head, query, key) position."""
    out: dict[fx.Node, Term] = {}
    for t in terms:
        seen = out.get(t.node) or (Term(t.node, labels[t.node]) if t.node in labels else None)
        if seen is not None and seen.labels != t.labels:
            return None
        out[t.node] = t
    return list(out.values())


def _check_scatter_shape(site: Site) -> None:
    sc, idx = shape(site.scatter), site.index_shape
    att = site.attention
    sq, sk = shape(att.q), shape(att.k)
    B, T, S = sq[0], sq[2], sk[2]
    if sc is None or len(sc) not in (2, 3) or idx is None or len(idx) != len(sc):
        raise Reject("the index mask is not [batch, queries, keys]", site.scatter)
    for what, a, b in (("keys", sc[-1], S), ("queries", sc[-2], T), ("batch", sc[0] if len(sc) == 3 else B, B)):
        if not (same_size(a, b) or what == "batch" and is_one(a)):
            raise Reject(f"the index mask {list(sc)} and the attention's {what} {differ(a, b)}", site.scatter)
    for a, b in zip(idx[:-1], sc[:-1]):
        if not same_size(a, b):  # scatter writes the index's rows only
            raise Reject(f"the scattered indices {list(idx)} cover only part of the index mask's rows {list(sc)}"
                         if isinstance(a, int) and isinstance(b, int) else
                         f"the scattered indices' rows and the index mask's {differ(a, b)}", site.scatter)


def _check_table(site: Site, table: dict) -> bool:
    """The mask is visible exactly at picked-and-visible keys; returns whether it is additive."""
    visible = {key: all(key) for key in table}  # picked and every partner visible
    values = list(table.values())
    if all(isinstance(v, bool) for v in values):
        if all(table[key] == visible[key] for key in table):
            return False
        raise Reject(_polarity_reason(site, table), site.scatter)
    if any(isinstance(v, bool) for v in values):
        raise Reject("the attention mask mixes boolean and additive parts", site.scatter)
    eager = site.attention.kind == "eager"
    for key, v in table.items():
        c = v.c if isinstance(v, Score) else v
        if visible[key]:
            if float(c) != 0.0 or eager != isinstance(v, Score):
                raise Reject(_polarity_reason(site, table), site.scatter)
        elif float(c) == 0.0:
            raise Reject(_polarity_reason(site, table), site.scatter)
        elif not hides(c):
            how = "adding" if isinstance(v, Score) or not eager else "filling them with"
            raise Reject(f"the mask hides keys by {how} {float(c):g}, which does not hide them exactly: the model's "
                         f"softmax gives a hidden key a weight that is not 0 once logits reach about {abs(float(c)):g} "
                         f"in size; only -inf and torch.finfo({c.dtype}).min hide a key exactly (use one of them)",
                         site.scatter)
    return True


# SDPA's empty rows under an added fill: its forward is the mean of v on every backend, its gradient is not. The
# math kernel differentiates the softmax of S equal scores (weight 1/S a key, as eager attention does); the fused
# kernels (flash on the CPU, memory-efficient and cuDNN on CUDA) recompute the weights as exp(score - lse) from a
# logsumexp the fill absorbed too (finfo.min + log S == finfo.min), so every key gets weight 1. Which one runs is
# decided when the model runs (device, dtype, sizes, sdpa_kernel), so no single gradient is the model's.
_SDPA_EMPTY_GRAD = (
    "the mask adds {fill:g} to SDPA's scores and a query row may have no visible pick: SDPA gives such a row the mean "
    "of v, but its gradient depends on the kernel SDPA picks when the model runs (the math kernel weighs every key "
    "1/S; the fused kernels recompute the weights from a logsumexp the fill absorbed and weigh every key 1), so the "
    "op cannot give the model's gradient; a boolean attn_mask (True = visible) has one answer for such rows")


def _polarity_reason(site: Site, table: dict) -> str:
    picked_only = {k: v for k, v in table.items() if all(k[1:])}
    shown = ", ".join(f"{'picked' if k[0] else 'not picked'} -> {_show(v)}" for k, v in picked_only.items())
    return (f"the mask built from the scattered indices does not keep exactly the picked keys (where the model's "
            f"own mask is visible: {shown}); check the polarity of the scatter (True/0 at the picks) and of its "
            "combination (mask & ~index_mask, masked_fill(index_mask, min))")


def _show(v) -> str:
    if isinstance(v, bool):
        return "visible" if v else "hidden"
    if isinstance(v, Score):
        return f"score + {float(v.c):g}"
    return f"{float(v):g}"


def _empty_rule(site: Site, table: dict, additive: bool, rows_can_be_empty: bool, out: MaskPlan) -> None:
    """What a row with no visible pick gives in the model: 0, or the mean of v over all keys."""
    att = site.attention
    if not additive or not rows_can_be_empty:
        out.empty = "zero"  # SDPA under a boolean mask gives 0 for a row with nothing visible; or no row is empty
        return
    # (fill, whether the score is added to it): SDPA adds its float mask; eager may add or replace
    hidden = [(v.c, True) if isinstance(v, Score) else (v, att.kind == "sdpa") for k, v in table.items() if not all(k)]
    fills = {float(c) for c, _ in hidden}
    if fills == {float("-inf")}:
        if att.kind == "sdpa":
            out.empty = "zero"  # SDPA's softmax gives 0 for a row whose keys are all -inf
            return
        raise Reject("the eager softmax over a row whose keys are all -inf gives NaN, which the op does not "
                     "reproduce, and rows with no visible pick can occur here; fill with torch.finfo(dtype).min",
                     site.scatter)
    if len(fills) != 1:
        raise Reject(f"hidden keys carry the values {sorted(fills)}: a row with no visible pick would be neither 0 "
                     "nor a plain mean of v in the model", site.scatter)
    (fill,) = fills
    added = [a for _, a in hidden]
    if any(a and c.dtype not in _ABSORBING for c, a in hidden):
        raise Reject(f"the mask adds {fill:g} ({hidden[0][0].dtype}) to the scores, which does not absorb them: a row "
                     "with no visible pick is a softmax over unequal values in the model, not the mean of v the op "
                     "gives; replace the scores (masked_fill) or compute the scores in bfloat16 / float32",
                     site.scatter)
    if any(added) and not all(added) and requires_grad(att.node) and any(requires_grad(x) for x in (att.q, att.k)):
        raise Reject(f"hidden keys get {fill:g} added to the score at some keys and in place of it at others: a row "
                     "with no visible pick sends gradient to q and k through the added ones only, which the op does "
                     "not reproduce; fill every hidden key the same way (all added, or all masked_fill)", site.scatter)
    if att.kind == "sdpa" and requires_grad(att.node) and any(requires_grad(x) for x in (att.q, att.k, att.v)):
        raise Reject(_SDPA_EMPTY_GRAD.format(fill=fill), site.scatter)
    out.empty = "mean"
    out.eager_empty_grad = all(added)
    out.notes.append(f"hidden keys are filled with {fill:g}: a row with no visible pick gives the mean of v over "
                     "all keys, as the model's softmax does")


# ---------------------------------------------------------------------------------------------
# the partner masks


def _split(site: Site, node: fx.Node, labels: tuple, out: MaskPlan) -> None:
    """Split a boolean partner mask into a conjunction and map each term onto the op's arguments."""
    name = op_name(node)
    if name == "and":
        for a in node.args[:2]:
            if isinstance(a, fx.Node):
                _split(site, a, _labels_for(labels, a), out)
        return
    if name in VALUE_VIEWS and dtype(node.args[0]) == torch.bool:
        try:
            inner = view_input_labels(node, labels)
        except Reject:  # e.g. an advanced index (HF's padding mask read at [batch, key]): a tensor of its own
            inner = None
        if inner is not None:
            _split(site, node.args[0], inner, out)
            return
    fill = constant_fill(node)
    if fill is not None and op_name(node) in CONSTANT_TENSORS:
        if bool(fill):
            return
        raise Reject("the model's mask hides every key", site.scatter)
    present = {lab for lab in labels if lab is not None}
    if "h" in present:
        raise Reject(f"the model's mask ({node.name}, at {source_line(node)}) differs between heads, and one set of "
                     "picks serves all the heads of a query", site.scatter)
    if present <= {"b", "s"}:
        out.key_terms.append(Term(node, labels))
        out.kinds.append("key mask")
        return
    pred = positions.visible_where(Leaf(node, labels))
    terms = masks.causal_offset(pred, labels, "s", "t") if pred is not None else None
    if terms is not None and not out.causal:
        out.causal, out.offset_terms = True, terms
        out.kinds.append("causal")
        return
    out.pick_terms.append(Term(node, labels))
    out.kinds.append("mask read at the picks")


def _triangle(site: Site, pred: positions.Pred, labels: tuple, out: MaskPlan) -> None:
    terms = masks.causal_offset(pred, labels, "s", "t")
    if terms is None or out.causal:
        raise Reject("the model adds a -inf triangle that is not one causal limit on (query, key)", site.scatter)
    out.causal, out.offset_terms = True, terms
    out.kinds.append("causal (additive)")
