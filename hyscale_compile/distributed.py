"""Context-parallel indexer selection on ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Layout (the usual context-parallel one): a sequence of L tokens is split into ``world`` contiguous
chunks; rank r holds the T = L / world queries at global positions [r*T, (r+1)*T) and the indexer
keys ``kx`` of the same positions. A query at global position p sees the keys 0..p, so rank r needs
the keys of ranks 0..r. Keys are small (S x D against the [T, S] score table), so every rank
all-gathers them and runs selection with its global ``query_offset = r*T``:

    values, indices = cp_indexer_topk(q_local, kx_local, k, weights=w_local, scale=s)

Causal work grows with the position, so with contiguous chunks the last rank does the most
(with 2 ranks, rank 1 scores 3x the key-query pairs of rank 0). ``layout="zigzag"`` balances it:
the sequence is cut into 2*world chunks of c = T/2 and rank r holds chunks r and 2*world-1-r
(queries and keys alike); every rank then scores the same number of pairs. Measured on 2 gloo CPU
ranks (L=4096): slowest/fastest rank 1.74 contiguous, 1.15 zigzag; slowest rank 25% faster.

``indices`` are global key positions; each row equals the single-process result for that row
(indices identical, values bitwise) because the score of (t, s) does not depend on which other
keys are scored with it (the operator contract's "one arithmetic").

Overlap, two ways:

* ``start_key_gather(kx_local)`` right after the keys are computed, other work (the query and
  weight projections), then ``cp_indexer_topk(..., keys=handle)``: the gather hides behind work
  the model does anyway, at no extra cost. This is the recommended one.
* ``overlap=True``: while the gather is in flight the rank selects over its *own* keys (the
  diagonal block, causal with offset 0); once it lands, over the keys of lower ranks (all
  visible); then it merges the two exact top-k lists by (value desc, position asc). The top k of
  a union is inside the union of the parts' top k under the same total order, so the merge is
  exact. It costs a second selection launch and a merge of 2k candidates per row, and the gather
  it hides is small (S x D): on 2 gloo CPU ranks (L=4096, H=4, D=32, k=64) the gather took
  0.6 ms next to 1-2 s of selection, so there was nothing to win and the split's extra work made
  the call 4-20% slower or faster at random (noise of a shared machine). On GPUs it can gain at
  most the gather time (64 MiB at L=262144, D=128, bf16: well under a millisecond over NVLink);
  off by default. ``benchmarks/context_parallel.py`` measures both sides.

Gradients: when ``kx_local`` requires grad, the gathered keys carry a backward that
reduce-scatters their gradient back to the ranks that own them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .lowering.api import indexer_topk
from .runtime.reference import order_key

__all__ = ["KeyGather", "cp_indexer_topk", "gather_keys", "gather_sequence", "global_positions", "merge_topk",
           "query_offset", "rank_segments", "start_key_gather"]


# ---------------------------------------------------------------------------------------------
# positions


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def query_offset(local_len: int, group: dist.ProcessGroup | None = None) -> int:
    """Global position of this rank's first query: ``rank * local_len``."""
    rank, _ = _rank_world(group)
    return rank * local_len


_LAYOUTS = ("contiguous", "zigzag")


