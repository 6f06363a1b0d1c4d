"""Indexer spellings as model authors write them (the forms the backend issue names), one module each.

Each factory returns (module, example_inputs). Sizes are tiny; inputs are fresh random data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

B, T, H, D, S, K = 2, 6, 4, 16, 9, 4


class GlmDsaIndexer(nn.Module):
    """HF GLM-MoE-DSA style: einsum bshd,btd->bsht, relu, einsum with head weights, masked_fill(~bool)."""

    def forward(self, q, k, w, mask):
        s = torch.einsum("bshd,btd->bsht", q, k)
        s = F.relu(s)
        s = torch.einsum("bsht,bsh->bst", s, w) * (q.shape[-1] ** -0.5)
        s = s.masked_fill(~mask, float("-inf"))
        return s.topk(min(K, s.shape[-1]), dim=-1).indices


class DeepseekV32Indexer(nn.Module):
    """HF DeepSeek-V3.2 style: bf16 inputs upcast, matmul with k^T, scale, F.relu, matmul with w, additive causal."""

    def forward(self, q, k, w):
        t, s_len = q.shape[1], k.shape[1]
        s = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * (q.shape[-1] ** -0.5)
        s = F.relu(s)
        s = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)
        s = s + torch.full((t, s_len), float("-inf")).triu(s_len - t + 1)
        values, indices = torch.topk(s, K, dim=-1)
        return values, indices


class WeightedSumIndexer(nn.Module):
    """einsum bthd,bsd->bths, (w[..., None] * relu(s)).sum(dim=2), torch.where with an arange causal mask."""

    def forward(self, q, k, w):
        t, s_len = q.shape[1], k.shape[1]
        s = torch.einsum("bthd,bsd->bths", q, k)
        s = (w[..., None] * torch.relu(s)).sum(dim=2)
        visible = torch.arange(s_len)[None, :] <= torch.arange(t)[:, None] + (s_len - t)
        s = torch.where(visible, s, float("-inf"))
        return s.topk(K, dim=-1, sorted=False)[1]


class ScaleFoldedIndexer(nn.Module):
    """Scale folded into the head weights, .relu() method, additive float mask from the caller."""

    def forward(self, q, k, w, bias):
        s = torch.einsum("bthd,bsd->bths", q, k).relu()
        s = (s * (w * D**-0.5)[..., None]).sum(2)
        s = s + bias
        return s.topk(K)


class ScaleAfterSumIndexer(nn.Module):
    """Scale after the head sum, values read back with gather, indices cast to int32."""

    def forward(self, q, k, w):
        s = torch.einsum("bthd,bsd->bths", q, k)
        s = torch.relu(s)
        s = torch.einsum("bths,bth->bts", s, w) / math.sqrt(D)
        idx = s.topk(K, dim=-1).indices
        return s.gather(-1, idx), idx.to(torch.int32)


class ScaleBeforeReluIndexer(nn.Module):
    """Scale before relu, no head weights, tril causal bool mask."""

    def forward(self, q, k):
        t, s_len = q.shape[1], k.shape[1]
        s = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * 0.125).sum(dim=2)
        keep = torch.ones(t, s_len, dtype=torch.bool).tril(s_len - t)
        s = s.masked_fill(keep.logical_not(), float("-inf"))
        return s.topk(K, dim=-1)


class EllipsisClampIndexer(nn.Module):
    """einsum with '...', F.relu(inplace=True) whose result is read through the mutated tensor, clamp(min=0)."""

    def forward(self, q, k, w):
        s = torch.einsum("...thd,...sd->...ths", q, k) * 0.25
        F.relu(s, inplace=True)  # the model keeps using ``s``, which the call mutated
        s = (s.clamp(min=0) * w[..., None]).sum(-2)
        return s.topk(K).indices


class PerGroupIndexer(nn.Module):
    """One selection per key group ([B, G, T, S] scores: two batch dims); the keys are shared by every group
    (einsum broadcasts them), the head weights and the padding mask are per group."""

    def forward(self, q, k, w, keep):
        t, s_len = q.shape[2], k.shape[1]
        s = torch.relu(torch.einsum("bgthd,bsd->bgths", q, k))
        s = torch.einsum("bgths,bgth->bgts", s, w)
        causal = torch.arange(s_len)[None, :] <= torch.arange(t)[:, None] + (s_len - t)
        s = s.masked_fill(~causal, float("-inf")).masked_fill(~keep[:, :, None, :], float("-inf"))
        return s.topk(K, dim=-1)


class Bf16TensorFillIndexer(nn.Module):
    """A bf16 model scoring in bf16 (no upcast), a detached score, torch.where with a 0-d tensor fill."""

    def forward(self, q, k, w, keep):
        s = (torch.relu(torch.einsum("bthd,bsd->bths", q, k)) * w[..., None].to(q.dtype)).sum(2).detach()
        s = torch.where(keep, s, torch.tensor(float("-inf"), dtype=s.dtype))
        return s.topk(K).indices


class DenseWarmupIndexer(nn.Module):
    """The full score row feeds a KL loss (dense warm-up): the table is needed, the site must stay."""

    def forward(self, q, k, w, target):
        s = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, k))).sum(dim=2)
        loss = F.kl_div(F.log_softmax(s, dim=-1), target, reduction="batchmean")
        return s.topk(K).indices, loss


class PerHeadReadIndexer(nn.Module):
    """The per-head scores are also returned: rewriting would lose them, the site must stay."""

    def forward(self, q, k, w):
        per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, k))
        s = (w[..., None] * per_head).sum(dim=2)
        return s.topk(K).indices, per_head.mean()


def _qkw(dtype=torch.float32):
    return (torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, S, D, dtype=dtype), torch.randn(B, T, H))


def _causal_bool():
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)


def glm_dsa():
    q, k, w = _qkw()
    return GlmDsaIndexer(), (q, k, w, _causal_bool())


def deepseek_v32():
    q, k, w = _qkw(torch.bfloat16)
    return DeepseekV32Indexer(), (q, k, w)


def weighted_sum():
    return WeightedSumIndexer(), _qkw()


def scale_folded():
    q, k, w = _qkw()
    bias = torch.zeros(B, T, S).masked_fill(torch.rand(B, T, S) < 0.3, float("-inf"))
    return ScaleFoldedIndexer(), (q, k, w, bias)


def scale_after_sum():
    return ScaleAfterSumIndexer(), _qkw()


def scale_before_relu():
    q, k, _ = _qkw()
    return ScaleBeforeReluIndexer(), (q, k)


def ellipsis_clamp():
    return EllipsisClampIndexer(), _qkw()


def per_group():
    G = 3
    q, w = torch.randn(B, G, T, H, D), torch.randn(B, G, T, H)
    keep = torch.rand(B, G, S) > 0.2
    return PerGroupIndexer(), (q, torch.randn(B, S, D), w, keep)


def bf16_tensor_fill():
    q, k, w = _qkw(torch.bfloat16)
    return Bf16TensorFillIndexer(), (q, k, w, torch.rand(T, S) > 0.3)


def dense_warmup():
    q, k, w = _qkw()
    return DenseWarmupIndexer(), (q, k, w, torch.softmax(torch.randn(B, T, S), -1))


def per_head_read():
    return PerHeadReadIndexer(), _qkw()


REWRITE = {
    "glm_dsa": glm_dsa,
    "deepseek_v32": deepseek_v32,
    "weighted_sum": weighted_sum,
    "scale_folded": scale_folded,
    "scale_after_sum": scale_after_sum,
    "scale_before_relu": scale_before_relu,
    "ellipsis_clamp": ellipsis_clamp,
    "per_group": per_group,
    "bf16_tensor_fill": bf16_tensor_fill,
}
REJECT = {
    "dense_warmup": dense_warmup,
    "per_head_read": per_head_read,
}
