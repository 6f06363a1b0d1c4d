"""Indexer -> top-k spellings found in the wild, one small module each, written the way their authors write them.

Each class docstring says where the spelling comes from. ``SPELLINGS`` maps a name to ``factory(seed)``, which
returns ``(module, example_inputs, expected)``: ``example_inputs`` is a tuple of positional arguments,
``expected`` is ``"rewrite"`` (every selection site of the module is the indexer form and must be rewritten)
or ``"reject"`` (the site must be left alone, with a reason). A module with several sites says so in its class
attribute ``SITES`` (default 1). Inputs are deterministic for a given seed.

Sizes are tiny: batch 2, 12 queries, 12 keys (queries are the keys' own positions unless a docstring says
otherwise), 8 indexer heads of dim 16, k = 6, so causal rows 0..4 see fewer than k keys and pad. Eight heads make
exact ReLU-zero ties (a key negative in every head scores exactly 0) rare: 1 key in 256.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

B, T, S, H, D, K = 2, 12, 12, 8, 16, 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _qkw(seed: int, dtype=torch.float32):
    """Batch-first q [B,T,H,D], keys [B,S,D], head weights [B,T,H]."""
    gen = _gen(seed)
    return _randn(gen, B, T, H, D, dtype=dtype), _randn(gen, B, S, D, dtype=dtype), _randn(gen, B, T, H)


def _causal_additive(t: int = T, s: int = S) -> torch.Tensor:
    """[t, s] float mask, 0 where key s is visible to query t (queries are the last t of s keys), -inf elsewhere."""
    return torch.full((t, s), float("-inf")).triu(s - t + 1)


# --------------------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------------------


class MegatronSequenceFirst(nn.Module):
    """Megatron-LM DSA ``_compute_index_scores`` (experimental_attention_variant/dsa.py): sequence-first tensors
    q [sq, b, h, d], k [sk, b, d], weights [sq, b, h]; ``einsum("sbhd,tbd->sbht")`` on fp32 copies, ``torch.relu``,
    ``* weights.unsqueeze(-1)``, ``.sum(dim=2)``, ``.transpose(0, 1)`` to [b, sq, sk]; then the caller adds the
    [sq, sk] additive causal mask and takes ``topk(...)[1]``."""

    def forward(self, q, k, weights, mask):
        index_scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
        index_scores = torch.relu(index_scores)
        index_scores = index_scores * weights.unsqueeze(-1)
        index_scores = index_scores.sum(dim=2)
        index_scores = index_scores.transpose(0, 1)  # [b, sq, sk]
        index_scores = index_scores + mask.unsqueeze(0)
        topk_k = min(K, index_scores.shape[-1])
        return index_scores.topk(topk_k, dim=-1)[1]


class MegatronChunkInplace(nn.Module):
    """Megatron-LM DSA dense top-k over a query chunk (``_dense_qk_topk_for_chunk``): the same sequence-first
    einsum, but with in-place ``torch.relu_``, ``scores.mul_(weights.unsqueeze(-1).float())`` and
    ``masked_fill_(k_pos > q_pos, -inf)`` from ``arange(...).view`` positions (the chunk starts at ``q_start``),
    ``topk(..., sorted=False).indices.to(torch.int32)``."""

    def __init__(self, q_start: int):
        super().__init__()
        self.q_start = q_start

    def forward(self, q, k, weights):
        sq, sk = q.shape[0], k.shape[0]
        topk_k = min(K, sk)
        scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
        scores = torch.relu_(scores)
        scores.mul_(weights.unsqueeze(-1).float())
        scores = scores.sum(dim=2).transpose(0, 1)
        q_pos = torch.arange(self.q_start, self.q_start + sq, device=q.device).view(1, sq, 1)
        k_pos = torch.arange(sk, device=q.device).view(1, 1, sk)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        return scores.topk(topk_k, dim=-1, sorted=False).indices.to(torch.int32)


class DeepGemmRaggedWindows(nn.Module):
    """DeepGEMM's torch reference for ``fp8_mqa_logits`` (tests/test_attention.py, copied into vLLM, SGLang,
    TensorRT-LLM): ragged/packed layout q [m, h, d], k [n, d], weights [m, h], per-row key windows
    ``[cu_seqlen_ks, cu_seqlen_ke)``; ``einsum("mhd,nd->hmn")`` (head-first), ``(score.relu() *
    weights.unsqueeze(-1).transpose(0, 1)).sum(dim=0)``, ``masked_fill(~(mask_lo & mask_hi), -inf)`` with the
    masks from ``arange(0, n)[None, :] >= ks[:, None]`` and ``< ke[:, None]``. The engines then call
    ``torch.topk(logits, min(k, n), dim=-1)``. The mask is a row window: the pass should use the window kind."""

    def forward(self, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke):
        seq_len_kv = kv.shape[0]
        q = q.float()
        k = kv.float()
        mask_lo = torch.arange(0, seq_len_kv, device=q.device)[None, :] >= cu_seqlen_ks[:, None]
        mask_hi = torch.arange(0, seq_len_kv, device=q.device)[None, :] < cu_seqlen_ke[:, None]
        mask = mask_lo & mask_hi
        score = torch.einsum("mhd,nd->hmn", q, k)
        logits = (score.relu() * weights.unsqueeze(-1).transpose(0, 1)).sum(dim=0)
        logits = logits.masked_fill(~mask, float("-inf"))
        return torch.topk(logits, min(K, seq_len_kv), dim=-1).indices


class VllmKeyScaleRagged(nn.Module):
    """vLLM's CUDA fallback ``fp8_mqa_logits_torch`` (and the ROCm copy of DeepGEMM's reference): like DeepGEMM's
    reference, but the per-key fp8 dequantisation scale multiplies the head-first scores before the ReLU,
    ``torch.einsum("mhd,nd->hmn", q, k).float() * scale.reshape(-1)``. A per-key factor inside the ReLU folds into
    the keys (relu(s_n * q.k_n) = relu(q.(s_n k_n)) for any sign of s_n), so this is still the indexer form."""

    def forward(self, q, kv, scale, weights, cu_seqlen_ks, cu_seqlen_ke):
        seq_len_kv = kv.shape[0]
        mask_lo = torch.arange(0, seq_len_kv, device=q.device)[None, :] >= cu_seqlen_ks[:, None]
        mask_hi = torch.arange(0, seq_len_kv, device=q.device)[None, :] < cu_seqlen_ke[:, None]
        mask = mask_lo & mask_hi
        score = torch.einsum("mhd,nd->hmn", q, kv).float() * scale.reshape(-1)
        logits = (score.relu() * weights.unsqueeze(-1).transpose(0, 1)).sum(dim=0)
        logits = logits.masked_fill(~mask, float("-inf"))
        topk_k = min(K, logits.shape[-1])
        return logits.topk(topk_k, dim=-1)


class MegatronThdMinusOne(nn.Module):
    """Megatron-LM / SGLang packed (THD) indexer: ``einsum("qhd,kd->qhk")``, ``torch.relu(logits) *
    index_w.float().unsqueeze(-1)``, ``.sum(dim=1)``, row windows from ``key_pos >= starts`` and ``< ends``, then
    ``topk_idx.to(torch.int32).masked_fill(topk_scores == float("-inf"), -1)``: slots of rows with fewer than k
    visible keys become -1. The remap stays in the graph; it stays correct only if padded slots carry -inf."""

    def forward(self, index_q, index_k, index_w, starts, ends):
        logits = torch.einsum("qhd,kd->qhk", index_q.float(), index_k.float())
        logits = torch.relu(logits) * index_w.float().unsqueeze(-1)
        logits = logits.sum(dim=1)  # [sq, sk]
        key_pos = torch.arange(index_k.size(0), dtype=torch.int64, device=logits.device)
        valid = (key_pos.unsqueeze(0) >= starts.to(torch.int64).unsqueeze(-1)) & (
            key_pos.unsqueeze(0) < ends.to(torch.int64).unsqueeze(-1)
        )
        logits = logits.masked_fill(~valid, float("-inf"))
        topk_k = min(K, logits.size(-1))
        topk_scores, topk_idx = torch.topk(logits, topk_k, dim=-1)
        topk_idx = topk_idx.to(torch.int32)
        topk_idx = topk_idx.masked_fill(topk_scores == float("-inf"), -1)
        return topk_scores, topk_idx


# --------------------------------------------------------------------------------------------------------------
# Head weights, ReLU, scale
# --------------------------------------------------------------------------------------------------------------


class NoHeadWeights(nn.Module):
    """Indexers without a learned head gate (e.g. ablations and small re-implementations of DSA): the heads are
    summed with a plain ``.sum(-2)`` over [B, T, H, S]; causal ``masked_fill`` from ``tril``."""

    def forward(self, q, k):
        scores = torch.matmul(q, k.transpose(-1, -2).unsqueeze(1))  # [B, T, H, S]
        scores = F.relu(scores).sum(-2)
        causal = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return scores.topk(K, dim=-1).indices


class NoRelu(nn.Module):
    """Megatron-LM ``_compute_index_scores(..., use_relu=False)``: the ReLU is a configuration switch, and without
    it the indexer is a plain head-weighted dot product (batch-first here, ``einsum("bthd,bsd->bths")``)."""

    def __init__(self, use_relu: bool = False):
        super().__init__()
        self.use_relu = use_relu

    def forward(self, q, k, weights, mask):
        index_scores = torch.einsum("bthd,bsd->bths", q.float(), k.float())
        if self.use_relu:
            index_scores = torch.relu(index_scores)
        index_scores = (index_scores * weights.unsqueeze(-1)).sum(dim=2)
        index_scores = index_scores + mask
        return index_scores.topk(K, dim=-1).indices


class ScaleDivSqrt(nn.Module):
    """Scale written as ``/ math.sqrt(head_dim)`` right after the q.k product (the attention-textbook spelling,
    common in from-scratch DSA implementations), ``F.relu``, weighted head sum with ``torch.einsum("bths,bth->bts")``,
    bool causal mask through ``torch.where``."""

    def forward(self, q, k, weights):
        t, s = q.shape[1], k.shape[1]
        scores = torch.einsum("bthd,bsd->bths", q, k) / math.sqrt(q.shape[-1])
        scores = torch.einsum("bths,bth->bts", F.relu(scores), weights)
        visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        scores = torch.where(visible, scores, float("-inf"))
        return scores.topk(K, dim=-1).indices


class SumDtypeFloat32(nn.Module):
    """bf16 activations, fp32 reduction requested through ``.sum(dim=2, dtype=torch.float32)`` instead of
    ``.float()`` casts (the pattern of bf16 training code that avoids materialising fp32 copies); the per-head
    product stays bf16, only the head sum accumulates in fp32."""

    def forward(self, q, k, weights, mask):
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q, k))
        index_scores = (scores * weights.to(scores.dtype).unsqueeze(-1)).sum(dim=2, dtype=torch.float32)
        index_scores = index_scores.masked_fill(~mask, float("-inf"))
        return index_scores.topk(K, dim=-1).indices


class ScaleOutsideRelu(nn.Module):
    """HF transformers ``DeepseekV4IndexerScorer``: ``F.relu(scores) * self.softmax_scale`` (scale after the
    ReLU), ``weights_proj(...).float() * self.weights_scaling``, ``(scores * weights.unsqueeze(-1)).sum(dim=2)``."""

    def __init__(self):
        super().__init__()
        self.softmax_scale = D**-0.5
        self.weights_scaling = H**-0.5

    def forward(self, q, compressed_kv, weights, mask):
        scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1))  # [B, S, H, T]
        scores = F.relu(scores) * self.softmax_scale
        weights = weights.float() * self.weights_scaling
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        index_scores = index_scores.masked_fill(~mask, float("-inf"))
        return index_scores.topk(min(K, index_scores.shape[-1]), dim=-1).indices


class ScaleInsideRelu(nn.Module):
    """HF transformers ``Glm5NextTextIndexer``: ``F.relu(scores * self.softmax_scale)`` (scale inside the ReLU),
    then the DeepSeek-V3.2 ``matmul(weights.unsqueeze(-2), scores).squeeze(-2)`` head sum."""

    def __init__(self):
        super().__init__()
        self.softmax_scale = D**-0.5
        self.n_heads = H

    def forward(self, q, k, weights, mask):
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.softmax_scale)
        weights = weights.float() * (self.n_heads**-0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        index_scores = index_scores.masked_fill(~mask, float("-inf"))
        return index_scores.topk(K, dim=-1).indices


class ScaleFoldedIntoWeights(nn.Module):
    """DeepSeek-V3.2-Exp reference inference code (``inference/model.py``, ``Indexer.forward``): both scales go
    into the head weights, ``weights = self.weights_proj(x.float()) * self.n_heads ** -0.5`` then
    ``weights.unsqueeze(-1) * ... * self.softmax_scale``; the scoring itself is an unscaled ReLU dot product
    (written in plain PyTorch here instead of the fp8 kernel), the mask is added, ``topk(...)[1]``."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.softmax_scale = H, D**-0.5
        self.weights_proj = nn.Linear(H * D, H, bias=False)

    def forward(self, x, q, k, mask):
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5
        weights = weights.unsqueeze(-1) * self.softmax_scale  # [B, T, H, 1]
        index_score = (torch.relu(torch.einsum("bthd,bsd->bths", q, k)) * weights).sum(dim=2)
        index_score += mask
        return index_score.topk(min(K, k.shape[1]), dim=-1)[1]


