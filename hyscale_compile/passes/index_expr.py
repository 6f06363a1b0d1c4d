"""Read the producer subgraph of a top-k input as one index expression (the indexer form).

Every dimension of every tensor on the path gets a *label*; contractions, sums and views move labels
around instead of positions, so ``einsum("bshd,btd->bsht")``, ``matmul(q, k.T.unsqueeze(1))`` and
``(w[..., None] * relu(s)).sum(2)`` all reduce to the same ``Score``:

    score[B, T, S] = scale * sum_H  prod(weights)[B, T, H] * act(prod(pre)[B, T, H] * q[B, T, H, D] . k[B, S, D])
                     + bias, masked to fill

The walk is top-down, from the top-k input, because only there is it known which dimension holds
the keys (S); at a contraction, the operand holding S is the key side of the dot, or the score
itself when the other operand has no free dimension (a head-weighted sum). Anything outside this
vocabulary raises ``Reject`` with a reason a user can act on.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from .graph_ops import (
    dtype,
    is_one,
    is_tensor,
    named_arg,
    normalize_dim,
    op_name,
    same_size,
    shape,
    source_line,
    value,
    written_in_place,
)

_labels = itertools.count()

Label = int | None  # None: a size-1 dimension that only broadcasts


class Reject(Exception):
    """The site is not the indexer form (or cannot be proven to be); the message says why."""

    def __init__(self, reason: str, node: fx.Node | None = None, graph_input: fx.Node | None = None) -> None:
        where = f" (at {source_line(node)})" if node is not None else ""
        super().__init__(reason + where)
        self.reason = reason + where
        self.graph_input = graph_input  # the placeholder the score is read from, when it is not computed here


@dataclass(frozen=True)
class Leaf:
    """A tensor the model computed itself (q, k, weights, masks), with the label of each of its dims."""

    node: fx.Node
    labels: tuple[Label, ...]
    negate: bool = False  # bool masks: the tensor marks *hidden* positions; additive terms: it is subtracted
    at: fx.Node | None = field(default=None, compare=False)  # the node of the score's chain that reads it
    cast: torch.dtype | None = None  # an additive term the model's add converts first (int or bool to float)


@dataclass(frozen=True)
class Score:
    dims: tuple[Label, ...]  # label of each dim of the tensor this Score stands for
    q: Leaf
    k: Leaf
    key: int  # S
    contracted: int  # D
    batch: tuple[int, ...]  # labels shared by q and k
    query_free: tuple[int, ...]  # T, H (if present) and any query-only batch dims, not yet told apart
    head: int | None = None  # the summed label, once summed
    relu: bool = False
    pre_scale: float = 1.0
    post_scale: float = 1.0
    pre: tuple[Leaf, ...] = ()  # tensor factors applied before the activation
    key_pre: tuple[Leaf, ...] = ()  # per-key factors before the activation (fold into k)
    weights: tuple[Leaf, ...] = ()
    bias: tuple[Leaf, ...] = ()
    keep: tuple[Leaf, ...] = ()  # bool masks
    fill: float | None = None
    filled_before_bias: bool = False
    virtual_query: Label = None  # decode with the query dim squeezed away: a size-1 query dim of our own
    wide: bool = False  # cast to float64: only views and casts may follow (the op computes in float32)
    nodes: tuple[fx.Node, ...] = field(default=())  # the chain, bottom-up; all must die with the rewrite
    node_dims: tuple[tuple[fx.Node, tuple], ...] = field(default=())  # each chain node's dim labels

    def with_node(self, node: fx.Node, **changes) -> Score:
        new = replace(self, nodes=self.nodes + (node,), **changes)
        return replace(new, node_dims=new.node_dims + ((node, new.dims),))

    @property
    def masked(self) -> bool:
        return bool(self.bias or self.keep) or self.fill is not None

    @property
    def query(self) -> int:
        """T: of the query-only dims that survive the head sum, the innermost (the others are batch dims)."""
        rest = [lab for lab in self.dims if lab in self.query_free and lab != self.head]
        return rest[-1] if rest else self.virtual_query

    @property
    def batch_all(self) -> tuple[int, ...]:
        """Every batch dim of the selection, in score order: shared ones, and query-only ones k broadcasts over."""
        extra = {lab for lab in self.query_free if lab not in (self.head, self.query)}
        return tuple(lab for lab in self.dims if lab in extra or lab in self.batch)


# ---------------------------------------------------------------------------------------------
# contractions (einsum, matmul, bmm)


def _einsum_letters(node: fx.Node) -> tuple[list[tuple[fx.Node, str]], str]:
    eq = node.args[0]
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not isinstance(eq, str) or "->" not in eq:
        raise Reject(f"einsum equation {eq!r} is not supported (it needs an explicit output)", node)
    lhs, out = eq.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != 2 or len(operands) != 2:
        raise Reject("only two-operand einsum is part of the indexer form", node)
    if "..." in eq:
        ins, out = _expand_ellipsis(node, ins, out, operands)
    if any(len(set(x)) != len(x) for x in (*ins, out)):
        raise Reject(f"einsum {eq!r} repeats a letter within one operand (a diagonal), not the indexer form", node)
    return list(zip(operands, ins)), out


def _expand_ellipsis(node: fx.Node, ins: list[str], out: str, operands) -> tuple[list[str], str]:
    """Spell '...' with letters of its own (right-aligned broadcast dims, as einsum aligns them)."""
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(ins) + out]
    ranks = []
    for letters, x in zip(ins, operands):
        if shape(x) is None:
            raise Reject("an einsum operand is not a tensor", node)
        ranks.append(len(shape(x)) - len(letters.replace("...", "")) if "..." in letters else 0)
    n = max(ranks)
    dims = "".join(free[:n])
    expanded = [letters.replace("...", dims[n - r:]) for letters, r in zip(ins, ranks)]
    return expanded, out.replace("...", dims)


def _matmul_letters(node: fx.Node) -> tuple[list[tuple[fx.Node, str]], str]:
    a, b = node.args[0], node.args[1]
    sa, sb = shape(a), shape(b)
    if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
        raise Reject("matmul of vectors is not part of the indexer form", node)
    letters = iter("abcdefghijklmnopqrstuvw")
    nb = max(len(sa), len(sb)) - 2
    ba, bb, bo = [], [], []
    for i in range(nb):  # batch dims, right-aligned
        da = sa[len(sa) - 2 - nb + i] if len(sa) - 2 - nb + i >= 0 else None
        db = sb[len(sb) - 2 - nb + i] if len(sb) - 2 - nb + i >= 0 else None
        one_a, one_b = da is None or is_one(da), db is None or is_one(db)
        letter = next(letters)
        # a size-1 dim that broadcasts against a real one belongs to the other operand only
        if da is not None:
            ba.append(letter if not (one_a and not one_b) else "1")
        if db is not None:
            bb.append(letter if not (one_b and not one_a) else "1")
        bo.append(letter)
    m, n, p = next(letters), next(letters), next(letters)
    m = "1" if is_one(sa[-2]) else m  # e.g. w.unsqueeze(-2): a unit row, not a query dimension
    p = "1" if is_one(sb[-1]) else p
    return [(a, "".join(ba) + m + n), (b, "".join(bb) + n + p)], "".join(bo) + m + p


def _contraction(node: fx.Node, s_dim: int) -> Score:
    name = op_name(node)
    ((x, lx), (y, ly)), out = (_einsum_letters if name == "einsum" else _matmul_letters)(node)
    s_letter = out[s_dim]
    holders = [i for i, letters in enumerate((lx, ly)) if s_letter in letters]
    if len(holders) != 1:
        raise Reject("the keys dimension of the score comes from both operands of a contraction", node)
    (sn, sl), (on, ol) = ((x, lx), (y, ly)) if holders[0] == 0 else ((y, ly), (x, lx))
    contracted = [c for c in set(sl) & set(ol) if c not in out and c != "1"]
    if len(contracted) != 1:
        raise Reject(f"the contraction must sum exactly one dimension, it sums {len(contracted)}", node)
    other_free = [c for c in ol if c not in sl and c in out and c != "1"]
    if other_free:
        return _dot(node, query=(on, ol), key=(sn, sl), out=out, d=contracted[0])
    return _head_sum(node, score=(sn, sl), weight=(on, ol), out=out, h=contracted[0], s_letter=s_letter)


def _dot(node: fx.Node, query, key, out: str, d: str) -> Score:
    (qn, ql), (kn, kl) = query, key
    if not (is_tensor(qn) and is_tensor(kn)):
        raise Reject("the dot product's operands must be tensors", node)
    names = {c: next(_labels) for c in set(ql) | set(kl) | set(out) if c != "1"}
    lab = lambda s: tuple(names.get(c) for c in s)  # noqa: E731  ('1' -> None)
    batch = tuple(names[c] for c in out if c in ql and c in kl and c != "1")
    key_free = [c for c in kl if c not in ql and c != d and c != "1"]
    query_free = tuple(names[c] for c in ql if c not in kl and c != d and c != "1")
    if len(key_free) != 1:
        if len(key_free) > 1:
            raise Reject("the keys have dimensions the queries lack besides the key positions (the queries "
                         "broadcast over a batch of keys): not the indexer form", node)
        raise Reject("the key operand must have exactly one dimension besides batch and head_dim", node)
    if not query_free:
        raise Reject("the query operand has no dimension of its own", node)
    return Score(dims=lab(out), q=Leaf(qn, lab(ql), at=node), k=Leaf(kn, lab(kl), at=node), key=names[key_free[0]],
                 contracted=names[d], batch=batch, query_free=query_free, nodes=(node,),
                 node_dims=((node, lab(out)),))


def _head_sum(node: fx.Node, score, weight, out: str, h: str, s_letter: str) -> Score:
    (sn, sl), (wn, wl) = score, weight
    sc = _narrow(interpret(sn, sl.index(s_letter)), node)
    names = dict(zip(sl, sc.dims))
    if any(c not in names for c in wl if c != "1"):
        raise Reject("the head weights have a dimension the score does not have", node)
    head = names[h]
    if head is None:  # one indexer head (q [B, T, 1, D] through matmul): the sum over it is a product
        sc, head = _unit_head(sc, node)
    sc = _with_unit_query(sc, head)
    sc = _check_head(sc, head, node)
    w = Leaf(wn, tuple(names.get(c) if c != "1" else None for c in wl), at=node)
    _check_factor_labels(sc, w, node)
    return sc.with_node(node, dims=tuple(names.get(c) for c in out), head=head, weights=sc.weights + (w,))


def _unit_head(sc: Score, node: fx.Node) -> tuple[Score, Label]:
    """A head dim of size 1 that matmul's broadcasting left unlabelled: give it a label of its own (no tensor
    has it; the rewrite inserts it as a size-1 dim), so the one-head indexer is the same form as any other."""
    if sc.head is not None or sc.masked:
        raise Reject("the score is summed over a dimension that is not the indexer's head dimension", node)
    head = next(_labels)
    return replace(sc, query_free=sc.query_free + (head,)), head


def _with_unit_query(sc: Score, head: Label) -> Score:
    """Decode (T=1) through matmul: the size-1 query dim was shared by q and k (read as a batch dim). When the
    head sum would leave no query dim, the innermost batch dim of size 1 on both sides is the query dim."""
    if sc.head is not None or tuple(sc.query_free) != (head,):
        return sc
    for lab in reversed(sc.dims):
        if lab in sc.batch and all(is_one(shape(x.node)[x.labels.index(lab)]) for x in (sc.q, sc.k)):
            k_labels = tuple(None if x == lab else x for x in sc.k.labels)
            return replace(sc, batch=tuple(b for b in sc.batch if b != lab), query_free=(lab, head),
                           k=replace(sc.k, labels=k_labels))
    return sc


def _check_head(sc: Score, head: Label, node: fx.Node) -> Score:
    if sc.head is not None:
        raise Reject("the score is summed over heads twice (a second sum after the head sum)", node)
    if head not in sc.query_free:
        what = "the keys" if head == sc.key else "a dimension the keys share with the queries (a batch dimension)"
        raise Reject(f"the score is summed over {what}, not over the query's heads", node)
    if sc.masked:
        raise Reject("a mask is applied before the head sum, which is not the indexer form", node)
    if len(sc.query_free) < 2:  # decode with the query dim squeezed away: q [B, H, D] -> score [B, S]
        return replace(sc, virtual_query=next(_labels))
    return sc


# ---------------------------------------------------------------------------------------------
# elementwise factors, masks


def _align(sc: Score, node: fx.Node, t: fx.Node) -> Leaf:
    """Labels of a tensor that broadcasts against the score (right-aligned)."""
    tshape = shape(t)
    if tshape is None or len(tshape) > len(sc.dims):
        raise Reject("a tensor combined with the score would change the score's shape", node)
    if shape(node) is not None and shape(node) != _score_shape(node, t):
        raise Reject("a tensor combined with the score broadcasts it to a larger shape", node)
    off = len(sc.dims) - len(tshape)
    labels = []
    for i, size in enumerate(tshape):
        lab = sc.dims[off + i]
        if is_one(size):
            labels.append(None)
        elif lab is None:
            raise Reject("a tensor combined with the score would change the score's shape", node)
        else:
            labels.append(lab)
    return Leaf(t, tuple(labels), at=node)


def _score_shape(node: fx.Node, other: fx.Node) -> tuple | None:
    """The shape of the score operand of a binary op (the tensor operand that is not ``other``)."""
    for a in node.all_input_nodes:
        if a is not other and shape(a) is not None and len(shape(a)) == len(shape(node)):
            return shape(a)
    return shape(node)


def _check_factor_labels(sc: Score, leaf: Leaf, node: fx.Node) -> None:
    if sc.key in leaf.labels:
        raise Reject("the score is multiplied by a factor that varies with the key position", node)


def _scalar(x) -> float | None:
    """A constant number: a Python number, or a 0-d ``torch.tensor(number)`` built in the graph."""
    if isinstance(x, fx.Node) and op_name(x) == "tensor" and len(x.args) == 1 and shape(x) == ():
        if written_in_place(x):
            return None
        x = x.args[0]
    if isinstance(x, bool):
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    return None


def _score_and_other(node: fx.Node, s_dim: int) -> tuple[Score, object]:
    """For a binary op, interpret the operand that carries the score; return it with the other operand."""
    a, b = node.args[0], node.args[1] if len(node.args) > 1 else named_arg(node, "other")
    out = shape(node)
    candidates = [x for x in (a, b) if isinstance(x, fx.Node) and is_tensor(x)]
    # the score has the full output shape; a broadcasting factor does not
    candidates.sort(key=lambda x: shape(x) != out)
    last: Reject | None = None
    for cand in candidates:
        if shape(cand) is None or len(shape(cand)) != len(out):
            continue
        try:
            sc = interpret(cand, s_dim)
        except Reject as err:
            last = last or err  # the full-shape operand's reason is the one a user needs
            continue
        return sc, (b if cand is a else a)
    raise last or Reject(f"`{node.target}` does not combine the score with a constant or a factor", node)


def _scaled(sc: Score, node: fx.Node, c: float) -> Score:
    """Multiply the score by the constant ``c`` (before or after the activation, as it stands)."""
    _narrow(sc, node)
    if sc.masked:
        # c * fill must stay the fill and the biases would need scaling too: only a positive c on a score
        # whose masked entries are infinite and that has no additive mask is still the same selection
        if c <= 0 or sc.bias or (sc.fill is not None and abs(sc.fill) != float("inf")):
            raise Reject("the score is scaled after a mask, which changes the masked values", node)
        return sc.with_node(node, post_scale=sc.post_scale * c)
    if sc.relu or sc.head is not None:
        return sc.with_node(node, post_scale=sc.post_scale * c)
    return sc.with_node(node, pre_scale=sc.pre_scale * c)


def _multiply(node: fx.Node, s_dim: int, divide: bool = False) -> Score:
    sc, other = _score_and_other(node, s_dim)
    _narrow(sc, node)
    if divide and other is node.args[0]:
        raise Reject("the score divides something instead of being divided", node)
    c = _scalar(other)
    if c is not None:
        if divide:
            if c == 0:
                raise Reject("the score is divided by zero", node)
            c = 1.0 / c
        return _scaled(sc, node, c)
    if isinstance(other, fx.Node) and isinstance(value(other), (torch.SymFloat, torch.SymInt)) and not divide:
        if sc.masked:
            raise Reject("the score is scaled by a symbolic number after a mask", node)
        # a symbolic number (e.g. a float attribute under dynamic=True): its sign is unknown, so it is
        # folded into q before the activation or into the weights after it, never into the scale
        leaf = Leaf(other, (), at=node)
        if sc.relu or sc.head is not None:
            return sc.with_node(node, weights=sc.weights + (leaf,))
        return sc.with_node(node, pre=sc.pre + (leaf,))
    if divide or not is_tensor(other):
        raise Reject("the score is scaled by a value that is not a constant number", node)
    if sc.masked:
        what = "a tensor was added to it" if sc.bias and not (sc.keep or sc.fill is not None) else "a mask"
        raise Reject(f"the score is multiplied by a tensor after {what}, so the added or masked values would be "
                     "scaled too, which the indexer form does not do", node)
    leaf = _align(sc, node, other)
    before_act = not (sc.relu or sc.head is not None)
    if sc.key in leaf.labels:
        # act(f_s * q.k_s) == act(q.(f_s k_s)): a per-key factor before the activation folds into the keys
        if before_act and set(leaf.labels) <= {sc.key, None, *sc.batch}:  # k's own batch dims only
            return sc.with_node(node, key_pre=sc.key_pre + (leaf,))
        raise Reject("the score is multiplied by a factor that varies with the key position after the "
                     "activation or with the query too", node)
    if not before_act:
        return sc.with_node(node, weights=sc.weights + (leaf,))
    return sc.with_node(node, pre=sc.pre + (leaf,))


_SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _add(node: fx.Node, s_dim: int, subtract: bool = False) -> Score:
    """score + x / score - x with a tensor x (an additive mask or bias): x becomes an additive term."""
    if named_arg(node, "alpha", 1) != 1:
        raise Reject(f"{'sub' if subtract else 'add'} with alpha != 1 is not supported on the score", node)
    sc, other = _score_and_other(node, s_dim)
    _narrow(sc, node)
    if subtract and other is node.args[0]:
        raise Reject("the score is subtracted from something (a negated score), which is not the indexer form", node)
    if not is_tensor(other):
        raise Reject("a constant is added to the score (only mask or bias tensors are supported)", node)
    if dtype(node) not in _SCORE_DTYPES:
        raise Reject(f"adding this tensor makes the score {dtype(node)}; the selection computes in float32, less "
                     "precisely than the model", node)
    leaf = _align(sc, node, other)
    if dtype(other) is not None and not dtype(other).is_floating_point:  # the add converts an int or bool tensor
        leaf = replace(leaf, cast=dtype(node))
    if subtract:
        leaf = replace(leaf, negate=True)
    if sc.fill is not None and sc.fill != float("-inf"):
        raise Reject("an additive mask follows a masked fill with a finite value", node)
    return sc.with_node(node, bias=sc.bias + (leaf,), filled_before_bias=sc.filled_before_bias or sc.fill is not None)


def _fill(sc: Score, node: fx.Node, value) -> Score:
    _narrow(sc, node)
    v = _scalar(value)
    if v is None:
        raise Reject("the masked fill value is not a constant number", node)
    dt = dtype(node)
    if dt is not None and dt.is_floating_point and math.isfinite(v) and abs(v) > torch.finfo(dt).max:
        if op_name(node) == "masked_fill":
            raise Reject(f"the fill value {v} overflows {dt} (eager raises an error here)", node)
        v = math.copysign(math.inf, v)  # where() converts the number to the score's dtype: it rounds to inf
    if sc.fill is not None and not _same_float(sc.fill, v):
        raise Reject(f"two different fill values ({sc.fill} and {v}) are used on the score", node)
    return sc.with_node(node, fill=v)


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _masked_fill(node: fx.Node, s_dim: int) -> Score:
    sc = interpret(node.args[0], s_dim)
    cond = named_arg(node, "mask")
    leaf = _align(sc, node, cond)
    filled = _fill(sc, node, named_arg(node, "value"))
    return replace(filled, keep=sc.keep + (replace(leaf, negate=True),))


def _where(node: fx.Node, s_dim: int) -> Score:
    cond, a, b = named_arg(node, "condition"), named_arg(node, "input"), named_arg(node, "other")
    if isinstance(a, fx.Node) and is_tensor(a) and shape(a) and _scalar(b) is not None:
        sc, negate, value = interpret(a, s_dim), False, b
    elif isinstance(b, fx.Node) and is_tensor(b) and shape(b) and _scalar(a) is not None:
        sc, negate, value = interpret(b, s_dim), True, a
    else:
        raise Reject("torch.where on the score must choose between the score and a constant", node)
    leaf = replace(_align(sc, node, cond), negate=negate)
    filled = _fill(sc, node, value)
    return replace(filled, keep=sc.keep + (leaf,))


# ---------------------------------------------------------------------------------------------
# views, casts, activation, head sum


def _relu(node: fx.Node, s_dim: int) -> Score:
    if op_name(node) in ("clamp", "maximum") and not _is_relu_clamp(node):
        raise Reject("the score is clamped to a range other than [0, inf)", node)
    sc = _narrow(interpret(node.args[0] if node.args else node.kwargs["input"], s_dim), node)
    if sc.relu and not (sc.weights or sc.head is not None or sc.bias or sc.keep) and sc.post_scale > 0:
        return sc.with_node(node)  # relu(c * relu(x)) == c * relu(x) for c > 0
    if sc.relu or sc.head is not None or sc.bias or sc.keep:
        raise Reject("relu is applied after the head sum or a mask, which is not the indexer form", node)
    return sc.with_node(node, relu=True)


def _is_relu_clamp(node: fx.Node) -> bool:
    """clamp(min=0) / clamp_min(0) / clamp(0, inf) / maximum(x, 0-d zero): ReLU spelled otherwise (all keep NaN)."""
    if op_name(node) == "maximum":
        other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        return _scalar(other) == 0.0 and shape(other) == ()
    if node.target in ("clamp_min", torch.clamp_min):
        low, high = node.args[1] if len(node.args) > 1 else node.kwargs.get("min"), None
    else:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    return _scalar(low) == 0.0 and (high is None or _scalar(high) == math.inf)


def _sum(node: fx.Node, s_dim: int) -> Score:
    dim = named_arg(node, "dim")
    keepdim = bool(named_arg(node, "keepdim", False))
    ndim = len(shape(node.args[0]) or ())
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            raise Reject("the score is summed over several dimensions at once", node)
        dim = dim[0]
    if not isinstance(dim, int):
        raise Reject("the score is summed over all dimensions", node)
    dim = normalize_dim(dim, ndim)
    in_s = s_dim if (keepdim or s_dim < dim) else s_dim + 1
    if in_s == dim:
        raise Reject("the score is summed over the key dimension", node)
    sc = _narrow(interpret(node.args[0], in_s), node)
    head = sc.dims[dim]
    if head is None:  # one indexer head that a matmul left unlabelled, summed with .sum(dim)
        sc, head = _unit_head(sc, node)
    sc = _with_unit_query(sc, head)
    _check_head(sc, head, node)
    dims = list(sc.dims)
    if keepdim:
        dims[dim] = None
    else:
        del dims[dim]
    return sc.with_node(node, dims=tuple(dims), head=head)


def _mean(node: fx.Node, s_dim: int) -> Score:
    """mean over the heads: the head sum scaled by 1 / H (H a number; the scale folds into the weights)."""
    if node.kwargs.get("dtype") is not None:
        raise Reject("the head mean is taken in another dtype", node)
    sc = _sum(node, s_dim)
    size = dim_size(sc, sc.head)
    if not isinstance(size, int) or size < 1:
        raise Reject("the score is averaged over a dimension of symbolic size", node)
    return _scaled(replace(sc, nodes=sc.nodes[:-1]), node, 1.0 / size)


def dim_size(sc: Score, label: Label):
    """The size of a label's dim, from the leaf that has it (None for a label no tensor has)."""
    for leaf in (sc.q, sc.k):
        if label in leaf.labels:
            return shape(leaf.node)[leaf.labels.index(label)]
    return None