def rank_segments(rank: int, world: int, local_len: int, layout: str = "contiguous") -> list[tuple[int, int, int]]:
    """Rank ``rank``'s rows as (local start, global start, length) runs of consecutive positions."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    if layout == "zigzag":
        if local_len % 2:
            raise ValueError(f"zigzag layout needs an even number of local tokens, got {local_len}")
        c = local_len // 2
        return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]
    raise ValueError(f"unknown layout {layout!r}; expected one of {_LAYOUTS}")


def global_positions(local_len: int, group: dist.ProcessGroup | None = None,
                     device: torch.device | str | None = None, layout: str = "contiguous") -> Tensor:
    """Global positions of this rank's ``local_len`` tokens, as an int64 tensor.

    contiguous: [rank*T, (rank+1)*T); zigzag: chunks rank and 2*world-1-rank of length T/2.
    Handy for sharding inputs (``x[:, global_positions(T, layout=...)]``) and for building masks
    from global positions in plain PyTorch, e.g. ``torch.arange(S)[None] <= global_positions(T)[:, None]``.
    """
    rank, world = _rank_world(group)
    return torch.cat([torch.arange(g, g + n, device=device, dtype=torch.int64)
                      for _, g, n in rank_segments(rank, world, local_len, layout)])


def _to_global_order(gathered: Tensor, world: int, layout: str) -> Tensor:
    """Gathered keys (rank order) -> global position order. Differentiable (a flip and a concat)."""
    if layout == "contiguous":
        return gathered
    B, S, D = gathered.shape
    halves = gathered.reshape(B, world, 2, S // (2 * world), D)
    # Chunk j < world is rank j's first half; chunk j >= world is rank 2*world-1-j's second half.
    return torch.cat([halves[:, :, 0], halves[:, :, 1].flip(1)], dim=1).reshape(B, S, D)


# ---------------------------------------------------------------------------------------------
# key gather (forward: all-gather; backward: reduce-scatter)

# ``all_gather_single`` replaced ``all_gather_into_tensor`` in recent torch; use whichever exists.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class KeyGather:
    """An in-flight key gather (from ``start_key_gather``): the output buffer and the work to wait on."""

    def __init__(self, kx_local: Tensor, send: Tensor, buf: Tensor, work: dist.Work | None,
                 group: dist.ProcessGroup | None) -> None:
        self.kx_local, self.buf, self.work, self.group = kx_local, buf, work, group
        self.send = send  # keep the send buffer alive until the gather has landed

    def wait(self) -> Tensor:
        """Block until the gather lands; returns the keys of all ranks as [B, world*S_local, D]."""
        if self.work is not None:
            self.work.wait()
            self.work, self.send = None, None
        # buf is [world*S_local, B, D] (gathered along dim 0); for B == 1 the transpose is free.
        return self.buf.transpose(0, 1)


def _start_gather(kx_local: Tensor, group: dist.ProcessGroup | None, async_op: bool) -> KeyGather:
    _, world = _rank_world(group)
    B, S_local, D = kx_local.shape
    # Gather along the sequence: put it first so the ranks' chunks concatenate on dim 0.
    send = kx_local.detach().transpose(0, 1).contiguous()
    buf = send.new_empty((world * S_local, B, D))
    work = _all_gather(buf, send, group=group, async_op=async_op)
    return KeyGather(kx_local, send, buf, work if async_op else None, group)


class _AttachKeyGrad(torch.autograd.Function):
    """Identity on already-gathered keys whose backward reduce-scatters the gradient to the owners."""

    @staticmethod
    def forward(ctx, kx_local: Tensor, gathered: Tensor, group) -> Tensor:
        ctx.group = group
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad: Tensor):
        _, world = _rank_world(ctx.group)
        B, S, D = grad.shape
        send = grad.transpose(0, 1).contiguous()  # [S, B, D]: chunks of S_local rows per rank
        out = send.new_empty((S // world, B, D))
        _reduce_scatter(out, send, group=ctx.group)
        return out.transpose(0, 1), None, None


def _with_grad(kx_local: Tensor, gathered: Tensor, group) -> Tensor:
    if torch.is_grad_enabled() and kx_local.requires_grad:
        return _AttachKeyGrad.apply(kx_local, gathered, group)
    return gathered


def gather_keys(kx_local: Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous") -> Tensor:
    """All ranks' keys [B, world*S_local, D] in global position order (differentiable: backward reduce-scatters)."""
    _, world = _rank_world(group)
    gathered = _with_grad(kx_local, _start_gather(kx_local, group, async_op=False).wait(), group)
    return _to_global_order(gathered, world, layout)


