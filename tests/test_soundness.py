"""Adversarial models: every site the pass rewrites must compute what eager computes; the others are left
alone and still run. Inputs are tie-free (positive q and k, random weights), so results compare exactly.

Each case was a wrong result or a crash before its fix (found by an adversarial review of the pass).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import flat, ties_by_position
from torch._dynamo.utils import counters

import hyscale_compile

B, T, H, D, S, K = 2, 5, 3, 8, 7, 4
NEG = float("-inf")


def _qkw(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, D, generator=g).abs(), torch.randn(B, S, D, generator=g).abs(),
            torch.rand(B, T, H, generator=g) + 0.1)


def _dots(q, k):
    return torch.einsum("bthd,bsd->bths", q, k)


def _score(q, k, w):
    return torch.einsum("bths,bth->bts", torch.relu(_dots(q, k)), w)


def _visible():
    """Causal with every row seeing at least K keys (masked picks would tie)."""
    return torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (K - 1)


def relu_of_negated(q, k, w):
    return torch.einsum("bths,bth->bts", torch.relu(-_dots(q, k)), w).topk(K)


def double_negation(q, k, w):
    negated = -_score(q, k, w)
    return (-negated).topk(K)


def negated_scaled_values(q, k, w):
    return (-(torch.einsum("bths,bth->bts", torch.relu(_dots(q, k)), -w) * 2.0)).topk(K)


def scale_after_bias(q, k, w):
    bias = torch.linspace(-5, 5, T * S).view(T, S)
    return ((_score(q, k, w) + bias) * 3.0).topk(K)


def finite_fill_then_scale(q, k, w):
    return (_score(q, k, w).masked_fill(~_visible(), -1.0) * 2.0).topk(K)


def infinite_fill_then_negate(q, k, w):
    return (-(_score(q, k, -w).masked_fill(~_visible(), NEG))).topk(K)


def positive_scale_after_causal_fill(q, k, w):
    return (_score(q, k, w).masked_fill(~_visible(), NEG) * 0.5).topk(K)


def cache_write_between(q, kc, w):
    s = _score(q, kc, w)
    kc[:, 0] = 10.0
    return s.topk(K)


def weights_mutated_between(q, k, w):
    s = (torch.relu(_dots(q, k)) * w[..., None]).sum(2)
    w.mul_(-1)
    return s.topk(K)


def alias_of_mask_mutated(q, k, w):
    b = torch.zeros(T, S)
    b2 = b.detach()
    b.masked_fill_(torch.arange(S)[None, :] > torch.arange(T)[:, None] + (K - 1), NEG)
    return (_score(q, k, w) + b2).topk(K)


def gather_mutated(q, k, w):
    s = _score(q, k, w)
    v, i = s.topk(K)
    g = s.gather(-1, i)
    g.mul_(2.0)
    return v, g


def mask_with_alpha(q, k, w):
    vis = torch.arange(S)[None, :] <= torch.add(torch.arange(T)[:, None], 3, alpha=2)
    return _score(q, k, w).masked_fill(~vis, NEG).topk(K)


def topk_out(q, k, w, ov, oi):
    torch.topk(_score(q, k, w), K, out=(ov, oi))
    return ov, oi


def mask_broadcasts_score(q, k, w):
    return _score(q[:1], k[:1], w[:1]).masked_fill(torch.arange(3 * T * S).view(3, T, S) % 5 == 0, NEG).topk(K)


def repeated_letter(q, k, w):
    return torch.einsum("bhhd,bsd->bhs", q[:, :3], k).relu().topk(K)


def float64_inputs(q, k, w):
    return _score(q.double(), k.double(), w.double()).topk(K)


def query_batch_broadcast(q, k, w):
    return _score(q[:1], k, w[:1]).topk(K)


def inplace_relu_chain(q, k, w):
    s = _dots(q, k) * 0.5
    F.relu(s, inplace=True)
    return (s * w[..., None]).sum(2).topk(K)


CASES = {  # name: (model, decision)
    "relu_of_negated": (relu_of_negated, "rejected"),
    "double_negation": (double_negation, "rewritten"),
    "negated_scaled_values": (negated_scaled_values, "rewritten"),
    "scale_after_bias": (scale_after_bias, "rejected"),
    "finite_fill_then_scale": (finite_fill_then_scale, "rejected"),
    "infinite_fill_then_negate": (infinite_fill_then_negate, "rejected"),
    "positive_scale_after_causal_fill": (positive_scale_after_causal_fill, "rewritten"),
    "cache_write_between": (cache_write_between, "rejected"),
    "weights_mutated_between": (weights_mutated_between, "rejected"),
    "alias_of_mask_mutated": (alias_of_mask_mutated, None),
    "gather_mutated": (gather_mutated, "rewritten"),
    "mask_with_alpha": (mask_with_alpha, "rewritten"),
    "topk_out": (topk_out, "rejected"),
    "mask_broadcasts_score": (mask_broadcasts_score, "rejected"),
    "repeated_letter": (repeated_letter, "rejected"),
    "float64_inputs": (float64_inputs, "rejected"),
    "query_batch_broadcast": (query_batch_broadcast, "rejected"),
    "inplace_relu_chain": (inplace_relu_chain, "rewritten"),
}


def _args(name):
    q, k, w = _qkw()
    if name == "topk_out":
        return q, k, w, torch.empty(B, T, K), torch.empty(B, T, K, dtype=torch.long)
    return q, k, w


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrites_are_exact_and_the_rest_still_run(name):
    model, decision = CASES[name]
    report = hyscale_compile.explain(model, *_args(name))
    if decision is not None:
        assert [s.decision for s in report.sites] == [decision], str(report)
    got = flat(torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*_args(name)))
    want = flat(model(*_args(name)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_mask_with_alpha_is_not_read_as_a_plain_offset():
    report = hyscale_compile.explain(mask_with_alpha, *_args("mask_with_alpha"))
    assert report.sites[0].mask_kind == "bool mask tensor"


# ---------------------------------------------------------------------------------------------
# cases that kill mutants of the legality checks (each mutant gives a wrong result on these tiny models)


def gather_at_other_indices(q, k, w):
    """A gather of the table at indices that are not the top-k's: the table is read, so it must be written."""
    s = _score(q, k, w)
    idx = s.topk(K).indices
    return s.gather(-1, idx.flip(-1) % S), idx


