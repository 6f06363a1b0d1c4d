"""Review round 7: the two changes of the round before it. Index masks built with arithmetic and comparisons
(``attention_masks._arithmetic``: ``(1.0 - keep.float()) * finfo.min``, ``keep == 0``, ``keep.float() < 0.5``, ``-x``,
products), tried with 16-bit and integer masks, 0-d tensor constants, NaN / inf fills, -0.0, a learned scalar, a
non-constant factor, autocast; and the absorbed MLA op ``hyscale.sparse_attention_mla`` the latent rewrite emits,
tried with padding, per-batch query offsets, fp32 / bf16, checkpointing, dynamic=True, a latent shared by the
batch, a frozen projection or detached latent, q read elsewhere too, every subset of gradients, the eager and the
inductor compiler, and blocks of one query row (``absorbed.ROWS_BYTES``).

Each "Found in review" test reproduces a bug found then (the model code, what differed), now fixed; the others pin
spellings that were already right. Every test compares the compiled model's outputs and gradients with eager's and
checks the decision the pass made. Tiny sizes: seconds each on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, flat
from test_red_team_round6 import MIN, D, _attention, _causal, _eager, _hidden, _inputs, _pad, _picks, _sdpa
from torch import nn

from hyscale_compile.passes import report
from hyscale_compile.runtime.sparse_attention import absorbed

HMIN = torch.finfo(torch.float16).min
BMIN = torch.finfo(torch.bfloat16).min


def _keep(s):  # True at the visible keys a query picked
    return _causal() & ~_hidden(_picks(s))


def _added(mask):
    return _eager(lambda x, s: x + mask(s))


def _filled(hidden):
    return _eager(lambda x, s: x.masked_fill(hidden(s), MIN))


# ---------------------------------------------------------------------------------------------
# 1. mask arithmetic


# Found in review, fixed (wrong values): the evaluator holds every mask value as a 0-d tensor, and torch promotes
# two 0-d tensors by full type promotion but a 0-d tensor against a tensor with dims by category only. So
# ``keep.half() <= torch.tensor(0.9999)`` compares in float16 in the model, where 0.9999 is 1.0 and the comparison is
# True at every key (every key hidden: each row is the mean of v), while the evaluator compared in float32, found
# exactly the unpicked keys hidden and rewrote the site: all 160 outputs off (up to 1.7), the SDPA spelling
# (``~(...)`` as a boolean mask) likewise. Operands the model has with dims are now computed with one dim
# (attention_masks._arithmetic), so the comparison runs the model's kernel on the model's kinds of operands.
@pytest.mark.parametrize("attn,decision", [
    (_filled(lambda s: _keep(s).half() <= torch.tensor(0.9999)), "rejected"),
    (_sdpa(lambda s: ~(_keep(s).half() <= torch.tensor(0.9999))), "rejected"),
    (_filled(lambda s: _keep(s).to(torch.bfloat16) <= torch.tensor(0.999)), "rejected"),
    # the other way round: float16's 1.0001 is 1.0, so this is exactly the unpicked keys (it was rejected)
    (_filled(lambda s: _keep(s).half() < torch.tensor(1.0001, dtype=torch.float64)), "rewritten"),
], ids=["fp16_le", "fp16_le_sdpa", "bf16_le", "fp16_lt_f64"])
def test_comparison_with_a_0d_tensor_constant_promotes_as_the_model(attn, decision):
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
    assert [s.decision for s in sites] == [decision], [s.reason for s in sites]
    assert decision == "rewritten" or "polarity" in sites[0].reason, sites[0].reason


class _LearnedFill(nn.Module):
    def __init__(self):
        super().__init__()
        self.fill = nn.Parameter(torch.tensor(MIN))

    def forward(self, q, k, v, s):
        w = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + (1.0 - _keep(s).float()) * self.fill, -1)
        return w @ v


def _autocast(sdpa: bool):
    def attn(q, k, v, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m = (1.0 - _keep(s).float()) * MIN
            if sdpa:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + m, -1) @ v

    return attn


# (model, the decision, a phrase of the reason): spellings tried in review that were already right
SPELLINGS = {
    # the same comparisons where the constant does not round onto a mask value: exact, rewritten
    "bf16_lt_0d_tensor": (_filled(lambda s: _keep(s).to(torch.bfloat16) < torch.tensor(0.999)), "rewritten", ""),
    "fp16_ge_0d_fp16_sdpa": (_sdpa(lambda s: _keep(s).half() >= torch.tensor(0.5, dtype=torch.float16)),
                             "rewritten", ""),
    "int_mask": (_added(lambda s: (1 - _keep(s).int()) * MIN), "rewritten", ""),
    "int_eq_zero": (_filled(lambda s: _keep(s).int() == 0), "rewritten", ""),
    "times_0d_tensor_min": (_added(lambda s: (1.0 - _keep(s).float()) * torch.tensor(MIN)), "rewritten", ""),
    "times_0d_f64_min": (_added(lambda s: (1.0 - _keep(s).float()) * torch.tensor(MIN, dtype=torch.float64)),
                         "rewritten", ""),
    "negative_zero_at_kept": (_added(lambda s: -torch.where(_keep(s), 0.0, -MIN)), "rewritten", ""),
    "nan_compared": (_filled(lambda s: (1.0 - _keep(s).float()) * float("inf") > 0), "rewritten", ""),
    "product_with_padding": (_added(lambda s: (1.0 - _keep(s).float() * _pad(s).float()) * MIN), "rewritten", ""),
    "negated_compared": (_filled(lambda s: -_keep(s).float() >= 0), "rewritten", ""),
    # 0 * -inf = NaN at the kept keys
    "times_minus_inf": (_added(lambda s: (1.0 - _keep(s).float()) * float("-inf")), "rejected", "nan"),
    # finfo.min * 2 and float32's min rounded to bf16 / fp16 overflow to -inf: an empty row is NaN in eager
    "min_times_two": (_added(lambda s: (1.0 - _keep(s).float()) * MIN * 2), "rejected", "gives NaN"),
    "bf16_mask_f32_min": (_added(lambda s: (1.0 - _keep(s).to(torch.bfloat16)) * MIN), "rejected", "gives NaN"),
    "fp16_mask_f32_min": (_added(lambda s: (1.0 - _keep(s).half()) * MIN), "rejected", "gives NaN"),
    # another dtype's min, added to float32 scores: a finite fill of its own (conservative)
    "bf16_mask_bf16_min": (_added(lambda s: (1.0 - _keep(s).to(torch.bfloat16)) * BMIN), "rejected",
                           "does not hide them exactly"),
    "fp16_mask_fp16_min": (_added(lambda s: (1.0 - _keep(s).half()) * HMIN), "rejected", "does not hide them exactly"),
    "int64_min": (_added(lambda s: (1 - _keep(s).long()) * torch.iinfo(torch.int64).min), "rejected",
                  "does not hide them exactly"),
    "learned_fill": (_LearnedFill(), "rejected", "self._parameters.fill"),
    "times_a_tensor_input": (_eager(lambda x, s: x + (1.0 - _keep(s).float()) * (s[:, None] * 0 + MIN)), "rejected",
                             "graph input `score`"),
    "autocast_eager": (_autocast(False), "rewritten", ""),
    "autocast_sdpa": (_autocast(True), "rewritten", ""),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_arithmetic_spellings(name):
    attn, decision, phrase = SPELLINGS[name]
    tol = dict(rtol=2e-2, atol=2e-2) if name.startswith("autocast") else {}
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2), **tol))
    assert [s.decision for s in sites] == [decision], [s.reason for s in sites]
    assert phrase in sites[0].reason, sites[0].reason


def test_scores_scaled_by_the_keep_mask_are_no_mask():
    """``scores * keep + (1 - keep) * min``: equal at kept keys, but the scores are an operand of the product."""
    attn = _eager(lambda x, s: x * _keep(s).float() + (1.0 - _keep(s).float()) * MIN)
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
    assert sites and all(s.decision == "rejected" for s in sites)
    assert any("scales the scores themselves" in s.reason for s in sites), [s.reason for s in sites]


# ---------------------------------------------------------------------------------------------
# 2. the absorbed MLA op (hyscale.sparse_attention_mla)

B, H, T, S = 2, 4, 6, 10
DC, DR, DN, DV = 16, 8, 16, 12
_BF16 = dict(rtol=3e-2, atol=3e-2)


class _Mla(nn.Module):
    """HF's MLA (``kv_b`` expanded per head, a shared rope key) under a scattered top-k mask, with the model's own
    mask causal, causal & padding ([B, S] input), or causal at per-batch query offsets (read at the picks)."""

    def __init__(self, attn="sdpa", mask="causal", dtype=torch.float32, frozen=False, detach=False, ckpt=False,
                 q_elsewhere=False):
        super().__init__()
        self.kv_b = nn.Linear(DC, H * (DN + DV), bias=False).to(dtype)
        self.kv_b.weight.requires_grad_(not frozen)
        self.attn, self.mask, self.detach, self.ckpt, self.q_elsewhere = attn, mask, detach, ckpt, q_elsewhere

    def body(self, q, c, r, score, pad):
        c = c.detach() if self.detach else c
        Bc, Sk, Tq = c.shape[0], c.shape[1], q.shape[2]
        k_nope, v = torch.split(self.kv_b(c).view(Bc, Sk, H, DN + DV).transpose(1, 2), [DN, DV], dim=-1)
        k = torch.cat((k_nope, r.expand(-1, H, -1, -1)), dim=-1)
        hidden = torch.ones(score.shape, dtype=torch.bool).scatter(-1, score.topk(4, dim=-1).indices, False)[:, None]
        m = torch.arange(Sk)[None, :] <= torch.arange(Tq)[:, None] + (Sk - Tq)
        if self.mask == "pad":
            m = m & pad[:, None, None, :]
        elif self.mask == "offsets":
            off = pad.long().sum(-1) - Tq
            m = (torch.arange(Sk)[None, None, :] <= torch.arange(Tq)[None, :, None] + off[:, None, None])[:, None]
        scale = (DN + DR) ** -0.5
        if self.attn == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m & ~hidden, scale=scale)
        else:
            low = torch.finfo(q.dtype).min
            w = torch.matmul(q, k.transpose(2, 3)) * scale + torch.where(m, 0.0, low).masked_fill(hidden, low)
            out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
        out = out.transpose(1, 2).contiguous()
        return out + q.transpose(1, 2)[..., :DV] * 2 if self.q_elsewhere else out

    def forward(self, q, c, r, score, pad):
        if self.ckpt:
            return torch.utils.checkpoint.checkpoint(self.body, q, c, r, score, pad, use_reentrant=False)
        return self.body(q, c, r, score, pad)


def _mla_inputs(dtype=torch.float32, shared=False, seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, t, DN + DR, generator=g).to(dtype)
    c = torch.randn(1 if shared else b, S, DC, generator=g).to(dtype)
    r = torch.randn(1 if shared else b, 1, S, DR, generator=g).to(dtype)
    pad = torch.arange(S)[None] >= torch.tensor([0, 3, 1][:b])[:, None]
    return q, c, r, torch.randn(b, t, S, generator=g), pad


def _check_mla(module, calls, grad=(0, 1, 2), compiler="eager", dynamic=None, rows=None, monkeypatch=None, **tol):
    """Compile with hyscale; outputs and gradients (of the inputs at ``grad`` and the parameters that require grad)
    equal eager's on each call; return the attention reports."""
    if rows is not None:  # ``rows`` query rows a block: forward and backward run many blocks
        monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * B * H * (DC + DR) * calls[0][0].element_size())

    def run(fn, args):
        xs = [x.detach().clone().requires_grad_(i in grad) if x.is_floating_point() else x for i, x in enumerate(args)]
        out = flat(fn(*xs))
        leaves = [xs[i] for i in grad] + [p for p in module.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(7)
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out if o.requires_grad)
        grads = torch.autograd.grad(loss, leaves, materialize_grads=True) if leaves else ()
        return [o.detach() for o in out] + list(grads)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend="hyscale", options={"compiler": compiler}, dynamic=dynamic)
    with report.collect() as reports:
        got = [run(compiled, args) for args in calls]
    for g, w in zip(got, [run(module, args) for args in calls]):
        for a, b in zip(g, w, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **{**dict(rtol=1e-4, atol=1e-5), **tol})
    sites = _attention(reports)
    assert sites and all(s.decision == "rewritten" and s.layout.startswith("MLA latent") for s in sites), \
        [(s.decision, s.layout, s.reason) for s in sites]
    return sites


