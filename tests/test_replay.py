"""Selection replay through torch.compile(backend="hyscale"): gradients, partitioned graphs, profiler.

Every compiled variant is built once (compiles are the slow part on CPU) and shared by the tests.
"""

from __future__ import annotations

import functools
import math
import operator

import expecttest
import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hyscale_compile
from hyscale_compile.passes import replay

B, T, DM, H, D, K = 1, 32, 6, 2, 8, 4
S = T  # keys are the same tokens
OFFSET = K  # every query sees at least K + 1 keys: no masked picks, so dense topk agrees on indices
SCALE = 0.5
HYSCALE_OPS = {"select", "rescore", "sparse_backward"}


# ---------------------------------------------------------------------------------------------
# the model: an indexer (dense as users write it, or the hyscale op) feeding sparse attention


def _dense_indexer(q, kx, w, spelling):
    dots = torch.einsum("bthd,bsd->bths", q, kx) * SCALE
    score = (torch.relu(dots) * w[..., None]).sum(2)
    t = torch.arange(T).view(T, 1)
    s = torch.arange(S).view(1, S)
    score = score.masked_fill(s > t + OFFSET, float("-inf"))
    values, idx = score.topk(K, dim=-1)
    if spelling == "gather":
        values = score.gather(-1, idx)
    return values, idx


def _hyscale_indexer(q, kx, w, spelling):
    return hyscale_compile.indexer_topk(q, kx, K, weights=w, scale=SCALE, query_offset=OFFSET)


def _layer(x, wq, wk, ww, wa, indexer, loss):
    # Offsets keep the dots positive: relu then leaves no exact ties at 0 that topk may break either way.
    xn = torch.nn.functional.layer_norm(x, (DM,))
    q = (xn @ wq + 2.0).view(B, T, H, D)
    kx = xn @ wk + 2.0
    w = xn @ ww
    values, idx = indexer(q, kx, w, loss)
    if loss == "values":  # the loss reads topk values directly
        return (torch.softmax(values, -1) * x[..., :K]).sum() + values.square().mean(), x + values.mean(-1, True)
    # DSA: sparse attention over the selected keys, indexer KL loss read at the selected positions
    qa, ka, va = (x @ wa[i] for i in range(3))
    flat = idx.reshape(B * T * K)
    sel_k = ka.reshape(B * S, DM)[flat].view(B, T, K, DM)
    sel_v = va.reshape(B * S, DM)[flat].view(B, T, K, DM)
    attn = torch.softmax(torch.einsum("btd,btkd->btk", qa, sel_k) / math.sqrt(DM), -1)
    out = torch.einsum("btk,btkd->btd", attn, sel_v)
    target = attn.detach()
    kl = (target * (target.clamp_min(1e-12).log() - torch.log_softmax(values, -1))).sum()
    return out.square().mean() + kl, x + out


def _sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _model(indexer, loss, ckpt):
    def fn(x, wq, wk, ww, wa):
        if ckpt == "none":
            return _layer(x, wq, wk, ww, wa, indexer, loss)[0]
        ctx = {} if ckpt != "sac" else {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                        _sac_policy)}
        first, h = checkpoint(_layer, x, wq, wk, ww, wa, indexer, loss, use_reentrant=False, **ctx)
        if ckpt != "ckpt2":
            return first
        # a second checkpointed layer reading the first one's output: replay must stay in each region
        return first + checkpoint(_layer, h, wq, wk, ww, wa, indexer, loss, use_reentrant=False)[0]

    return fn


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(B, T, DM), (DM, H * D), (DM, D), (DM, H), (3, DM, DM)]
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _assert_close(got, want):
    """fp32 compiled result against the float64 dense oracle, tolerance relative to the tensor's scale."""
    assert (got is None) == (want is None)
    if got is None:
        return
    want = want.to(got.dtype)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# ---------------------------------------------------------------------------------------------
# capturing the partitioned graphs


class _Capture(CustomGraphPass):
    """Post-grad pass that keeps a compact projection of every graph Inductor compiles."""

    def __init__(self):
        self.graphs: list[dict] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        out = next(n for n in nodes if n.op == "output")
        self.graphs.append({
            "bw": any(str(n.target).startswith("tangents") for n in placeholders),
            "ops": [_op_label(n) for n in nodes if _hyscale_name(n)],
            "placeholders": [n.name for n in placeholders if not str(n.target).startswith("tangents")],
            "kinds": {n.name: _kind(n) for n in nodes},
            "outputs": [a.name for a in torch.fx.node.map_aggregate(out.args[0], lambda a: a)
                        if isinstance(a, torch.fx.Node)],
            # Score tables are floating point; a bool [T, S] mask the user builds may stay (it is theirs).
            "max_numel": max([n.meta["val"].numel() for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)
                              and n.meta["val"].is_floating_point()] or [0]),
        })

    def uuid(self):
        return None  # never cached: the graphs must really be compiled to be seen


