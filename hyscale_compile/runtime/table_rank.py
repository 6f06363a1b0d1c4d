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

One program reads its whole row, so the rule that picks the ranker (``plan.table_ranker``) keeps that to rows
short enough for one SM; a longer row's pass is split over programs of ``split_keys`` composites, which take
their slots from the row's counters by atomics, and a second launch finishes each row (two launches; the
table's launch zeroes the counters: ``table_path.composites``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .env import interpreting
from .fast_launch import launch
from .final_pivots import SAMPLE, pivot_ranks
from .final_select import INT64_MAX, _emit, _kth, classify, pivot_pair, place
from .final_sort import _sort_decode, sort_width
from .score_tile import INT64_MIN

RANK_WARPS = 16  # a row per program: the pass, the list and the sort of k = 2048 winners all want the SM's width
RANK_CHUNK = 4096  # composites a step of the pass over a row (8 a thread at 16 warps)
RANK_LIST_CHUNK = 512  # entries a step over the list
SPLIT_WAVE = 4  # the split pass's programs aimed for per SM: one wave of 16-warp programs (see split_keys)
# Under the interpreter, which runs the programs one by one and sorts in numpy: a small sample and chunks (the
# same steps, the same bits; the pivots only decide how fast a row goes)
INTERPRETED = dict(samples=16, chunk=64, list_chunk=32, warps=1)
_ON_DEVICE = dict(samples=SAMPLE, chunk=RANK_CHUNK, list_chunk=RANK_LIST_CHUNK, warps=RANK_WARPS)

# The row's length and the sizes that follow from it (its pivots' ranks, its list's size) are not specialized: a
# decode step's row grows by one key a step, and specializing them on divisibility by 16 (and on 1) compiled up to
# 20 variants of each kernel over a decode of a few thousand to a hundred thousand keys, a compile of seconds at
# steps nobody can predict.
_ROW_SIZES = ["W", "cap", "i_hi", "i_lo"]

_MIN = tl.constexpr(INT64_MIN)
_MAX = tl.constexpr(INT64_MAX)


