"""``hyscale::sparse_attention`` and its backward: each query attends to its k selected keys only.

    sparse_attention(q [B, T, H, Dqk], k [B, S, G, Dqk], v [B, S, G, Dv], indices [B, T, K] int32/int64,
                     scale, causal, offset, offsets [B] | None, key_mask [B, S] bool | None, empty)
        -> (out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32)

H % G == 0 (query head h reads kv group h // (H // G)); q, k, v share one dtype (bf16, fp16, fp32) and
device. A pick s counts when 0 <= s < S, s <= t + offset (+ offsets[b]) under ``causal``, and
key_mask[b, s]; the others are dropped. The indices of a row must be distinct (the caller guarantees it,
as a top-k does; a repeated key would count twice). A row with no kept pick gives out = 0
(empty="zero", SDPA under a boolean mask) or the mean of v over all S keys (empty="mean", eager
softmax over finfo.min-filled scores), and lse = -inf. ``runtime/sparse_attention/naive.py`` is the
contract as code. The backward is deterministic (same inputs, same bits) and reaches q, k, v only
through the kept picks; an lse gradient is supported.

    sparse_attention_latent(q [B, T, H, Dqk], kv [B, S, G, Dqk], indices, value_dim, scale, causal, offset,
                            offsets, key_mask, empty) -> (out [B, T, H, value_dim], lse)

is the same attention with v = kv[..., :value_dim] (the MLA latent layout: one kv row, its first value_dim
features the value), taking kv once. Its backward returns (dq, dkv), dkv being kv's whole gradient: dk with
dv added into its first value_dim columns.

Why a second op, and the gradients when k and v alias. ``sparse_attention(q, k, v)`` returns dk and dv
apart, whether or not v is a view of k: autograd adds dv into k's gradient through the view, a gradient
taken with respect to v alone is dv, and where v aliases k's storage without being a view of k in the autograd
graph (``v = k.detach()[..., :Dv]``, or k detached) the right gradient of k excludes dv. The op sees storage,
not the autograd graph, so it cannot tell these apart and never folds dv into dk. The Triton backward is
cheapest when it may fold (one Dqk-wide contribution a pick instead of Dqk + Dv: 576 against 1088 floats in
the MLA layer), so the fold has its own op whose contract makes it right: it has no v argument and returns
only kv's total gradient, which is what every caller that builds v as kv's view gets from the first op,
summed by autograd. ``hyscale_compile.sparse_attention_latent`` and the attention pass (MLA latent rewrite)
call it; ``sparse_attention`` keeps dk and dv apart (its aliased MLA backward still sums the heads of a group
into one contribution a pick, 1088 floats, but not dk and dv).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..runtime import sparse_attention as runtime
from ..runtime.sparse_attention import EMPTY_RULES, Picks

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def without_autocast(device: torch.device):
    """Autocast off for an op's own arithmetic: a custom op's body still runs in the caller's autocast state (an
    autocast region in the compiled graph, or one around it), which would round the reference's fp32 sums to the
    autocast dtype. Its inputs are what the caller cast them to; it computes as documented."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _require(cond, msg: str) -> None:
    torch._check(cond, lambda: msg)


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, offsets: Tensor | None,
                           key_mask: Tensor | None, empty: str) -> None:
    """Shape, dtype and device checks with messages naming the argument (symbolic-size safe)."""
    name = "hyscale.sparse_attention"
    for arg, t in (("q", q), ("k", k), ("v", v)):
        layout = "[B, T, H, Dqk]" if arg == "q" else f"[B, S, G, {'Dv' if arg == 'v' else 'Dqk'}]"
        _require(t.dim() == 4, f"{name}: {arg} must be {layout}, got {t.dim()} dims {tuple(t.shape)}")
    _require(q.dtype in _DTYPES, f"{name}: q dtype {q.dtype} unsupported; use bfloat16, float16 or float32")
    _require(k.dtype == q.dtype and v.dtype == q.dtype,
             f"{name}: k and v must have q's dtype {q.dtype}, got k {k.dtype}, v {v.dtype}")
    _require(indices.dim() == 3, f"{name}: indices must be [B, T, K], got {indices.dim()} dims {tuple(indices.shape)}")
    _require(indices.dtype in (torch.int32, torch.int64),
             f"{name}: indices must be int32 or int64, got {indices.dtype}")
    B, T, H, Dqk = q.shape
    S, G = k.shape[1], k.shape[2]
    _require(k.shape[0] == B, f"{name}: k batch {k.shape[0]} != q batch {B}")
    _require(k.shape[3] == Dqk, f"{name}: k feature dim {k.shape[3]} != q feature dim {Dqk}")
    _require(v.shape[0] == B and v.shape[1] == S and v.shape[2] == G,
             f"{name}: v must be [B, S, G, Dv] = [{B}, {S}, {G}, Dv] like k, got {tuple(v.shape)}")
    _require(G >= 1, f"{name}: k has no kv group (G = 0)")
    _require(H % G == 0, f"{name}: q heads H={H} must be a multiple of the kv groups G={G} of k and v")
    _require(indices.shape[0] == B and indices.shape[1] == T,
             f"{name}: indices must be [B, T, K] = [{B}, {T}, K], got {tuple(indices.shape)}")
    if offsets is not None:
        _require(offsets.dim() == 1 and offsets.shape[0] == B,
                 f"{name}: query_offset tensor (offsets) must be [B] = [{B}], got {tuple(offsets.shape)}")
        _require(not offsets.is_floating_point() and offsets.dtype != torch.bool,
                 f"{name}: query_offset tensor (offsets) must be an integer tensor, got {offsets.dtype}")
    if key_mask is not None:
        _require(key_mask.dtype == torch.bool, f"{name}: key_mask must be bool (True = visible), got {key_mask.dtype}")
        _require(key_mask.dim() == 2 and key_mask.shape[0] == B and key_mask.shape[1] == S,
                 f"{name}: key_mask must be [B, S] = [{B}, {S}], got {tuple(key_mask.shape)}")
    _require(empty in EMPTY_RULES, f"{name}: empty must be one of {EMPTY_RULES}, got {empty!r}")
    for arg, t in (("k", k), ("v", v), ("indices", indices), ("offsets", offsets), ("key_mask", key_mask)):
        if t is not None:
            _require(t.device == q.device, f"{name}: {arg} is on {t.device}, q on {q.device}")


