"""HyTopK's first two stages: sample each row's context, then take its pass mark from the samples.

    sample     -> per query block, the keys of M evenly spaced positions of its rows' union range
                  (one score tile of the block's rows against the sampled keys: the same arithmetic
                  as every other stage), written as order keys in the rows' own buffer slots
    threshold  -> per row, the ceil(target * m / ctx)-th best of its m valid samples; and the row's
                  k lowest out-of-range positions (value fill) written after its C candidate slots

A row whose context fits its C slots takes no threshold (every entry of its range passes), and
when no row's context passes C nothing is sampled at all.

A threshold on a tie group (many keys scoring exactly the threshold: a zero-initialised weight
projection scores every key 0, ReLU zeroes most keys) would let the whole group pass and overflow the
row. Ties go to the lowest positions, so the group's winners need not pass the filter: such a row (the
samples say the group would take more than half the room its higher entries leave) gets a filter key
one above its threshold, and ``ties.fill_ties`` appends the group's lowest positions after the filter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .plan import Plan
from .problem import Problem, fill_bits
from .score_tile import MASK_KEYS, block_rows, key_visible, order_key, raw_entry, score_tile, tile_values


@triton.jit
def sample_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, samp_ptr, msamp_ptr, mask_ptr, bias_ptr,
                  T, S, H, scale, fill, M, samp_stride, SPLIT,
                  sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Keys of M evenly spaced positions of the block's range, shared by its rows (one matmul tile).

    SPLIT programs share a block's samples; the per-row count of valid samples is an integer atomic sum.
    Without mask or bias (or with a mask of the key alone, read once per sample key) the range test runs on
    32-bit offsets from the block's start: the 64-bit compares of tile_values over the whole tile made this
    kernel spill (255 registers and 1.4 KB of stack on sm_90).
    """
    split = tl.program_id(0)  # fastest: the programs running together share one query block's q in L2
    b = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2)
    rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    bctx = tl.maximum(bhi - blo, 0)
    n = tl.minimum(bctx, M)
    # position of sample j: blo + (j * bctx) // M = blo + j * step + (j * rem) // M, where j * rem < M * M
    # fits 32 bits (a 64-bit division per column was most of the kernel's integer work)
    step = tl.where(bctx > M, bctx // M, 1).to(tl.int32)
    rem = tl.where(bctx > M, bctx % M, 0).to(tl.int32)
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    lo_rel = (tl.maximum(lo, blo) - blo).to(tl.int32)  # row ranges as offsets from blo (all < 2**31)
    hi_rel = (tl.maximum(hi, blo) - blo).to(tl.int32)
    m = tl.zeros((BT,), dtype=tl.int32)
    for j0 in range(split * BS, M, SPLIT * BS):
        j32 = j0 + tl.arange(0, BS)
        j = j32.to(tl.int64)
        j_ok = j < n
        cols = tl.where(j_ok, blo + (j32 * step + (j32 * rem) // M).to(tl.int64), 0)
        key = tl.full((BT, BS), -2147483648, tl.int32)
        ok = row_ok[:, None] & j_ok[None, :]
        if j0 < n:
            acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, j_ok,
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC)
            if (HAS_MASK and HAS_MASK != MASK_KEYS) or HAS_BIAS:
                val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, j_ok, lo, hi, fill,
                                            mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK,
                                            HAS_BIAS)
            else:  # the score is the value (a key mask's fill where it hides the key); the range test in 32-bit
                rel = (cols - blo).to(tl.int32)  # offsets from blo
                val = acc
                if HAS_MASK:  # MASK_KEYS: one column of the mask for the block's shared sample keys
                    val = tl.where(key_visible(b, cols, j_ok, mask_ptr, smb, sms)[None, :], acc, fill)
                in_range = (rel[None, :] >= lo_rel[:, None]) & (rel[None, :] < hi_rel[:, None])
            key = tl.where(ok & in_range, order_key(val), key)
        m += tl.sum((key != -2147483648).to(tl.int32), axis=1)  # no order key is INT32_MIN (-inf's is above)
        tl.store(samp_ptr + rid[:, None] * samp_stride + j[None, :], key, mask=row_ok[:, None] & (j < M)[None, :])
    tl.atomic_add(msamp_ptr + rid, m, mask=row_ok & (m > 0))


@triton.jit
def threshold_kernel(samp_ptr, msamp_ptr, buf_ptr, lo_ptr, hi_ptr, thr_ptr, fthr_ptr, tie_ptr,
                     S, k, C, target, M, samp_stride, width, fill_bits,
                     SAMPLED: tl.constexpr, MB: tl.constexpr, EB: tl.constexpr):
    """Per row: the target-th best sample key as threshold (ceil(target*m/ctx)-th), then the first k
    out-of-range positions (value fill) after the C candidate slots, sentinels past them. The slots
    themselves are not reset: the filter counts what it appends and the final select reads no more.

    Rows whose context fits the buffer skip the threshold: every entry of their range passes. A row whose
    threshold sits on a tie group (its equal samples, scaled to the row, would take more than half the
    slots its higher entries leave) is marked in tie[r] and filters with the key one above (fthr[r]).
    """
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(lo_ptr + r)
    hi = tl.load(hi_ptr + r)
    ctx = hi - lo
    thr = tl.full((), -2147483648, tl.int64)
    tie = thr > thr  # False until the samples say otherwise
    if SAMPLED:
        m = tl.load(msamp_ptr + r).to(tl.int64)
        rank = (target * m + ctx - 1) // tl.maximum(ctx, 1)
        js = tl.arange(0, MB)
        keys = tl.load(samp_ptr + r * samp_stride + js, mask=js < M, other=-2147483648)
        # the largest x with #(keys >= x) >= rank, by bisection over int32 (at most 32 passes, each
        # one compare and one count a key). A count of exactly rank ends it early: the smallest key
        # counted is x. That comes once the bracket is narrower than the gap between the rank-th and
        # the next key; only ties at the rank need all 32 (NOTES-selection.md, defaults: threshold early end).
        a = tl.full((), -2147483648, tl.int64)
        z = tl.full((), 2147483647, tl.int64)
        hit = tl.full((), 2147483648, tl.int64)  # no pass counted exactly rank
        while a < z:
            mid = (a + z + 1) >> 1
            cnt = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), axis=0)
            if cnt == rank:
                hit = mid
                z = a
            elif cnt > rank:
                a = mid
            else:
                z = mid - 1
        if hit <= 2147483647:
            a = tl.min(tl.where(keys >= hit.to(tl.int32), keys, 2147483647), axis=0).to(tl.int64)
        use = (ctx > C) & (rank >= 1) & (rank <= m)
        thr = tl.where(use, a, thr)
        valid = keys != -2147483648
        n_eq = tl.sum((valid & (keys == a.to(tl.int32))).to(tl.int64), axis=0)
        n_gt = tl.sum((valid & (keys > a.to(tl.int32))).to(tl.int64), axis=0)
        # n_eq * ctx / m > (C - n_gt * ctx / m) / 2, in integers; a NaN threshold (key 0x7FC00000) keeps
        # the plain filter (one key above a NaN is a NaN, which every entry passes)
        tie = use & (2 * n_eq * ctx > C * m - n_gt * ctx) & (a < 0x7FC00000)
    tl.store(thr_ptr + r, thr.to(tl.int32))
    tl.store(fthr_ptr + r, tl.where(tie, thr + 1, thr).to(tl.int32))
    tl.store(tie_ptr + r, tie.to(tl.int8))
    tl.debug_barrier()  # the samples may reach into the extras' slots: read them all before overwriting
    sentinel = tl.full((EB,), -1, tl.int64)  # an empty slot (no position is 2**32 - 1)
    n_ext = tl.minimum(S - ctx, k)
    fv = (tl.full((EB,), 0, tl.int32) + fill_bits).to(tl.float32, bitcast=True)
    for j0 in range(0, k, EB):
        j = j0 + tl.arange(0, EB).to(tl.int64)
        pos = tl.where(j < lo, j, hi + (j - lo))
        comp = tl.where(j < n_ext, raw_entry(fv, pos), sentinel)
        tl.store(buf_ptr + r * width + C + j, comp, mask=j < k)


