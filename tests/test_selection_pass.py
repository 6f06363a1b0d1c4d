"""The selection pass on every indexer spelling: rewritten (golden graphs) and equal to eager, or left alone."""

from __future__ import annotations

import indexers
import pytest
import torch
from helpers import captured, flat, topk_inputs
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import TestCase

from hyscale_compile.passes.debug import compact
from hyscale_compile.testing import assert_same_topk


def _compare(out, ref, scores):
    """Outputs of the indexers: (values, indices) pairs or bare indices. Bare indices are compared through the
    eager score table (``scores``): the same sets up to near-ties, by the rule every test uses."""
    out, ref = flat(out), flat(ref)
    assert len(out) == len(ref)
    idx = [i for i, r in enumerate(ref) if not r.is_floating_point()]
    vals = [i for i, r in enumerate(ref) if r.is_floating_point() and r.dim() > 0]
    for i in idx:
        assert out[i].dtype == ref[i].dtype and out[i].shape == ref[i].shape
    for v in vals:
        assert_same_topk(out[v], out[idx[0]], ref[v], ref[idx[0]], rtol=1e-5, atol=1e-5)
    for i in idx:
        o, r = out[i].long(), ref[i].long()
        assert_same_topk(scores.gather(-1, o), o, scores.gather(-1, r), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(indexers.REWRITE))
def test_rewritten_and_equal_to_eager(name):
    torch.manual_seed(0)
    model, args = indexers.REWRITE[name]()
    ref = model(*args)
    scores = topk_inputs(model, *args)[0].float()
    counters.clear()
    out = torch.compile(model, backend="hyscale")(*args)
    assert counters["hyscale"]["selection_rewritten"] == 1, dict(counters["hyscale"])
    assert counters["hyscale"]["selection_rejected"] == 0
    _compare(out, ref, scores)


@pytest.mark.parametrize("name", sorted(indexers.REWRITE))
def test_indices_match_dense_topk_up_to_near_ties(name):
    """Models that return only indices: compare against the dense eager scores at those indices."""
    torch.manual_seed(1)
    model, args = indexers.REWRITE[name]()
    out = flat(torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args))
    ref = flat(model(*args))
    scores = topk_inputs(model, *args)[0].float()
    for o, r in zip(out, ref):
        if not o.is_floating_point():
            o, r = o.long(), r.long()
            # same rows, same k; sets equal except near-ties, checked through the shared rule
            assert_same_topk(scores.gather(-1, o), o, scores.gather(-1, r), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(indexers.REJECT))
def test_rejected_sites_are_untouched(name):
    torch.manual_seed(0)
    model, args = indexers.REJECT[name]()
    before, after, reports = captured(model, *args)
    assert [r.decision for r in reports] == ["rejected"]
    assert reports[0].reason
    assert before == [gm.code for gm in after], "a rejected site must leave the graph byte-for-byte unchanged"
    out = torch.compile(model, backend="hyscale")(*args)
    ref = model(*args)
    torch.testing.assert_close(flat(out)[-1], flat(ref)[-1])


def test_rejection_reasons_name_the_reader():
    model, args = indexers.dense_warmup()
    _, _, reports = captured(model, *args)
    assert "score table is read by log_softmax" in reports[0].reason
    model, args = indexers.per_head_read()
    _, _, reports = captured(model, *args)
    assert "per-head scores" in reports[0].reason and "mean" in reports[0].reason


