"""Views of the index expression: permutes and transposes, size-1 moves (unsqueeze, squeeze, views, ``[None]``),
a query dim split back into the query and head dims it was flattened from, and identities (``contiguous``,
``clone``, ``detach``: gradient boundaries are the legality checks' concern, values pass through).
"""

from __future__ import annotations

from dataclasses import replace

from torch import fx

from .expr import (
    HANDLERS,
    Reject,
    Score,
    interpret,
    new_label,
)
from .graph_ops import (
    is_one,
    is_tensor,
    named_arg,
    normalize_dim,
    op_name,
    same_size,
    shape,
)


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
    new = tuple(new_label() for _ in sizes)
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


HANDLERS.update({
    "detach": _identity,
    "identity": _identity,
    "transpose": _permute,
    "permute": _permute,
    "unsqueeze": _reshape_like,
    "squeeze": _reshape_like,
    "reshape": _reshape_like,
    "getitem": _getitem,
})
