"""Every indexer spelling found in the wild (tests/models/spellings.py): rewritten and equal to eager, or
left alone with its reason.

Eager runs with ``torch.topk`` breaking ties by lowest position (the operator's documented order) so that
compiled and eager can be compared exactly, padded rows and ReLU-zero ties included.
"""

from __future__ import annotations

import pytest
import torch
from helpers import captured, flat, ties_by_position
from models import spellings
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import TestCase

import hyscale_compile
from hyscale_compile.passes.debug import compact


@pytest.mark.parametrize("name", sorted(spellings.SPELLINGS))
def test_spelling(name):
    module, inputs, expected = spellings.SPELLINGS[name](0)
    report = hyscale_compile.explain(module, *inputs)
    sites = getattr(module, "SITES", 1)
    decisions = [s.decision for s in report.sites]
    if expected == "rewrite":
        assert decisions.count("rewritten") == sites, str(report)
    else:
        assert "rewritten" not in decisions and report.sites, str(report)
        assert all(s.reason for s in report.sites)
    counters.clear()
    if expected == "reject":  # left alone: the model must still run, and equal eager's own top-k exactly
        out = flat(torch.compile(module, backend="hyscale", options={"compiler": "eager"})(*inputs))
        ref = flat(module(*inputs))
    else:
        out = flat(torch.compile(module, backend="hyscale")(*inputs))
        with ties_by_position():
            ref = flat(module(*inputs))
    for o, r in zip(out, ref, strict=True):
        if o.is_floating_point():
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)
        else:
            assert torch.equal(o, r)


def test_window_and_causal_kinds_are_used():
    kinds = {}
    for name in ("deepgemm_ragged_windows", "megatron_thd_minus_one", "deepseek_v4_compressed_keys",
                 "megatron_chunk_inplace", "no_head_weights"):
        module, inputs, _ = spellings.SPELLINGS[name](0)
        kinds[name] = hyscale_compile.explain(module, *inputs).sites[0].mask_kind
    assert kinds == {"deepgemm_ragged_windows": "window", "megatron_thd_minus_one": "window",
                     "deepseek_v4_compressed_keys": "window", "megatron_chunk_inplace": "causal",
                     "no_head_weights": "causal"}


def test_rejections_say_why():
    reasons = {}
    for name in ("nsa_block_selection", "dense_warmup_kl", "minimax_m3_block_max"):
        module, inputs, _ = spellings.SPELLINGS[name](0)
        reasons[name] = hyscale_compile.explain(module, *inputs).sites[0].reason
    assert "score table is read by log_softmax" in reasons["dense_warmup_kl"]
    assert "not part of the indexer form" in reasons["nsa_block_selection"]
    assert "amax" in reasons["minimax_m3_block_max"]