class GoldenGraphs(TestCase):
    """What the pass leaves in the graph, one spelling each (compact projection, stable across versions)."""

    def golden(self, name):
        torch.manual_seed(0)
        model, args = indexers.REWRITE[name]()
        _, after, reports = captured(model, *args)
        assert [r.decision for r in reports] == ["rewritten"], reports
        return compact(after[0])

    def test_glm_dsa(self):
        self.assertExpectedInline(self.golden("glm_dsa"), """\
.unsqueeze(in, 0)
hyscale.select(q=in, kx=in, weights=in, k=4, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=.unsqueeze, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_deepseek_v32(self):
        self.assertExpectedInline(self.golden("deepseek_v32"), """\
hyscale.select(q=in, kx=in, weights=in, k=4, scale=0.25, relu=True, causal=True, offset=3, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=True, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_weighted_sum(self):
        self.assertExpectedInline(self.golden("weighted_sum"), """\
getitem(in, [Ellipsis, None])
.squeeze(getitem, 3)
hyscale.select(q=in, kx=in, weights=.squeeze, k=4, scale=1, relu=True, causal=True, offset=3, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_folded(self):
        self.assertExpectedInline(self.golden("scale_folded"), """\
mul(in, 0.25)
getitem(mul, [Ellipsis, None])
.squeeze(getitem, 3)
hyscale.select(q=in, kx=in, weights=.squeeze, k=4, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=in, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_after_sum(self):
        self.assertExpectedInline(self.golden("scale_after_sum"), """\
hyscale.select(q=in, kx=in, weights=in, k=4, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.to(getitem, torch.int32)""")

    def test_ellipsis_clamp(self):
        self.assertExpectedInline(self.golden("ellipsis_clamp"), """\
getitem(in, [Ellipsis, None])
.squeeze(getitem, 3)
hyscale.select(q=in, kx=in, weights=.squeeze, k=4, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_per_group(self):
        self.assertExpectedInline(self.golden("per_group"), """\
getitem(in, [slice(None, None, None), slice(None, None, None), None, slice(None, None, None)])
.expand(in, 2, 3, -1, -1, -1)
.flatten(.expand, 0, 1)
.unsqueeze(in, 1)
.expand(.unsqueeze, 2, 3, -1, -1)
.flatten(.expand, 0, 1)
.expand(in, 2, 3, -1, -1)
.flatten(.expand, 0, 1)
.squeeze(getitem, 2)
.unsqueeze(.squeeze, 2)
.expand(.unsqueeze, 2, 3, -1, -1)
.flatten(.expand, 0, 1)
hyscale.select(q=.flatten, kx=.flatten, weights=.flatten, k=4, scale=1, relu=True, causal=True, offset=3, offsets=None, starts=None, ends=None, mask=.flatten, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.unflatten(getitem, 0, [2, 3])
.unflatten(getitem, 0, [2, 3])""")

    def test_bf16_tensor_fill(self):
        self.assertExpectedInline(self.golden("bf16_tensor_fill"), """\
getitem(in, [Ellipsis, None])
.to(getitem, torch.bfloat16)
.squeeze(.to, 3)
.float(.squeeze)
.unsqueeze(in, 0)
hyscale.select(q=in, kx=in, weights=.float, k=4, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=.unsqueeze, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=True)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.to(getitem, torch.bfloat16)""")

    def test_scale_before_relu(self):
        self.assertExpectedInline(self.golden("scale_before_relu"), """\
hyscale.select(q=in, kx=in, weights=None, k=4, scale=0.125, relu=True, causal=True, offset=3, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")


@pytest.mark.parametrize("name", ["deepseek_v32", "weighted_sum", "glm_dsa"])
def test_sequence_length_changes_recompile_at_most_once(name):
    """Automatic dynamic: the second length recompiles with symbolic T and S; later lengths reuse it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from hyscale_compile.backend import hyscale

    counter = CompileCounterWithBackend(lambda gm, ex: hyscale(gm, ex, options={"compiler": "eager"}))
    model = indexers.REWRITE[name]()[0]
    compiled = torch.compile(model, backend=counter)
    for T, S in ((6, 9), (7, 11), (9, 13), (12, 16), (5, 21)):
        torch.manual_seed(T)
        q, k, w = torch.randn(2, T, 4, 16), torch.randn(2, S, 16), torch.randn(2, T, 4)
        extra = (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T),) if name == "glm_dsa" else ()
        out, ref = compiled(q, k, w, *extra), model(q, k, w, *extra)
        out, ref = flat(out), flat(ref)
        assert out[-1].shape == ref[-1].shape
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for 5 sequence lengths"
    assert counters["hyscale"]["selection_rewritten"] == counter.frame_count


def test_symbolic_triu_diagonal_is_causal():
    model = indexers.REWRITE["deepseek_v32"]()[0]
    reports = []
    for T, S in ((6, 9), (7, 11)):
        q, k, w = torch.randn(2, T, 4, 16).bfloat16(), torch.randn(2, S, 16).bfloat16(), torch.randn(2, T, 4)
        reports += captured(model, q, k, w)[2]
    assert [r.mask_kind for r in reports] == ["causal (additive)", "causal (additive)"]
    assert "s" in reports[-1].shapes["q"]  # the second length compiled with symbolic sizes


def test_decode_one_query_through_matmul_is_rewritten():
    """T=1: Dynamo sees the query dim as a size-1 dim shared by q and k; it is still the query dim."""
    model = indexers.REWRITE["deepseek_v32"]()[0]
    q, k, w = torch.randn(2, 1, 4, 16).bfloat16(), torch.randn(2, 9, 16).bfloat16(), torch.randn(2, 1, 4)
    _, _, reports = captured(model, q, k, w)
    assert [r.decision for r in reports] == ["rewritten"]
    out = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(q, k, w)
    ref = model(q, k, w)
    assert_same_topk(out[0], out[1], ref[0], ref[1])