def start_key_gather(kx_local: Tensor, group: dist.ProcessGroup | None = None) -> KeyGather:
    """Issue the key all-gather now (async); pass the handle as ``cp_indexer_topk(..., keys=handle)``.

    Every rank of ``group`` must call it. Do other work in between to hide the gather.
    """
    return _start_gather(kx_local, group, async_op=True)


def gather_sequence(x_local: Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> Tensor:
    """All ranks' chunks of ``x_local`` concatenated along ``dim``, for use *inside* torch.compile.

    Built on torch's functional collectives, which Dynamo traces into the graph (no graph break)
    and which are differentiable (backward: reduce-scatter). A model under context parallelism
    gathers its indexer keys with it and writes the rest of the indexer in plain PyTorch with a
    global-position causal mask; the selection pass rewrites that site as usual. The result is
    contiguous, which the operators' saved tensors expect.
    """
    from torch.distributed import _functional_collectives as fc

    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return gather(x_local, dim, group if group is not None else dist.group.WORLD)


# ---------------------------------------------------------------------------------------------
# exact merge of two top-k lists


def merge_topk(values_a: Tensor, indices_a: Tensor, values_b: Tensor, indices_b: Tensor,
               k: int, *, ordered: bool = False) -> tuple[Tensor, Tensor]:
    """The k best of two top-k lists over disjoint key sets, by (value desc, position asc).

    Uses the operator's own order (``order_key``: NaN highest, -0.0 == +0.0), so the result is the
    top k of the union exactly as one selection over all keys would return it.
    ``ordered=True`` promises that both lists are sorted (value desc, position asc) and that every
    position of ``a`` is below every position of ``b``; one stable sort then suffices (half the work).
    """
    values = torch.cat([values_a, values_b], dim=-1)
    indices = torch.cat([indices_a, indices_b], dim=-1)
    if not ordered:
        # Stable sort by position first, so the stable sort by value keeps positions ascending on ties.
        by_pos = indices.argsort(dim=-1, stable=True)
        values, indices = values.gather(-1, by_pos), indices.gather(-1, by_pos)
    by_val = torch.sort(order_key(values), dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, by_val), indices.gather(-1, by_val)


# ---------------------------------------------------------------------------------------------
# context-parallel selection


def _visible_len(rank: int, T: int, S: int, k: int) -> int:
    """Keys a rank must pass to selection: up to its last query (rank+1)*T, and at least k.

    Rows with fewer than k visible keys fill with the lowest masked positions, exactly as the
    single-process result does, so at least k keys must be present.
    """
    return min(S, max((rank + 1) * T, k))


def _can_overlap(rank: int, T: int, S_local: int, k: int) -> bool:
    # The split (lower ranks' keys | own keys) covers every visible key only when queries and keys
    # are sharded alike; both parts together must hold k keys for rows short of visible keys.
    return rank > 0 and T == S_local and k <= S_local


def cp_indexer_topk(q_local: Tensor, kx_local: Tensor, k: int, group: dist.ProcessGroup | None = None, *,
                    weights: Tensor | None = None, scale: float = 1.0, relu: bool = True,
                    keys: KeyGather | None = None, overlap: bool = False, layout: str = "contiguous",
                    sorted: bool = True) -> tuple[Tensor, Tensor]:
    """Causal indexer top-k for this rank's query chunk under context parallelism.

    q_local [B, T, H, D] at global positions [rank*T, (rank+1)*T); kx_local [B, S_local, D] this
    rank's keys (global positions [rank*S_local, (rank+1)*S_local)); weights [B, T, H] or None.
    Every rank of ``group`` must call it (it runs a collective). Returns (values fp32 [B, T, k],
    global indices int64 [B, T, k]), equal to rows [rank*T, (rank+1)*T) of the single-process
    ``indexer_topk(q, kx, k, query_offset=0, ...)``.
    keys: a gather already issued with ``start_key_gather(kx_local)`` (else one is issued here).
    overlap: select over the own keys while the gather is in flight, then merge (see the module notes;
    contiguous layout only).
    layout: "contiguous" as above, or "zigzag" (load-balanced): q_local and kx_local hold the rows of
    ``global_positions(T, layout="zigzag")``, and so do the returned rows.
    ``sorted=False`` is honoured only on the non-overlapped path (the merge always sorts).
    """
    if layout != "contiguous":
        return _cp_select_segments(q_local, kx_local, k, group, weights, scale, relu, keys, layout, sorted)
    rank, world = _rank_world(group)
    T, S_local = q_local.shape[1], kx_local.shape[1]
    S = world * S_local
    torch._check(k <= S, lambda: f"cp_indexer_topk: k={k} is larger than the number of keys S={S}")
    offset = rank * T
    kw = dict(weights=weights, scale=scale, relu=relu)
    if keys is not None and keys.kx_local is not kx_local:
        raise ValueError("cp_indexer_topk: keys= must come from start_key_gather(kx_local) of this kx_local")
    pending = keys if keys is not None else start_key_gather(kx_local, group)
    needs_grad = torch.is_grad_enabled() and kx_local.requires_grad
    if overlap and rank == 0 and k <= S_local and T == S_local and not needs_grad:
        # Rank 0 sees only its own keys: select now, wait only to complete the collective.
        # (With grad it takes the gathered path so every rank joins the backward reduce-scatter.)
        out = indexer_topk(q_local, kx_local, k, query_offset=0, sorted=sorted, **kw)
        pending.wait()
        return out
    if not (overlap and _can_overlap(rank, T, S_local, k)):
        visible = _with_grad(kx_local, pending.wait(), group)[:, :_visible_len(rank, T, S, k)]
        return indexer_topk(q_local, visible, k, query_offset=offset, sorted=sorted, **kw)
    # While the gather is in flight: the diagonal block (own keys, causal, same local offset 0).
    v_own, i_own = indexer_topk(q_local, kx_local, k, query_offset=0, **kw)
    before = _with_grad(kx_local, pending.wait(), group)[:, :rank * S_local]
    # Keys of lower ranks are all visible to every local query; query_offset keeps the mask exact anyway.
    v_low, i_low = indexer_topk(q_local, before, min(k, before.shape[1]), query_offset=offset, **kw)
    # Lower ranks' positions all precede this rank's: the cheap ordered merge applies.
    return merge_topk(v_low, i_low, v_own, i_own + rank * S_local, k, ordered=True)


def _cp_select_segments(q_local: Tensor, kx_local: Tensor, k: int, group, weights: Tensor | None, scale: float,
                        relu: bool, keys: KeyGather | None, layout: str, sorted: bool) -> tuple[Tensor, Tensor]:
    """Any layout: one selection per run of consecutive positions, over the keys in global order."""
    rank, world = _rank_world(group)
    T, S_local = q_local.shape[1], kx_local.shape[1]
    if S_local != T:
        raise ValueError(f"cp_indexer_topk: layout={layout!r} needs keys sharded like queries (S_local == T), "
                         f"got S_local={S_local}, T={T}")
    S = world * S_local
    torch._check(k <= S, lambda: f"cp_indexer_topk: k={k} is larger than the number of keys S={S}")
    if keys is not None and keys.kx_local is not kx_local:
        raise ValueError("cp_indexer_topk: keys= must come from start_key_gather(kx_local) of this kx_local")
    pending = keys if keys is not None else start_key_gather(kx_local, group)
    ordered = _to_global_order(_with_grad(kx_local, pending.wait(), group), world, layout)
    values, indices = [], []
    for local, first, n in rank_segments(rank, world, T, layout):
        rows = slice(local, local + n)
        w = weights[:, rows] if weights is not None else None
        # Keys up to the run's last query (and at least k, for rows short of visible keys).
        visible = ordered[:, :min(S, max(first + n, k))]
        v, i = indexer_topk(q_local[:, rows], visible, k, weights=w, scale=scale, relu=relu,
                            query_offset=first, sorted=sorted)
        values.append(v)
        indices.append(i)
    return torch.cat(values, dim=1), torch.cat(indices, dim=1)
