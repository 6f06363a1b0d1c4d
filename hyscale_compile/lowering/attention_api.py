"""``sparse_attention``: attention over each query's selected keys, by hand (as ``indexer_topk`` selects them)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import attention  # noqa: F401  (registers torch.ops.hyscale.sparse_attention)


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, scale: float | None = None,
                     query_offset: int | Tensor | None = None, key_mask: Tensor | None = None, empty: str = "zero",
                     return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Each query attends to the keys ``indices`` selects for it, not to all S.

    q [B, T, H, Dqk], k [B, S, G, Dqk], v [B, S, G, Dv] (bf16 / fp16 / fp32; H a multiple of G, head h
    reading kv group h // (H // G); for the MLA latent form pass G = 1 and v = k[..., :Dv], a view: each
    gathered row is then read once; ``sparse_attention_latent`` takes that layout's kv once and has the cheaper
    backward). indices [B, T, K] int32/int64, distinct within a row; picks that
    are negative, >= S, or not visible are dropped.
    scale: None = 1 / sqrt(Dqk). query_offset: None = no causal mask; int or [B] tensor = key s is
    visible to query t iff s <= t + offset. key_mask: [B, S] bool, True = visible.
    empty: what a row with no kept pick gives: "zero" (SDPA under a boolean mask) or "mean" (the mean
    of v over all S keys, as eager softmax over finfo.min-filled scores).
    Returns out [B, T, H, Dv] in q's dtype, and with return_lse also lse [B, T, H] fp32 (-inf for empty rows).
    """
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    offsets = query_offset.reshape(-1) if isinstance(query_offset, Tensor) else None
    offset = 0 if query_offset is None or offsets is not None else int(query_offset)
    out, lse = torch.ops.hyscale.sparse_attention(q, k, v, indices, float(scale), query_offset is not None, offset,
                                                  offsets, key_mask, empty)
    return (out, lse) if return_lse else out


def sparse_attention_latent(q: Tensor, kv: Tensor, indices: Tensor, *, value_dim: int, scale: float | None = None,
                            query_offset: int | Tensor | None = None, key_mask: Tensor | None = None,
                            empty: str = "zero", return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``sparse_attention(q, kv, kv[..., :value_dim], indices, ...)`` in the MLA latent layout, kv taken once.

    kv [B, S, G, Dqk] (G = 1 in MLA: the latent c and the rope key, 512 + 64); the value of key s is
    kv[b, s, g, :value_dim]. Same values and the same total gradient of kv as the call with the view; the
    backward returns kv's gradient whole (dk with dv added into its first value_dim columns), which lets it
    sum dk and dv per pick (a cheaper backward). There is no v to take a gradient with respect to: where that
    is needed, call ``sparse_attention`` with the view. Other arguments as ``sparse_attention``.
    """
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    offsets = query_offset.reshape(-1) if isinstance(query_offset, Tensor) else None
    offset = 0 if query_offset is None or offsets is not None else int(query_offset)
    out, lse = torch.ops.hyscale.sparse_attention_latent(q, kv, indices, int(value_dim), float(scale),
                                                         query_offset is not None, offset, offsets, key_mask, empty)
    return (out, lse) if return_lse else out
