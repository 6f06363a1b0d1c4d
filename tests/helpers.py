"""Shared test helpers: what the selection pass did to a graph, and eager runs to compare against."""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from hyscale_compile.passes import report, selection
from hyscale_compile.runtime.reference import order_key

_topk = torch.topk


def flat(x) -> list[torch.Tensor]:
    """Every tensor of a (nested) output, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in flat(item)]


def _topk_ties_by_position(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    if not largest:
        return _topk(input, k, dim, largest, sorted)
    idx = torch.sort(order_key(input.movedim(dim, -1)), dim=-1, descending=True, stable=True).indices[..., :k]
    idx = idx.movedim(-1, dim)
    return torch.return_types.topk((input.gather(dim, idx), idx))


@contextlib.contextmanager
def ties_by_position():
    """Eager torch.topk breaking ties by lowest position, as the operator does (for exact comparisons)."""
    old_fn, old_method = torch.topk, torch.Tensor.topk
    torch.topk = torch.Tensor.topk = _topk_ties_by_position
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = old_fn, old_method


def topk_inputs(model, *args) -> list[torch.Tensor]:
    """The tensors an eager run of ``model(*args)`` selects from (its dense score tables)."""
    seen: list[torch.Tensor] = []
    old_fn, old_method = torch.topk, torch.Tensor.topk

    def spy(input, *a, **kw):
        seen.append(input)
        return _topk(input, *a, **kw)

    torch.topk = torch.Tensor.topk = spy
    try:
        model(*args)
    finally:
        torch.topk, torch.Tensor.topk = old_fn, old_method
    return seen


def captured(model, *args) -> tuple[list[str], list[str], list]:
    """(graph code before, after, reports) for each Dynamo graph of ``model(*args)``, run eagerly."""
    before, after, reports = [], [], []

    def backend(gm: fx.GraphModule, example_inputs):
        before.append(gm.code)
        reports.extend(selection.run(gm))
        after.append(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*args)
    return before, after, reports


def rewritten_with_attention(model, *args) -> tuple[object, list[fx.GraphModule], list]:
    """(model's output, each Dynamo graph after the selection and attention passes, every report), the passes
    run as the backend does with ``options["attention"] = "always"`` and the graphs run eagerly."""
    from hyscale_compile.passes import attention

    graphs = []

    def backend(gm: fx.GraphModule, example_inputs):
        selection.run(gm)
        attention.run(gm, always=True)
        graphs.append(gm)
        return gm.forward

    with report.collect() as reports:
        out = torch.compile(model, backend=backend)(*args)
    return out, graphs, reports


TOL = dict(rtol=1e-4, atol=1e-5, equal_nan=True)


def check_compiled(fn, args, grad=(), compiler="eager", ties=False, backward=False, **tol):
    """Compile ``fn`` with hyscale; assert its outputs, which outputs require grad, and the gradients of the
    inputs at ``grad`` equal eager's (to ``TOL``, or the ``rtol`` / ``atol`` given); return the reports.
    ``backward``: ``.backward()`` instead of autograd.grad (a reentrant checkpoint refuses the latter)."""

    def run(f):
        xs = [a.detach().clone().requires_grad_(i in grad) if a.is_floating_point() else a.clone()
              for i, a in enumerate(args)]
        out = flat(f(*xs))
        leaves = [xs[i] for i in grad]
        losses = [(o.float() * torch.linspace(-1, 2, o.numel()).view(o.shape)).sum() for o in out if o.requires_grad]
        grads = []
        if leaves and losses and backward:
            sum(losses).backward()
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        elif leaves and losses:
            grads = list(torch.autograd.grad(sum(losses), leaves, allow_unused=True, materialize_grads=True))
        return [o.detach() for o in out], grads, [o.requires_grad for o in out]

    torch._dynamo.reset()
    with report.collect() as reports:
        got = run(torch.compile(fn, backend="hyscale", options={"compiler": compiler}))
    if ties:
        with ties_by_position():
            want = run(fn)
    else:
        want = run(fn)
    assert got[2] == want[2], f"requires_grad of the outputs: {got[2]} compiled, {want[2]} eager"
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **{**TOL, **tol})
    return reports
