"""Gather-based Triton backward of the indexer selection: gradients through the k selected scores only.

For each query row (b, t) and each pick j with key s = indices[b, t, j] and upstream gradient g[j]:

    pre[h, j]  = scale * q[b, t, h, :] . kx[b, s, :]          (fp32 accumulation, as the forward)
    dw[h]     += g[j] * act(pre[h, j])
    gpre[h, j] = g[j] * w[h] * scale * act'(pre[h, j])
    dq[h, :]  += gpre[h, j] * kx[b, s, :]
    dkx[b, s] += sum_h gpre[h, j] * q[b, t, h, :]

dq and dw are per row: one program per row writes them once, or, when a chunk has too few rows to
fill the GPU, each of P slices of a row's picks writes partials that are summed after (a fixed
reduction for a fixed P; its bits differ from P=1's by fp32 rounding). dkx collects picks of many rows:
the atomic path adds them with float atomics (order-dependent bits); the deterministic path sorts
the picks by key (stable) first, writes each pick's contribution at its place in that order, and
sums each key's contiguous run in that fixed order. Masked picks (not visible) get a zero upstream
gradient, so they add nothing.

Precision follows the model (``GRAD``): the score gradients gpre are fp32 values. Where the model scores
in 16-bit, they are rounded to the operand dtype for the MMAs, as flash-attention does (GRAD_LOW). Where the
model's score arithmetic is fp32 on 16-bit inputs, they stay fp32-exact: for bf16 operands gpre is split
into three bf16 terms (8 + 8 + 8 bits: the split is exact) multiplied with the exact bf16 operands in fp32
accumulation (GRAD_SPLIT3); fp16 operands (whose narrow exponent cannot hold the split) are widened to fp32
and multiplied as tf32x3 (fp16 is exact in tf32), as fp32 operands are under torch's matmul precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .env import interpreting, multiprocessors
from .reference import Visibility
from .score_tile import precision

# Deterministic dkx even when the caller allows atomics: it measured faster than the atomic path at every
# training shape (the rule: deterministic unless it costs more than 1.3x; benchmarks/NOTES-selection.md,
# "Defaults and the measurements behind them": deterministic dkx).
PREFER_DETERMINISTIC = True

# Upper bound on the fp32 contribution buffer of the deterministic path; rows go in chunks under it
# (at 1 GiB it set the training step's peak memory; each chunk costs two launches, and each group
# of chunks one sort).
_CONTRIB_BYTES = 1 << 29
# Upper bound on the scratch of one sort that orders the picks of several chunks (keys, sorted keys,
# order, the sort's own buffers, places), beside the contribution buffer.
_ORDER_BYTES = 1 << 28
_ORDER_BYTES_PER_PICK = 40
_INT32_KEYS_BELOW = 2**31  # sort keys and places in int32 below this (tests lower it to take int64)

SEGMENT_KEYS = 16  # key positions per program of the deterministic dkx reduction

# Row program shape: picks per step, steps loaded ahead of use (num_stages), and programs per SM to
# aim for by splitting each row's picks over slices (0: no slices). A chunk has few rows (the
# contribution buffer caps it near 512 at k=2048), so wide rows (heads x dim past 4096) need the
# slices: (64, 3, 8) there; narrow rows measured even either way, and (32, 1, 0) launches fewer host
# ops per chunk (the small training step is bound by the host) (benchmarks/NOTES-selection.md,
# "Defaults and the measurements behind them": backward row shape). None: the rule.
ROW_PICKS: int | None = None
ROW_STAGES: int | None = None
PROGRAMS_PER_SM: int | None = None


def _row_shape(BH: int, BD: int) -> tuple[int, int, int, int]:
    """(picks per step, num_stages, programs per SM, warps) for rows of BH heads x BD dims."""
    wide = BH * BD > 4096
    picks = ROW_PICKS if ROW_PICKS is not None else (64 if wide else 32)
    stages = ROW_STAGES if ROW_STAGES is not None else (3 if wide else 1)
    per_sm = PROGRAMS_PER_SM if PROGRAMS_PER_SM is not None else (8 if wide else 0)
    if picks < 16 and not interpreting():
        raise ValueError(f"ROW_PICKS={picks}: the picks per step are a tensor-core K on the GPU (at least 16)")
    return picks, stages, per_sm, 8 if wide else 4


def _slices(rows: int, K: int, BK: int, per_sm: int, device: torch.device) -> int:
    """Slices per row so that rows * slices reach per_sm programs per SM (1 on the CPU: the interpreter
    runs programs one by one)."""
    if device.type != "cuda" or per_sm <= 0:
        return 1
    target = per_sm * multiprocessors(device)
    return max(1, min(triton.cdiv(K, BK), triton.cdiv(target, rows)))


@triton.jit
def _row_kernel(g_ptr, q_ptr, kx_ptr, w_ptr, idx_ptr, dq_ptr, dw_ptr, dkx_ptr, contrib_ptr, place_ptr, seg_ptr,
                t0, B, R, T, H, S, K, D, scale, slice_picks, out_T, out_t0, seg_base, g0, group_rows,
                HAS_W: tl.constexpr, RELU: tl.constexpr, ATOMIC: tl.constexpr, GRAD: tl.constexpr,
                PREC: tl.constexpr, GRAD_PREC: tl.constexpr,
                BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    # One program per query row of the chunk and slice of ``slice_picks`` picks: pid = b * R + r, the row is
    # t = t0 + r. Slice p writes its dq / dw to rows [p, b, t - out_t0] of a [P, B, out_T] array: dq
    # itself when there is one slice, else partials the host sums in slice order. The deterministic path
    # writes each pick's dkx contribution at its place in the sorted order, counted from the chunk's
    # first place (so the segment reduction reads each key's picks as one contiguous run).
    pid = tl.program_id(0)
    part = tl.program_id(1)
    b = (pid // R).to(tl.int64)
    t = t0 + (pid % R).to(tl.int64)
    row = b * T + t
    j_lo = part.to(tl.int64) * slice_picks
    j_hi = tl.minimum(j_lo + slice_picks, K)
    hs = tl.arange(0, BH)
    ds = tl.arange(0, BD)
    js = tl.arange(0, BK)
    hmask = hs < H
    dmask = ds < D
    qt = tl.load(q_ptr + row * H * D + hs[:, None] * D + ds[None, :],
                 mask=hmask[:, None] & dmask[None, :], other=0.0)
    if HAS_W:
        wv = tl.load(w_ptr + row * H + hs, mask=hmask, other=0.0).to(tl.float32)
    else:
        wv = tl.where(hmask, 1.0, 0.0)
    kx_b = kx_ptr + b * S * D
    if not ATOMIC:
        place_row = place_ptr + (b * group_rows + t - g0) * K
        first = tl.load(seg_ptr + seg_base).to(tl.int64)
    dq_acc = tl.zeros((BH, BD), dtype=tl.float32)
    dw_acc = tl.zeros((BH,), dtype=tl.float32)
    # Pipelined (the launch's num_stages): the dependent index -> key loads bound the loop when issued
    # one step at a time.
    for k0 in range(j_lo, j_hi, BK):
        jmask = (k0 + js) < j_hi
        ids = tl.load(idx_ptr + row * K + k0 + js, mask=jmask, other=0).to(tl.int64)
        gv = tl.load(g_ptr + row * K + k0 + js, mask=jmask, other=0.0)
        kd_mask = jmask[:, None] & dmask[None, :]
        kg = tl.load(kx_b + ids[:, None] * D + ds[None, :], mask=kd_mask, other=0.0)
        # The gate's dot follows the forward's rule (score_tile): inputs as stored, fp32 accumulation,
        # the same precision setting; only the tile shape differs.
        if PREC == "upcast":
            pre = tl.dot(qt.to(tl.float32), tl.trans(kg).to(tl.float32), input_precision="ieee") * scale
        elif GRAD != 2:  # 16-bit operands, as stored (the products are exact in fp32)
            pre = tl.dot(qt, tl.trans(kg), out_dtype=tl.float32) * scale
        else:
            pre = tl.dot(qt, tl.trans(kg), input_precision=PREC, out_dtype=tl.float32) * scale
        if RELU:
            act = tl.maximum(pre, 0.0)
        else:
            act = pre
        dw_acc += tl.sum(act * gv[None, :], axis=1)
        gp = gv[None, :] * wv[:, None] * scale
        if RELU:
            gp = tl.where(pre > 0.0, gp, 0.0)
        if PREC == "upcast":
            dq_acc += tl.dot(gp, kg.to(tl.float32), input_precision="ieee")
            contrib = tl.dot(tl.trans(gp), qt.to(tl.float32), input_precision="ieee")
        elif GRAD == 0:  # GRAD_LOW: the model scores in 16-bit; score gradients in the operand dtype
            gp_lo = gp.to(kg.dtype)
            dq_acc += tl.dot(gp_lo, kg)
            contrib = tl.dot(tl.trans(gp_lo), qt)
        elif GRAD == 1:  # GRAD_SPLIT3: gp = hi + mid + lo exactly, three bf16 MMAs, smallest term first
            hi = gp.to(tl.bfloat16)
            rest = gp - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            dq_acc = tl.dot(lo, kg, dq_acc)
            dq_acc = tl.dot(mid, kg, dq_acc)
            dq_acc = tl.dot(hi, kg, dq_acc)
            contrib = tl.dot(tl.trans(lo), qt)
            contrib = tl.dot(tl.trans(mid), qt, contrib)
            contrib = tl.dot(tl.trans(hi), qt, contrib)
        else:
            dq_acc += tl.dot(gp, kg, input_precision=GRAD_PREC)
            contrib = tl.dot(tl.trans(gp), qt, input_precision=GRAD_PREC)
        if ATOMIC:
            tl.atomic_add(dkx_ptr + b * S * D + ids[:, None] * D + ds[None, :], contrib, mask=kd_mask)
        else:
            dst = tl.load(place_row + k0 + js, mask=jmask, other=0).to(tl.int64) - first
            tl.store(contrib_ptr + dst[:, None] * D + ds[None, :], contrib, mask=kd_mask)
    part_rows = (part.to(tl.int64) * B + b) * out_T + (t - out_t0)
    tl.store(dq_ptr + part_rows * H * D + hs[:, None] * D + ds[None, :], dq_acc,
             mask=hmask[:, None] & dmask[None, :])
    if HAS_W:
        tl.store(dw_ptr + part_rows * H + hs, dw_acc, mask=hmask)


@triton.jit
def _segment_kernel(contrib_ptr, seg_ptr, dkx_ptr, n_keys, D, seg_base, BD: tl.constexpr, BKEY: tl.constexpr):
    # BKEY key positions p = b * S + s per program, each adding its picks one after another in their
    # sorted (stable) order: the bits depend only on the picks. One key per program was bound by how
    # fast programs start (a key has T*K/S picks on average, split over the row chunks: a handful).
    # The row kernel wrote the contributions in sorted order: key p's are the contiguous run
    # [seg[p] - seg[0], seg[p + 1] - seg[0]) of this chunk's buffer (seg from this chunk's base).
    p = tl.program_id(0).to(tl.int64) * BKEY + tl.arange(0, BKEY)
    ds = tl.arange(0, BD)
    pmask = p < n_keys
    tile = pmask[:, None] & (ds < D)[None, :]
    first = tl.load(seg_ptr + seg_base).to(tl.int64)
    start = tl.load(seg_ptr + seg_base + p, mask=pmask, other=0).to(tl.int64)
    count = tl.load(seg_ptr + seg_base + p + 1, mask=pmask, other=0) - start
    start -= first
    acc = tl.load(dkx_ptr + p[:, None] * D + ds[None, :], mask=tile, other=0.0)
    n = tl.max(count, axis=0)
    i = 0
    while i < n:
        ok = i < count
        acc += tl.load(contrib_ptr + (start + i)[:, None] * D + ds[None, :], mask=ok[:, None] & tile, other=0.0)
        i += 1
    tl.store(dkx_ptr + p[:, None] * D + ds[None, :], acc, mask=tile)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _masked_grad(grad_values: Tensor, indices: Tensor, vis: Visibility, S: int) -> Tensor:
    """Upstream gradient with masked picks zeroed: their value is a constant fill."""
    B, T, _ = indices.shape
    g = grad_values.float()
    visible = vis.at(0, T, indices, (B, T, S))
    if visible is not None:
        g = torch.where(visible, g, torch.zeros_like(g))
    return g.contiguous()


def _pick_order(idx: Tensor, g0: int, group_rows: int, rows: int, S: int) -> tuple[Tensor, Tensor]:
    """Where each pick of rows [g0, g0 + group_rows) goes in the stable order by (chunk of ``rows`` rows,
    key b * S + s), as [B, group_rows, K] places, and each (chunk, key)'s [start, end) in that order:
    one sort for several chunks, no host sync. Inside a segment the picks keep their (b, row, j)
    order, as one sort per chunk gave."""
    B, _, K = idx.shape
    n = B * S
    chunks = triton.cdiv(group_rows, rows)
    dtype = torch.int32 if chunks * n < _INT32_KEYS_BELOW else torch.int64  # a radix sort of half the passes
    dev = idx.device
    base = ((torch.arange(group_rows, device=dev, dtype=dtype) // rows) * n).view(1, group_rows, 1)
    base = base + (torch.arange(B, device=dev, dtype=dtype) * S).view(B, 1, 1)
    keys = (idx[:, g0:g0 + group_rows].to(dtype) + base).reshape(-1)
    sorted_keys, perm = torch.sort(keys, stable=True)
    small = keys.numel() < _INT32_KEYS_BELOW
    place = torch.empty_like(perm, dtype=torch.int32 if small else torch.int64)
    place.scatter_(0, perm, torch.arange(keys.numel(), device=dev, dtype=place.dtype))
    edges = torch.arange(chunks * n + 1, device=dev, dtype=dtype)
    return place, torch.searchsorted(sorted_keys, edges, out_int32=small)


def _group_chunks(B: int, rows: int, K: int, S: int) -> int:
    """Chunks ordered by one sort: as many as keep its scratch (per pick; and edges and bounds per chunk
    and key) under _ORDER_BYTES."""
    return max(1, _ORDER_BYTES // (_ORDER_BYTES_PER_PICK * B * rows * K + 16 * B * S))


GRAD_LOW, GRAD_SPLIT3, GRAD_FP32 = 0, 1, 2  # how the score gradients meet the operands (module note)


def grad_path(q: Tensor, kx: Tensor, low_precision: bool) -> int:
    """GRAD_LOW where asked for and the operands are one 16-bit dtype; GRAD_SPLIT3 for bf16 operands;
    GRAD_FP32 (operands widened) for fp16, fp32 or mixed ones."""
    if q.dtype == torch.float32 or kx.dtype != q.dtype:
        return GRAD_FP32
    if low_precision:
        return GRAD_LOW
    return GRAD_SPLIT3 if q.dtype == torch.bfloat16 else GRAD_FP32


def sparse_backward(grad_values: Tensor, q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor,
                    scale: float, relu: bool, vis: Visibility, deterministic: bool = False,
                    low_precision: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Gradients of sum(grad_values * values) w.r.t. q, kx, weights (contract: ``reference.sparse_backward``).

    deterministic=True forbids float atomics; False lets ``PREFER_DETERMINISTIC`` decide. low_precision:
    the model scores in 16-bit, so 16-bit score gradients are as precise as its own (module note).
    """
    B, T, H, D = q.shape
    S, K = kx.shape[1], indices.shape[-1]
    use_atomics = not (deterministic or PREFER_DETERMINISTIC)
    g = _masked_grad(grad_values, indices, vis, S)
    path = grad_path(q, kx, low_precision)
    # fp16, fp32 or mixed operands go through fp32 (tl.dot needs one input dtype).
    widened = path == GRAD_FP32
    qc = q.float().contiguous() if widened else q.contiguous()
    kxc = kx.float().contiguous() if widened else kx.contiguous()
    idx = indices.contiguous()
    wc = weights.contiguous() if weights is not None else qc
    dq = torch.empty(B, T, H, D, dtype=torch.float32, device=q.device)
    dw = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if weights is not None else dq
    dkx = torch.zeros(B, S, D, dtype=torch.float32, device=q.device)
    if B * T == 0 or K == 0:
        dq.zero_()
        dw.zero_()
        return _finish(dq, dkx, dw, q, kx, weights)
    BH, BD = _pow2(H), _pow2(D)
    BK, stages, per_sm, warps = _row_shape(BH, BD)
    rows = T if use_atomics else max(1, min(T, _CONTRIB_BYTES // max(1, B * K * D * 4)))
    group_rows = rows * _group_chunks(B, rows, K, S)
    contrib = dkx if use_atomics else torch.empty(B * rows * K * D, dtype=torch.float32, device=q.device)
    place = seg = idx  # the atomic path writes no contributions (unused pointers)
    g0 = G = 0
    for t0 in range(0, T, rows):
        R = min(rows, T - t0)
        if not use_atomics and t0 % group_rows == 0:  # the next group's order (keys never leave the device)
            g0, G = t0, min(group_rows, T - t0)
            place, seg = _pick_order(idx, g0, G, rows, S)
        P = _slices(B * R, K, BK, per_sm, q.device)
        slice_picks = triton.cdiv(triton.cdiv(K, P), BK) * BK
        P = triton.cdiv(K, slice_picks)
        # One slice writes dq / dw in place; several write partials, summed below.
        dq_out, dw_out, out_T, out_t0 = dq, dw, T, 0
        if P > 1:
            dq_out = torch.empty(P, B, R, H, D, dtype=torch.float32, device=q.device)
            dw_out = torch.empty(P, B, R, H, dtype=torch.float32, device=q.device) if weights is not None else dq_out
            out_T, out_t0 = R, t0
        seg_base = (t0 - g0) // rows * B * S  # this chunk's bounds in its group's
        _row_kernel[(B * R, P)](g, qc, kxc, wc, idx, dq_out, dw_out, dkx, contrib, place, seg, t0, B, R, T, H, S,
                                K, D, float(scale), slice_picks, out_T, out_t0, seg_base, g0, G,
                                HAS_W=weights is not None, RELU=bool(relu), ATOMIC=use_atomics, GRAD=path,
                                PREC=precision(qc.dtype), GRAD_PREC=_grad_precision(q, qc), BH=BH, BK=BK, BD=BD,
                                num_warps=warps, num_stages=stages)
        if P > 1:
            dq[:, t0:t0 + R] = dq_out.sum(0)
            if weights is not None:
                dw[:, t0:t0 + R] = dw_out.sum(0)
        if not use_atomics:
            _segment_kernel[(triton.cdiv(B * S, SEGMENT_KEYS),)](contrib, seg, dkx, B * S, D, seg_base, BD=BD,
                                                                 BKEY=SEGMENT_KEYS)
    return _finish(dq, dkx, dw, q, kx, weights)


def _grad_precision(q: Tensor, qc: Tensor) -> str:
    """The widened path's MMA precision for the score gradients: tf32x3 for widened 16-bit operands (exact in
    tf32; three MMAs keep the fp32 gradients' bits), torch's matmul setting for the model's own fp32."""
    if q.dtype != torch.float32 and qc.dtype == torch.float32 and not interpreting():
        return "tf32x3"
    return precision(qc.dtype)


def _finish(dq: Tensor, dkx: Tensor, dw: Tensor, q: Tensor, kx: Tensor, weights: Tensor | None):
    return (dq.to(q.dtype), dkx.to(kx.dtype), None if weights is None else dw.to(weights.dtype))
