"""Triton backward of ``hyscale::sparse_attention``: dq, dk, dv through the kept picks only, deterministic.

With p = exp(scale * q.k - lse), dp = dout . v and ds = p * (dp - delta) (delta = rowsum(dout * out) - dlse):

    dq[t, h]  = scale * sum_j ds[h, j] k[s_j]             one query row's picks: summed by its program
    dk[s]     = scale * sum_{(t, h) picking s} ds q[t, h]   many rows' picks: contributions + segments
    dv[s]     =         sum_{(t, h) picking s} p  dout[t, h]

Each pick's contribution to dk / dv is written to a buffer at the pick's place in the stable order of the
chunk's picks by key (the CSR a sort of the chunk's keys gives); the segment kernel then adds each key's
contiguous run, in that fixed order, to an fp32 accumulator, once per chunk, chunks in order. No float atomics:
the same inputs give the same bits, run after run, and dk / dv have the same bits for any chunking. Dropped
picks (out of range, not visible) load nothing (masked loads: their rows are 0, never multiplied by p = 0),
write nothing and sort after every key.

Narrow tiles (GQA / MHA head dims): the row kernel, one program per (query row, kv group, block of BH heads,
slice of the row's picks), the forward's tiling: it recomputes S, p, dp, ds for BK gathered rows, adds ds @ k
to its dq (registers; written once, or as a slice partial the host sums in slice order) and writes a
contribution [ds^T q, p^T dout] (Dqk + Dv fp32) per pick and head block.

Wide tiles (the MLA layer: 128 heads x 576 + 512 features) and the latent entry split the work:

* the contribution kernel, one program per (query row, kv group, slice of picks) for ALL the group's heads
  (the heads are the contribution MMA's K dimension): S and dp CH feature columns at a time, p, ds; one
  contribution a pick (not one per head block), and ds (in q's dtype, as the dq MMA takes it) to a buffer;
* the dq kernel: dq = scale * ds @ k from that buffer (no recompute of S and dp); for a caller that did not keep
  the forward's output (the absorbed MLA op), also o = p @ v from p stored beside ds, on the rows it gathers.

The latent entry (``backward_latent``, op ``sparse_attention_latent``: v = kv[..., :Dv], kv's whole gradient
returned) folds dv into dk per pick: its contribution is ds^T q scale + [p^T dout, 0], Dqk floats a pick, where
``backward`` (op ``sparse_attention``) keeps dk and dv apart, Dqk + Dv floats, also when v is a view of k
(lowering/attention.py says why the op cannot fold there). MLA at 128 heads: 576 floats a pick against the
2 x 1088 of one contribution per 64-head block.

Extra memory: the contribution buffer, at most CONTRIB_BYTES with the ds buffer (query rows go in chunks under
it; a per-pick buffer for all rows would be T * K * 576 * 4 bytes, 310 GB for the MLA layer at T = 65536,
K = 2048), its sort (about 20 bytes a pick of one chunk), the fp32 accumulator of dk and dv [B, S, G, W], and
the dq partials when a row's picks are split into slices (fp32; dq itself is stored in q's dtype, each value
rounded once from its fp32 sum, as a cast after would: at 128 heads x 576 an fp32 dq of T = 65536 is 19 GB).

In the MLA latent layout (v aliasing k's first Dv features) a gathered row is read once: its A block (its
first Dv features, CH columns at a time in the contribution kernel) is the value row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..env import multiprocessors
from . import common

# used inside the kernels
from .common import LOG2E_C, block_heads, causal_limit, chunk_row, load_picks, load_rows, mm, mm_acc, store_dq
from .naive import Picks, add_mean_grad, empty_rows, value_mean

# Upper bound on the contribution buffer of one chunk of query rows.
CONTRIB_BYTES = 1 << 31
# Tuning knobs (None: the rule in ``passes``).
HEAD_BLOCK = 64
CONTRIB_HEAD_BLOCK = 128  # heads of a group per head block of the contribution pass (16-bit; half for fp32)
PICKS: int | None = None
WARPS: int | None = None
STAGES: int | None = None
SPLIT: bool | None = None  # dq and the contributions in two passes (None: where a program's tiles are wide)
CHUNK = 64  # contribution columns per store in the second pass of a split
DQ_STAGES: int | None = 2  # the dq kernel's pick loop (None: STAGES)
# Picks a block of the 16-bit dq kernel: more picks a block hide more of each block's gathers behind its MMAs
# (the stages of the whole A block take 80 KB of shared memory at 64 picks in the MLA layer); where the output is
# recomputed, each program's A columns are half as wide and 128 fit.
DQ_PICKS = 64
DQ_PICKS_RECOMPUTING = 128
# Heads a dq program handles when it also recomputes the output; None: the dq kernel's own.
OUT_HEAD_BLOCK: int | None = None
# Column blocks of the A block (the value features) that a row's dq / output programs split between them when the
# output is recomputed: two fp32 accumulators a column ([BH, 576] and [BH, 512] whole in the MLA layer need 272
# registers a thread at 64 heads and 8 warps; a half each, 160), the MMAs at the dq kernel's own 64 heads.
OUT_COL_SPLIT = 2
CONTRIB_PICKS: int | None = None  # picks a block of the contribution kernel (None: PICKS's rule, then ``passes``')
CONTRIB_STAGES = 4  # the contribution kernel's feature-chunk loops pipelined this deep (1: not pipelined)
# Programs per SM to aim for by splitting each row's picks into slices (0: one slice per row).
PROGRAMS_PER_SM = 4
SEGMENT_KEYS = 2  # keys per program of the segment kernel (few: a key's run is streamed by its program alone)
SEGMENT_COLS = 256  # contribution columns per program of the segment kernel
SEGMENT_ROWS = 8  # contribution rows a program loads before it adds them (in order): loads in flight


def passes(HG: int, BDA: int, BDB: int, BDV: int, dtype: torch.dtype, K: int,
           fold: bool = False, recompute: bool = False) -> tuple[int, list[tuple]]:
    """(BH, passes), a pass being (DO_DQ, DO_KV, BK, CH, warps, stages); BH is the heads of a row kernel or dq
    kernel program (the contribution kernel takes a group's heads up to CONTRIB_HEAD_BLOCK: ``contrib_heads``).

    One fused pass (the row kernel) where a program's tiles are narrow (GQA / MHA head dims: no spills on sm_90
    at BK = 32, 4 warps). Wide tiles (the MLA layer) do not fit one program on sm_90 (dq's accumulator
    [64, 576] fp32 alone is 144 registers a thread at 8 warps; q and dout held twice in shared memory, as A
    and as B operand, exceed it), and the latent entry folds dv into dk per pick: two passes, the dq kernel
    (BK = DQ_PICKS, DQ_PICKS_RECOMPUTING where it recomputes the output: first tuple) after the contribution
    kernel (CH feature columns at a time, second tuple; BK = 128 picks for the 16-bit latent entry: q and dout are
    re-read once per block of picks, and halving those re-reads outweighs the registers ptxas spills there; 64
    elsewhere). ptxas for sm_90a (bf16, MLA at 128 heads) and the
    timings: benchmarks/NOTES-sparse-attention.md. fp32 (tf32x3): 16 heads a dq program, BK = 16 (launchable,
    spilling: the model computes this layer in 16-bit)."""
    BH, wide = common.head_block(HG, BDA + BDB + BDV, dtype, HEAD_BLOCK)
    split = wide or fold if SPLIT is None else SPLIT or fold
    warps, stages = WARPS or (8 if wide and dtype != torch.float32 else 4), STAGES or 1
    fp32 = dtype == torch.float32

    def bk(n: int, own: int | None = None) -> int:  # a pass's own knob, then PICKS, then its default
        return min(own or PICKS or n, common.pow2(K))

    if not split:
        return BH, [(True, True, bk(32), 0, warps, stages)]
    dq_picks = 16 if fp32 else DQ_PICKS_RECOMPUTING if recompute else DQ_PICKS
    return BH, [(True, False, bk(dq_picks), 0, warps, DQ_STAGES or stages),
                (False, True, bk(16 if fp32 else 128 if fold else 64, CONTRIB_PICKS), min(CHUNK, BDA, BDV), warps,
                 stages)]


@triton.jit
def _row_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, idx_ptr, offs_ptr, km_ptr, place_ptr, dq_ptr,
                contrib_ptr, B, T, S, K, H, HG, NHB, G, Dqk, Dv, offset, scale, scale_log2,
                sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, sdo_b, sdo_t, sdo_h, skm_b, skm_s,
                t0, R, slice_picks, dq_T, dq_t0,
                CAUSAL: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_KM: tl.constexpr, ALIAS: tl.constexpr,
                PREC: tl.constexpr, DA: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr,
                BH: tl.constexpr, BK: tl.constexpr):
    # pid 0 = b * R + r: row t = t0 + r of the chunk; pid 1 = g * NHB + head block; pid 2 = slice of picks.
    pid = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) // NHB
    hb = tl.program_id(1) % NHB
    part = tl.program_id(2).to(tl.int64)
    b, t, row = chunk_row(pid, R, t0, T)
    h, hmask = block_heads(hb, g, HG, BH)
    ca = tl.arange(0, BDA)
    cv = tl.arange(0, BDV)
    q_row = q_ptr + b * sq_b + t * sq_t + h[:, None] * sq_h
    qa = tl.load(q_row + ca[None, :], mask=hmask[:, None] & (ca < DA)[None, :], other=0.0)
    if BDB > 0:
        cb = DA + tl.arange(0, BDB)
        qb = tl.load(q_row + cb[None, :], mask=hmask[:, None] & (cb < Dqk)[None, :], other=0.0)
        dqb = tl.zeros((BH, BDB), tl.float32)
    do_row = do_ptr + b * sdo_b + t * sdo_t + h[:, None] * sdo_h
    do = tl.load(do_row + cv[None, :], mask=hmask[:, None] & (cv < Dv)[None, :], other=0.0)
    lse2 = tl.load(lse_ptr + row * H + h, mask=hmask, other=0.0) * LOG2E_C
    delta = tl.load(delta_ptr + row * H + h, mask=hmask, other=0.0)
    dqa = tl.zeros((BH, BDA), tl.float32)
    k_base = k_ptr + b * sk_b + g * sk_g
    v_base = v_ptr + b * sv_b + g * sv_g
    idx_row = idx_ptr + row * K
    km_row = km_ptr + b * skm_b
    lim = causal_limit(t, offset, offs_ptr, b, HAS_OFFS)
    DC = Dqk + Dv
    j_lo = part * slice_picks
    j_hi = tl.minimum(j_lo + slice_picks, K)
    for k0 in range(j_lo, j_hi, BK):
        ids, ok = load_picks(idx_row, k0, j_hi, S, lim, km_row, skm_s, CAUSAL, HAS_KM, BK)
        ka = load_rows(k_base, ids, ok, sk_s, ca, DA)
        s = mm(qa, tl.trans(ka), PREC)
        if BDB > 0:
            kb = load_rows(k_base, ids, ok, sk_s, cb, Dqk)
            s += mm(qb, tl.trans(kb), PREC)
        p = tl.where(ok[None, :] & hmask[:, None], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        if ALIAS:
            vt = ka
        else:
            vt = load_rows(v_base, ids, ok, sv_s, cv, Dv)
        dp = mm(do, tl.trans(vt), PREC)
        # dropped picks (their rows loaded as 0) get ds = 0 outright, not p = 0 times a dp or delta that a
        # non-finite dout may make NaN; 16-bit operands: ds in their dtype, as flash-attention
        ds = tl.where(ok[None, :] & hmask[:, None], p * (dp - delta[:, None]), 0.0).to(ka.dtype)
        dqa += mm(ds, ka, PREC)
        if BDB > 0:
            dqb += mm(ds, kb, PREC)
        place = tl.load(place_ptr + pid * K + k0 + tl.arange(0, BK), mask=ok, other=0).to(tl.int64)
        dst = contrib_ptr + ((place * NHB + hb) * G + g) * DC
        ds_t = tl.trans(ds)
        p_t = tl.trans(p.to(do.dtype))
        tl.store(dst[:, None] + ca[None, :], mm(ds_t, qa, PREC) * scale, mask=ok[:, None] & (ca < DA)[None, :])
        tl.store(dst[:, None] + Dqk + cv[None, :], mm(p_t, do, PREC), mask=ok[:, None] & (cv < Dv)[None, :])
        if BDB > 0:
            tl.store(dst[:, None] + cb[None, :], mm(ds_t, qb, PREC) * scale, mask=ok[:, None] & (cb < Dqk)[None, :])
    dq_row = ((part * B + b) * dq_T + t - dq_t0) * H + h
    store_dq(dq_ptr, dq_row, ca, dqa, scale, hmask, DA, Dqk)
    if BDB > 0:
        store_dq(dq_ptr, dq_row, cb, dqb, scale, hmask, Dqk, Dqk)


@triton.jit
def _score_chunk(q_row, do_row, k_base, ids, ok, sk_s, hmask, c0, s, dp, DA, Dv, ALIAS: tl.constexpr,
                 PREC: tl.constexpr, CH: tl.constexpr):
    cc = c0 + tl.arange(0, CH)
    qc = tl.load(q_row + cc[None, :], mask=hmask[:, None] & (cc < DA)[None, :], other=0.0)
    kc = load_rows(k_base, ids, ok, sk_s, cc, DA)
    s = mm_acc(qc, tl.trans(kc), s, PREC)
    if ALIAS:  # DA = Dv: the k chunk is the v chunk
        doc = tl.load(do_row + cc[None, :], mask=hmask[:, None] & (cc < Dv)[None, :], other=0.0)
        dp = mm_acc(doc, tl.trans(kc), dp, PREC)
    return s, dp


@triton.jit
def _contrib_chunk(q_row, do_row, dst, ds_t, p_t, ok, hmask, c0, hb, scale, DA, Dv, FOLD: tl.constexpr,
                   MULTI_HB: tl.constexpr, PREC: tl.constexpr, CH: tl.constexpr):
    cc = c0 + tl.arange(0, CH)
    m = ok[:, None] & (cc < DA)[None, :]
    qc = tl.load(q_row + cc[None, :], mask=hmask[:, None] & (cc < DA)[None, :], other=0.0)
    val = mm(ds_t, qc, PREC) * scale
    if FOLD:  # ALIAS, DA = Dv: dk and dv share these columns
        doc = tl.load(do_row + cc[None, :], mask=hmask[:, None] & (cc < Dv)[None, :], other=0.0)
        val += mm(p_t, doc, PREC)
    if MULTI_HB:
        if hb > 0:
            val += tl.load(dst[:, None] + cc[None, :], mask=m, other=0.0)
    tl.store(dst[:, None] + cc[None, :], val, mask=m)


@triton.jit
def _contrib_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, idx_ptr, offs_ptr, km_ptr, place_ptr,
                    contrib_ptr, ds_ptr, p_ptr, rd_ptr, NKB, T, S, K, H, HG, NHB, G, Dqk, Dv, W, offset, scale,
                    scale_log2,
                    sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, sdo_b, sdo_t, sdo_h, skm_b, skm_s,
                    t0, R, slice_picks, q_t0, do_t0,
                    CAUSAL: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_KM: tl.constexpr, ALIAS: tl.constexpr,
                    FOLD: tl.constexpr, MULTI_HB: tl.constexpr, PREC: tl.constexpr, DA: tl.constexpr,
                    BDA: tl.constexpr, BDB: tl.constexpr, BDV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                    CH: tl.constexpr, CSTAGES: tl.constexpr, STORE_P: tl.constexpr):
    # The contribution pass of a split backward: one program per (query row, kv group, slice of picks) for ALL
    # the group's heads, so each pick gets one contribution (W = Dqk + Dv columns, or Dqk with FOLD: dv added
    # into dk's first Dv columns). Per block of BK picks and head block: S = q k^T and dp = dout v^T
    # accumulated CH feature columns at a time (q, dout chunks reloaded from cache; in the latent layout a
    # gathered k chunk is the v chunk too), p and ds, then the contribution CH columns at a time,
    # ds^T q (* scale) (+ p^T dout), the heads being the MMA's K dimension. Head blocks past the first (more
    # than BH heads a group) add theirs to the stored columns in order (the program's own: no other reads them).
    # ds (in q's dtype, as the dq MMA takes it) goes to ds_ptr [chunk rows, H, K] for the dq kernel, and with
    # STORE_P p (rounded as the contribution MMA takes it) to p_ptr, for the dq kernel's recomputed output, and each
    # block's row sums of p * dp to rd_ptr [chunk rows, H, NKB] (the host sums a row's blocks into the row term of
    # the dp formed here, sum_j p_j dp_j, which the dq kernel's correction needs before any output exists). The chunk
    # loops are loops, not unrolled, so that the pipeliner overlaps a chunk's loads (the gathered rows) with the
    # previous chunk's MMAs: CSTAGES deep, one buffer set of a chunk (q, k, dout: ~40 KB at 128 heads) a stage.
    # q and dout rows are [H, D] blocks: q_t0 / do_t0 is the first row of a chunk's row-major copy (0: none).
    pid = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    part = tl.program_id(2).to(tl.int64)
    b, t, row = chunk_row(pid, R, t0, T)
    k_base = k_ptr + b * sk_b + g * sk_g
    v_base = v_ptr + b * sv_b + g * sv_g
    idx_row = idx_ptr + row * K
    km_row = km_ptr + b * skm_b
    lim = causal_limit(t, offset, offs_ptr, b, HAS_OFFS)
    j_lo = part * slice_picks
    j_hi = tl.minimum(j_lo + slice_picks, K)
    for k0 in range(j_lo, j_hi, BK):
        ids, ok = load_picks(idx_row, k0, j_hi, S, lim, km_row, skm_s, CAUSAL, HAS_KM, BK)
        place = tl.load(place_ptr + pid * K + k0 + tl.arange(0, BK), mask=ok, other=0).to(tl.int64)
        dst = contrib_ptr + (place * G + g) * W
        for hb in range(0, NHB):
            h, hmask = block_heads(hb, g, HG, BH)
            q_row = q_ptr + b * sq_b + (t - q_t0) * sq_t + h[:, None] * sq_h
            do_row = do_ptr + b * sdo_b + (t - do_t0) * sdo_t + h[:, None] * sdo_h
            lse2 = tl.load(lse_ptr + row * H + h, mask=hmask, other=0.0) * LOG2E_C
            delta = tl.load(delta_ptr + row * H + h, mask=hmask, other=0.0)
            s = tl.zeros((BH, BK), tl.float32)
            dp = tl.zeros((BH, BK), tl.float32)
            for c0 in tl.range(0, BDA, CH, num_stages=CSTAGES):
                s, dp = _score_chunk(q_row, do_row, k_base, ids, ok, sk_s, hmask, c0, s, dp, DA, Dv, ALIAS, PREC, CH)
            if BDB > 0:
                cb = DA + tl.arange(0, BDB)
                qb = tl.load(q_row + cb[None, :], mask=hmask[:, None] & (cb < Dqk)[None, :], other=0.0)
                s = mm_acc(qb, tl.trans(load_rows(k_base, ids, ok, sk_s, cb, Dqk)), s, PREC)
            if not ALIAS:
                for c0 in tl.static_range(0, BDV, CH):
                    cc = c0 + tl.arange(0, CH)
                    doc = tl.load(do_row + cc[None, :], mask=hmask[:, None] & (cc < Dv)[None, :], other=0.0)
                    dp = mm_acc(doc, tl.trans(load_rows(v_base, ids, ok, sv_s, cc, Dv)), dp, PREC)
            kept = ok[None, :] & hmask[:, None]
            p = tl.where(kept, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
            # as in the row kernel: dropped picks and padded heads get ds = 0 outright; 16-bit: ds, p rounded
            ds = tl.where(kept, p * (dp - delta[:, None]), 0.0).to(q_ptr.dtype.element_ty)
            at = (pid * H + h)[:, None] * K + (k0 + tl.arange(0, BK))[None, :]
            tl.store(ds_ptr + at, ds, mask=kept)
            p16 = p.to(do_ptr.dtype.element_ty)
            if STORE_P:
                tl.store(p_ptr + at, p16, mask=kept)
                tl.store(rd_ptr + (pid * H + h) * NKB + k0 // BK, tl.sum(tl.where(kept, p * dp, 0.0), 1), mask=hmask)
            ds_t = tl.trans(ds)
            p_t = tl.trans(p16)
            if MULTI_HB:
                tl.debug_barrier()  # the previous head block's stores are visible to this one's loads
            for c0 in tl.range(0, BDA, CH, num_stages=CSTAGES):
                _contrib_chunk(q_row, do_row, dst, ds_t, p_t, ok, hmask, c0, hb, scale, DA, Dv, FOLD, MULTI_HB,
                               PREC, CH)
            if BDB > 0:
                m = ok[:, None] & (cb < Dqk)[None, :]
                val = mm(ds_t, qb, PREC) * scale
                if MULTI_HB:
                    if hb > 0:
                        val += tl.load(dst[:, None] + cb[None, :], mask=m, other=0.0)
                tl.store(dst[:, None] + cb[None, :], val, mask=m)
            if not FOLD:
                for c0 in tl.static_range(0, BDV, CH):
                    cc = c0 + tl.arange(0, CH)
                    m = ok[:, None] & (cc < Dv)[None, :]
                    doc = tl.load(do_row + cc[None, :], mask=hmask[:, None] & (cc < Dv)[None, :], other=0.0)
                    val = mm(p_t, doc, PREC)
                    if MULTI_HB:
                        if hb > 0:
                            val += tl.load(dst[:, None] + Dqk + cc[None, :], mask=m, other=0.0)
                    tl.store(dst[:, None] + Dqk + cc[None, :], val, mask=m)


@triton.jit
def _dq_kernel(k_ptr, idx_ptr, offs_ptr, km_ptr, ds_ptr, dq_ptr, p_ptr, o_ptr, eps_ptr, B, T, S, K,
               H, HG, NHB, G, Dqk, offset, scale, sk_b, sk_s, sk_g, skm_b, skm_s, t0, R,
               slice_picks, dq_T, dq_t0, O_W,
               CAUSAL: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_KM: tl.constexpr, PREC: tl.constexpr,
               DA: tl.constexpr, BDA: tl.constexpr, BDB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
               WITH_O: tl.constexpr, NCOL: tl.constexpr):
    # dq of a split backward from the ds the contribution kernel stored: dq = scale * ds @ k over a row's kept
    # picks (dropped ones: ds not stored, loaded as 0; their rows load nothing). One program per (query row,
    # kv group, block of BH heads, column block, slice of picks), the programs of a row adjacent in launch order
    # (they gather the same key rows). WITH_O (the latent layout, v = the A block): also o = p @ k from the
    # stored p, on the same gathered rows: its A block is the forward's output (stored O_W = DA wide), and dq
    # takes the softmax row term of the dp the contributions formed, sum_j p_j dp_j - dlse, in place of the
    # caller's (from the model's rounded output): ds - p * eps summed against k is dq - eps * (p @ k), with eps
    # [chunk rows, H] from the host (0 at an empty row). Linear in the picks, so a slice's partial takes it too.
    # The A block's columns are split NCOL ways between programs (two accumulators a column with WITH_O); the
    # B block (the tail past DA) goes with the last column block, the others load none of it.
    GH = G * NHB * NCOL
    flat = tl.program_id(0).to(tl.int64)
    pid = flat // GH
    g = (flat % GH) // (NHB * NCOL)
    hb = (flat % (NHB * NCOL)) // NCOL
    col = flat % NCOL
    part = tl.program_id(1).to(tl.int64)
    b, t, row = chunk_row(pid, R, t0, T)
    h, hmask = block_heads(hb, g, HG, BH)
    ca = col * BDA + tl.arange(0, BDA)
    dqa = tl.zeros((BH, BDA), tl.float32)
    if BDB > 0:
        cb = DA + tl.arange(0, BDB)
        b_w = tl.where(col == NCOL - 1, Dqk, DA)  # the B block's columns below b_w: none but in the last block
        dqb = tl.zeros((BH, BDB), tl.float32)
    if WITH_O:
        oa = tl.zeros((BH, BDA), tl.float32)
        if BDB > 0:
            ob = tl.zeros((BH, BDB), tl.float32)
    k_base = k_ptr + b * sk_b + g * sk_g
    idx_row = idx_ptr + row * K
    km_row = km_ptr + b * skm_b
    lim = causal_limit(t, offset, offs_ptr, b, HAS_OFFS)
    j_lo = part * slice_picks
    j_hi = tl.minimum(j_lo + slice_picks, K)
    for k0 in range(j_lo, j_hi, BK):
        ids, ok = load_picks(idx_row, k0, j_hi, S, lim, km_row, skm_s, CAUSAL, HAS_KM, BK)
        at = (pid * H + h)[:, None] * K + (k0 + tl.arange(0, BK))[None, :]
        ds = tl.load(ds_ptr + at, mask=hmask[:, None] & ok[None, :], other=0.0)
        ka = load_rows(k_base, ids, ok, sk_s, ca, DA)
        dqa = mm_acc(ds, ka, dqa, PREC)
        if WITH_O:
            p = tl.load(p_ptr + at, mask=hmask[:, None] & ok[None, :], other=0.0)
            oa = mm_acc(p, ka, oa, PREC)
        if BDB > 0:
            kb = load_rows(k_base, ids, ok, sk_s, cb, b_w)
            dqb = mm_acc(ds, kb, dqb, PREC)
            if WITH_O:
                ob = mm_acc(p, kb, ob, PREC)
    if WITH_O:
        eps = tl.load(eps_ptr + pid * H + h, mask=hmask, other=0.0)
        dqa -= eps[:, None] * oa
        if BDB > 0:
            dqb -= eps[:, None] * ob
    dq_row = ((part * B + b) * dq_T + t - dq_t0) * H + h
    store_dq(dq_ptr, dq_row, ca, dqa, scale, hmask, DA, Dqk)
    if BDB > 0:
        store_dq(dq_ptr, dq_row, cb, dqb, scale, hmask, b_w, Dqk)
    if WITH_O:
        store_dq(o_ptr, dq_row, ca, oa, 1.0, hmask, DA, O_W)


@triton.jit
def _segment_kernel(contrib_ptr, bounds_ptr, acc_ptr, n_keys, W, NHB,
                    BKEY: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr):
    # BKEY keys per program (not a program per sorted pick: a chunk's picks outnumber its keys, and each of
    # those programs ran to find out it owned no run): key s adds its run of sorted picks [bounds[s],
    # bounds[s + 1]) of contributions (NHB rows a pick, the run's rows contiguous) in order to its sum. ROWS
    # rows are loaded before they are added, so ROWS loads are in flight rather than one; the adds keep their
    # order, and the bits are those of one row at a time: a row past the run loads -0.0, the exact identity of
    # an add (0.0 would turn a -0.0 sum, e.g. of a caller's dkv_acc, into +0.0). Spelled as bits: Triton
    # takes a float -0.0 (other=-0.0, tl.full) as +0.0, in the interpreter as in the compile for the GPU.
    s = tl.program_id(0).to(tl.int64) * BKEY + tl.arange(0, BKEY)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = s < n_keys
    first = tl.load(bounds_ptr + s, mask=inside, other=0).to(tl.int64)
    rows = (tl.load(bounds_ptr + s + 1, mask=inside, other=0).to(tl.int64) - first) * NHB
    first = first * NHB
    tile = (rows > 0)[:, None] & (c < W)[None, :]
    acc = tl.load(acc_ptr + s[:, None] * W + c[None, :], mask=tile, other=0.0)
    n_max = tl.max(rows, axis=0)
    neg_zero = tl.full([BKEY, BC], 0x80000000, tl.uint32).to(tl.float32, bitcast=True)
    j = 0
    while j < n_max:
        loaded = ()
        for u in tl.static_range(ROWS):
            more = tile & (j + u < rows)[:, None]
            loaded = loaded + (tl.load(contrib_ptr + (first + j + u)[:, None] * W + c[None, :], mask=more,
                                       other=neg_zero),)
        for u in tl.static_range(ROWS):
            acc += loaded[u]
        j += ROWS
    tl.store(acc_ptr + s[:, None] * W + c[None, :], acc, mask=tile)


def pick_order(idx: Tensor, t0: int, S: int, picks: Picks) -> tuple[Tensor, Tensor]:
    """For the picks idx [B, R, K] of rows t0..: (each pick's place in the stable order by key b * S + s,
    each key's run of sorted places, [bounds[key], bounds[key + 1]), as B * S + 1 bounds); dropped picks get
    key B * S, after every run."""
    place, sorted_keys = sorted_picks(idx, t0, S, picks)
    n_keys = idx.shape[0] * S
    bounds = torch.searchsorted(sorted_keys, torch.arange(n_keys + 1, device=idx.device, dtype=sorted_keys.dtype),
                                out_int32=place.dtype == torch.int32)
    return place, bounds


def sorted_picks(idx: Tensor, t0: int, S: int, picks: Picks) -> tuple[Tensor, Tensor]:
    """(each pick's place in the stable order by key b * S + s, the sorted keys); dropped picks get key B * S.
    Places are int32 where the picks' count allows, keys int32 where B * S does."""
    B, R, K = idx.shape
    n_keys = B * S
    kdt = torch.int32 if n_keys < 2**31 - 1 else torch.int64
    base = (torch.arange(B, device=idx.device, dtype=kdt) * S).view(B, 1, 1)
    keys = torch.where(picks.kept(idx, t0, S), idx.to(kdt) + base, n_keys).reshape(-1)
    sorted_keys, perm = torch.sort(keys, stable=True)
    small = keys.numel() < 2**31
    place = torch.empty_like(perm, dtype=torch.int32 if small else torch.int64)
    place.scatter_(0, perm, torch.arange(keys.numel(), device=idx.device, dtype=place.dtype))
    return place, sorted_keys


def _row_major_rows(x: Tensor, t0: int, R: int) -> tuple[Tensor, int]:
    """(x, 0) where each query row's [H, D] block is contiguous, else (a copy of rows t0..t0 + R, t0).

    The contribution kernel reads a row's q and dout blocks twice per block of picks, from L2. A head-major
    tensor (autograd's gradient of the absorbed output projection, a bmm over heads, is [B, H, T, D] in
    memory) puts a row's heads T * D elements apart: a power-of-two stride whose lines alias in L2. A copy
    of the chunk's rows (a few tens of MB) is read row-major instead."""
    if x.shape[2] == 1 or x.stride(2) == x.shape[3]:
        return x, 0
    return x[:, t0:t0 + R].contiguous(), t0


def _slices(programs: int, K: int, BK: int, device: torch.device) -> int:
    """Slices per row so that the chunk's programs reach PROGRAMS_PER_SM a SM (1 on the CPU)."""
    if device.type != "cuda" or PROGRAMS_PER_SM <= 0:
        return 1
    target = PROGRAMS_PER_SM * multiprocessors(device)
    return max(1, min(triton.cdiv(K, BK), triton.cdiv(target, programs)))


def backward(dout: Tensor, delta: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, indices: Tensor,
             scale: float, picks: Picks, empty: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes (contract: ``naive.backward``)."""
    B, T, H, Dqk = q.shape
    S, G, Dv, K = k.shape[1], k.shape[2], v.shape[3], indices.shape[-1]
    DC = Dqk + Dv
    dq = torch.zeros(B, T, H, Dqk, dtype=q.dtype, device=q.device)  # the kernels round their fp32 sums once
    acc = torch.zeros(B * S, G * DC, dtype=torch.float32, device=q.device)
    if B * T * H > 0 and K > 0 and S > 0:
        _run(dout, delta, q, k, v, lse, indices, scale, picks, dq, acc, fold=False)
    dkv = acc.view(B, S, G, DC)
    dk, dv = dkv[..., :Dqk], dkv[..., Dqk:]
    if empty == "mean":
        add_mean_grad(dv, dout, lse)
    return dq, dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


def backward_latent(dout: Tensor, delta: Tensor, q: Tensor, kv: Tensor, Dv: int, lse: Tensor, indices: Tensor,
                    scale: float, picks: Picks, empty: str, dkv_acc: Tensor | None = None,
                    out: Tensor | None = None, dlse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dq, dkv) in the inputs' dtypes, v being kv[..., :Dv] (contract: ``naive.backward_latent``): dkv = dk with
    dv added into its first Dv columns, each pick's contribution summed (ds^T q scale + p^T dout) before it is
    stored, so the buffer holds Dqk floats a pick instead of Dqk + Dv.

    ``dkv_acc`` (fp32 [B, S, G, Dqk], contiguous): kv's gradient is added into it (and returned, in fp32), so that
    a caller running the query rows in blocks sums it in fp32 across them; each key still adds its picks in (row,
    pick) order, so the bits are those of one call over all the rows.

    ``out`` ([B, T, H, Dv], contiguous, q's dtype): the forward's output is recomputed into it, o = p @ v by the
    dq kernel from the p the contribution kernel stores (rounded as its MMA takes it) and the rows it gathers for
    dq anyway; empty rows as the forward gives them. ``delta`` is then the caller's approximation (from an output
    it did not keep, e.g. the model's rounded projection of it), with ``dlse`` (or None) the lse gradient it holds:
    dq takes the row term consistent with the recomputed output (``naive.backward`` says why), dkv the caller's."""
    B, T, H, Dqk = q.shape
    S, G, K = kv.shape[1], kv.shape[2], indices.shape[-1]
    dq = torch.zeros(B, T, H, Dqk, dtype=q.dtype, device=q.device)  # the kernels round their fp32 sums once
    if dkv_acc is None:
        acc = torch.zeros(B * S, G * Dqk, dtype=torch.float32, device=q.device)
    else:
        assert dkv_acc.dtype == torch.float32 and dkv_acc.is_contiguous() and dkv_acc.shape == (B, S, G, Dqk)
        acc = dkv_acc.view(B * S, G * Dqk)
    kv = common.last_dim_unit(kv)
    work = B * T * H > 0 and K > 0 and S > 0
    if out is not None:
        assert out.shape == (B, T, H, Dv) and out.dtype == q.dtype and out.is_contiguous(), "out: [B, T, H, Dv]"
        if not work:
            out.zero_()
    if work:
        _run(dout, delta, q, kv, kv[..., :Dv], lse, indices, scale, picks, dq, acc, fold=True, out=out, dlse=dlse)
    dkv = acc.view(B, S, G, Dqk)
    if empty == "mean":
        add_mean_grad(dkv[..., :Dv], dout, lse)
        if out is not None:  # empty rows: p = 0 gave 0, the forward gave the mean of v
            HG = H // G
            vmean = value_mean(kv[..., :Dv]).repeat_interleave(HG, 1)[:, None].to(out.dtype)
            out.copy_(torch.where(empty_rows(lse)[..., None], vmean, out))
    return dq, (dkv if dkv_acc is not None else dkv.to(kv.dtype))


def _row_term(rd: Tensor, NKB: int, shift: Tensor, lse: Tensor, t0: int, R: int) -> Tensor:
    """eps [B, R, H] of a chunk, contiguous (the dq kernel reads row b * R + r): sum_j p_j dp_j (the contribution
    blocks' row sums, in block order) - shift; 0 at an empty row (lse -inf: p = 0, and an infinite lse gradient or
    a non-finite dout there would make eps * 0 NaN)."""
    B, _, H = shift.shape
    rows = slice(t0, t0 + R)
    eps = rd[:B * R * H * NKB].view(B, R, H, NKB).sum(-1) - shift[:, rows]
    return torch.where(empty_rows(lse[:, rows]), 0.0, eps).contiguous()


def contrib_heads(HG: int, dtype: torch.dtype) -> int:
    """Heads a contribution program handles per head block (all of a group's up to CONTRIB_HEAD_BLOCK)."""
    return min(common.pow2(HG), CONTRIB_HEAD_BLOCK if dtype != torch.float32 else CONTRIB_HEAD_BLOCK // 2)


def _run(dout, delta, q, k, v, lse, indices, scale, picks: Picks, dq: Tensor, acc: Tensor, fold: bool,
         out: Tensor | None = None, dlse: Tensor | None = None) -> None:
    B, T, H, Dqk = q.shape
    S, G, Dv, K = k.shape[1], k.shape[2], v.shape[3], indices.shape[-1]
    HG, W = H // G, acc.shape[1] // G
    q, dout = common.last_dim_unit(q), common.last_dim_unit(dout)
    if not fold:  # (the latent entry made kv's last stride 1 and took v from it)
        k, v = common.last_dim_unit(k), common.last_dim_unit(v)
    alias = common.aliases(k, v)
    assert alias or not fold, "the folded (latent) backward needs v = k[..., :Dv]"
    DA, BDA, BDB, BDV = common.split(Dqk, Dv, alias)
    BH, launches = passes(HG, BDA, BDB, BDV, q.dtype, K, fold, recompute=out is not None)
    NHB = triton.cdiv(HG, BH)
    split = len(launches) > 1
    assert split or out is None, "the output is recomputed by the split backward's dq kernel"
    BHQ = BH if out is None else min(BH, OUT_HEAD_BLOCK or BH)  # heads a dq program
    NHBQ = triton.cdiv(HG, BHQ)
    NCOL = OUT_COL_SPLIT if out is not None and BDA % OUT_COL_SPLIT == 0 and BDA // OUT_COL_SPLIT >= 16 else 1
    CBH = contrib_heads(HG, q.dtype)
    CNHB = triton.cdiv(HG, CBH)
    contrib_blocks = 1 if split else NHB  # a contribution per pick (all heads), or per pick and head block
    step = max(launch[2] for launch in launches)  # slices are a multiple of every pass's BK (powers of two)
    # a split backward's ds [rows, H, K] for the dq kernel (and p beside it where the output is recomputed)
    ds_bytes = H * q.element_size() * (2 if out is not None else 1) if split else 0
    rows = max(1, min(T, CONTRIB_BYTES // (B * K * (contrib_blocks * G * W * 4 + ds_bytes))))
    contrib = torch.empty(B * rows * K * contrib_blocks * G * W, dtype=torch.float32, device=q.device)
    ds = torch.empty(B * rows * H * K if split else 0, dtype=q.dtype, device=q.device)
    p_buf = torch.empty(B * rows * H * K if out is not None else 0, dtype=q.dtype, device=q.device)
    # the contribution blocks' row sums of p * dp, for the recomputed output's row term
    NKB = triton.cdiv(K, launches[-1][2]) if out is not None else 0
    rd = torch.empty(B * rows * H * NKB, dtype=torch.float32, device=q.device)
    idx = indices.contiguous()
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    # rowsum(dout * the caller's output): what the row term of the recomputed output replaces
    shift = delta if out is None or dlse is None else (delta + dlse.float()).contiguous()
    offs = picks.offsets.to(torch.int64).contiguous() if picks.offsets is not None else idx
    km = picks.key_mask.view(torch.uint8) if picks.key_mask is not None else idx
    km_strides = km.stride() if picks.key_mask is not None else (0, 0)
    prec = common.mma_precision(q.dtype)
    flags = dict(CAUSAL=bool(picks.causal), HAS_OFFS=picks.offsets is not None, HAS_KM=picks.key_mask is not None,
                 PREC=prec, DA=DA, BDA=BDA, BDB=BDB)

    def strides_of(q, dout):  # the kernels' stride arguments, for q and dout or their chunk copies
        return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *km_strides)

    strides = strides_of(q, dout)
    for t0 in range(0, T, rows):
        R = min(rows, T - t0)
        place, bounds = pick_order(idx[:, t0:t0 + R], t0, S, picks)
        P = _slices(B * R * G * (NHBQ * NCOL if split else NHB), K, step, q.device)
        slice_picks = triton.cdiv(triton.cdiv(K, P), step) * step
        P = triton.cdiv(K, slice_picks)
        dq_out, o_out, dq_T, dq_t0 = dq, out, T, 0
        if P > 1:
            dq_out, dq_T, dq_t0 = torch.empty(P, B, R, H, Dqk, dtype=torch.float32, device=q.device), R, t0
            if out is not None:
                o_out = torch.empty(P, B, R, H, Dv, dtype=torch.float32, device=q.device)
        if not split:
            _, _, BK, _, warps, stages = launches[0]
            _row_kernel[(B * R, G * NHB, P)](
                q, k, v, dout, lse, delta, idx, offs, km, place, dq_out, contrib, B, T, S, K, H, HG, NHB, G,
                Dqk, Dv, int(picks.offset), float(scale), float(scale) * common.LOG2E, *strides, t0, R,
                slice_picks, dq_T, dq_t0, ALIAS=alias, BDV=BDV, BH=BH, BK=BK, num_warps=warps,
                num_stages=stages, **flags)
        else:
            # contributions (one a pick for all the group's heads) and ds, then dq from ds; the contribution
            # kernel's slices need not match the dq kernel's (neither changes what a pick contributes)
            (_, _, BKQ, _, warps_q, stages_q), (_, _, BK, CH, warps, stages) = launches
            PC = _slices(B * R * G, K, BK, q.device)
            c_picks = triton.cdiv(triton.cdiv(K, PC), BK) * BK
            (q_c, q_t0), (do_c, do_t0) = _row_major_rows(q, t0, R), _row_major_rows(dout, t0, R)
            _contrib_kernel[(B * R, G, triton.cdiv(K, c_picks))](
                q_c, k, v, do_c, lse, delta, idx, offs, km, place, contrib, ds, p_buf, rd, NKB, T, S, K, H, HG, CNHB,
                G, Dqk, Dv, W, int(picks.offset), float(scale), float(scale) * common.LOG2E, *strides_of(q_c, do_c),
                t0, R, c_picks, q_t0, do_t0, ALIAS=alias, FOLD=fold, MULTI_HB=CNHB > 1, BDV=BDV, BH=CBH, BK=BK, CH=CH,
                CSTAGES=CONTRIB_STAGES, STORE_P=out is not None, num_warps=warps, num_stages=stages, **flags)
            eps = rd if out is None else _row_term(rd, NKB, shift, lse, t0, R)
            _dq_kernel[(B * R * G * NHBQ * NCOL, P)](
                k, idx, offs, km, ds, dq_out, p_buf, dq_out if o_out is None else o_out, eps, B, T, S, K,
                H, HG, NHBQ, G, Dqk, int(picks.offset), float(scale), *k.stride()[:3], *km_strides,
                t0, R, slice_picks, dq_T, dq_t0, Dv, **dict(flags, BDA=BDA // NCOL), BH=BHQ, BK=BKQ,
                WITH_O=out is not None, NCOL=NCOL, num_warps=warps_q, num_stages=stages_q)
        if P > 1:  # the slices' partials (each took the row term: it is linear in the picks), in slice order
            dq[:, t0:t0 + R] = dq_out.sum(0)
            if out is not None:
                out[:, t0:t0 + R] = o_out.sum(0)
        _segment_kernel[(triton.cdiv(B * S, SEGMENT_KEYS), triton.cdiv(G * W, SEGMENT_COLS))](
            contrib, bounds, acc, B * S, G * W, contrib_blocks, BKEY=SEGMENT_KEYS, BC=SEGMENT_COLS,
            ROWS=SEGMENT_ROWS)