# Found in review, fixed (a crash): under dynamic=True the rope key's feature dim is a symbolic size (it is a size of
# the model's input, not of a parameter), and the cost estimate of the latent layout added it unhinted: formatting
# the estimate raised "unsupported format string passed to SymFloat.__format__" and the compile failed (with
# HYSCALE_STRICT; without it, the site was left dense for an internal error). attention._cost_shape now takes the
# latent dims' traced sizes, as it does for the others.
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_mla_under_dynamic_shapes(compiler, monkeypatch):
    calls = [_mla_inputs(), _mla_inputs(seed=1, t=5), _mla_inputs(seed=2, b=3, t=7)]
    _check_mla(_Mla(mask="pad"), calls, compiler=compiler, dynamic=True, rows=2 if compiler == "inductor" else None,
               monkeypatch=monkeypatch)


# (module, inputs, keyword arguments of _check_mla): spellings tried in review that were already right
MLA_CASES = {
    "sdpa": (lambda: _Mla(), {}, {}),
    "eager": (lambda: _Mla("eager"), {}, {}),
    "padding": (lambda: _Mla(mask="pad"), {}, dict(rows=1)),
    "padding_eager_inference": (lambda: _Mla("eager", mask="pad"), {}, dict(grad=(), rows=1)),
    "padding_eager_training": (lambda: _Mla("eager", mask="pad"), {}, dict(rows=1)),  # empty rows' gradient
    "query_offsets": (lambda: _Mla(mask="offsets"), {}, dict(rows=1)),
    "query_offsets_eager_inference": (lambda: _Mla("eager", mask="offsets"), {}, dict(grad=(), rows=1)),
    "bf16": (lambda: _Mla(dtype=torch.bfloat16), dict(dtype=torch.bfloat16), dict(rows=1, **_BF16)),
    "fp16_inductor": (lambda: _Mla(dtype=torch.float16), dict(dtype=torch.float16),
                      dict(rows=1, compiler="inductor", **_BF16)),
    "checkpoint": (lambda: _Mla(ckpt=True, mask="pad"), {}, dict(rows=1)),
    "checkpoint_inductor": (lambda: _Mla(ckpt=True, mask="pad"), {}, dict(rows=1, compiler="inductor")),
    "shared_latent": (lambda: _Mla(), dict(shared=True), dict(rows=1)),
    "shared_latent_frozen_detached": (lambda: _Mla(frozen=True, detach=True), dict(shared=True), {}),
    "frozen_weight": (lambda: _Mla(frozen=True), {}, {}),
    "detached_latent": (lambda: _Mla(detach=True), {}, {}),
    "q_read_elsewhere": (lambda: _Mla(q_elsewhere=True), {}, dict(rows=1)),
    "inductor_padding": (lambda: _Mla(mask="pad"), {}, dict(rows=1, compiler="inductor")),
    "grad_of_q_only": (lambda: _Mla(frozen=True), {}, dict(grad=(0,))),
    "grad_of_latent_only": (lambda: _Mla(frozen=True), {}, dict(grad=(1,))),
    "grad_of_weight_only": (lambda: _Mla(), {}, dict(grad=(), rows=1)),
}


