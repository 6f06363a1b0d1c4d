"""Absorbed MLA attention a block of query rows at a time: the per-head latent tensors never exist whole.

The latent form of MLA attention (``passes/attention_mla.py`` derives it) is, per head h, with q = [q_nope,
q_rope] [B, T, H, Dn + Dr], kv = [c, r] [B, S, 1, Dc + Dr] and the up-projection w [H, Dn + Dv, Dc]
(w_uk = w[:, :Dn], w_uv = w[:, Dn:]):

    q' = [q_nope w_uk[h], q_rope]                          [B, T, H, Dc + Dr]
    o', lse = sparse_attention_latent(q', kv, Dc)          [B, T, H, Dc]
    out = o' w_uv[h]^T                                     [B, T, H, Dv]

Written as graph ops, autograd keeps q' and o' for the backward and the backward makes dq' and do' = dout w_uv
whole: at DeepSeek-V3.2's sizes (128 heads, 576 / 512 features) that is 9.7 + 8.6 + 9.7 + 8.6 GB at T = 65536,
most of the layer step's peak. Here the same operations run ROWS_BYTES of q' at a time, forward and backward; the
backward recomputes a block's q' (one GEMM), and kv's gradient is summed in fp32 across blocks by the latent
backward itself (the same bits as one call: each key adds its picks in row order).

w_uv's gradient is sum_t o'[t]^T dout[t] per head, so the backward needs o' (8.6 GB at T = 65536). Two ways:

* keep it (``keep_latent``, the default): the backward's row term is rowsum(do' * o') as the graph ops had it;
* recompute it: the latent backward's dq kernel forms o' = p v a block at a time from the rows it gathers for
  dq' anyway (p being what the backward computes in any case), which costs attention time. Its row term is then
  first rowsum(dout * out) over the Dv output features (o' is not there yet), and dq' takes the one consistent
  with the recomputed o' (``naive.backward``: do' is rounded to 16 bits for the dp the backward forms, the
  model's out another way; the first row term alone would put a bias in every pick of dq'); kv's gradient keeps
  the first (its contributions are summed before o' exists): as accurate as the graph ops for dq' and w, a
  little less for kv (the tests bound it).

Each block runs the ops the graph ran for its rows, in the same dtypes (the absorption GEMMs in the inputs'
dtype, the attention as ``sparse_attention_latent``): the values are the graph's, up to the GEMM library's
choice of kernel. The weight's gradient sums the blocks' products in fp32 and rounds once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import attention, attention_backward_latent, row_delta
from .empty_rows import eager_gradient
from .naive import Picks, compute_dtype

# Bytes of q' per block of query rows (its dq', do' and o' blocks are about as large).
ROWS_BYTES = 1 << 29


def block_rows(q: Tensor, kv: Tensor) -> int:
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    return max(1, min(max(T, 1), ROWS_BYTES // max(1, B * H * kv.shape[-1] * q.element_size())))


def _shifted(picks: Picks, t0: int) -> Picks:
    """The picks rule of rows t0.. run as rows 0..: a causal limit t + offset becomes (t - t0) + offset + t0."""
    return dataclasses.replace(picks, offset=picks.offset + t0)


def _heads_mm(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out[..., h, :] = a[..., h, :] @ b[h] for a [B, R, H, X], b [H, X, Y], out [B, R, H, Y] (views), written in place:
    one batched GEMM over the heads, for all B * R rows where both are views of that many rows (one batch row, or
    the whole T), else one a batch row. With the heads as the GEMM's batch, a row-major [R, H, X] block is [H, R, X]
    with row stride H * X, which cuBLAS reads and writes as it is: no permuted copy, no concatenation after."""
    try:
        pairs = [(a.view(-1, *a.shape[2:]), out.view(-1, *out.shape[2:]))]
    except RuntimeError:  # a block of rows of several batch rows: not one stride apart
        pairs = list(zip(a, out))
    for x, o in pairs:
        torch.bmm(x.transpose(0, 1), b, out=o.transpose(0, 1))


def _latent_q(q: Tensor, w: Tensor, Dn: int) -> Tensor:
    """q' = [q_nope w_uk[h], q_rope], row-major [B, R, H, Dc + Dr] (the layout the kernels read a row's heads in)."""
    Dc = w.shape[2]
    ql = q.new_empty(*q.shape[:3], Dc + q.shape[3] - Dn)
    _heads_mm(q[..., :Dn], w[:, :Dn], ql[..., :Dc])
    ql[..., Dc:] = q[..., Dn:]
    return ql