@triton.jit
def _pivots(src, W, i_hi, i_lo, SAMPLES: tl.constexpr):
    """(hi, lo) of a row: two ranks of a strided sample of its composites, sorted (a short row repeats)."""
    j = tl.arange(0, SAMPLES)
    return pivot_pair(tl.sort(tl.load(src + (j.to(tl.int64) * W) // SAMPLES), descending=True), j, i_hi, i_lo)


@triton.jit
def _finish(src, W, dst, val, scr, k, cap, hi, lo, n_hi, n_mid, CH: tl.constexpr, LCH: tl.constexpr,
            TPB: tl.constexpr, KP: tl.constexpr):
    """The rest of the winners from the list (or, where the pivots missed, the whole row), then all k sorted and
    decoded where they lie: val[:k] the values, dst[:k] the positions."""
    if (n_hi < k) & (n_hi + n_mid >= k) & (n_mid <= cap):
        K, V = _kth(scr, n_mid, n_mid, 0, k - n_hi, lo, hi, False, LCH)
        _emit(scr, n_mid, n_mid, 0, K, V, dst + n_hi, False, LCH, TPB)
    else:  # the pivots missed: the whole row is the list
        K, V = _kth(src, W, W, 0, k, tl.full((), _MIN + 1, tl.int64), tl.full((), _MAX, tl.int64), False, CH)
        _emit(src, W, W, 0, K, V, dst, False, CH, TPB)
    _sort_decode(dst, val, k, KP)


@triton.jit(do_not_specialize=_ROW_SIZES)
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
    hi, lo = _pivots(src, W, i_hi, i_lo, SAMPLES)
    n_hi = tl.zeros((), dtype=tl.int32)
    n_mid = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, W, CH):
        offs = c0 + tl.arange(0, CH)
        x = tl.load(src + offs, mask=offs < W, other=_MIN)
        sure, mid, before, tot = classify(x, hi, lo, TPB)
        place(x, sure, mid, before, n_hi, n_mid, dst, scr, k, cap)
        n_hi += tot & 0xFFFF
        n_mid += tot >> 16
    tl.debug_barrier()  # the list is read below, and the slow path rewrites the slots written above
    _finish(src, W, dst, val_ptr + r * k, scr, k, cap, hi, lo, n_hi, n_mid, CH, LCH, TPB, KP)


@triton.jit(do_not_specialize=[*_ROW_SIZES, "seg"])  # its segment follows from the row length too
def split_pass_kernel(comp_ptr, pos_ptr, scr_ptr, cnt_ptr, W, k, cap, seg, i_hi, i_lo, SAMPLES: tl.constexpr,
                      CH: tl.constexpr, TPB: tl.constexpr):
    """Segment program_id(1) (``seg`` composites) of row r's pass, for rows too long for one program: the row's
    pivots (every program of the row computes the same), then its chunks' sure winners and list entries at slots
    taken from the row's two counters cnt[r] (zeroed), so the slots' order is the programs' and may differ from
    run to run; the winners are sorted afterwards, so the result does not."""
    r = tl.program_id(0).to(tl.int64)
    src = comp_ptr + r * W
    dst = pos_ptr + r * k
    scr = scr_ptr + r * cap
    hi, lo = _pivots(src, W, i_hi, i_lo, SAMPLES)
    end = tl.minimum(tl.program_id(1).to(tl.int64) * seg + seg, W)
    for c0 in range(tl.program_id(1).to(tl.int64) * seg, end, CH):
        offs = c0 + tl.arange(0, CH)
        x = tl.load(src + offs, mask=offs < end, other=_MIN)
        sure, mid, before, tot = classify(x, hi, lo, TPB)
        n_hi = tl.atomic_add(cnt_ptr + 2 * r, tot & 0xFFFF, sem="relaxed")  # the slots before this chunk's
        n_mid = tl.atomic_add(cnt_ptr + 2 * r + 1, tot >> 16, sem="relaxed")
        place(x, sure, mid, before, n_hi, n_mid, dst, scr, k, cap)


@triton.jit(do_not_specialize=_ROW_SIZES)
def split_finish_kernel(comp_ptr, pos_ptr, val_ptr, scr_ptr, cnt_ptr, W, k, cap, i_hi, i_lo,
                        SAMPLES: tl.constexpr, CH: tl.constexpr, LCH: tl.constexpr, TPB: tl.constexpr,
                        KP: tl.constexpr):
    """Row r after split_pass_kernel: its counts, then _finish as rank_kernel's."""
    r = tl.program_id(0).to(tl.int64)
    src = comp_ptr + r * W
    hi, lo = _pivots(src, W, i_hi, i_lo, SAMPLES)
    _finish(src, W, pos_ptr + r * k, val_ptr + r * k, scr_ptr + r * cap, k, cap, hi, lo, tl.load(cnt_ptr + 2 * r),
            tl.load(cnt_ptr + 2 * r + 1), CH, LCH, TPB, KP)


def _sizes(samples, chunk, list_chunk, warps) -> tuple[int, int, int, int]:
    """The kernels' sample and chunk sizes and warps: RANK_* on a device, INTERPRETED under the interpreter; a
    value given wins (tests)."""
    d = INTERPRETED if interpreting() else _ON_DEVICE
    if samples is None and chunk is None and list_chunk is None and warps is None:  # every call but tests'
        return d["samples"], d["chunk"], d["list_chunk"], d["warps"]
    got = dict(samples=samples, chunk=chunk, list_chunk=list_chunk, warps=warps)
    samples, chunk, list_chunk, warps = (d[n] if got[n] is None else got[n] for n in d)
    assert _fits(chunk, list_chunk, warps), "rank: chunks of whole steps of the warps' threads, below 2**15"
    return samples, chunk, list_chunk, warps


def _fits(chunk: int, list_chunk: int, warps: int) -> bool:
    """Chunks of whole steps of the program's threads, a chunk's slots countable in 15 bits (final_select._slots)."""
    return chunk % (32 * warps) == 0 and list_chunk % (32 * warps) == 0 and chunk < 2**15


assert all(_fits(d["chunk"], d["list_chunk"], d["warps"]) for d in (INTERPRETED, _ON_DEVICE))


def split_keys(rows: int, W: int, sms: int) -> int:
    """Composites a program of the split pass takes: the fewest whole RANK_CHUNKs with which the pass over ``rows``
    rows of W composites is one wave of SPLIT_WAVE programs per SM (``sms`` of them). Every program first ranks
    the row's sample for its pivots (a few microseconds whatever its share), so programs past a wave only add
    that; fewer leave SMs idle while a row's chunks go one after another (NOTES-selection.md, "Defaults ...":
    table ranker). A multiple of RANK_CHUNK, hence of the interpreter's chunk too."""
    per_row = max(1, SPLIT_WAVE * sms // rows)  # programs a row may have
    return RANK_CHUNK * max(1, -(-W // (RANK_CHUNK * per_row)))


def rank(comp: Tensor, k: int, *, split: int | None = None, counts: Tensor | None = None,
         samples: int | None = None, ranks: tuple[int, int] | None = None, cap: int | None = None,
         chunk: int | None = None, list_chunk: int | None = None, warps: int | None = None) -> tuple[Tensor, Tensor]:
    """(values fp32 [..., k], positions int64 [..., k]) of the k largest composites of each row of ``comp``
    [..., W] (contiguous int64, 1 <= k <= W, k <= final_sort.SORT_MAX), ordered by value desc, position asc.
    Composites as the table kernel writes them: an order key above INT32_MIN (the lowest, -inf's, is 0x807FFFFF;
    the final select's steps take INT32_MIN for an empty slot) and a position below 2**31.

    One program a row; with ``split``, a row's pass is spread over programs of ``split`` composites each (a
    multiple of the chunk) and a second launch finishes each row (for rows too long for one SM). Its counters:
    ``counts`` (int32 [rows, 2], zeroed: the table's launch zeroes them), or zeros of its own. The other keyword
    arguments are for tests: the sample and chunk sizes, and pivot ranks or a list size that force the slow
    path."""
    samples, chunk, list_chunk, warps = _sizes(samples, chunk, list_chunk, warps)
    W = comp.shape[-1]
    kp = sort_width(k)
    assert comp.dtype == torch.int64 and comp.is_contiguous() and 1 <= k <= W and kp, "rank: int64 rows, k <= W"
    assert split is None or (split > 0 and split % chunk == 0), "rank: split must be a multiple of the chunk"
    i_hi, i_lo, default_cap = pivot_ranks(k, W, samples)
    i_hi, i_lo = ranks if ranks is not None else (i_hi, i_lo)
    cap = default_cap if cap is None else cap
    lead = comp.shape[:-1]
    R = comp.numel() // W
    pos = torch.empty(*lead, k, dtype=torch.int64, device=comp.device)
    val = torch.empty(*lead, k, dtype=torch.float32, device=comp.device)
    if not R:
        return val, pos
    scratch = torch.empty(R, cap, dtype=torch.int64, device=comp.device)
    sizes = dict(SAMPLES=samples, CH=chunk, TPB=32 * warps, num_warps=warps)
    if split is None:
        launch(rank_kernel, (R,), (comp, pos, val, scratch, W, k, cap, i_hi, i_lo),
               dict(LCH=list_chunk, KP=kp, **sizes))
        return val, pos
    if counts is None:  # each row's sure winners and list entries
        counts = torch.zeros(R, 2, dtype=torch.int32, device=comp.device)
    assert counts.shape == (R, 2) and counts.dtype == torch.int32 and counts.is_contiguous(), "rank: counts [R, 2]"
    launch(split_pass_kernel, (R, -(-W // split)), (comp, pos, scratch, counts, W, k, cap, split, i_hi, i_lo), sizes)
    launch(split_finish_kernel, (R,), (comp, pos, val, scratch, counts, W, k, cap, i_hi, i_lo),
           dict(LCH=list_chunk, KP=kp, **sizes))
    return val, pos