def write_to_q_inside_the_score(q, k, w):
    """q changes between the q.k product and the selection: the op, reading q at the top-k, would see it."""
    s = torch.relu(_dots(q, k))
    q.mul_(-1.0)
    return (s * w[..., None]).sum(2).topk(K)


def triangle_then_finite_fill(q, k, w):
    """(s + full(-inf).triu(1)).masked_fill(~keep, -1e4): rows that see fewer than K keys pick both kinds of
    masked entry; those behind the triangle are -inf (added), those outside keep are -1e4 (replaced)."""
    tri = torch.full((T, S), NEG).triu(1)
    keep = torch.ones(S, dtype=torch.bool)
    keep[1] = False
    return (_score(q, k, w) + tri).masked_fill(~keep, -1e4).topk(K)


@pytest.mark.parametrize("model", [gather_at_other_indices, write_to_q_inside_the_score, triangle_then_finite_fill],
                         ids=lambda f: f.__name__)
def test_legality_mutants_are_caught(model):
    got = flat(torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*_qkw()))
    with ties_by_position():  # masked picks tie; the operator takes the lowest positions
        want = flat(model(*_qkw()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_triangle_then_finite_fill_is_additive_and_rewritten():
    report = hyscale_compile.explain(triangle_then_finite_fill, *_qkw())
    assert [s.decision for s in report.sites] == ["rewritten"]
    assert "causal (additive)" in report.sites[0].mask_kind
    values = triangle_then_finite_fill(*_qkw()).values
    assert (values == -1e4).any() and torch.isinf(values).any()  # both kinds of masked pick occur


# ---------------------------------------------------------------------------------------------
# a reviewer's cases (each was a wrong result or a crash): masks written after they are built, copies whose
# original changes, writes spelled as dunders or foreach, float64 fills, positions in narrow dtypes


def _masked(s, visible):
    return s.masked_fill(~visible, NEG).topk(K)


def prefix_lm_edit_of_arange_mask(q, k, w):
    m = torch.arange(S)[None, :] <= torch.arange(T)[:, None]
    m[:, :3] = True  # the positional causal mask, edited in place: not the causal kind any more
    return _masked(_score(q, k, w), m)


def write_into_ones_before_tril(q, k, w):
    m = torch.ones(T, S, dtype=torch.bool)
    m[:, 2:] = False
    return _masked(_score(q, k, w), m.tril(3))


def triangle_edited_with_masked_fill_(q, k, w):
    tri = torch.full((T, S), NEG).triu(1)
    tri.masked_fill_(torch.arange(S) < 2, 0.0)
    return (_score(q, k, w) + tri).topk(K)


def keys_cloned_then_updated(q, k, w):
    kc = k.clone()
    k.mul_(-1.0)
    return _score(q, kc, w).topk(K)


def bias_updated_by_dunder(q, k, w):
    b = torch.linspace(-1, 1, T * S).view(T, S)
    s = _score(q, k, w) + b
    b.__imul__(-3.0)
    return s.topk(K)


def bias_updated_by_foreach(q, k, w):
    b = torch.linspace(-1, 1, T * S).view(T, S)
    s = _score(q, k, w) + b
    torch._foreach_mul_([b], -3.0)
    return s.topk(K)


def fill_after_float64(q, k, w):
    return _score(q, k, w).to(torch.float64).masked_fill(~_visible(), 1e-50).topk(K)


def positions_in_bfloat16(q, k, w):
    kpos = torch.arange(S, dtype=torch.bfloat16) + 1000
    qpos = torch.arange(T, dtype=torch.bfloat16) + 1000 + (S - T)
    return _masked(_score(q, k, w), kpos[None, :] <= qpos[:, None])


def int32_window_wraps(q, k, w):
    ks = torch.tensor([0, 2**31 - 2, 1, 0, 3], dtype=torch.int32)
    return _masked(_score(q, k, w), torch.arange(S)[None, :] >= ks[:, None] + 3)


def float_arange_start(q, k, w):
    return _masked(_score(q, k, w), torch.arange(0.5, S + 0.5)[None, :] <= torch.arange(T)[:, None] + 2)


REVIEWED = [prefix_lm_edit_of_arange_mask, write_into_ones_before_tril, triangle_edited_with_masked_fill_,
            keys_cloned_then_updated, bias_updated_by_dunder, bias_updated_by_foreach, fill_after_float64,
            positions_in_bfloat16, int32_window_wraps, float_arange_start]


@pytest.mark.parametrize("model", REVIEWED, ids=lambda f: f.__name__)
def test_reviewed_cases_equal_eager(model):
    hyscale_compile.explain(model, *_qkw())  # never raises, whatever it decides
    got = flat(torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"})(*_qkw()))
    with ties_by_position():
        want = flat(model(*_qkw()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_float16_score_arithmetic_is_left_alone():
    """fp16 overflows at 65504 (inf - inf across heads is NaN); the op's fp32 arithmetic would not."""
    def model(q, k, w):
        return (torch.relu(torch.einsum("bthd,bsd->bths", q, k)) * w[..., None]).sum(2).topk(2)

    q = torch.tensor([300.0, 290.0]).half().view(1, 1, 2, 1)
    k = torch.tensor([250.0, 1.0, 2.0, 3.0]).half().view(1, 4, 1)
    w = torch.tensor([1.0, -1.0]).half().view(1, 1, 2)
    report = hyscale_compile.explain(model, q, k, w)
    assert [s.decision for s in report.sites] == ["rejected"] and "float16" in report.sites[0].reason
    got = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(q, k, w)
    assert torch.isnan(got.values[0, 0, 0])


def test_score_combined_with_itself_is_left_alone():
    def model(q, k, w):
        s = _score(q, k, w)
        return (s + s).topk(K)

    report = hyscale_compile.explain(model, *_qkw())
    assert [s.decision for s in report.sites] == ["rejected"] and "from the score itself" in report.sites[0].reason


def test_sort_slice_under_dynamic_shapes_is_rewritten_like_explain_says():
    def model(q, k, w):
        v, i = _score(q, k, w).sort(dim=-1, descending=True)
        return v[..., :K], i[..., :K]

    compiled = torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"}, dynamic=True)
    got = compiled(*_qkw())
    assert dict(counters["hyscale"]).get("selection_rewritten") == 1
    with ties_by_position():
        want = model(*_qkw())
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert hyscale_compile.explain(model, *_qkw()).sites[0].decision == "rewritten"
