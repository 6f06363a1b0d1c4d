"""Adversarial models for the attention pass: every site it rewrites computes what eager computes (values,
gradients, dtypes, strides); the others are left alone, with a reason, and still compute eager's values.

Each case was a wrong result, a crash or a misleading report before its fix (found by an adversarial review of
the pass). The picks come from a top-k of an input score (the selection pass leaves it alone), so they are
eager's exactly, except in the whole-layer cases, whose indexer inputs are positive (no ReLU ties).
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import hyscale_compile
from hyscale_compile.passes import report

B, H, T, S, D, K = 2, 2, 6, 10, 8, 4
TOL = dict(rtol=1e-5, atol=1e-5)
MIN = torch.finfo(torch.float32).min


def _inputs(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D,
                                                                                                      generator=g)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, torch.randn(B, T, S, generator=g)


def _causal():
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)


def _compile(fn, *args, **options):
    """(outputs, the attention reports) of ``fn`` compiled by hyscale."""
    torch._dynamo.reset()
    with report.collect() as reports:
        out = torch.compile(fn, backend="hyscale", options={"compiler": "eager", **options})(*args)
    return out, [r for r in reports if r.kind == "attention"]


def _grads(fn, args, leaves):
    out = fn(*args)
    g = torch.Generator().manual_seed(5)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out.detach(), grads


# ---------------------------------------------------------------------------------------------
# 10: what counts as a site


def test_router_mask_feeding_no_attention_is_not_a_site():
    """A MoE router's ``zeros_like(logits, bool).scatter(idx, True)`` then a masked softmax: no q.k^T, no product
    with v, so no attention site (docs/counters.md)."""
    def router(x, w):
        logits = x @ w
        idx = logits.topk(2, dim=-1).indices
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, idx, True)
        return logits.masked_fill(~keep, float("-inf")).softmax(-1)

    x, w = torch.randn(B, T, D), torch.randn(D, 8)
    out, sites = _compile(router, x, w)
    assert sites == [] and "attention_sites" not in counters["hyscale"], dict(counters["hyscale"])
    torch.testing.assert_close(out, router(x, w), **TOL)
    assert not [s for s in hyscale_compile.explain(router, x, w).sites if s.kind == "attention"]
