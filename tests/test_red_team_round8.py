"""Review round 8: the absorbed MLA op's ``keep_latent=False`` (o' recomputed in the backward, with dq's row term
corrected) and ``options["recompute_latent"]``, tried with blocks of rows spanning batch rows, an lse gradient
(finite, and infinite at empty rows), eager padding in training, causal / per-batch offsets, key masks, empty rows,
NaN / inf in keys no row picks, bf16 against fp32, aot_eager / Inductor with dynamic shapes, checkpointing, the
output read twice or written in place after, the kernels in the interpreter, and the option's validation.

Each "Found in review" test reproduces a bug found then (the input, what differed), now fixed; the others pin
behaviour that was already right. Tiny sizes: seconds each on the CPU (the interpreter's kernels at B = 2, T = 5).
"""

from __future__ import annotations

import operator

import pytest
import torch
from helpers import check_compiled
from sparse_attention_cases import close, finite
from test_red_team_round7 import DC, _attention, _Mla, _mla_inputs
from test_red_team_round7 import B as MB
from test_red_team_round7 import H as MH
from test_red_team_round7 import T as MT
from test_sparse_attention_mla import Dc, Dn, Dr, _graph_ops, _problem, _rel

from hyscale_compile import backend as backend_mod
from hyscale_compile.passes import report
from hyscale_compile.runtime import dispatch
from hyscale_compile.runtime.sparse_attention import absorbed, backward


def _op(keep: bool, eager_empty_grad: bool = False):
    def run(q, kv, w, idx, *args):
        return torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, *args, eager_empty_grad, keep)[:2]
    return run


