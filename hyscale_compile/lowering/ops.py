"""The operators the passes emit: ``hyscale::select``, ``hyscale::rescore``, ``hyscale::sparse_backward``.

Each is a ``torch.library.custom_op`` with a fake rule (symbolic sizes work) and, for the first two,
an autograd formula that only touches the k selected keys per query. The implementations dispatch
to the runtime (Triton on CUDA, the plain-PyTorch reference elsewhere); semantics are those of
``runtime/reference.py``.

Visibility arguments, shared by all three ops and in this order:
    causal, offset, offsets, starts, ends, mask, bias
(see ``runtime.reference.Visibility``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..runtime import dispatch
from ..runtime.reference import Visibility

_QK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond, msg: str) -> None:
    torch._check(cond, lambda: msg)


def check_inputs(q: Tensor, kx: Tensor, weights: Tensor | None, k: int | None,
                 offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
                 mask: Tensor | None, bias: Tensor | None) -> None:
    """Shape and dtype checks with messages naming the offending argument (symbolic-size safe)."""
    _check(q.dim() == 4, f"hyscale: q must be [B, T, H, D], got {q.dim()} dims {tuple(q.shape)}")
    _check(kx.dim() == 3, f"hyscale: kx must be [B, S, D], got {kx.dim()} dims {tuple(kx.shape)}")
    _check(q.dtype in _QK_DTYPES, f"hyscale: q dtype {q.dtype} unsupported; use bfloat16, float16 or float32")
    _check(kx.dtype in _QK_DTYPES, f"hyscale: kx dtype {kx.dtype} unsupported; use bfloat16, float16 or float32")
    B, T, H, D = q.shape
    _check(kx.shape[0] == B or kx.shape[0] == 1, f"hyscale: kx batch {kx.shape[0]} is neither q batch {B} nor 1")
    _check(kx.shape[2] == D, f"hyscale: kx head dim {kx.shape[2]} != q head dim {D}")
    S = kx.shape[1]
    if weights is not None:
        _check(weights.dim() == 3 and all(w == n or w == 1 for w, n in zip(weights.shape, (B, T, H))),
               f"hyscale: weights must broadcast to [B, T, H] = [{B}, {T}, {H}], got {tuple(weights.shape)}")
        _check(weights.is_floating_point(), f"hyscale: weights must be floating point, got {weights.dtype}")
    if k is not None:
        _check(k >= 0, f"hyscale: k must be >= 0, got k={k}")
        _check(k <= S, f"hyscale: k={k} is larger than the number of keys S={S}")
    if offsets is not None:
        _check(offsets.dim() == 1 and offsets.shape[0] == B,
               f"hyscale: query_offset tensor must be [B] = [{B}], got {tuple(offsets.shape)}")
    for name, win in (("starts", starts), ("ends", ends)):
        if win is not None:
            _check(win.dim() == 2 and all(w == n or w == 1 for w, n in zip(win.shape, (B, T))),
                   f"hyscale: {name} must broadcast to [B, T] = [{B}, {T}], got {tuple(win.shape)}")
            _check(not win.is_floating_point(), f"hyscale: {name} must be an integer tensor, got {win.dtype}")
    if mask is not None:
        _check(mask.dtype == torch.bool, f"hyscale: mask must be bool here, got {mask.dtype}")
        _check(mask.dim() <= 3, f"hyscale: mask must broadcast to [B, T, S], got {tuple(mask.shape)}")
    if bias is not None:
        _check(bias.is_floating_point(), f"hyscale: additive mask must be floating point, got {bias.dtype}")
        _check(bias.dim() <= 3, f"hyscale: additive mask must broadcast to [B, T, S], got {tuple(bias.shape)}")


def _prepare(q: Tensor, kx: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Kernels take kx with q's batch and fp32 [B, T, H] weights; expand broadcast ones (views, no copy)."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    kx = kx.expand(B, kx.shape[1], kx.shape[2])
    if weights is not None:
        weights = weights.expand(B, T, H)
        weights = weights if weights.dtype == torch.float32 else weights.float()
    return kx, weights


def _vis(causal, offset, offsets, starts, ends, mask, bias, rows=None) -> Visibility:
    if rows is not None:  # windows may broadcast over batch or query rows: give kernels full [B, T] views
        starts = starts.expand(*rows) if starts is not None else None
        ends = ends.expand(*rows) if ends is not None else None
    return Visibility(causal=causal, offset=offset, offsets=offsets, starts=starts, ends=ends, mask=mask, bias=bias)


# ---------------------------------------------------------------------------------------------
# select


@torch.library.custom_op("hyscale::select", mutates_args=())
def select(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, scale: float, relu: bool,
           causal: bool, offset: int, offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
           mask: Tensor | None, bias: Tensor | None, fill: float, sorted: bool) -> tuple[Tensor, Tensor]:
    check_inputs(q, kx, weights, k, offsets, starts, ends, mask, bias)
    vis = _vis(causal, offset, offsets, starts, ends, mask, bias, rows=q.shape[:2])
    kx, weights = _prepare(q, kx, weights)
    impl = dispatch.kernels_for(q)
    return impl.select(q, kx, weights, k, scale, relu, vis, fill, sorted=sorted)


@select.register_fake
def _(q, kx, weights, k, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill, sorted):
    check_inputs(q, kx, weights, k, offsets, starts, ends, mask, bias)
    B, T = q.shape[0], q.shape[1]
    return (q.new_empty((B, T, k), dtype=torch.float32), q.new_empty((B, T, k), dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# rescore


@torch.library.custom_op("hyscale::rescore", mutates_args=())
def rescore(q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor, scale: float, relu: bool,
            causal: bool, offset: int, offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
            mask: Tensor | None, bias: Tensor | None, fill: float) -> Tensor:
    check_inputs(q, kx, weights, None, offsets, starts, ends, mask, bias)
    vis = _vis(causal, offset, offsets, starts, ends, mask, bias, rows=q.shape[:2])
    kx, weights = _prepare(q, kx, weights)
    return dispatch.kernels_for(q).rescore(q, kx, weights, indices, scale, relu, vis, fill)


@rescore.register_fake
def _(q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill):
    check_inputs(q, kx, weights, None, offsets, starts, ends, mask, bias)
    _check(indices.dim() == 3 and indices.shape[0] == q.shape[0] and indices.shape[1] == q.shape[1],
           f"hyscale: indices must be [B, T, k], got {tuple(indices.shape)}")
    return indices.new_empty(indices.shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# sparse backward: gradients through the k selected scores only


@torch.library.custom_op("hyscale::sparse_backward", mutates_args=())
def sparse_backward(grad_values: Tensor, q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor,
                    scale: float, relu: bool, causal: bool, offset: int, offsets: Tensor | None,
                    starts: Tensor | None, ends: Tensor | None, mask: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    vis = _vis(causal, offset, offsets, starts, ends, mask, None, rows=q.shape[:2])
    dq, dkx, dw = dispatch.backward_kernels_for(q).sparse_backward(
        grad_values, q, kx, weights, indices, scale, relu, vis,
        deterministic=torch.are_deterministic_algorithms_enabled())
    return dq, dkx, (dw if dw is not None else q.new_empty((0,), dtype=torch.float32))


@sparse_backward.register_fake
def _(grad_values, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask):
    # contiguous, like every implementation returns (empty_like would copy an input's strides)
    dw = weights.new_empty(weights.shape) if weights is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), kx.new_empty(kx.shape), dw





def _setup(ctx, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask) -> None:
    ctx.save_for_backward(q, kx, weights, indices, offsets, starts, ends, mask)
    ctx.scale, ctx.relu, ctx.causal, ctx.offset = scale, relu, causal, offset


def _grads(ctx, grad_values: Tensor):
    q, kx, weights, indices, offsets, starts, ends, mask = ctx.saved_tensors
    kx_full, w_full = _prepare(q, kx, weights)
    dq, dkx, dw = torch.ops.hyscale.sparse_backward(
        grad_values, q, kx_full, w_full, indices, ctx.scale, ctx.relu, ctx.causal, ctx.offset,
        offsets, starts, ends, mask)
    dkx = _sum_to(dkx, kx)
    dw = _sum_to(dw, weights).to(weights.dtype) if weights is not None else None
    return dq, dkx, dw


def _sum_to(grad: Tensor, like: Tensor) -> Tensor:
    """Reduce a gradient over the dims ``like`` broadcast (size 1 there, larger in the gradient)."""
    dims = [i for i, (g, n) in enumerate(zip(grad.shape, like.shape)) if n == 1 and g != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


def _select_setup(ctx, inputs, output) -> None:
    q, kx, weights, k, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill, sorted = inputs
    _setup(ctx, q, kx, weights, output[1], scale, relu, causal, offset, offsets, starts, ends, mask)
    ctx.mark_non_differentiable(output[1])


def _select_backward(ctx, grad_values, grad_indices):
    dq, dkx, dw = _grads(ctx, grad_values)
    return dq, dkx, dw, None, None, None, None, None, None, None, None, None, None, None, None


def _rescore_setup(ctx, inputs, output) -> None:
    q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill = inputs
    _setup(ctx, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask)


def _rescore_backward(ctx, grad_values):
    dq, dkx, dw = _grads(ctx, grad_values)
    return dq, dkx, dw, None, None, None, None, None, None, None, None, None, None, None


select.register_autograd(_select_backward, setup_context=_select_setup)
rescore.register_autograd(_rescore_backward, setup_context=_rescore_setup)
