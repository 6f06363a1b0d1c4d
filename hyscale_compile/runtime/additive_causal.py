"""The additive causal mask (``score + full(-inf).triu(1)``) as the kernels' additive bias, without a [T, S] tensor.

Under an additive mask a NaN or +inf score behind the causal limit is NaN, which ranks first. Its value at
(b, t, s) depends on s - t only, so it is a Toeplitz view of one [B, T + S] row per batch, read with a
negative query stride (torch views cannot have one; the kernels take strides as numbers).

Keys behind the limit need scoring only in a row where a score can be NaN or +inf at all. A bound decides
that on the device, per row, without a sync: |score| <= sum_h |scale * w_h| * |q_h|_1 * max |kx| (float32
partial sums stay within a factor 1 + D * eps of it), so a row whose bound is finite and far below
float32's largest value scores only up to its limit (behind it every value is score + -inf = -inf, the
fill), and any other row scores every key with the mask added. With a finite fill (the row's out-of-range
keys would carry it, not -inf) every row scores every key.
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


_SAFE_BOUND = 1e37  # far below float32's largest value (3.4e38): no partial sum can overflow


def as_bias(vis: Visibility, q: Tensor, kx: Tensor, weights: Tensor | None, scale: float, fill: float) -> Visibility:
    """``vis`` with its additive causal mask turned into a bias the kernels read and, where the fill is -inf,
    per-row ends: the causal limit in a row that cannot hold a non-finite score, S in any other."""
    if not (vis.causal and vis.causal_additive):
        return vis
    B, T, S, device = q.shape[0], q.shape[1], kx.shape[1], q.device
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
    ends = vis.ends
    if fill == float("-inf") and vis.bias is None:
        lim = torch.arange(T, device=device, dtype=torch.int64).view(1, T) + limit + 1  # [B or 1, T]
        finite = _finite_rows(q, kx, weights, scale)
        rows = torch.where(finite, lim, S).expand(B, T)
        ends = rows if ends is None else torch.minimum(ends.to(device=device, dtype=torch.int64), rows)
    return dataclasses.replace(vis, causal=False, causal_additive=False, bias=bias, ends=ends)


def _finite_rows(q: Tensor, kx: Tensor, weights: Tensor | None, scale: float) -> Tensor:
    """[B, T] bool: no score of the row can be NaN or +inf (false for a NaN or inf input anywhere in it)."""
    kmax = kx.float().abs().amax(dim=(1, 2))  # [B]; NaN or inf propagate
    heads = q.float().abs().sum(-1)  # [B, T, H]
    w = abs(scale) if weights is None else weights.float().abs() * abs(scale)
    bound = (heads * w).sum(-1) * kmax.view(-1, 1)
    return bound < _SAFE_BOUND
