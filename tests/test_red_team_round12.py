"""Review round 12: a tensor factor of the score before the activation, ``relu(f * q.k)``, now rewritten as
``|f| * relu(sign(f) * q.k)`` (sign into q, magnitude into the head weights; ``rewrite._split_factor``), tried the
way indexers and user code write it.

Tried: the factor on either side of the multiply (``f * s``, ``s.mul(f)``, in place ``mul_`` / ``relu_``), heads-last
scores (``btsh``) with the factor broadcast over keys, factors per (batch, query, head), per (query, head) shared by
the batch (``[T, H]``), per head, per batch (``[B, 1, 1, 1]``), with extra size-1 dims, the head weights applied
after the relu by a multiply or by an einsum, ``clamp(min=0)`` as the relu, no activation, a causal mask after the
head sum; DeepSeek-V3.2's fp8 q dequant (``q_scale = q.abs().amax(-1)``, q divided by it and the score multiplied
by it before the relu: gradients through both); factors in bf16 / fp16 on an fp32 score, q / k in bf16 upcast by the
model or scored in bf16; factors that require grad, detached, or made under no_grad; decode (T = 1, and the query
dim squeezed away); dynamic=True; compiler "eager" and "aot_eager"; factors negative, 0, -0.0, subnormal, huge
(``f * q.k`` overflowing), tiny, NaN, compared bit for bit; gelu / leaky_relu / square / division by a tensor / a
three-operand einsum (left alone with a reason); the README's documented differences (an infinite f, a per-key
factor folded into the keys), asserted to be exactly what README says.

Found (strict xfails below, documented in README as "Several factors"): wherever a second factor meets the score, the site is rewritten but not
eager's. The op takes one weight per (query, head) and computes ``relu(+-q.k) * weight`` with one product, so
``_split_factor``'s ``|f|`` is multiplied into the head weights, the other factors before the relu and the constant
scale *before* it meets q.k, where eager applies them to the score one at a time. For finite factors this
changes which scores overflow or underflow: ``relu(f * s) * w`` with f = 1e30, s = 1e20, w = 1e-30 is inf in eager
and 1e20 in the op; f = w = 1e-30 gives 0 where eager's is subnormal; two factors 1e30 before the relu overflow to
inf (NaN at a negative q.k) where eager's product is finite; ``relu(f * s).sum() * 0.5`` with f = 3e38 (a scale
below 1, which README does not cover); ``f * s * w`` without a relu (contrary to ``_split_factor``'s docstring,
"by nothing in which products are inf or NaN"); and a symbolic scale under dynamic=True (``q.shape[-1] ** -0.5``
before the relu), still folded into q as ``(c q).k``, overflowing where ``c * (q.k)`` does. A fix needs the op to
take the pre-activation factor apart from the weights, or these sites left alone or documented: not small.

Found and fixed (expr_terms._relu; older than the factor split): ``clamp(min=0)``, ``clamp_min(x, 0)`` and
``maximum(x, 0)``, taken as relu, have other gradients at exactly 0 (clamp passes it, maximum halves it); the op's
backward is relu's. A factor of 0 (or -0.0) then got no gradient where eager's is q.k * w, an all-zero q row none
where eager's is w * k. Such a spelling is now left alone where a gradient reaches it.

Found and fixed (rewrite._Operands.factors): two or more 16-bit factors were multiplied together in 16 bits before
the upcast, where eager multiplies each into an fp32 score: fp16 head weights of 300 and 300 gave an inf weight
(NaN / inf scores) where eager's scores are finite, and bf16 ones a product rounded to bf16.

Otherwise every rewritten site matched eager (indices with ties by position, values, NaN positions, gradients of q,
k, the factor and the weights), single finite factors bit for bit, and every other site was left alone with a
reason. Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, ties_by_position

from hyscale_compile.passes import report

B, T, S, H, D, K = 2, 3, 8, 2, 4, 3
NEG, INF, NAN = float("-inf"), float("inf"), float("nan")
ALL = (0, 1, 2, 3)


def _qk(q, k):
    return torch.einsum("bthd,bsd->bths", q, k)


def _inputs(seed=0, t=T, dt=torch.float32):
    """q, k, a factor of every sign (0 and -0.0 included) and positive head weights."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, t, H, D, generator=g).to(dt), torch.randn(B, S, D, generator=g).to(dt)
    f = torch.randn(B, t, H, generator=g)
    f[0, 0, 0], f[1, -1, 1], f[1, 0, 0] = 0.0, -0.0, -3.0
    return q, k, f, torch.rand(B, t, H, generator=g) + 0.5