def _eager_graph_ops(q, kv, w, idx, *a):
    """The graph ops with eager's gradient of empty rows (what the pass emitted with empty_rows_like_eager)."""
    ql = torch.cat([torch.einsum("bthn,hnc->bthc", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
    lat, lse = torch.ops.hyscale.sparse_attention_latent(ql, kv, idx, Dc, *a)
    lat = torch.ops.hyscale.empty_rows_like_eager(lat, ql, kv, kv[..., :Dc], lse, a[0])
    return torch.einsum("bthc,hvc->bthv", lat, w[:, Dn:]), lse


def _grads(fn, q, kv, w, idx, gout, glse, *args):
    """(out, lse, dq, dkv, dw) with the lse gradient ``glse`` everywhere, empty rows (lse -inf) included."""
    leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
    out, lse = fn(*leaves, idx, *args)
    torch.autograd.backward([out, lse], [gout, glse.to(lse.dtype)])
    return (out, lse, *(x.grad for x in leaves))


def _same_nan(got, want, tol):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(finite(a).double(), finite(b).double(), rtol=tol, atol=tol, equal_nan=True)


def _rows(monkeypatch, rows, q):
    monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * q.shape[0] * q.shape[2] * (Dc + Dr) * q.element_size())


# ---------------------------------------------------------------------------------------------
# 1. empty rows in the recomputed backward


# Found in review, fixed (NaN gradients): the recomputed backward corrects dq by eps * o, eps = rowsum(do' * o') -
# dlse - delta, o = p @ k. An empty row (no visible pick, lse -inf) has p = 0, o = 0, but its eps need not be
# finite: an lse gradient of -inf there (d(lse**2)/d lse at lse = -inf) makes eps inf - inf, and with empty="mean"
# a NaN or inf in a key no row picks makes the row's output (the mean of v) and so eps NaN: eps * 0 put NaN in the
# row's dq, and through the absorption in dq and w's gradient, where o' kept and the graph ops give finite values
# (every dq of such a row, in the reference and both kernel paths). eps is now 0 at empty rows (naive.backward; the
# kernels' shift, backward._run).
@pytest.mark.parametrize("what", ["dlse_inf", "nan_key", "inf_key"])
def test_recomputed_backward_of_empty_rows_is_finite(what, monkeypatch):
    q, kv, w, idx, gout, _ = _problem(B=2, T=9, seed=3)
    _rows(monkeypatch, 2, q)
    args = (0.3, True, -3, torch.tensor([-3, 2]), None, "zero" if what == "dlse_inf" else "mean")
    if what != "dlse_inf":
        idx = torch.where(idx == 0, -1, idx)  # key 0 kept by no row (picked by none)
        kv[:, 0] = float("nan" if what == "nan_key" else "inf")
    lse = _op(True)(q, kv, w, idx, *args)[1]
    assert lse.isinf().any() and not lse.isinf().all()
    glse = torch.where(lse.isinf(), float("-inf") if what == "dlse_inf" else 0.0, 1.0)
    got = _grads(_op(False), q, kv, w, idx, gout, glse, *args)
    kept = _grads(_op(True), q, kv, w, idx, gout, glse, *args)
    graph = _grads(_graph_ops, q, kv, w, idx, gout, glse, *args)
    assert got[2].isfinite().all() and got[3].isfinite().all()
    if what == "dlse_inf":
        assert got[4].isfinite().all()
    _same_nan(got, kept, 1e-5)
    _same_nan(got, graph, 1e-5)


# The same on the kernels (forced on the CPU, in the interpreter): one slice a row (the dq kernel's correction) and
# two (the host's, on the summed partials), blocks of 2 rows over 2 batch rows, per-batch offsets and a key mask.
@pytest.mark.parametrize("sliced", [False, True], ids=["one_slice", "two_slices"])
def test_recomputed_backward_of_empty_rows_on_the_kernels(sliced, monkeypatch):
    Bk, T, S, H, Dnk, Drk, Dck, Dv, K = 2, 5, 13, 2, 8, 8, 16, 8, 4
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(Bk, T, H, Dnk + Drk, generator=g), torch.randn(Bk, S, 1, Dck + Drk, generator=g)
    w = torch.randn(H, Dnk + Dv, Dck, generator=g) * 0.3
    idx = torch.stack([torch.randperm(S + 2, generator=g)[:K] - 1 for _ in range(Bk * T)]).view(Bk, T, K)
    km = torch.rand(Bk, S, generator=g) > 0.3
    gout, glse = torch.randn(Bk, T, H, Dv, generator=g), torch.randn(Bk, T, H, generator=g)
    monkeypatch.setattr(absorbed, "ROWS_BYTES", 2 * Bk * H * (Dck + Drk) * 4)
    if sliced:
        monkeypatch.setattr(backward, "PICKS", 2)
        monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    results = []
    for backend, keep in (("triton", False), ("reference", False), ("triton", True)):
        leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
        with dispatch.force_backend(backend):
            out, lse, _ = torch.ops.hyscale.sparse_attention_mla(*leaves, idx, Dnk, 0.3, True, 0, torch.tensor([S - T, -2]),
                                                                 km, "mean", False, keep)
            torch.autograd.backward([out, lse], [gout, torch.where(lse.isinf(), float("-inf"), glse)])
        results.append((out, lse, *(x.grad for x in leaves)))
    assert results[0][1].isinf().any()
    assert all(t.isfinite().all() for t in results[0][2:])
    close(results[0], results[1], 2e-5)
    close(results[0], results[2], 2e-5)


# ---------------------------------------------------------------------------------------------
# 2. the attention output written in place after the attention


class _MlaWritten(_Mla):
    """The attention output scaled in place after the attention, inside the graph (``inside``) or by the caller
    after a graph break: eager runs (nothing the model's autograd keeps is written)."""

    def __init__(self, inside=True, **kw):
        super().__init__(**kw)
        self.inside = inside

    def forward(self, q, c, r, score, pad):
        out = self.body(q, c, r, score, pad)
        if not self.inside:
            torch._dynamo.graph_break()
        out.mul_(2)
        return out * 3


def _compiled_grads(module, args, options, grad=(0, 1, 2)):
    xs = [x.detach().clone().requires_grad_(i in grad) if x.is_floating_point() else x for i, x in enumerate(args)]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return backend_mod.hyscale(gm, example_inputs, options=options)

    fn = module
    if options is not None:
        torch._dynamo.reset()
        fn = torch.compile(module, backend=backend)
    with report.collect() as reports:
        y = fn(*xs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    leaves = [xs[i] for i in grad] + [p for p in module.parameters() if p.requires_grad]
    return [y.detach(), *torch.autograd.grad((y * g).sum(), leaves)], _attention(reports), graphs


def _copies(graphs):
    """Copies of the attention op's output (own_copies gives the op copies of its inputs, e.g. the [B, S] mask)."""
    return sum(n.target is torch.ops.hyscale.saved_copy.default and n.args[0].target is operator.getitem
               for gm in graphs for n in gm.graph.nodes)


# Found in review, fixed (a crash, o' kept as well as recomputed): the change made the MLA op keep its output out
# for the backward (its recomputed row term reads it) in both modes. A model that writes its attention output in
# place after the attention (here ``out.mul_(2)`` after HF's ``.transpose(1, 2).contiguous()``, which the rewrite
# makes the op's output itself) then failed: "one of the variables needed for gradient computation has been
# modified by an inplace operation" in the backward under compiler="eager", and at compile time (AOTAutograd's
# trace) under aot_eager and Inductor, in the default mode too; eager runs, and so did the rewrite before the
# change. Fixed twice: the op keeps out only without keep_latent (lowering/attention_mla.py), and the rewrite hands
# a model that may write the output of an op that keeps it a copy (hyscale.saved_copy: Inductor removed a clone
# and the caller's write after a graph break reached the kept tensor), which also fixes hyscale.sparse_attention,
# which kept its output before the change, for the same models.
@pytest.mark.parametrize("compiler,recompute,inside", [
    ("eager", False, True), ("aot_eager", False, True), ("aot_eager", True, True),
    ("inductor", True, False), ("eager", True, False),
])
def test_attention_output_written_in_place_after(compiler, recompute, inside):
    torch.manual_seed(0)
    module = _MlaWritten(inside=inside, mask="pad")
    args = _mla_inputs()
    got, sites, graphs = _compiled_grads(module, args, {"compiler": compiler, "recompute_latent": recompute})
    want, _, _ = _compiled_grads(module, args, None)
    assert [s.decision for s in sites] == ["rewritten"] and sites[0].layout.startswith("MLA latent")
    assert ("recomputed in the backward" in sites[0].reason) == recompute
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert _copies(graphs[:1]) == (1 if recompute else 0)  # a copy only where the op keeps its output


def test_sparse_attention_output_written_in_place_after():
    """The plain op kept its output before the change: the same model shape, the same fix."""
    from test_red_team_round6 import _causal, _hidden, _inputs, _picks

    def attn(q, k, v, s):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_causal() & ~_hidden(_picks(s)))
        o = o.transpose(1, 2).contiguous()
        o.mul_(2)
        return o * 3

    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2), compiler="aot_eager"))
    assert [s.decision for s in sites] == ["rewritten"]


