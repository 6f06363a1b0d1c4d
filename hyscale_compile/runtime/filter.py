"""HyTopK's score + filter stage: score tiles on chip, keep only the entries that pass the row threshold.

One program walks the key tiles of one query block (every SPLIT-th tile from its own): it computes each
[BT, BS] score tile with ``score_tile`` (the one arithmetic) and appends the (value, position) entries
at or above their row's threshold to the row's candidate buffer (``filter_append``). It writes nothing
else: the score table is never stored. The walk's steps (``block_tiles``, ``tile_scores``,
``keep_passing``) are the benchmarks' too: their floor and compare-only kernels walk the same grid
with the same tiles (benchmarks/floor.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .filter_append import OK_ALL, OK_RANGE, OK_TILE, append_passing
from .plan import Plan
from .problem import Problem
from .score_tile import MASK_KEYS, block_rows, key_value, key_visible, score_tile, tile_values


@triton.jit
def filter_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, thr_ptr, cnt_ptr, out_ptr, mask_ptr, bias_ptr,
                  T, S, H, scale, fill, C, out_stride, SPLIT,
                  sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                  APPEND: tl.constexpr = 1, ASM: tl.constexpr = False, TMA: tl.constexpr = False,
                  q_desc=None, k_desc=None):
    """Append (value, position) entries passing the row threshold to the row's buffer; count them all.

    The threshold is compared as a float (x >= thr, or x is NaN: the order_key order without
    computing keys). Tiles inside every row's range, with no mask or bias (or a mask of the key alone, read
    once per tile: ``keep_passing``), skip the range test.
    TMA: q and kx through the descriptors of ``tma_views`` (2-D: rows b * T + t and b * S + s).
    """
    split, b, pid_t, rows_t, row_ok, rid, lo, hi, tile0, tile1 = block_tiles(T, S, lo_ptr, hi_ptr, BT, BS)
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    lo_all, hi_all = common_range(row_ok, lo, hi, S)
    thr = key_value(tl.load(thr_ptr + rid, mask=row_ok, other=0))
    q_row0 = (b * T + pid_t * BT).to(tl.int32)
    for tile in range(tile0 + split, tile1, SPLIT):
        cols, col_ok, acc = tile_scores(q_ptr, kx_b, w_ptr, q_rows, w_rows, row_ok, tile, b, S, H, sks, sqh, swh,
                                        scale, q_row0, q_desc, k_desc, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, TMA)
        keep_passing(acc, tile, cols, col_ok, b, rows_b, rows_t, row_ok, rid, lo, hi, lo_all, hi_all, thr, fill,
                     mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, cnt_ptr, out_ptr, C, out_stride, thr,
                     _append, APPEND, ASM, HAS_MASK, HAS_BIAS, BT, BS)  # no carry: thr passes through


@triton.jit
def block_tiles(T, S, lo_ptr, hi_ptr, BT: tl.constexpr, BS: tl.constexpr):
    """This program's part of the filter's grid: its key split (the fastest grid dimension: the programs
    running together share one query block's q in L2), batch and query block; the block's rows and
    their ranges; and the key tiles [tile0, tile1) that the ranges cover."""
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2)
    rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    return split, b, pid_t, rows_t, row_ok, rid, lo, hi, blo // BS, (bhi + BS - 1) // BS


@triton.jit
def common_range(row_ok, lo, hi, S):
    """[lo_all, hi_all): the positions visible to every row of the block."""
    return tl.max(tl.where(row_ok, lo, 0), axis=0), tl.min(tl.where(row_ok, hi, S), axis=0)


@triton.jit
def tile_scores(q_ptr, kx_b, w_ptr, q_rows, w_rows, row_ok, tile, b, S, H, sks, sqh, swh, scale, q_row0,
                q_desc, k_desc, D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """Key tile ``tile``: its positions, which of them lie before S, and the block's scores against them."""
    cols = tile * BS + tl.arange(0, BS).to(tl.int64)
    col_ok = cols < S
    acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, col_ok,
                     H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC,
                     q_desc, k_desc, q_row0, (b * S + tile * BS).to(tl.int32), TMA)
    return cols, col_ok, acc


@triton.jit
def keep_passing(acc, tile, cols, col_ok, b, rows_b, rows_t, row_ok, rid, lo, hi, lo_all, hi_all, thr, fill,
                 mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, cnt_ptr, out_ptr, C, out_stride, carry,
                 KEEP: tl.constexpr, APPEND: tl.constexpr, ASM: tl.constexpr, HAS_MASK: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """KEEP(values, ok, ..., carry, OK) on a score tile, with ok in the cheapest form the tile allows: a tile
    inside every row's range with no mask or bias needs only the row bound (OK_ALL); with a mask or bias,
    the values as the reference defines them and their range test (OK_TILE); a range's edge, the range
    test in int32 (OK_RANGE: ranges lie in [0, S], a row past T has hi = 0), where tile_values' int64 one
    set the kernel's register count. A mask of the key alone (HAS_MASK == MASK_KEYS, no bias; the tile's rows
    are all of batch ``b``) keeps the first and last forms: its [BS] column is read once and a hidden key's
    value is ``fill`` (it still competes, as tile_values defines it). Returns KEEP's carry."""
    inside = (tile * BS >= lo_all) & (tile * BS + BS <= hi_all)
    if HAS_MASK == MASK_KEYS and not HAS_BIAS:
        acc = tl.where(key_visible(b, cols, col_ok, mask_ptr, smb, sms)[None, :], acc, fill)
    elif HAS_MASK or HAS_BIAS:
        inside = False
    if inside:  # every entry in range: the (key-masked) score is the value, only the row bound matters
        carry = KEEP(acc, row_ok[:, None], thr, cols, rid, row_ok, cnt_ptr, out_ptr, C, out_stride, carry,
                     APPEND, ASM, BT, BS, OK_ALL)
    elif (HAS_MASK and HAS_MASK != MASK_KEYS) or HAS_BIAS:
        val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                    mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
        carry = KEEP(val, in_range, thr, cols, rid, row_ok, cnt_ptr, out_ptr, C, out_stride, carry,
                     APPEND, ASM, BT, BS, OK_TILE)
    else:
        carry = KEEP(acc, (lo.to(tl.int32), hi.to(tl.int32)), thr, cols, rid, row_ok, cnt_ptr, out_ptr, C,
                     out_stride, carry, APPEND, ASM, BT, BS, OK_RANGE)
    return carry


@triton.jit
def _append(val, ok, thr, cols, rid, row_ok, cnt_ptr, buf_ptr, C, stride, carry,
            APPEND: tl.constexpr, ASM: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, OK: tl.constexpr):
    """The filter's KEEP: append the passing entries; the carry comes back as it came."""
    append_passing(val, ok, thr, cols, rid, row_ok, cnt_ptr, buf_ptr, C, stride, APPEND, ASM, BT, BS, OK)
    return carry


def filter_rows(pb: Problem, plan: Plan, thr: Tensor, buf: Tensor) -> Tensor:
    """Append every in-range entry >= its row threshold to the row buffer (the first plan.capacity slots of
    each row of ``buf``); returns the int32 row counts, which may pass the capacity."""
    cnt = torch.zeros(pb.rows, dtype=torch.int32, device=pb.device)
    split = plan.filter_split
    pb.launch(filter_kernel, (split, pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, thr, cnt, buf, pb.mask,
              pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, plan.capacity, buf.shape[1], split, APPEND=plan.append,
              ASM=plan.asm, **pb.descriptors, **plan.filter_options)
    return cnt