def _check_rewritten(fn, args, grad=ALL, compiler="eager", dynamic=None, **tol):
    """check_compiled (ties by position: the operator's rule), and the one site rewritten."""
    if dynamic is None:
        reports = check_compiled(fn, args, grad=grad, ties=True, compiler=compiler, **tol)
    else:
        reports = _check_dynamic(fn, args)
    assert [(r.kind, r.decision) for r in reports] == [("selection", "rewritten")], \
        [(r.kind, r.decision, r.reason) for r in reports]
    return reports[0]


def _check_dynamic(fn, args):
    torch._dynamo.reset()
    with report.collect() as reports:
        got = torch.compile(fn, backend="hyscale", options={"compiler": "eager"}, dynamic=True)(*args)
    with ties_by_position():
        want = fn(*args)
    _same(got, want)
    return reports


def _same(got, want, exact=False):
    assert torch.equal(got.indices, want.indices), (got, want)
    assert torch.equal(torch.isnan(got.values), torch.isnan(want.values)), (got, want)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.values, want.values, equal_nan=True, **tol)


def _compiled(fn, args, dynamic=None):
    torch._dynamo.reset()
    with report.collect() as reports:
        got = torch.compile(fn, backend="hyscale", options={"compiler": "eager"}, dynamic=dynamic)(*args)
    return got, reports


# ---------------------------------------------------------------------------------------------
# spellings: rewritten, eager's picks, values and gradients (q, k, the factor, the head weights)
def _fp8_q_dequant(q, k, f, w):  # DeepSeek-V3.2: q quantised per (query, head), its scale applied before the relu
    q_scale = q.abs().amax(-1)
    s = _qk(q / q_scale[..., None], k)
    return (torch.relu(s * q_scale[..., None]) * w[..., None]).sum(2).topk(K)


def _causal_after(q, k, f, w):
    s = torch.relu(f[..., None] * _qk(q, k)).sum(2)
    return s.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None] + S - T, NEG).topk(K)


def _no_grad_factor(q, k, f, w):
    with torch.no_grad():
        scale = f * 2
    return torch.relu(_qk(q, k) * scale[..., None]).sum(2).topk(K)


