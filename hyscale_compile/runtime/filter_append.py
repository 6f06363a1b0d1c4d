"""How the filter hands a passing entry its slot in the row's candidate buffer: the four appends.

    APPEND_SCAN      one atomic add per row and tile, slots from a running count along the row
    APPEND_ATOMIC    one relaxed atomic per passing entry
    APPEND_PTX       the same as predicated inline PTX on the score tile's own registers
    APPEND_RESERVED  each thread reserves the slots of its passing entries of a row with one atomic,
                     then writes them at running counts (its steps in PTX where there is PTX, in
                     triton under the interpreter)

All four append every passing entry of a row within its capacity C exactly once, in an order that
depends on scheduling (the final select orders by value and position, so it never matters), and
count every passing entry: a row counted past C overflowed and is recovered whole. ``plan.append_kind``
chooses one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .columns import columns
from .score_tile import raw_entry

APPEND_SCAN = tl.constexpr(0)
APPEND_ATOMIC = tl.constexpr(1)
APPEND_PTX = tl.constexpr(2)
APPEND_RESERVED = tl.constexpr(3)
# what says which entries of a tile are in range (append_passing's OK)
OK_ALL = tl.constexpr(0)
OK_TILE = tl.constexpr(1)
OK_RANGE = tl.constexpr(2)


@triton.jit
def append_passing(val, ok, thr, cols, rid, row_ok, cnt_ptr, buf_ptr, C, stride,
                   APPEND: tl.constexpr, ASM: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, OK: tl.constexpr):
    """Append the entries that are ``ok`` and >= their row's threshold, by the APPEND_* way.

    ok by OK: OK_ALL [BT, 1] (every entry of a valid row), OK_TILE [BT, BS], or OK_RANGE a tuple
    (lo, hi) of int32 [BT] row ranges to test the int32 positions against (lo <= position < hi); the
    range test stands for the row and column bounds too, so it needs 0 <= lo <= hi <= S and
    lo = hi = 0 for rows past the end (``problem.ranges``, ``score_tile.block_rows``). An entry passes
    where val >= thr or either is NaN (setp.geu; a NaN threshold, from NaN samples, passes every entry
    and overflows the row, which is then recovered).
    """
    if APPEND == APPEND_RESERVED:  # the reserved append takes the range as it is (fewer registers)
        _append_reserved(cnt_ptr, buf_ptr, rid, row_ok, ok, val, thr, cols, C, stride, BT, BS, OK, ASM)
        return
    if OK == OK_RANGE:
        c32 = cols.to(tl.int32)[None, :]
        ok = (c32 >= ok[0][:, None]) & (c32 < ok[1][:, None])
    if APPEND == APPEND_PTX:  # the PTX append makes the same compare itself
        _append_ptx(cnt_ptr, buf_ptr, rid, ok, val, thr, cols, C, stride)
        return
    passed = ok & passes(val, thr[:, None])
    raw = raw_entry(val, cols[None, :])
    if APPEND == APPEND_SCAN:
        _append_scan(cnt_ptr, buf_ptr, rid, row_ok, passed, raw, C, stride)
    else:
        _append_atomic(cnt_ptr, buf_ptr, rid, passed, raw, C, stride, BT, BS)


@triton.jit
def _append_scan(cnt_ptr, buf_ptr, rid, row_ok, passed, raw, C, stride):
    """Slots from one atomic add per row and a running count along the row (a block scan)."""
    pi = passed.to(tl.int32)
    n = tl.sum(pi, axis=1)
    base = tl.atomic_add(cnt_ptr + rid, n, mask=row_ok & (n > 0))
    slot = base[:, None] + tl.cumsum(pi, axis=1) - pi
    tl.store(buf_ptr + rid[:, None] * stride + slot, raw, mask=passed & (slot < C))


@triton.jit
def _append_atomic(cnt_ptr, buf_ptr, rid, passed, raw, C, stride, BT: tl.constexpr, BS: tl.constexpr):
    """One relaxed atomic per passing entry hands out its slot: no scan, no cross-thread exchange.

    Slot order depends on scheduling; the final select orders by (value, position), so it never matters.
    """
    ctr = tl.broadcast_to(cnt_ptr + rid[:, None], (BT, BS))
    slot = tl.atomic_add(ctr, tl.full((BT, BS), 1, tl.int32), mask=passed, sem="relaxed")
    tl.store(buf_ptr + rid[:, None] * stride + slot, raw, mask=passed & (slot < C))


@triton.jit
def _append_ptx(cnt_ptr, buf_ptr, rid, ok, val, thr, cols, C, stride):
    """_append_atomic as predicated PTX on the score tile's own registers, per entry:
    pass = ok and (val >= thr or val is NaN)  (setp.geu: greater-equal or unordered), then one
    relaxed atomic for the slot and one 8-byte store of {position, value bits}.

    Written in PTX because tl.atomic_add / tl.store make the compiler re-lay-out 64-bit pointer and
    value tiles through shared memory and spill; here everything per entry stays 32-bit.
    """
    ctr = (cnt_ptr + rid).to(tl.int64)[:, None]
    row = (buf_ptr + rid * stride).to(tl.int64)[:, None]
    # all atomics of the tile first, then all stores: the slots' round trips overlap instead of
    # each store waiting for its own atomic; a failing entry's slot is 2**32 - 1 (never < C)
    slot = tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        mov.b32 $0, -1;
        setp.geu.f32 p, $2, $3;
        setp.ne.and.b32 p, $1, 0, p;
        @p atom.relaxed.gpu.global.add.u32 $0, [$4], 1;
        }
        """,
        "=r,r,f,f,l", [ok.to(tl.int32), val, thr[:, None], ctr], dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b64 a, e;
        mov.b32 $0, 0;
        setp.lt.u32 p, $1, $2;
        mad.wide.u32 a, $1, 8, $3;
        mov.b64 e, {$4, $5};
        @p st.global.b64 [a], e;
        }
        """,
        "=r,r,r,l,r,r", [slot, C, row, cols.to(tl.int32)[None, :], val.to(tl.int32, bitcast=True)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _by_thread(x, BT: tl.constexpr, BS: tl.constexpr):
    """[BT, BS] -> the BS // 4 tensors [BT * 4] of columns 8j + 2i + e (i = 0..3), ordered by j then e.

    On the tensor-core result (an MMA accumulator gives lane i of each quad the columns 8j + 2i + e of
    its rows) each of them holds one entry per thread and row, so work along the tuple stays in
    registers: reshapes, a permute and splits only relabel. On any other layout the entries are the
    same, only moved.
    """
    y = tl.permute(tl.reshape(x, (BT, BS // 8, 4, 2)), (0, 2, 1, 3))
    return columns(tl.reshape(y, (BT * 4, BS // 4)), BS // 4)


@triton.jit
def _per_thread_row(x, BT: tl.constexpr):
    """[BT] -> [BT * 4]: the row's value for each of the four lanes that hold its columns."""
    return tl.reshape(tl.broadcast_to(x[:, None], (BT, 4)), (BT * 4,))


