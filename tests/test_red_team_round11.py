"""Review round 11: indexer and attention code of the newer model families, written as their authors write it, which
the earlier rounds did not try. Selection: DeepSeek-V3.2's indexer preprocessing (a Hadamard rotation by matmul /
``F.linear`` with a fixed matrix, fp8 round trips ``.to(float8_e4m3fn).to(...)``, ``n_heads ** -0.5 * softmax_scale``
on the weights, on the head sum, or negative there), head weights from a softmax or a sigmoid, ``relu(w * s)`` with
negative weights, fp8 key scales that vary per key (after the head sum), near-relu activations (relu6, clamp(min=0.1),
clamp(0, 1), leaky_relu, ``** 2``), other head reductions (mean, amax), constants added, masks written as products,
fills other than -inf (+inf sinks, 0, -1e4, finfo.min; +inf and -inf together), scales after the fill (0.5, -1, 0),
the table transposed (top-k over dim=1 / -2), keys shared by the batch (``[S, D]``, ``[1, S, D]``), per-head keys,
the table flipped / rolled / sliced / with a sink column catted, NSA-style mean-pooled block keys; ``k = min(index_topk,
S)`` under dynamic shapes across S < index_topk; DeepSeek's reference inference code (a k-cache buffer written in
place, ``index_score += mask``, prefill then decode). Training: the DSA KL loss at the picks on a detached indexer,
a dense-warm-up target, a no_grad selection with a second indexer gathered at its picks, gradients through the top-k
values. Attention: an index mask without a head dim where B == H (broadcast onto the heads), one_hot / ``idx[..., None]
== arange`` / ``scatter_add`` count masks, a selection mask (causal) the attention does not repeat, a different mask
in a shared layer's second use, int32 indices, a second use with one more key, the last query row's picks reused,
a sliding window unioned with the picks, NSA blocks expanded to token indices, mask arithmetic (float 0 / 1 masks,
``^``, ``!=``, int sums, products, two -inf biases, partial fills, NaN fills, nan_to_num), gpt-oss attention sinks,
manual and log-softmax, ALiBi before and after the mask, softmax over the wrong dim, nn.Dropout(0.0) in train mode,
the DSA loss reading the attention weights, hand-written sparse attention gathering k / v at the picks.

One bug was found and is left open (xfail): a tensor factor before the relu is folded into q or k, which changes which
scores are inf or NaN (an inf weight or key, q.k overflowing); the "Found in review" test reproduces it. Otherwise
every rewritten site matched eager (forward values,
indices, gradients of every input), and every site that could not be proven was left alone with a reason. The tests
pin those decisions (a site left alone is correct, only slower; a rewritten one must be exact). Tiny sizes: seconds
on the CPU.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, ties_by_position
from torch import nn

from hyscale_compile.passes import report

B, T, S, H, D, K = 2, 6, 8, 2, 8, 4  # the attention's sizes (B == H on purpose: see the broadcast test)
HI, DI = 3, 8  # the indexer's heads and dim
NEG, INF = float("-inf"), float("inf")
MIN = torch.finfo(torch.float32).min
ALL = (0, 1, 2)


def _causal(t=T, s=S, off=None):
    off = s - t if off is None else off
    return torch.arange(s)[None, :] <= torch.arange(t)[:, None] + off


def _qkw(seed=0, t=T, s=S, dt=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, t, HI, DI, generator=g).to(dt), torch.randn(B, s, DI, generator=g).to(dt),
            torch.randn(B, t, HI, generator=g))


def _qk(q, k):
    return torch.einsum("bthd,bsd->bths", q, k)


def _score(q, k, w):
    return (_qk(q, k).relu() * w[..., None]).sum(2) * DI ** -0.5


def _check_sites(fn, args, grad, expect, compiler="eager"):
    """check_compiled with ties broken by position where the selection is expected rewritten (the operator's rule) and
    eager's own torch.topk where it is expected left alone (the compiled graph then runs torch.topk too); ``expect``:
    the decision of each site, in order, as (kind, decision, words of the reason or the mask kind)."""
    ties = all(e[1] == "rewritten" for e in expect if e[0] == "selection")
    reports = check_compiled(fn, args, grad=grad, ties=ties, compiler=compiler)
    got = [(r.kind, r.decision) for r in reports]
    assert got == [e[:2] for e in expect], [(r.kind, r.decision, r.reason) for r in reports]
    for r, (_, _, words) in zip(reports, expect, strict=True):
        assert words in r.reason or words == r.mask_kind, (words, r.mask_kind, r.reason)
    return reports


# ---------------------------------------------------------------------------------------------
# selection: DeepSeek-V3.2's preprocessing, head weights, scales


def _hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h * n ** -0.5


HAD = _hadamard(DI)


def _fp8(x):
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def _v32_rotated(q, k, w):  # rotate_activation as a matmul with a fixed matrix, k = min(index_topk, S)
    s = _score(q @ HAD, k @ HAD, w).masked_fill(~_causal(), NEG)
    return s.topk(min(2048, s.shape[-1]) // 2, dim=-1)


def _v32_linear_fp8(q, k, w):  # F.linear rotation, fp8 round trips, weights * n_heads ** -0.5 * softmax_scale
    q, k = _fp8(F.linear(q, HAD)), _fp8(F.linear(k, HAD))
    w = w * HI ** -0.5 * DI ** -0.5
    s = torch.einsum("bthd,bsd->bths", q, k).relu()
    s = (s * w[..., None]).sum(2) + torch.full((T, S), NEG).triu(S - T + 1)
    return s.topk(K, dim=-1)[1]


def _v32_bf16_upcast_fp8(q, k, w):  # a bf16 model: fp8 round trip in bf16, then upcast to score in fp32
    q, k = _fp8(q.bfloat16()).float(), _fp8(k.bfloat16()).float()
    return _score(q, k, w).masked_fill(~_causal(), NEG).topk(K)


SELECTION_REWRITTEN = {
    "v32_rotated": _v32_rotated,
    "v32_linear_fp8": _v32_linear_fp8,
    "v32_bf16_upcast_fp8": _v32_bf16_upcast_fp8,
    "weights_softmax": lambda q, k, w: (_qk(q, k).relu() * w.softmax(-1)[..., None]).sum(2).topk(K),
    "weights_sigmoid_scaled": lambda q, k, w: torch.einsum(
        "bths,bth->bts", _qk(q, k).relu(), torch.sigmoid(w) * HI ** -0.5 * DI ** -0.5).topk(K),
    "negative_scale_on_the_sum": lambda q, k, w: ((_qk(q, k).relu() * w[..., None]).sum(2) * -0.5).topk(K),
    # folded into q / k: equal for finite inputs (see test_finite_factor_before_the_relu_is_exact)
    "weights_before_the_relu": lambda q, k, w: (w[..., None] * _qk(q, k)).relu().sum(2).topk(K),
    "key_scale_before_the_relu": lambda q, k, w: (w[..., None] * (_qk(q, k) * k.abs().amax(-1)[:, None, None])
                                                  .relu()).sum(2).topk(K),
    "mean_over_heads": lambda q, k, w: _qk(q, k).relu().mean(2).topk(K),
    "heads_last": lambda q, k, w: (w[:, :, None] * torch.einsum("bthd,bsd->btsh", q, k).relu()).sum(-1).topk(K),
    "scale_after_the_fill": lambda q, k, w: (_score(q, k, w).masked_fill(~_causal(), NEG) * 0.5).topk(K),
    "topk_dim1_of_the_transposed_table": lambda q, k, w: _score(q, k, w).masked_fill(~_causal(), NEG)
    .transpose(1, 2).topk(K, dim=1),
    "topk_dim_minus2": lambda q, k, w: _score(q, k, w).transpose(1, 2).topk(K, dim=-2),
    "keys_shared_by_the_batch": lambda q, k, w: (w[..., None] * torch.einsum("bthd,sd->bths", q, k[0]).relu())
    .sum(2).topk(K),
    "keys_of_batch1_expanded": lambda q, k, w: (w[..., None] * _qk(q, k[:1].expand(B, S, DI)).relu()).sum(2).topk(K),
    "keys_with_a_zero_sink_catted": lambda q, k, w: _score(q, torch.cat([torch.zeros(B, 1, DI), k], 1), w).topk(K),
    "mean_pooled_block_keys": lambda q, k, w: _score(q, k.view(B, S // 2, 2, DI).mean(2), w).topk(K // 2),
    "unfold_pooled_block_keys": lambda q, k, w: _score(q, k.unfold(1, 2, 2).mean(-1), w).topk(K // 2),
}


@pytest.mark.parametrize("name", sorted(SELECTION_REWRITTEN))
def test_selection_spellings_rewritten(name):
    (site,) = _check_sites(SELECTION_REWRITTEN[name], _qkw(), ALL, [("selection", "rewritten", "")])
    assert site.rewritten


SELECTION_LEFT_ALONE = {  # name: (model, words of the reason)
    # fp8_index's per-key k scale, applied after the head sum: not positive in general, and per key
    "per_key_scale_after_the_sum": (lambda q, k, w: ((_qk(q, k).relu() * w[..., None]).sum(2)
                                                     * k.sum(-1)[:, None, :]).topk(K), "varies with the key"),
    "weights_over_keys": (lambda q, k, w: (_qk(q, k).relu() * k.sum(-1)[:, None, None, :]).sum(2).topk(K),
                          "varies with the key"),
    "per_head_keys": (lambda q, k, w: (w[..., None] * torch.einsum(
        "bthd,bshd->bths", q, k[:, :, None].expand(B, S, HI, DI) * torch.arange(1.0, HI + 1)[:, None])
        .relu()).sum(2).topk(K), "not over the query's heads"),
    "relu6": (lambda q, k, w: (w[..., None] * F.relu6(_qk(q, k))).sum(2).topk(K), "relu6"),
    "leaky_relu": (lambda q, k, w: (w[..., None] * F.leaky_relu(_qk(q, k))).sum(2).topk(K), "leaky_relu"),
    "clamp_min_nonzero": (lambda q, k, w: (w[..., None] * _qk(q, k).clamp(min=0.1)).sum(2).topk(K), "clamped"),
    "clamp_0_1": (lambda q, k, w: (w[..., None] * _qk(q, k).clamp(0, 1)).sum(2).topk(K), "clamped"),
    "relu_squared": (lambda q, k, w: (w[..., None] * _qk(q, k).relu() ** 2).sum(2).topk(K), "pow"),
    "amax_over_heads": (lambda q, k, w: (w[..., None] * _qk(q, k).relu()).amax(2).topk(K), "amax"),
    "constant_before_relu": (lambda q, k, w: (w[..., None] * (_qk(q, k) + 0.5).relu()).sum(2).topk(K), "constant"),
    "constant_after_the_sum": (lambda q, k, w: (_score(q, k, w) + 0.5).topk(K), "constant"),
    "mask_as_a_product": (lambda q, k, w: (_score(q, k, w) * _causal()).topk(K), "varies with the key"),
    "negative_scale_after_the_fill": (lambda q, k, w: (_score(q, k, w).masked_fill(~_causal(), NEG) * -1.0)
                                      .topk(K), "scaled after a mask"),
    "zero_scale_after_the_fill": (lambda q, k, w: (_score(q, k, w).masked_fill(~_causal(), NEG) * 0.0).topk(K),
                                  "scaled after a mask"),
    "sink_forced_with_inf_and_causal": (lambda q, k, w: _score(q, k, w).masked_fill(~_causal(), NEG)
                                        .masked_fill(torch.arange(S) < 1, INF).topk(K), "two different fill"),
    "table_flipped": (lambda q, k, w: _score(q, k, w).flip(-1).topk(K), "flip"),
    "table_rolled": (lambda q, k, w: _score(q, k, w).roll(1, -1).topk(K), "roll"),
    "table_sliced": (lambda q, k, w: _score(q, k, w)[..., 1:].topk(K), "sliced"),
    "sink_column_catted": (lambda q, k, w: torch.cat([torch.zeros(B, T, 1), _score(q, k, w)], -1).topk(K), "cat"),
    "largest_false_with_inf_fill": (lambda q, k, w: _score(q, k, w).masked_fill(~_causal(), INF)
                                    .topk(K, largest=False), "largest=False"),
}


@pytest.mark.parametrize("name", sorted(SELECTION_LEFT_ALONE))
def test_selection_spellings_left_alone(name):
    fn, words = SELECTION_LEFT_ALONE[name]
    _check_sites(fn, _qkw(), ALL, [("selection", "rejected", words)])


FILLS = {  # a fill other than -inf: the masked picks carry it, and it ranks as eager ranks it
    "sink_plus_inf": (lambda q, k, w: _score(q, k, w).masked_fill(torch.arange(S) < 2, INF).topk(K), "inf"),
    "window_plus_inf": (lambda q, k, w: torch.where(_causal() & ~_causal(off=S - T - 2), INF, _score(q, k, w))
                        .topk(K), "inf"),
    "zero": (lambda q, k, w: _score(q, k, w).masked_fill(~_causal(off=0), 0.0).topk(K), "0.0"),
    "minus_1e4": (lambda q, k, w: _score(q, k, w).masked_fill(~_causal(off=0), -1e4).topk(K), "-10000.0"),
    "finfo_min": (lambda q, k, w: _score(q, k, w).masked_fill(~_causal(off=0), MIN).topk(K), "e+38"),
}


@pytest.mark.parametrize("name", sorted(FILLS))
def test_fills_other_than_minus_inf(name):
    """Negative head weights make scores below 0 (and below -1e4 at times): a fill of 0 or -1e4 is a value that
    ranks among them, and rows past the diagonal (off=0) pick masked keys; +inf forces keys in."""
    fn, words = FILLS[name]
    w_big = _qkw()[2] * 3000.0  # scores of size 1e4: a -1e4 fill lands among them
    (site,) = _check_sites(fn, (*_qkw()[:2], w_big), ALL, [("selection", "rewritten", "")])
    assert "fill value" in site.reason and words in site.reason, site.reason


# Found in review: a tensor factor multiplying the score before the relu (head weights written inside it,
# ``relu(w * q.k)``, a dequant scale per (query, head), ``relu(q.k * q_scale)``) was folded into q: the op computed
# relu((w q).k) where the model computes relu(w * (q.k)), which differ in which scores are inf or NaN (q.k
# overflowing float32 is inf in eager, finite once scaled down by a small w first; an inf weight makes every term of
# (inf q).k infinite). Fixed in rewrite._split_factor: relu(f * s) == |f| * relu(sign(f) * s) bit for bit for every
# finite nonzero f, so the sign goes into q and the magnitude into the head weights; without a relu the factor is a
# head weight. Still apart, and listed in README: an infinite factor (eager's relu(inf * negative) is 0, the op's
# inf * relu(.) NaN), and a factor that varies with the key, which can only fold into the keys.
def _overflowing(kind):
    if kind not in ("overflow", "signs"):
        from test_ieee_masks import _inputs as ieee_inputs

        return ieee_inputs(kind.removeprefix("ieee_"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(1, 2, 2, 4, generator=g) + 0.5, torch.rand(1, 6, 4, generator=g) + 0.5
    w = torch.rand(1, 2, 2, generator=g)
    if kind == "overflow":  # q.k of query 0, head 0 overflows at keys 0..2; its weight is 1e-30
        q[0, 0, 0] *= 1e20
        k[0, :3] *= 1e20
        w[0, 0, 0] = 1e-30
    else:  # negative, zero, huge and tiny factors; mixed-sign dot products
        q, k = q - 0.75, k - 0.75
        w[0, 0] = torch.tensor([-2.0, 0.0])
        w[0, 1] = torch.tensor([3e38, -1e-40])
    return q, k, w


def _factor_model(spelling):
    def model(q, k, w):
        s = torch.einsum("bthd,bsd->bths", q, k)
        if spelling == "weights":
            return torch.relu(w[..., None] * s).sum(2).topk(3)
        if spelling == "weights_and_head_weights":
            return (torch.relu(s * w[..., None]) * w.flip(-1)[..., None]).sum(2).topk(3)
        if spelling == "no_relu":
            return (w[..., None] * s).sum(2).topk(3)
        return (torch.relu(s * k.abs().amax(-1)[:, None, None, :]) * w[..., None]).sum(2).topk(3)

    return model


def _same_as_eager(model, args):
    torch._dynamo.reset()
    with report.collect() as reports:
        got = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args())
    with ties_by_position() if reports[0].rewritten else contextlib.nullcontext():  # the op's tie rule, or topk's
        want = model(*args())
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(torch.isnan(got.values), torch.isnan(want.values))
    torch.testing.assert_close(got.values, want.values, equal_nan=True)
    assert len(reports) == 1
    return reports[0]


@pytest.mark.parametrize("spelling", ["weights", "weights_and_head_weights", "no_relu"])
@pytest.mark.parametrize("kind", ["overflow", "signs", "nan_query", "inf_key", "ieee_overflow"])
def test_finite_factor_before_the_relu_is_exact(spelling, kind):
    """Rewritten, and eager's picks, values and NaN / inf positions, for finite factors of any sign and size."""
    assert _same_as_eager(_factor_model(spelling), lambda: _overflowing(kind)).rewritten


def test_factor_before_the_relu_keeps_its_gradients():
    """relu(f * s) as |f| * relu(sign(f) * s): q, k and f get eager's gradients, negative and zero f included."""
    q, k, w = _overflowing("signs")
    w[0, 1] = torch.tensor([3.0, -0.5])  # the forward test's 3e38 would overflow the gradients' products
    _check_sites(lambda q, k, w: _factor_model("weights_and_head_weights")(q, k, w).values, (q, k, w), ALL,
                 [("selection", "rewritten", "")])


@pytest.mark.xfail(strict=True, reason="README, by design: an infinite factor before the relu, a per-key one")
@pytest.mark.parametrize("spelling, kind", [("weights", "inf_weight"), ("key_scale", "inf_key")])
def test_infinite_factor_before_the_relu_differs_as_documented(spelling, kind):
    _same_as_eager(_factor_model(spelling), lambda: _overflowing(kind))


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_v32_indexer_trained_through_the_topk_values(compiler):
    """The indexer's inputs get gradients only through the top-k values (rows past the diagonal pick -inf)."""
    def model(q, k, w):
        vals, idx = _score(_fp8(q @ HAD), _fp8(k @ HAD), w).masked_fill(~_causal(off=1), NEG).topk(K)
        return torch.where(torch.isfinite(vals), vals, 0.0).pow(2).sum(), idx

    _check_sites(model, _qkw(), ALL, [("selection", "rewritten", "causal")], compiler=compiler)


def test_k_from_the_shapes_under_dynamic_shapes():
    """``k = min(index_topk, S)`` from the shapes, compiled once with dynamic=True, then lengths where S < index_topk
    (k = S: every key, masked ones included) and decode (T = 1)."""
    def model(q, k, w):
        s = _score(q, k, w).masked_fill(~_causal(q.shape[1], k.shape[1]), NEG)
        vals, idx = s.topk(min(K, s.shape[-1]), dim=-1)
        return torch.where(torch.isfinite(vals), vals, 0.0), idx

    compiled = torch.compile(model, backend="hyscale", dynamic=True)
    with report.collect() as reports:
        for t, s in ((5, 8), (3, 3), (2, 2), (4, 12), (1, 9)):
            args = [x.requires_grad_() for x in _qkw(seed=t + s, t=t, s=s)]
            got = compiled(*args)
            grads = torch.autograd.grad(got[0].sum(), args)
            with ties_by_position():
                want = model(*args)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(grads, torch.autograd.grad(want[0].sum(), args))
    assert reports and all(r.rewritten for r in reports), [r.reason for r in reports]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2's reference inference code: a k cache written in place, ``+= mask``, prefill then decode


class _RefIndexer(nn.Module):
    def __init__(self, dim=16, max_len=16):
        super().__init__()
        self.wq, self.wk = nn.Linear(dim, HI * DI, bias=False), nn.Linear(dim, DI, bias=False)
        self.weights_proj, self.k_norm = nn.Linear(dim, HI, bias=False), nn.LayerNorm(DI)
        self.register_buffer("k_cache", torch.zeros(B, max_len, DI), persistent=False)

    def forward(self, x, start_pos, mask):
        bsz, seqlen, _ = x.shape
        end_pos = start_pos + seqlen
        q = _fp8(F.linear(self.wq(x).view(bsz, seqlen, HI, DI), HAD))
        k = _fp8(F.linear(self.k_norm(self.wk(x)), HAD))
        self.k_cache[:bsz, start_pos:end_pos] = k
        weights = (self.weights_proj(x) * HI ** -0.5).unsqueeze(-1) * DI ** -0.5
        index_score = (torch.einsum("bshd,btd->bsht", q, self.k_cache[:bsz, :end_pos]).relu() * weights).sum(2)
        if mask is not None:
            index_score += mask
        return index_score.topk(min(K, end_pos), dim=-1)[1]


class _RefAttention(nn.Module):
    """The naive MLA path's index mask: ``full(-inf).scatter_(-1, idx, 0)``, ``+= mask``, scores [B, T, H, S]."""

    def __init__(self, dim=16):
        super().__init__()
        self.indexer = _RefIndexer(dim)
        self.wq, self.wkv, self.wo = (nn.Linear(dim, H * D, bias=False), nn.Linear(dim, 2 * H * D, bias=False),
                                      nn.Linear(H * D, dim, bias=False))

    def forward(self, x, mask):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, H, D)
        k, v = self.wkv(x).view(bsz, seqlen, H, 2 * D).split(D, -1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * D ** -0.5
        index_mask = torch.full((bsz, seqlen, seqlen), NEG).scatter_(-1, self.indexer(x, 0, mask), 0)
        index_mask += mask
        scores += index_mask.unsqueeze(2)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        return self.wo(torch.einsum("bsht,bthd->bshd", scores, v).flatten(2))


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_reference_indexer_prefill_then_decode(compiler):
    torch.manual_seed(0)
    eager = _RefIndexer()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="hyscale", options={"compiler": compiler})
    x, xd = torch.randn(B, T, 16), torch.randn(B, 1, 16)
    mask = torch.full((T, T), NEG).triu(1)  # rows 0..K-2 see fewer than K keys: masked picks, lowest first
    with report.collect() as reports:
        got = compiled(x, 0, mask), compiled(xd, T, None)
    with ties_by_position():
        want = eager(x, 0, mask), eager(xd, T, None)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(model.k_cache, eager.k_cache)
    assert [r.decision for r in reports] == ["rewritten", "rewritten"], [r.reason for r in reports]
    assert reports[0].mask_kind == "additive mask tensor"


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_reference_attention_with_the_index_mask(compiler):
    """Selection rewritten; the [B, T, H, S] einsum attention is no site (left dense); gradients of every parameter."""
    torch.manual_seed(0)
    eager = _RefAttention()
    model = copy.deepcopy(eager)
    x, mask = torch.randn(B, T, 16), torch.full((T, T), NEG).triu(1)
    with report.collect() as reports:
        got = torch.compile(model, backend="hyscale", options={"compiler": compiler})(x, mask)
    with ties_by_position():
        want = eager(x, mask)
    torch.testing.assert_close(got, want, **{"rtol": 1e-4, "atol": 1e-5})
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, list(model.parameters()), g, materialize_grads=True),
                    torch.autograd.grad(want, list(eager.parameters()), g, materialize_grads=True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert [(r.kind, r.decision) for r in reports] == [("selection", "rewritten")], [r.reason for r in reports]


# ---------------------------------------------------------------------------------------------
# attention consumers


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    qi, ki, w = (torch.randn(B, T, HI, DI, generator=g), torch.randn(B, S, DI, generator=g),
                 torch.randn(B, T, HI, generator=g))
    return (qi, ki, w, *(torch.randn(B, H, n, D, generator=g) for n in (T, S, S)))


ATT_ALL = (0, 1, 2, 3, 4, 5)


def _picks(qi, ki, w, off=S - T, fill=NEG):
    return _score(qi, ki, w).masked_fill(~_causal(off=off), fill).topk(K).indices


def _picked(idx, s=S):
    return torch.zeros(B, idx.shape[1], s, dtype=torch.bool).scatter(-1, idx, True)


def _sdpa(mask):
    def attn(qi, ki, w, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(_picked(_picks(qi, ki, w))[:, None], _causal()))

    return attn


def _eager(scores):
    def attn(qi, ki, w, q, k, v):
        a = scores(q @ k.transpose(-1, -2) * D ** -0.5, _picked(_picks(qi, ki, w))[:, None], _causal())
        return a.softmax(-1) @ v

    return attn


SEL, ATT = ("selection", "rewritten", "causal"), "attention"

MASK_SPELLINGS = {  # name: (model, the attention's decision, words of its reason or its mask kind)
    "int_sum_eq_2": (_sdpa(lambda p, c: (p.int() + c.int()) == 2), "rewritten", "causal"),
    "bool_product": (_sdpa(lambda p, c: p * c), "rewritten", "causal"),
    "two_minus_inf_biases": (_sdpa(lambda p, c: torch.where(p, 0.0, NEG) + torch.where(c, 0.0, NEG)), "rewritten",
                             "causal"),
    "float_0_1_mask": (_sdpa(lambda p, c: (p & c).float()), "rejected", "does not keep exactly the picked"),
    "float_0_1_bias": (_sdpa(lambda p, c: torch.where(p & c, 1.0, 0.0)), "rejected", "does not keep exactly"),
    "ne": (_sdpa(lambda p, c: p != ~c), "rejected", "does not keep exactly the picked"),
    "int_sum_ge_1": (_sdpa(lambda p, c: (p.int() + c.int()) >= 1), "rejected", "does not keep exactly the picked"),
    "partial_bias": (_sdpa(lambda p, c: torch.where(p & c, 0.0, -5.0)), "rejected", "does not hide them exactly"),
    "min_plus_min": (_sdpa(lambda p, c: (~p).float() * MIN + (~c).float() * MIN), "rejected", "neither 0 nor"),
    "eager_where": (_eager(lambda a, p, c: torch.where(p & c, a, MIN)), "rewritten", "causal"),
    "eager_where_swapped": (_eager(lambda a, p, c: torch.where(p & c, MIN, a)), "rejected", "does not keep exactly"),
    "eager_fill_positive": (_eager(lambda a, p, c: a.masked_fill(~(p & c), 5.0)), "rejected", "does not hide"),
    "eager_fill_nan": (_eager(lambda a, p, c: a.masked_fill(~(p & c), float("nan"))), "rejected", "does not hide"),
    "eager_fill_then_shift": (_eager(lambda a, p, c: a.masked_fill(~(p & c), MIN) + 1e38), "rejected",
                              "does not hide"),
    "eager_fill_then_zero": (_eager(lambda a, p, c: a.masked_fill(~p, MIN).masked_fill(~c, 0.0)), "rejected",
                             "does not keep exactly"),
    "eager_times_keep": (_eager(lambda a, p, c: a * (p & c)), "rejected", "scales the scores"),
    "eager_scale_after_the_fill": (_eager(lambda a, p, c: a.masked_fill(~(p & c), MIN) * 2.0), "rejected",
                                   "scales the scores"),
    "eager_alibi_after_the_fill": (_eager(lambda a, p, c: a.masked_fill(~(p & c), MIN) + torch.arange(S) * 0.1),
                                   "rejected", "cannot read"),
    "eager_alibi_before_the_fill": (_eager(lambda a, p, c: (a + torch.arange(S) * 0.1).masked_fill(~(p & c), MIN)),
                                    "rejected", "not the scores"),
}


@pytest.mark.parametrize("name", sorted(MASK_SPELLINGS))
def test_mask_spellings(name):
    fn, decision, words = MASK_SPELLINGS[name]
    _check_sites(fn, _inputs(), ATT_ALL, [SEL, (ATT, decision, words)])


NO_ATTENTION_SITE = {  # the attention is no site at all: left dense, the selection still rewritten
    "xor": _sdpa(lambda p, c: p ^ ~c),
    "minimum": _sdpa(lambda p, c: torch.minimum(p, c.expand_as(p))),
    "log_of_a_0_1_mask": _sdpa(lambda p, c: (p & c).float().log()),
    "manual_softmax": lambda qi, ki, w, q, k, v: _manual_softmax(
        (q @ k.transpose(-1, -2)).masked_fill(~(_picked(_picks(qi, ki, w))[:, None] & _causal()), MIN)) @ v,
    "log_softmax_exp": lambda qi, ki, w, q, k, v: (q @ k.transpose(-1, -2)).masked_fill(
        ~(_picked(_picks(qi, ki, w))[:, None] & _causal()), MIN).log_softmax(-1).exp() @ v,
    "gpt_oss_sinks": lambda qi, ki, w, q, k, v: _with_sinks(
        (q @ k.transpose(-1, -2)).masked_fill(~(_picked(_picks(qi, ki, w))[:, None] & _causal()), MIN)) @ v,
    "renormalised_after_the_softmax": lambda qi, ki, w, q, k, v: _renormalised(
        (q @ k.transpose(-1, -2)).softmax(-1) * (_picked(_picks(qi, ki, w))[:, None] & _causal())) @ v,
}


def _manual_softmax(a):
    e = torch.exp(a - a.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


SINKS = torch.linspace(-1, 1, H)


def _with_sinks(a):
    c = torch.cat([a, SINKS.reshape(1, -1, 1, 1).expand(B, -1, T, 1)], -1)
    return F.softmax(c - c.max(-1, keepdim=True).values, -1, dtype=c.dtype)[..., :-1]


def _renormalised(p):
    return p / p.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", sorted(NO_ATTENTION_SITE))
def test_attentions_that_are_no_site(name):
    _check_sites(NO_ATTENTION_SITE[name], _inputs(), ATT_ALL, [SEL])


def _broadcast_onto_heads(qi, ki, w, q, k, v):
    """A [B, T, S] index mask given to SDPA without ``[:, None]``: it broadcasts as [1, B, T, S], batch row b's
    picks onto head b of every batch row (B == H here, so eager runs): no batch-aligned rewrite may take it."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_picked(_picks(qi, ki, w)) & _causal())


def _selection_mask_not_repeated(qi, ki, w, q, k, v):
    """Rows 0..2 see fewer than K keys: their picks include keys past the diagonal, which the attention (no causal
    of its own) attends to."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_picked(_picks(qi, ki, w, off=1))[:, None])


def _selection_mask_not_repeated_eager(qi, ki, w, q, k, v):
    bias = torch.full((B, T, S), MIN).scatter(-1, _picks(qi, ki, w, off=1), 0.0)
    a = q @ k.transpose(-1, -2) * D ** -0.5 + bias[:, None]
    return torch.softmax(a, -1, dtype=torch.float32).to(q.dtype) @ v


def _window_in_the_attention(qi, ki, w, q, k, v):
    keep = _picked(_picks(qi, ki, w, off=1)) & _causal(off=3) & ~_causal(off=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _window_unioned(qi, ki, w, q, k, v):
    keep = (_picked(_picks(qi, ki, w)) | (_causal() & ~_causal(off=S - T - 3))) & _causal()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _nsa_blocks_expanded(qi, ki, w, q, k, v):
    blocks = _score(qi, ki.view(B, S // 2, 2, DI).mean(2), w).masked_fill(~_causal(s=S // 2, off=-1), NEG)
    tokens = (blocks.topk(2).indices[..., None] * 2 + torch.arange(2)).flatten(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(tokens) & _causal())[:, None])


def _one_hot_mask(qi, ki, w, q, k, v):
    keep = F.one_hot(_picks(qi, ki, w), S).sum(-2).bool() & _causal()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _arange_eq_mask(qi, ki, w, q, k, v):
    keep = (_picks(qi, ki, w)[..., None] == torch.arange(S)).any(-2) & _causal()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _scatter_add_count(qi, ki, w, q, k, v):
    keep = (torch.zeros(B, T, S).scatter_add(-1, _picks(qi, ki, w), torch.ones(B, T, K)) > 0) & _causal()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _shared_int32_other_mask(qi, ki, w, q, k, v):
    """GLM-5's shared layers: the next layer reuses int32 picks under a padding mask instead of causal."""
    idx = _picks(qi, ki, w).to(torch.int32)
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx.long()) & _causal())[:, None])
    pad = torch.arange(S) >= torch.tensor([0, 2])[:, None]
    o2 = F.scaled_dot_product_attention(o1, k, v, attn_mask=(_picked(idx.to(torch.int64)) & pad[:, None])[:, None])
    return o2, idx


def _shared_one_more_key(qi, ki, w, q, k, v):
    """The second use scatters along S + 1 keys (its cache grew by one)."""
    idx = _picks(qi, ki, w)
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None])
    k2, v2 = torch.cat([k, k[:, :, :1] * 2], 2), torch.cat([v, v[:, :, :1] * 3], 2)
    keep2 = _picked(idx, S + 1) & _causal(s=S + 1)
    return F.scaled_dot_product_attention(o1, k2, v2, attn_mask=keep2[:, None])


