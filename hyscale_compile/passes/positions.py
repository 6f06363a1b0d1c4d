"""What a mask built from positions says: which keys each query sees, read from how the mask is produced.

Positions are small affine forms over the mask's dimensions (counted from the right, as broadcasting aligns
them): ``arange`` comparisons, sums and integer multiples of them, per-row integer tensors, and triangles cut
from constant tensors (``ones(bool).tril(d)``, ``full(-inf).triu(d)``, ``full_like(score, ...)``). A predicate
is a conjunction of ``expr <= 0``. Anything else (or anything written in place after it is made) is unknown:
``masks.plan`` then passes the mask as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .graph_ops import dtype, is_one, is_tensor, named_arg, op_name, shape, value, written_in_place
from .index_expr import Leaf

NEG_INF = float("-inf")


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
        return Affine(tuple((d, -v) for d, v in self.coef), tuple(neg_term(t) for t in self.const),
                      tuple((-s, n, dims) for s, n, dims in self.tensors))

    def moved(self, mapping: dict[int, int | None]) -> Affine:
        if any(mapping[d] is None for d, _ in self.coef) or any(
                mapping[d] is None for _, _, dims in self.tensors for d in dims):
            raise _Unknown  # the value varies along a dim an integer index removed
        return Affine(tuple(sorted((mapping[d], v) for d, v in self.coef)), self.const,
                      tuple((s, n, tuple(mapping[d] for d in dims)) for s, n, dims in self.tensors))


@dataclass(frozen=True)
class Neg:
    term: object


def neg_term(t):
    if isinstance(t, int):
        return -t
    return t.term if isinstance(t, Neg) else Neg(t)


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
