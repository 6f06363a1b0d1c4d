"""Step 1 of the selection pass: the sites.

A site is a ``topk`` (or a descending ``sort`` / ``argsort`` read only through ``[..., :k]`` slices) over a
tensor of this graph, with the nodes that read its values and indices and the gathers of the score at the
selected indices (``gather`` / ``take_along_dim``), which are the selected values too. This module also
says what the rest of the graph does with the indices (``order_free``, ``dense_scatter_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

from .graph_ops import arg, dtype, named_arg, normalize_dim, op_name, shape, value
from .index_expr import Reject
from .report import symbolic_bytes

SELECTIONS = ("topk", "sort", "argsort")


@dataclass
class Site:
    topk: fx.Node
    score_node: fx.Node
    s_dim: int
    k: object  # an int or a node holding a SymInt
    sorted: bool
    values: list[fx.Node]  # getitem(topk, 0)
    indices: list[fx.Node]  # getitem(topk, 1)
    gathers: list[fx.Node]  # score.gather(s_dim, indices)
    extra: tuple[fx.Node, ...] = ()  # other nodes of the selection to erase (a sort's getitems)
    k_at_most_keys: bool = False  # a slice [..., :k] of a sort: k = min(k, S), S symbolic
    select: fx.Node | None = None  # the hyscale.select node the rewrite inserted


def find(node: fx.Node) -> Site:
    """The site of a ``topk`` / ``sort`` / ``argsort`` node (Reject when it is not one we can rewrite)."""
    name = op_name(node)
    if name == "topk":
        return _topk_site(node)
    return _sort_site(node)


def describe(node: fx.Node) -> str:
    """How a node reads in a reason: its function or method name, or "the graph output"."""
    if node.op == "output":
        return "the graph output"
    name = getattr(node.target, "__name__", str(node.target))
    if name == "tag_activation_checkpoint":  # a region's body writes its inputs in the caller's tensors
        return "a checkpointed region (torch.utils.checkpoint)"
    return name


def _input_and_dim(node: fx.Node) -> tuple[fx.Node, int, int]:
    """The selected tensor, its rank and the (non-negative) dim selected along."""
    score = arg(node, 0, "input")
    if not isinstance(score, fx.Node) or shape(score) is None:
        raise Reject(f"the {op_name(node)} input is not a tensor of this graph", node)
    ndim = len(shape(score))
    dim = named_arg(node, "dim", -1)
    if not isinstance(dim, int):
        raise Reject(f"the {op_name(node)} dim is not a constant", node)
    return score, ndim, normalize_dim(dim, ndim)


def _writes_out(node: fx.Node) -> bool:
    return node.kwargs.get("out") is not None


def _sort_site(node: fx.Node) -> Site:
    """``sort(score, descending=True)`` / ``argsort(...)`` read only through ``[..., :k]`` slices: a top-k, ties
    by position."""
    name = op_name(node)
    score, ndim, s_dim = _input_and_dim(node)
    if _writes_out(node) or not named_arg(node, "descending", False):
        raise Reject(f"the {name} is not a descending {name}", node)
    parts, ks = ([], []), set()
    # argsort returns the indices themselves; sort a (values, indices) pair read through getitem
    outputs = [(node, 1)] if name == "argsort" else []
    for user in node.users if name == "sort" else ():
        if op_name(user) != "getitem" or user.args[1] not in (0, 1):
            raise Reject(f"the sort result is used by {describe(user)} directly", node)
        outputs.append((user, user.args[1]))
    for out, which in outputs:
        for sl in out.users:
            k = _leading_slice(sl, s_dim, ndim)
            if k is None:
                raise Reject(f"the sorted {'scores or ' if name == 'sort' else ''}indices are read beyond a leading "
                             "[..., :k] slice", node)
            ks.add(k)
            parts[which].append(sl)
    size = shape(score)[s_dim]
    if len(ks) != 1:
        raise Reject(f"the {name} is sliced to different lengths ({sorted(ks)})", node)
    k = ks.pop()
    if not isinstance(size, int):  # the slice takes min(k, S) entries: the rewrite computes that from S
        gathers = [u for u in score.users if u is not node and _is_gather_at(u, score, s_dim, ndim, parts[1])]
        return Site(node, score, s_dim, k, True, parts[0], parts[1], gathers,
                    extra=tuple(node.users) if name == "sort" else (), k_at_most_keys=True)
    k = min(k, size)
    gathers = [u for u in score.users if u is not node and _is_gather_at(u, score, s_dim, ndim, parts[1])]
    extra = tuple(node.users) if name == "sort" else ()
    return Site(node, score, s_dim, k, True, parts[0], parts[1], gathers, extra=extra)


def _leading_slice(node: fx.Node, s_dim: int, ndim: int) -> int | None:
    """k when ``node`` is ``x[..., :k]`` on ``s_dim`` (every other dim whole), else None."""
    if op_name(node) != "getitem":
        return None
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if Ellipsis in idx:
        i = idx.index(Ellipsis)
        idx = idx[:i] + (slice(None),) * (ndim - len(idx) + 1) + idx[i + 1:]
    if len(idx) < ndim:
        idx = idx + (slice(None),) * (ndim - len(idx))
    if len(idx) != ndim or not all(isinstance(x, slice) for x in idx):
        return None
    for d, x in enumerate(idx):
        if d == s_dim:
            if x.start not in (None, 0) or x.step not in (None, 1) or not isinstance(x.stop, int) or x.stop < 0:
                return None
        elif x != slice(None):
            return None
    return idx[s_dim].stop


def _topk_site(node: fx.Node) -> Site:
    score, ndim, s_dim = _input_and_dim(node)
    if _writes_out(node):
        raise Reject("top-k writes into out= tensors", node)
    if not named_arg(node, "largest", True):
        raise Reject("top-k with largest=False selects the lowest scores", node)
    k = named_arg(node, "k")
    if isinstance(k, fx.Node) and not isinstance(value(k), torch.SymInt):
        raise Reject("k is a tensor (e.g. a registered buffer), so the output size is data-dependent; hold it as "
                     "a Python int (self.index_topk = int(...))", node)
    if not isinstance(k, int | fx.Node):
        raise Reject(f"k is {type(k).__name__}, not an int", node)
    values, indices = [], []
    for user in node.users:
        if op_name(user) != "getitem" or user.args[1] not in (0, 1):
            raise Reject(f"the top-k result is used by {describe(user)} directly", node)
        (values if user.args[1] == 0 else indices).append(user)
    gathers = [u for u in score.users if u is not node and _is_gather_at(u, score, s_dim, ndim, indices)]
    return Site(node, score, s_dim, k, bool(named_arg(node, "sorted", True)), values, indices, gathers)


def gather_index(user: fx.Node) -> object:
    """The index a ``gather`` / ``take_along_dim`` reads."""
    return arg(user, 1, "indices") if op_name(user) == "take_along_dim" else named_arg(user, "index")


def _is_gather_at(user: fx.Node, score: fx.Node, s_dim: int, ndim: int, indices: list[fx.Node]) -> bool:
    """``score.gather(s_dim, idx)`` or ``take_along_dim(score, idx, s_dim)`` at the site's own indices."""
    if op_name(user) == "take_along_dim":
        src, index, dim = arg(user, 0, "input"), gather_index(user), arg(user, 2, "dim")
    elif op_name(user) == "gather" and not user.kwargs.get("sparse_grad"):  # sparse: eager's backward raises
        src, index, dim = named_arg(user, "input"), gather_index(user), named_arg(user, "dim")
    else:
        return False
    if src is not score or _writes_out(user):
        return False
    return isinstance(dim, int) and normalize_dim(dim, ndim) == s_dim and index in indices


