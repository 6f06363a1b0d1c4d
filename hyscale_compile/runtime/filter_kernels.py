"""Kernels that walk (query block x key tile) grids: sample, threshold, score+filter, and rescore.

Each one calls ``score_tile`` with the shared tile shape. The block kernel also has a FLOOR mode
(the score arithmetic with no output, for the benchmark) and a TABLE mode (writes the fp32 value
table, the baseline HyTopK replaces).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .score_tile import act_fma, key_value, order_key, raw_entry, score_tile, tile_values

# block_kernel modes (host side; the kernel compares the literals)
MODE_FLOOR = 0
MODE_TABLE = 1
MODE_FILTER = 2
MODE_COUNT = 3
# what says which entries of a tile are in range (_emit's OK; constexpr globals the jit code reads)
OK_ALL = tl.constexpr(0)
OK_TILE = tl.constexpr(1)
OK_RANGE = tl.constexpr(2)


@triton.jit
def _block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT: tl.constexpr):
    """Rows of one query block, their [lo, hi) ranges, and the union range of the block."""
    rows_t = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
    row_ok = rows_t < T
    rid = b * T + rows_t
    lo = tl.load(lo_ptr + rid, mask=row_ok, other=0)
    hi = tl.load(hi_ptr + rid, mask=row_ok, other=0)
    blo = tl.min(tl.where(row_ok & (hi > lo), lo, S), axis=0)
    bhi = tl.max(tl.where(row_ok, hi, 0), axis=0)
    return rows_t, row_ok, rid, lo, hi, blo, bhi


@triton.jit
def block_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, thr_ptr, cnt_ptr, out_ptr, mask_ptr, bias_ptr,
                 T, S, H, scale, fill, C, out_stride, SPLIT,
                 sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                 ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                 APPEND: tl.constexpr = 1, ASM: tl.constexpr = False, TMA: tl.constexpr = False,
                 q_desc=None, k_desc=None):
    """FILTER: append (value, position) entries passing the row threshold to the row's buffer.

    The threshold is compared as a float (x >= thr, or x is NaN: the order_key order without
    computing keys). Tiles inside every row's range, with no mask or bias, skip the range test.
    TMA: q and kx through the descriptors of ``tma_views`` (2-D: rows b * T + t and b * S + s).
    """
    split = tl.program_id(0)  # fastest: the programs running together share one query block's q in L2
    b = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2)
    rows_t, row_ok, rid, lo, hi, blo, bhi = _block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    tile0 = blo // BS
    tile1 = (bhi + BS - 1) // BS
    if MODE == 1:  # TABLE: the table covers every position, masked ones as fill
        tile0 = 0
        tile1 = (S + BS - 1) // BS
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    lo_all = tl.max(tl.where(row_ok, lo, 0), axis=0)  # [lo_all, hi_all) is visible to every row
    hi_all = tl.min(tl.where(row_ok, hi, S), axis=0)
    thr = tl.full((BT,), float("inf"), tl.float32)
    if MODE >= 2:  # FILTER (and COUNT)
        thr = key_value(tl.load(thr_ptr + rid, mask=row_ok, other=0))
    sink = tl.zeros((BT,), dtype=tl.float32)
    q_row0 = (b * T + pid_t * BT).to(tl.int32)
    for tile in range(tile0 + split, tile1, SPLIT):
        cols = tile * BS + tl.arange(0, BS).to(tl.int64)
        col_ok = cols < S
        acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, col_ok,
                         H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC,
                         q_desc, k_desc, q_row0, (b * S + tile * BS).to(tl.int32), TMA)
        if MODE == 0:  # FLOOR: the arithmetic alone, one sum kept per row
            sink += tl.sum(acc, axis=1)
        elif MODE == 1:
            val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                        mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            tl.store(out_ptr + rid[:, None] * out_stride + cols[None, :], val,
                     mask=row_ok[:, None] & col_ok[None, :])
        else:
            inside = (tile * BS >= lo_all) & (tile * BS + BS <= hi_all)
            if HAS_MASK or HAS_BIAS:
                inside = False
            if inside:  # every entry visible: the score is the value, only the row bound matters
                sink = _emit(acc, row_ok[:, None], thr, cols, rid, row_ok, cnt_ptr, out_ptr, C, out_stride, sink,
                             MODE, APPEND, ASM, BT, BS, OK_ALL)
            elif HAS_MASK or HAS_BIAS:
                val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                            mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
                sink = _emit(val, in_range, thr, cols, rid, row_ok, cnt_ptr, out_ptr, C, out_stride, sink,
                             MODE, APPEND, ASM, BT, BS, OK_TILE)
            else:  # a range's edge: the score is the value; the range test in int32 (ranges lie in [0, S],
                # a row past T has hi = 0), where tile_values' int64 one set the kernel's register count
                sink = _emit(acc, (lo.to(tl.int32), hi.to(tl.int32)), thr, cols, rid, row_ok, cnt_ptr, out_ptr, C,
                             out_stride, sink, MODE, APPEND, ASM, BT, BS, OK_RANGE)
    if (MODE == 0) or (MODE == 3):
        pid = (pid_t * tl.num_programs(1) + tl.program_id(1)) * SPLIT + split
        tl.store(out_ptr + pid.to(tl.int64) * BT + tl.arange(0, BT), sink)


@triton.jit
def _emit(val, ok, thr, cols, rid, row_ok, cnt_ptr, buf_ptr, C, stride, sink,
          MODE: tl.constexpr, APPEND: tl.constexpr, ASM: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
          OK: tl.constexpr):
    """Append the entries that are ``ok`` and >= their row's threshold (COUNT mode: count them).

    ok by OK: OK_ALL [BT, 1] (every entry of a valid row), OK_TILE [BT, BS], or OK_RANGE a tuple
    (lo, hi) of int32 [BT] row ranges to test the int32 positions against (lo <= position < hi); the
    range test stands for the row and column bounds too, so it needs 0 <= lo <= hi <= S and
    lo = hi = 0 for rows past the end (``hytopk.ranges``, ``_block_rows``). An entry passes where
    val >= thr or either is NaN (setp.geu; a NaN threshold, from NaN samples, passes every entry and
    overflows the row, which is then recovered).
    """
    if APPEND == 3 and MODE != 3:  # the reserved append takes the range as it is (fewer registers)
        _append_reserved(cnt_ptr, buf_ptr, rid, row_ok, ok, val, thr, cols, C, stride, BT, BS, OK, ASM)
        return sink
    if OK == OK_RANGE:
        c32 = cols.to(tl.int32)[None, :]
        ok = (c32 >= ok[0][:, None]) & (c32 < ok[1][:, None])
    if APPEND == 2 and MODE != 3:  # the PTX append makes the same compare itself
        _append_asm(cnt_ptr, buf_ptr, rid, ok, val, thr, cols, C, stride)
        return sink
    passed = ok & _passes(val, thr[:, None])
    if MODE == 3:  # the compare without the append (a benchmark diagnostic)
        return sink + tl.sum(passed.to(tl.float32), axis=1)
    raw = raw_entry(val, cols[None, :])
    if APPEND == 0:
        _append_scan(cnt_ptr, buf_ptr, rid, row_ok, passed, raw, C, stride)
    else:
        _append_atomic(cnt_ptr, buf_ptr, rid, passed, raw, C, stride, BT, BS)
    return sink


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
def _by_thread(x, BT: tl.constexpr, BS: tl.constexpr):
    """[BT, BS] -> the BS // 4 tensors [BT * 4] of columns 8j + 2i + e (i = 0..3), ordered by j then e.

    On the tensor-core result (an MMA accumulator gives lane i of each quad the columns 8j + 2i + e of
    its rows) each of them holds one entry per thread and row, so work along the tuple stays in
    registers: reshapes, a permute and splits only relabel. On any other layout the entries are the
    same, only moved.
    """
    y = tl.permute(tl.reshape(x, (BT, BS // 8, 4, 2)), (0, 2, 1, 3))
    return _columns(tl.reshape(y, (BT * 4, BS // 4)), BS // 4)


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
    ok, KIND as in _emit: a [BT, BS] one is kept as bits, a word per row for the thread's entries
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
def _passes(v, t):
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
    return n + (_passes(v, t) & (ok != 0)).to(tl.int32)


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
    p = _passes(v, t) & (go != 0)
    tl.store(row + slot, raw_entry(v, col), mask=p)
    return slot + p.to(tl.int32)


@triton.jit
def _append_asm(cnt_ptr, buf_ptr, rid, ok, val, thr, cols, C, stride):
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
def sample_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, samp_ptr, msamp_ptr, mask_ptr, bias_ptr,
                  T, S, H, scale, fill, M, samp_stride, SPLIT,
                  sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Keys of M evenly spaced positions of the block's range, shared by its rows (one matmul tile).

    SPLIT programs share a block's samples; the per-row count of valid samples is an integer atomic sum.
    Without mask or bias the range test runs on 32-bit offsets from the block's start: the 64-bit
    compares of tile_values over the whole tile made this kernel spill (255 registers and 1.4 KB of
    stack on sm_90).
    """
    split = tl.program_id(0)  # fastest: the programs running together share one query block's q in L2
    b = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2)
    rows_t, row_ok, rid, lo, hi, blo, bhi = _block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    bctx = tl.maximum(bhi - blo, 0)
    n = tl.minimum(bctx, M)
    # position of sample j: blo + (j * bctx) // M = blo + j * step + (j * rem) // M, where j * rem < M * M
    # fits 32 bits (a 64-bit division per column was most of the kernel's integer work)
    step = tl.where(bctx > M, bctx // M, 1).to(tl.int32)
    rem = tl.where(bctx > M, bctx % M, 0).to(tl.int32)
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    lo_rel = (tl.maximum(lo, blo) - blo).to(tl.int32)  # row ranges as offsets from blo (all < 2**31)
    hi_rel = (tl.maximum(hi, blo) - blo).to(tl.int32)
    m = tl.zeros((BT,), dtype=tl.int32)
    for j0 in range(split * BS, M, SPLIT * BS):
        j32 = j0 + tl.arange(0, BS)
        j = j32.to(tl.int64)
        j_ok = j < n
        cols = tl.where(j_ok, blo + (j32 * step + (j32 * rem) // M).to(tl.int64), 0)
        key = tl.full((BT, BS), -2147483648, tl.int32)
        ok = row_ok[:, None] & j_ok[None, :]
        if j0 < n:
            acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, j_ok,
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC)
            if HAS_MASK or HAS_BIAS:
                val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, j_ok, lo, hi, fill,
                                            mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK,
                                            HAS_BIAS)
            else:  # the score is the value; the range test in 32-bit offsets from blo
                rel = (cols - blo).to(tl.int32)
                val = acc
                in_range = (rel[None, :] >= lo_rel[:, None]) & (rel[None, :] < hi_rel[:, None])
            key = tl.where(ok & in_range, order_key(val), key)
        m += tl.sum((key != -2147483648).to(tl.int32), axis=1)  # no order key is INT32_MIN (-inf's is above)
        tl.store(samp_ptr + rid[:, None] * samp_stride + j[None, :], key, mask=row_ok[:, None] & (j < M)[None, :])
    tl.atomic_add(msamp_ptr + rid, m, mask=row_ok & (m > 0))


@triton.jit
def threshold_kernel(samp_ptr, msamp_ptr, buf_ptr, lo_ptr, hi_ptr, thr_ptr,
                     S, k, C, target, M, samp_stride, width, fill_bits,
                     SAMPLED: tl.constexpr, MB: tl.constexpr, EB: tl.constexpr):
    """Per row: the target-th best sample key as threshold (ceil(target*m/ctx)-th), then the first k
    out-of-range positions (value fill) after the C candidate slots, sentinels past them. The slots
    themselves are not reset: the filter counts what it appends and the final select reads no more.

    Rows whose context fits the buffer skip the threshold: every entry of their range passes.
    """
    r = tl.program_id(0).to(tl.int64)
    lo = tl.load(lo_ptr + r)
    hi = tl.load(hi_ptr + r)
    ctx = hi - lo
    thr = tl.full((), -2147483648, tl.int64)
    if SAMPLED:
        m = tl.load(msamp_ptr + r).to(tl.int64)
        rank = (target * m + ctx - 1) // tl.maximum(ctx, 1)
        js = tl.arange(0, MB)
        keys = tl.load(samp_ptr + r * samp_stride + js, mask=js < M, other=-2147483648)
        # the largest x with #(keys >= x) >= rank, by bisection over int32 (at most 32 passes, each
        # one compare and one count a key). A count of exactly rank ends it early: the smallest key
        # counted is x. That comes once the bracket is narrower than the gap between the rank-th and
        # the next key; only ties at the rank need all 32 (H200, 4096 samples: 0.117 -> 0.079 ms).
        a = tl.full((), -2147483648, tl.int64)
        z = tl.full((), 2147483647, tl.int64)
        hit = tl.full((), 2147483648, tl.int64)  # no pass counted exactly rank
        while a < z:
            mid = (a + z + 1) >> 1
            cnt = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), axis=0)
            if cnt == rank:
                hit = mid
                z = a
            elif cnt > rank:
                a = mid
            else:
                z = mid - 1
        if hit <= 2147483647:
            a = tl.min(tl.where(keys >= hit.to(tl.int32), keys, 2147483647), axis=0).to(tl.int64)
        use = (ctx > C) & (rank >= 1) & (rank <= m)
        thr = tl.where(use, a, thr)
    tl.store(thr_ptr + r, thr.to(tl.int32))
    tl.debug_barrier()  # the samples may reach into the extras' slots: read them all before overwriting
    sentinel = tl.full((EB,), -1, tl.int64)  # an empty slot (no position is 2**32 - 1)
    n_ext = tl.minimum(S - ctx, k)
    fv = (tl.full((EB,), 0, tl.int32) + fill_bits).to(tl.float32, bitcast=True)
    for j0 in range(0, k, EB):
        j = j0 + tl.arange(0, EB).to(tl.int64)
        pos = tl.where(j < lo, j, hi + (j - lo))
        comp = tl.where(j < n_ext, raw_entry(fv, pos), sentinel)
        tl.store(buf_ptr + r * width + C + j, comp, mask=j < k)


