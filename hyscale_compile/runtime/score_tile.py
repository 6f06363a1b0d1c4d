"""The one score arithmetic every HyTopK kernel uses.

``score_tile`` computes a [BLOCK_T, BLOCK_S] tile of
    sum_h wt[t, h] * act(dot(q[t, h, :], kx[s, :]))      wt = w * scale (fp32, or scale without weights)
in fp32, heads in order 0..H-1, one fused multiply-add per head, for any set of query rows and key
columns (contiguous or gathered): callers pass row and column offsets, so sampling, filtering and
recovery all run the very same instructions with the same tile shapes, and the score of (t, s) is
bit-identical in all of them. ``act`` is max(x, 0) for a ReLU with scale >= 0 and min(x, 0) for a
negative scale (scale * min(x, 0) == max(scale * x, 0)), both keeping NaN like torch.relu.

Why the fold: per head and element the tile then costs one max and one FMA after the MMA (it was a
multiply, a compare-select and a multiply-add), and that epilogue is what bounds the kernel.

``tile_values`` applies the visibility (range, bool mask, additive bias, fill) exactly as the
reference does, ``block_rows`` gives a query block's rows and ranges, and ``order_key`` /
``composite`` give the integer orders the selection works in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .env import interpreting


@dataclass
class TileConfig:
    """Tile shape and warps shared by every kernel of one call (same shape => same MMA => same bits)."""

    bt: int = 64  # query rows per tile
    bs: int = 128  # keys per tile
    warps: int = 4
    stages: int = 2
    # how the filter hands out candidate slots: one of filter_append's APPEND_* (scan, atomic, PTX,
    # reserved); None: the rule of plan.append_kind
    append: int | None = None
    maxnreg: int | None = None  # register cap (fewer registers -> more tiles in flight per SM)
    tma: bool = True  # block_kernel reads q and kx by tensor descriptor where tma_views allows


TILE = TileConfig()  # the tile of every call (a plan.Tuning names another for one call)

# HAS_MASK: no mask, a mask read per (row, key) with its strides, or one that depends on the batch and key only
# (stride 0 along the rows: a padding mask broadcast over the queries), which a kernel whose tile shares one batch
# may read once per key tile (``key_visible``). Both nonzero: every ``if HAS_MASK`` reads either with its strides.
MASK_NONE = tl.constexpr(0)
MASK_TABLE = tl.constexpr(1)
MASK_KEYS = tl.constexpr(2)

INT32_MIN = -(2**31)
INT64_MIN = -(2**63)


def precision(dtype: torch.dtype) -> str:
    """score_tile's PREC for operands of ``dtype``: 16-bit as stored (widened under the interpreter,
    whose dot cannot take them; the products are exact either way), fp32 in fp32 unless torch's own
    matmul setting allows tf32. The sparse backward's gate dots follow the same rule."""
    if dtype != torch.float32:
        return "upcast" if interpreting() else "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def block_d(D: int) -> int:
    """Head-dim tile: a power of two, at least 16 (the smallest tensor-core K)."""
    return max(16, 1 << (D - 1).bit_length())  # triton.next_power_of_2 is a jit function: microseconds a call


