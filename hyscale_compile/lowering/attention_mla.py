"""``hyscale::sparse_attention_mla``: absorbed MLA attention over the selected keys, the absorption inside the op.

    sparse_attention_mla(q [B, T, H, Dn + Dr], kv [B, S, 1, Dc + Dr], w [H, Dn + Dv, Dc], indices [B, T, K],
                         nope_dim (= Dn), scale, causal, offset, offsets, key_mask, empty, eager_empty_grad,
                         keep_latent)
        -> (out [B, T, H, Dv], lse [B, T, H] fp32, o' [B, T, H, Dc], or an empty [0] without keep_latent)

is, per head h (w_uk = w[:, :Dn], w_uv = w[:, Dn:]; the MLA up-projection ``kv_b_proj.weight`` viewed per head)::

    q' = cat(q[..., :Dn] @ w_uk[h], q[..., Dn:])
    o', lse = sparse_attention_latent(q', kv, indices, value_dim=Dc, ...)
    out = o' @ w_uv[h]^T

The attention pass emitted those three steps as graph ops; autograd then kept q' and o' for the backward and the
backward made dq' and do' whole, which were most of the layer's peak memory at long contexts. This op runs them a
block of query rows at a time (``runtime/sparse_attention/absorbed.py``): q' is recomputed in the backward a block
at a time; o' (which w_uv's gradient needs) is kept as the op's third output with ``keep_latent``, else recomputed
by the backward a block at a time too (less memory, more attention time: the absorbed module says how). Picks, the
causal rule, the
key mask and empty rows as ``sparse_attention`` (lowering/attention.py); ``eager_empty_grad`` adds, for rows with no
visible pick, the gradient eager attention under an additive finfo.min mask gives them (what
``empty_rows_like_eager`` adds after ``sparse_attention``: lowering/attention_rows.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime.sparse_attention import Picks, absorbed
from .attention import _require, check_attention_inputs, without_autocast

_NAME = "hyscale.sparse_attention_mla"


def check_mla_inputs(q: Tensor, kv: Tensor, w: Tensor, indices: Tensor, nope_dim: int, offsets: Tensor | None,
                     key_mask: Tensor | None, empty: str) -> None:
    """The absorbed layout's own shape rules, then the attention's (on q' as a view: nothing is allocated)."""
    _require(q.dim() == 4, f"{_NAME}: q must be [B, T, H, Dn + Dr], got {q.dim()} dims {tuple(q.shape)}")
    _require(w.dim() == 3, f"{_NAME}: w must be [H, Dn + Dv, Dc] (kv_b_proj.weight per head), got {w.dim()} dims "
             f"{tuple(w.shape)}")
    _require(kv.dim() == 4, f"{_NAME}: kv must be [B, S, 1, Dc + Dr], got {kv.dim()} dims {tuple(kv.shape)}")
    H, Dqk = q.shape[2], q.shape[3]
    _require(1 <= nope_dim and nope_dim < Dqk, f"{_NAME}: nope_dim {nope_dim} must be in [1, q's features {Dqk})")
    _require(nope_dim < w.shape[1], f"{_NAME}: nope_dim {nope_dim} leaves w (dim 1 = {w.shape[1]}) no value rows")
    _require(w.shape[0] == H, f"{_NAME}: w must have q's {H} heads in dim 0, got {tuple(w.shape)}")
    _require(kv.shape[2] == 1, f"{_NAME}: kv must have one latent row a key (dim 2 = 1), got {tuple(kv.shape)}")
    Dc, Dr = w.shape[2], Dqk - nope_dim
    _require(kv.shape[3] == Dc + Dr, f"{_NAME}: kv's features {kv.shape[3]} != the latent {Dc} (w's dim 2) + q's "
             f"rope part {Dr}")
    _require(w.dtype == q.dtype, f"{_NAME}: w must have q's dtype {q.dtype}, got {w.dtype}")
    _require(w.device == q.device, f"{_NAME}: w is on {w.device}, q on {q.device}")
    q_latent = q[..., :1].expand(*q.shape[:3], Dc + Dr)
    check_attention_inputs(q_latent, kv, kv[..., :Dc], indices, offsets, key_mask, empty)


@torch.library.custom_op(_NAME.replace(".", "::"), mutates_args=())
def sparse_attention_mla(q: Tensor, kv: Tensor, w: Tensor, indices: Tensor, nope_dim: int, scale: float,
                         causal: bool, offset: int, offsets: Tensor | None, key_mask: Tensor | None, empty: str,
                         eager_empty_grad: bool = False, keep_latent: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    check_mla_inputs(q, kv, w, indices, nope_dim, offsets, key_mask, empty)
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    with without_autocast(q.device):
        return absorbed.forward(q, kv, w, nope_dim, indices, scale, picks, empty, keep_latent)


@sparse_attention_mla.register_fake
def _(q, kv, w, indices, nope_dim, scale, causal, offset, offsets, key_mask, empty, eager_empty_grad=False,
      keep_latent=True):
    check_mla_inputs(q, kv, w, indices, nope_dim, offsets, key_mask, empty)
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    return (q.new_empty((B, T, H, w.shape[1] - nope_dim)), q.new_empty((B, T, H), dtype=torch.float32),
            q.new_empty((B, T, H, w.shape[2]) if keep_latent else (0,)))


@torch.library.custom_op("hyscale::sparse_attention_mla_backward", mutates_args=())
def sparse_attention_mla_backward(grad_out: Tensor, grad_lse: Tensor | None, grad_latent: Tensor | None, q: Tensor,
                                  kv: Tensor, w: Tensor, out: Tensor, lse: Tensor, latent: Tensor, indices: Tensor,
                                  nope_dim: int, scale: float, causal: bool, offset: int, offsets: Tensor | None,
                                  key_mask: Tensor | None, empty: str, eager_empty_grad: bool
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    picks = Picks(causal=causal, offset=offset, offsets=offsets, key_mask=key_mask)
    kept = latent.dim() == 4  # else the forward's empty [0]: o' is recomputed
    with without_autocast(q.device):
        return absorbed.backward(grad_out, grad_lse, grad_latent, q, kv, w, nope_dim, out, lse,
                                 latent if kept else None, indices, scale, picks, empty, eager_empty_grad)


@sparse_attention_mla_backward.register_fake
def _(grad_out, grad_lse, grad_latent, q, kv, w, out, lse, latent, indices, nope_dim, scale, causal, offset, offsets,
      key_mask, empty, eager_empty_grad):
    return q.new_empty(q.shape), kv.new_empty(kv.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output) -> None:
    q, kv, w, indices, nope_dim, scale, causal, offset, offsets, key_mask, empty, eager_empty_grad, keep_latent = inputs
    out, lse, latent = output
    # o' and lse are read by few callers (the pass's graph reads out alone): a gradient materialized as zeros for
    # o' would be as large as o' itself (8.6 GB at the layer's sizes, at the backward's peak)
    ctx.set_materialize_grads(False)
    # out is the model's attention output, which its output projection keeps anyway (the same storage); without
    # keep_latent, the backward's row term and recomputed o' start from it, and latent is the empty [0] (a plain
    # Tensor argument of the backward op either way: Inductor's dynamic-shape fallback call dropped an optional
    # tensor argument that was not None). With keep_latent out is not read, and not kept: the op keeps what it kept
    # before the option, and a caller may write out in place after (the attention pass's rewrite copies it for a
    # model that does so without keep_latent: attention_rewrite.py)
    ctx.save_for_backward(q, kv, w, lse, latent, indices, offsets, key_mask, *(() if keep_latent else (out,)))
    ctx.args = (nope_dim, scale, causal, offset, empty, eager_empty_grad)


def _backward(ctx, grad_out, grad_lse, grad_latent):
    q, kv, w, lse, latent, indices, offsets, key_mask, *rest = ctx.saved_tensors
    out = rest[0] if rest else latent  # kept o': out is not read (the backward op takes a tensor there)
    nope_dim, scale, causal, offset, empty, eager_empty_grad = ctx.args
    if grad_out is None:
        grad_out = q.new_zeros((*q.shape[:3], w.shape[1] - nope_dim))
    dq, dkv, dw = torch.ops.hyscale.sparse_attention_mla_backward(
        grad_out, grad_lse, grad_latent if latent.dim() == 4 else None, q, kv, w, out, lse, latent, indices,
        nope_dim, scale, causal, offset, offsets, key_mask, empty, eager_empty_grad)
    return dq, dkv, dw, None, None, None, None, None, None, None, None, None, None


sparse_attention_mla.register_autograd(_backward, setup_context=_setup)