@pytest.mark.parametrize("name", sorted(MLA_CASES))
def test_mla_spellings(name, monkeypatch):
    module, inputs, kw = MLA_CASES[name]
    _check_mla(module(), [_mla_inputs(**inputs)], monkeypatch=monkeypatch, **kw)


# ---------------------------------------------------------------------------------------------
# 3. open: a graph input the op keeps for the backward, written in place later, under Inductor


class _MlaWeightUpdated(_Mla):
    """The projection weight updated in place after the attention (a no_grad EMA / weight-norm style step): the
    model's autograd never keeps the weight (the linear keeps c, SDPA keeps k and v), so eager runs and is right."""

    def forward(self, q, c, r, score, pad):
        out = self.body(q, c, r, score, pad)
        with torch.no_grad():
            self.kv_b.weight.mul_(0.5)
        return out


def _mask_updated(q, k, v, s, pad):
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal() & pad[:, None, None, :] & ~_hidden(_picks(s)))
    pad.logical_not_()  # the padding mask updated in place for the next step; SDPA keeps no mask for its backward
    return o


def _grads_after_update(fn, module, args, grad, compiler):
    xs = [x.detach().clone().requires_grad_(i in grad) if x.is_floating_point() else x.clone()
          for i, x in enumerate(args)]
    if compiler is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="hyscale", options={"compiler": compiler})
    with report.collect() as reports:
        out = fn(*xs)
    leaves = [xs[i] for i in grad] + ([module.kv_b.weight] if module is not None else [])
    return [out.detach(), *torch.autograd.grad(out.sum(), leaves)], _attention(reports)


