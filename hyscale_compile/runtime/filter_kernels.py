"""Kernels that walk (query block x key tile) grids: sample, threshold, score+filter, and rescore.

Each one calls ``score_tile`` with the shared tile shape. The block kernel also has a FLOOR mode
(the score arithmetic with no output, for the benchmark) and a TABLE mode (writes the fp32 value
table, the baseline HyTopK replaces).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .score_tile import composite, order_key, score_tile, tile_values

# block_kernel modes (host side; the kernel compares the literals, jit code reads no globals)
MODE_FLOOR = 0
MODE_TABLE = 1
MODE_FILTER = 2
MODE_COUNT = 3


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
                 RELU: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                 HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                 PREFIX_DOT: tl.constexpr = False):
    """FILTER: append (value, position) composites passing the row threshold to the row's buffer."""
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
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
    if MODE >= 2:  # FILTER (and COUNT)
        thr = tl.load(thr_ptr + rid, mask=row_ok, other=0)
    sink = tl.zeros((BT,), dtype=tl.float32)
    # upper[c', c] = 1 for c' <= c: passed @ upper is each row's inclusive running count (exact integers)
    upper = (tl.arange(0, BS)[:, None] <= tl.arange(0, BS)[None, :]).to(tl.float16)
    for tile in range(tile0 + split, tile1, SPLIT):
        cols = tile * BS + tl.arange(0, BS).to(tl.int64)
        col_ok = cols < S
        acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, col_ok,
                         H, sqh, swh, scale, D, BLOCK_D, BT, BS, RELU, HAS_W, PREC)
        if MODE == 0:  # FLOOR: the arithmetic alone, one sum kept per row
            sink += tl.sum(acc, axis=1)
        else:
            val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, col_ok, lo, hi, fill,
                                        mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            if MODE == 1:
                tl.store(out_ptr + rid[:, None] * out_stride + cols[None, :], val,
                         mask=row_ok[:, None] & col_ok[None, :])
            else:
                key = order_key(val)
                passed = in_range & (key >= thr[:, None])
                if MODE == 3:  # COUNT: the compare without the append (a benchmark diagnostic)
                    sink += tl.sum(passed.to(tl.float32), axis=1)
                elif PREFIX_DOT:
                    _append_dot(cnt_ptr, out_ptr, rid, row_ok, passed, composite(key, cols[None, :]), C, out_stride,
                                upper)
                else:
                    _append(cnt_ptr, out_ptr, rid, row_ok, passed, composite(key, cols[None, :]), C, out_stride)
    if (MODE == 0) or (MODE == 3):
        pid = (tl.program_id(1) * tl.num_programs(0) + pid_t) * SPLIT + split
        tl.store(out_ptr + pid.to(tl.int64) * BT + tl.arange(0, BT), sink)


@triton.jit
def _append(cnt_ptr, buf_ptr, rid, row_ok, passed, comp, C, stride):
    """Append the passing entries of each row at slots reserved with one atomic add per row.

    Slot order depends on scheduling; the final select sorts by the unique composite, so it never matters.
    """
    pi = passed.to(tl.int32)
    n = tl.sum(pi, axis=1)
    base = tl.atomic_add(cnt_ptr + rid, n, mask=row_ok & (n > 0))
    slot = base[:, None] + tl.cumsum(pi, axis=1) - pi
    tl.store(buf_ptr + rid[:, None] * stride + slot, comp, mask=passed & (slot < C))


@triton.jit
def _append_dot(cnt_ptr, buf_ptr, rid, row_ok, passed, comp, C, stride, upper):
    """_append with the running count from one small matmul, which stays in the score tile's layout."""
    pf = passed.to(tl.float16)
    incl = tl.dot(pf, upper, out_dtype=tl.float32).to(tl.int32)
    pi = passed.to(tl.int32)
    n = tl.sum(pi, axis=1)
    base = tl.atomic_add(cnt_ptr + rid, n, mask=row_ok & (n > 0))
    slot = base[:, None] + incl - pi
    tl.store(buf_ptr + rid[:, None] * stride + slot, comp, mask=passed & (slot < C))


