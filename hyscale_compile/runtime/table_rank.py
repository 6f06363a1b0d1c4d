"""The table route's own ranker: each row's top k of its composite table, sorted and decoded, in one launch.

``torch.topk`` over the int64 composite table is exact, but on a decode step it is mostly host work: its
multi-block radix select issues about 34 kernels over int64 (eight 8-bit digit passes), and ``final_sort.values``
adds a launch for the values. Where the call is bound by its host work (an uncaptured decode step), one launch
of our own ranks each row instead: one program per row, with the final select's steps over the row's composites
(``final_select``: pivots from a strided sample, one pass that writes the sure winners and lists the entries
between the pivots, the k-th of the list by bisection, the rest of the winners emitted), then the winners sorted
in registers and decoded (``final_sort``). A row whose pivots miss ranks its whole row the same way: slower,
equally exact. The result is torch.topk's over the same composites, bit for bit (no two composites are equal, so
the top k and their order are unique).

One program reads its whole row, so the rule that picks this ranker (``plan.own_ranker``) keeps it to rows
short enough for one SM; longer rows keep torch.topk, whose passes spread a row over many.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .env import interpreting
from .final_pivots import SAMPLE, pivot_ranks
from .final_select import _emit, _kth, _slots
from .final_sort import _sort_decode, sort_width
from .score_tile import INT64_MIN

INT64_MAX = 2**63 - 1
RANK_WARPS = 16  # a row per program: the pass, the list and the sort of k = 2048 winners all want the SM's width
RANK_CHUNK = 4096  # composites a step of the pass over a row (8 a thread at 16 warps)
RANK_LIST_CHUNK = 512  # entries a step over the list
# Under the interpreter, which runs the programs one by one and sorts in numpy: a small sample and chunks (the
# same steps, the same bits; the pivots only decide how fast a row goes)
INTERPRETED = dict(samples=16, chunk=64, list_chunk=32, warps=1)

_MIN = tl.constexpr(INT64_MIN)
_MAX = tl.constexpr(INT64_MAX)


@triton.jit
def rank_kernel(comp_ptr, pos_ptr, val_ptr, scr_ptr, W, k, cap, i_hi, i_lo, SAMPLES: tl.constexpr,
                CH: tl.constexpr, LCH: tl.constexpr, TPB: tl.constexpr, KP: tl.constexpr):
    """Row r of comp [R, W] (composites): val[r, :k] and pos[r, :k] its k largest, descending, decoded.

    The winners are gathered as composites in pos[r, :k] (sure ones from the pass, the rest emitted from the
    list in scr[r, :cap]), then sorted and decoded where they lie.
    """
    r = tl.program_id(0).to(tl.int64)
    src = comp_ptr + r * W
    dst = pos_ptr + r * k
    scr = scr_ptr + r * cap
    j = tl.arange(0, SAMPLES)
    samp = tl.sort(tl.load(src + (j.to(tl.int64) * W) // SAMPLES), descending=True)  # a short row repeats
    hi = tl.max(tl.where(j == i_hi, samp, _MIN), axis=0)
    hi = tl.where(hi == _MIN, _MAX, hi)  # no such rank: nothing is a sure winner
    lo = tl.maximum(tl.max(tl.where(j == i_lo, samp, _MIN), axis=0), _MIN + 1)  # no such rank: every entry
    n_hi = tl.zeros((), dtype=tl.int32)
    n_mid = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, W, CH):
        offs = c0 + tl.arange(0, CH)
        x = tl.load(src + offs, mask=offs < W, other=_MIN)
        sure = x >= hi
        mid = (x >= lo) & (x < hi)
        before, tot = _slots(sure.to(tl.int32) + (mid.to(tl.int32) << 16), TPB)  # both counts, one scan
        s_slot = n_hi + (before & 0xFFFF)
        m_slot = n_mid + (before >> 16)
        tl.store(dst + s_slot, x, mask=sure & (s_slot < k))
        tl.store(scr + m_slot, x, mask=mid & (m_slot < cap))
        n_hi += tot & 0xFFFF
        n_mid += tot >> 16
    tl.debug_barrier()  # the list is read below, and the slow path rewrites the slots written above
    if (n_hi < k) & (n_hi + n_mid >= k) & (n_mid <= cap):
        K, V = _kth(scr, n_mid, n_mid, 0, k - n_hi, lo, hi, False, LCH)
        _emit(scr, n_mid, n_mid, 0, K, V, dst + n_hi, False, LCH, TPB)
    else:  # the pivots missed: the whole row is the list
        K, V = _kth(src, W, W, 0, k, tl.full((), _MIN + 1, tl.int64), tl.full((), _MAX, tl.int64), False, CH)
        _emit(src, W, W, 0, K, V, dst, False, CH, TPB)
    _sort_decode(dst, val_ptr + r * k, k, KP)


def rank(comp: Tensor, k: int, *, samples: int | None = None, ranks: tuple[int, int] | None = None,
         cap: int | None = None, chunk: int | None = None, list_chunk: int | None = None,
         warps: int | None = None) -> tuple[Tensor, Tensor]:
    """(values fp32 [..., k], positions int64 [..., k]) of the k largest composites of each row of ``comp``
    [..., W] (contiguous int64, 1 <= k <= W, k <= final_sort.SORT_MAX), ordered by value desc, position asc.

    The keyword arguments are for tests: the sample and chunk sizes (default: RANK_* on a device, INTERPRETED
    under the interpreter), and pivot ranks or a list size that force the slow path."""
    sizes = INTERPRETED if interpreting() else dict(samples=SAMPLE, chunk=RANK_CHUNK, list_chunk=RANK_LIST_CHUNK,
                                                     warps=RANK_WARPS)
    samples = sizes["samples"] if samples is None else samples
    chunk = sizes["chunk"] if chunk is None else chunk
    list_chunk = sizes["list_chunk"] if list_chunk is None else list_chunk
    warps = sizes["warps"] if warps is None else warps
    W = comp.shape[-1]
    kp = sort_width(k)
    assert comp.dtype == torch.int64 and comp.is_contiguous() and 1 <= k <= W and kp, "rank: int64 rows, k <= W"
    assert chunk % (32 * warps) == 0 and list_chunk % (32 * warps) == 0 and chunk < 2**15  # see _slots
    i_hi, i_lo, default_cap = pivot_ranks(k, W, samples)
    i_hi, i_lo = ranks if ranks is not None else (i_hi, i_lo)
    cap = default_cap if cap is None else cap
    lead = comp.shape[:-1]
    R = comp.numel() // W
    pos = torch.empty(*lead, k, dtype=torch.int64, device=comp.device)
    val = torch.empty(*lead, k, dtype=torch.float32, device=comp.device)
    if R:
        scratch = torch.empty(R, cap, dtype=torch.int64, device=comp.device)
        rank_kernel[(R,)](comp, pos, val, scratch, W, k, cap, i_hi, i_lo, SAMPLES=samples, CH=chunk, LCH=list_chunk,
                          TPB=32 * warps, KP=kp, num_warps=warps)
    return val, pos
