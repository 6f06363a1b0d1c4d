"""A threshold on a tie group costs no recovery: the filter keeps the entries above it, the tie stage appends
the group's lowest positions (interpreter, bitwise against the reference).

The families are the ones that overflowed every row before: every key scoring the same (a zero-initialised
weight projection), ReLU zeroing every head for most keys (the k-th value is 0), a few keys repeated. A small
capacity and sample count (Tuning) make the threshold and the tie test bite at interpreter sizes.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_compile.runtime import hytopk, reference, stats
from hyscale_compile.runtime.plan import Tuning
from hyscale_compile.runtime.reference import Visibility

NEG_INF = float("-inf")
TUNING = Tuning(capacity=48, target=24, samples=32, programs=2, table=False)  # the pipeline, not the table


def _inputs(family: str, B=1, T=6, H=2, D=16, S=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randint(-4, 5, (B, T, H, D), generator=g) / 8).to(torch.bfloat16)
    kx = (torch.randint(-4, 5, (B, S, D), generator=g) / 8).to(torch.bfloat16)
    w = (torch.randint(1, 3, (B, T, H), generator=g) / 4).float()
    if family == "all_equal":
        w = torch.zeros_like(w)
    elif family == "relu_zero_majority":  # every dot below 0 but for 5 keys, which score above it
        q, kx = q.abs() + 0.125, -(kx.abs() + 0.125)
        kx[:, [7, 50, 51, 90, 140]] *= -1
    elif family == "dup_keys":
        kx = kx[:, torch.randint(0, 4, (S,), generator=g)]
    return q, kx, w


def _same(a, b):
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("family", ["all_equal", "relu_zero_majority", "dup_keys"])
@pytest.mark.parametrize("vis", [Visibility(), Visibility(causal=True, offset=150)], ids=["full", "causal"])
def test_tie_rows_are_exact_without_recovery(family, vis):
    q, kx, w = _inputs(family)
    k = 12
    stats.reset()
    v, i = hytopk.select(q, kx, w, k, 0.5, True, vis, NEG_INF, tuning=TUNING)
    rv, ri = reference.select(q, kx, w, k, 0.5, True, vis, NEG_INF)
    assert _same(v, rv) and torch.equal(i, ri)
    s = stats.read()
    assert s.rows_recovered == 0, f"{s.rows_recovered} rows recovered"
    r = hytopk.rescore(q, kx, w, i, 0.5, True, vis, NEG_INF)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))


def test_tie_rows_with_mask_bias_and_fill():
    """The tie group may be masked entries (their value is the fill) and the extras may tie it too."""
    q, kx, w = _inputs("all_equal", seed=3)
    mask = torch.rand(1, 6, 160, generator=torch.Generator().manual_seed(1)) > 0.3
    for fill in (0.0, -1.0, NEG_INF):
        vis = Visibility(causal=True, offset=140, mask=mask)
        v, i = hytopk.select(q, kx, w, 12, 0.5, True, vis, fill, tuning=TUNING)
        rv, ri = reference.select(q, kx, w, 12, 0.5, True, vis, fill)
        assert _same(v, rv) and torch.equal(i, ri), fill


def test_a_small_tie_group_still_recovers_exactly():
    """When the group is smaller than the samples said (fewer equal keys than can rank), the row keeps fewer
    than k candidates and is flagged and recovered, as any such row."""
    q, kx, w = _inputs("relu_zero_majority", seed=5)
    kx[:, 8:] = kx[:, 8:] * 0  # keys past 8 score 0; those before: negative dots (0 too) or positive
    v, i = hytopk.select(q, kx, w, 12, 0.5, True, Visibility(), NEG_INF, tuning=TUNING)
    rv, ri = reference.select(q, kx, w, 12, 0.5, True, Visibility(), NEG_INF)
    assert _same(v, rv) and torch.equal(i, ri)


def test_thresholds_mark_tie_rows_and_filter_above_them():
    q, kx, w = _inputs("all_equal")
    pb = hytopk.Problem(q, kx, w, 0.5, True, Visibility(), NEG_INF)
    plan = hytopk.make_plan(pb, 12, TUNING)
    _, th = hytopk.sample_threshold(pb, plan)
    assert bool((th.tie == 1).all())
    assert torch.equal(th.filter_key, th.key + 1)
    q, kx, w = _inputs("random")
    pb = hytopk.Problem(q, kx, w, 0.5, True, Visibility(), NEG_INF)
    _, th = hytopk.sample_threshold(pb, hytopk.make_plan(pb, 12, TUNING))
    assert bool((th.tie == 0).all()) and torch.equal(th.filter_key, th.key)