def forward(q: Tensor, kv: Tensor, w: Tensor, Dn: int, indices: Tensor, scale: float, picks: Picks,
            empty: str, keep_latent: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, T, H, Dv], lse [B, T, H] fp32, o' [B, T, H, Dc] or, without ``keep_latent``, an empty [0]), out
    and o' in q's dtype."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    Dc = w.shape[2]
    out = q.new_empty(B, T, H, w.shape[1] - Dn)
    lat = q.new_empty(B, T, H, Dc) if keep_latent else q.new_empty(0)
    lse = torch.empty(B, T, H, dtype=compute_dtype(q), device=q.device)
    w_uv_t = w[:, Dn:].transpose(1, 2)
    step = block_rows(q, kv)
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        into = lse[:, rows].is_contiguous()  # one batch row: the kernel writes o' and lse where they stay
        o, m = attention(_latent_q(q[:, rows], w, Dn), kv, kv[..., :Dc], indices[:, rows], scale,
                         _shifted(picks, t0), empty,
                         *(((lat[:, rows] if keep_latent else None), lse[:, rows]) if into else ()))
        if not into:
            lse[:, rows] = m
            if keep_latent:
                lat[:, rows] = o
        _heads_mm(o, w_uv_t, out[:, rows])
    return out, lse, lat


def _add_products(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc [H, X, Y] (fp32) += sum over rows of a^T b per head, a [B, R, H, X], b [B, R, H, Y] 16-bit or fp32:
    the products and their sum in fp32 (cuBLAS's fp32-output GEMM for 16-bit inputs, an fp32 GEMM otherwise)."""
    H = a.shape[2]
    a = a.permute(2, 3, 0, 1).reshape(H, a.shape[3], -1)
    b = b.permute(2, 0, 1, 3).reshape(H, -1, b.shape[3])
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        acc += torch.bmm(a, b, out_dtype=acc.dtype)
    else:
        acc.baddbmm_(a.to(acc.dtype), b.to(acc.dtype))


def backward(dout: Tensor, dlse: Tensor | None, dlat: Tensor | None, q: Tensor, kv: Tensor, w: Tensor, Dn: int,
             out: Tensor, lse: Tensor, lat: Tensor | None, indices: Tensor, scale: float, picks: Picks, empty: str,
             eager_empty_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dkv, dw) in the inputs' dtypes, from the gradients of out, lse and o' (None: no gradient) and the
    forward's out, lse and o' (None where it was not kept: recomputed). ``eager_empty_grad``: rows with no visible
    pick also get the gradient an additive finfo.min mask gives them in eager (empty_rows.py), added to q' and kv's
    gradients as autograd adds the two uses of them."""
    T, H = q.shape[1], q.shape[2]
    Dc = w.shape[2]
    ct = compute_dtype(q)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=ct, device=q.device)
    dw_uk = torch.zeros(H, Dn, Dc, dtype=ct, device=q.device)
    dw_uv = torch.zeros(H, w.shape[1] - Dn, Dc, dtype=ct, device=q.device)
    w_uk_t = w[:, :Dn].transpose(1, 2)
    step = block_rows(q, kv)
    for t0 in range(0, T, step):
        rows = slice(t0, min(T, t0 + step))
        do = dout[:, rows]
        dl = q.new_empty(*do.shape[:3], Dc)  # do' row-major, as the kernels read a row's heads
        _heads_mm(do, w[:, Dn:], dl)
        if dlat is not None:
            dl += dlat[:, rows]
        dlse_rows = None if dlse is None else dlse[:, rows]
        ql = _latent_q(q[:, rows], w, Dn)
        if lat is not None:
            lat_rows, again = lat[:, rows], None
            delta = row_delta(dl, lat_rows, dlse_rows)
        else:  # the block's o', recomputed by the latent backward
            lat_rows = again = q.new_empty(*do.shape[:3], Dc)
            delta = row_delta(do, out[:, rows], dlse_rows)
        dql, _ = attention_backward_latent(dl, delta, ql, kv, Dc, lse[:, rows], indices[:, rows], scale,
                                           _shifted(picks, t0), empty, dkv_acc=dkv, out=again,
                                           dlse=dlse_rows if again is not None else None)
        if eager_empty_grad:
            dq_e, dkv_e = eager_gradient(dl, ql, kv, kv[..., :Dc], lse[:, rows], scale)
            dql = dql + dq_e.to(dql.dtype)
            dkv += dkv_e
        _heads_mm(dql[..., :Dc], w_uk_t, dq[:, rows, :, :Dn])
        dq[:, rows, :, Dn:] = dql[..., Dc:]
        _add_products(dw_uk, q[:, rows, :, :Dn], dql[..., :Dc])
        _add_products(dw_uv, do, lat_rows)
    return dq, dkv.to(kv.dtype), torch.cat([dw_uk, dw_uv], 1).to(w.dtype)
