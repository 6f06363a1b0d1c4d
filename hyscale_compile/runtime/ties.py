"""HyTopK's tie stage: a row whose threshold sits on a tie group takes the group's winners in position order.

Ties go to the lowest positions, so of the keys scoring exactly the threshold only the lowest
``k - count`` can rank, where ``count`` is how many keys score above it (the filter appended those, and
nothing else, on a tie row: ``sample.Thresholds``). One program per query block walks the block's key
tiles from its first position up, scores them with the one arithmetic, and appends each tie row's entries
equal to its threshold, in position order, until the row has k candidates; it stops as soon as every row of
the block has its share. For an all-equal row that is k keys, a few tiles, where passing the whole group
through the filter overflowed the row and sent it to recovery. A row whose group turns out too small keeps
fewer than k candidates and is flagged by the check as before.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .plan import Plan
from .problem import Problem
from .sample import Thresholds
from .score_tile import block_rows, order_key, raw_entry, score_tile, tile_values


@triton.jit
def tie_fill_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, thr_ptr, tie_ptr, cnt_ptr, buf_ptr, mask_ptr, bias_ptr,
                    T, S, H, scale, fill, k, C, stride,
                    sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                    ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """cnt[r] counts the entries above row r's threshold (all appended, or more than C); a tie row with fewer
    than k appends its lowest-position entries equal to the threshold after them (never past slot C) and
    cnt[r] grows by as many."""
    b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    tie = tl.load(tie_ptr + rid, mask=row_ok, other=0) != 0
    cnt = tl.load(cnt_ptr + rid, mask=row_ok, other=0)
    need = tl.where(tie & (cnt < k), k - cnt, 0)
    if tl.max(need, axis=0) > 0:
        room = tl.maximum(tl.minimum(C - cnt, need), 0)
        thr = tl.load(thr_ptr + rid, mask=row_ok, other=0)
        q_rows = b * sqb + rows_t * sqt
        w_rows = b * swb + rows_t * swt
        kx_b = kx_ptr + b * skb
        rows_b = rows_t * 0 + b
        first = tl.min(tl.where(need > 0, lo, S), axis=0)
        tile = first // BS
        tile1 = (bhi + BS - 1) // BS
        got = tl.zeros((BT,), dtype=tl.int32)
        while (tile < tile1) & (tl.max(tl.where(got < need, 1, 0), axis=0) > 0):
            cols = tile * BS + tl.arange(0, BS).to(tl.int64)
            col_ok = cols < S
            acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, col_ok,
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC)
            val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                        mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            eq = in_range & (order_key(val) == thr[:, None]) & (got < need)[:, None]
            slot = got[:, None] + tl.cumsum(eq.to(tl.int32), axis=1) - 1  # position order within the row
            keep = eq & (slot < room[:, None])
            tl.store(buf_ptr + rid[:, None] * stride + (cnt[:, None] + slot), raw_entry(val, cols), mask=keep)
            got += tl.sum(eq.to(tl.int32), axis=1)
            tile += 1
        tl.store(cnt_ptr + rid, cnt + tl.minimum(got, room), mask=row_ok & (need > 0))


def fill_ties(pb: Problem, plan: Plan, thresholds: Thresholds, cnt: Tensor, buf: Tensor) -> None:
    """Append each tie row's lowest-position entries equal to its threshold after what the filter appended
    (one program a query block; blocks without a tie row return at once)."""
    if not plan.sampled:
        return  # no row has a threshold, so none a tie
    pb.launch(tie_fill_kernel, (pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, thresholds.key, thresholds.tie,
              cnt, buf, pb.mask, pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, plan.k, plan.capacity, buf.shape[1])