@triton.jit
def _append_reserved(cnt_ptr, buf_ptr, rid, row_ok, ok, val, thr, cols, C, stride,
                     BT: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr):
    """Each thread reserves the slots of its passing entries of a row with one atomic, then writes
    them at running counts along its columns: no atomic and no branch per entry (the per-entry
    atomic took ~13 instructions an entry, and this kernel's time follows its instruction count).

    The compare runs twice, once to count and once to store, instead of keeping a flag per entry
    live across the atomic (64 registers a thread: they held the kernel to two tiles per SM). A
    thread whose reserved slots would pass C writes none of them: its row overflowed, so the check
    stage recovers it whole and never reads its buffer; that leaves no bound test per entry.
    ok, KIND as in append_passing: a [BT, BS] one is kept as bits, a word per row for the thread's entries
    0..31 and one for 32..63; a range is tested per entry in both passes. ASM: the steps in PTX
    (tl.atomic_add and tl.store would re-lay-out their 64-bit pointer tiles through shared memory);
    without it the same steps in triton (interpreter).
    """
    N: tl.constexpr = BS // 4
    if ASM:  # a thread per (row, quarter) at most: copies of an element would each run its atomic and stores
        tl.static_assert(BT * 4 >= tl.extra.cuda.num_threads())
    vs = _by_thread(val, BT, BS)
    cs = _by_thread(tl.broadcast_to(cols.to(tl.int32)[None, :], (BT, BS)), BT, BS)
    t = _per_thread_row(thr, BT)
    lo = tl.zeros((BT * 4,), tl.int32)  # OK_RANGE: the range; OK_TILE: the ok bits of entries 0..31, 32..63
    hi = tl.zeros((BT * 4,), tl.int32)
    if KIND == OK_RANGE:
        lo = _per_thread_row(ok[0], BT)
        hi = _per_thread_row(ok[1], BT)
    elif KIND == OK_TILE:
        oks = _by_thread(ok.to(tl.int32), BT, BS)
        for i in tl.static_range(N):
            if i < 32:
                lo = lo | (oks[i] << i)
            else:
                hi = hi | (oks[i] << (i - 32))
    n = tl.zeros((BT * 4,), tl.int32)
    for i in tl.static_range(N):
        n = _count_pass(n, vs[i], t, _entry_ok(lo, hi, cs[i], i, KIND), ASM)
    lim = _per_thread_row(tl.where(row_ok, C, 0), BT)  # no slot for rows past the end
    slot = _reserve(_per_thread_row(cnt_ptr + rid, BT), n, lim, ASM)
    go = ((lim != 0) & (slot + n <= lim)).to(tl.int32)
    row = _per_thread_row(buf_ptr + rid * stride, BT)
    for i in tl.static_range(N):
        slot = _store_pass(row, slot, vs[i], t, cs[i], go & _entry_ok(lo, hi, cs[i], i, KIND), ASM)


