"""Forms public model code uses (decode steps, one indexer head, flattened heads, biases written as subtraction,
masks cut from ``full_like``, integer masks, ``argsort``, ``take_along_dim`` ...): each is rewritten and equal to
eager, values, indices and gradients; and the cases that crashed compile now, with a reason where they are
left alone. ``explain`` says what the compile does (the same decision from the same pass).
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


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkw(seed=0, heads=H):
    g = _gen(seed)
    return (torch.randn(B, T, heads, D, generator=g).abs(), torch.randn(B, S, D, generator=g).abs(),
            torch.randn(B, T, heads, generator=g))


def _score(q, k, w):
    return (torch.relu(torch.einsum("bthd,bsd->bths", q, k)) * w[..., None]).sum(2)


def _tri():
    return torch.full((T, S), NEG).triu(S - T + 1)


def decode_query_squeezed(q, k, w):
    """vLLM / SGLang decode: q [B, H, D] (the query dim squeezed away), bmm with the cache, head sum to [B, S]."""
    q1, w1 = q[:, -1], w[:, -1]
    s = torch.bmm(k, q1.transpose(1, 2))  # [B, S, H]
    s = (F.relu(s) * w1[:, None, :]).sum(-1)
    return s.topk(K)


def one_head_hf_matmul(q, k, w):
    """HF DeepSeek-V3.2 indexer code with a single indexer head (q [B, T, 1, D])."""
    q, w = q[:, :, :1], w[:, :, :1]
    s = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.5
    s = F.relu(s)
    s = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)
    return (s + _tri()).topk(K)


def bias_as_subtraction(q, k, w):
    """A distance penalty written ``score - slope * dist``."""
    dist = (torch.arange(T)[:, None] + (S - T) - torch.arange(S)[None, :]).abs().float()
    return (_score(q, k, w) - 0.3 * dist).topk(K)


def flattened_heads_bmm(q, k, w):
    """bmm over (t * h) query rows, then ``.view(b, t, h, s)``."""
    s = torch.bmm(q.reshape(B, T * H, D), k.transpose(1, 2)).view(B, T, H, S)
    return (s.relu() * w[..., None]).sum(2).topk(K)


def mask_from_full_like(q, k, w):
    """``full_like(score, -inf).triu_(1)``: only the score's shape is read."""
    s = _score(q, k, w)
    m = torch.full_like(s, NEG).triu_(S - T + 1)
    return (s + m).topk(K)


def head_mean(q, k, w):
    """Unweighted indexer: ``relu(q . k).mean(dim=heads)``."""
    return torch.einsum("bthd,bsd->bths", q, k).relu().mean(dim=2).topk(K)


def take_along_dim_values(q, k, w):
    s = _score(q, k, w) + _tri()
    idx = s.topk(K).indices
    return torch.take_along_dim(s, idx, dim=-1), idx


def argsort_slice(q, k, w):
    return (_score(q, k, w) + _tri()).argsort(dim=-1, descending=True)[..., :K]


def clamp_min_function(q, k, w):
    return (torch.clamp_min(torch.einsum("bthd,bsd->bths", q, k), 0) * w[..., None]).sum(2).topk(K)


def clip_function(q, k, w):
    return (torch.clip(torch.einsum("bthd,bsd->bths", q, k), min=0) * w[..., None]).sum(2).topk(K)


def int_padding_logical_not(q, k, w):
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, -2:] = 0
    return _score(q, k, w).masked_fill(torch.logical_not(pad)[:, None, :], NEG).topk(K)


def int_additive_penalty(q, k, w):
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, -2:] = 0
    return (_score(q, k, w) + ((pad - 1) * 10000)[:, None, :]).topk(K)


def bool_additive_penalty(q, k, w):
    return (_score(q, k, w) + (torch.arange(S) > 4)).topk(K)


def triangle_inplace_on_ones_like(q, k, w):
    s = _score(q, k, w)
    keep = torch.ones_like(s, dtype=torch.bool).tril_(S - T)
    return s.masked_fill(~keep, NEG).topk(K)


FORMS = [decode_query_squeezed, one_head_hf_matmul, bias_as_subtraction, flattened_heads_bmm, mask_from_full_like,
         head_mean, take_along_dim_values, argsort_slice, int_padding_logical_not, int_additive_penalty,
         bool_additive_penalty, triangle_inplace_on_ones_like]
# the ReLU spelled as a clamp: rewritten where no gradient reaches it (its gradient at 0 is not relu's)
CLAMP_FORMS = [clamp_min_function, clip_function]


