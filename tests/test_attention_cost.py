"""The attention pass rewrites a provable site only where the sparse op is estimated faster (attention_cost).

The estimate's rates are fitted to the committed device results of benchmarks/sparse_attention.py; these tests
check that the fit still reproduces them, that the decisions at the model sizes users run come out as the
measurements say they should, and that the pass, left to its default, keeps a tiny model's attention dense
(with a reason) while ``options["attention"] = "always"`` rewrites it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import dsa_attention as da

from hyscale_compile.passes import attention_cost as cost
from hyscale_compile.passes import report

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _fitted_rows() -> list[dict]:
    """The measurements the per-head rates are fitted to: the GQA and per-head rows of sparse_attention.json (its
    mla row, and sparse_attention_latent.json's, predate the latent backward's kernel changes: the latent rates
    are fitted to the layer step's kernels, ``test_latent_fit_reproduces_the_layer_step_kernels``)."""
    return [r for r in json.loads((RESULTS / "sparse_attention.json").read_text())["rows"] if r["layout"] != "mla"]


LATENT_KERNELS = {"fwd": ["_fwd_kernel"], "bwd": ["_contrib_kernel", "_segment_kernel", "_dq_kernel"]}


def _bench_shape(row: dict, training: bool) -> cost.Shape:
    """A benchmark row as the op runs it (its dense baseline runs the same per-head layout)."""
    mla = row["layout"] == "mla"
    return cost.Shape(B=1, T=row["T"], S=row["S"], H=row["H"], k=row["k"], itemsize=2, training=training,
                      eager=False, G=row["G"], Dqk=row["Dqk"], Dv=row["Dv"], aliased=mla, dense_Dqk=row["Dqk"],
                      dense_Dv=row["Dv"])


def _hf_dsa(T: int, *, training: bool, latent: bool = True, eager: bool = False, k: int = 2048) -> cost.Shape:
    """One DeepSeek-V3.2 attention (128 heads, qk 128 + 64, v 128, latent 512 + 64) at T = S."""
    op = dict(G=1, Dqk=576, Dv=512, aliased=True) if latent else dict(G=128, Dqk=192, Dv=128, aliased=False)
    return cost.Shape(B=1, T=T, S=T, H=128, k=k, itemsize=2, training=training, eager=eager, dense_Dqk=192,
                      dense_Dv=128, **op)


@pytest.mark.parametrize("row", _fitted_rows(), ids=lambda r: f"{r['layout']}-{r['S']}")
def test_fit_reproduces_the_committed_measurements(row):
    s = _bench_shape(row, training=False)
    assert cost.sparse_ms(s) == pytest.approx(row["sparse_fwd_ms"], rel=0.25)
    assert cost.sparse_ms(_bench_shape(row, training=True)) == pytest.approx(row["sparse_fwd_bwd_ms"], rel=0.25)
    if row["layout"] != "mla":  # the mla baseline runs the latent dims, which no model's dense attention does
        assert cost.dense_ms(s) == pytest.approx(row["dense_masked_fwd_ms"], rel=0.25)
        assert cost.dense_ms(_bench_shape(row, True)) == pytest.approx(row["dense_masked_fwd_bwd_ms"], rel=0.25)


@pytest.mark.parametrize("T", [65536])  # (the 32K row's kernels predate the fit's)
def test_latent_fit_reproduces_the_layer_step_kernels(T):
    """The latent op's forward and backward kernels in the profiled DeepSeek-V3.2 layer step (model.json)."""
    row = next(r for r in json.loads((RESULTS / "model.json").read_text())["rows"] if r["T"] == T)
    ms = dict(row["hyscale_top_kernels"])
    fwd, bwd = (sum(ms[name] for name in names) for names in LATENT_KERNELS.values())
    assert cost.sparse_ms(_hf_dsa(T, training=False)) == pytest.approx(fwd, rel=0.15)
    assert cost.sparse_ms(_hf_dsa(T, training=True)) == pytest.approx(fwd + bwd, rel=0.15)


@pytest.mark.parametrize("T, training, latent, expected", [
    (8192, True, True, False),  # measured (older kernels): 197 ms sparse (latent) against 82 ms dense (per-head)
    # the DeepSeek-V3.2 layer's step (results/model.json), sparse against dense: 548 against 440 ms at 16384 (kernels
    # of fcf449b, 1.7x slower at 64K than fa7ec5a's), 722 against 1662 at 32768, 1376 against 6736 at 65536 (dense
    # grows with T * S, the op with T * k). At 16384 the estimate with fa7ec5a's kernels is 1.32x: not yet measured.
    (16384, True, True, True),
    (32768, True, True, True),
    (65536, True, True, True),
    (32768, False, True, True),  # a forward: the op's forward is 6x cheaper than its backward
    (4096, False, True, False),
    (65536, True, False, False),  # per-head gathers: 49x slower than dense at 8K; at 64K a step of 35 s against 6.7
    (262144, True, False, False),  # ... and at 256K in training (the backward's per-pick contributions)
    (262144, False, False, True),  # a forward over 256K keys: the gather pays at last
])
def test_decisions_at_model_sizes(T, training, latent, expected):
    faster, words = cost.pays(_hf_dsa(T, training=training, latent=latent))
    assert faster == expected, words
    assert f"S={T} keys" in words and ("a training step" if training else "a forward") in words


def test_eager_attention_counts_its_logits():
    sdpa, eager = _hf_dsa(32768, training=True), _hf_dsa(32768, training=True, eager=True)
    assert cost.dense_ms(eager) > cost.dense_ms(sdpa)
    assert cost.sparse_ms(eager) == cost.sparse_ms(sdpa)


def test_more_picks_cost_more_and_k_past_s_costs_s():
    small, big = _hf_dsa(16384, training=True, k=512), _hf_dsa(16384, training=True, k=4096)
    assert cost.sparse_ms(small) < cost.sparse_ms(big)
    assert cost.sparse_ms(_hf_dsa(1024, training=True, k=4096)) == cost.sparse_ms(_hf_dsa(1024, training=True,
                                                                                          k=1024))


def test_symbolic_sizes_are_read_at_their_traced_size():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env, src = ShapeEnv(), ConstantSource("T")
    T = env.create_symintnode(env.create_symbol(37, source=src), hint=37, source=src)
    assert cost.size_hint(T) == 37 and cost.size_hint(5) == 5 and cost.size_hint(None) is None
    assert not env.guards  # reading the hint adds no guard


def _compile(options: dict, monkeypatch, form: str = "sdpa_bool"):
    monkeypatch.delenv("HYSCALE_ATTENTION", raising=False)
    module, args = da.make(form)
    with report.collect() as reports:
        out = torch.compile(module, backend="hyscale", options={"compiler": "eager", **options})(*args)
    sites = [r for r in reports if r.kind == "attention"]
    exact = not any(s.rewritten for s in sites)  # left alone: the model's own graph, the same bits
    torch.testing.assert_close(out, module(*args), **({"rtol": 0, "atol": 0} if exact else {}))
    return sites


def test_default_leaves_a_tiny_attention_dense_and_says_why(monkeypatch):
    sites = _compile({}, monkeypatch)
    assert sites and all(not s.rewritten for s in sites)
    assert sites[0].reason.startswith("not faster: estimated ")
    assert "options['attention'] = 'always' rewrites it anyway" in sites[0].reason


def test_always_rewrites_and_reports_the_estimate(monkeypatch):
    sites = _compile({"attention": "always"}, monkeypatch)
    assert sites and all(s.rewritten for s in sites)
    assert "not faster, rewritten as options['attention'] is 'always'" in sites[0].reason


def test_default_rewrites_where_the_estimate_says_faster(monkeypatch):
    monkeypatch.setattr(cost, "MARGIN", 0.0)  # any estimate counts as faster
    sites = _compile({}, monkeypatch)
    assert sites and all(s.rewritten for s in sites)
    assert "for the sparse op against" in sites[0].reason and "not faster" not in sites[0].reason


def test_the_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv("HYSCALE_ATTENTION", "always")
    assert cost.always()
    monkeypatch.setenv("HYSCALE_ATTENTION", "")
    assert not cost.always()


@pytest.mark.parametrize("grad_mode, requires_grad, expected", [
    (True, True, "a training step"), (False, True, "a forward"), (True, False, "a forward")])
def test_training_or_inference_as_autograd_decides(monkeypatch, grad_mode, requires_grad, expected):
    """A backward is counted where AOT autograd builds one: grad mode on and an operand that requires grad."""
    monkeypatch.delenv("HYSCALE_ATTENTION", raising=False)
    module, args = da.make("sdpa_bool", requires_grad=requires_grad)
    with torch.set_grad_enabled(grad_mode), report.collect() as reports:
        torch.compile(module, backend="hyscale", options={"compiler": "eager"})(*args)
    sites = [r for r in reports if r.kind == "attention"]
    assert sites and f"({expected}, B=" in sites[0].reason, sites[0].reason