def tma_views(q: torch.Tensor, kx: torch.Tensor, tile: TileConfig) -> dict:
    """filter_kernel's extra arguments for reading q and kx through tensor descriptors (TMA), or {}
    where their layout or the device does not allow it (the pointer path then runs, same bits).

    The scoring floor runs faster so (benchmarks/NOTES-selection.md, "Defaults and the measurements
    behind them": descriptors). Needs 16-bit operands and D of 64 or 128 on NVIDIA sm_90+ (any dtype
    and power of two under the interpreter), q rows [B*T, H*D] and kx rows [B*S, D] as 2-D views
    with unit last stride, 16-byte aligned bases and row strides.
    """
    B, T, H, D = q.shape
    S = kx.shape[1]
    if not tile.tma or D != block_d(D) or kx.shape[0] != B or min(B * T, S, H) == 0:
        return {}
    if max(B * T, B * S, H * D) >= 2**31:  # descriptor coordinates are int32
        return {}
    if not interpreting():
        if not (q.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(q.device)[0] >= 9):
            return {}
        if q.dtype not in (torch.bfloat16, torch.float16) or D not in (64, 128):
            return {}  # D: the sizes the GPU tests run; others keep pointers until measured
    if q.stride()[1:] != (H * D, D, 1) or (B > 1 and q.stride(0) != T * H * D):
        return {}
    if kx.stride()[1:] != (D, 1) or (B > 1 and kx.stride(0) != S * D):
        return {}
    q2 = q.as_strided((B * T, H * D), (H * D, 1))
    k2 = kx.as_strided((B * S, D), (D, 1))
    if q2.data_ptr() % 16 or k2.data_ptr() % 16 or (H * D * q.element_size()) % 16 or (D * kx.element_size()) % 16:
        return {}
    from triton.tools.tensor_descriptor import TensorDescriptor

    return dict(TMA=True, q_desc=TensorDescriptor.from_tensor(q2, [tile.bt, D]),
                k_desc=TensorDescriptor.from_tensor(k2, [tile.bs, D]))


ACT_NONE = 0
ACT_MAX = 1  # relu, scale >= 0
ACT_MIN = 2  # relu, scale < 0


def act_kind(relu: bool, scale: float) -> int:
    """Which activation the folded arithmetic applies (see the module note)."""
    if not relu:
        return ACT_NONE
    return ACT_MIN if scale < 0 else ACT_MAX


@triton.jit
def score_tile(q_ptr, kx_ptr, w_ptr, q_rows, w_rows, k_cols, row_ok, col_ok,
               H, stride_qh, stride_wh, scale,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
               ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
               q_desc=None, k_desc=None, q_row0=0, k_row0=0, TMA: tl.constexpr = False):
    """fp32 [BT, BS] scores. q_rows / w_rows / k_cols are int64 element offsets of each row / key.

    Each head's weight is w * scale, rounded to fp32 as torch rounds ``w * scale`` (fp32 weights, the scale
    an fp32 argument): the kernels take the caller's weights and the scale, so no call spends a torch op on
    the product. Without weights every head is weighted by ``scale``.
    PREC is "ieee" or "tf32" for fp32 operands, or "upcast": 16-bit operands widened to fp32 first
    (only under the CPU interpreter, whose dot cannot take bf16; the products are exact either way).

    TMA: q and kx come through tensor descriptors instead (``tma_views``): the tile's rows are q's
    2-D rows q_row0 .. q_row0 + BT and its keys kx's rows k_row0 .. k_row0 + BS, read whole (rows
    and keys past the caller's range hold other data or zeros: the caller masks them, as it masks
    the pointer path's zeros). Same operands, same dots, same epilogue: the same bits wherever the
    row and key are in range (the benchmark floor's row sums add up the rest too).
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if TMA:
        kt = k_desc.load([k_row0, 0]).T
    else:
        kt = tl.load(kx_ptr + k_cols[None, :] + offs_d[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    acc = tl.zeros((BT, BS), dtype=tl.float32)
    for h in range(H):
        if TMA:
            qh = q_desc.load([q_row0, h * D])
        else:
            qh = tl.load(q_ptr + q_rows[:, None] + h * stride_qh + offs_d[None, :],
                         mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if PREC == "upcast":
            s = tl.dot(qh.to(tl.float32), kt.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        else:
            s = tl.dot(qh, kt, input_precision=PREC, out_dtype=tl.float32)
        if HAS_W:
            w = (tl.load(w_ptr + w_rows + h * stride_wh, mask=row_ok, other=0.0) * scale)[:, None]
        else:
            w = scale
        acc = act_fma(s, w, acc, ACT)
    return acc


@triton.jit
def act_fma(s, w, acc, ACT: tl.constexpr):
    """acc + w * act(s), rounded once: the per-head step every score kernel shares."""
    if ACT == 1:
        s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACT == 2:
        s = tl.minimum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.fma(s, w, acc)


@triton.jit
def tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs,
                HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Values as the reference defines them, and whether each entry lies in its row's [lo, hi) range.

    Entries in range but False in the bool mask get ``fill`` (they still compete, like any value);
    entries out of range are handled by the callers (they are masked positions with value ``fill``).
    """
    in_range = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & row_ok[:, None] & col_ok[None, :]
    v = acc
    visible = in_range
    if HAS_BIAS:
        boff = rows_b[:, None] * sbb + rows_t[:, None] * sbt + cols[None, :] * sbs
        v = v + tl.load(bias_ptr + boff, mask=in_range, other=0.0).to(tl.float32)
    if HAS_MASK:
        moff = rows_b[:, None] * smb + rows_t[:, None] * smt + cols[None, :] * sms
        visible = visible & (tl.load(mask_ptr + moff, mask=in_range, other=0) != 0)
    return tl.where(visible, v, fill), in_range