# ---------------------------------------------------------------------------------------------
# what the graph does with the indices


def order_free(site: Site) -> bool:
    """Nothing downstream sees the order of the selected entries: no value is read, and the indices
    (through dtype casts) only say where a constant is scattered along the selected dim, as in DSA's
    ``full(-inf).scatter_(-1, idx, 0)``, or lend their device (HF's ``idx.new_ones(...)``). A row's
    indices are distinct, so every order writes the same tensor, and the op may skip its final sort."""
    if site.values or site.gathers:
        return False
    return all(_reads_metadata_only(user, n) or _scatters_constant_at(user, n, site.s_dim)
               for user, n in index_readers(site))


def index_readers(site: Site) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(reader, the index node it reads) for every reader of the selected indices, through dtype casts
    (.long(), .to(torch.int32)). A reader reached from two index-derived nodes comes once for each."""
    todo, seen = list(site.indices), set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if (user, n) in seen:
                continue
            seen.add((user, n))
            if op_name(user) == "to":
                todo.append(user)
            else:
                yield user, n


# Methods that read only a tensor's shape, dtype or device (HF builds its index mask with new_ones).
_METADATA_METHODS = {"new_ones", "new_zeros", "new_empty", "new_full", "size", "dim"}


def _reads_metadata_only(node: fx.Node, index: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _METADATA_METHODS and node.args[0] is index
            and index not in node.args[1:] and index not in node.kwargs.values())


def _scatters_constant_at(node: fx.Node, index: fx.Node, s_dim: int) -> bool:
    """``x.scatter(dim, index, c)`` / ``scatter_`` with a number c along s_dim (not scatter_add or reduce)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if op_name(node) != "scatter" or name not in ("scatter", "scatter_") or "reduce" in node.kwargs:
        return False
    if len(node.args) > 4 or arg(node, 2, "index") is not index or shape(index) is None:
        return False
    dim, value_ = arg(node, 1, "dim"), arg(node, 3, "value", node.kwargs.get("src"))
    if not isinstance(dim, int) or not isinstance(value_, int | float):  # a bool is an int too
        return False
    return normalize_dim(dim, len(shape(index))) == s_dim


def dense_scatter_bytes(site: Site) -> int | None:
    """Bytes of dense tensors the model scatters the selected indices into (e.g. HF's [B, T, S] index mask).

    That mask is the model's own choice and stays; the report makes its cost visible.
    """
    total = 0
    for user, n in index_readers(site):  # a scatter reads one index node: counted once
        if op_name(user) == "scatter" and arg(user, 2, "index") is n:
            b = symbolic_bytes(*shape(user)) if shape(user) is not None else None
            if b is not None:
                total += b * dtype(user).itemsize
    return total or None