def _grads(fn, inputs):
    out = flat(fn(*inputs))
    vals = [o for o in out if o.is_floating_point()]
    if not vals:
        return out, None
    loss = sum((o.masked_fill(torch.isinf(o), 0) * torch.rand(o.shape, generator=_gen(5))).sum() for o in vals)
    return out, torch.autograd.grad(loss, inputs, allow_unused=True)


def _explained_eager_and_compiled(model):
    """explain's decision (asserted: rewritten, without gradients), then eager's (ties by position) and the
    compiled model's outputs and input gradients, the counters cleared before the compile."""
    report = hyscale_compile.explain(model, *_qkw())
    assert [s.decision for s in report.sites] == ["rewritten"], str(report)
    with ties_by_position():
        want, want_g = _grads(model, [x.requires_grad_() for x in _qkw()])
    counters.clear()
    got, got_g = _grads(torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"}),
                        [x.requires_grad_() for x in _qkw()])
    return (want, want_g), (got, got_g)


@pytest.mark.parametrize("model", FORMS, ids=lambda f: f.__name__)
def test_form_is_rewritten_and_equal_to_eager(model):
    (want, want_g), (got, got_g) = _explained_eager_and_compiled(model)
    assert counters["hyscale"]["selection_rewritten"] == 1, "explain and the compile decided differently"
    for a, b in zip(got, want, strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)
    for a, b in zip(got_g or (), want_g or ()):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", CLAMP_FORMS, ids=lambda f: f.__name__)
def test_clamp_form_is_rewritten_without_gradients_and_left_alone_with_them(model):
    (want, want_g), (got, got_g) = _explained_eager_and_compiled(model)
    assert counters["hyscale"]["selection_rejected"] == 1 and not counters["hyscale"]["selection_rewritten"]
    for a, b in zip([*got, *got_g], [*want, *want_g], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class IndexerWithTensorK(torch.nn.Module):
    """``k`` held as a 0-d tensor buffer: the output size is data-dependent, the site is left alone."""

    def __init__(self):
        super().__init__()
        self.register_buffer("index_topk", torch.tensor(K))

    def forward(self, q, k, w):
        return _score(q, k, w).topk(self.index_topk)


def test_k_held_as_a_tensor_is_left_alone_with_a_reason():
    model = IndexerWithTensorK()
    report = hyscale_compile.explain(model, *_qkw())
    assert [s.decision for s in report.sites] == ["rejected"]
    assert "k is a tensor" in report.sites[0].reason
    got = torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"})(*_qkw())
    torch.testing.assert_close(got.values, model(*_qkw()).values)


def test_graph_input_score_names_the_graph_break():
    def model(q, k, w):
        s = _score(q, k, w)
        torch._dynamo.graph_break()
        return s.topk(K)

    report = hyscale_compile.explain(model, *_qkw())
    (site,) = report.sites
    assert "not computed in it" in site.reason and site.graph_input is not None
    assert site.graph_break is not None and "graph break" in str(report)


# ---------------------------------------------------------------------------------------------
# the operators check their arguments and name the wrong one


def _select(q, kx, w=None, **kw):
    args = dict(k=2, scale=1.0, relu=True, causal=False, offset=0, offsets=None, starts=None, ends=None, mask=None,
                bias=None, fill=NEG, sorted=True)
    args.update(kw)
    return torch.ops.hyscale.select(q, kx, w, **args)


@pytest.mark.parametrize("name", ["kx", "weights", "mask", "bias", "query_offset"])
def test_operators_name_a_tensor_on_another_device(name):
    q, kx, w = _qkw()
    meta = {"kx": dict(kx=kx.to("meta")), "weights": dict(w=w.to("meta")),
            "mask": dict(mask=torch.ones(B, T, S, dtype=torch.bool, device="meta")),
            "bias": dict(bias=torch.zeros(T, S, device="meta")),
            "query_offset": dict(causal=True, offsets=torch.zeros(B, dtype=torch.long, device="meta"))}[name]
    args = dict(kx=kx, w=w)
    args.update(meta)
    with pytest.raises(RuntimeError, match=f"{name} is on meta"):
        _select(q, args.pop("kx"), args.pop("w"), **args)


def test_operators_name_a_mask_of_the_wrong_shape():
    q, kx, w = _qkw()
    with pytest.raises(RuntimeError, match=r"mask must broadcast to \[B, T, S\]"):
        _select(q, kx, w, mask=torch.ones(B, T, S + 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"bias \(additive mask\) must broadcast"):
        _select(q, kx, w, bias=torch.zeros(3, T, S))


def test_operators_refuse_a_float_query_offset():
    q, kx, w = _qkw()
    with pytest.raises(RuntimeError, match="query_offset tensor must be an integer tensor"):
        _select(q, kx, w, causal=True, offsets=torch.full((B,), 1.7))
