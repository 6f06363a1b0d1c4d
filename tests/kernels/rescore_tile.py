"""A second rescore for the tests: whole filter tiles against each row's gathered keys, one row kept.

``rescore.rescore_kernel`` takes a row's picks with its own MMA shape; this one computes the very
[BT, BS] score tile the filter computes (``score_tile``), so its values are select's bits by
construction, and the tests hold the fast kernel to them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyscale_compile.runtime.problem import Problem, cdiv
from hyscale_compile.runtime.rescore import canonical
from hyscale_compile.runtime.score_tile import block_rows, score_tile, tile_values


@triton.jit
def rescore_tile_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                        T, S, H, K, scale, fill,
                        sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                        ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                        HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Values at given positions: the row's block tile against the row's gathered keys, one row kept.

    The tile is the same [BT, BS] product the filter computes, so each kept value is bit-identical
    by construction; it does BT times the work of rescore_kernel.
    """
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2).to(tl.int64) * BS + tl.arange(0, BS)
    j_ok = j < K
    rows_t, row_ok, rid, lo, hi, blo, bhi = block_rows(pid_t, b, T, lo_ptr, hi_ptr, S, BT)
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


def rescore_by_tiles(q, kx, weights, indices, scale, relu, vis, fill) -> torch.Tensor:
    """``rescore.rescore``'s result (for k >= 1 picks a row) computed through whole filter tiles."""
    pb = Problem(q, kx, weights, scale, relu, vis, fill)
    K = indices.shape[-1]
    out = torch.empty(pb.B, pb.T, K, dtype=torch.float32, device=q.device)
    pb.launch(rescore_tile_kernel, (pb.n_tblk, pb.B, cdiv(K, pb.tile.bs)), pb.q, pb.kx, pb.wt, pb.lo, pb.hi,
              indices.to(torch.int64).contiguous(), out, pb.mask, pb.bias, pb.T, pb.S, pb.H, K, pb.scale, pb.fill)
    return out