_UPCAST_OK = (torch.float32, torch.float64)


def _cast(node: fx.Node, s_dim: int) -> Score:
    src = node.args[0]
    if dtype(node) not in _UPCAST_OK and dtype(node) != dtype(src):
        raise Reject(f"the score is cast to {dtype(node)} before selection; selection would be less precise "
                     "than the model's own", node)
    if shape(node) != shape(src):
        raise Reject("a cast changed the score's shape", node)
    sc = interpret(src, s_dim)
    return sc.with_node(node, wide=sc.wide or dtype(node) == torch.float64)


def _narrow(sc: Score, node: fx.Node) -> Score:
    """Arithmetic on the score: not after a float64 upcast, where the model computes more precisely than the op
    (a fill or bias that float32 cannot hold, a head sum in float64)."""
    if sc.wide:
        raise Reject("the score is cast to float64 and then masked, scaled or summed; the selection computes "
                     "in float32, less precisely than the model", node)
    return sc


def _permute(node: fx.Node, s_dim: int) -> Score:
    ndim = len(shape(node))
    if op_name(node) == "transpose":
        a, b = (normalize_dim(d, ndim) for d in (named_arg(node, "dim0"), named_arg(node, "dim1")))
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        perm = [normalize_dim(d, ndim) for d in (perm or node.kwargs.get("dims"))]
    sc = interpret(node.args[0], perm[s_dim])
    return sc.with_node(node, dims=tuple(sc.dims[p] for p in perm))