def _last_row_reused(qi, ki, w, q, k, v):
    idx = _picks(qi, ki, w)
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None])
    o2 = F.scaled_dot_product_attention(o1[:, :, -1:], k, v, attn_mask=_picked(idx[:, -1:])[:, None])
    return o1, o2


class _DropoutModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, qi, ki, w, q, k, v):
        a = (q @ k.transpose(-1, -2)) * D ** -0.5
        a = a.masked_fill(~(_picked(_picks(qi, ki, w)) & _causal())[:, None], MIN)
        return torch.matmul(self.drop(F.softmax(a, -1, dtype=torch.float32).to(q.dtype)), v)


def _dsa_kl_loss(qi, ki, w, q, k, v):
    """DSA training: the indexer on detached inputs, its KL loss at the picks against the detached attention."""
    vals, idx = _score(qi.detach(), ki.detach(), w).masked_fill(~_causal(), NEG).topk(K)
    a = (q @ k.transpose(-1, -2) * D ** -0.5).masked_fill(~(_picked(idx) & _causal())[:, None], MIN)
    p = a.softmax(-1)
    target = p.detach().sum(1).gather(-1, idx)
    loss = F.kl_div(F.log_softmax(vals, -1), target / target.sum(-1, keepdim=True), reduction="batchmean")
    return p @ v, loss


