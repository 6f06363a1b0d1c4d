"""Plain-PyTorch reference of the indexer selection operators.

This file *is* the operator contract (docs/design.md, section 3) written as code:

    score[b, t, s] = sum_h w[b, t, h] * act(scale * dot(q[b, t, h, :], kx[b, s, :]))   (fp32)
                   = sum_h (scale * w[b, t, h]) * act'(dot(...))   as it is evaluated: one rounding
                     per head, act' = max(., 0) for a ReLU with scale >= 0, min(., 0) below 0
    value[b, t, s] = score[b, t, s] + bias[b, t, s] (+ causal[t, s])   if visible(b, t, s) else fill
                     causal[t, s] = -inf where s > t + offset, else 0: the additive causal mask (the
                     model's ``score + full(-inf).triu(1)``), where NaN and +inf scores become NaN
    select -> the k largest values of each row, ordered by (value desc, position asc),
              NaN ranking above +inf as torch.topk ranks it, -0.0 equal to +0.0.

It never holds more than one block of query rows of the score table at a time, so it runs at
sizes the dense eager indexer cannot. It is what runs on CPU and what the Triton kernels are
tested against. Everything here is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Upper bound on the fp32 elements of one [B, rows, H, S] block of pre-head-sum scores.
_BLOCK_ELEMS = 1 << 24


@dataclass(frozen=True)
class Visibility:
    """Which keys a query may select. All parts combine with AND.

    causal:  key s visible to query t iff s <= t + offset (+ offsets[b] when given)
    starts/ends: [B, T] integer windows [start, end)
    mask:    bool tensor broadcastable to [B, T, S], True = visible
    bias:    float tensor broadcastable to [B, T, S], added to the score (additive mask)
    causal_additive: the causal part is added as -inf instead of replacing values with the fill (IEEE:
             a NaN or +inf score behind it is NaN, as ``score + full(-inf).triu(1)`` gives in eager)
    """

    causal: bool = False
    offset: int = 0
    offsets: Tensor | None = None
    starts: Tensor | None = None
    ends: Tensor | None = None
    mask: Tensor | None = None
    bias: Tensor | None = None
    causal_additive: bool = False

    def at(self, t0: int, t1: int, pos: Tensor, shape: tuple[int, int, int]) -> Tensor | None:
        """Bool visibility of key positions ``pos`` (broadcastable to [B, t1-t0, n]) for rows t0:t1.

        ``shape`` is the full (B, T, S) of the problem, used to broadcast the mask tensor.
        Returns None when everything is visible. The additive causal mask hides nothing here (its -inf is
        part of the value, see ``additive_at``).
        """
        B, T, S = shape
        vis = None

        def _and(a: Tensor | None, b: Tensor) -> Tensor:
            return b if a is None else a & b

        if self.causal and not self.causal_additive:
            vis = _and(vis, self._causal_at(t0, t1, pos))
        if self.starts is not None:
            vis = _and(vis, pos >= self.starts[:, t0:t1, None].to(torch.int64))
        if self.ends is not None:
            vis = _and(vis, pos < self.ends[:, t0:t1, None].to(torch.int64))
        if self.mask is not None:
            m = self.mask.expand(B, T, S)[:, t0:t1]
            vis = _and(vis, _take(m, pos))
        return vis

    def _causal_at(self, t0: int, t1: int, pos: Tensor) -> Tensor:
        t = torch.arange(t0, t1, device=pos.device, dtype=torch.int64).view(1, -1, 1) + self.offset
        if self.offsets is not None:
            t = t + self.offsets.to(device=pos.device, dtype=torch.int64).view(-1, 1, 1)
        return pos <= t

    def additive_at(self, t0: int, t1: int, pos: Tensor) -> Tensor | None:
        """The additive causal mask at ``pos`` for rows t0:t1: 0 where visible, -inf behind, or None."""
        if not (self.causal and self.causal_additive):
            return None
        visible = self._causal_at(t0, t1, pos)
        return torch.where(visible, 0.0, float("-inf")).to(torch.float32)

    def bias_at(self, t0: int, t1: int, pos: Tensor, shape: tuple[int, int, int]) -> Tensor | None:
        if self.bias is None:
            return None
        B, T, S = shape
        return _take(self.bias.expand(B, T, S)[:, t0:t1], pos).float()


def _take(table_rows: Tensor, pos: Tensor) -> Tensor:
    """table_rows[b, t, pos[b, t, j]] with pos either a full arange row or per-row indices."""
    if pos.dim() == 3 and pos.shape[0] == 1 and pos.shape[1] == 1 and pos.shape[2] == table_rows.shape[2]:
        return table_rows
    return table_rows.gather(-1, pos.expand(table_rows.shape[0], table_rows.shape[1], pos.shape[-1]))


def order_key(values: Tensor) -> Tensor:
    """An int64 key whose order is torch.topk's order of fp32 values (NaN highest, -0.0 == +0.0)."""
    v = values.float() + 0.0  # -0.0 + 0.0 == +0.0
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")).abs(), v)
    bits = v.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _rows_per_block(B: int, H: int, S: int) -> int:
    return max(1, _BLOCK_ELEMS // max(1, B * H * S))


def score_rows(q: Tensor, kx: Tensor, weights: Tensor | None, scale: float, relu: bool, t0: int, t1: int) -> Tensor:
    """fp32 scores of query rows t0:t1 against every key: [B, t1-t0, S]."""
    qb = q[:, t0:t1].float()
    dots = torch.einsum("bthd,bsd->bths", qb, kx.float())
    if relu:  # scale folded into the weights: scale * min(x, 0) == relu(scale * x) for scale < 0
        dots = dots.clamp(max=0.0) if scale < 0 else torch.relu(dots)
    wt = scale if weights is None else weights[:, t0:t1, :, None].float() * scale
    return (dots * wt).sum(dim=2)


def value_rows(q, kx, weights, scale, relu, vis: Visibility, fill: float, t0: int, t1: int) -> Tensor:
    """Scores after bias and masking for rows t0:t1: [B, t1-t0, S] fp32."""
    B, T = q.shape[0], q.shape[1]
    S = kx.shape[1]
    val = score_rows(q, kx, weights, scale, relu, t0, t1)
    pos = torch.arange(S, device=q.device).view(1, 1, S)
    bias = vis.bias_at(t0, t1, pos, (B, T, S))
    if bias is not None:
        val = val + bias
    additive = vis.additive_at(t0, t1, pos)
    if additive is not None:
        val = val + additive
    visible = vis.at(t0, t1, pos, (B, T, S))
    if visible is not None:
        val = torch.where(visible, val, torch.full_like(val, fill))
    return val


def topk_rows(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k by (value desc, position asc); a stable descending sort keeps positions ascending."""
    idx = torch.sort(order_key(values), dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, idx), idx


def select(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, scale: float, relu: bool,
           vis: Visibility, fill: float, sorted: bool = True) -> tuple[Tensor, Tensor]:
    """Exact top-k per query row, ordered by (value desc, position asc).

    sorted=False returns the same entries per row in ascending position order: as the contract allows
    (any deterministic order), and unlike the sorted one, so that code which wrongly relies on the
    order of an unsorted selection fails on the CPU too, not only with the kernels' order.
    """
    B, T, H, _ = q.shape
    S = kx.shape[1]
    values = torch.empty(B, T, k, dtype=torch.float32, device=q.device)
    indices = torch.empty(B, T, k, dtype=torch.int64, device=q.device)
    step = _rows_per_block(B, H, S)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        v, i = topk_rows(value_rows(q, kx, weights, scale, relu, vis, fill, t0, t1), k)
        if not sorted:
            i, order = i.sort(dim=-1)
            v = v.gather(-1, order)
        values[:, t0:t1] = v
        indices[:, t0:t1] = i
    return values, indices


def rescore(q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor, scale: float, relu: bool,
            vis: Visibility, fill: float) -> Tensor:
    """Values at the given positions, bit-identical to what ``select`` returns for them."""
    B, T, H, _ = q.shape
    S = kx.shape[1]
    out = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
    step = _rows_per_block(B, H, S)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        out[:, t0:t1] = value_rows(q, kx, weights, scale, relu, vis, fill, t0, t1).gather(-1, indices[:, t0:t1])
    return out


def sparse_backward(grad_values: Tensor, q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor,
                    scale: float, relu: bool, vis: Visibility, deterministic: bool = False,
                    low_precision: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Gradients of sum(grad_values * values) w.r.t. q, kx, weights, touching only the selected keys.

    Masked picks carry a constant (the fill), so they get no gradient. dkx is accumulated with
    index_add_, deterministic on CPU whatever ``deterministic`` asks, and everything is fp32 whatever
    ``low_precision`` asks (both are there for the kernels' interface: the Triton backward may use float
    atomics unless deterministic, and 16-bit score gradients where low_precision).
    """
    B, T, H, D = q.shape
    S = kx.shape[1]
    k = indices.shape[-1]
    dq = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device)
    dkx = torch.zeros(B * S, D, dtype=torch.float32, device=q.device)
    dw = None if weights is None else torch.zeros(B, T, H, dtype=torch.float32, device=q.device)
    kxf = kx.float()
    step = max(1, _BLOCK_ELEMS // max(1, B * k * max(H, D)))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        idx = indices[:, t0:t1]
        g = grad_values[:, t0:t1].float()
        visible = vis.at(t0, t1, idx, (B, T, S))
        if visible is not None:
            g = torch.where(visible, g, torch.zeros_like(g))
        kg = kxf.gather(1, idx.reshape(B, -1, 1).expand(B, idx.shape[1] * k, D)).view(B, t1 - t0, k, D)
        qb = q[:, t0:t1].float()
        pre = torch.einsum("bthd,btkd->bthk", qb, kg) * scale
        act = torch.relu(pre) if relu else pre
        gw = g[:, :, None, :]  # [B, rows, 1, k]
        if weights is not None:
            wb = weights[:, t0:t1].float()
            dw[:, t0:t1] = (gw * act).sum(-1)
            gpre = gw * wb[..., None]
        else:
            gpre = gw.expand(B, t1 - t0, H, k)
        gpre = gpre * scale
        if relu:
            gpre = torch.where(pre > 0, gpre, torch.zeros_like(gpre))
        dq[:, t0:t1] = torch.einsum("bthk,btkd->bthd", gpre, kg)
        contrib = torch.einsum("bthk,bthd->btkd", gpre, qb).reshape(-1, D)
        flat = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * S).reshape(-1)
        dkx.index_add_(0, flat, contrib)
    return (dq.to(q.dtype), dkx.view(B, S, D).to(kx.dtype),
            None if dw is None else dw.to(weights.dtype))