class ScaleOnQueryPerPosition(nn.Module):
    """DeepSeek-V3.2 fp8 indexer semantics written out in PyTorch (DeepSeek's ``act_quant`` + ``fp8_index``; the
    quantised paths of SGLang/vLLM): q is quantised per (token, head) with ``q_scale = amax / 448``, the product is
    dequantised by multiplying the scores with ``q_scale[..., None]`` *before* the ReLU. The per-position factor is
    positive (a clamped amax) and folds into q."""

    def forward(self, q, k, weights, mask):
        q_scale = q.abs().amax(dim=-1).clamp(min=1e-4) / 448.0  # [B, T, H]
        q_quant = q / q_scale.unsqueeze(-1)
        scores = torch.einsum("bthd,bsd->bths", q_quant, k) * q_scale.unsqueeze(-1)
        scores = F.relu(scores) * (weights * D**-0.5).unsqueeze(-1)
        index_scores = scores.sum(dim=2) + mask
        return index_scores.topk(K, dim=-1).indices


# --------------------------------------------------------------------------------------------------------------
# Mask fill values, remaps, compressed keys
# --------------------------------------------------------------------------------------------------------------


class FinfoMinFill(nn.Module):
    """Mask fill ``torch.finfo(dtype).min`` instead of -inf (HF ``Glm5NextTextIndexer``'s
    ``masked_fill(~valid_candidates, torch.finfo(index_scores.dtype).min)``; HF eager attention masks are
    ``finfo.min`` additive masks too). Both outputs are returned: the values of padded slots must be exactly
    ``finfo(float32).min``, as eager computes them."""

    def forward(self, q, k, weights, mask):
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D**-0.5
        index_scores = torch.matmul(weights.unsqueeze(-2), F.relu(scores)).squeeze(-2)
        index_scores = index_scores.masked_fill(~mask, torch.finfo(index_scores.dtype).min)
        values, indices = index_scores.topk(K, dim=-1)
        return values, indices


