"""Contractions of the index expression: the q.k dot (einsum, matmul, bmm) and the head sum (a contraction
with the head weights, ``sum`` or ``mean`` over the heads), with the one-head and the squeezed-query decode forms.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

from .expr import (
    HANDLERS,
    Label,
    Leaf,
    Reject,
    Score,
    check_factor_labels,
    dim_size,
    interpret,
    narrow,
    new_label,
)
from .expr_terms import scaled
from .graph_ops import (
    dtype,
    is_one,
    is_tensor,
    named_arg,
    normalize_dim,
    op_name,
    shape,
)


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
    names = {c: new_label() for c in set(ql) | set(kl) | set(out) if c != "1"}
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
    sc = narrow(interpret(sn, sl.index(s_letter)), node)
    names = dict(zip(sl, sc.dims))
    if any(c not in names for c in wl if c != "1"):
        raise Reject("the head weights have a dimension the score does not have", node)
    head = names[h]
    if head is None:  # one indexer head (q [B, T, 1, D] through matmul): the sum over it is a product
        sc, head = _unit_head(sc, node)
    sc = _with_unit_query(sc, head)
    sc = _check_head(sc, head, node)
    w = Leaf(wn, tuple(names.get(c) if c != "1" else None for c in wl), at=node)
    check_factor_labels(sc, w, node)
    return sc.with_node(node, dims=tuple(names.get(c) for c in out), head=head, weights=sc.weights + (w,))


def _unit_head(sc: Score, node: fx.Node) -> tuple[Score, Label]:
    """A head dim of size 1 that matmul's broadcasting left unlabelled: give it a label of its own (no tensor
    has it; the rewrite inserts it as a size-1 dim), so the one-head indexer is the same form as any other."""
    if sc.head is not None or sc.masked:
        raise Reject("the score is summed over a dimension that is not the indexer's head dimension", node)
    head = new_label()
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
        return replace(sc, virtual_query=new_label())
    return sc


# ---------------------------------------------------------------------------------------------
# elementwise factors, masks
def _sum(node: fx.Node, s_dim: int) -> Score:
    _check_sum_dtype(node)
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
    sc = narrow(interpret(node.args[0], in_s), node)
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
    sc = _sum(node, s_dim)
    size = dim_size(sc, sc.head)
    if not isinstance(size, int) or size < 1:
        raise Reject("the score is averaged over a dimension of symbolic size", node)
    return scaled(replace(sc, nodes=sc.nodes[:-1]), node, 1.0 / size)


def _check_sum_dtype(node: fx.Node) -> None:
    """A head sum or mean with a ``dtype``: its input's dtype, or float32 (an upcast, as ``.float()`` before it), is
    the op's arithmetic; float64 is more precise than the op, a 16-bit dtype rounds where the op does not."""
    dt, given = node.kwargs.get("dtype"), dtype(node.args[0])
    if dt is not None and dt != given and dt != torch.float32:
        raise Reject(f"the score is {'summed' if op_name(node) == 'sum' else 'averaged'} over the heads in {dt}; "
                     "the selection computes in float32", node)


HANDLERS.update({"einsum": _contraction, "matmul": _contraction, "sum": _sum, "mean": _mean})
