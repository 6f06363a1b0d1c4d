"""The final stage's last step: each row's k winners sorted by (value desc, position asc) and decoded.

The final select leaves each row's winners as composites (``score_tile.composite``), unsorted. Up to
SORT_MAX of them are sorted in registers by ``sort_decode_kernel``, a kernel of its own (fewer
registers, more warps than the select's) that writes the values and the positions where the
composites were; past that, ``torch.sort`` and ``decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fast_launch import launch
from .score_tile import INT64_MIN

SORT_MAX = 2048  # widest in-kernel sort of a row's winners (16 int64 registers a thread at 4 warps)

_MIN = tl.constexpr(INT64_MIN)


@triton.jit
def decode_words(x):
    """Composites -> (canonical fp32 values, int64 positions); see decode."""
    key = (x >> 32).to(tl.int32)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # order key -> fp32 bits (an involution)
    pos = (~x.to(tl.int32)).to(tl.int64)  # the low word is 0xFFFFFFFF - position, -1 - position as int32
    return bits.to(tl.float32, bitcast=True), pos


@triton.jit
def _sort_decode(dst, val, k, KP: tl.constexpr):
    """dst[0:k] composites -> sorted descending, then val[0:k] values and dst[0:k] positions."""
    tl.debug_barrier()  # the winners were written by other threads
    j = tl.arange(0, KP)
    v, pos = decode_words(tl.sort(tl.load(dst + j, mask=j < k, other=_MIN), descending=True))
    tl.debug_barrier()  # every thread has its winners before the positions overwrite them
    tl.store(val + j, v, mask=j < k)
    tl.store(dst + j, pos, mask=j < k)


@triton.jit
def sort_decode_kernel(comp_ptr, val_ptr, k, KP: tl.constexpr):
    """Row r's k composites (comp[r, :k]) sorted descending, then decoded: val[r, :k] the values and
    comp[r, :k] the positions. Apart from the final select, whose other steps need 4 warps and 96
    registers: the sort alone runs at 16 warps and 62 registers for k = 2048 (two rows per SM, 32
    warps), where inside the final select it had 4 warps at 128 registers and a spill."""
    r = tl.program_id(0).to(tl.int64)
    _sort_decode(comp_ptr + r * k, val_ptr + r * k, k, KP)


def sort_width(k: int) -> int:
    """The in-kernel sort's width for k (a power of two), or 0 where k is past what registers hold."""
    kp = 1 << max(0, (k - 1).bit_length())
    return kp if kp <= SORT_MAX else 0


def sort_warps(kp: int) -> int:
    """Warps of the sort kernel: 4 entries a thread, 4 to 16 warps, and one warp up to 512 entries (one
    warp holds the row in registers: no shared memory, no barriers; at k = 2048 its 254 registers
    leave too few warps). Measured apart from the final select, faster than the sort inside it
    (benchmarks/NOTES-selection.md, "Defaults and the measurements behind them": sort warps)."""
    return 1 if kp <= 512 else max(4, min(16, kp // 128))


@triton.jit
def values_kernel(comp_ptr, val_ptr, n, BLOCK: tl.constexpr):
    """val[i] = the canonical fp32 value of composite comp[i] (decode_words' value) for i < n, both contiguous."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    v, _ = decode_words(tl.load(comp_ptr + i, mask=ok, other=0))
    tl.store(val_ptr + i, v, mask=ok)


VALUES_BLOCK = 1024  # composites a program of values_kernel decodes


def values(comp: Tensor) -> Tensor:
    """``decode_values`` of a contiguous ``comp`` (torch.topk's values) in one launch: there it is three
    element-wise ops and two views, each with its own host work, where a decode step's [B, T, k] is tiny."""
    out = torch.empty(comp.shape, dtype=torch.float32, device=comp.device)
    n = comp.numel()
    launch(values_kernel, (-(-n // VALUES_BLOCK),), (comp, out, n), dict(BLOCK=VALUES_BLOCK))
    return out


def decode_values(comp: Tensor) -> Tensor:
    """Composites -> canonical fp32 values alone (three element-wise ops): where the positions are known
    otherwise (torch.topk's indices over a table indexed by position)."""
    key = comp.view(torch.int32)[..., 1::2]  # one view op fewer than unflatten, then select
    bits = key >> 31
    bits &= 0x7FFFFFFF
    bits ^= key
    return bits.view(torch.float32)


def decode(comp: Tensor) -> tuple[Tensor, Tensor]:
    """Composites -> (canonical fp32 values, int64 positions), working on the 32-bit halves.

    On a little-endian device an int64 viewed as int32 pairs is (low, high): high is the order key,
    whose bits come back as key ^ 0x7FFFFFFF for negative keys; low is 0xFFFFFFFF - position.
    """
    low = comp.view(torch.int32)[..., 0::2]
    return decode_values(comp), torch.bitwise_not(low).long()
