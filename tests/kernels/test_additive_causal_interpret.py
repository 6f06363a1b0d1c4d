"""The additive causal mask through the Triton kernels (interpreter), bitwise against the reference.

Behind ``score + full(-inf).triu(1)`` a NaN or +inf score is NaN and ranks first; the kernels read the mask
as a Toeplitz bias of one row per batch (``runtime.additive_causal``). Values are multiples of 1/8, so every
score is exact in any summation order.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_compile.runtime import hytopk, reference
from hyscale_compile.runtime.plan import Tuning
from hyscale_compile.runtime.reference import Visibility

NEG_INF = float("-inf")


def _inputs(B=2, T=5, H=2, D=16, S=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randint(-4, 5, (B, T, H, D), generator=g) / 8).to(torch.bfloat16)
    kx = (torch.randint(-4, 5, (B, S, D), generator=g) / 8).to(torch.bfloat16)
    w = (torch.randint(-2, 3, (B, T, H), generator=g) / 4).float()
    return q, kx, w


def _same(a, b):
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _select(q, kx, w, k, vis, fill):
    """The pipeline's selection (forced: these sizes take the table route), and the table route's, the same bits."""
    v, i = hytopk.select(q, kx, w, k, 0.5, True, vis, fill, tuning=Tuning(table=False))
    tv, ti = hytopk.select(q, kx, w, k, 0.5, True, vis, fill, tuning=Tuning(table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i), "table route != pipeline"
    return v, i


@pytest.mark.parametrize("poison", ["none", "nan_query", "inf_key"])
@pytest.mark.parametrize("offsets", [None, torch.tensor([30, 33])])
def test_additive_causal_matches_reference(poison, offsets):
    q, kx, w = _inputs()
    if poison == "nan_query":
        q[0, 2, 1, 3] = float("nan")
    elif poison == "inf_key":
        kx[1, 38, 0] = float("inf")  # behind the mask of every row of batch 1
    vis = Visibility(causal=True, offset=30, offsets=offsets, causal_additive=True)
    v, i = _select(q, kx, w, 8, vis, NEG_INF)
    rv, ri = reference.select(q, kx, w, 8, 0.5, True, vis, NEG_INF)
    assert _same(v, rv) and torch.equal(i, ri)
    if poison != "none":
        assert torch.isnan(rv).any()
    r = hytopk.rescore(q, kx, w, i, 0.5, True, vis, NEG_INF)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))


def test_additive_causal_beside_a_bias_matches_reference():
    q, kx, w = _inputs(seed=1)
    bias = (torch.randint(-3, 3, (5, 40)) / 4).float()
    bias[3, 10] = float("nan")
    vis = Visibility(causal=True, offset=30, bias=bias, causal_additive=True)
    v, i = _select(q, kx, w, 8, vis, NEG_INF)
    rv, ri = reference.select(q, kx, w, 8, 0.5, True, vis, NEG_INF)
    assert _same(v, rv) and torch.equal(i, ri)


def test_additive_causal_with_a_finite_fill_scores_every_key():
    """A bool mask with a finite fill beside the additive triangle: out-of-range keys would carry the fill, not
    -inf, so no row is cut at its limit; every value still equals the reference's."""
    q, kx, w = _inputs(seed=2)
    mask = torch.rand(2, 5, 40, generator=torch.Generator().manual_seed(4)) > 0.2
    vis = Visibility(causal=True, offset=10, mask=mask, causal_additive=True)
    v, i = _select(q, kx, w, 20, vis, -1e4)
    rv, ri = reference.select(q, kx, w, 20, 0.5, True, vis, -1e4)
    assert _same(v, rv) and torch.equal(i, ri)
    assert (rv == -1e4).any() and torch.isinf(rv).any()  # both kinds of masked pick are selected


def test_rows_that_cannot_overflow_stop_at_their_limit():
    from hyscale_compile.runtime import additive_causal

    q, kx, w = _inputs()
    q[1, 3, 0, 0] = float("inf")
    vis = additive_causal.as_bias(Visibility(causal=True, offset=30, causal_additive=True), q, kx, w, 0.5,
                                  NEG_INF)
    want = torch.arange(5).view(1, 5) + 31
    assert torch.equal(vis.ends[0], want[0]) and vis.ends[1, 3] == 40 and torch.equal(vis.ends[1, :3], want[0, :3])
