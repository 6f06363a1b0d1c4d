"""The operators the passes emit: ``hyscale::select``, ``hyscale::rescore``, ``hyscale::sparse_backward``.

Each is a ``torch.library.custom_op`` with a fake rule (symbolic sizes work) and, for the first two,
an autograd formula that only touches the k selected keys per query. The implementations dispatch
to the runtime (Triton on CUDA, the plain-PyTorch reference elsewhere); semantics are those of
``runtime/reference.py``.

Visibility arguments, shared by all three ops and in this order:
    causal, offset, offsets, starts, ends, mask, bias
and, last, ``causal_additive`` for select and rescore (see ``runtime.reference.Visibility``).

``low_precision_grad`` (select, rescore; ``low_precision`` of sparse_backward): the model computes the score in
16-bit, so the backward may round the score gradients to the operand dtype for its MMAs; by default they stay
fp32-exact (precision follows the model: the pass sets it from the model's own arithmetic).

Gradients follow the expression the ops stand for: q, kx and weights through the k selected scores, the
additive mask ``bias`` at the selected positions; a pick hidden by a replacing mask (causal, windows, bool
mask: its value is the fill) passes no gradient, one behind the additive causal mask (its value is
score + -inf) passes it like any other, as ``+`` does in eager.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..runtime import dispatch
from ..runtime.kept import kept
from ..runtime.reference import Visibility
from .attention import without_autocast

_QK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(cond, msg) -> None:
    """torch._check(cond, msg), ``msg`` a callable that builds the message (only on failure). A condition that
    is a plain True (concrete sizes, the eager call) returns at once: these checks run on every call, and
    torch._check's own work on a bool cost more than the rest of them."""
    if cond is True:
        return
    torch._check(cond, msg)


def _broadcasts_to(t: Tensor, sizes: tuple) -> bool:
    """``t`` broadcasts to ``sizes`` (right-aligned; each dim equal or 1)."""
    if t.dim() > len(sizes):
        return False
    return all(d == 1 or d == n for d, n in zip(t.shape, sizes[len(sizes) - t.dim():]))


def check_inputs(q: Tensor, kx: Tensor, weights: Tensor | None, k: int | None,
                 offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
                 mask: Tensor | None, bias: Tensor | None, indices: Tensor | None = None) -> None:
    """Shape, dtype and device checks with messages naming the offending argument (symbolic-size safe)."""
    named = (("kx", kx), ("weights", weights), ("query_offset", offsets), ("starts", starts), ("ends", ends),
             ("mask", mask), ("bias", bias), ("indices", indices))
    for name, t in named:
        if t is not None:
            _check(t.device == q.device,
                   lambda name=name, t=t: f"hyscale: {name} is on {t.device} but q is on {q.device}; every tensor "
                                          "argument must be on q's device")
    _check(q.dim() == 4, lambda: f"hyscale: q must be [B, T, H, D], got {q.dim()} dims {tuple(q.shape)}")
    _check(kx.dim() == 3, lambda: f"hyscale: kx must be [B, S, D], got {kx.dim()} dims {tuple(kx.shape)}")
    _check(q.dtype in _QK_DTYPES, lambda: f"hyscale: q dtype {q.dtype} unsupported; use bfloat16, float16 or float32")
    _check(kx.dtype in _QK_DTYPES,
           lambda: f"hyscale: kx dtype {kx.dtype} unsupported; use bfloat16, float16 or float32")
    B, T, H, D = q.shape
    _check(kx.shape[0] == B or kx.shape[0] == 1,
           lambda: f"hyscale: kx batch {kx.shape[0]} is neither q batch {B} nor 1")
    _check(kx.shape[2] == D, lambda: f"hyscale: kx head dim {kx.shape[2]} != q head dim {D}")
    S = kx.shape[1]
    if weights is not None:
        _check(weights.dim() == 3 and all(w == n or w == 1 for w, n in zip(weights.shape, (B, T, H))),
               lambda: f"hyscale: weights must broadcast to [B, T, H] = [{B}, {T}, {H}], got {tuple(weights.shape)}")
        _check(weights.is_floating_point(), lambda: f"hyscale: weights must be floating point, got {weights.dtype}")
    if k is not None:
        _check(k >= 0, lambda: f"hyscale: k must be >= 0, got k={k}")
        _check(k <= S, lambda: f"hyscale: k={k} is larger than the number of keys S={S}")
    if offsets is not None:
        _check(offsets.dim() == 1 and offsets.shape[0] == B,
               lambda: f"hyscale: query_offset tensor must be [B] = [{B}], got {tuple(offsets.shape)}")
        _check(not offsets.is_floating_point() and offsets.dtype != torch.bool,
               lambda: f"hyscale: query_offset tensor must be an integer tensor, got {offsets.dtype}")
    for name, win in (("starts", starts), ("ends", ends)):
        if win is not None:
            _check(win.dim() == 2 and all(w == n or w == 1 for w, n in zip(win.shape, (B, T))),
                   lambda name=name, win=win: f"hyscale: {name} must broadcast to [B, T] = [{B}, {T}], got "
                                              f"{tuple(win.shape)}")
            _check(not win.is_floating_point(),
                   lambda name=name, win=win: f"hyscale: {name} must be an integer tensor, got {win.dtype}")
    if mask is not None:
        _check(mask.dtype == torch.bool, lambda: f"hyscale: mask must be bool here, got {mask.dtype}")
        _check(_broadcasts_to(mask, (B, T, S)),
               lambda: f"hyscale: mask must broadcast to [B, T, S] = [{B}, {T}, {S}], got {tuple(mask.shape)}")
    if bias is not None:
        _check(bias.is_floating_point(),
               lambda: f"hyscale: bias (additive mask) must be floating point, got {bias.dtype}")
        _check(_broadcasts_to(bias, (B, T, S)),
               lambda: f"hyscale: bias (additive mask) must broadcast to [B, T, S] = [{B}, {T}, {S}], got "
                       f"{tuple(bias.shape)}")
    if indices is not None:
        _check(indices.dim() == 3 and indices.shape[0] == B and indices.shape[1] == T,
               lambda: f"hyscale: indices must be [B, T, k] = [{B}, {T}, k], got {tuple(indices.shape)}")
        _check(indices.dtype in (torch.int32, torch.int64),
               lambda: f"hyscale: indices must be int32 or int64, got {indices.dtype}")


