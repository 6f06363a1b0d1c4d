"""Triton forward of ``hyscale::sparse_attention`` (contract: ``naive.py``).

One program per (query row b, t; kv group g; block of BH heads of that group). The heads are the M
dimension of both MMAs (padded to 16), the gathered key rows the N dimension of S = q k^T and the K
dimension of O += p v: the loop walks the row's picks BK at a time with an online softmax in fp32
(exp2, running max and sum per head), p cast to the input dtype for the PV MMA where the inputs are
16-bit (as flash-attention does). One gathered row of k serves every head of the group: for the MLA
latent layout (G = 1, H = 128, Dqk = 576, v = k[..., :512]) a row of 576 values is read once per block
of 64 heads, the A block (``common.split``) doubling as the value row, and the work is compute-bound.
Two programs share a query row there (HEAD_BLOCK = 64: the fp32 accumulator O [64, 512] is 128 registers
a thread over 8 warps). Dropped picks (out of range, not visible) load nothing (masked loads: their k and v rows
are 0, so a NaN or inf elsewhere never meets p = 0) and count -inf.

Every program writes its own outputs once: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import common
from .common import LN2_C, causal_limit, load_picks, load_rows, mm  # used inside the kernels
from .naive import Picks, outputs, value_mean

# Tuning knobs (None: the rule in ``config``): heads per program at most, picks per step, warps, stages.
HEAD_BLOCK = 64
PICKS: int | None = None  # set: used as it is, whatever shared memory it needs
WARPS: int | None = None
STAGES: int | None = None
# sm_90's shared memory a block can opt into (227 KB)
SHARED_BYTES = 232448


def config(HG: int, BDA: int, BDB: int, BDV: int, dtype: torch.dtype, K: int,
           alias: bool = True) -> tuple[int, int, int, int]:
    """(BH, BK, warps, stages) for HG heads per group, the padded feature widths and whether v is k's A block.

    ptxas for sm_90a, bf16: MLA (64 heads, 512 + 64, v = the A block) at BK = 64, 8 warps, 2 stages: 255
    registers and 104 bytes spilled, 222 KB shared (BK = 32: no spill, 148 KB, but a third slower on the
    device: its gathers wait; 32 heads at BK = 64 slower still); GQA / MHA (16 heads, 128 or 128 + 64) at BK = 64,
    4 warps, 2 stages: 122 / 168 registers. fp32 (tf32x3) tiles are twice as wide: 16 heads a program, BK = 16
    (wide) or 32. Where v is not the A block, each stage also holds BK value rows: BK halves until the stages fit
    in SHARED_BYTES (the MLA widths with v a copy: 344 KB at BK = 64, 208 at 32), then the stages fall to 1. Timings:
    benchmarks/NOTES-sparse-attention.md."""
    BH, wide = common.head_block(HG, BDA + BDB + BDV, dtype, HEAD_BLOCK)
    stages = STAGES or 2
    BK = min(PICKS or (16 if wide and dtype == torch.float32 else 32 if dtype == torch.float32 else 64),
             common.pow2(K))
    while shared_bytes(BH, BK, BDA + BDB, 0 if alias else BDV, dtype, stages) > SHARED_BYTES:
        if BK > 16 and PICKS is None:
            BK //= 2
        elif stages > 1 and STAGES is None:
            stages -= 1
        else:
            break
    return BH, BK, WARPS or (8 if wide else 4), stages


def shared_bytes(BH: int, BK: int, width_k: int, width_v: int, dtype: torch.dtype, stages: int) -> int:
    """The forward program's shared memory as Triton lays it out on sm_90 (checked against its report): q's
    [BH, width_k] tile, and per pipeline stage BK gathered key rows and, unless v is k's A block, BK value rows."""
    elem = 4 if dtype == torch.float32 else 2
    return (BH * width_k + stages * BK * (width_k + width_v)) * elem


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, offs_ptr, km_ptr, vmean_ptr, out_ptr, lse_ptr,
                T, S, K, H, HG, NHB, Dqk, Dv, offset, scale_log2,
                sq_b, sq_t, sq_h, sk_b, sk_s, sk_g, sv_b, sv_s, sv_g, skm_b, skm_s,
                CAUSAL: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_KM: tl.constexpr, MEAN: tl.constexpr,
                ALIAS: tl.constexpr, PREC: tl.constexpr, DA: tl.constexpr, BDA: tl.constexpr,
                BDB: tl.constexpr, BDV: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    g = tl.program_id(1) // NHB
    hb = tl.program_id(1) % NHB
    b = row // T
    t = row % T
    hl = hb * BH + tl.arange(0, BH)  # head within the group
    hmask = hl < HG
    h = g * HG + hl
    ca = tl.arange(0, BDA)
    cv = tl.arange(0, BDV)
    q_row = q_ptr + b * sq_b + t * sq_t + h[:, None].to(tl.int64) * sq_h
    qa = tl.load(q_row + ca[None, :], mask=hmask[:, None] & (ca < DA)[None, :], other=0.0)
    if BDB > 0:
        cb = DA + tl.arange(0, BDB)
        qb = tl.load(q_row + cb[None, :], mask=hmask[:, None] & (cb < Dqk)[None, :], other=0.0)
    k_base = k_ptr + b * sk_b + g * sk_g
    v_base = v_ptr + b * sv_b + g * sv_g
    idx_row = idx_ptr + row * K
    km_row = km_ptr + b * skm_b
    lim = causal_limit(t, offset, offs_ptr, b, HAS_OFFS)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BDV), tl.float32)
    for k0 in range(0, K, BK):
        ids, ok = load_picks(idx_row, k0, K, S, lim, km_row, skm_s, CAUSAL, HAS_KM, BK)
        ka = load_rows(k_base, ids, ok, sk_s, ca, DA)
        s = mm(qa, tl.trans(ka), PREC)
        if BDB > 0:
            s += mm(qb, tl.trans(load_rows(k_base, ids, ok, sk_s, cb, Dqk)), PREC)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no kept pick yet: keep p and alpha at 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if ALIAS:
            vt = ka  # DA == Dv: the A block of the gathered row is its value row
        else:
            vt = load_rows(v_base, ids, ok, sv_s, cv, Dv)
        acc = acc * alpha[:, None] + mm(p.to(vt.dtype), vt, PREC)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if MEAN:
        vm = tl.load(vmean_ptr + (b * (H // HG) + g) * Dv + cv, mask=cv < Dv, other=0.0)
        o = tl.where(empty[:, None], vm[None, :], o)
    out_row = row * H + h.to(tl.int64)
    tl.store(out_ptr + out_row[:, None] * Dv + cv[None, :], o, mask=hmask[:, None] & (cv < Dv)[None, :])
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2_C)
    tl.store(lse_ptr + out_row, lse, mask=hmask)


def forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float, picks: Picks, empty: str,
            out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32), written into ``out`` / ``lse`` where given
    (contiguous)."""
    B, T, H, Dqk = q.shape
    S, G, Dv, K = k.shape[1], k.shape[2], v.shape[3], indices.shape[-1]
    HG = H // G
    out, lse = outputs(q, Dv, torch.float32, out, lse)
    if B * T * H == 0:
        return out, lse
    if K == 0 or S == 0:
        lse.fill_(float("-inf"))
        if empty == "mean" and S > 0:
            out.copy_(value_mean(v).repeat_interleave(HG, 1)[:, None])
        else:
            out.zero_()
        return out, lse
    q, k, v = (common.last_dim_unit(t) for t in (q, k, v))
    alias = common.aliases(k, v)
    DA, BDA, BDB, BDV = common.split(Dqk, Dv, alias)
    BH, BK, warps, stages = config(HG, BDA, BDB, BDV, q.dtype, K, alias)
    NHB = triton.cdiv(HG, BH)
    idx = indices.contiguous()
    offs = picks.offsets.to(torch.int64).contiguous() if picks.offsets is not None else idx
    km = picks.key_mask.view(torch.uint8) if picks.key_mask is not None else idx
    vmean = value_mean(v).float().contiguous() if empty == "mean" else lse
    _fwd_kernel[(B * T, G * NHB)](
        q, k, v, idx, offs, km, vmean, out, lse, T, S, K, H, HG, NHB, Dqk, Dv, int(picks.offset),
        float(scale) * common.LOG2E, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *(km.stride() if picks.key_mask is not None else (0, 0)),
        CAUSAL=bool(picks.causal), HAS_OFFS=picks.offsets is not None, HAS_KM=picks.key_mask is not None,
        MEAN=empty == "mean", ALIAS=alias, PREC=common.mma_precision(q.dtype), DA=DA, BDA=BDA, BDB=BDB, BDV=BDV,
        BH=BH, BK=BK, num_warps=warps, num_stages=stages)
    return out, lse

