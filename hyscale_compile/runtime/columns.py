"""The columns of a register tile as separate tensors: moved, never computed.

Two kernels need a tile's columns one by one: the rescore takes each head's scores out of one MMA
result, and the filter's reserved append walks each thread's entries of a row. Reshapes, splits
and interleaves only relabel registers, so neither pays an instruction for it (a where + sum per
column would cost a pass over the tile each).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _halves(x):
    """[M, 2N] -> the even and the odd columns, [M, N] each."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _columns8(s):
    """The 8 columns of s [M, 8] as [M] tensors, in order: moved, not computed (no arithmetic)."""
    x0, x1 = _halves(s)  # columns 0 2 4 6 and 1 3 5 7
    x00, x01 = _halves(x0)  # 0 4 and 2 6
    x10, x11 = _halves(x1)  # 1 5 and 3 7
    c0, c4 = tl.split(x00)
    c2, c6 = tl.split(x01)
    c1, c5 = tl.split(x10)
    c3, c7 = tl.split(x11)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _interleave(e, o, N: tl.constexpr):
    """(e[0], o[0], e[1], o[1], ...): the columns of s from those of its even and odd halves."""
    out = ()
    for i in tl.static_range(N):
        out = out + (e[i], o[i])
    return out


@triton.jit
def _columns16(s):
    """The 16 columns of s [M, 16], in order."""
    ev, od = _halves(s)
    return _interleave(_columns8(ev), _columns8(od), 8)


@triton.jit
def _columns32(s):
    """The 32 columns of s [M, 32], in order."""
    ev, od = _halves(s)
    return _interleave(_columns16(ev), _columns16(od), 16)


@triton.jit
def _columns64(s):
    """The 64 columns of s [M, 64], in order."""
    ev, od = _halves(s)
    return _interleave(_columns32(ev), _columns32(od), 32)


@triton.jit
def columns(s, N: tl.constexpr):
    """The N (8, 16, 32 or 64) columns of s [M, N], in order."""
    tl.static_assert((N == 8) or (N == 16) or (N == 32) or (N == 64))
    if N == 8:
        return _columns8(s)
    elif N == 16:
        return _columns16(s)
    elif N == 32:
        return _columns32(s)
    else:
        return _columns64(s)
