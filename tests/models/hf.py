"""Tiny, randomly initialised HF transformers models with a DSA indexer (no downloads).

``tiny_deepseek_v32`` builds ``DeepseekV32ForCausalLM`` and ``tiny_glm_moe_dsa`` builds
``GlmMoeDsaForCausalLM`` from their config classes. Both indexers are the unmodified HF code:
``matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * softmax_scale`` -> ``F.relu`` ->
``matmul(weights.unsqueeze(-2), scores).squeeze(-2)`` -> mask -> ``topk(min(index_topk, S)).indices.to(int32)``,
whose indices are scattered into a dense boolean mask for the main attention
(see ``tests/models/HF_GRAPHS.md`` for the Dynamo graphs).

Each factory returns ``(model, example_inputs)`` where ``example_inputs`` is a dict of keyword arguments
for ``model(**example_inputs)``. Everything is deterministic for a given ``seed``.
"""

from __future__ import annotations

import torch

# Small enough to compile in seconds on CPU (hidden 64, 4 attention heads, rope dim 8).
# 12 indexer heads of dim 16: a key scores exactly 0 when the ReLU zeroes it in every head, and with 4 heads
# (probability 1/16 per key) such exact ties landed on the k-th place for about half of the seeds; torch.topk
# and an exact top-k with "lowest position first" then legitimately pick different keys and the logits differ.
# With 12 heads (1/4096) no seed in 0..11 has a tie or near-tie at the k-th place in any test configuration.
_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_head_dim=16,
    index_n_heads=12,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    max_position_embeddings=256,
    pad_token_id=0,
)


def _inputs(vocab_size: int, batch: int, seq_len: int, padding: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(1, vocab_size, (batch, seq_len), generator=gen)
    inputs = {"input_ids": input_ids}
    if padding:
        # Left padding on every row but the first: the indexer then sees a padded causal mask, not a pure causal one.
        attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
        for b in range(1, batch):
            attention_mask[b, : min(b, seq_len - 1)] = 0
        inputs["attention_mask"] = attention_mask
    return inputs


def _config(num_layers: int, index_topk: int, moe: bool, attn_implementation: str) -> dict:
    """Config keywords both DSA models share (MoE from the second layer on when moe=True)."""
    return dict(
        _COMMON,
        num_hidden_layers=num_layers,
        index_topk=index_topk,
        first_k_dense_replace=1 if moe else num_layers,
        attn_implementation=attn_implementation,
        experts_implementation="batched_mm",
    )


def _build(config_cls, model_cls, config_kwargs: dict, seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    config = config_cls(**config_kwargs)
    model = model_cls(config).to(dtype).eval()
    return model


def tiny_deepseek_v32(
    seed: int = 0,
    *,
    num_layers: int = 2,
    index_topk: int = 8,
    seq_len: int = 16,
    batch: int = 2,
    moe: bool = False,
    padding: bool = False,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    **config_overrides,
):
    """``DeepseekV32ForCausalLM`` with every layer running its own indexer (num_layers indexer sites).

    index_topk < seq_len: a real selection; index_topk >= seq_len: ``min(index_topk, S)`` selects every key.
    config_overrides go to the config class (e.g. index_n_heads=4).
    moe=True makes every layer after the first a MoE layer (its router adds two more, non-indexer, topk nodes
    per layer; experts run through the compile-friendly "batched_mm" implementation).
    """
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config_kwargs = _config(num_layers, index_topk, moe, attn_implementation)
    config_kwargs.update(config_overrides)
    model = _build(DeepseekV32Config, DeepseekV32ForCausalLM, config_kwargs, seed, dtype)
    return model, _inputs(model.config.vocab_size, batch, seq_len, padding, seed)


def tiny_glm_moe_dsa(
    seed: int = 0,
    *,
    num_layers: int = 3,
    index_topk: int = 8,
    seq_len: int = 16,
    batch: int = 2,
    indexer_pattern: str | None = "FSF",
    moe: bool = False,
    padding: bool = False,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    **config_overrides,
):
    """``GlmMoeDsaForCausalLM``; ``indexer_pattern`` has one letter per layer, F (own indexer) or S (reuses the
    previous full layer's top-k indices, cross-layer sharing). The number of indexer sites is ``pattern.count("F")``.
    """
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config_kwargs = _config(num_layers, index_topk, moe, attn_implementation)
    if indexer_pattern is not None:
        assert len(indexer_pattern) == num_layers, (indexer_pattern, num_layers)
        config_kwargs["index_topk_pattern"] = indexer_pattern
    config_kwargs.update(config_overrides)
    model = _build(GlmMoeDsaConfig, GlmMoeDsaForCausalLM, config_kwargs, seed, dtype)
    return model, _inputs(model.config.vocab_size, batch, seq_len, padding, seed)


def indexer_sites(model) -> int:
    """How many layers of ``model`` run an indexer (one top-k selection site each)."""
    return sum(1 for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None)