class Thresholds(NamedTuple):
    """Each row's pass mark, as int32 order keys, and the rows whose mark sits on a tie group."""

    key: Tensor  # [R] the threshold: every entry above it, and the tie group's winners, are candidates
    filter_key: Tensor  # [R] what the filter compares with: key, or key + 1 on a tie row (only entries above)
    tie: Tensor  # [R] int8: 1 where ties.fill_ties appends the group's lowest positions after the filter


def sample_threshold(pb: Problem, plan: Plan) -> tuple[Tensor, Thresholds]:
    """(row buffers with the out-of-range extras in place, the rows' thresholds)."""
    buf, samp, msamp = sample(pb, plan)
    return buf, threshold(pb, plan, buf, samp, msamp)


def sample(pb: Problem, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """(row buffers, the samples' order keys living in them, per-row count of valid samples)."""
    B, T, S, M, width = pb.B, pb.T, pb.S, plan.samples, plan.width
    R = B * T
    dev = pb.device
    buf = torch.empty(R, width, dtype=torch.int64, device=dev)
    if M <= 2 * width:
        samp = buf.view(torch.int32)  # samples live in the row's own slots until the threshold is taken
    else:  # a small k with a long context (or a tiny capacity): the row's slots hold fewer than M keys
        samp = torch.empty(R, M, dtype=torch.int32, device=dev)
    assert samp.shape[1] >= M  # the kernel writes M keys per row: never into the next row or past the end
    assert M * M < 2**31, f"samples={M}: the sample positions are computed in int32 (at most 46340 samples)"
    msamp = torch.zeros(R, dtype=torch.int32, device=dev)
    if plan.sampled:
        # two sample tiles a program (plan.sample_split): faster than one or four, the same samples either way
        # (benchmarks/NOTES-selection.md, "Defaults and the measurements behind them": sample split)
        split = plan.sample_split
        pb.launch(sample_kernel, (split, B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, samp, msamp, pb.mask,
                  pb.bias, T, S, pb.H, pb.scale, pb.fill, M, samp.stride(0), split)
    return buf, samp, msamp


def threshold(pb: Problem, plan: Plan, buf: Tensor, samp: Tensor, msamp: Tensor) -> Thresholds:
    """Per-row thresholds from the samples; writes the extras (candidate slots are left as they are: the
    final select reads only as many as the filter and the tie fill appended)."""
    R, M = pb.rows, plan.samples
    thr = torch.empty(R, dtype=torch.int32, device=pb.device)
    fthr = torch.empty(R, dtype=torch.int32, device=pb.device)
    tie = torch.empty(R, dtype=torch.int8, device=pb.device)
    mb = max(16, 1 << max(0, (M - 1).bit_length()))
    threshold_kernel[(R,)](samp, msamp, buf, pb.lo, pb.hi, thr, fthr, tie, pb.S, plan.k, plan.capacity, plan.target,
                           M, samp.stride(0), plan.width, fill_bits(pb.fill), SAMPLED=plan.sampled, MB=mb, EB=1024,
                           num_warps=threshold_warps(mb))
    return Thresholds(thr, fthr, tie)


def threshold_warps(mb: int) -> int:
    """Few warps: the bisection's steps are block-wide counts, bound by their latency, not by work
    (fewer warps measured faster: benchmarks/NOTES-selection.md, "Defaults and the measurements
    behind them": threshold warps); 64 int32 keys a thread at most."""
    return max(2, min(8, mb // 2048))