def _hyscale_name(node) -> str | None:
    target = getattr(node.target, "_schema", None)
    if node.op == "call_function" and target is not None and target.name.startswith("hyscale::"):
        return target.name.split("::")[1]
    return None


def _op_label(node) -> str:
    tag = node.meta.get("recompute")
    return _hyscale_name(node) + (f"[{tag.name}]" if tag is not None else "")


def _kind(node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.target is operator.getitem and _hyscale_name(node.args[0]) == "select":
        return ("values", "indices")[node.args[1]]
    return "other"


def _project(graphs: list[dict]) -> str:
    """hyscale ops of forward and backward (with recompute tags), and what the forward saves, by kind."""
    fw = next(g for g in graphs if not g["bw"])
    bw = next(g for g in graphs if g["bw"])
    saved = [fw["kinds"].get(name, "?") for name in bw["placeholders"]]
    # How many "other" tensors are kept is the partitioner's business and varies across torch versions.
    counts = ", ".join(kind if kind == "other" else f"{kind} x{saved.count(kind)}" for kind in sorted(set(saved)))
    return (f"fw: {', '.join(fw['ops'])}\n"
            f"saved: {counts}\n"
            f"bw: {', '.join(bw['ops'])}")


# ---------------------------------------------------------------------------------------------
# one compiled run per variant


@functools.cache
def _run(loss: str, ckpt: str, indexer: str = "hyscale") -> dict:
    """One compiled run; indexer "dense" is the unmodified code, which the selection pass must rewrite."""
    counters.clear()
    cap = _Capture()
    user_indexer = _hyscale_indexer if indexer == "hyscale" else _dense_indexer
    fn = torch.compile(_model(user_indexer, loss, ckpt), backend="hyscale",
                       options={"post_grad_custom_post_pass": cap, "fx_graph_cache": False})
    inputs = _inputs()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        out = fn(*inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward()
    bw_ops = [e.name for e in prof.events()]
    ref_inputs = _inputs(torch.float64)
    ref = _model(_dense_indexer, loss, ckpt)(*ref_inputs)
    ref.backward()
    return {"out": out.detach(), "ref": ref.detach(), "grads": [t.grad for t in inputs],
            "ref_grads": [t.grad for t in ref_inputs], "graphs": cap.graphs, "bw_ops": bw_ops,
            "counters": dict(counters["hyscale"])}


VARIANTS = [(loss, ckpt) for loss in ("values", "gather") for ckpt in ("none", "ckpt", "sac")] + [("gather", "ckpt2")]
SITES = {"ckpt2": 2}


@pytest.mark.parametrize("loss,ckpt", VARIANTS)
def test_gradients_match_dense_eager(loss, ckpt):
    r = _run(loss, ckpt)
    _assert_close(r["out"], r["ref"])
    for got, want in zip(r["grads"], r["ref_grads"]):
        _assert_close(got, want)


@pytest.mark.parametrize("loss,ckpt", VARIANTS)
def test_backward_never_runs_select(loss, ckpt):
    r = _run(loss, ckpt)
    assert "hyscale::select" not in r["bw_ops"]
    assert "hyscale::sparse_backward" in r["bw_ops"]
    if ckpt != "none":
        assert "hyscale::rescore" in r["bw_ops"]
    # counted where a recomputation of the selection was rewritten: never without checkpointing
    assert r["counters"].get("replay_applied", 0) == (0 if ckpt == "none" else SITES.get(ckpt, 1))


@pytest.mark.parametrize("loss,ckpt", VARIANTS)
def test_partition_invariants(loss, ckpt):
    r = _run(loss, ckpt)
    fw = next(g for g in r["graphs"] if not g["bw"])
    bw = next(g for g in r["graphs"] if g["bw"])
    assert not any(op.startswith("select") for op in bw["ops"])
    assert any(fw["kinds"].get(name) == "indices" for name in bw["placeholders"]), "the forward saves the indices"
    assert max(fw["max_numel"], bw["max_numel"]) < T * S, "no T x S tensor in either graph"


class TestGoldenGraphs(expecttest.TestCase):
    def test_checkpoint_gather(self):
        self.assertExpectedInline(_project(_run("gather", "ckpt")["graphs"]), """\
fw: select[MUST_SAVE]
saved: indices x1, input x5
bw: rescore[MUST_RECOMPUTE], sparse_backward""")

    def test_checkpoint_values(self):
        self.assertExpectedInline(_project(_run("values", "ckpt")["graphs"]), """\
fw: select[MUST_SAVE]
saved: indices x1, input x4
bw: rescore[MUST_RECOMPUTE], sparse_backward""")

    def test_selective_checkpoint_gather(self):
        self.assertExpectedInline(_project(_run("gather", "sac")["graphs"]), """\
fw: select[MUST_SAVE]
saved: indices x1, input x2, other
bw: rescore[MUST_RECOMPUTE], sparse_backward""")

    def test_two_checkpointed_layers(self):
        self.assertExpectedInline(_project(_run("gather", "ckpt2")["graphs"]), """\
fw: select[MUST_SAVE], select[MUST_SAVE]
saved: indices x2, input x4, other
bw: rescore[MUST_RECOMPUTE], sparse_backward, rescore[MUST_RECOMPUTE], sparse_backward""")

    def test_no_checkpoint_gather(self):
        self.assertExpectedInline(_project(_run("gather", "none")["graphs"]), """\
fw: select[MUST_SAVE]
saved: indices x1, input x1, other
bw: sparse_backward""")


def test_unmodified_indexer_is_rewritten_and_replayed():
    r = _run("gather", "ckpt", "dense")
    assert r["counters"].get("selection_rewritten") == 1, r["counters"]
    assert r["counters"].get("replay_applied") == 1
    assert "hyscale::select" not in r["bw_ops"] and "hyscale::rescore" in r["bw_ops"]
    _assert_close(r["out"], r["ref"])
    for got, want in zip(r["grads"], r["ref_grads"]):
        _assert_close(got, want)
    fw = next(g for g in r["graphs"] if not g["bw"])
    bw = next(g for g in r["graphs"] if g["bw"])
    assert max(fw["max_numel"], bw["max_numel"]) < T * S, "the score table must be gone from both graphs"
    assert _project(r["graphs"]) == _project(_run("gather", "ckpt")["graphs"])


# ---------------------------------------------------------------------------------------------
# registration


class _Other(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return "other"


def test_config_patches_install_and_chain():
    alone = replay.inductor_config_patches({})["joint_custom_pre_pass"]
    assert isinstance(alone, replay.ReplayPass) and alone.uuid() == replay.ReplayPass().uuid()
    other = _Other()
    chained = replay.inductor_config_patches({"joint_custom_pre_pass": other})["joint_custom_pre_pass"]
    assert isinstance(chained, replay.ChainedPass) and chained.passes[0] is other
    assert isinstance(chained.passes[1], replay.ReplayPass) and chained.uuid()[0] == "other"
    again = replay.inductor_config_patches({"joint_custom_pre_pass": chained})["joint_custom_pre_pass"]
    assert len(again.passes) == 2, "installing twice must not run the pass twice"
    listed = replay.inductor_config_patches({"joint_custom_pre_pass": [other]})["joint_custom_pre_pass"]
    assert isinstance(listed, replay.ChainedPass) and len(listed.passes) == 2


# ---------------------------------------------------------------------------------------------
# a random op in the replayed region: the backward must see the forward's draw, not a new one


def _dropout_region(q, kx, w, x):
    values, _ = _dense_indexer(q, kx, w, "values")
    return torch.nn.functional.dropout(values + x, p=0.5, training=True)


def _dropout_model(q, kx, w, x):
    return checkpoint(_dropout_region, q, kx, w, x, use_reentrant=False)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_random_op_after_the_selection_keeps_its_forward_draw(compiler):
    """dropout(values + x) under checkpointing: x.grad is the forward's keep mask times 1 / (1 - p). Replay
    copies the deterministic reads of the values into the backward; a random op stays with the partitioner,
    which replays its seed, so the backward's mask is the forward's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, D, generator=g).abs().requires_grad_()
    kx = torch.randn(B, S, D, generator=g).abs().requires_grad_()
    w = torch.randn(B, T, H, generator=g).requires_grad_()
    x = (torch.rand(B, T, K, generator=g) + 1.0).requires_grad_()  # values + x never 0: kept entries show
    counters.clear()
    out = torch.compile(_dropout_model, backend="hyscale", options={"compiler": compiler})(q, kx, w, x)
    out.sum().backward()
    assert counters["hyscale"]["selection_rewritten"] == 1
    kept = (out != 0).float()
    assert 0 < kept.mean() < 1
    torch.testing.assert_close(x.grad, kept * 2.0)


def test_cache_key_covers_every_op_registration(tmp_path, monkeypatch):
    """The pass's uuid (Inductor's and AOTAutograd's cache key) hashes every module registering our ops: their
    autograd formulas are traced into the cached joint graph, so a changed one must not be served stale (an
    upgrade changing an op's backward arguments would otherwise call it with the old ones)."""
    from pathlib import Path

    import hyscale_compile.lowering as lowering

    registering = {p.name for p in Path(lowering.__file__).parent.glob("*.py")
                   if "torch.library" in p.read_text() or "custom_op" in p.read_text()}
    assert {"ops.py", "attention.py", "attention_mla.py"} <= registering
    assert registering <= {p.name for p in replay._SOURCES}
    uuids, sources = [], replay._SOURCES
    for version in ("old", "new"):  # two trees (the file hash is cached by path)
        (tmp_path / version).mkdir()
        copies = []
        for p in sources:
            text = p.read_text() + ("\n# an autograd formula changed\n" if version == "new" and
                                    p.name == "attention_mla.py" else "")
            copies.append(tmp_path / version / f"{len(copies)}_{p.name}")
            copies[-1].write_text(text)
        monkeypatch.setattr(replay, "_SOURCES", tuple(copies))
        uuids.append(replay.ReplayPass().uuid())
    assert uuids[0] != uuids[1]