SPELLINGS = {
    "factor_left": lambda q, k, f, w: torch.relu(f[..., None] * _qk(q, k)).sum(2).topk(K),
    "factor_right_method": lambda q, k, f, w: _qk(q, k).mul(f.unsqueeze(-1)).relu().sum(2).topk(K),
    "in_place": lambda q, k, f, w: _qk(q, k).mul_(f.unsqueeze(-1)).relu_().sum(2).topk(K),
    "heads_last": lambda q, k, f, w: torch.einsum("bthd,bsd->btsh", q, k).mul(f[:, :, None]).relu().sum(-1).topk(K),
    "factor_TH_shared_by_batch": lambda q, k, f, w: torch.relu(_qk(q, k) * f[0][None, :, :, None]).sum(2).topk(K),
    "factor_per_head": lambda q, k, f, w: torch.relu(_qk(q, k) * f[0, 0][:, None]).sum(2).topk(K),
    "factor_per_batch": lambda q, k, f, w: torch.relu(_qk(q, k) * f[:, 0, 0].view(B, 1, 1, 1)).sum(2).topk(K),
    "factor_and_weights": lambda q, k, f, w: (torch.relu(_qk(q, k) * f[..., None]) * w[..., None]).sum(2).topk(K),
    "factor_and_einsum_weights": lambda q, k, f, w: torch.einsum(
        "bths,bth->bts", (_qk(q, k) * f[..., None]).relu(), w).topk(K),
    "two_factors": lambda q, k, f, w: torch.relu(f[..., None] * (_qk(q, k) * w[..., None])).sum(2).topk(K),
    "no_activation": lambda q, k, f, w: (_qk(q, k) * f[..., None]).sum(2).topk(K),
    "no_activation_and_weights": lambda q, k, f, w: (_qk(q, k) * f[..., None] * w[..., None]).sum(2).topk(K),
    "fp8_q_dequant": _fp8_q_dequant,
    "causal_after": _causal_after,
    "detached_factor": lambda q, k, f, w: torch.relu(_qk(q, k) * f.detach()[..., None]).sum(2).topk(K),
    "no_grad_factor": _no_grad_factor,
    "factor_from_weights_softmax": lambda q, k, f, w: torch.relu(
        _qk(q, k) * (f * w).softmax(-1)[..., None]).sum(2).topk(K),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_factor_spellings_rewritten_and_exact(name):
    _check_rewritten(SPELLINGS[name], _inputs())


@pytest.mark.parametrize("name", ["factor_left", "heads_last", "fp8_q_dequant", "no_activation_and_weights"])
def test_factor_spellings_aot_eager(name):
    _check_rewritten(SPELLINGS[name], _inputs(1), compiler="aot_eager")


def test_factor_from_q_is_the_only_gradient_path():
    """The factor is q's own amax: q's gradient runs through the sign (none) and |f| (d|f|/df = sign f)."""
    model = lambda q, k, f, w: torch.relu(_qk(q, k) * -q.abs().amax(-1)[..., None]).sum(2).topk(K)  # noqa: E731
    _check_rewritten(model, _inputs(2), grad=(0, 1))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_16_bit_factor_on_an_fp32_score(dt):
    model = lambda q, k, f, w: (torch.relu(_qk(q, k) * f.to(dt)[..., None]) * w[..., None]).sum(2).topk(K)  # noqa: E731
    _check_rewritten(model, _inputs(3), rtol=1e-2, atol=1e-2)  # the factor's gradient is rounded to dt


def test_bf16_q_k_upcast_by_the_model_with_a_bf16_factor():
    def model(q, k, f, w):
        return torch.relu(_qk(q.float(), k.float()) * f.bfloat16()[..., None].float()).sum(2).topk(K)

    _check_rewritten(model, _inputs(4, dt=torch.bfloat16), grad=(2, 3), rtol=1e-2, atol=1e-2)


def test_bf16_score_is_rewritten_with_the_documented_report():
    """q, k and f in bf16, scored in bf16: the exact fp32 score is ranked, and the report says so (README)."""
    q, k, f, w = _inputs(5, dt=torch.bfloat16)
    model = lambda q, k, f: torch.relu(_qk(q, k) * f[..., None]).sum(2).topk(K)  # noqa: E731
    _, reports = _compiled(model, (q, k, f.bfloat16()))
    assert [r.decision for r in reports] == ["rewritten"] and "bfloat16" in reports[0].reason, reports


def test_decode_one_query_and_the_query_dim_squeezed():
    q, k, f, w = _inputs(6, t=1)
    _check_rewritten(SPELLINGS["factor_and_weights"], (q, k, f, w))
    squeezed = lambda q, k, f, w: (torch.relu(torch.einsum("bhd,bsd->bhs", q, k) * f[..., None])  # noqa: E731
                                   * w[..., None]).sum(1).topk(K)
    _check_rewritten(squeezed, (q[:, 0], k, f[:, 0], w[:, 0]))


@pytest.mark.parametrize("name", ["factor_left", "factor_and_weights"])
def test_dynamic_shapes(name):
    _check_rewritten(SPELLINGS[name], _inputs(7), dynamic=True)


CLAMPS = {
    "clamp_min_0": lambda s: s.clamp(min=0),
    "clamp_min_function": lambda s: torch.clamp_min(s, 0),
    "maximum_0": lambda s: torch.maximum(s, torch.tensor(0.0)),
}


@pytest.mark.parametrize("name", sorted(CLAMPS))
def test_relu_spelled_as_a_clamp_forward(name):
    model = lambda q, k, f, w: (CLAMPS[name](_qk(q, k) * f[..., None]) * w[..., None]).sum(2).topk(K)  # noqa: E731
    _check_rewritten(model, _inputs(), grad=())


# Found in review (older than the factor split), fixed: clamp(min=0), clamp_min(x, 0) and maximum(x, 0) were taken
# as relu (expr_terms._relu / _is_relu_clamp), equal in the forward, NaN included, but not in the backward at exactly
# 0: relu's gradient there is 0, clamp's passes it (x >= min), maximum's halves it (a tie). The op's backward is
# relu's. A pre-activation of exactly 0 at a selected key is common: a factor of 0 (a zeroed head weight, f = 0 or
# -0.0 here) makes every key of that head 0 and eager sends q.k * w to the factor, the op sent nothing; an all-zero
# q row (a zeroed padding query) gives q a gradient in eager (w * k per picked key), none in the op. Now such a
# spelling is left alone where a gradient reaches it (with a reason naming torch.relu), rewritten where none does.
@pytest.mark.parametrize("name", sorted(CLAMPS))
@pytest.mark.parametrize("zero", ["factor", "q_row"])
def test_clamp_relu_with_a_gradient_is_left_alone(name, zero):
    q, k, f, w = _inputs()
    if zero == "q_row":
        f = f.abs() + 0.5
        q[1, 2, 0] = 0.0
    model = lambda q, k, f, w: (CLAMPS[name](_qk(q, k) * f[..., None]) * w[..., None]).sum(2).topk(K)  # noqa: E731
    reports = check_compiled(model, (q, k, f, w), grad=(0, 2) if zero == "q_row" else (2,))
    assert [(r.kind, r.decision) for r in reports] == [("selection", "rejected")], reports
    assert "gradient at exactly 0" in reports[0].reason and "torch.relu" in reports[0].reason
    _check_rewritten(model, (q, k, f, w), grad=())  # no gradient: the same values, rewritten


# ---------------------------------------------------------------------------------------------
# special factor values: a single factor is eager's bits (forward), whatever finite value it has
SPECIAL = [-2.0, 0.0, -0.0, 1e-40, -1e-45, 3e38, -3e38, 1e-30, NAN]


def _special_inputs(seed=8):
    """Every factor value at some (query, head); q.k of both signs, from ~0 to beyond 1.2 (so 3e38 * q.k overflows)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=g) * 2, torch.randn(B, S, D, generator=g) * 2
    f = torch.tensor(SPECIAL * 2)[: B * T * H].view(B, T, H)
    return q, k, f, torch.rand(B, T, H, generator=g) + 0.5


@pytest.mark.parametrize("name", ["factor_left", "heads_last", "no_activation", "in_place"])
def test_special_factor_values_bit_for_bit(name):
    args = _special_inputs()
    got, reports = _compiled(SPELLINGS[name], args)
    assert [r.decision for r in reports] == ["rewritten"]
    with ties_by_position():
        want = SPELLINGS[name](*args)
    if name != "no_activation":  # the overflow is reached: 3e38 * q.k is inf for some key
        assert torch.isinf(want.values).any()
    _same(got, want, exact=True)


def test_special_factor_values_gradients():
    """Gradients at negative, zero, -0.0 and tiny factors (huge ones would overflow the gradients' own products)."""
    q, k, f, w = _special_inputs()
    f = torch.where(f.abs() > 1e30, torch.full_like(f, 5.0), f).nan_to_num(-0.25)
    _check_rewritten(SPELLINGS["factor_and_weights"], (q, k, f, w))


def test_q_k_overflowing_before_a_tiny_factor():
    """q.k itself inf in fp32: inf * tiny f is inf in eager, relu(inf) * |f| too."""
    q, k, f, w = _special_inputs()
    q, k = q * 1e19, k * 1e19
    args = (q, k, f.abs().clamp(1e-30, 1e-30).nan_to_num(1e-30), w)
    got, _ = _compiled(SPELLINGS["factor_left"], args)
    with ties_by_position():
        want = SPELLINGS["factor_left"](*args)
    assert torch.isinf(want.values).any()
    _same(got, want, exact=True)


# ---------------------------------------------------------------------------------------------
# left alone, with the reason
LEFT_ALONE = {
    "gelu": (lambda q, k, f, w: F.gelu(_qk(q, k) * f[..., None]).sum(2).topk(K), "gelu"),
    "leaky_relu": (lambda q, k, f, w: F.leaky_relu(_qk(q, k) * f[..., None]).sum(2).topk(K), "leaky_relu"),
    "relu_squared": (lambda q, k, f, w: (_qk(q, k) * f[..., None]).relu().square().sum(2).topk(K), "square"),
    "divided_by_a_tensor": (lambda q, k, f, w: torch.relu(_qk(q, k) / f[..., None]).sum(2).topk(K),
                            "not a constant number"),
    "three_operand_einsum": (lambda q, k, f, w: torch.einsum("bthd,bsd,bth->bths", q, k, f).relu().sum(2).topk(K),
                             "two-operand einsum"),
}


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_left_alone_with_a_reason(name):
    fn, words = LEFT_ALONE[name]
    reports = check_compiled(fn, _inputs(9), grad=ALL)
    assert [r.decision for r in reports] == ["rejected"] and words in reports[0].reason, \
        [(r.decision, r.reason) for r in reports]


# ---------------------------------------------------------------------------------------------
# README's documented differences, and only those
def test_infinite_factor_differs_only_where_readme_says():
    """README: eager's relu(inf * x) is 0 where x < 0, the op's inf * relu(x) NaN; elsewhere the same."""
    q, k, _, _ = _inputs(10)
    f = torch.ones(B, T, H)
    f[0, 1, 0] = INF
    q[0, 1, 1] = 0.0  # one head only: the other head's relu(x) adds nothing
    model = lambda q, k, f: torch.relu(f[..., None] * _qk(q, k)).sum(2)  # noqa: E731
    scores = lambda q, k, f: model(q, k, f).topk(S)  # noqa: E731 (every key: the whole row is compared)
    got, reports = _compiled(scores, (q, k, f))
    assert [r.decision for r in reports] == ["rewritten"]
    with ties_by_position():
        want = scores(q, k, f)
    row = _qk(q, k)[0, 1, 0]
    assert (row < 0).any() and (row > 0).any()
    differ = torch.zeros(B, T, S, dtype=torch.bool)
    differ[0, 1] = row < 0
    got_by_key = torch.empty_like(got.values).scatter_(-1, got.indices, got.values)
    want_by_key = torch.empty_like(want.values).scatter_(-1, want.indices, want.values)
    assert torch.isnan(got_by_key[differ]).all() and (want_by_key[differ] == 0).all()
    torch.testing.assert_close(got_by_key[~differ], want_by_key[~differ], rtol=0, atol=0, equal_nan=True)


def test_per_key_factor_folds_into_the_keys_as_readme_says():
    """README: relu(q.k * s_key) becomes q.(s_key k); an overflowing s_key k is NaN where eager's is finite."""
    q, k, _, w = _inputs(11)
    q[..., 0], q[..., 1] = 1.0, -1.0
    k[0, 2, :2] = 1e30  # q.k cancels to a finite value; s_key * k overflows
    s_key = torch.ones(B, S)
    s_key[0, 2] = 1e10
    model = lambda q, k, s_key, w: (torch.relu(_qk(q, k) * s_key[:, None, None]) * w[..., None]).sum(2).topk(S)  # noqa: E731
    got, reports = _compiled(model, (q, k, s_key, w))
    assert [r.decision for r in reports] == ["rewritten"]
    want = model(q, k, s_key, w)
    at_key = lambda r: r.values.gather(-1, (r.indices == 2).int().argmax(-1, keepdim=True))  # noqa: E731
    assert torch.isnan(at_key(got)[0]).all() and torch.isfinite(at_key(want)[0]).all()
    assert not torch.isnan(got.values[1]).any()


# ---------------------------------------------------------------------------------------------
# Found in review, documented (README, "Several factors"; strict xfail): the op takes one weight per (query, head),
# so every factor but one is multiplied into it (rewrite._emit: _split_factor's |f| times the head weights;
# _Operands.factors' product of the factors before the relu; the constant scale, reference.score_rows ``weights *
# scale``) before it meets q.k, where eager multiplies the score by each in turn. Finite factors then overflow or underflow where eager's do not (or the
# other way round); see the module docstring. Exact would need the op to take the pre-activation factor apart.
def _one_query(f, w, qk_size):
    """f and w at query 0, head 0 (1 elsewhere); q.k of that head ~ qk_size at keys 0..3; head 1 of query 0 scores 0."""
    q, k, _, _ = _inputs(12)
    q[0, 0, 0] *= qk_size ** 0.5
    k[0, :4] *= qk_size ** 0.5
    q[0, 0, 1] = 0.0
    ff, ww = torch.ones(B, T, H), torch.ones(B, T, H)
    ff[0, 0, 0], ww[0, 0, 0] = f, w
    return q, k, ff, ww


def _scale_args():
    """f = 3e38 at query 0, head 0, whose q.k runs over -2 .. 2.5: 3e38 * q.k overflows above 1.13, 1.5e38 * q.k
    above 2.27."""
    q, k, f, w = _one_query(3e38, 1.0, 1.0)
    q[0, 0, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    k[0, :, 0] = torch.linspace(-2.0, 2.5, S)
    return q, k, f, w


def _sym_scale(q, k, f, w):  # under dynamic=True the head dim is symbolic: a SymFloat scale before the relu
    return torch.relu(_qk(q, k) * q.shape[-1] ** -0.5).sum(2).topk(K)


def _sym_args():
    """q.k = 4e38 (inf in fp32) at key 1 of query 0, head 0; (D ** -0.5 q).k = 2e38 is finite."""
    q, k, f, w = _inputs(13)
    q[0, 0, 0] = 1e19
    k[0, 1] = 1e19
    return q, k, f, w


OPEN = {  # model, inputs, dynamic
    "factor_overflows_then_tiny_weight": (SPELLINGS["factor_and_weights"], lambda: _one_query(1e30, 1e-30, 1e20),
                                          None),
    "factor_and_weight_underflow_apart": (SPELLINGS["factor_and_weights"], lambda: _one_query(1e-30, 1e-30, 1e20),
                                          None),
    "two_factors_product_overflows": (SPELLINGS["two_factors"], lambda: _one_query(1e30, 1e30, 1e-30), None),
    "no_activation_factor_then_weight": (SPELLINGS["no_activation_and_weights"],
                                         lambda: _one_query(1e30, 1e-30, 1e20), None),
    "factor_then_scale_below_1": (lambda q, k, f, w: (torch.relu(f[..., None] * _qk(q, k)).sum(2) * 0.5).topk(K),
                                  _scale_args, None),
    "symbolic_scale_dynamic": (_sym_scale, _sym_args, True),
}


@pytest.mark.xfail(strict=True, reason="README, by design: factors multiplied together before they meet q.k")
@pytest.mark.parametrize("name", sorted(OPEN))
def test_found_in_review_factors_combined_before_the_score(name):
    fn, args, dynamic = OPEN[name]
    got, reports = _compiled(fn, args(), dynamic=dynamic)
    assert [r.decision for r in reports] == ["rewritten"]  # it is rewritten: so it must be eager's
    with ties_by_position():
        want = fn(*args())
    _same(got, want, exact=True)


# Found in review, fixed in rewrite._Operands.factors: two 16-bit factors were multiplied in 16 bits before the upcast,
# where eager multiplies each into the fp32 score (fp16: 300 * 300 overflowed to an inf weight).
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["after_the_relu", "before_the_relu"])
def test_found_in_review_16_bit_factors_multiplied_in_16_bits(dt, where):
    q, k, f, w = _inputs(14)
    f, w = f.abs() + 0.5, w
    f[0, 0], w[0, 0] = 300.0, 300.0

    def model(q, k, f, w):
        s = _qk(q, k)
        if where == "after_the_relu":
            return (torch.relu(s) * f.to(dt)[..., None] * w.to(dt)[..., None]).sum(2).topk(K)
        return torch.relu(s * f.to(dt)[..., None] * w.to(dt)[..., None]).sum(2).topk(K)

    _check_rewritten(model, (q, k, f, w), grad=(0, 1))  # fp16: an inf weight; bf16: a product rounded to bf16