def check_inputs_once(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, *others: Tensor | None) -> None:
    """check_inputs on real tensors, skipped where the same sizes, dtypes and devices passed before (what the
    checks read, and all they read): a decode step passes the same every call. Failures are not kept."""
    key = (k, *((t.shape, t.dtype, t.device) if t is not None else None for t in (q, kx, weights, *others)))
    kept(_PASSED, key, lambda: check_inputs(q, kx, weights, k, *others) or True, _PASSED_MAX)


_PASSED: dict[tuple, bool] = {}
_PASSED_MAX = 64


def _prepare(q: Tensor, kx: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Kernels take kx with q's batch and fp32 [B, T, H] weights; expand broadcast ones (views, no copy)."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    if kx.shape[0] != B:  # each view is an op of host work: none where the sizes already agree
        kx = kx.expand(B, kx.shape[1], kx.shape[2])
    if weights is not None:
        if weights.shape != (B, T, H):
            weights = weights.expand(B, T, H)
        weights = weights if weights.dtype == torch.float32 else weights.float()
    return kx, weights


def _own_arithmetic(t: Tensor):
    """Autocast off for the op's own arithmetic (``attention.without_autocast``) where the caller runs under it: a
    custom op's body, and its backward, run in the caller's autocast state (an autocast region the selection stands
    in, compiled with the ``eager`` compiler or called by hand, an autocast around a compiled model, a backward
    called inside one), which would round the reference's fp32 scores to the autocast dtype (and fail its backward).
    Nothing is entered where autocast is off: the check costs a decode step nothing."""
    kind = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if kind is not None and torch.is_autocast_enabled(kind):
        return without_autocast(t.device)
    return _NOTHING


_NOTHING = contextlib.nullcontext()  # reusable: it holds no state


def _vis(causal, offset, offsets, starts, ends, mask, bias, rows=None, causal_additive=False) -> Visibility:
    if rows is not None:  # windows may broadcast over batch or query rows: give kernels full [B, T] views
        starts = starts.expand(*rows) if starts is not None else None
        ends = ends.expand(*rows) if ends is not None else None
    return Visibility(causal=causal, offset=offset, offsets=offsets, starts=starts, ends=ends, mask=mask, bias=bias,
                      causal_additive=causal and causal_additive)


# ---------------------------------------------------------------------------------------------
# select


def select_body(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, scale: float, relu: bool,
                causal: bool, offset: int, offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
                mask: Tensor | None, bias: Tensor | None, fill: float, sorted: bool, causal_additive: bool = False,
                low_precision_grad: bool = False) -> tuple[Tensor, Tensor]:
    """What ``hyscale::select`` runs on real tensors; ``indexer_topk`` calls it directly where the op's
    dispatch would add nothing (``dispatch_adds_nothing``)."""
    check_inputs_once(q, kx, weights, k, offsets, starts, ends, mask, bias)
    vis = _vis(causal, offset, offsets, starts, ends, mask, bias, rows=q.shape[:2], causal_additive=causal_additive)
    kx, weights = _prepare(q, kx, weights)
    impl = dispatch.kernels_for(q)
    with _own_arithmetic(q):
        return impl.select(q, kx, weights, k, scale, relu, vis, fill, sorted=sorted)


select = torch.library.custom_op("hyscale::select", mutates_args=())(select_body)


def dispatch_adds_nothing(q: Tensor, *others: Tensor | None) -> bool:
    """Whether torch's dispatch of ``hyscale::select`` on these tensors would only call ``select_body``: no
    autograd to record (grad off, or no input requires it), no mode, functorch transform, tracer or profiler
    watching, plain tensors, q on CPU or CUDA (a meta or fake tensor goes to the fake rule). The custom op's
    dispatch (its Python autograd wrapper, the redispatch, the output alias checks) costs an eager decode step
    more host time than our own planning. Not asked while Dynamo traces (``indexer_topk`` checks that first):
    a compiled graph must hold the op."""
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active() or torch.autograd._profiler_enabled()
            or torch._C._get_tracing_state()):
        return False
    grad = torch.is_grad_enabled()
    for t in (q, *others):
        if t is not None and (type(t) is not Tensor or (grad and t.requires_grad)):
            return False
    return q.is_cuda or q.is_cpu


