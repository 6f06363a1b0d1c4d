"""The check stage of HyTopK in one small launch: which rows' candidate buffers cannot be trusted.

After the filter, a row is flagged when its buffer overflowed (count > capacity) or when the
candidates and out-of-range extras it holds may not reach k. For the recovery the flagged rows are
listed in row order (rank -> row) with their number on the device; for the final select each row's
used slots are written, and how many of the slots past them it must read; the run-time statistics
are added to on the device. This was some thirty small torch ops per call, most of a small select's
host time; here it is one program that scans the rows in blocks (a carried prefix count), so nothing
waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import stats
from .plan import Plan
from .problem import Problem, fill_key


@triton.jit
def check_kernel(cnt_ptr, thr_ptr, lo_ptr, hi_ptr, used_ptr, tail_ptr, rows_ptr, nflag_ptr, stats_ptr,
                 R, S, k, cap, fill_key, fallback_rows, BLOCK: tl.constexpr):
    """One program over all R rows.

    cnt: int32 appends per row (may exceed cap); thr: int32 order key of the row threshold; lo, hi:
    int64 row ranges. A row whose threshold is at or below the fill's key also holds its
    min(S - (hi - lo), k) out-of-range extras. Writes used[r] (int32: min(k, cap) for a flagged row,
    whose recovered top k fills the buffer from slot 0; else min(cnt, cap)), tail[r] (int32: the slots
    past the cap that may hold part of the top k: the extras where the row holds them, none where its
    threshold lies above the fill (no extra can outrank its >= k candidates), all k for a flagged row,
    whose recovery may write there), rows[rank] = r for the flagged rows in row order, nflag, and adds
    (1 call, R rows, nflag recovered, 1 fallback if nflag > fallback_rows, the kept candidates) to the
    stats counters (runtime.stats' slot order).
    """
    offs = tl.arange(0, BLOCK)
    nflag = tl.zeros((), dtype=tl.int32)
    kept = tl.zeros((), dtype=tl.int64)
    for r0 in range(0, R, BLOCK):
        r = r0 + offs
        ok = r < R
        cnt = tl.load(cnt_ptr + r, mask=ok, other=0)
        thr = tl.load(thr_ptr + r, mask=ok, other=0).to(tl.int64)
        lo = tl.load(lo_ptr + r, mask=ok, other=0)
        hi = tl.load(hi_ptr + r, mask=ok, other=0)
        ext = tl.where(thr <= fill_key, tl.minimum(S - (hi - lo), k), 0)
        flag = ok & ((cnt > cap) | (cnt.to(tl.int64) + ext < k))
        tl.store(tail_ptr + r, tl.where(flag, k, ext).to(tl.int32), mask=ok)
        f = flag.to(tl.int32)
        rank = nflag + tl.cumsum(f, axis=0) - f
        tl.store(rows_ptr + rank, r.to(tl.int64), mask=flag)
        kept_r = tl.minimum(cnt, cap)
        tl.store(used_ptr + r, tl.where(flag, tl.minimum(k, cap), kept_r), mask=ok)
        kept += tl.sum(tl.where(ok, kept_r, 0).to(tl.int64), axis=0)
        nflag += tl.sum(f, axis=0)
    tl.store(nflag_ptr, nflag)
    one = tl.full((), 1, tl.int64)
    tl.atomic_add(stats_ptr + 0, one)
    tl.atomic_add(stats_ptr + 1, one * R)
    tl.atomic_add(stats_ptr + 2, nflag.to(tl.int64))
    tl.atomic_add(stats_ptr + 3, (nflag > fallback_rows).to(tl.int64))
    tl.atomic_add(stats_ptr + 4, kept)


def check_block(R: int) -> int:
    """Rows per step of the scan: one step up to 4096 rows; a long prefill (R = B * T past that) takes
    R / 4096 dependent steps, a few microseconds each."""
    return min(4096, max(16, triton.next_power_of_2(R)))


def check_warps(block: int) -> int:
    return 4 if block <= 1024 else 8


def check(pb: Problem, plan: Plan, cnt: Tensor, thr: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flag the rows whose buffers may not hold their top k, list them, count them (on the device):
    (int32 [R] used slots, int32 [R] tail, int64 [R + 1] flagged rows in row order, int32 [1] how many)."""
    R = pb.rows
    used = torch.empty(R, dtype=torch.int32, device=pb.device)
    tail = torch.empty(R, dtype=torch.int32, device=pb.device)
    rows = torch.empty(R + 1, dtype=torch.int64, device=pb.device)
    nflag = torch.empty(1, dtype=torch.int32, device=pb.device)
    block = check_block(R)
    check_kernel[(1,)](cnt, thr, pb.lo, pb.hi, used, tail, rows, nflag, stats.counters(pb.device), R, pb.S, plan.k,
                       plan.capacity, fill_key(pb.fill), stats.FALLBACK_ROWS, BLOCK=block,
                       num_warps=check_warps(block))
    return used, tail, rows, nflag