def test_no_copy_where_the_output_is_not_written():
    """A write to a tensor computed from the output (``y = out * 3; y.add_(1)``) is no write of it: no copy."""

    class Later(_Mla):
        def forward(self, q, c, r, score, pad):
            y = self.body(q, c, r, score, pad) * 3
            y.add_(1)
            return y

    torch.manual_seed(0)
    module = Later(mask="pad")
    got, sites, graphs = _compiled_grads(module, _mla_inputs(), {"compiler": "eager", "recompute_latent": True})
    want, _, _ = _compiled_grads(module, _mla_inputs(), None)
    assert [s.decision for s in sites] == ["rewritten"] and _copies(graphs) == 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_op_output_written_by_its_caller():
    """The op itself: with o' kept out may be written after (nothing kept reads it: the gradients are those of the
    unwritten call); without, the backward reads it and refuses loudly, never silently."""
    q, kv, w, idx, gout, _ = _problem()
    grads = []
    for keep, write in ((True, False), (True, True), (False, True)):
        leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
        out = torch.ops.hyscale.sparse_attention_mla(*leaves, idx, Dn, 0.3, True, 12, None, None, "zero", False,
                                                     keep)[0]
        y = out * gout
        if write:
            out.mul_(2)
        if keep:
            y.sum().backward()
            grads.append([x.grad for x in leaves])
        else:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
    close(grads[1], grads[0], 0)


# ---------------------------------------------------------------------------------------------
# 3. tried in review, already right


VIS = {  # (causal, offset, offsets, key mask)
    "offsets": (True, 0, torch.tensor([12, -4, 3]), False),
    "key_mask": (True, 5, None, True),
    "few_visible": (True, -4, None, False),
}