@triton.jit
def sample_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, samp_ptr, msamp_ptr, mask_ptr, bias_ptr,
                  T, S, H, scale, fill, M, samp_stride, SPLIT,
                  sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  RELU: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Keys of M evenly spaced positions of the block's range, shared by its rows (one matmul tile).

    SPLIT programs share a block's samples; the per-row count of valid samples is an integer atomic sum.
    """
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows_t, row_ok, rid, lo, hi, blo, bhi = _block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
    bctx = tl.maximum(bhi - blo, 0)
    n = tl.minimum(bctx, M)
    q_rows = b * sqb + rows_t * sqt
    w_rows = b * swb + rows_t * swt
    kx_b = kx_ptr + b * skb
    rows_b = rows_t * 0 + b
    m = tl.zeros((BT,), dtype=tl.int32)
    for j0 in range(split * BS, M, SPLIT * BS):
        j = j0 + tl.arange(0, BS).to(tl.int64)
        j_ok = j < n
        cols = tl.where(j_ok, blo + tl.where(bctx > M, (j * bctx) // M, j), 0)
        key = tl.full((BT, BS), -2147483648, tl.int32)
        ok = row_ok[:, None] & j_ok[None, :]
        if j0 < n:
            acc = score_tile(q_ptr, kx_b, w_ptr, q_rows, w_rows, cols * sks, row_ok, j_ok,
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, RELU, HAS_W, PREC)
            val, in_range = tile_values(acc, rows_b, rows_t, cols, row_ok, j_ok, lo, hi, fill,
                                        mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            ok = ok & in_range
            key = tl.where(ok, order_key(val), key)
        m += tl.sum(ok.to(tl.int32), axis=1)
        tl.store(samp_ptr + rid[:, None] * samp_stride + j[None, :], key, mask=row_ok[:, None] & (j < M)[None, :])
    tl.atomic_add(msamp_ptr + rid, m, mask=row_ok & (m > 0))


@triton.jit
def threshold_kernel(samp_ptr, msamp_ptr, buf_ptr, lo_ptr, hi_ptr, thr_ptr,
                     S, k, C, target, M, samp_stride, width, fill_key,
                     SAMPLED: tl.constexpr, MB: tl.constexpr, EB: tl.constexpr):
    """Per row: the target-th best sample key as threshold (ceil(target*m/ctx)-th), then reset the
    row's candidate slots and write the first k out-of-range positions (value fill) after them.

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
        keys = tl.load(samp_ptr + r * samp_stride + js, mask=js < M, other=-2147483648).to(tl.int64)
        a = tl.full((), -2147483648, tl.int64)
        z = tl.full((), 2147483647, tl.int64)
        for _ in range(32):  # largest x with #(keys >= x) >= rank
            mid = (a + z + 1) >> 1
            enough = tl.sum((keys >= mid).to(tl.int64), axis=0) >= rank
            a = tl.where(enough, mid, a)
            z = tl.where(enough, z, mid - 1)
        use = (ctx > C) & (rank >= 1) & (rank <= m)
        thr = tl.where(use, a, thr)
    tl.store(thr_ptr + r, thr.to(tl.int32))
    tl.debug_barrier()  # the samples live in this row's slots: read them all before overwriting
    sentinel = tl.full((EB,), 1, tl.int64) << 63
    for c0 in range(0, C, EB):
        c = c0 + tl.arange(0, EB)
        tl.store(buf_ptr + r * width + c, sentinel, mask=c < C)
    n_ext = tl.minimum(S - ctx, k)
    fk = tl.full((EB,), 0, tl.int32) + fill_key
    for j0 in range(0, k, EB):
        j = j0 + tl.arange(0, EB).to(tl.int64)
        pos = tl.where(j < lo, j, hi + (j - lo))
        comp = tl.where(j < n_ext, composite(fk, pos), sentinel)
        tl.store(buf_ptr + r * width + C + j, comp, mask=j < k)


@triton.jit
def rescore_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                   T, S, H, K, scale, fill,
                   sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                   RELU: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Values at given positions: the row's block tile against the row's gathered keys, one row kept.

    The tile is the same [BT, BS] product the filter computes, so each kept value is bit-identical.
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
                             H, sqh, swh, scale, D, BLOCK_D, BT, BS, RELU, HAS_W, PREC)
            val, _ = tile_values(acc, rows_b, rows_t, cols, row_ok, c_ok, lo, hi, fill,
                                 mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
            v = tl.sum(tl.where(rows_t[:, None] == t, val, 0.0), axis=0)  # exact: one term per column
            v = tl.where(v != v, float("nan"), v)  # canonical NaN, as select returns it
            tl.store(out_ptr + (b * T + t) * K + j, v, mask=j_ok)


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