class DeepseekV4CompressedKeys(nn.Module):
    """HF transformers ``DeepseekV4Indexer`` (CSA): the keys are compressed windows of ``ratio`` tokens (here the
    mean of each window; HF uses a gated softmax pool), ``future_mask = entry_indices.view(1, 1, -1) >=
    causal_threshold.unsqueeze(-1)`` with ``causal_threshold = (position_ids + 1) // ratio``, ``masked_fill(-inf)``,
    ``topk(min(index_topk, compressed_len))``, then picks at or past the threshold become -1 with
    ``torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)``."""

    ratio, index_topk = 2, 4

    def forward(self, q, kv, weights, position_ids):
        batch, seq_len, _ = kv.shape
        compressed_kv = kv.view(batch, seq_len // self.ratio, self.ratio, -1).mean(dim=2)  # [B, S // r, D]
        scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1))  # [B, T, H, S // r]
        scores = F.relu(scores) * D**-0.5
        index_scores = (scores * (weights.float() * H**-0.5).unsqueeze(-1)).sum(dim=2)
        compressed_len = compressed_kv.shape[1]
        top_k = min(self.index_topk, compressed_len)
        causal_threshold = (position_ids + 1) // self.ratio  # [B, T]
        entry_indices = torch.arange(compressed_len, device=index_scores.device)
        future_mask = entry_indices.view(1, 1, -1) >= causal_threshold.unsqueeze(-1)
        index_scores = index_scores.masked_fill(future_mask, float("-inf"))
        top_k_indices = index_scores.topk(top_k, dim=-1).indices
        invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
        return torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)


