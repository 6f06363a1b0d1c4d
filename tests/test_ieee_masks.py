"""Non-finite scores under every mask kind: the rewritten site gives eager's values and indices.

Eager's arithmetic decides: ``score + full(-inf).triu(1)`` is NaN where the score is NaN or +inf (and NaN ranks
first), ``masked_fill`` / ``where`` / a bool mask replace the score whatever it was, an additive tensor adds.
Inputs: a NaN in one query's head, +inf in one key, -inf in one head weight (inf * 0 is NaN), and q, k so
large that their products overflow float32. Eager breaks ties by position, as the operator does (NaN ties too).
"""

from __future__ import annotations

import pytest
import torch
from helpers import flat, ties_by_position

import hyscale_compile
from hyscale_compile.testing import assert_same_topk

B, T, H, D, S, K = 2, 6, 3, 8, 9, 4
NEG = float("-inf")


def _score(q, k, w):
    return (torch.relu(torch.einsum("bthd,bsd->bths", q, k)) * w[..., None]).sum(2)


def _causal():
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)


def _tri():
    return torch.full((T, S), NEG).triu(S - T + 1)


def _keep():  # a padding-style bool mask: two keys of batch 1 hidden
    m = torch.ones(B, 1, S, dtype=torch.bool)
    m[1, :, 2:4] = False
    return m


MASKS = {
    "none": lambda s: s,
    "additive_causal": lambda s: s + _tri(),
    "additive_causal_then_finite_fill": lambda s: (s + _tri()).masked_fill(~_keep(), -1e4),
    "masked_fill_causal": lambda s: s.masked_fill(~_causal(), NEG),
    "where_causal": lambda s: torch.where(_causal(), s, NEG),
    "bool_mask_tensor": lambda s: s.masked_fill(~_keep(), NEG),
    "additive_tensor": lambda s: s + torch.where(_keep(), 0.0, NEG),
    "additive_tensor_and_causal": lambda s: s + _tri() + torch.where(_keep(), 0.0, NEG),
    "finite_fill": lambda s: s.masked_fill(~_causal(), -1.0),
}


def _inputs(kind):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, S, D, generator=g)
    w = torch.rand(B, T, H, generator=g) + 0.1
    if kind == "nan_query":
        q[0, 1, 0, 3] = float("nan")
        q[1, 4, 2, 0] = float("nan")
    elif kind == "inf_key":
        k[0, 7, 1] = float("inf")
        k[1, 2, 0] = float("inf")
    elif kind == "inf_weight":
        w[0, 2, 1] = float("inf")  # inf * relu(0) = NaN for keys that head scores 0
    elif kind == "overflow":
        q, k = q * 1e20, k * 1e20
    return q, k, w


@pytest.mark.parametrize("kind", ["nan_query", "inf_key", "inf_weight", "overflow"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_non_finite_scores_follow_eager(mask, kind):
    model = lambda q, k, w: MASKS[mask](_score(q, k, w)).topk(K)  # noqa: E731
    report = hyscale_compile.explain(model, *_inputs(kind))
    assert [s.decision for s in report.sites] == ["rewritten"], str(report)
    with ties_by_position():
        want = flat(model(*_inputs(kind)))
    got = flat(torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"})(*_inputs(kind)))
    assert_same_topk(got[0], got[1], want[0], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0]))


def test_additive_causal_keeps_nan_behind_the_mask():
    """The case that was wrong: a NaN score behind ``+ full(-inf).triu(1)`` is NaN in eager and ranks first."""
    q, k, w = _inputs("inf_key")
    model = lambda q, k, w: (_score(q, k, w) + _tri()).topk(K)  # noqa: E731
    with ties_by_position():
        want = model(q, k, w)
    assert torch.isnan(want.values).any()
    got = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(q, k, w)
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(torch.isnan(got.values), torch.isnan(want.values))


def test_fill_first_then_float_tensor_is_left_alone():
    """fill, then + x: eager's masked value is -inf + x (NaN where x is NaN); the op masks last. Left alone."""
    bias = torch.zeros(T, S)
    bias[0, 8] = float("nan")
    model = lambda q, k, w, b: (_score(q, k, w).masked_fill(~_causal(), NEG) + b).topk(K)  # noqa: E731
    report = hyscale_compile.explain(model, *_inputs("none"), bias)
    assert [s.decision for s in report.sites] == ["rejected"]
    assert "after a masked fill" in report.sites[0].reason
    got = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*_inputs("none"), bias)
    want = model(*_inputs("none"), bias)
    torch.testing.assert_close(got.values, want.values, equal_nan=True)
