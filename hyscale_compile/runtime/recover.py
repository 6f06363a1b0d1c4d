"""Exact recovery of flagged rows: a radix select over recomputed scores, with no host sync.

A row is flagged when its candidate buffer cannot be trusted (overflow, or too few candidates).
For those rows the k-th best (value, position) composite is found 4 bits at a time from the top:
each of the 16 passes rescores the row's whole range (score_tile again, so the same bits) and
counts, per digit d, the entries that match the known prefix and have digit >= d. Counts are
integers summed with atomics, so the result is deterministic. A last pass writes the exactly-k
entries >= the k-th composite into the row's buffer (as raw entries, like the filter's); the final
select treats them like any candidates.

Work items are (group of BT flagged rows, key split); the grid is fixed and programs past the
device-side flagged count return at once, so nothing here needs the host to know the count.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import launch_policy
from .env import interpreting
from .plan import Plan
from .problem import Problem, cdiv, fill_bits, fill_key
from .score_tile import composite, order_key, raw_entry, score_tile, tile_values

PASSES = 16  # 64-bit composite, 4 bits per pass


@triton.jit
def _prefix(cnt_ptr, ranks, active, npass, R, k, BT: tl.constexpr):
    """The known top 4*npass bits of each row's k-th composite (sign-flipped) and the count above it."""
    d16 = tl.arange(0, 16)
    prefix = tl.zeros((BT,), dtype=tl.int64)
    above = tl.zeros((BT,), dtype=tl.int64)
    for p in range(npass):
        c = tl.load(cnt_ptr + (p * R + ranks)[:, None] * 16 + d16[None, :], mask=active[:, None], other=0,
                    cache_modifier=".cg")  # written by other programs of this launch (one-launch recovery)
        c = c.to(tl.int64)
        ok = (above[:, None] + c) >= k  # counts fall with d, so ok is true for d <= chosen digit
        dsel = tl.sum(ok.to(tl.int64), axis=1) - 1
        above += tl.sum(tl.where(d16[None, :] == dsel[:, None] + 1, c, 0), axis=1)
        prefix = prefix | (dsel << (60 - 4 * p))
    return prefix


@triton.jit
def _count_or_emit(comp, raw, ok, p, prefix, cnt_acc, ecnt_ptr, buf_ptr, rid, ranks, width,
                   EMIT: tl.constexpr):
    d16 = tl.arange(0, 16)
    x = comp ^ (tl.full((), 1, tl.int64) << 63)  # unsigned order of x == signed order of comp
    if EMIT:
        kth = prefix ^ (tl.full((), 1, tl.int64) << 63)
        sel = ok & (comp >= kth[:, None])
        pi = sel.to(tl.int32)
        n = tl.sum(pi, axis=1)
        base = tl.atomic_add(ecnt_ptr + ranks, n, mask=n > 0)
        slot = base[:, None] + tl.cumsum(pi, axis=1) - pi
        tl.store(buf_ptr + rid[:, None] * width + slot, raw, mask=sel & (slot < width))
    else:
        sh = tl.where(p == 0, 0, 64 - 4 * p)
        match = ok & ((p == 0) | (((x ^ prefix[:, None]) >> sh) == 0))
        digit = (x >> (60 - 4 * p)) & 15
        for d in tl.static_range(16):
            c_d = tl.sum((match & (digit >= d)).to(tl.int32), axis=1)
            cnt_acc += tl.where(d16[None, :] == d, c_d[:, None], 0)
    return cnt_acc