def _one_dim_view(node: fx.Node, s_dim: int) -> Score | None:
    """unsqueeze(d) / squeeze(d) move exactly one dim (a size-1 labelled dim elsewhere stays put)."""
    src, d = node.args[0], named_arg(node, "dim")
    if not isinstance(d, int):
        return None
    ins, outs = shape(src), shape(node)
    if op_name(node) == "unsqueeze":
        d = normalize_dim(d, len(outs))
        if d == s_dim:
            raise Reject("the key dimension has size 1", node)
        sc = interpret(src, s_dim if s_dim < d else s_dim - 1)
        return sc.with_node(node, dims=sc.dims[:d] + (None,) + sc.dims[d:])
    d = normalize_dim(d, len(ins))
    if not is_one(ins[d]):
        return interpret(src, s_dim).with_node(node)  # squeezing a dim that is not 1 does nothing
    sc = interpret(src, s_dim if s_dim < d else s_dim + 1)
    if sc.dims[d] is not None:
        raise Reject("a size-1 batch, query or head dimension of the score is squeezed away", node)
    return sc.with_node(node, dims=sc.dims[:d] + sc.dims[d + 1:])


def _reshape_like(node: fx.Node, s_dim: int) -> Score:
    """unsqueeze / squeeze / view / [None] indexing: moves of size-1 dims, or a query dim split back into the
    query and head dims it was flattened from (``bmm`` over ``q.reshape(b, t * h, d)``, then ``.view(b, t, h, s)``)."""
    if op_name(node) in ("unsqueeze", "squeeze") and len(node.args) + len(node.kwargs) == 2:
        one = _one_dim_view(node, s_dim)
        if one is not None:
            return one
    src = node.args[0]
    ins, outs = shape(src), shape(node)
    real_in = [i for i, d in enumerate(ins) if not is_one(d)]
    real_out = [i for i, d in enumerate(outs) if not is_one(d)]
    if len(real_in) != len(real_out) or any(not same_size(ins[i], outs[j]) for i, j in zip(real_in, real_out)):
        split = _split_view(node, s_dim)
        if split is not None:
            return split
        raise Reject("the score is reshaped beyond adding or removing size-1 dimensions", node)
    if s_dim not in real_out:
        raise Reject("the key dimension has size 1", node)
    in_s = real_in[real_out.index(s_dim)]
    sc = interpret(src, in_s)
    dropped = [sc.dims[i] for i, d in enumerate(ins) if is_one(d) and sc.dims[i] is not None]
    if dropped:
        raise Reject("a size-1 batch, query or head dimension of the score is squeezed away", node)
    dims = [None] * len(outs)
    for i, j in zip(real_in, real_out):
        dims[j] = sc.dims[i]
    return sc.with_node(node, dims=tuple(dims))


