"""The rewrite changes no gradient: every input that requires grad gets eager's gradient (a missing one counts
as a difference), ``detach`` and ``no_grad`` boundaries anywhere in the score are honoured, and additive terms
that require grad (a learned bias, an ALiBi-like slope) get theirs.

Inputs are tie-free (positive q and k: no ReLU zeros; random weights), and eager breaks top-k ties by position
as the operator does, so values, indices and gradients compare at rounding level. Each model is compiled with
AOTAutograd (the op's autograd formula in a joint graph) and, for a few, with Inductor.
"""

from __future__ import annotations

import pytest
import torch
from helpers import flat, ties_by_position

import hyscale_compile

B, T, H, D, S, K = 2, 5, 3, 8, 7, 4
NEG = float("-inf")


def _dots(q, k):
    return torch.einsum("bthd,bsd->bths", q, k)


def _score(q, k, w):
    return (torch.relu(_dots(q, k)) * w[..., None]).sum(2)


def _tri():  # additive causal mask; queries are the last T of S keys, rows 0..1 see fewer than K keys
    return torch.full((T, S), NEG).triu(S - T + 1)


def _causal():
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)


def _touch(*xs):  # keeps every input in the graph of the loss, so a leaked gradient shows as nonzero
    return sum(0.0 * x.sum() for x in xs)


# name: (model(q, k, w, extra), extra factory or None, expected decision)
MODELS = {
    "control": (lambda q, k, w, e: _score(q, k, w).topk(K).values, None, "rewritten"),
    "detach_q": (lambda q, k, w, e: _score(q.detach(), k, w).topk(K).values + _touch(q), None, "rewritten"),
    "detach_k": (lambda q, k, w, e: _score(q, k.detach(), w).topk(K).values + _touch(k), None, "rewritten"),
    "detach_w": (lambda q, k, w, e: _score(q, k, w.detach()).topk(K).values + _touch(w), None, "rewritten"),
    "detach_score": (lambda q, k, w, e: _score(q, k, w).detach().topk(K).values + _touch(q, k, w), None,
                     "rewritten"),
    "detach_dots": (lambda q, k, w, e: (torch.relu(_dots(q, k).detach()) * w[..., None]).sum(2).topk(K).values
                    + _touch(q, k), None, "rewritten"),
    "detach_relu": (lambda q, k, w, e: (torch.relu(_dots(q, k)).detach() * w[..., None]).sum(2).topk(K).values
                    + _touch(q, k), None, "rewritten"),
    "learned_bias": (lambda q, k, w, e: (_score(q, k, w) + e).topk(K).values,
                     lambda g: torch.randn(T, S, generator=g) * 0.1, "rewritten"),
    "learned_bias_subtracted": (lambda q, k, w, e: (_score(q, k, w) - e).topk(K).values,
                                lambda g: torch.randn(B, 1, S, generator=g) * 0.1, "rewritten"),
    "alibi_slope": (lambda q, k, w, e: (_score(q, k, w) - e * (torch.arange(T)[:, None] + S - T
                                                               - torch.arange(S)[None, :]).abs().float()
                                        ).topk(K).values, lambda g: torch.rand(1, generator=g) * 0.1, "rewritten"),
    "bias_then_causal_fill": (lambda q, k, w, e: (_score(q, k, w) + e).masked_fill(~_causal(), NEG).topk(K).values,
                              lambda g: torch.randn(T, S, generator=g) * 0.1, "rewritten"),
    "causal_fill_then_bias": (lambda q, k, w, e: (_score(q, k, w).masked_fill(~_causal(), NEG) + e).topk(K).values,
                              lambda g: torch.randn(T, S, generator=g) * 0.1, "rejected"),
    "query_factor_before_relu": (lambda q, k, w, e: (torch.relu(_dots(q, k) * e[..., None]) * w[..., None])
                                 .sum(2).topk(K).values, lambda g: torch.rand(B, T, H, generator=g) + 0.5, "rewritten"),
    "key_scale_before_relu": (lambda q, k, w, e: (torch.relu(_dots(q, k) * e[:, None, None, :]) * w[..., None])
                              .sum(2).topk(K).values, lambda g: torch.rand(B, S, generator=g) + 0.5, "rewritten"),
    # rows with fewer than K visible keys: behind an additive mask the picks' values are score + -inf and
    # their gradient flows (eager's add); behind masked_fill it does not
    "additive_causal": (lambda q, k, w, e: (_score(q, k, w) + _tri()).topk(K).values, None, "rewritten"),
    "masked_fill_causal": (lambda q, k, w, e: _score(q, k, w).masked_fill(~_causal(), NEG).topk(K).values, None,
                           "rewritten"),
    "gathered_values": (lambda q, k, w, e: _gather(_score(q, k, w) + _tri()), None, "rewritten"),
}


