"""Sparse attention over the selected keys: each query attends to its k picks only.

``naive`` is the contract as plain PyTorch (what runs on the CPU); ``forward`` / ``backward`` are the
Triton kernels (CUDA). ``runtime.dispatch.force_backend("triton")`` runs the kernels on CPU tensors
under TRITON_INTERPRET=1, and ``force_backend("reference")`` the reference on CUDA tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import dispatch
from . import naive
from .naive import EMPTY_RULES, Picks, compute_dtype

__all__ = ["EMPTY_RULES", "Picks", "attention", "attention_backward", "attention_backward_latent", "row_delta"]


def _triton(t: Tensor) -> bool:
    return dispatch.backend_for(t) == "triton"


def attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float, picks: Picks, empty: str,
              out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32 (float64 for float64 inputs)), written into ``out`` /
    ``lse`` where given (contiguous, those shapes and dtypes)."""
    if _triton(q):
        from . import forward

        return forward.forward(q, k, v, indices, scale, picks, empty, out, lse)
    return naive.forward(q, k, v, indices, scale, picks, empty, out, lse)


# Elements of dout a row_delta step upcasts at once: its fp32 temporaries stay at 256 MB each, where the whole
# [B, T, H, Dv] at once would be three of 17 GB for the MLA latent layout at T = 65536.
ROW_DELTA_ELEMS = 1 << 26


def row_delta(dout: Tensor, out: Tensor, dlse: Tensor | None) -> Tensor:
    """[B, T, H] rowsum(dout * out) - dlse in fp32: the softmax backward's per-row term (an lse gradient
    folds in here: d lse / d score = p). Query rows in chunks of a fixed size (the same sums for any T)."""
    ct = compute_dtype(dout)
    B, T, H, Dv = dout.shape
    delta = torch.empty(B, T, H, dtype=ct, device=dout.device)
    rows = max(1, ROW_DELTA_ELEMS // max(1, B * H * Dv))
    for t0 in range(0, T, rows):
        part = slice(t0, t0 + rows)
        delta[:, part] = (dout[:, part].to(ct) * out[:, part].to(ct)).sum(-1)
    return delta if dlse is None else delta - dlse.to(ct)


def attention_backward(dout: Tensor, delta: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, indices: Tensor,
                       scale: float, picks: Picks, empty: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes; deterministic on every backend."""
    if _triton(q):
        from . import backward

        return backward.backward(dout, delta, q, k, v, lse, indices, scale, picks, empty)
    return naive.backward(dout, delta, q, k, v, lse, indices, scale, picks, empty)


def attention_backward_latent(dout: Tensor, delta: Tensor, q: Tensor, kv: Tensor, Dv: int, lse: Tensor,
                              indices: Tensor, scale: float, picks: Picks, empty: str,
                              dkv_acc: Tensor | None = None, out: Tensor | None = None,
                              dlse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dq, dkv) of the latent form (v = kv[..., :Dv]): dkv = dk with dv added into its first Dv columns. With
    ``dkv_acc`` ([B, S, G, Dqk] contiguous, ``compute_dtype(q)``), dkv is added into it and it is returned uncast.
    With ``out`` ([B, T, H, Dv] contiguous, q's dtype), the forward's output is recomputed into it from the p the
    backward forms anyway (a caller that did not keep it: the absorbed MLA op); equal to the forward's up to the
    rounding of p (normalized here, rescaled online there); ``delta`` is then the caller's approximation and
    ``dlse`` the lse gradient in it (``naive.backward``: dq's row term is taken from the recomputed output)."""
    if _triton(q):
        from . import backward

        return backward.backward_latent(dout, delta, q, kv, Dv, lse, indices, scale, picks, empty, dkv_acc, out,
                                        dlse)
    return naive.backward_latent(dout, delta, q, kv, Dv, lse, indices, scale, picks, empty, dkv_acc, out, dlse)
