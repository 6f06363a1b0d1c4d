"""The selection benchmark's own kernels: the scoring floor, the score table, the filter's compare alone.

One kernel walks the filter's grid (query block x every SPLIT-th key tile) with the filter's score
tile, so its time is what the filter's arithmetic costs, and does one of three things with each tile:

    FLOOR  the score arithmetic alone, one sum kept per row: what HyTopK's time is held against
    TABLE  the fp32 value table [R, S], masked positions as fill: the baseline HyTopK replaces
           (the table, then torch.topk over it)
    COUNT  the filter's compare without its append, one count kept per row: how much of the filter
           the append costs (a diagnostic)

It walks the grid with the filter's own steps (``runtime/filter.py``: ``block_tiles``, ``tile_scores``,
``keep_passing``) and takes the filter's parameter list, unused ones included, so that it compiles to
the very floor the published tables were timed with. Launch through ``floor``, ``table`` and ``count``.

The rescore's floor (``rescore_floor_kernel``, launched through ``rescore_floor``) is the other kind: the
rescore's grid, index loads and gathered [BJ, D] key rows at the rescore's own launch, without its MMA
and head sums, so its time is what reading the same key rows costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyscale_compile.runtime import rescore as rs
from hyscale_compile.runtime.filter import block_tiles, common_range, keep_passing, tile_scores
from hyscale_compile.runtime.filter_append import OK_RANGE, passes
from hyscale_compile.runtime.plan import Plan
from hyscale_compile.runtime.problem import Problem, cdiv
from hyscale_compile.runtime.score_tile import key_value, tile_values

FLOOR = tl.constexpr(0)
TABLE = tl.constexpr(1)
COUNT = tl.constexpr(3)


@triton.jit
def floor_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, thr_ptr, cnt_ptr, out_ptr, mask_ptr, bias_ptr,
                 T, S, H, scale, fill, C, out_stride, SPLIT,
                 sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                 ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                 TMA: tl.constexpr = False, q_desc=None, k_desc=None):
    """FLOOR and COUNT: one float per row and program into out[pid * BT + row]; TABLE: out [R, out_stride]."""
    split, b, pid_t, rows_t, row_ok, rid, lo, hi, tile0, tile1 = block_tiles(T, S, lo_ptr, hi_ptr, BT, BS)
    if MODE == TABLE:  # the table covers every position, masked ones as fill
        tile0 = 0
        tile1 = (S + BS - 1) // BS
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    lo_all, hi_all = common_range(row_ok, lo, hi, S)
    thr = tl.full((BT,), float("inf"), tl.float32)
    if MODE == COUNT:
        thr = key_value(tl.load(thr_ptr + rid, mask=row_ok, other=0))
    sink = tl.zeros((BT,), dtype=tl.float32)
    q_row0 = (b * T + pid_t * BT).to(tl.int32)
    for tile in range(tile0 + split, tile1, SPLIT):
        cols, col_ok, acc = tile_scores(q_ptr, kx_b, w_ptr, q_rows, w_rows, row_ok, tile, b, S, H, sks, sqh, swh,
                                        scale, q_row0, q_desc, k_desc, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, TMA)
        if MODE == FLOOR:
            sink += tl.sum(acc, axis=1)
        elif MODE == TABLE:
            val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                        mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            tl.store(out_ptr + rid[:, None] * out_stride + cols[None, :], val,
                     mask=row_ok[:, None] & col_ok[None, :])
        else:  # COUNT: each kind of tile compared as the filter compares it
            sink = keep_passing(acc, tile, cols, col_ok, b, rows_b, rows_t, row_ok, rid, lo, hi, lo_all, hi_all, thr,
                                fill, mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, cnt_ptr, out_ptr, C,
                                out_stride, sink, _count, 0, False, HAS_MASK, HAS_BIAS, BT, BS)
    if MODE != TABLE:
        pid = (pid_t * tl.num_programs(1) + tl.program_id(1)) * SPLIT + split
        tl.store(out_ptr + pid.to(tl.int64) * BT + tl.arange(0, BT), sink)


@triton.jit
def _count(val, ok, thr, cols, rid, row_ok, cnt_ptr, buf_ptr, C, stride, sink,
           APPEND: tl.constexpr, ASM: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, OK: tl.constexpr):
    """COUNT's KEEP: sink + the entries that are ``ok`` and pass their row's threshold (filter_append's test)."""
    if OK == OK_RANGE:
        c32 = cols.to(tl.int32)[None, :]
        ok = (c32 >= ok[0][:, None]) & (c32 < ok[1][:, None])
    passed = ok & passes(val, thr[:, None])
    return sink + tl.sum(passed.to(tl.float32), axis=1)


def sink(pb: Problem, split: int) -> torch.Tensor:
    """Room for one float per row and program of a FLOOR or COUNT launch."""
    return torch.empty(pb.n_tblk * pb.B * split * pb.tile.bt, device=pb.device, dtype=torch.float32)


def floor(pb: Problem, out: torch.Tensor, split: int) -> None:
    """The scoring floor: the filter's grid and arithmetic, nothing kept but a sum per row."""
    pb.launch(floor_kernel, (split, pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, pb.lo, pb.lo, out, pb.mask,
              pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, 0, pb.S, split, MODE=FLOOR, **pb.descriptors)


def table(pb: Problem, out: torch.Tensor, split: int) -> None:
    """The fp32 value table into out [B * T, S]."""
    pb.launch(floor_kernel, (split, pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, pb.lo, pb.lo, out, pb.mask,
              pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, 0, pb.S, split, MODE=TABLE, **pb.descriptors)


def count(pb: Problem, plan: Plan, thr: torch.Tensor, out: torch.Tensor) -> None:
    """The filter's compare alone at the filter's own launch (split, descriptors, register cap)."""
    split = plan.filter_split
    cnt = torch.zeros(pb.rows, dtype=torch.int32, device=pb.device)
    pb.launch(floor_kernel, (split, pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, thr, cnt, out, pb.mask,
              pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, plan.capacity, plan.width, split, MODE=COUNT,
              **pb.descriptors, **plan.filter_options)


@triton.jit
def rescore_floor_kernel(kx_ptr, idx_ptr, out_ptr, T, S, K, picks, skb, sks,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BJ: tl.constexpr):
    """``rescore_kernel``'s loads alone: its grid (one query row's ``picks`` positions a program), its
    index loads and its gathered [BJ, D] key rows, each row summed (so no load is dead) into a [BJ]
    sink; one float per program into out[program]. No MMA, no head sums, no per-pick store."""
    r = tl.program_id(0).to(tl.int64)  # row b * T + t
    b = r // T
    j_lo = tl.program_id(1).to(tl.int64) * picks
    j_hi = tl.minimum(j_lo + picks, K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    sink = tl.zeros((BJ,), dtype=tl.float32)
    for j0 in range(j_lo, j_hi, BJ):
        _, _, _, _, kg = rs.gather_keys(idx_ptr, kx_ptr, r, b, K, skb, sks, j0, j_hi, S, offs_d, d_ok, BJ)
        sink += tl.sum(kg.to(tl.float32), axis=1)
    tl.store(out_ptr + r * tl.num_programs(1) + tl.program_id(1), tl.sum(sink, axis=0))


def rescore_floor(q, kx, weights, indices, scale: float, relu: bool, vis, fill: float):
    """The rescore's gather floor at ``rescore.rescore``'s arguments: a launch of no arguments (operands
    prepared once, so timing it times the kernel and one launch) and the tensor it writes, one float a
    program. Its shape follows rescore's (``rescore_shape``, RESCORE_BLOCKS, ``launch_options``), so
    re-make it after changing a RESCORE_* setting."""
    pb = Problem(q, kx, weights, scale, relu, vis, fill)
    B, T, K = pb.B, pb.T, indices.shape[-1]
    idx = indices.to(torch.int64).contiguous()
    bj, _ = rs.rescore_shape(pb.H, pb.consts["BLOCK_D"], pb.kx.element_size(), pb.consts["PREC"])
    picks = bj * rs.RESCORE_BLOCKS
    grid = (B * T, cdiv(K, picks))
    out = torch.empty(grid[0] * grid[1], device=pb.device, dtype=torch.float32)
    skb, sks = pb.kx.stride(0), pb.kx.stride(1)
    opts = rs.launch_options()
    D, block_d = pb.D, pb.consts["BLOCK_D"]

    def run():
        rescore_floor_kernel[grid](pb.kx, idx, out, T, pb.S, K, picks, skb, sks, D=D, BLOCK_D=block_d, BJ=bj,
                                   **opts)

    return run, out