def _dense_warmup_target(qi, ki, w, q, k, v):
    s = _score(qi, ki, w).masked_fill(~_causal(), NEG)
    idx = s.topk(K).indices
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None])
    with torch.no_grad():
        ref = (q @ k.transpose(-1, -2)).masked_fill(~_causal(), NEG).softmax(-1).sum(1)
    return o, -(ref.gather(-1, idx) * F.log_softmax(s.gather(-1, idx), -1)).sum()


def _two_indexers(qi, ki, w, q, k, v):
    """Picks from an indexer under no_grad; a second indexer with gradients read at them."""
    with torch.no_grad():
        idx = _picks(qi, ki, w)
    vals = _score(qi, ki, w).masked_fill(~_causal(), NEG).gather(-1, idx)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None]), vals


def _gathered_sparse_attention(qi, ki, w, q, k, v):
    """Sparse attention by hand: k / v gathered at the picks, masked picks told apart by their value (finfo.min)."""
    vals, idx = _score(qi, ki, w).masked_fill(~_causal(off=1), MIN).topk(K)
    at = idx[:, None, :, :, None].expand(B, H, T, K, D)
    kk, vv = (x[:, :, None].expand(B, H, T, S, D).gather(3, at) for x in (k, v))
    a = ((q[:, :, :, None] * kk).sum(-1) * D ** -0.5).masked_fill((vals == MIN)[:, None], NEG)
    return (a.softmax(-1)[..., None] * vv).sum(-2)