@pytest.mark.parametrize("name,empty,eager_empty_grad", [
    ("offsets", "zero", False), ("key_mask", "mean", False), ("few_visible", "mean", True), ("offsets", "mean", True),
])
def test_recomputed_equals_the_graph_ops_over_batch_rows(name, empty, eager_empty_grad, monkeypatch):
    """B = 3 in blocks of 2 rows (each block spans the batch rows: o' and lse not written in place), an lse gradient
    at every row, empty ones included: values and the gradients of q, kv and w as the graph ops' (with eager's
    gradient of empty rows where asked) and as o' kept."""
    q, kv, w, idx, gout, glse = _problem(B=3, T=9, seed=7)
    _rows(monkeypatch, 2, q)
    causal, offset, offsets, key_mask = VIS[name]
    key_mask = torch.rand(3, kv.shape[1], generator=torch.Generator().manual_seed(1)) > 0.5 if key_mask else None
    args = (0.3, causal, offset, offsets, key_mask, empty)
    got = _grads(_op(False, eager_empty_grad), q, kv, w, idx, gout, glse, *args)
    close(got, _grads(_eager_graph_ops if eager_empty_grad else _graph_ops, q, kv, w, idx, gout, glse, *args), 1e-5)
    close(got, _grads(_op(True, eager_empty_grad), q, kv, w, idx, gout, glse, *args), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_recomputed_as_accurate_as_the_graph_ops(dtype, monkeypatch):
    """Against the fp32 graph ops, with per-batch offsets, a key mask, empty rows (mean), an lse gradient and blocks
    spanning batch rows: out, lse, dq and dw no further than o' kept (and than the 16-bit graph ops), kv's gradient
    within 1.5x of the 16-bit graph ops'."""
    q, kv, w, idx, gout, glse = _problem(B=2, T=24, H=8, seed=2, dtype=dtype)
    _rows(monkeypatch, 5, q)
    key_mask = torch.rand(2, kv.shape[1], generator=torch.Generator().manual_seed(1)) > 0.3
    args = (0.3, True, 0, torch.tensor([10, -3]), key_mask, "mean")
    got = _grads(_op(False), q, kv, w, idx, gout, glse, *args)
    kept = _grads(_op(True), q, kv, w, idx, gout, glse, *args)
    graph = _grads(_graph_ops, q, kv, w, idx, gout, glse, *args)
    ref = _grads(_graph_ops, *(x.float() for x in (q, kv, w)), idx, gout.float(), glse, *args)
    assert got[1].isinf().any()
    for name, a, k, g, r in zip(("out", "lse", "dq", "dkv", "dw"), got, kept, graph, ref):
        assert a.dtype == k.dtype == g.dtype
        most = 1.5 * _rel(g, r) if name == "dkv" else max(_rel(k, r), _rel(g, r)) * 1.05
        assert _rel(a, r) <= most + 1e-6, (name, _rel(a, r), _rel(k, r), _rel(g, r))


def _check_recompute(module, calls, compiler, dynamic=None, grad=(0, 1, 2), **tol):
    """Compiled with recompute_latent: outputs and gradients equal eager's on each call, the site rewritten
    absorbed and the report saying o' is recomputed."""
    def run(fn, args):
        xs = [x.detach().clone().requires_grad_(i in grad) if x.is_floating_point() else x for i, x in enumerate(args)]
        out = fn(*xs)
        out = out if isinstance(out, tuple) else (out,)
        leaves = [xs[i] for i in grad] + [p for p in module.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(7)
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
        return [o.detach() for o in out] + list(torch.autograd.grad(loss, leaves))

    torch._dynamo.reset()
    compiled = torch.compile(module, backend="hyscale", dynamic=dynamic,
                             options={"compiler": compiler, "recompute_latent": True})
    with report.collect() as reports:
        got = [run(compiled, args) for args in calls]
    for g, w in zip(got, [run(module, args) for args in calls], strict=True):
        for a, b in zip(g, w, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **{**dict(rtol=1e-4, atol=1e-5), **tol})
    sites = _attention(reports)
    assert sites and all(s.decision == "rewritten" and s.layout.startswith("MLA latent")
                         and "recomputed in the backward" in s.reason for s in sites), [s.reason for s in sites]


class _Twice(_Mla):
    """The attention output read twice."""

    def forward(self, q, c, r, score, pad):
        o = self.body(q, c, r, score, pad)
        return o * 2, o.sum(-1)


MODELS = {  # (module, inputs, compiler, dynamic, ROWS_BYTES in rows)
    "inductor_dynamic": (lambda: _Mla(mask="pad"), [_mla_inputs(), _mla_inputs(seed=2, b=3, t=7)], "inductor", True,
                         2),
    "aot_checkpoint_offsets": (lambda: _Mla(ckpt=True, mask="offsets"), [_mla_inputs()], "aot_eager", None, 1),
    "eager_padding_training": (lambda: _Mla("eager", mask="pad"), [_mla_inputs()], "eager", None, 1),
    "read_twice": (lambda: _Twice(mask="pad"), [_mla_inputs()], "aot_eager", None, 1),
    "bf16_shared_latent": (lambda: _Mla(dtype=torch.bfloat16), [_mla_inputs(dtype=torch.bfloat16, shared=True)],
                           "eager", None, 1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recompute_latent_models(name, monkeypatch):
    module, calls, compiler, dynamic, rows = MODELS[name]
    monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * 2 * 4 * 24 * calls[0][0].element_size())
    torch.manual_seed(0)
    tol = dict(rtol=3e-2, atol=3e-2) if "bf16" in name else {}
    _check_recompute(module(), calls, compiler, dynamic, **tol)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_recompute_latent_keeps_no_latent_output(compiler):
    """What the compiled forward keeps for the backward: o' ([B, T, H, Dc]) once, and not with recompute_latent."""
    def saved(recompute):
        torch._dynamo.reset()
        torch.manual_seed(0)
        compiled = torch.compile(_Mla(mask="pad"), backend="hyscale",
                                 options={"compiler": compiler, "recompute_latent": recompute})
        xs = [x.requires_grad_() if i < 3 else x for i, x in enumerate(_mla_inputs())]
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = compiled(*xs)
        y.sum().backward()
        return shapes

    latent = (MB, MT, MH, DC)
    assert latent in saved(False) and latent not in saved(True)


@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)])
def test_recompute_latent_must_be_a_bool(value):
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="hyscale", options={"recompute_latent": value})
    with pytest.raises(Exception, match=r"TypeError: hyscale: options\['recompute_latent'\] must be True or False"):
        fn(torch.ones(3))
