"""An experiment toward the rescore's bar (1.5x its gather floor at H = 64): the rescore as a warp-specialized
Gluon kernel on Hopper, so the gathers and the MMAs overlap. Not used by the product; driven and measured by
``tune_rescore_gluon.py`` beside it (results/tune_rescore_gluon.json, benchmarks/NOTES-selection.md).

Why Gluon: ``runtime/rescore.py``'s Triton kernel is one program per query row whose loop gathers a block of keys,
multiplies it, sums the heads and stores; Triton's pipeliner keeps the next gathers in flight, but the MMA and the
head sums of a block run in the same warps as the gathers. Triton 3.6's automatic warp specialization aborts on that
loop; Gluon, Triton's lower-level language in ``triton.experimental``, splits it over warps by hand:

- a gather partition (4 warps) copies each block's key rows, and its positions, into a ring of shared-memory stages
  by ``cp.async``, the next block's positions loaded before it waits for a free stage;
- two scoring partitions (a warpgroup each) take the blocks in turn: one [64 heads, D] x [D, 128 keys] wgmma (q in
  registers as the A operand), the result turned through a shared-memory tile so each thread holds one key's heads,
  the heads summed in order with score_tile.act_fma, then score_tile.tile_values' visibility and rescore.canonical
  (the Triton functions themselves where their shapes allow: Gluon calls them);
- stages are handed over by mbarriers, in a persistent grid (one program per SM) that keeps the ring full across
  rows.

The values are the Triton kernel's, bit for bit (each head's dot is one wgmma per 16 of D in the same order, whatever
the instruction's M and N; each key's heads are summed in order with the same max or min and FMA); the tuning
script checks that on random, masked, biased, NaN / inf, all-equal and out-of-range inputs. What limits it is the
shared memory's bandwidth: per block of 128 keys at H = 64 the copies write 32 KB, the wgmma reads 32 KB, the turn
writes and reads 32 KB each and the positions take 1 KB, 129 KB at 128 bytes a clock.

Gluon has no interpreter, and its API is experimental (it changes between Triton releases): this file targets
Triton 3.6.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from hyscale_compile.runtime.rescore import canonical
from hyscale_compile.runtime.score_tile import act_fma

WS_BJ = 128  # keys per block: the MMA's N
WS_BH = 64  # heads per MMA: its M, one warpgroup's (H of 33 to 64; fewer heads leave most of it idle)
WS_STAGES = 3  # gathered blocks in flight
WS_GATHER_WARPS = 4  # with BJ = 128: one position copy a thread
WS_GATHER_REGS = 96
WS_SCORE_REGS = 208
WS_MODE = 0  # 1: the gathers alone (the scoring warps only hand stages back), 2: the scoring alone (no key copies)


@gluon.constexpr_function
def _rows_layout(D, warps):
    """Rows of D 16-bit elements, 16 bytes a thread (one cp.async each for the keys; q's rows are loaded so too)."""
    per_row = D // 8
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [warps, 1], [1, 0])


