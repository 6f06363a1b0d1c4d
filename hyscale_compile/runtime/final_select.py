"""The last HyTopK stage: each row's exact top k of its candidate buffer.

It replaces ``torch.topk`` over the whole buffer (a radix select that reads all W int64 entries of
a row on every pass; benchmarks/NOTES-selection.md, "Defaults and the measurements behind them":
final select) with one read of each row in a Triton kernel; ``final_sort`` then sorts each
row's k winners in registers and decodes them. Entries are raw: fp32 value bits high, position low,
-1 empty. They rank by the unique (value, position) composite of ``score_tile.composite``.

Per row, in one program:
    pivots -> two entries of a strided sample of the row (sorted): hi ranks above the k-th, lo below
              (``final_pivots``)
    split  -> one pass over the row: entries >= hi are winners, written to the row's output slots;
              entries in [lo, hi) go to a list (about 2k of 13824 at k = 2048): the program's
              scratch, or (row_lists) the row's own unused candidate slots, and where those are
              short, a list of a small shared pool (about 2% of the buffer at k = 2048)
    select -> the k-th of the list by bisection over counts: its key first, then (only if entries of
              that key straddle it) the position among them; every pass is 32-bit work
    emit   -> the list entries that rank at or above it fill the remaining output slots
and then, per row in a kernel of its own (fewer registers, more warps: final_sort.sort_decode_kernel):
    sort   -> the k winners, back into registers: a bitonic sort, decode, store values and positions
A row whose pivots miss (k or more entries >= hi, fewer than k >= lo, or more between than the list
holds) selects over its whole buffer the same way: slower, equally exact. Counts never leave the
device, so a call does not synchronize and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .env import multiprocessors
from .final_pivots import SAMPLE, list_room, pivot_ranks, pool_lists
from .final_sort import decode, decode_words, sort_decode_kernel, sort_warps, sort_width
from .reference import order_key as order_key_ref
from .score_tile import INT64_MIN, composite, order_key

INT64_MAX = 2**63 - 1
CHUNK = 1024  # entries per step of the pass over a row
LIST_CHUNK = 512  # entries per step over a scratch list

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
def pivot_pair(samp, j, i_hi, i_lo):
    """(hi, lo): the entries of ranks i_hi and i_lo of a sample sorted descending (j its ranks). No such rank, or
    an empty slot there: hi admits no sure winner, lo every entry but the empties."""
    hi = tl.max(tl.where(j == i_hi, samp, _MIN), axis=0)
    hi = tl.where(hi == _MIN, _MAX, hi)
    lo = tl.maximum(tl.max(tl.where(j == i_lo, samp, _MIN), axis=0), _MIN + 1)
    return hi, lo


@triton.jit
def classify(x, hi, lo, TPB: tl.constexpr):
    """A chunk's sure winners (>= hi) and list entries ([lo, hi)): (sure, mid, their slots in the chunk packed as
    sure + (mid << 16), the chunk's two counts packed the same way)."""
    sure = x >= hi
    mid = (x >= lo) & (x < hi)
    before, tot = _slots(sure.to(tl.int32) + (mid.to(tl.int32) << 16), TPB)  # both counts, one scan
    return sure, mid, before, tot


@triton.jit
def place(x, sure, mid, before, n_hi, n_mid, dst, scr, k, cap):
    """The chunk's sure winners to dst from slot n_hi, its list entries to scr from slot n_mid (none past k or cap)."""
    s_slot = n_hi + (before & 0xFFFF)
    m_slot = n_mid + (before >> 16)
    tl.store(dst + s_slot, x, mask=sure & (s_slot < k))
    tl.store(scr + m_slot, x, mask=mid & (m_slot < cap))


@triton.jit
def _decode_in_place(dst, val, k, CH: tl.constexpr):
    """dst[0:k] composites -> val[0:k] values and dst[0:k] positions, where they lie, CH at a time
    (each entry is read and rewritten by the same thread: one barrier, before, is enough)."""
    tl.debug_barrier()  # the winners were written by other threads
    for c0 in range(0, k, CH):
        j = c0 + tl.arange(0, CH)
        v, pos = decode_words(tl.load(dst + j, mask=j < k, other=0))
        tl.store(val + j, v, mask=j < k)
        tl.store(dst + j, pos, mask=j < k)


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
        hi, lo = pivot_pair(samp, j, i_hi, i_lo)
        n_hi = tl.zeros((), dtype=tl.int32)
        n_mid = tl.zeros((), dtype=tl.int32)
        for c0 in range(0, n, CH):
            x = _comps(src, c0 + tl.arange(0, CH), n, seam, jump, True)
            sure, mid, before, tot = classify(x, hi, lo, TPB)
            place(x, sure, mid, before, n_hi, n_mid, dst, scr, k, lcap)
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


def _programs(device: torch.device) -> int:
    """About what fits at once (96 registers x 128 threads: 5 per SM on an H200); more only idle."""
    if device.type == "cuda":
        return 6 * multiprocessors(device)
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


def select_sorted(buf: Tensor, k: int, *, used: Used = None, sort: bool = True, sample: int = SAMPLE,
                  ranks: tuple[int, int] | None = None, cap: int | None = None, chunk: int = CHUNK,
                  list_chunk: int = LIST_CHUNK, warps: int = 4, row_lists: bool = False,
                  pool: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(values fp32 [R, k], positions int64 [R, k], fast flags): ``select_rows`` with the options above.

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