@triton.jit
def recover_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, nflag_ptr, rows_ptr, cnt_ptr, ecnt_ptr, buf_ptr,
                   mask_ptr, bias_ptr, sync_ptr,
                   B, T, S, H, k, scale, fill, fill_key, fill_bits, width, R, p, NPROG, SPLIT, ITEMS,
                   sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                   ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, EMIT: tl.constexpr,
                   ALL_PASSES: tl.constexpr, NPASS: tl.constexpr):
    """Pass p of the recovery, or (ALL_PASSES) every pass in one launch with a grid barrier between
    them: the host then launches once per call instead of NPASS + 1 times (the launches, not the
    device, bounded small training steps). ALL_PASSES needs every program resident at once (the host
    launches at most one per SM) and threads that run concurrently (not the interpreter)."""
    if ALL_PASSES:
        # Nothing flagged (the common case): every program skips all passes and barriers at once.
        if tl.load(nflag_ptr) > 0:
            for pp in range(NPASS):
                _recover_pass(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, nflag_ptr, rows_ptr, cnt_ptr, ecnt_ptr, buf_ptr,
                              mask_ptr, bias_ptr, B, T, S, H, k, scale, fill, fill_key, fill_bits, width, R, pp,
                              NPROG, SPLIT, ITEMS, sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt,
                              sbs, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, HAS_MASK, HAS_BIAS, False)
                _grid_barrier(sync_ptr, NPROG * (pp + 1))
            _recover_pass(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, nflag_ptr, rows_ptr, cnt_ptr, ecnt_ptr, buf_ptr,
                          mask_ptr, bias_ptr, B, T, S, H, k, scale, fill, fill_key, fill_bits, width, R, NPASS,
                          NPROG, SPLIT, ITEMS, sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt,
                          sbs, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, HAS_MASK, HAS_BIAS, True)
    else:
        _recover_pass(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, nflag_ptr, rows_ptr, cnt_ptr, ecnt_ptr, buf_ptr,
                      mask_ptr, bias_ptr, B, T, S, H, k, scale, fill, fill_key, fill_bits, width, R, p,
                      NPROG, SPLIT, ITEMS, sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt,
                      sbs, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC, HAS_MASK, HAS_BIAS, EMIT)