def _rw(words):
    return (ATT, "rewritten", words)


def _rj(words):
    return (ATT, "rejected", words)


CONSUMERS = {  # name: (model, the sites after the selection)
    "broadcast_onto_heads": (_broadcast_onto_heads, [_rj("do not land on the attention's")]),
    "selection_mask_not_repeated": (_selection_mask_not_repeated, [_rw("none")]),
    "selection_mask_not_repeated_eager": (_selection_mask_not_repeated_eager, [_rw("none")]),
    "window_in_the_attention": (_window_in_the_attention, [_rw("causal + mask read at the picks")]),
    "window_unioned": (_window_unioned, [_rj("does not keep exactly the picked")]),
    "nsa_blocks_expanded": (_nsa_blocks_expanded, [_rj("not a top-k's")]),
    "one_hot_mask": (_one_hot_mask, []),
    "arange_eq_mask": (_arange_eq_mask, []),
    "scatter_add_count": (_scatter_add_count, []),
    "shared_int32_other_mask": (_shared_int32_other_mask, [_rw("causal"), _rw("key mask")]),
    "shared_one_more_key": (_shared_one_more_key, [_rw("causal"), _rj("not provably in range")]),
    "last_row_reused": (_last_row_reused, [_rw("causal"), _rj("not a top-k's")]),
    "dropout_module_train": (_DropoutModule().train(), [_rw("causal")]),
    "dsa_kl_loss": (_dsa_kl_loss, [_rj("attention weights are read")]),
    "dense_warmup_target": (_dense_warmup_target, [_rw("causal")]),
    "two_indexers": (_two_indexers, [_rw("causal")]),
    "gathered_sparse_attention": (_gathered_sparse_attention, []),
}


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(CONSUMERS))
def test_attention_consumers(name, compiler):
    fn, attention = CONSUMERS[name]
    sel = ("selection", "rewritten", "")
    _check_sites(fn, _inputs(), ATT_ALL, [sel] + attention, compiler=compiler)