class PooledKeysOffsetRemap(nn.Module):
    """DeepSeek-V4 CSA as training frameworks write it (Megatron-LM csa.py style): keys pooled by ``ratio`` with
    ``view(...).mean``, visibility ``arange(S // r)[None, :] < ((t + 1) // r)[:, None]`` built in the graph, and
    the selected compressed positions remapped into the concatenated [window keys | compressed keys] layout of
    the sparse attention with ``torch.where(idx >= limit, -1, idx + offset)``."""

    ratio, window = 3, 4

    def forward(self, q, k, weights):
        t, s = q.shape[1], k.shape[1]
        pooled = k.unflatten(1, (s // self.ratio, self.ratio)).mean(dim=2)  # [B, S // r, D]
        scores = torch.einsum("bthd,bsd->bths", q, pooled).relu()
        scores = (scores * weights[..., None]).sum(2)
        limit = (torch.arange(t) + 1) // self.ratio  # compressed entries complete for each query
        visible = torch.arange(s // self.ratio)[None, :] < limit[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        idx = scores.topk(min(K - 3, s // self.ratio), dim=-1).indices
        return torch.where(idx >= limit[:, None], -1, idx + self.window)


class Glm5NextKPool(nn.Module):
    """HF transformers ``Glm5NextTextIndexer`` (k-pool): scores against pooled keys, ``F.relu(scores * scale)``,
    head sum by matmul, ``masked_fill(~valid_candidates, torch.finfo(dtype).min)``, ``topk(select_k).indices``,
    then the *mask* (not the scores) is gathered at the selection, ``valid_candidates.gather(-1, selected)``, the
    pools are mapped back to token indices with ``pool_indices[batch_idx, selected]``, ``flatten(-2)`` and invalid
    slots become -1."""

    kpool = 2

    def forward(self, q, k, weights, mask):
        batch, seq_len = k.shape[:2]
        n_pools = seq_len // self.kpool
        pool_keys = k.view(batch, n_pools, self.kpool, -1).mean(dim=2)
        pool_indices = torch.arange(seq_len).view(1, n_pools, self.kpool).expand(batch, -1, -1)
        scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * D**-0.5)
        weights = weights.float() * (H**-0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        pool_end = pool_indices[..., -1]
        valid_candidates = mask.gather(-1, pool_end[:, None, :].expand(batch, q.shape[1], -1))
        index_scores = index_scores.masked_fill(~valid_candidates, torch.finfo(index_scores.dtype).min)
        select_k = min(K // self.kpool, index_scores.shape[-1])
        selected = index_scores.topk(select_k, dim=-1).indices
        batch_idx = torch.arange(batch)[:, None, None]
        selected_valid = valid_candidates.gather(-1, selected)
        selected_indices = pool_indices[batch_idx, selected]  # [B, T, k, P]
        topk_indices = selected_indices.flatten(-2)
        return topk_indices.masked_fill(~selected_valid[..., None].expand_as(selected_indices).flatten(-2), -1)


# --------------------------------------------------------------------------------------------------------------
# Selection spelled as a sort
# --------------------------------------------------------------------------------------------------------------


class SortInsteadOfTopk(nn.Module):
    """Selection by a full stable sort and a slice (code that wants ties broken by position, as ``torch.topk``
    does not promise): ``torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]``. It is a
    top-k with ties by lowest position: rewrite it."""

    def forward(self, q, k, weights, mask):
        scores = torch.einsum("bthd,bsd->bths", q, k)
        scores = (weights.unsqueeze(-1) * scores.relu()).sum(dim=2)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :K]


# --------------------------------------------------------------------------------------------------------------
# Must be rejected
# --------------------------------------------------------------------------------------------------------------


class NsaBlockSelection(nn.Module):
    """Native Sparse Attention (NSA, Yuan et al. 2025) block selection as its open PyTorch re-implementations
    write it (e.g. native-sparse-attention-pytorch): keys are compressed per block (mean here), the compressed
    attention ``cmp_sim.softmax(dim=-1)`` (causal blocks only, masked with ``-finfo.max``) is averaged over the
    heads of a GQA group into a block importance, and ``importance.topk(num_selected, dim=-1)`` picks the blocks.
    The selection reads softmax probabilities, not the ReLU-weighted indexer score: reject (the softmax couples
    the whole row, so no per-key score can be filtered on chip)."""

    block = 3

    def forward(self, q, k):
        batch, t, heads, dim = q.shape
        s = k.shape[1]
        k_cmp = k.view(batch, s // self.block, self.block, dim).mean(dim=2)  # [B, S // blk, D]
        cmp_sim = torch.einsum("bthd,bnd->bthn", q, k_cmp) * dim**-0.5
        block_end = (torch.arange(s // self.block) + 1) * self.block - 1
        cmp_mask = block_end[None, :] <= torch.arange(t)[:, None]  # [T, n_blocks]
        cmp_sim = cmp_sim.masked_fill(~cmp_mask[None, :, None, :], -torch.finfo(cmp_sim.dtype).max)
        cmp_attn = cmp_sim.softmax(dim=-1)
        importance_scores = cmp_attn.mean(dim=2)  # [B, T, n_blocks]
        num_selected = min(2, importance_scores.shape[-1])
        _, selected_block_indices = importance_scores.topk(num_selected, dim=-1)
        return selected_block_indices


class MiniMaxM3BlockMax(nn.Module):
    """HF transformers ``MiniMaxM3VLIndexer``: per-head q.k scores (no ReLU, no head weights), future keys masked
    with -inf, max-pooled into key blocks with ``view(..., num_key_blocks, block_size).amax(dim=-1)``, the query's
    own block boosted with ``block_scores.scatter_(-1, local_idx, inf)``, one selection per indexer head, and
    ``topk_indices.masked_fill(topk_scores == -inf, -1)``. Max-pooled block scores with an in-place boost are
    not the indexer form: reject."""

    block_size, topk_blocks = 3, 2

    def forward(self, idx_q, idx_k, position_ids):
        batch, heads, q_len, _ = idx_q.shape
        k_len = idx_k.shape[2]
        num_key_blocks = k_len // self.block_size
        scores = torch.matmul(idx_q.float(), idx_k.float().transpose(-1, -2))  # [B, H, Sq, Sk]
        k_positions = torch.arange(k_len, device=idx_q.device)
        token_future = k_positions[None, None, None, :] > position_ids[:, None, :, None]
        scores = scores.masked_fill(token_future, float("-inf"))
        scores = scores.view(batch, heads, q_len, num_key_blocks, self.block_size)
        block_scores = scores.amax(dim=-1)
        q_block = position_ids // self.block_size
        local_idx = q_block[..., None].unsqueeze(1).expand(-1, heads, -1, -1)
        block_scores.scatter_(-1, local_idx, float("inf"))
        topk_scores, topk_indices = block_scores.topk(min(self.topk_blocks, num_key_blocks), dim=-1)
        return topk_indices.masked_fill(topk_scores == float("-inf"), -1)


class DenseWarmupKL(nn.Module):
    """DeepSeek-V3.2 dense warm-up stage as Megatron-LM's ``compute_dsa_indexer_loss`` writes it: the indexer is
    trained with a KL divergence between the softmax of the *full* index-score row and the (detached, head-summed,
    L1-normalised) main-attention distribution, and the same scores also feed the top-k. The score table is read by
    the loss: reject with "score table is read by ...", and the model must still run."""

    def forward(self, q, k, weights, attn_q, attn_k, mask):
        index_scores = (torch.einsum("bthd,bsd->bths", q, k).relu() * weights.unsqueeze(-1)).sum(dim=2)
        index_scores = index_scores + mask
        topk_indices = index_scores.topk(K, dim=-1).indices
        with torch.no_grad():
            attention = torch.einsum("bthd,bshd->bhts", attn_q, attn_k) / math.sqrt(attn_q.shape[-1])
            attention = torch.softmax(attention + mask[:, None], dim=-1).sum(dim=1)
            attention = attention / attention.sum(dim=-1, keepdim=True)
        index_log_probs = F.log_softmax(index_scores, dim=-1, dtype=torch.float32)
        kl = attention * (torch.log(attention + 1e-10) - index_log_probs)
        indexer_loss = kl.masked_fill(mask == float("-inf"), 0.0).sum(dim=-1).mean()
        return topk_indices, indexer_loss


# --------------------------------------------------------------------------------------------------------------
# Several sites, checkpoint bodies, no_grad, graph breaks
# --------------------------------------------------------------------------------------------------------------


class _DsaLayer(nn.Module):
    """One DSA-style layer: indexer projections, indexer top-k, and a sparse attention over the selected keys
    through ``gather`` (the form of reference implementations that avoid dense masks)."""

    def __init__(self, dim: int):
        super().__init__()
        self.wq = nn.Linear(dim, H * D, bias=False)
        self.wk = nn.Linear(dim, D, bias=False)
        self.weights_proj = nn.Linear(dim, H, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)

    def indexer(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, H, D)
        k = self.wk(x)
        scores = torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * D**-0.5
        scores = torch.matmul(self.weights_proj(x).unsqueeze(-2), F.relu(scores)).squeeze(-2)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return scores.topk(min(K, t), dim=-1)

    def forward(self, x):
        values, idx = self.indexer(x)
        v = self.wv(x)  # [B, T, dim]
        picked = torch.gather(v.unsqueeze(1).expand(-1, x.shape[1], -1, -1), 2,
                              idx.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))  # [B, T, K, dim]
        probs = torch.softmax(values, dim=-1)  # every row sees itself, so at least one value is finite
        return x + (probs.unsqueeze(-1) * picked).sum(dim=2)


class SeveralSites(nn.Module):
    """Three stacked DSA layers in one graph (one indexer site per layer, as in every DSA model). Each site reads
    its own selected values (softmax over the k kept scores): they are the op's values."""

    SITES = 3

    def __init__(self, dim: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(_DsaLayer(dim) for _ in range(self.SITES))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class CheckpointedSites(SeveralSites):
    """Two DSA layers, each wrapped in ``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)`` as
    training code does (Megatron's recompute, HF ``GradientCheckpointingLayer``): the sites live inside the
    checkpoint bodies (higher-order op subgraphs)."""

    SITES = 2

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


class NoGradIndexer(nn.Module):
    """HF-style indexer method decorated ``@torch.no_grad()`` (DeepseekV32Indexer, GlmMoeDsaIndexer,
    Glm5NextTextIndexer), called from a module that runs with gradients."""

    def __init__(self):
        super().__init__()
        self.weights_proj = nn.Linear(H * D, H, bias=False)

    @torch.no_grad()
    def indexer(self, x, q, k, mask):
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D**-0.5)
        weights = self.weights_proj(x).float() * H**-0.5
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        index_scores = index_scores.masked_fill(~mask, float("-inf"))
        return index_scores.topk(K, dim=-1).indices.to(torch.int32)

    def forward(self, x, q, k, mask):
        idx = self.indexer(x, q, k, mask)
        keep = torch.zeros(mask.shape, dtype=torch.bool).scatter(-1, idx.long(), True)
        return (x.sum(-1, keepdim=True) * keep).sum(-1)


class AfterGraphBreak(nn.Module):
    """A graph break between the projections and the scoring (a ``print`` of a tensor, a ``.item()`` for logging,
    an unsupported call): Dynamo compiles two graphs and the site is in the second one."""

    def forward(self, q, k, weights, mask):
        q = q * 1.0
        torch._dynamo.graph_break()
        scores = torch.einsum("bthd,bsd->bths", q, k).relu()
        scores = (scores * weights[..., None]).sum(2).masked_fill(~mask, float("-inf"))
        return scores.topk(K, dim=-1).indices


# --------------------------------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------------------------------


def _causal_bool(t: int = T, s: int = S) -> torch.Tensor:
    """[B, t, s] bool, True = visible (queries are the last t of s keys)."""
    visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    return visible.expand(B, t, s)


def _windows(gen, rows: int, n: int):
    """Ragged row windows [ks, ke) over n packed keys, some shorter than K, one empty."""
    ks = torch.randint(0, n - 2, (rows,), generator=gen, dtype=torch.int32)
    lengths = torch.randint(1, n, (rows,), generator=gen, dtype=torch.int32)
    ke = torch.minimum(ks + lengths, torch.tensor(n, dtype=torch.int32))
    ke[0] = ks[0]  # an empty window: every slot of that row is padding
    return ks, ke


def megatron_sequence_first(seed):
    q, k, w = _qkw(seed)
    return MegatronSequenceFirst(), (q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), _causal_additive()), \
        "rewrite"


def megatron_chunk_inplace(seed):
    q, k, w = _qkw(seed)
    t0 = S - T // 2  # the second half of the queries, as one chunk
    return MegatronChunkInplace(q_start=t0), (q[:, T // 2:].transpose(0, 1).contiguous(), k.transpose(0, 1),
                                              w[:, T // 2:].transpose(0, 1).contiguous()), "rewrite"


def deepgemm_ragged_windows(seed):
    gen = _gen(seed)
    m, n = 10, 20
    q, kv, w = _randn(gen, m, H, D, dtype=torch.bfloat16), _randn(gen, n, D, dtype=torch.bfloat16), _randn(gen, m, H)
    ks, ke = _windows(gen, m, n)
    return DeepGemmRaggedWindows(), (q, kv, w, ks, ke), "rewrite"


def vllm_key_scale_ragged(seed):
    gen = _gen(seed)
    m, n = 10, 20
    q, kv, w = _randn(gen, m, H, D), _randn(gen, n, D), _randn(gen, m, H)
    scale = torch.rand(n, 1, generator=gen) + 0.01  # [N, 1] as vLLM passes it
    ks, ke = _windows(gen, m, n)
    return VllmKeyScaleRagged(), (q, kv, scale, w, ks, ke), "rewrite"


def megatron_thd_minus_one(seed):
    gen = _gen(seed)
    m, n = 10, 20
    q, kv, w = _randn(gen, m, H, D, dtype=torch.bfloat16), _randn(gen, n, D, dtype=torch.bfloat16), _randn(gen, m, H)
    starts, ends = _windows(gen, m, n)
    return MegatronThdMinusOne(), (q, kv, w, starts, ends), "rewrite"


def no_head_weights(seed):
    q, k, _ = _qkw(seed)
    return NoHeadWeights(), (q, k), "rewrite"


def no_relu(seed):
    q, k, w = _qkw(seed)
    return NoRelu(), (q, k, w, _causal_additive()), "rewrite"


def scale_div_sqrt(seed):
    return ScaleDivSqrt(), _qkw(seed), "rewrite"


def sum_dtype_float32(seed):
    q, k, w = _qkw(seed, torch.bfloat16)
    return SumDtypeFloat32(), (q, k, w, _causal_bool()), "rewrite"


def scale_outside_relu(seed):
    q, k, w = _qkw(seed)
    return ScaleOutsideRelu(), (q, k, w, _causal_bool()), "rewrite"


def scale_inside_relu(seed):
    q, k, w = _qkw(seed, torch.bfloat16)
    return ScaleInsideRelu(), (q, k, w, _causal_bool()), "rewrite"


def scale_folded_into_weights(seed):
    q, k, _ = _qkw(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = ScaleFoldedIntoWeights()
    x = _randn(_gen(seed + 1), B, T, H * D)
    return module, (x, q, k, _causal_additive()), "rewrite"


def scale_on_query_per_position(seed):
    q, k, w = _qkw(seed)
    return ScaleOnQueryPerPosition(), (q, k, w, _causal_additive()), "rewrite"


def finfo_min_fill(seed):
    q, k, w = _qkw(seed)
    return FinfoMinFill(), (q, k, w, _causal_bool()), "rewrite"


def deepseek_v4_compressed_keys(seed):
    q, k, w = _qkw(seed)
    position_ids = torch.arange(T).expand(B, T)
    return DeepseekV4CompressedKeys(), (q, k, w, position_ids), "rewrite"


def pooled_keys_offset_remap(seed):
    return PooledKeysOffsetRemap(), _qkw(seed), "rewrite"


def glm5_next_kpool(seed):
    q, k, w = _qkw(seed)
    return Glm5NextKPool(), (q, k, w, _causal_bool()), "rewrite"


def sort_instead_of_topk(seed):
    q, k, w = _qkw(seed)
    return SortInsteadOfTopk(), (q, k, w, _causal_bool()), "rewrite"


def nsa_block_selection(seed):
    q, k, _ = _qkw(seed)
    return NsaBlockSelection(), (q, k), "reject"


def minimax_m3_block_max(seed):
    q, k, _ = _qkw(seed)
    position_ids = torch.arange(T).expand(B, T)
    return MiniMaxM3BlockMax(), (q.transpose(1, 2), k.unsqueeze(1), position_ids), "reject"


def dense_warmup_kl(seed):
    q, k, w = _qkw(seed)
    gen = _gen(seed + 1)
    attn_q, attn_k = _randn(gen, B, T, 4, D), _randn(gen, B, S, 4, D)
    return DenseWarmupKL(), (q, k, w, attn_q, attn_k, _causal_additive().expand(B, T, S)), "reject"


def _with_params(cls, seed, *args):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls(*args)


def several_sites(seed):
    return _with_params(SeveralSites, seed), (_randn(_gen(seed + 1), B, T, 32),), "rewrite"


def checkpointed_sites(seed):
    return _with_params(CheckpointedSites, seed), (_randn(_gen(seed + 1), B, T, 32).requires_grad_(),), "rewrite"


def no_grad_indexer(seed):
    q, k, _ = _qkw(seed)
    x = _randn(_gen(seed + 1), B, T, H * D)
    return _with_params(NoGradIndexer, seed), (x, q, k, _causal_bool()), "rewrite"


def after_graph_break(seed):
    q, k, w = _qkw(seed)
    return AfterGraphBreak(), (q, k, w, _causal_bool()), "rewrite"


SPELLINGS = {
    "megatron_sequence_first": megatron_sequence_first,
    "megatron_chunk_inplace": megatron_chunk_inplace,
    "deepgemm_ragged_windows": deepgemm_ragged_windows,
    "vllm_key_scale_ragged": vllm_key_scale_ragged,
    "megatron_thd_minus_one": megatron_thd_minus_one,
    "no_head_weights": no_head_weights,
    "no_relu": no_relu,
    "scale_div_sqrt": scale_div_sqrt,
    "sum_dtype_float32": sum_dtype_float32,
    "scale_outside_relu": scale_outside_relu,
    "scale_inside_relu": scale_inside_relu,
    "scale_folded_into_weights": scale_folded_into_weights,
    "scale_on_query_per_position": scale_on_query_per_position,
    "finfo_min_fill": finfo_min_fill,
    "deepseek_v4_compressed_keys": deepseek_v4_compressed_keys,
    "pooled_keys_offset_remap": pooled_keys_offset_remap,
    "glm5_next_kpool": glm5_next_kpool,
    "sort_instead_of_topk": sort_instead_of_topk,
    "nsa_block_selection": nsa_block_selection,
    "minimax_m3_block_max": minimax_m3_block_max,
    "dense_warmup_kl": dense_warmup_kl,
    "several_sites": several_sites,
    "checkpointed_sites": checkpointed_sites,
    "no_grad_indexer": no_grad_indexer,
    "after_graph_break": after_graph_break,
}