def _split_groups(ins: tuple, outs: tuple) -> list[list[int]] | None:
    """For each dim of ``ins``, the dims of ``outs`` it becomes, when the reshape only splits dims (each group's
    product provably equals its input dim). None for any other reshape."""
    groups, j = [], 0
    for size in ins:
        group, prod = [], 1
        while j < len(outs) and (not group or not same_size(prod, size)):
            group.append(j)
            prod = prod * outs[j]
            j += 1
        if not same_size(prod, size):
            return None
        groups.append(group)
    return groups if j == len(outs) else None


def _split_view(node: fx.Node, s_dim: int) -> Score | None:
    """The score's query dim, a flattening of q's own dims (q.reshape(b, t * h, d)), split back by this view.

    Exact when only q carries the flattened dim: the split view of the score is then the score of q's
    unflattened view. q's reshape joins the chain (it must die with it)."""
    src = node.args[0]
    groups = _split_groups(shape(src), shape(node))
    if groups is None or sum(len(g) > 1 for g in groups) != 1:
        return None
    d_in = next(i for i, g in enumerate(groups) if len(g) > 1)
    if s_dim in groups[d_in]:
        return None
    in_s = next(i for i, g in enumerate(groups) if s_dim in g)
    sc = interpret(src, in_s)
    flat = sc.dims[d_in]
    others = (sc.k, *sc.pre, *sc.key_pre, *sc.weights, *sc.bias, *sc.keep)
    if flat is None or flat not in sc.query_free or any(flat in leaf.labels for leaf in others):
        return None
    q_view = sc.q.node
    if op_name(q_view) != "reshape" or not is_tensor(q_view.args[0]):
        return None
    q_dim = sc.q.labels.index(flat)
    q_groups = _split_groups(shape(q_view), shape(q_view.args[0]))
    sizes = [shape(node)[j] for j in groups[d_in]]
    q_sizes = [shape(q_view.args[0])[j] for j in q_groups[q_dim]] if q_groups is not None else []
    if len(q_sizes) != len(sizes) or not all(same_size(a, b) for a, b in zip(q_sizes, sizes)):
        return None
    if any(len(g) != 1 for i, g in enumerate(q_groups) if i != q_dim):
        return None
    new = tuple(next(_labels) for _ in sizes)
    q_labels = []
    for i, lab in enumerate(sc.q.labels):
        q_labels.extend(new if i == q_dim else (lab,))
    dims = []
    for i, lab in enumerate(sc.dims):
        dims.extend(new if i == d_in else (lab,))
    query_free = tuple(x for lab in sc.query_free for x in (new if lab == flat else (lab,)))
    return replace(sc, q=replace(sc.q, node=q_view.args[0], labels=tuple(q_labels)), query_free=query_free,
                   nodes=(q_view,) + sc.nodes).with_node(node, dims=tuple(dims))