# Found in review, fixed (wrong gradients, silently, under the default compiler): the rewritten op keeps for its
# backward a tensor the model's autograd never kept: the MLA op the weight (it recomputes q' = q_nope w_uk a block at
# a time), every sparse op the [B, S] key mask it reads from the model's padding mask. Where the graph writes it in
# place after the attention, graph_ops.own_copies hands the op a clone, which is right under compiler="eager" and
# "aot_eager". Under Inductor the clone of a graph input is not kept apart from the input: AOTAutograd's epilogue
# writes the input after the forward, and the backward reads the written values (dq off by up to 7.5 for the mask,
# 0.5 for q and 1.8 for the weight in the MLA model). Plain PyTorch shows it without hyscale (``y = x @
# w.clone(); w.mul_(0.5)`` under no_grad, w a parameter: Inductor's dx uses 0.5 w), so a clone cannot be the copy
# here. Fixed: own_copies hands the op hyscale.saved_copy, a custom op the min-cut partitioner does not recompute
# (it recomputed the cheap clone in the backward, from the written input).
@pytest.mark.parametrize("what", ["mla_weight", "key_mask"])
def test_kept_input_written_after_the_attention_under_inductor(what):
    if what == "mla_weight":
        torch.manual_seed(0)
        module, args, grad = _MlaWeightUpdated(), _mla_inputs(), (0,)
        ref = _MlaWeightUpdated()
        ref.load_state_dict(module.state_dict())
        got, sites = _grads_after_update(module, module, args, grad, "inductor")
        want, _ = _grads_after_update(ref, ref, args, grad, None)
    else:
        pad = torch.arange(S)[None] >= torch.tensor([0, 3])[:, None]
        args, grad = (*_inputs(), pad), (0, 1, 2)
        got, sites = _grads_after_update(_mask_updated, None, args, grad, "inductor")
        want, _ = _grads_after_update(_mask_updated, None, args, grad, None)
    assert [s.decision for s in sites] == ["rewritten"]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_kept_input_written_after_the_attention(compiler):
    """The same two models under the compilers that keep the clone: equal to eager."""
    torch.manual_seed(0)
    module, ref = _MlaWeightUpdated(), _MlaWeightUpdated()
    ref.load_state_dict(module.state_dict())
    got, sites = _grads_after_update(module, module, _mla_inputs(), (0,), compiler)
    want, _ = _grads_after_update(ref, ref, _mla_inputs(), (0,), None)
    pad = torch.arange(S)[None] >= torch.tensor([0, 3])[:, None]
    got2, sites2 = _grads_after_update(_mask_updated, None, (*_inputs(), pad), (0, 1, 2), compiler)
    want2, _ = _grads_after_update(_mask_updated, None, (*_inputs(), pad), (0, 1, 2), None)
    assert [s.decision for s in sites + sites2] == ["rewritten", "rewritten"]
    for a, b in zip(got + got2, want + want2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
