"""Adversarial models for the attention pass: every site it rewrites computes what eager computes (values,
gradients, dtypes, strides); the others are left alone, with a reason, and still compute eager's values.

Each case was a wrong result, a crash or a misleading report before its fix (found by an adversarial review of
the pass). The picks come from a top-k of an input score (the selection pass leaves it alone), so they are
eager's exactly, except in the whole-layer cases, whose indexer inputs are positive (no ReLU ties).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._dynamo.utils import counters

import hyscale_compile
from hyscale_compile.passes import report
from hyscale_compile.passes.graph_ops import written_in_place
from hyscale_compile.runtime.sparse_attention import Picks, naive

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
# 1, 2: in-place writes to what the pass reads, in any spelling


def _written_logits(how: str):
    def attn(q, k, v, score):
        idx = score.topk(K, dim=-1).indices
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        if how == "tanh_":  # an in-place soft-cap of the scores
            w.tanh_()
        elif how == "setitem":  # a forced sink logit
            w[..., 0] = 5.0
        elif how == "foreach":
            torch._foreach_mul_([w], 3.0)
        elif how == "view":  # through a view the pass does not know by name
            w.narrow(-1, 0, 2).mul_(3.0)
        index_mask = torch.ones(B, T, S, dtype=torch.bool).scatter(-1, idx, False)[:, None]
        w = w + torch.where(_causal(), 0.0, MIN).masked_fill(index_mask, MIN)
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32), v)

    return attn


@pytest.mark.parametrize("how", ["tanh_", "setitem", "foreach", "view"])
def test_logits_written_in_place_are_left_alone(how):
    fn, args = _written_logits(how), _inputs()
    out, (site,) = _compile(fn, *args)
    assert site.decision == "rejected" and "may change" in site.reason, site.reason
    torch.testing.assert_close(out, fn(*args), **TOL)


def _written_operand(how: str):
    def attn(q, k, v, score):
        idx = score.topk(K, dim=-1).indices
        sel = torch.zeros(B, T, S, dtype=torch.bool).scatter(-1, idx, True)
        if how == "foreach_indices":  # the indices reused as a buffer after the mask is built
            torch._foreach_add_([idx], 1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sel[:, None]), idx
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        if how == "foreach_keys":  # the keys written after the q.k^T product read them
            torch._foreach_mul_([k, v], 2.0)
        elif how == "mask_constant":  # the fill the mask evaluation reads from its constructor, zeroed
            fill = torch.full((), MIN)
            fill.zero_()
            return torch.matmul(F.softmax(w + torch.where(sel[:, None], 0.0, fill), dim=-1), v)
        return torch.matmul(F.softmax(w.masked_fill(~sel[:, None], MIN), dim=-1), v)

    return attn


@pytest.mark.parametrize("how", ["foreach_indices", "foreach_keys", "mask_constant"])
def test_operands_written_in_place_are_left_alone(how):
    fn, args = _written_operand(how), _inputs()
    out, (site,) = _compile(fn, *[a.clone() for a in args])
    assert site.decision == "rejected" and "may change" in site.reason, site.reason
    for a, b in zip(flat_out(out), flat_out(fn(*[a.clone() for a in args]))):
        torch.testing.assert_close(a, b, **TOL)


def flat_out(x):
    return list(x) if isinstance(x, tuple) else [x]


def test_written_in_place_sees_out_and_foreach_writes():
    """The shared helper (selection and attention passes) sees ``out=`` and ``torch._foreach_*_`` writes."""
    graph = fx.Graph()
    a, b, c, d = (graph.placeholder(n) for n in "abcd")
    view = graph.call_method("transpose", (c, 0, 1))
    graph.call_function(torch.add, (a, b), {"out": view})
    graph.call_function(torch._foreach_add_, ([d], 1))
    assert written_in_place(c) and written_in_place(d)
    assert not written_in_place(a) and not written_in_place(b)


# ---------------------------------------------------------------------------------------------
# 3, 4: what hides a key exactly, and the gradient of a row with nothing visible


def _mixed_fill(q, k, v, score, pad):
    idx = score.topk(3, dim=-1).indices
    added = torch.where(_causal()[None, None] & pad[:, None, None, :], 0.0, MIN)
    chosen = torch.zeros(B, T, S, dtype=torch.bool).scatter(-1, idx, True)[:, None]
    w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
    w = (w + torch.where(chosen, added, 0.0)).masked_fill(~chosen, MIN)  # picked: added; not picked: replaced
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32), v)


def test_fill_added_at_some_keys_and_replacing_others_keeps_eager_gradient():
    q, k, v, score = _inputs(requires_grad=True)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :8] = False  # batch 1: the first queries see no key
    torch._dynamo.reset()
    with report.collect() as reports:
        got = _grads(torch.compile(_mixed_fill, backend="hyscale", options={"compiler": "eager"}),
                     (q, k, v, score, pad), (q, k, v))
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rejected" and "added to the score at some keys" in site.reason, site.reason
    want = _grads(_mixed_fill, (q, k, v, score, pad), (q, k, v))
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(a, b, **TOL)
    # without a gradient the values are all that matter: rewritten (the mean of v, as eager)
    with torch.no_grad():
        out, (site,) = _compile(_mixed_fill, q, k, v, score, pad)
        assert site.decision == "rewritten", site.reason
        torch.testing.assert_close(out, _mixed_fill(q, k, v, score, pad), **TOL)


def _finite_fill(fill: float, form: str):
    def attn(q, k, v, score):
        idx = score.topk(2, dim=-1).indices
        chosen = torch.zeros(B, T, S, dtype=torch.bool).scatter(-1, idx, True)[:, None]
        if form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(chosen, 0.0, fill))
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        w = w.masked_fill(~chosen, fill) if form == "replaced" else w + torch.where(chosen, 0.0, fill)
        return torch.matmul(F.softmax(w, dim=-1), v)

    return attn


@pytest.mark.parametrize("form", ["replaced", "added", "sdpa"])
@pytest.mark.parametrize("fill", [-1e4, -1e9])
def test_finite_fill_that_does_not_hide_exactly_is_left_alone(fill, form):
    """BERT's -1e4 (or -1e9): eager's softmax lets a "hidden" key through once the logits reach that size."""
    fn = _finite_fill(fill, form)
    score = torch.arange(S, dtype=torch.float32).repeat(B, T, 1)  # picks keys 9 and 8
    mag = 100.0 if fill == -1e4 else 3e4  # logits +-2.8e4 (+-2.5e9): picked keys' below the fill, the others' above
    q, k = torch.full((B, H, T, D), mag), torch.full((B, H, S, D), mag)
    k[:, :, 8:] = -mag
    v = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(0))
    out, (site,) = _compile(fn, q, k, v, score)
    assert site.decision == "rejected" and "does not hide them exactly" in site.reason, site.reason
    want = fn(q, k, v, score)
    torch.testing.assert_close(out, want, **TOL)
    assert (want - naive_picked_only(q, k, v, score)).abs().max() > 0.1  # the rewrite would have been wrong


def naive_picked_only(q, k, v, score):
    idx = score.topk(2, dim=-1).indices
    out, _ = naive.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx, D ** -0.5, Picks(), "zero")
    return out.transpose(1, 2)


@pytest.mark.parametrize("fill", [float("-inf"), MIN])
def test_fills_that_hide_exactly_are_rewritten(fill):
    for form in ("replaced", "added", "sdpa"):
        fn = _finite_fill(fill, form)
        args = _inputs()
        out, (site,) = _compile(fn, *args)
        assert site.decision == "rewritten", (form, site.reason)
        torch.testing.assert_close(out, fn(*args), **TOL)


# ---------------------------------------------------------------------------------------------
# 5: autocast


def _autocast_attention(form: str, enabled: bool = True):
    def attn(q, k, v, score):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            idx = score.topk(K, dim=-1).indices
            index_mask = torch.ones(B, T, S, dtype=torch.bool).scatter(-1, idx, False)[:, None]
            if form == "sdpa":
                return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal() & ~index_mask)
            w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
            w = w + torch.where(_causal(), 0.0, MIN).masked_fill(index_mask, MIN)
            return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    return attn


@pytest.mark.parametrize("form", ["sdpa", "eager"])
def test_autocast_attention_computes_in_the_autocast_dtype(form):
    """fp32 q, k, v under autocast(bfloat16): eager's attention is bf16, the op's output too (q, k, v cast as
    autocast casts them), and as close to the fp32 attention as eager's (the op rounds once, from fp32 sums)."""
    fn = _autocast_attention(form)
    q, k, v, score = _inputs(requires_grad=True)
    torch._dynamo.reset()
    with report.collect() as reports:
        got = _grads(torch.compile(fn, backend="hyscale", options={"compiler": "eager"}), (q, k, v, score), (q, k, v))
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten" and "autocast" in site.reason, site.reason
    want = _grads(fn, (q, k, v, score), (q, k, v))
    exact = _grads(_autocast_attention(form, enabled=False), (q, k, v, score), (q, k, v))
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for a, b, x in zip([got[0], *got[1]], [want[0], *want[1]], [exact[0], *exact[1]]):
        assert a.dtype == b.dtype
        ours, theirs = (a.float() - x).abs().max(), (b.float() - x).abs().max()
        assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_autocast_around_the_compiled_region():
    fn = _written_logits("none")  # no write: a plain eager attention under an autocast entered outside
    q, k, v, score = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = fn(q, k, v, score)
        out, (site,) = _compile(fn, q, k, v, score)
    assert site.decision == "rewritten", site.reason
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# 6: the output's strides