class GoldenSpellings(TestCase):
    """What the pass leaves in the graph for each spelling (compact projection; rejected ones are unchanged)."""

    def golden(self, name):
        module, inputs, _ = spellings.SPELLINGS[name](0)
        _, after, _ = captured(module, *inputs)
        return "\n----\n".join(compact(gm) for gm in after)

    def test_after_graph_break(self):
        self.assertExpectedInline(self.golden("after_graph_break"), """\
mul(in, 1)
----
getitem(in, [Ellipsis, None])
.squeeze(getitem, 3)
hyscale.select(q=in, kx=in, weights=.squeeze, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_checkpointed_sites(self):
        self.assertExpectedInline(self.golden("checkpointed_sites"), """\
tag_activation_checkpoint(wrap_body_0, in, in, in, in, in)
getitem(tag_activation_checkpoint, 0)
tag_activation_checkpoint(wrap_body_1, getitem, in, in, in, in)
getitem(tag_activation_checkpoint, 0)""")

    def test_deepgemm_ragged_windows(self):
        self.assertExpectedInline(self.golden("deepgemm_ragged_windows"), """\
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.to(.unsqueeze, torch.int64)
.unsqueeze(in, 0)
.to(.unsqueeze, torch.int64)
hyscale.select(q=.unsqueeze, kx=.unsqueeze, weights=.unsqueeze, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=.to, ends=.to, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.squeeze(getitem, 0)
.squeeze(getitem, 0)""")

    def test_deepseek_v4_compressed_keys(self):
        self.assertExpectedInline(self.golden("deepseek_v4_compressed_keys"), """\
.view(in, 2, 6, 2, -1)
.mean(.view)
.float(in)
.transpose(.mean, -1, -2)
.float(.transpose)
.float(in)
mul(.float, 0.353553)
add(in, 1)
floordiv(add, 2)
.permute(.float, 0, 2, 1)
.to(floordiv, torch.int64)
hyscale.select(q=.float, kx=.permute, weights=mul, k=4, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=.to, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.unsqueeze(floordiv, -1)
ge(getitem, .unsqueeze)
full_like(getitem, -1)
where(ge, full_like, getitem)""")

    def test_dense_warmup_kl(self):
        self.assertExpectedInline(self.golden("dense_warmup_kl"), """\
einsum(bthd,bsd->bths, in, in)
.relu(einsum)
.unsqueeze(in, -1)
mul(.relu, .unsqueeze)
.sum(mul)
add(.sum, in)
.topk(add, 6)
getitem(.topk, 1)
_set_grad_enabled(False)
einsum(bthd,bshd->bhts, in, in)
truediv(einsum, 4)
getitem(in, [slice(None, None, None), None])
add(truediv, getitem)
softmax(add)
.sum(softmax)
.sum(.sum)
truediv(.sum, .sum)
_set_grad_enabled(True)
log_softmax(add)
add(truediv, 1e-10)
log(add)
sub(log, log_softmax)
mul(truediv, sub)
eq(in, -inf)
.masked_fill(mul, eq, 0)
.sum(.masked_fill)
.mean(.sum)""")

    def test_finfo_min_fill(self):
        self.assertExpectedInline(self.golden("finfo_min_fill"), """\
.float(in)
.transpose(in, -1, -2)
.float(.transpose)
.permute(.float, 0, 2, 1)
hyscale.select(q=.float, kx=.permute, weights=in, k=6, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-3.40282e+38, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_glm5_next_kpool(self):
        self.assertExpectedInline(self.golden("glm5_next_kpool"), """\
.view(in, 2, 6, 2, -1)
.mean(.view)
arange(12)
.view(arange, 1, 6, 2)
.expand(.view, 2, -1, -1)
.float(in)
.transpose(.mean, -1, -2)
.float(.transpose)
.float(in)
mul(.float, 0.353553)
getitem(.expand, [Ellipsis, -1])
getitem(getitem, [slice(None, None, None), None, slice(None, None, None)])
.expand(getitem, 2, 12, -1)
.gather(in, -1, .expand)
.permute(.float, 0, 2, 1)
hyscale.select(q=.float, kx=.permute, weights=mul, k=3, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=.gather, bias=None, fill=-3.40282e+38, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
arange(2)
getitem(arange, [slice(None, None, None), None, None])
.gather(.gather, -1, getitem)
getitem(.expand, [getitem, getitem])
.flatten(getitem, -2)
getitem(.gather, [Ellipsis, None])
.expand_as(getitem, getitem)
.flatten(.expand_as, -2)
invert(.flatten)
.masked_fill(.flatten, invert, -1)""")

    def test_megatron_chunk_inplace(self):
        self.assertExpectedInline(self.golden("megatron_chunk_inplace"), """\
.float(in)
.float(in)
.unsqueeze(in, -1)
.float(.unsqueeze)
.permute(.float, 1, 0, 2, 3)
.permute(.float, 1, 0, 2)
.squeeze(.float, 3)
.permute(.squeeze, 1, 0, 2)
hyscale.select(q=.permute, kx=.permute, weights=.permute, k=6, scale=1, relu=True, causal=True, offset=6, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.to(getitem, torch.int32)""")

    def test_megatron_sequence_first(self):
        self.assertExpectedInline(self.golden("megatron_sequence_first"), """\
.float(in)
.float(in)
.permute(.float, 1, 0, 2, 3)
.permute(.float, 1, 0, 2)
.permute(in, 1, 0, 2)
.unsqueeze(in, 0)
hyscale.select(q=.permute, kx=.permute, weights=.permute, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=.unsqueeze, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_megatron_thd_minus_one(self):
        self.assertExpectedInline(self.golden("megatron_thd_minus_one"), """\
.float(in)
.to(in, torch.int64)
.to(in, torch.int64)
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.unsqueeze(.float, 0)
.unsqueeze(.to, 0)
.to(.unsqueeze, torch.int64)
.unsqueeze(.to, 0)
.to(.unsqueeze, torch.int64)
hyscale.select(q=.unsqueeze, kx=.unsqueeze, weights=.unsqueeze, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=.to, ends=.to, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.squeeze(getitem, 0)
.squeeze(getitem, 0)
.to(.squeeze, torch.int32)
eq(.squeeze, -inf)
.masked_fill(.to, eq, -1)""")

    def test_minimax_m3_block_max(self):
        self.assertExpectedInline(self.golden("minimax_m3_block_max"), """\
.float(in)
.float(in)
.transpose(.float, -1, -2)
matmul(.float, .transpose)
arange(12)
getitem(arange, [None, None, None, slice(None, None, None)])
getitem(in, [slice(None, None, None), None, slice(None, None, None), None])
gt(getitem, getitem)
.masked_fill(matmul, gt, -inf)
.view(.masked_fill, 2, 8, 12, 4, 3)
.amax(.view)
floordiv(in, 3)
getitem(floordiv, [Ellipsis, None])
.unsqueeze(getitem, 1)
.expand(.unsqueeze, -1, 8, -1, -1)
.scatter_(.amax, -1, .expand, inf)
.topk(.amax, 2)
getitem(.topk, 0)
getitem(.topk, 1)
eq(getitem, -inf)
.masked_fill(getitem, eq, -1)""")

    def test_no_grad_indexer(self):
        self.assertExpectedInline(self.golden("no_grad_indexer"), """\
_set_grad_enabled(False)
.float(in)
.transpose(in, -1, -2)
.float(.transpose)
linear(in, in, None)
.float(linear)
mul(.float, 0.353553)
.permute(.float, 0, 2, 1)
hyscale.select(q=.float, kx=.permute, weights=mul, k=6, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=False, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.to(getitem, torch.int32)
_set_grad_enabled(True)
zeros([2, 12, 12])
.long(.to)
.scatter(zeros, -1, .long, True)
.sum(in, -1)
mul(.sum, .scatter)
.sum(mul, -1)""")

    def test_no_head_weights(self):
        self.assertExpectedInline(self.golden("no_head_weights"), """\
hyscale.select(q=in, kx=in, weights=None, k=6, scale=1, relu=True, causal=True, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_no_relu(self):
        self.assertExpectedInline(self.golden("no_relu"), """\
.float(in)
.float(in)
.float(in)
.unsqueeze(in, 0)
hyscale.select(q=.float, kx=.float, weights=.float, k=6, scale=1, relu=False, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=.unsqueeze, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_nsa_block_selection(self):
        self.assertExpectedInline(self.golden("nsa_block_selection"), """\
.view(in, 2, 4, 3, 16)
.mean(.view)
einsum(bthd,bnd->bthn, in, .mean)
mul(einsum, 0.25)
arange(4)
add(arange, 1)
mul(add, 3)
sub(mul, 1)
getitem(sub, [None, slice(None, None, None)])
arange(12)
getitem(arange, [slice(None, None, None), None])
le(getitem, getitem)
getitem(le, [None, slice(None, None, None), None, slice(None, None, None)])
invert(getitem)
.masked_fill(mul, invert, -3.40282e+38)
.softmax(.masked_fill)
.mean(.softmax)
.topk(.mean, 2)
getitem(.topk, 1)""")

    def test_pooled_keys_offset_remap(self):
        self.assertExpectedInline(self.golden("pooled_keys_offset_remap"), """\
.unflatten(in, 1, [4, 3])
.mean(.unflatten)
getitem(in, [Ellipsis, None])
arange(12)
add(arange, 1)
floordiv(add, 3)
.squeeze(getitem, 3)
.unsqueeze(floordiv, 0)
.to(.unsqueeze, torch.int64)
hyscale.select(q=in, kx=.mean, weights=.squeeze, k=3, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=.to, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
getitem(floordiv, [slice(None, None, None), None])
ge(getitem, getitem)
add(getitem, 4)
where(ge, -1, add)""")

    def test_scale_div_sqrt(self):
        self.assertExpectedInline(self.golden("scale_div_sqrt"), """\
hyscale.select(q=in, kx=in, weights=in, k=6, scale=0.25, relu=True, causal=True, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_folded_into_weights(self):
        self.assertExpectedInline(self.golden("scale_folded_into_weights"), """\
.float(in)
linear(.float, in, None)
mul(linear, 0.353553)
.unsqueeze(mul, -1)
mul(.unsqueeze, 0.25)
.squeeze(mul, 3)
.unsqueeze(in, 0)
hyscale.select(q=in, kx=in, weights=.squeeze, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=.unsqueeze, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_inside_relu(self):
        self.assertExpectedInline(self.golden("scale_inside_relu"), """\
.float(in)
mul(.float, 0.353553)
hyscale.select(q=in, kx=in, weights=mul, k=6, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_on_query_per_position(self):
        self.assertExpectedInline(self.golden("scale_on_query_per_position"), """\
.abs(in)
.amax(.abs)
.clamp(.amax)
truediv(.clamp, 448)
.unsqueeze(truediv, -1)
truediv(in, .unsqueeze)
mul(in, 0.25)
.float(truediv)
ones_like(.float)
copysign(ones_like, .float)
.to(copysign, torch.float32)
.unsqueeze(.to, -1)
mul(truediv, .unsqueeze)
abs(.float)
mul(abs, mul)
.unsqueeze(in, 0)
hyscale.select(q=mul, kx=in, weights=mul, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=.unsqueeze, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_scale_outside_relu(self):
        self.assertExpectedInline(self.golden("scale_outside_relu"), """\
.float(in)
.transpose(in, -1, -2)
.float(.transpose)
.float(in)
mul(.float, 0.353553)
.permute(.float, 0, 2, 1)
hyscale.select(q=.float, kx=.permute, weights=mul, k=6, scale=0.25, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_several_sites(self):
        self.assertExpectedInline(self.golden("several_sites"), """\
linear(in, in, None)
.view(linear, 2, 12, 8, 16)
linear(in, in, None)
linear(in, in, None)
hyscale.select(q=.view, kx=linear, weights=linear, k=6, scale=0.25, relu=True, causal=True, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
linear(in, in, None)
.unsqueeze(linear, 1)
.expand(.unsqueeze, -1, 12, -1, -1)
.unsqueeze(getitem, -1)
.expand(.unsqueeze, -1, -1, -1, 32)
gather(.expand, 2, .expand)
softmax(getitem)
.unsqueeze(softmax, -1)
mul(.unsqueeze, gather)
.sum(mul)
add(in, .sum)
linear(add, in, None)
.view(linear, 2, 12, 8, 16)
linear(add, in, None)
linear(add, in, None)
hyscale.select(q=.view, kx=linear, weights=linear, k=6, scale=0.25, relu=True, causal=True, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
linear(add, in, None)
.unsqueeze(linear, 1)
.expand(.unsqueeze, -1, 12, -1, -1)
.unsqueeze(getitem, -1)
.expand(.unsqueeze, -1, -1, -1, 32)
gather(.expand, 2, .expand)
softmax(getitem)
.unsqueeze(softmax, -1)
mul(.unsqueeze, gather)
.sum(mul)
add(add, .sum)
linear(add, in, None)
.view(linear, 2, 12, 8, 16)
linear(add, in, None)
linear(add, in, None)
hyscale.select(q=.view, kx=linear, weights=linear, k=6, scale=0.25, relu=True, causal=True, offset=0, offsets=None, starts=None, ends=None, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
linear(add, in, None)
.unsqueeze(linear, 1)
.expand(.unsqueeze, -1, 12, -1, -1)
.unsqueeze(getitem, -1)
.expand(.unsqueeze, -1, -1, -1, 32)
gather(.expand, 2, .expand)
softmax(getitem)
.unsqueeze(softmax, -1)
mul(.unsqueeze, gather)
.sum(mul)
add(add, .sum)""")

    def test_sort_instead_of_topk(self):
        self.assertExpectedInline(self.golden("sort_instead_of_topk"), """\
hyscale.select(q=in, kx=in, weights=in, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_sum_dtype_float32(self):
        self.assertExpectedInline(self.golden("sum_dtype_float32"), """\
.to(in, torch.bfloat16)
.float(.to)
hyscale.select(q=in, kx=in, weights=.float, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=in, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=True)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)""")

    def test_vllm_key_scale_ragged(self):
        self.assertExpectedInline(self.golden("vllm_key_scale_ragged"), """\
.reshape(in, -1)
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.unsqueeze(.reshape, 0)
.float(.unsqueeze)
.unsqueeze(.unsqueeze, -1)
mul(.float, .unsqueeze)
.unsqueeze(in, 0)
.unsqueeze(in, 0)
.to(.unsqueeze, torch.int64)
.unsqueeze(in, 0)
.to(.unsqueeze, torch.int64)
hyscale.select(q=.unsqueeze, kx=mul, weights=.unsqueeze, k=6, scale=1, relu=True, causal=False, offset=0, offsets=None, starts=.to, ends=.to, mask=None, bias=None, fill=-inf, sorted=True, causal_additive=False, low_precision_grad=False)
getitem(hyscale.select, 0)
getitem(hyscale.select, 1)
.squeeze(getitem, 0)
.squeeze(getitem, 0)""")