@triton.jit
def _grid_barrier(sync_ptr, target):
    """Wait until ``target`` program arrivals: this program's writes before it are visible to every
    program after it (block barrier, then a release / acquire pair on one counter at GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _recover_pass(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, nflag_ptr, rows_ptr, cnt_ptr, ecnt_ptr, buf_ptr,
                  mask_ptr, bias_ptr,
                  B, T, S, H, k, scale, fill, fill_key, fill_bits, width, R, p, NPROG, SPLIT, ITEMS,
                  sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, EMIT: tl.constexpr):
    pid = tl.program_id(0)
    nflag = tl.load(nflag_ptr).to(tl.int64)
    n_items = (nflag + BT - 1) // BT * SPLIT
    for it in range(ITEMS):
        item = pid + it * NPROG
        if item < n_items:
            g = item // SPLIT
            split = item % SPLIT
            ranks = g * BT + tl.arange(0, BT).to(tl.int64)
            active = ranks < nflag
            rid = tl.load(rows_ptr + ranks, mask=active, other=0)
            b_r = rid // T
            t_r = rid % T
            lo = tl.load(lo_ptr + rid, mask=active, other=0)
            hi = tl.load(hi_ptr + rid, mask=active, other=0)
            prefix = _prefix(cnt_ptr, ranks, active, p, R, k, BT)
            if not EMIT:
                if (p == 0) & (split == 0):  # the row's old candidates are void: reset to sentinel
                    sentinel = tl.full((BT, BS), -1, tl.int64)
                    for c0 in range(0, width, BS):
                        c = c0 + tl.arange(0, BS)
                        tl.store(buf_ptr + rid[:, None] * width + c[None, :], sentinel,
                                 mask=active[:, None] & (c < width)[None, :])
            cnt_acc = tl.zeros((BT, 16), dtype=tl.int32)
            for b32 in range(B):
                b = b32 + tl.zeros((), dtype=tl.int64)  # batch offsets pass 2**31 on large inputs
                rb = active & (b_r == b)
                if tl.max(rb.to(tl.int32), axis=0) > 0:
                    blo = tl.min(tl.where(rb & (hi > lo), lo, S), axis=0)
                    bhi = tl.max(tl.where(rb, hi, 0), axis=0)
                    q_rows = b * sqb + t_r * sqt
                    w_rows = b * swb + t_r * swt
                    for tile in range(blo // BS + split, (bhi + BS - 1) // BS, SPLIT):
                        cols = tile * BS + tl.arange(0, BS).to(tl.int64)
                        col_ok = cols < S
                        acc = score_tile(q_ptr, kx_ptr + b * skb, w_ptr, q_rows, w_rows, cols * sks, rb, col_ok,
                                         H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC)
                        val, in_range = tile_values(acc, b_r, t_r, cols, rb, col_ok, lo, hi, fill,
                                                    mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs,
                                                    HAS_MASK, HAS_BIAS)
                        comp = composite(order_key(val), cols[None, :])
                        cnt_acc = _count_or_emit(comp, raw_entry(val, cols[None, :]), in_range, p, prefix,
                                                 cnt_acc, ecnt_ptr, buf_ptr, rid, ranks, width, EMIT)
            # out-of-range positions are masked (value fill); only the lowest k of them can matter
            n_ext = tl.minimum(S - (hi - lo), k)
            fk = tl.full((BT, BS), 0, tl.int32) + fill_key
            fv = (tl.full((BT, BS), 0, tl.int32) + fill_bits).to(tl.float32, bitcast=True)
            for j0 in range(split * BS, k, SPLIT * BS):
                j = j0 + tl.arange(0, BS).to(tl.int64)
                pos = tl.where(j[None, :] < lo[:, None], j[None, :], hi[:, None] + (j[None, :] - lo[:, None]))
                ok = active[:, None] & (j[None, :] < n_ext[:, None])
                cnt_acc = _count_or_emit(composite(fk, pos), raw_entry(fv, pos), ok, p, prefix, cnt_acc,
                                         ecnt_ptr, buf_ptr, rid, ranks, width, EMIT)
            if not EMIT:
                d16 = tl.arange(0, 16)
                tl.atomic_add(cnt_ptr + (p * R + ranks)[:, None] * 16 + d16[None, :], cnt_acc,
                              mask=active[:, None] & (cnt_acc > 0))


def recover(pb: Problem, plan: Plan, nflag: Tensor, rows: Tensor, buf: Tensor) -> None:
    """Rewrite the buffers of the nflag (device count) flagged rows listed in rows with their exact top k,
    for any number of flagged rows: in one launch on CUDA where the device holds its grid
    (``launch_policy``), else one launch per pass."""
    R, k, width = pb.rows, plan.k, buf.shape[1]
    dev = pb.device
    counts = torch.zeros(PASSES, R, 16, dtype=torch.int32, device=dev)
    ecnt = torch.zeros(R + 1, dtype=torch.int32, device=dev)  # the last one: the grid barrier's counter
    split = max(1, min(cdiv(pb.S, pb.tile.bs), plan.programs // 2))
    items = cdiv(R, pb.tile.bt) * split
    fk, fb = fill_key(pb.fill), fill_bits(pb.fill)

    def launch(grid: int, p: int, all_passes: bool, **extra) -> None:
        pb.launch(recover_kernel, (grid,), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, nflag, rows, counts, ecnt, buf,
                  pb.mask, pb.bias, ecnt[R:], pb.B, pb.T, pb.S, pb.H, k, pb.scale, pb.fill, fk, fb, width, R, p,
                  grid, split, cdiv(items, grid), EMIT=p == PASSES, ALL_PASSES=all_passes, NPASS=PASSES, **extra)

    if launch_policy.RECOVER_ONE_LAUNCH and dev.type == "cuda" and not interpreting():
        variant = (dev, tuple(sorted(pb.consts.items())), dataclasses.astuple(pb.tile))
        grids = launch_policy.one_launch_grids(dev)
        if launch_policy.launch_once(launch, variant, grids, items, torch.cuda.is_current_stream_capturing()):
            return
    nprog = max(1, min(items, plan.programs))
    for p in range(PASSES + 1):
        launch(nprog, p, False)