def _read_output(how: str, form: str):
    def attn(q, k, v, score):
        idx = score.topk(K, dim=-1).indices
        index_mask = torch.ones(B, T, S, dtype=torch.bool).scatter(-1, idx, False)[:, None]
        if form == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal() & ~index_mask)
        else:
            w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
            w = w + torch.where(_causal(), 0.0, MIN).masked_fill(index_mask, MIN)
            o = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32), v)
        if how == "view":
            return o.view(B * H, T, D)
        if how == "as_strided":
            return o.as_strided((B, H * T * D), (H * T * D, 1))
        if how == "inplace":
            o[:, :, 0] = 0.0
            return o.view(B, -1)
        if how == "hf":  # HF's attention functions: no copy of ours needed
            return o.transpose(1, 2).contiguous().reshape(B, T, -1)
        return o

    return attn


@pytest.mark.parametrize("form", ["sdpa", "eager"])
@pytest.mark.parametrize("how", ["plain", "view", "as_strided", "inplace", "hf"])
def test_output_has_eager_strides(how, form):
    fn, args = _read_output(how, form), _inputs()
    out, (site,) = _compile(fn, *args)
    assert site.decision == "rewritten", site.reason
    want = fn(*args)
    assert out.stride() == want.stride()
    torch.testing.assert_close(out, want, **TOL)


