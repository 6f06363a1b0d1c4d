"""HyTopK's table route for small problems: write the composite table, then rank it (``torch.topk``, or ours).

The pipeline (sample, threshold, filter, ties, check, recovery, final select, sort) never writes the score
table, which is what matters where the table is large; but its launches and their host work are a fixed cost
of every call, and at decode sizes (one or a few query rows against a long context) that fixed cost is most
of the call. There the table is small, and writing it is cheaper than the launches it saves
(``plan.TABLE_MAX_BYTES`` draws the line; ``plan.Plan.table`` says which route a call takes).

One kernel scores every key of every row with the pipeline's arithmetic (the filter's ``tile_scores``: the
same tile shape, the same ``score_tile``, hence the same bits), applies the visibility with ``tile_values``
(out-of-range and masked positions get the fill, as the pipeline's extras and masked entries do) and writes
each entry's unique int64 ``composite`` (order key high, 2**32 - 1 - position low) into a [B, T, S] table.
``torch.topk`` over the composites is exact and deterministic whatever its tie rule (no two are equal), and
``final_sort.values`` (a second, tiny launch) turns the winners back into canonical fp32 values, exactly as
the final select does, and torch.topk's indices are the positions (the table's columns): the result is the
pipeline's, bit for bit, fill values and positions of short rows included (every position competes with its
value; of the masked ones, ranked by position, the lowest win, which are the ones the pipeline's extras hold).

Where its sort holds the k winners (``plan.table_ranker``), ``table_rank.rank`` ranks the table instead of
torch.topk and the values launch: one launch (three for long rows) in place of torch.topk's some 34 over int64,
with the same bits (the top k of unique composites, sorted, decoded as the final select decodes them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .env import multiprocessors
from .filter import tile_scores
from .final_sort import values
from .plan import Plan
from .problem import Problem, cdiv
from .score_tile import block_rows, block_rows_from, composite, order_key, tile_values
from .table_rank import rank, split_keys


@triton.jit(do_not_specialize=["first"])
def table_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, mask_ptr, bias_ptr,
                 T, S, H, scale, fill, out_stride, zero_ptr, n_zero, first,
                 sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                 ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, RANGES_FROM_FIRST: tl.constexpr):
    """out[r, s] = composite(order_key(value[r, s]), s) for key tile program_id(0) of one query block.

    Values as the pipeline computes them: the filter's score tile (pointer loads), then ``tile_values``
    (bias added, bool mask and the row's [lo, hi) range replaced by the fill). A tile outside every row's
    range of the block is all fill and is not scored. The first program also zeroes int32 zero[:n_zero] (the split
    ranker's counters, read after this launch: a launch fewer than a fill of their own).
    """
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2)
    if (tile == 0) & (b == 0) & (pid_t == 0):
        for z in range(0, n_zero, 256):
            offs = z + tl.arange(0, 256)
            tl.store(zero_ptr + offs, tl.zeros([256], dtype=tl.int32), mask=offs < n_zero)
    if RANGES_FROM_FIRST:
        rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows_from(pid_t, b, T, first, S, BT)
    else:
        rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    cols = tile * BS + tl.arange(0, BS).to(tl.int64)
    col_ok = cols < S
    acc = tl.zeros((BT, BS), dtype=tl.float32)
    if (tile * BS < bhi) & (tile * BS + BS > blo):
        q_rows = b * sqb + rows_t * sqt
        w_rows = b * swb + rows_t * swt
        cols, col_ok, acc = tile_scores(q_ptr, kx_ptr + b * skb, w_ptr, q_rows, w_rows, row_ok, tile, b, S, H, sks,
                                        sqh, swh, scale, 0, None, None, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, False)
    val, _ = tile_values(acc, rows_t * 0 + b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                         mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
    tl.store(out_ptr + rid[:, None] * out_stride + cols[None, :], composite(order_key(val), cols[None, :]),
             mask=row_ok[:, None] & col_ok[None, :])


def composites(pb: Problem, zero: Tensor | None = None) -> Tensor:
    """The int64 composite table [B, T, S] of every entry (what ``select`` ranks): row b * T + t of the
    kernel's [R, S] (shaped so, torch.topk gives [B, T, k] with no view to make). ``zero`` (contiguous int32), if
    given, is zeroed by the same launch."""
    comp = torch.empty(pb.B, pb.T, pb.S, dtype=torch.int64, device=pb.device)
    first = pb.first
    lo, hi = (pb.lo, pb.hi) if first is None else (pb.dummy, pb.dummy)
    pb.launch(table_kernel, (cdiv(pb.S, pb.tile.bs), pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, lo, hi, comp,
              pb.mask, pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, pb.S, comp if zero is None else zero,
              0 if zero is None else zero.numel(), 0 if first is None else first,
              RANGES_FROM_FIRST=first is not None)
    return comp


def select(pb: Problem, plan: Plan, sorted: bool = True) -> tuple[Tensor, Tensor]:
    """(values fp32 [B, T, k], positions int64 [B, T, k]) of each row's top plan.k, ordered by (value desc,
    position asc), or with sorted=False the same entries in torch.topk's unspecified order (sorted all the same
    where our ranker ranks the table: its sort is part of its one launch)."""
    if plan.ranker == "row":
        return rank(composites(pb), plan.k)
    if plan.ranker == "split":
        counts = torch.empty(pb.rows, 2, dtype=torch.int32, device=pb.device)  # zeroed by the table's launch
        split = split_keys(pb.rows, pb.S, multiprocessors(pb.device))
        return rank(composites(pb, counts), plan.k, split=split, counts=counts)
    top = torch.topk(composites(pb), plan.k, dim=-1, sorted=sorted)
    return values(top.values), top.indices  # the table's column is the position: no decode needed