@triton.jit
def key_visible(b, cols, col_ok, mask_ptr, smb, sms):
    """[BS] bool: the key mask of batch ``b`` at ``cols`` (HAS_MASK == MASK_KEYS: the same for every row), False
    past S. ``tl.where(vis[None, :], acc, fill)`` then gives tile_values' values wherever the range holds."""
    return tl.load(mask_ptr + b * smb + cols * sms, mask=col_ok, other=0) != 0


@triton.jit
def block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT: tl.constexpr):
    """Rows of one query block, their [lo, hi) ranges, and the union range of the block."""
    rows_t, row_ok, rid = _block(pid_t, b, T, BT)
    lo = tl.load(lo_ptr + rid, mask=row_ok, other=0)
    hi = tl.load(hi_ptr + rid, mask=row_ok, other=0)
    blo, bhi = _span(row_ok, lo, hi, S)
    return rows_t, row_ok, rid, lo, hi, blo, bhi


@triton.jit
def block_rows_from(pid_t, b, T, first, S, BT: tl.constexpr):
    """block_rows where the ranges follow from the sizes (``Problem.first``): row t sees [0, clamp(t + first, 0,
    S)), the values problem.ranges would have written for rows below T (callers mask the others by row_ok)."""
    rows_t, row_ok, rid = _block(pid_t, b, T, BT)
    lo = tl.zeros([BT], dtype=tl.int64)
    hi = tl.minimum(tl.maximum(rows_t + first, 0), S)
    blo, bhi = _span(row_ok, lo, hi, S)
    return rows_t, row_ok, rid, lo, hi, blo, bhi


@triton.jit
def _block(pid_t, b, T, BT: tl.constexpr):
    """Query block pid_t's rows t, which of them exist, and their row ids b * T + t."""
    rows_t = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
    return rows_t, rows_t < T, b * T + rows_t


@triton.jit
def _span(row_ok, lo, hi, S):
    """The union [blo, bhi) of the existing rows' ranges (blo = S where none is open)."""
    blo = tl.min(tl.where(row_ok & (hi > lo), lo, S), axis=0)
    bhi = tl.max(tl.where(row_ok, hi, 0), axis=0)
    return blo, bhi


@triton.jit
def key_value(key):
    """The fp32 whose order_key is ``key`` (INT32_MIN, below every key, gives -inf)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return tl.where(key == -2147483648, float("-inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def raw_entry(v, pos):
    """int64 candidate as stored: fp32 bits high, position low (unordered; the final select orders)."""
    return (v.to(tl.int32, bitcast=True).to(tl.int64) << 32) | pos.to(tl.int64)


@triton.jit
def order_key(v):
    """int32 key ordered like torch.topk orders fp32 (NaN highest, -0.0 == +0.0); see reference.order_key."""
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(v == 0.0, 0, bits)
    bits = tl.where(v != v, 0x7FC00000, bits)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def composite(key, pos):
    """int64 unique per entry, ordered by (value desc, position asc) when sorted descending."""
    low = (4294967296 - pos.to(tl.int64)) - 1  # 2**32 - 1 - pos, kept in int64
    return (key.to(tl.int64) << 32) | low