@triton.jit
def _entry_ok(lo, hi, col, i: tl.constexpr, KIND: tl.constexpr):
    """Entry i's ok (1 or 0): always (OK_ALL), its bit (OK_TILE), or lo <= col < hi (OK_RANGE)."""
    if KIND == OK_ALL:
        return 1
    elif KIND == OK_RANGE:
        return ((col >= lo) & (col < hi)).to(tl.int32)
    elif i < 32:
        return (lo >> i) & 1
    else:
        return (hi >> (i - 32)) & 1


@triton.jit
def passes(v, t):
    """v >= t, or either is NaN: what PTX's setp.geu (greater-equal or unordered) computes."""
    return (v >= t) | (v != v) | (t != t)


@triton.jit
def _count_pass(n, v, t, ok, ASM: tl.constexpr):
    """n + 1 where ok and (v >= t or either is NaN) (setp.geu: greater-equal or unordered), else n."""
    if ASM:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .pred p;
            setp.ne.u32 p, $4, 0;
            setp.geu.and.f32 p, $2, $3, p;
            mov.b32 $0, $1;
            @p add.u32 $0, $0, 1;
            }
            """,
            "=r,r,f,f,r", [n, v, t, ok + tl.zeros_like(n)], dtype=tl.int32, is_pure=True, pack=1)
    return n + (passes(v, t) & (ok != 0)).to(tl.int32)


@triton.jit
def _reserve(ctr, n, lim, ASM: tl.constexpr):
    """First of n slots from the counters at ctr (one relaxed atomic each; none where n or lim is 0)."""
    if ASM:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .pred p;
            mov.b32 $0, 0;
            setp.ne.u32 p, $2, 0;
            setp.ne.and.u32 p, $3, 0, p;
            @p atom.relaxed.gpu.global.add.u32 $0, [$1], $2;
            }
            """,
            "=r,l,r,r", [ctr.to(tl.int64), n, lim], dtype=tl.int32, is_pure=False, pack=1)
    slot = tl.atomic_add(ctr, n, mask=(n != 0) & (lim != 0), sem="relaxed")
    return tl.where(lim != 0, slot, 0)  # whatever a masked atomic returns, a row past the end stores nothing


@triton.jit
def _store_pass(row, slot, v, t, col, go, ASM: tl.constexpr):
    """Where go and (v >= t or either is NaN): row[slot] = {position col, bits of v} (raw_entry) as one
    8-byte store, and slot + 1 is returned; elsewhere slot."""
    if ASM:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .pred p;
            .reg .b64 a, e;
            setp.ne.u32 p, $6, 0;
            setp.geu.and.f32 p, $3, $4, p;
            mov.b32 $0, $2;
            mad.wide.u32 a, $2, 8, $1;
            mov.b64 e, {$5, $7};
            @p st.global.b64 [a], e;
            @p add.u32 $0, $0, 1;
            }
            """,
            "=r,l,r,f,f,r,r,r", [row.to(tl.int64), slot, v, t, col, go, v.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=False, pack=1)
    p = passes(v, t) & (go != 0)
    tl.store(row + slot, raw_entry(v, col), mask=p)
    return slot + p.to(tl.int32)