def _gather(s):
    idx = s.topk(K).indices
    return s.gather(-1, idx) * 2.0


def _no_grad_block(q, k, w, e):
    with torch.no_grad():
        s = _score(q, k, w)
    return s.topk(K).values + _touch(q, k, w)


def _no_grad_projection(q, k, w, e):
    with torch.no_grad():
        q2 = q * 2.0
    return _score(q2, k, w).topk(K).values + _touch(q)


def _no_grad_view(q, k, w, e):  # a view made under no_grad: Dynamo's example value still says requires_grad
    with torch.no_grad():
        k2 = k[:, :, :]
    return _score(q, k2, w).topk(K).values + _touch(k)


def _no_grad_view_of_q(q, k, w, e):
    with torch.no_grad():
        q2 = q.transpose(1, 2).transpose(1, 2)
    return _score(q2, k, w).topk(K).values + _touch(q)


MODELS["no_grad_score_topk_after"] = (_no_grad_block, None, "rewritten")
MODELS["no_grad_view"] = (_no_grad_view, None, "rewritten")
MODELS["no_grad_view_of_q"] = (_no_grad_view_of_q, None, "rewritten")
MODELS["no_grad_projection"] = (_no_grad_projection, None, "rewritten")


def _inputs(extra, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).abs()
    k = torch.randn(B, S, D, generator=g).abs()
    w = torch.randn(B, T, H, generator=g)
    e = extra(g) if extra is not None else torch.zeros(())
    return [x.requires_grad_() for x in (q, k, w, e)]


def _run(model, inputs, compiled):
    fn = torch.compile(model, backend="hyscale", options={"compiler": compiled}) if compiled else model
    out = fn(*inputs)
    outs = [o for o in flat(out) if o.is_floating_point()]
    g = torch.Generator().manual_seed(1)
    loss = sum((o.float().masked_fill(torch.isinf(o), 0.0) * torch.rand(o.shape, generator=g)).sum()
               for o in outs)
    # -inf picks: their value is replaced by 0 in the loss (masked_fill passes no gradient), so a finite loss
    # still reaches their scores only where eager's own expression does
    grads = None
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return outs, grads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_match_eager(name):
    model, extra, decision = MODELS[name]
    report = hyscale_compile.explain(model, *_inputs(extra))
    assert [s.decision for s in report.sites] == [decision], str(report)
    with ties_by_position():
        want, want_g = _run(model, _inputs(extra), None)
    got, got_g = _run(model, _inputs(extra), "aot_eager")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert (got_g is None) == (want_g is None), "the loss requires grad in one run only"
    for i, (a, b) in enumerate(zip(got_g or (), want_g or ())):
        assert (a is None) == (b is None), f"input {i}: gradient {'missing' if a is None else 'leaked'}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize("name", ["detach_q", "learned_bias", "no_grad_score_topk_after", "additive_causal"])
def test_gradients_match_eager_through_inductor(name):
    model, extra, _ = MODELS[name]
    with ties_by_position():
        want, want_g = _run(model, _inputs(extra, seed=3), None)
    got, got_g = _run(model, _inputs(extra, seed=3), "inductor")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g or (), want_g or ()):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_detached_inputs_are_cut_in_the_graph():
    """The rewrite detaches what the model detaches (not only the values: the op's inputs)."""
    from helpers import captured

    model = MODELS["detach_q"][0]
    _, after, reports = captured(model, *_inputs(None))
    assert [r.decision for r in reports] == ["rewritten"]
    (gm,) = after
    select = next(n for n in gm.graph.nodes if n.target is torch.ops.hyscale.select.default)
    assert select.kwargs["q"].target == "detach"
    assert select.kwargs["kx"].op == "placeholder"
