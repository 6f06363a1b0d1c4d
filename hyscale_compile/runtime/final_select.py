"""The last HyTopK stage: each row's exact top k of its candidate buffer, sorted.

It replaces ``torch.topk`` over the whole buffer (a radix select that reads all W int64 entries of
a row on every pass: 1.8 ms for 4096 x 13824 on an H200) with one read of each row in a Triton
kernel; a second one sorts each row's k winners in registers and decodes them. Entries are raw: fp32 value
bits high, position low, -1 empty. They rank by the unique (value, position) composite of
``score_tile.composite``.

Per row, in one program:
    pivots -> two entries of a strided sample of the row (sorted): hi ranks above the k-th, lo below
    split  -> one pass over the row: entries >= hi are winners, written to the row's output slots;
              entries in [lo, hi) go to a list (about 2k of 13824 at k = 2048): the program's
              scratch, or (row_lists) the row's own unused candidate slots, and where those are
              short, a list of a small shared pool (about 2% of the buffer at k = 2048)
    select -> the k-th of the list by bisection over counts: its key first, then (only if entries of
              that key straddle it) the position among them; every pass is 32-bit work
    emit   -> the list entries that rank at or above it fill the remaining output slots
and then, per row in a kernel of its own (fewer registers, more warps: sort_decode_kernel):
    sort   -> the k winners, back into registers: a bitonic sort, decode, store values and positions
A row whose pivots miss (k or more entries >= hi, fewer than k >= lo, or more between than the list
holds) selects over its whole buffer the same way: slower, equally exact. Counts never leave the
device, so a call does not synchronize and can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import order_key as order_key_ref
from .score_tile import INT64_MIN, composite, order_key

INT64_MAX = 2**63 - 1
SAMPLE = 512  # sample entries per row for the pivots
CHUNK = 1024  # entries per step of the pass over a row
LIST_CHUNK = 512  # entries per step over a scratch list
SORT_MAX = 2048  # widest in-kernel sort of a row's winners (16 int64 registers a thread at 4 warps)
MARGIN_SD = 4.5  # pivot ranks this many standard deviations of the sample rank away from the k-th

_MIN = tl.constexpr(INT64_MIN)
_MAX = tl.constexpr(INT64_MAX)
_I32_MIN = tl.constexpr(-(2**31))
_I32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _raw_comps(ptr, offs, ok):
    """Composites of the raw entries ptr[offs] where ok (INT64_MIN elsewhere and for the sentinel)."""
    raw = tl.load(ptr + offs, mask=ok, other=-1)
    low = raw.to(tl.int32)  # the position; -1 only in the sentinel
    key = order_key((raw >> 32).to(tl.int32).to(tl.float32, bitcast=True))
    return tl.where(low == -1, _MIN, composite(key, low.to(tl.uint32)))  # uint32: zero-extended


@triton.jit
def _comps(ptr, offs, n, seam, jump, RAW: tl.constexpr):
    """Composites of the n entries of a row (INT64_MIN past n), RAW ones converted.

    Entry i lives at ptr[i] before the seam and at ptr[i + jump] from it: a candidate row's unused
    slots are jumped over (for a scratch list, seam = n).
    """
    phys = offs + tl.where(offs >= seam, jump, 0)
    if RAW:
        return _raw_comps(ptr, phys, offs < n)
    else:
        return tl.load(ptr + phys, mask=offs < n, other=_MIN)


@triton.jit
def _scan(ptr, n, seam, jump, t, K, RAW: tl.constexpr, CH: tl.constexpr, TIES: tl.constexpr):
    """One pass over v = each entry's key, or (TIES) minus the position of each entry with key K.

    Returns #(v >= t), the smallest of those v and the largest v below t; all 32-bit work.
    """
    cnt = tl.zeros((CH,), dtype=tl.int32)  # reduced once, at the end of the pass
    above = tl.full((CH,), _I32_MAX, tl.int32)
    below = tl.full((CH,), _I32_MIN, tl.int32)
    for c0 in range(0, n, CH):
        x = _comps(ptr, c0 + tl.arange(0, CH), n, seam, jump, RAW)
        if TIES:
            ok = (x >> 32).to(tl.int32) == K
            v = x.to(tl.int32) + 1  # the low word 0xFFFFFFFF - pos is -1 - pos as int32
            ge = ok & (v >= t)
            lt = ok & (v < t)
        else:
            v = (x >> 32).to(tl.int32)  # empties and padding have key INT32_MIN, below every bound
            ge = v >= t
            lt = v < t
        cnt += ge.to(tl.int32)
        above = tl.minimum(above, tl.where(ge, v, _I32_MAX))
        below = tl.maximum(below, tl.where(lt, v, _I32_MIN))
    return tl.reduce((cnt, above, below), 0, _sum_min_max)  # one block reduction for the three


@triton.jit
def _sum_min_max(c0, a0, b0, c1, a1, b1):
    return c0 + c1, tl.minimum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _bisect(ptr, n, seam, jump, need, lo, hi, K, RAW: tl.constexpr, CH: tl.constexpr, TIES: tl.constexpr):
    """The need-th largest v (see _scan), given #(v >= lo) >= need and no v >= hi (int64 bounds).

    Bisection that moves each bound onto a value present, so it takes about log2(distinct values)
    passes. Also returns whether a count was exactly ``need`` and #(v >= hi) for the final hi.
    """
    exact = tl.zeros((), dtype=tl.int32)
    n_hi = tl.zeros((), dtype=tl.int32)
    while hi - lo > 1:
        cnt, above, below = _scan(ptr, n, seam, jump, (lo + (hi - lo) // 2).to(tl.int32), K, RAW, CH, TIES)
        if cnt >= need:
            lo = above.to(tl.int64)
            if cnt == need:  # the need largest are exactly those counted: the smallest of them is it
                hi = lo + 1
                exact = tl.full((), 1, tl.int32)
        else:
            hi = below.to(tl.int64) + 1
            n_hi = cnt
    return lo, exact, n_hi


@triton.jit
def _kth(ptr, n, seam, jump, need, lo, hi, RAW: tl.constexpr, CH: tl.constexpr):
    """(K, V): the need largest entries of ptr[0:n] are those with key > K, or key K and -position >= V.

    Needs every entry below the composite hi and at least need of them at or above lo. The key comes
    first; positions only matter when the entries of key K straddle the need-th.
    """
    lo_key = tl.maximum(lo >> 32, _I32_MIN + 1)  # empties and padding (key INT32_MIN) never count
    key, exact, above = _bisect(ptr, n, seam, jump, need, lo_key, ((hi - 1) >> 32) + 1, 0, RAW, CH, False)
    v = tl.full((), _I32_MIN, tl.int64)  # a count was exact: every entry of key K is in
    if exact == 0:  # positions are below 2**31 - 1, so -position lies in [INT32_MIN + 1, 1)
        v = _bisect(ptr, n, seam, jump, need - above, tl.full((), _I32_MIN + 1, tl.int64), tl.full((), 1, tl.int64),
                    key.to(tl.int32), RAW, CH, True)[0]
    return key.to(tl.int32), v.to(tl.int32)


@triton.jit
def _slots(f, TPB: tl.constexpr):
    """Exclusive running sums of a chunk f [CH] in (thread, register) order, and their total.

    Any order will do (the winners are sorted afterwards). Element i of a chunk sits in register
    i // TPB of thread i % TPB, so seen as [CH // TPB, TPB] the sums over dim 0 stay in registers and
    one value per thread is scanned across the block (a scan in offset order scans every register).
    """
    CH: tl.constexpr = f.shape[0]
    f2 = tl.reshape(f, [CH // TPB, TPB])
    per_thread = tl.sum(f2, axis=0)
    before = tl.cumsum(per_thread, axis=0) - per_thread
    return tl.reshape(before[None, :] + tl.cumsum(f2, axis=0) - f2, [CH]), tl.sum(per_thread, axis=0)


@triton.jit
def _emit(ptr, n, seam, jump, K, V, dst, RAW: tl.constexpr, CH: tl.constexpr, TPB: tl.constexpr):
    """Write the entries of the row (see _comps) selected by (K, V) (see _kth) to dst[0:], in no particular order."""
    base = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, n, CH):
        x = _comps(ptr, c0 + tl.arange(0, CH), n, seam, jump, RAW)
        key = (x >> 32).to(tl.int32)
        sel = (key > K) | ((key == K) & (x.to(tl.int32) + 1 >= V))
        slot, tot = _slots(sel.to(tl.int32), TPB)
        tl.store(dst + base + slot, x, mask=sel)
        base += tot


@triton.jit
def _decode_words(x):
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
    v, pos = _decode_words(tl.sort(tl.load(dst + j, mask=j < k, other=_MIN), descending=True))
    tl.debug_barrier()  # every thread has its winners before the positions overwrite them
    tl.store(val + j, v, mask=j < k)
    tl.store(dst + j, pos, mask=j < k)


@triton.jit
def _decode_in_place(dst, val, k, CH: tl.constexpr):
    """dst[0:k] composites -> val[0:k] values and dst[0:k] positions, where they lie, CH at a time
    (each entry is read and rewritten by the same thread: one barrier, before, is enough)."""
    tl.debug_barrier()  # the winners were written by other threads
    for c0 in range(0, k, CH):
        j = c0 + tl.arange(0, CH)
        v, pos = _decode_words(tl.load(dst + j, mask=j < k, other=0))
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


# W and cap unspecialized: rows then look unaligned, so the loads are not vectorized and keep the layout
# of the scattered stores (no re-layout through shared memory between them).
@triton.jit(do_not_specialize=["W", "cap"])
def final_select_kernel(buf_ptr, used_ptr, tail_ptr, out_ptr, val_ptr, scr_ptr, fast_ptr, next_ptr, R, W, C, k, cap,
                        i_hi, i_lo, room, npool, S: tl.constexpr, CH: tl.constexpr, LCH: tl.constexpr,
                        TPB: tl.constexpr, USED: tl.constexpr, TAIL: tl.constexpr, FINISH: tl.constexpr,
                        ROW_LISTS: tl.constexpr):
    """out[r, :k] = the k largest composites of raw row r, unsorted; fast[r] = 1 where the pivots held.

    With USED, only the first used[r] of the row's first C slots hold entries (the rest is never read),
    and with TAIL only the first tail[r] of the slots from C (the rest is never read either).
    FINISH then decodes each row's winners in place, val[r, :k] the canonical values and out[r, :k]
    the positions (int64); without it they stay composites (sort_decode_kernel sorts and decodes them).
    Unsorted, they come in the order of the row's slots (which the filter's atomics decided).
    Programs take rows from an atomic counter (next_ptr[0], zeroed), so a slow row holds up no other,
    and each keeps one scratch list of ``cap`` entries for all its rows. With ROW_LISTS (needs USED)
    a row's list lives in its own unused slots [used[r], C), which the pass never reads; a row with
    fewer than ``room`` of them takes one of the npool lists of scr (cap entries each, counter
    next_ptr[1], zeroed) while any is left. A row whose list does not fit selects over its whole
    buffer, which the lists never touch.
    """
    scr = scr_ptr + tl.program_id(0).to(tl.int64) * cap
    lcap = cap
    j = tl.arange(0, S)
    row = tl.atomic_add(next_ptr, 1, sem="relaxed").to(tl.int64)  # int64: offsets pass 2**31
    while row < R:
        src = buf_ptr + row * W
        dst = out_ptr + row * k
        n, seam, jump = W, W, 0
        if USED:
            seam = tl.load(used_ptr + row)
            n, jump = W - (C - seam), C - seam
            if TAIL:
                n = seam + tl.load(tail_ptr + row)
            if ROW_LISTS:
                scr = src + seam
                lcap = C - seam
                if lcap < room:
                    pl = tl.atomic_add(next_ptr + 1, 1, sem="relaxed")
                    if pl < npool:
                        scr = scr_ptr + pl.to(tl.int64) * cap
                        lcap = cap
        p = (j.to(tl.int64) * W) // S  # the pivots sample the physical row: unused slots count as empty
        samp = tl.sort(_raw_comps(src, p, (p < seam) | ((p >= C) & (p - jump < n))), descending=True)
        hi = tl.max(tl.where(j == i_hi, samp, _MIN), axis=0)
        hi = tl.where(hi == _MIN, _MAX, hi)  # no such rank, or an empty slot: nothing is a sure winner
        lo = tl.maximum(tl.max(tl.where(j == i_lo, samp, _MIN), axis=0), _MIN + 1)  # never admit empties
        n_hi = tl.zeros((), dtype=tl.int32)
        n_mid = tl.zeros((), dtype=tl.int32)
        for c0 in range(0, n, CH):
            x = _comps(src, c0 + tl.arange(0, CH), n, seam, jump, True)
            sure = x >= hi
            mid = (x >= lo) & (x < hi)
            before, tot = _slots(sure.to(tl.int32) + (mid.to(tl.int32) << 16), TPB)  # both counts, one scan
            s_slot = n_hi + (before & 0xFFFF)
            m_slot = n_mid + (before >> 16)
            tl.store(dst + s_slot, x, mask=sure & (s_slot < k))
            tl.store(scr + m_slot, x, mask=mid & (m_slot < lcap))
            n_hi += tot & 0xFFFF
            n_mid += tot >> 16
        fast = (n_hi < k) & (n_hi + n_mid >= k) & (n_mid <= lcap)
        tl.store(fast_ptr + row, fast.to(tl.int8))
        tl.debug_barrier()  # the list is read below, and the slow path rewrites the slots written above
        if fast:
            K, V = _kth(scr, n_mid, n_mid, 0, k - n_hi, lo, hi, False, LCH)
            _emit(scr, n_mid, n_mid, 0, K, V, dst + n_hi, False, LCH, TPB)
        else:  # the whole buffer is the list
            K, V = _kth(src, n, seam, jump, k, tl.full((), _MIN + 1, tl.int64), tl.full((), _MAX, tl.int64), True,
                        CH)
            _emit(src, n, seam, jump, K, V, dst, True, CH, TPB)
        if FINISH:
            _decode_in_place(dst, val_ptr + row * k, k, LCH)
        tl.debug_barrier()  # the next row overwrites the list
        row = tl.atomic_add(next_ptr, 1, sem="relaxed").to(tl.int64)


def _ranks_between(i_hi: int, i_lo: int, S: int) -> int:
    """Sample ranks from just below the hi pivot to the lo pivot, clipped to the sample (a rank outside
    [0, S) means no pivot there): each stands for W / S slots of the row."""
    return min(i_lo, S - 1) - max(i_hi, -1)


def pivot_ranks(k: int, W: int, S: int = SAMPLE) -> tuple[int, int, int]:
    """(i_hi, i_lo, cap): sample ranks (descending, 0-based) of the pivots and the scratch list size.

    About k*S/W of the S sampled slots hold an entry >= the row's k-th (empty slots rank lowest),
    with standard deviation sqrt(S p (1 - p)), p = k/W; the pivots sit MARGIN_SD of those (plus a
    repeat of a short row) away on either side. Ranks outside [0, S) mean "no pivot there". The list
    gets twice the expected count of entries between the pivots (that count varies by about
    1/sqrt(ranks between) of itself).
    """
    p = k / W
    margin = math.ceil(MARGIN_SD * math.sqrt(S * p * (1 - p)) + S / W) + 1  # S/W: a short row repeats in the sample
    i_hi = math.floor(k * S / W) - 1 - margin
    i_lo = math.ceil(k * S / W) - 1 + margin
    between = _ranks_between(i_hi, i_lo, S) * W / S
    return i_hi, i_lo, max(1, min(W, int(2 * between) + 64))


def list_room(k: int, W: int, S: int = SAMPLE) -> int:
    """Unused slots a row needs to hold its own list: the expected count between the pivots and three
    of its standard deviations (it varies by about 1/sqrt(ranks between) of itself)."""
    i_hi, i_lo, _ = pivot_ranks(k, W, S)
    ranks = max(1, _ranks_between(i_hi, i_lo, S))
    between = ranks * W / S
    return math.ceil(between + 3 * between / math.sqrt(ranks)) + 64


def lists_fit_rows(k: int, W: int, room: int, S: int = SAMPLE) -> bool:
    """Whether rows with about ``room`` unused candidate slots (the typical row) can hold their own
    lists (row_lists); a row with less than ``list_room`` takes a list from the pool."""
    return room >= list_room(k, W, S)


def pool_lists(R: int) -> int:
    """Lists of the pool for rows short of room, which with row_lists chosen by ``hytopk.row_lists``
    come from the spread of the threshold alone: one for every 16 rows. H200, k = 2048, 512 samples:
    at (2048, 524288) used slots are 7255 on average, 10884 at most, and 15 of 2048 rows had too
    little room for their lists (0 of 4096 at (4096, 131072)); each such row without a pool list
    selects over its whole buffer, and a few of them add ~0.1 ms at the end of the kernel."""
    return max(16, R // 16)


def _programs(device: torch.device) -> int:
    """About what fits at once (96 registers x 128 threads: 5 per SM on an H200); more only idle."""
    if device.type == "cuda":
        return 6 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


# (int32 [R] counts, C[, int32 [R] tail]): only the first counts[r] of slots [0, C) hold entries, and (with
# tail) only the first tail[r] of the slots from C
Used = tuple[Tensor, int] | tuple[Tensor, int, Tensor] | None


def _launch(buf: Tensor, k: int, out: Tensor, values: Tensor | None, used: Used, sample: int,
            ranks: tuple[int, int] | None, cap: int | None, chunk: int, list_chunk: int, warps: int,
            row_lists: bool, pool: int | None) -> Tensor:
    """Run the kernel over every row of buf into out: composites, or with values decoded winners (unsorted);
    returns the fast flags."""
    R, W = buf.shape
    assert buf.dtype == torch.int64 and buf.is_contiguous() and 1 <= k <= W
    assert chunk % (32 * warps) == 0 and list_chunk % (32 * warps) == 0 and chunk < 2**15  # see _slots
    i_hi, i_lo, default_cap = pivot_ranks(k, W, sample)
    i_hi, i_lo = ranks if ranks is not None else (i_hi, i_lo)
    cap = default_cap if cap is None else cap
    fast = torch.empty(R, dtype=torch.int8, device=buf.device)
    if R == 0:
        return fast
    counts, C = used[:2] if used is not None else (fast, W)
    tail = used[2] if used is not None and len(used) == 3 else None
    assert counts.dtype in (torch.int8, torch.int32) and counts.shape == (R,) and 0 <= C <= W, "used: int32 [R], C"
    assert tail is None or (tail.dtype == torch.int32 and tail.shape == (R,)), "used's tail: int32 [R]"
    assert used is not None or not row_lists, "row_lists: the lists live in the unused slots that used names"
    nprog = min(R, _programs(buf.device))
    npool = (pool_lists(R) if pool is None else pool) if row_lists else nprog
    scratch = torch.empty(max(1, npool), cap, dtype=torch.int64, device=buf.device)
    counters = torch.zeros(2, dtype=torch.int32, device=buf.device)  # next row, next pool list
    final_select_kernel[(nprog,)](buf, counts, counts if tail is None else tail, out, out if values is None else values,
                                  scratch, fast, counters, R, W, C, k, cap, i_hi, i_lo, list_room(k, W, sample), npool,
                                  S=sample, CH=chunk, LCH=list_chunk, TPB=32 * warps, USED=used is not None,
                                  TAIL=tail is not None, FINISH=values is not None, ROW_LISTS=row_lists,
                                  num_warps=warps)
    return fast


def select_composites(buf: Tensor, k: int, *, used: Used = None, sample: int = SAMPLE,
                      ranks: tuple[int, int] | None = None, cap: int | None = None, chunk: int = CHUNK,
                      list_chunk: int = LIST_CHUNK, warps: int = 4, row_lists: bool = False,
                      pool: int | None = None) -> tuple[Tensor, Tensor]:
    """(composites [R, k] of each row's top k, unsorted; int8 [R], 1 where the row took the fast path).

    Pivot ranks and list size default to ``pivot_ranks``; tests set them to force either path (and
    small samples and chunks: the interpreter's sort is slow, and small chunks exercise the loops).
    row_lists: each row's list in its own unused slots, or one of ``pool`` (default ``pool_lists``)
    shared lists where those are short, instead of a scratch list per program.
    """
    out = torch.empty(buf.shape[0], k, dtype=torch.int64, device=buf.device)
    return out, _launch(buf, k, out, None, used, sample, ranks, cap, chunk, list_chunk, warps, row_lists, pool)


def sort_width(k: int) -> int:
    """The in-kernel sort's width for k (a power of two), or 0 where k is past what registers hold."""
    kp = 1 << max(0, (k - 1).bit_length())
    return kp if kp <= SORT_MAX else 0


def sort_warps(kp: int) -> int:
    """Warps of the sort kernel: 4 entries a thread, 4 to 16 warps, and one warp up to 512 entries.
    On the H200 at k = 2048 (8192 rows, the final select and the sort together): 1.81 / 2.12 / 1.64 ms
    at 4 / 8 / 16 warps, 1.89 ms sorted inside the final select. The sort alone at 4096 rows
    (NOTES-selection.md, v10): k = 2048 0.64 / 0.55 / 0.63 / 0.78 / 0.53 ms at
    1 / 2 / 4 / 8 / 16 warps; k = 512 0.040 / 0.067 / 0.053 / 0.060 / 0.065 ms (one warp holds the
    row in registers: no shared memory, no barriers; at k = 2048 its 254 registers leave too few warps)."""
    return 1 if kp <= 512 else max(4, min(16, kp // 128))


def select_sorted(buf: Tensor, k: int, *, used: Used = None, sort: bool = True, sample: int = SAMPLE,
                  ranks: tuple[int, int] | None = None, cap: int | None = None, chunk: int = CHUNK,
                  list_chunk: int = LIST_CHUNK, warps: int = 4, row_lists: bool = False,
                  pool: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(values fp32 [R, k], positions int64 [R, k], fast flags): ``select_rows`` with the knobs above.

    Up to SORT_MAX winners are sorted and decoded by ``sort_decode_kernel`` in the positions' memory
    (the composites and the positions have the same size), so no [R, k] temporary exists; past it the
    composites go through ``torch.sort`` and ``decode``. sort=False decodes the winners as they lie,
    in the order of the row's slots (the sort is about half the time at k=2048).
    """
    kw = dict(used=used, sample=sample, ranks=ranks, cap=cap, chunk=chunk, list_chunk=list_chunk, warps=warps,
              row_lists=row_lists, pool=pool)
    if sort and sort_width(k) == 0:
        comp, fast = select_composites(buf, k, **kw)
        return (*decode(torch.sort(comp, dim=1, descending=True).values), fast)
    indices = torch.empty(buf.shape[0], k, dtype=torch.int64, device=buf.device)
    values = torch.empty(buf.shape[0], k, dtype=torch.float32, device=buf.device)
    if not sort:
        return values, indices, _launch(buf, k, indices, values, **kw)
    fast = _launch(buf, k, indices, None, **kw)  # composites into the positions' memory: sorted, decoded there
    if buf.shape[0]:
        kp = sort_width(k)
        sort_decode_kernel[(buf.shape[0],)](indices, values, k, KP=kp, num_warps=sort_warps(kp))
    return values, indices, fast


def decode(comp: Tensor) -> tuple[Tensor, Tensor]:
    """Composites -> (canonical fp32 values, int64 positions), working on the 32-bit halves.

    On a little-endian device an int64 viewed as int32 pairs is (low, high): high is the order key,
    whose bits come back as key ^ 0x7FFFFFFF for negative keys; low is 0xFFFFFFFF - position.
    """
    words = comp.view(torch.int32).unflatten(-1, (-1, 2))
    key, low = words[..., 1], words[..., 0]
    bits = key >> 31
    bits &= 0x7FFFFFFF
    bits ^= key
    return bits.view(torch.float32), torch.bitwise_not(low).long()


def select_rows(buf: Tensor, k: int, used: Used = None, sorted: bool = True,
                row_lists: bool = False) -> tuple[Tensor, Tensor]:
    """Each row's k best raw entries of ``buf`` [R, W] int64 (fp32 bits << 32 | position; -1 empty).

    Returns (values fp32 [R, k], positions int64 [R, k]) ordered by value descending, ties by position
    ascending, NaN above +inf and -0.0 == +0.0, values canonical (NaN as 0x7FC00000, -0.0 as +0.0).
    Every row must hold at least k entries. With ``used = (counts, C)`` slots [counts[r], C) of row r
    are unused, whatever they hold (counts must not exceed C: nothing checks it on the device); with
    ``used = (counts, C, tail)`` so are its slots from C + tail[r] on (tail must not exceed W - C).
    sorted=False: the same k entries per row, in the order of their slots. row_lists (with used): the
    selection's working lists go into the unused slots, which then hold other garbage.
    """
    values, indices, _ = select_sorted(buf, k, used=used, sort=sorted, row_lists=row_lists)
    return values, indices


def select_rows_reference(buf: Tensor, k: int, used: Used = None) -> tuple[Tensor, Tensor]:
    """The same in plain PyTorch: composites of the whole buffer, torch.topk, decode in int64."""
    if used is not None:
        counts, C = used[:2]
        slot = torch.arange(buf.shape[1], device=buf.device)
        buf = torch.where((slot >= counts.view(-1, 1)) & (slot < C), -1, buf)
        if len(used) == 3:
            buf = torch.where(slot >= C + used[2].view(-1, 1), -1, buf)
    pos = buf & 0xFFFFFFFF
    key = order_key_ref((buf >> 32).to(torch.int32).view(torch.float32))
    comp = torch.where(buf == -1, INT64_MIN, (key << 32) | (0xFFFFFFFF - pos))
    comp = torch.topk(comp, k, dim=1, largest=True, sorted=True).values
    key = comp >> 32
    bits = torch.where(key >= 0, key, key ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32), 0xFFFFFFFF - (comp & 0xFFFFFFFF)