def _fake_outputs(q: Tensor, value_dim: int) -> tuple[Tensor, Tensor]:
    """Both ops' outputs: out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty((B, T, H, value_dim)), q.new_empty((B, T, H), dtype=torch.float32)


@torch.library.custom_op("hyscale::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float, causal: bool, offset: int,
                     offsets: Tensor | None, key_mask: Tensor | None, empty: str) -> tuple[Tensor, Tensor]:
    check_attention_inputs(q, k, v, indices, offsets, key_mask, empty)
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    with without_autocast(q.device):
        return runtime.attention(q, k, v, indices, scale, picks, empty)


@sparse_attention.register_fake
def _(q, k, v, indices, scale, causal, offset, offsets, key_mask, empty):
    check_attention_inputs(q, k, v, indices, offsets, key_mask, empty)
    return _fake_outputs(q, v.shape[3])


@torch.library.custom_op("hyscale::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor, indices: Tensor, scale: float, causal: bool, offset: int,
                              offsets: Tensor | None, key_mask: Tensor | None, empty: str
                              ) -> tuple[Tensor, Tensor, Tensor]:
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    with without_autocast(q.device):
        delta = runtime.row_delta(grad_out, out, grad_lse)
        return runtime.attention_backward(grad_out, delta, q, k, v, lse, indices, scale, picks, empty)


@sparse_attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, indices, scale, causal, offset, offsets, key_mask, empty):
    # contiguous, as every implementation returns them (empty_like would copy an input's strides)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output) -> None:
    q, k, v, indices, scale, causal, offset, offsets, key_mask, empty = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, indices, offsets, key_mask)
    ctx.args = (scale, causal, offset, empty)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, indices, offsets, key_mask = ctx.saved_tensors
    scale, causal, offset, empty = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.hyscale.sparse_attention_backward(grad_out, grad_lse, q, k, v, out, lse, indices, scale,
                                                             causal, offset, offsets, key_mask, empty)
    return dq, dk, dv, None, None, None, None, None, None, None


sparse_attention.register_autograd(_backward, setup_context=_setup)


def _latent_value(kv: Tensor, value_dim: int) -> Tensor:
    _require(kv.dim() == 4, f"hyscale.sparse_attention_latent: kv must be [B, S, G, Dqk], got {kv.dim()} dims")
    _require(1 <= value_dim and value_dim <= kv.shape[3],
             f"hyscale.sparse_attention_latent: value_dim {value_dim} must be in [1, Dqk = {kv.shape[3]}]")
    return kv[..., :value_dim]


@torch.library.custom_op("hyscale::sparse_attention_latent", mutates_args=())
def sparse_attention_latent(q: Tensor, kv: Tensor, indices: Tensor, value_dim: int, scale: float, causal: bool,
                            offset: int, offsets: Tensor | None, key_mask: Tensor | None, empty: str
                            ) -> tuple[Tensor, Tensor]:
    v = _latent_value(kv, value_dim)
    check_attention_inputs(q, kv, v, indices, offsets, key_mask, empty)
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    with without_autocast(q.device):
        return runtime.attention(q, kv, v, indices, scale, picks, empty)


@sparse_attention_latent.register_fake
def _(q, kv, indices, value_dim, scale, causal, offset, offsets, key_mask, empty):
    check_attention_inputs(q, kv, _latent_value(kv, value_dim), indices, offsets, key_mask, empty)
    return _fake_outputs(q, value_dim)


@torch.library.custom_op("hyscale::sparse_attention_latent_backward", mutates_args=())
def sparse_attention_latent_backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, kv: Tensor, out: Tensor,
                                     lse: Tensor, indices: Tensor, value_dim: int, scale: float, causal: bool,
                                     offset: int, offsets: Tensor | None, key_mask: Tensor | None, empty: str
                                     ) -> tuple[Tensor, Tensor]:
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    with without_autocast(q.device):
        delta = runtime.row_delta(grad_out, out, grad_lse)
        return runtime.attention_backward_latent(grad_out, delta, q, kv, value_dim, lse, indices, scale, picks, empty)


@sparse_attention_latent_backward.register_fake
def _(grad_out, grad_lse, q, kv, out, lse, indices, value_dim, scale, causal, offset, offsets, key_mask, empty):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _setup_latent(ctx, inputs, output) -> None:
    q, kv, indices, value_dim, scale, causal, offset, offsets, key_mask, empty = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, out, lse, indices, offsets, key_mask)
    ctx.args = (value_dim, scale, causal, offset, empty)


def _backward_latent(ctx, grad_out, grad_lse):
    q, kv, out, lse, indices, offsets, key_mask = ctx.saved_tensors
    value_dim, scale, causal, offset, empty = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dkv = torch.ops.hyscale.sparse_attention_latent_backward(grad_out, grad_lse, q, kv, out, lse, indices,
                                                                 value_dim, scale, causal, offset, offsets,
                                                                 key_mask, empty)
    return dq, dkv, None, None, None, None, None, None, None, None


sparse_attention_latent.register_autograd(_backward_latent, setup_context=_setup_latent)