@select.register_fake
def _(q, kx, weights, k, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill, sorted,
      causal_additive=False, low_precision_grad=False):
    check_inputs(q, kx, weights, k, offsets, starts, ends, mask, bias)
    B, T = q.shape[0], q.shape[1]
    return (q.new_empty((B, T, k), dtype=torch.float32), q.new_empty((B, T, k), dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# rescore


@torch.library.custom_op("hyscale::rescore", mutates_args=())
def rescore(q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor, scale: float, relu: bool,
            causal: bool, offset: int, offsets: Tensor | None, starts: Tensor | None, ends: Tensor | None,
            mask: Tensor | None, bias: Tensor | None, fill: float, causal_additive: bool = False,
            low_precision_grad: bool = False) -> Tensor:
    check_inputs(q, kx, weights, None, offsets, starts, ends, mask, bias, indices)
    vis = _vis(causal, offset, offsets, starts, ends, mask, bias, rows=q.shape[:2], causal_additive=causal_additive)
    kx, weights = _prepare(q, kx, weights)
    with _own_arithmetic(q):
        return dispatch.kernels_for(q).rescore(q, kx, weights, indices, scale, relu, vis, fill)


@rescore.register_fake
def _(q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill,
      causal_additive=False, low_precision_grad=False):
    check_inputs(q, kx, weights, None, offsets, starts, ends, mask, bias, indices)
    return indices.new_empty(indices.shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# sparse backward: gradients through the k selected scores only


@torch.library.custom_op("hyscale::sparse_backward", mutates_args=())
def sparse_backward(grad_values: Tensor, q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor,
                    scale: float, relu: bool, causal: bool, offset: int, offsets: Tensor | None,
                    starts: Tensor | None, ends: Tensor | None, mask: Tensor | None, low_precision: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor]:
    vis = _vis(causal, offset, offsets, starts, ends, mask, None, rows=q.shape[:2])
    with _own_arithmetic(q):
        dq, dkx, dw = dispatch.backward_kernels_for(q).sparse_backward(
            grad_values, q, kx, weights, indices, scale, relu, vis,
            deterministic=torch.are_deterministic_algorithms_enabled(), low_precision=low_precision)
    return dq, dkx, (dw if dw is not None else q.new_empty((0,), dtype=torch.float32))


@sparse_backward.register_fake
def _(grad_values, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask,
      low_precision=False):
    # contiguous, like every implementation returns (empty_like would copy an input's strides)
    dw = weights.new_empty(weights.shape) if weights is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), kx.new_empty(kx.shape), dw


def _setup(ctx, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias,
           causal_additive, low_precision_grad) -> None:
    ctx.save_for_backward(q, kx, weights, indices, offsets, starts, ends, mask)
    ctx.scale, ctx.relu, ctx.offset, ctx.low_precision = scale, relu, offset, low_precision_grad
    # behind an additive causal mask a pick's value is score + -inf: its gradient flows as through any add
    ctx.causal, ctx.causal_additive = causal, causal and causal_additive
    ctx.bias_shape = None if bias is None else (bias.shape, bias.dtype)


def _grads(ctx, grad_values: Tensor, bias_grad: bool):
    q, kx, weights, indices, offsets, starts, ends, mask = ctx.saved_tensors
    kx_full, w_full = _prepare(q, kx, weights)
    causal = ctx.causal and not ctx.causal_additive  # the mask that replaces values (and stops gradients)
    dq, dkx, dw = torch.ops.hyscale.sparse_backward(
        grad_values, q, kx_full, w_full, indices, ctx.scale, ctx.relu, causal, ctx.offset,
        offsets, starts, ends, mask, ctx.low_precision)
    dkx = _sum_to(dkx, kx)
    dw = _sum_to(dw, weights).to(weights.dtype) if weights is not None else None
    dbias = None
    if bias_grad and ctx.bias_shape is not None:
        vis = _vis(causal, ctx.offset, offsets, starts, ends, mask, None, rows=q.shape[:2])
        dbias = _bias_grad(grad_values, indices, vis, kx.shape[1], *ctx.bias_shape)
    return dq, dkx, dw, dbias


def _bias_grad(grad_values: Tensor, indices: Tensor, vis: Visibility, S: int, shape: torch.Size,
               dtype: torch.dtype) -> Tensor:
    """d values / d bias: each selected, unreplaced value is score + bias there, so the upstream gradient
    lands at its position (a row's indices are distinct: the scatter is exact), summed over broadcast dims.
    Dense like the bias itself; only built when the bias requires grad."""
    B, T, _ = indices.shape
    g = grad_values.float()
    visible = vis.at(0, T, indices.long(), (B, T, S))
    if visible is not None:
        g = torch.where(visible, g, torch.zeros_like(g))
    dense = g.new_zeros(B, T, S).scatter_(-1, indices.long(), g)
    lead = dense.dim() - len(shape)
    dense = dense.sum(tuple(range(lead))) if lead else dense
    return _sum_to(dense, shape).to(dtype)


def _sum_to(grad: Tensor, like: Tensor | torch.Size) -> Tensor:
    """Reduce a gradient over the dims ``like`` broadcast (size 1 there, larger in the gradient)."""
    sizes = like.shape if isinstance(like, Tensor) else like
    dims = [i for i, (g, n) in enumerate(zip(grad.shape, sizes)) if n == 1 and g != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


def _select_setup(ctx, inputs, output) -> None:
    (q, kx, weights, k, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill, sorted,
     causal_additive, low_precision_grad) = inputs
    _setup(ctx, q, kx, weights, output[1], scale, relu, causal, offset, offsets, starts, ends, mask, bias,
           causal_additive, low_precision_grad)
    ctx.mark_non_differentiable(output[1])


def _select_backward(ctx, grad_values, grad_indices):
    dq, dkx, dw, dbias = _grads(ctx, grad_values, ctx.needs_input_grad[12])
    return dq, dkx, dw, None, None, None, None, None, None, None, None, None, dbias, None, None, None, None


def _rescore_setup(ctx, inputs, output) -> None:
    (q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias, fill,
     causal_additive, low_precision_grad) = inputs
    _setup(ctx, q, kx, weights, indices, scale, relu, causal, offset, offsets, starts, ends, mask, bias,
           causal_additive, low_precision_grad)


def _rescore_backward(ctx, grad_values):
    dq, dkx, dw, dbias = _grads(ctx, grad_values, ctx.needs_input_grad[12])
    return dq, dkx, dw, None, None, None, None, None, None, None, None, None, dbias, None, None, None


select.register_autograd(_select_backward, setup_context=_select_setup)
rescore.register_autograd(_rescore_backward, setup_context=_rescore_setup)
