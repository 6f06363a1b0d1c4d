"""``hyscale::empty_rows_like_eager``: the gradient a model's additive ``finfo.min`` mask gives a row with no
visible key, for the rows of ``hyscale::sparse_attention(..., empty="mean")`` that are empty.

A model that *adds* a ``finfo.min`` mask to its scores (HF's eager attention, SDPA with a float mask) gives a row
whose keys are all hidden the softmax of S equal values (the fill absorbed every score): the mean of v, which
``sparse_attention(empty="mean")`` reproduces. Autograd, though, differentiates the softmax there as if the
scores still counted: with p = 1/S on every key and g the row's output gradient,

    d score[s] = (g . (v[s] - mean(v))) / S,   dq = scale * sum_s d score[s] k[s],   dk[s] += scale * d score[s] q

(eager's own arithmetic, and what a padded query row sends back in training). The sparse op gives such a row's
q and k nothing (it is exact for a mask that *replaces* the scores). This op stands between the attention and
the rest of the graph: its forward returns the attention output unchanged, its backward passes the output
gradient through and adds the terms above for the empty rows only (``lse == -inf``), which it gathers: the
cost is that of those rows against all S keys, as in the model, and nothing when no row is empty.

    empty_rows_like_eager(out [B, T, H, Dv], q [B, T, H, Dqk], k [B, S, G, Dqk], v [B, S, G, Dv], lse [B, T, H],
                          scale) -> out
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime.sparse_attention.empty_rows import eager_gradient
from .attention import without_autocast


@torch.library.custom_op("hyscale::empty_rows_like_eager", mutates_args=())
def empty_rows_like_eager(out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, scale: float) -> Tensor:
    return out.clone()


@empty_rows_like_eager.register_fake
def _(out, q, k, v, lse, scale):
    return out.new_empty(out.shape)


@torch.library.custom_op("hyscale::empty_rows_like_eager_backward", mutates_args=())
def empty_rows_like_eager_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, scale: float
                                   ) -> tuple[Tensor, Tensor]:
    """(dq, dk): eager's softmax gradient on the empty rows, zero elsewhere (deterministic: no atomics)."""
    with without_autocast(q.device):
        dq, dk = eager_gradient(grad, q, k, v, lse, scale)
        return dq.to(q.dtype), dk.to(k.dtype)


@empty_rows_like_eager_backward.register_fake
def _(grad, q, k, v, lse, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup(ctx, inputs, output) -> None:
    out, q, k, v, lse, scale = inputs
    ctx.save_for_backward(q, k, v, lse)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, lse = ctx.saved_tensors
    dq, dk = torch.ops.hyscale.empty_rows_like_eager_backward(grad, q, k, v, lse, ctx.scale)
    return grad, dq, dk, None, None, None


empty_rows_like_eager.register_autograd(_backward, setup_context=_setup)