@gluon.jit
def _gather(idx_ptr, kx_ptr, keys, pos, ready, empty, n_items, n_chunks, T, S, K, skb, sks, picks,
            BJ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, MODE: gl.constexpr = 0):
    """The gather partition: each block's key rows into the next free stage, positions outside [0, S) (and picks past
    the row's end) as zero rows, then the stage's ``ready`` barrier arrives when this thread's copies have landed."""
    layout: gl.constexpr = _rows_layout(D, WARPS)
    offs_j = gl.arange(0, BJ, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    pos_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    pj = gl.expand_dims(gl.arange(0, BJ, layout=gl.SliceLayout(0, pos_layout)), 0)
    it = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        r = (item // n_chunks).to(gl.int64)
        b = r // T
        j_lo = (item % n_chunks) * picks
        j_hi = gl.minimum(j_lo + picks, K)
        row = idx_ptr + r * K
        cols_next = gl.load(row + j_lo + offs_j, mask=j_lo + offs_j < j_hi, other=0)
        for j0 in range(j_lo, j_hi, BJ):
            # the next block's positions are loaded before this block waits for its stage: a position load's latency
            # then overlaps a whole block, where loading them just before the copies left each block waiting on it
            cols = cols_next
            j_ok = j0 + offs_j < j_hi
            cols_next = gl.load(row + j0 + BJ + offs_j, mask=j0 + BJ + offs_j < j_hi, other=0)
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            c_ok = j_ok & (cols >= 0) & (cols < S)
            cols = gl.where(c_ok, cols, 0)
            ptrs = kx_ptr + b * skb + gl.expand_dims(cols * sks, 1) + gl.expand_dims(offs_d, 0)
            if MODE != 2:
                async_copy.async_copy_global_to_shared(keys.index(s), ptrs, mask=gl.expand_dims(c_ok, 1))
            # the positions too, for the scoring warps' masks and stores (no global load of their own per block)
            async_copy.async_copy_global_to_shared(pos.index(s), row + j0 + pj, mask=j0 + pj < j_hi)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            it += 1


@gluon.jit
def _score(q_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, mask_ptr, bias_ptr, keys, pos, heads, ready, empty,
           n_items, n_chunks, T, S, K, scale, fill, picks,
           sqb, sqt, sqh, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
           H: gl.constexpr, D: gl.constexpr, BJ: gl.constexpr, BH: gl.constexpr, STAGES: gl.constexpr,
           ACT: gl.constexpr, HAS_W: gl.constexpr, HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr,
           P: gl.constexpr, NP: gl.constexpr, MODE: gl.constexpr = 0):
    """A scoring partition (one warpgroup): per block one [BH, D] x [D, BJ] wgmma, its result turned through
    ``heads`` so each thread holds one key's heads, summed in order, then score_tile.tile_values and the store."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BJ, 16])
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    q_load: gl.constexpr = _rows_layout(D, 4)
    key: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])  # [1, BJ], one key a thread
    hh = gl.arange(0, BH, layout=gl.SliceLayout(1, q_load))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, q_load))
    jj = gl.expand_dims(gl.arange(0, BJ, layout=gl.SliceLayout(0, key)), 0)
    zero = gl.zeros([BH, BJ], gl.float32, mma)
    it = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        r = (item // n_chunks).to(gl.int64)
        b = r // T
        t = r % T
        j_lo = (item % n_chunks) * picks
        j_hi = gl.minimum(j_lo + picks, K)
        q_row = q_ptr + b * sqb + t * sqt
        qv = gl.load(q_row + gl.expand_dims(hh * sqh, 1) + gl.expand_dims(dd, 0), mask=gl.expand_dims(hh < H, 1),
                     other=0.0)
        q = gl.convert_layout(qv, q_op)
        w_row = w_ptr + b * swb + t * swt
        ws = ()
        for h in gl.static_range(H):
            if HAS_W:
                ws = ws + (gl.load(w_row + h * swh) * scale,)
            else:
                ws = ws + (scale,)
        lo = gl.load(lo_ptr + r)
        hi = gl.load(hi_ptr + r)
        for j0 in range(j_lo, j_hi, BJ):
            if it % NP == P:  # blocks alternate between the scoring partitions
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if MODE == 1:
                    mbarrier.arrive(empty.index(s), count=1)
                else:
                    acc = warpgroup_mma(q, keys.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    cols = pos.index(s).load(key)
                    mbarrier.arrive(empty.index(s), count=1)
                    _sum_and_store(acc, heads, ws, cols, j0 + jj, j_hi, lo, hi, r, b, t, K, S, fill, out_ptr,
                                   mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, H, ACT, HAS_MASK, HAS_BIAS)
            it += 1


@gluon.jit
def _sum_and_store(acc, heads, ws, cols, j, j_hi, lo, hi, r, b, t, K, S, fill, out_ptr,
                   mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs,
                   H: gl.constexpr, ACT: gl.constexpr, HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr):
    """One block's values from its MMA result acc [BH, BJ]: turned through ``heads`` so each thread holds one key's
    heads, summed in order with score_tile.act_fma, then score_tile.tile_values' visibility (written out here: its
    [rows, keys] operands do not fit one row's [1, BJ] block), rescore.canonical and the store."""
    key: gl.constexpr = cols.type.layout
    heads.store(acc)
    v = gl.zeros(cols.shape, gl.float32, key)
    for h in gl.static_range(H):
        v = act_fma(heads.slice(h, 1).load(key), ws[h], v, ACT)
    j_ok = j < j_hi
    visible = j_ok & (cols >= 0) & (cols < S) & (cols >= lo) & (cols < hi)
    if HAS_BIAS:
        v = v + gl.load(bias_ptr + b * sbb + t * sbt + cols * sbs, mask=visible, other=0.0).to(gl.float32)
    if HAS_MASK:
        visible = visible & (gl.load(mask_ptr + b * smb + t * smt + cols * sms, mask=visible, other=0) != 0)
    gl.store(out_ptr + r * K + j, canonical(gl.where(visible, v, fill)), mask=j_ok)


@gluon.jit
def rescore_ws_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                      T, S, K, scale, fill, picks, n_items, n_chunks,
                      sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                      H: gl.constexpr, D: gl.constexpr, BJ: gl.constexpr, BH: gl.constexpr, STAGES: gl.constexpr,
                      ACT: gl.constexpr, HAS_W: gl.constexpr, HAS_MASK: gl.constexpr, HAS_BIAS: gl.constexpr,
                      GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr, SCORE_REGS: gl.constexpr,
                      MODE: gl.constexpr = 0):
    """Values of ``picks`` given positions per work item (row, chunk), items spread over a persistent grid."""
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BJ, D], gl.bfloat16)
    keys = gl.allocate_shared_memory(kx_ptr.dtype.element_ty, [STAGES, BJ, D], key_smem)
    heads_layout: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BJ, 8]], [BH, BJ], [1, 0])
    heads0 = gl.allocate_shared_memory(gl.float32, [BH, BJ], heads_layout)
    heads1 = gl.allocate_shared_memory(gl.float32, [BH, BJ], heads_layout)
    pos = gl.allocate_shared_memory(idx_ptr.dtype.element_ty, [STAGES, 1, BJ],
                                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_score, (q_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, mask_ptr, bias_ptr, keys, pos, heads0, ready, empty,
                  n_items, n_chunks, T, S, K, scale, fill, picks,
                  sqb, sqt, sqh, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  H, D, BJ, BH, STAGES, ACT, HAS_W, HAS_MASK, HAS_BIAS, 0, 2, MODE)),
        (_score, (q_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, mask_ptr, bias_ptr, keys, pos, heads1, ready, empty,
                  n_items, n_chunks, T, S, K, scale, fill, picks,
                  sqb, sqt, sqh, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  H, D, BJ, BH, STAGES, ACT, HAS_W, HAS_MASK, HAS_BIAS, 1, 2, MODE)),
        (_gather, (idx_ptr, kx_ptr, keys, pos, ready, empty, n_items, n_chunks, T, S, K, skb, sks, picks,
                   BJ, D, STAGES, GATHER_WARPS, MODE)),
    ], [4, GATHER_WARPS], [SCORE_REGS, GATHER_REGS])


