"""``indexer_topk``: the functional API, for people who call selection by hand (like ``flex_attention``)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops  # registers torch.ops.hyscale.*


def indexer_topk(q: Tensor, kx: Tensor, k: int, *, weights: Tensor | None = None, scale: float = 1.0,
                 relu: bool = True, query_offset: int | Tensor | None = None, starts: Tensor | None = None,
                 ends: Tensor | None = None, mask: Tensor | None = None, sorted: bool = True,
                 fill: float = float("-inf"), low_precision_grad: bool = False) -> tuple[Tensor, Tensor]:
    """Top-k keys per query of ``sum_h weights * relu(scale * q_h . kx)`` without writing the score table.

    q [B, T, H, D], kx [B, S, D] (bf16 / fp16 / fp32), weights [B, T, H] or None.
    query_offset: None = no causal mask; int or [B] tensor = key s is visible to query t iff s <= t + offset.
    starts / ends: [B, T] integer windows [start, end). mask: bool (True = visible) or additive float,
    broadcastable to [B, T, S]. Masked picks (rows with fewer than k visible keys) have value ``fill``.
    Returns (values fp32 [B, T, k], indices int64 [B, T, k]), ordered by value desc then position asc;
    with sorted=False the same entries per row in an unspecified order (on CUDA it may differ from run to
    run, as torch.topk promises no order; on CPU it is ascending position): use it only where the order
    cannot matter. Gradients of the values are fp32-exact; low_precision_grad=True rounds the score
    gradients to q's 16-bit dtype in the backward's matrix products (as flash-attention does), for models
    that score in 16-bit.
    """
    causal = query_offset is not None
    offset, offsets = 0, None
    if isinstance(query_offset, Tensor):
        offsets = query_offset.reshape(-1).to(torch.int64)
    elif query_offset is not None:
        offset = int(query_offset)
    bool_mask, bias = None, None
    if mask is not None:
        if mask.dtype == torch.bool:
            bool_mask = mask
        elif mask.is_floating_point():
            bias = mask
        else:
            raise TypeError(f"indexer_topk: mask must be bool or floating point, got {mask.dtype}")
    args = (q, kx, weights, k, float(scale), relu, causal, offset, offsets, starts, ends, bool_mask, bias,
            float(fill), sorted)
    if not torch.compiler.is_compiling() and ops.dispatch_adds_nothing(q, kx, weights, offsets, starts, ends,
                                                                       bool_mask, bias):
        return ops.select_body(*args, low_precision_grad=low_precision_grad)  # what the op would run, no more
    return torch.ops.hyscale.select(*args, low_precision_grad=low_precision_grad)
