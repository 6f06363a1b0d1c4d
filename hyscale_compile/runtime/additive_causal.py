"""The additive causal mask (``score + full(-inf).triu(1)``) as the kernels' additive bias, without a [T, S] tensor.

Under an additive mask a NaN or +inf score behind the causal limit is NaN, which ranks first: the keys
behind it cannot be skipped, so the kernels score every key and add the mask. Its value at (b, t, s)
depends on s - t only, so it is a Toeplitz view of one [B, T + S] row per batch, read with a negative
query stride (torch views cannot have one; the kernels take strides as numbers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .reference import Visibility


@dataclass(frozen=True)
class StridedBias:
    """An additive bias the kernels read at ``base + b * strides[0] + t * strides[1] + s * strides[2]``."""

    base: Tensor
    strides: tuple[int, int, int]


def as_bias(vis: Visibility, B: int, T: int, S: int, device: torch.device) -> Visibility:
    """``vis`` with its additive causal mask turned into a bias the kernels read (other visibility kept)."""
    if not (vis.causal and vis.causal_additive):
        return vis
    limit = torch.full((B if vis.offsets is not None else 1, 1), vis.offset, dtype=torch.int64, device=device)
    if vis.offsets is not None:
        limit = limit + vis.offsets.to(device=device, dtype=torch.int64).view(B, 1)
    # row[b, j] holds the mask at s - t = j - (T - 1): 0 where s - t <= limit[b], -inf behind it
    rel = torch.arange(T + S - 1, device=device, dtype=torch.int64).view(1, -1) - (T - 1)
    row = torch.where(rel <= limit, 0.0, float("-inf")).to(torch.float32).contiguous()
    width = row.shape[1]
    bias: Tensor | StridedBias = StridedBias(row.view(-1)[T - 1:], (width if row.shape[0] > 1 else 0, -1, 1))
    if vis.bias is not None:  # two additive terms: one dense tensor (rare: a bias beside the causal triangle)
        s_minus_t = torch.arange(S, device=device).view(1, 1, S) - torch.arange(T, device=device).view(1, T, 1)
        dense = torch.where(s_minus_t <= limit.view(-1, 1, 1), 0.0, float("-inf"))
        bias = (vis.bias.expand(B, T, S).float() + dense).contiguous()
    return dataclasses.replace(vis, causal=False, causal_additive=False, bias=bias)