def _getitem(node: fx.Node, s_dim: int) -> Score:
    idx = node.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not all(i is None or i is Ellipsis or i == slice(None) for i in idx):
        raise Reject("the score is sliced before selection", node)
    return _reshape_like(node, s_dim)


def _identity(node: fx.Node, s_dim: int) -> Score:
    return interpret(node.args[0], s_dim).with_node(node)


_HANDLERS = {
    "einsum": _contraction,
    "matmul": _contraction,
    "relu": _relu,
    "clamp": _relu,
    "maximum": _relu,
    "mul": _multiply,
    "div": lambda n, s: _multiply(n, s, divide=True),
    "neg": lambda n, s: _scaled(interpret(n.args[0], s), n, -1.0),
    "sum": _sum,
    "add": _add,
    "sub": lambda n, s: _add(n, s, subtract=True),
    "mean": _mean,
    "detach": _identity,
    "masked_fill": _masked_fill,
    "where": _where,
    "float": _cast,
    "to": _cast,
    "identity": _identity,
    "transpose": _permute,
    "permute": _permute,
    "unsqueeze": _reshape_like,
    "squeeze": _reshape_like,
    "reshape": _reshape_like,
    "getitem": _getitem,
}


def interpret(node, s_dim: int) -> Score:
    """The Score that ``node`` computes, given that its dim ``s_dim`` runs over key positions."""
    if not isinstance(node, fx.Node) or not is_tensor(node):
        raise Reject("the selected tensor is not computed in this graph", None)
    name = op_name(node)
    handler = _HANDLERS.get(name)
    if handler is None:
        if node.op == "placeholder":
            raise Reject("the score is an input of this compiled graph, not computed in it", graph_input=node)
        what = node.target if node.op != "get_attr" else f"the module attribute {node.target!r}"
        raise Reject(f"the score is produced by {getattr(what, '__name__', what)}, which is not part of the "
                     "indexer form (q.k -> relu -> head-weighted sum -> mask)", node)
    return handler(node, s_dim)


def positive_scale(sc: Score, node: fx.Node) -> float:
    """The single scale of the canonical form, after checking that folding it is legal."""
    if sc.relu and sc.pre_scale <= 0:
        raise Reject(f"the scale before relu ({sc.pre_scale}) is not positive", node)
    if not any(w.labels or is_tensor(w.node) for w in sc.weights) and sc.weights:
        raise Reject("the score is scaled by a symbolic number and has no head weights to fold it into", node)
    if sc.post_scale < 0 and not sc.weights:
        raise Reject(f"the score is multiplied by {sc.post_scale}, so selection would pick the smallest scores",
                     node)
    scale = sc.pre_scale * abs(sc.post_scale)
    if not math.isfinite(scale) or scale == 0:
        raise Reject(f"the scale {scale} is not a finite positive number", node)
    return scale