# ---------------------------------------------------------------------------------------------
# 7: absorbed MLA with a rope key broadcast over the batch or the positions


@pytest.mark.parametrize("rope_shape", [(1, 1, S, 8), (B, 1, 1, 8)], ids=["shared-by-batch", "one-position"])
def test_mla_rope_key_broadcast(rope_shape):
    Dc, Dr, Dn, Dv = 16, 8, 16, 12
    torch.manual_seed(0)
    kv_b = torch.nn.Linear(Dc, H * (Dn + Dv), bias=False)

    def f(q, c, r, score):
        kv = kv_b(c).view(B, S, H, Dn + Dv).transpose(1, 2)
        k_nope, v = torch.split(kv, [Dn, Dv], dim=-1)
        k = torch.cat((k_nope, r.expand(B, H, S, -1)), dim=-1)
        idx = score.topk(K, dim=-1).indices
        index_mask = torch.ones(B, T, S, dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~index_mask, scale=0.2)

    g = torch.Generator().manual_seed(1)
    q, c, r = (torch.randn(*s, generator=g).requires_grad_() for s in ((B, H, T, Dn + Dr), (B, S, Dc), rope_shape))
    score = torch.randn(B, T, S, generator=g)
    torch._dynamo.reset()
    with report.collect() as reports:
        got = _grads(torch.compile(f, backend="hyscale", options={"compiler": "eager"}), (q, c, r, score), (q, c, r))
    (site,) = [x for x in reports if x.kind == "attention"]
    assert site.decision == "rewritten" and site.layout.startswith("MLA latent"), site.reason
    want = _grads(f, (q, c, r, score), (q, c, r))
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 8: nodes a pass inserted without example values


def test_whole_dsa_layer_indices_straight_from_the_selection():
    """Indexer -> topk(...).indices (no cast) -> scatter -> SDPA in one graph: the scatter reads the selection
    pass's inserted getitem, which has no recorded shape."""
    Hi, Di = 4, 8

    def layer(iq, ik, iw, q, k, v):
        sc = (torch.einsum("bthd,bsd->bths", iq, ik).relu() * iw[..., None]).sum(2)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        idx = sc.masked_fill(~causal, float("-inf")).topk(K, dim=-1).indices
        sel = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, idx, True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(causal & sel)[:, None])

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g).abs() + 0.1 for s in ((B, T, Hi, Di), (B, T, Di), (B, T, Hi))]
    args += [torch.randn(B, H, T, D, generator=g) for _ in range(3)]
    out, (site,) = _compile(layer, *args)
    assert site.decision == "rewritten", site.reason
    assert counters["hyscale"]["selection_rewritten"] == 1
    torch.testing.assert_close(out, layer(*args), **TOL)


def test_picks_shared_by_the_batch():
    """A [T, K] top-k scattered into a [T, S] mask that every batch and head reads."""
    def f(q, k, v, score):
        idx = score[0].topk(K, -1).indices
        im = torch.ones(T, S, dtype=torch.bool).scatter(-1, idx, False)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~im)

    args = _inputs()
    out, (site,) = _compile(f, *args)
    assert site.decision == "rewritten", site.reason
    torch.testing.assert_close(out, f(*args), **TOL)


# ---------------------------------------------------------------------------------------------
# 9: non-finite values at keys a query does not pick


def test_nonfinite_unpicked_key_differs_by_design():
    """Eager multiplies the zero weight of a masked key by its NaN value (or its inf key's score) and gets NaN;
    the sparse op never reads that key (the README's differences by design)."""
    def f(q, k, v, score):
        idx = score.topk(2, dim=-1).indices
        sel = torch.zeros(B, T, S, dtype=torch.bool).scatter(-1, idx, True)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sel)

    q, k, v, score = _inputs()
    score[..., 0] = -100.0  # key 0 is never picked
    v[:, :, 0] = float("nan")
    out, (site,) = _compile(f, q, k, v, score)
    assert site.decision == "rewritten"
    assert f(q, k, v, score).isnan().all() and out.isfinite().all()


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