@triton.jit
def _load_heads(q_row, c, sqh, offs_d, d_ok, H: tl.constexpr, BH: tl.constexpr):
    """Heads c .. c+BH-1 of one query row as the [D, BH] operand of the rescore MMA (missing heads 0)."""
    hh = tl.arange(0, BH)
    return tl.load(q_row + (c + hh)[None, :] * sqh + offs_d[:, None], mask=(c + hh < H)[None, :] & d_ok[:, None],
                   other=0.0)


@triton.jit
def _row_weights(w_row, swh, H: tl.constexpr, BH: tl.constexpr):
    """The row's BH head weights as scalars (0 past H), loaded once per program: loaded per block they
    were 64 uniform loads per thread per 64 keys at H=64, 8x the load instructions of the key gathers."""
    ws = ()
    for h in tl.static_range(BH):
        ws = ws + (tl.load(w_row + h * swh, mask=h < H, other=0.0),)
    return ws


@triton.jit
def _head_scores(kg, qt, BH: tl.constexpr, PREC: tl.constexpr):
    """The BH heads' dots of the gathered keys kg: one [BJ, D] x [D, BH] MMA, each head's column moved
    out by splits (no arithmetic, no cross-thread sums: a where + sum per head cost BH times the work
    and failed triton's pipeliner at H=64)."""
    if PREC == "upcast":
        s = tl.dot(kg.to(tl.float32), qt.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        s = tl.dot(kg, qt, input_precision=PREC, out_dtype=tl.float32)
    return _columns(s, BH)


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
def _columns(s, N: tl.constexpr):
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


@triton.jit
def rescore_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                   T, S, K, scale, fill, picks,
                   sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BJ: tl.constexpr, BH: tl.constexpr,
                   ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, W_ONCE: tl.constexpr = True):
    """Values of one query row at ``picks`` given positions, BJ at a time: the gathered keys times the
    row's heads in one [BJ, D] x [D, BH] MMA (BH >= H, up to 64; past that a loop over groups of BH
    heads), then the heads summed in order with score_tile's per-head step.

    Each score is the same fp32 dot (16-bit products are exact, accumulated by the tensor core in
    the same k order) followed by the same act + FMA chain as in the filter, so the values equal
    select's bit for bit; the GPU tests check that, and rescore_tile_kernel is the slow cross-check.
    The loop over blocks is software-pipelined (the launch's num_stages), so the dependent index -> key
    loads of the next blocks are in flight during this one's math. H is a constexpr: at H <= BH the head loop
    unrolls, the block loop is the innermost loop (the one the pipeliner works on) and the row's q is
    loaded once, its weights too with W_ONCE (64 more registers at H=64). A runtime loop over 16-head
    groups at H=64 left the block loop unpipelined.
    """
    r = tl.program_id(0).to(tl.int64)  # row b * T + t
    b = r // T
    t = r % T
    j_lo = tl.program_id(1).to(tl.int64) * picks
    j_hi = tl.minimum(j_lo + picks, K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    one = tl.arange(0, 1).to(tl.int64)
    lo = tl.load(lo_ptr + r + one)
    hi = tl.load(hi_ptr + r + one)
    row_ok = one == 0
    q_row = q_ptr + b * sqb + t * sqt
    w_row = w_ptr + b * swb + t * swt
    if H <= BH:  # the row's heads and weights, loaded once for all its blocks
        q_all = _load_heads(q_row, 0, sqh, offs_d, d_ok, H, BH)
        if HAS_W and W_ONCE:
            w_all = _row_weights(w_row, swh, H, BH)
    for j0 in range(j_lo, j_hi, BJ):
        j = j0 + tl.arange(0, BJ)
        j_ok = j < j_hi
        cols = tl.load(idx_ptr + r * K + j, mask=j_ok, other=0)
        c_ok = j_ok & (cols >= 0) & (cols < S)
        cols = tl.where(c_ok, cols, 0)
        kg = tl.load(kx_ptr + b * skb + cols[:, None] * sks + offs_d[None, :],
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.zeros((BJ,), dtype=tl.float32)
        if H <= BH:  # one MMA: unrolled, so the block loop stays the innermost (pipelined) loop
            sh = _head_scores(kg, q_all, BH, PREC)
            for i in tl.static_range(H):  # heads in order, score_tile's step
                if not HAS_W:
                    w = scale
                elif W_ONCE:
                    w = w_all[i]
                else:
                    w = tl.load(w_row + i * swh)
                acc = act_fma(sh[i], w, acc, ACT)
        else:  # a loop over head groups (H > 64)
            for c in range(0, H, BH):
                sh = _head_scores(kg, _load_heads(q_row, c, sqh, offs_d, d_ok, H, BH), BH, PREC)
                for i in tl.static_range(BH):
                    if c + i < H:
                        acc = act_fma(sh[i], tl.load(w_row + (c + i) * swh) if HAS_W else scale, acc, ACT)
        val, _ = tile_values(acc[None, :], one + b, one + t, cols, row_ok, c_ok, lo, hi, fill,
                             mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
        tl.store(out_ptr + r * K + j, canonical(tl.reshape(val, (BJ,))), mask=j_ok)


@triton.jit
def rescore_tile_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                        T, S, H, K, scale, fill,
                        sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                        ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                        HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Values at given positions: the row's block tile against the row's gathered keys, one row kept.

    The tile is the same [BT, BS] product the filter computes, so each kept value is bit-identical
    by construction; it does BT times the work of rescore_kernel (kept as its cross-check).
    """
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2).to(tl.int64) * BS + tl.arange(0, BS)
    j_ok = j < K
    rows_t, row_ok, rid, lo, hi, blo, bhi = _block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    for i in range(BT):
        t = pid_t.to(tl.int64) * BT + i
        if t < T:
            cols = tl.load(idx_ptr + (b * T + t) * K + j, mask=j_ok, other=0)
            c_ok = j_ok & (cols >= 0) & (cols < S)
            cols = tl.where(c_ok, cols, 0)
            acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, c_ok,
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, ACT, HAS_W, PREC)
            val, _ = tile_values(acc, rows_b, rows_t, cols, row_ok, c_ok, lo, hi, fill,
                                 mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            v = tl.sum(tl.where(rows_t[:, None] == t, val, 0.0), axis=0)  # exact: one term per column
            v = canonical(v)
            tl.store(out_ptr + (b * T + t) * K + j, v, mask=j_ok)


@triton.jit
def canonical(v):
    """NaN as 0x7FC00000 and -0.0 as +0.0: the values select returns (they come back from order keys)."""
    v = tl.where(v != v, float("nan"), v)
    return tl.where(v == 0.0, 0.0, v)


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
