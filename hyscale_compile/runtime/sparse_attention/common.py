"""What the forward and backward kernels share: the split of the key features, the pick loads, the MMA rule.

Key features are read in two column blocks: A = [0, DA) and a tail B = [DA, Dqk). In the MLA latent layout
(v a view of k's first Dv features) DA = Dv, so the A block of a gathered row is its value row as well:
each gathered row is read once, for q.k and for p.v. Otherwise DA is the largest power of two <= Dqk
(576 -> 512 + 64, 192 -> 128 + 64, 128 -> 128 + none), so no block is padded to twice its width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..env import interpreting

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # for use inside kernels
LN2_C = tl.constexpr(0.6931471805599453)

# fp32 inputs on the GPU: "tf32x3" (three tf32 MMAs on a hi / lo split: about fp32's accuracy on tensor
# cores); "ieee" is exact fp32 but runs on the FMA units (ptxas: it spills heavily at these tiles). The
# interpreter computes in fp32 ("ieee").
FP32_PRECISION = "tf32x3"


def pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


def head_block(HG: int, width: int, dtype: torch.dtype, most: int) -> tuple[int, bool]:
    """(heads per program, wide): at most ``most`` heads (16 for fp32, whose tiles are twice the bytes);
    wide = a program's q / dout tiles ([heads, padded Dqk + Dv]) hold 64 KB or more (the MLA layer)."""
    BH = min(pow2(HG), max(16, most if dtype != torch.float32 else 16))
    return BH, BH * width * (4 if dtype == torch.float32 else 2) >= 64 * 1024


def aliases(k: Tensor, v: Tensor) -> bool:
    """v is k's first Dv features (``v = k[..., :Dv]``): same storage, offset and strides."""
    return (v.shape[:3] == k.shape[:3] and v.shape[3] <= k.shape[3] and k.stride(-1) == 1
            and v.stride() == k.stride() and v.storage_offset() == k.storage_offset()
            and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())


def split(Dqk: int, Dv: int, alias: bool) -> tuple[int, int, int, int]:
    """(DA, BDA, BDB, BDV): the A block's width and the padded widths of A, tail B (0: none) and v."""
    DA = Dv if alias else 1 << (Dqk.bit_length() - 1)
    DB = Dqk - DA
    return DA, pow2(DA), (pow2(DB) if DB > 0 else 0), pow2(Dv)


def mma_precision(dtype: torch.dtype) -> str:
    """The kernels' PREC: 16-bit operands as stored ("native"; widened in the interpreter, whose dot takes
    fp32 only: "upcast", the products are exact either way), fp32 by FP32_PRECISION."""
    if dtype != torch.float32:
        return "upcast" if interpreting() else "native"
    return "ieee" if interpreting() else FP32_PRECISION


def last_dim_unit(t: Tensor) -> Tensor:
    """Kernels take any strides but a unit last one."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation under the PREC rule (mma_precision)."""
    if PREC == "native":
        c = tl.dot(a, b, out_dtype=tl.float32)
    elif PREC == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def mm_acc(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b, accumulated in the MMA (fp32) under the PREC rule: a dot split along its K dimension into such
    steps adds its products in the order one dot over the whole K dimension would."""
    if PREC == "native":
        c = tl.dot(a, b, acc, out_dtype=tl.float32)
    elif PREC == "upcast":
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision=PREC)
    return c


@triton.jit
def load_picks(idx_row, k0, k_end, S, lim, km_row, skm_s, CAUSAL: tl.constexpr, HAS_KM: tl.constexpr,
               BK: tl.constexpr):
    """Picks k0..k0+BK of a row (those below k_end): (key positions, 0 where dropped; kept)."""
    js = k0 + tl.arange(0, BK)
    ids = tl.load(idx_row + js, mask=js < k_end, other=-1).to(tl.int64)
    ok = (ids >= 0) & (ids < S)
    if CAUSAL:
        ok = ok & (ids <= lim)
    if HAS_KM:
        ok = ok & (tl.load(km_row + ids * skm_s, mask=ok, other=0) != 0)
    return tl.where(ok, ids, 0), ok


@triton.jit
def load_rows(base, ids, ok, stride_s, cols, width):
    """Gathered rows ``base + ids * stride_s`` at columns ``cols < width``; dropped picks read nothing."""
    return tl.load(base + ids[:, None] * stride_s + cols[None, :], mask=ok[:, None] & (cols < width)[None, :],
                   other=0.0)


@triton.jit
def causal_limit(t, offset, offs_ptr, b, HAS_OFFS: tl.constexpr):
    """The last key position query t may see: t + offset (+ offsets[b])."""
    lim = t + offset
    if HAS_OFFS:
        lim = lim + tl.load(offs_ptr + b).to(tl.int64)
    return lim


@triton.jit
def store_dq(dq_ptr, dq_row, cols, acc, scale, hmask, width, Dqk):
    """One block of dq [heads, cols] (columns below width): scaled, and rounded once to dq's dtype."""
    tl.store(dq_ptr + dq_row[:, None] * Dqk + cols[None, :], (acc * scale).to(dq_ptr.dtype.element_ty),
             mask=hmask[:, None] & (cols < width)[None, :])


@triton.jit
def chunk_row(pid, R, t0, T):
    """(b, t, b * T + t) of program row pid = b * R + r of a chunk of R query rows starting at t0."""
    b = pid // R
    t = t0 + pid % R
    return b, t, b * T + t


@triton.jit
def block_heads(hb, g, HG, BH: tl.constexpr):
    """(the query heads of head block hb of kv group g, int64 [BH]; which of them exist)."""
    hl = hb * BH + tl.arange(0, BH)
    return (g * HG + hl).to(tl.int64), hl < HG