def launch(pb, idx, out, sms: int | None = None) -> None:
    """The kernel on ``pb`` (a ``problem.Problem``) and the int64 positions ``idx`` [B, T, K] into ``out`` (fp32,
    the shape of idx): the values ``rescore.rescore`` returns for them. ``sms``: the grid's programs (the device's
    multiprocessors unless given)."""
    K = idx.shape[-1]
    B, T = pb.q.shape[0], pb.q.shape[1]
    rows = B * T
    sms = sms or torch.cuda.get_device_properties(pb.q.device).multi_processor_count
    blocks = -(-K // WS_BJ)
    chunks = min(blocks, -(-sms // rows))  # a row's picks split only where rows alone leave SMs idle
    picks = WS_BJ * -(-blocks // chunks)
    n_chunks = -(-K // picks)
    n_items = rows * n_chunks
    grid = (min(sms, n_items),)
    c = pb.consts
    rescore_ws_kernel[grid](
        pb.q, pb.kx, pb.wt, pb.lo, pb.hi, idx, out, pb.mask, pb.bias, T, pb.S, K, pb.scale, pb.fill, picks,
        n_items, n_chunks, *pb.strides,
        H=pb.H, D=c["D"], BJ=WS_BJ, BH=WS_BH, STAGES=WS_STAGES, ACT=c["ACT"], HAS_W=c["HAS_W"],
        HAS_MASK=c["HAS_MASK"], HAS_BIAS=c["HAS_BIAS"], GATHER_WARPS=WS_GATHER_WARPS, GATHER_REGS=WS_GATHER_REGS,
        SCORE_REGS=WS_SCORE_REGS, MODE=WS_MODE, num_warps=4)
