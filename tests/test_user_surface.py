"""Driving the backend as any torch.compile backend: TORCH_LOGS, validated options, truthful counters on a
cache hit, explain() beside compiled models, the command line, packaging."""

from __future__ import annotations

import json
import logging
import os
import runpy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import indexers
import pytest
import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import hyscale_compile
from hyscale_compile.backend import HyscaleOptions, _inductor_patches
from hyscale_compile.passes import debug, replay, report

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# logging


SCRIPT = """\
import torch

import hyscale_compile  # noqa: F401  (after torch: TORCH_LOGS is parsed when torch is imported)


def f(q, kx, w):
    score = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, kx))).sum(2)
    kept = score.topk(2, dim=-1).indices
    dense = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, kx))).sum(2)
    other = dense.topk(2, dim=-1).indices
    soft = torch.log_softmax(dense, -1)
    late = torch.einsum("bthd,bsd->bts", q, kx)
    torch._dynamo.graph_break()
    return kept, other, soft, late.topk(2, dim=-1).indices


q, kx, w = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 8), torch.randn(1, 4, 2)
torch.compile(f, backend="hyscale", options={"compiler": "eager"})(q, kx, w)
"""


@pytest.mark.parametrize("setting", ["hyscale", "+hyscale"])
def test_torch_logs_names_every_site(tmp_path, setting):
    (tmp_path / "model.py").write_text(SCRIPT)
    env = {**os.environ, "TORCH_LOGS": setting, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "model.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if "hyscale:" in ln]
    # paths relative to the current directory, one line per site with its decision
    assert any("rewrote the top-k at model.py:8 (f)" in ln for ln in lines), run.stderr
    # the reason's wording is the pass's; what it must name is the reader and where it is
    assert any("left the top-k at model.py:10 (f) alone:" in ln and "log_softmax at model.py:11" in ln
               for ln in lines), run.stderr
    broke = [ln for ln in lines if "left the top-k at model.py:14 (f) alone" in ln]
    assert broke and "Dynamo broke the graph at model.py:13" in broke[0], run.stderr
    assert "/model.py" not in "\n".join(lines)
    detailed = "shapes:" in run.stderr
    assert detailed == setting.startswith("+"), run.stderr


def _records(level=logging.DEBUG):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    return records, Keep(level)


def test_log_lines_in_process():
    records, handler = _records()
    log = logging.getLogger("hyscale")
    old = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        model, args = indexers.dense_warmup()
        torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(info) == 1 and "left the top-k at" in info[0] and "log_softmax" in info[0]
    assert report.shown(str(ROOT / "tests" / "indexers.py")) + ":" in info[0]
    assert any("shapes:" in r.getMessage() for r in records if r.levelno == logging.DEBUG)


def test_site_table_is_a_structured_trace_artifact():
    from torch._logging._internal import trace_log

    records, handler = _records()
    old = trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        model, args = indexers.weighted_sum()
        torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args)
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(old)
    tables = [r for r in records if "hyscale_sites" in str(getattr(r, "metadata", ""))]
    assert len(tables) == 1
    (site,) = json.loads(tables[0].payload)
    assert site["decision"] == "rewritten" and site["source"].endswith("(forward)")


def test_shown_paths_are_relative_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside, outside = str(tmp_path / "pkg" / "m.py"), "/elsewhere/m.py"
    assert report.shown(f"{inside}:3 (forward)") == "pkg/m.py:3 (forward)"
    assert report.shown(f"read at {outside}:3 (forward)") == f"read at {outside}:3 (forward)"
    resumed = f"{inside}:9 (torch_dynamo_resume_in_torch_dynamo_resume_in_forward_at_5_at_7)"
    assert report.shown(resumed) == "pkg/m.py:9 (forward)"
    assert report.graph_break_of(resumed) == f"{inside}:7"
    assert report.graph_break_of(f"{inside}:9 (forward)") is None


def test_score_from_a_graph_break_points_at_the_break():
    class Broken(torch.nn.Module):
        def forward(self, q, kx):
            scores = torch.einsum("bthd,bsd->bts", q, kx)
            torch._dynamo.graph_break()
            return scores.topk(3, dim=-1).indices

    line = Broken.forward.__code__.co_firstlineno + 2
    got = hyscale_compile.explain(Broken(), torch.randn(1, 4, 2, 8), torch.randn(1, 6, 8))
    (site,) = got.sites
    assert site.graph_input == "scores" and site.graph_break == f"{__file__}:{line}"
    assert f"Dynamo broke the graph at {report.shown(__file__)}:{line}" in " ".join(str(got).split())


# ---------------------------------------------------------------------------------------------
# options


def test_options_misspelled_key_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option 'rewite'.*debug_dir, rewrite, replay, compiler, mode"):
        HyscaleOptions.parse({"rewite": False})


def test_options_wrong_types_and_values():
    with pytest.raises(TypeError, match=r"options\['rewrite'\] must be True or False, got 'no'"):
        HyscaleOptions.parse({"rewrite": "no"})
    with pytest.raises(TypeError, match=r"options\['replay'\]"):
        HyscaleOptions.parse({"replay": 1})
    with pytest.raises(ValueError, match="'inductor', 'aot_eager', 'eager'"):
        HyscaleOptions.parse({"compiler": "inductr"})
    with pytest.raises(TypeError, match="Inductor option 'max_autotune' must be bool"):
        HyscaleOptions.parse({"max_autotune": "yes"})
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        HyscaleOptions.parse({"mode": "fast"})


def test_options_inductor_keys_and_mode_inside_options(tmp_path):
    opts, rest = HyscaleOptions.parse({"max-autotune": True, "debug_dir": tmp_path, "mode": "max-autotune"})
    assert rest == {"max_autotune": True} and opts.debug_dir == str(tmp_path) and opts.mode == "max-autotune"
    patches = _inductor_patches(rest, opts)
    assert patches["coordinate_descent_tuning"] is True and patches["force_disable_caches"] is True
    assert isinstance(patches["joint_custom_pre_pass"], replay.ReplayPass)
    assert isinstance(patches["post_grad_custom_pre_pass"], debug.PartitionDump)
    assert HyscaleOptions.parse({"mode": "default"})[0].mode is None
    with pytest.raises(ValueError, match="mode given twice"):
        HyscaleOptions.parse({"mode": "max-autotune"}, mode="reduce-overhead")


def test_misspelled_option_fails_the_compile_with_our_message():
    model, args = indexers.weighted_sum()
    for compiler in ("eager", "inductor"):
        with pytest.raises(Exception, match="unknown option 'rewite'"):
            torch.compile(model, backend="hyscale", options={"rewite": False, "compiler": compiler})(*args)
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# counters


def _layer(q, kx, w):
    T, S = q.shape[1], kx.shape[1]
    score = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, kx))).sum(2)
    score = score.masked_fill(torch.arange(S)[None, :] > torch.arange(T)[:, None] + (S - T), float("-inf"))
    values, _ = score.topk(4, dim=-1)
    return torch.log_softmax(values, -1).sum()


def _checkpointed(q, kx, w):
    return checkpoint(_layer, q, kx, w, use_reentrant=False)


def _training_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).requires_grad_() for s in ((1, 8, 2, 8), (1, 8, 8), (1, 8, 2))]


def _step(fn, options, grad=True) -> dict:
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="hyscale", options=options)
    with torch.set_grad_enabled(grad):
        out = compiled(*_training_inputs())
    if grad:
        out.backward()
    return {k: v for k, v in counters["hyscale"].items() if v}


@pytest.mark.parametrize("fn,grad,replayed", [(_checkpointed, True, 1), (_layer, True, 0), (_checkpointed, False, 0)],
                         ids=["checkpoint", "no-checkpoint", "no-grad"])
def test_replay_counts_only_rewritten_recomputations(fn, grad, replayed):
    got = _step(fn, {"compiler": "aot_eager"}, grad)
    assert got == {"selection_sites": 1, "selection_rewritten": 1, **({"replay_applied": 1} if replayed else {})}


def test_counters_are_the_same_on_a_cache_hit():
    if torch._inductor.config.force_disable_caches:
        pytest.skip("Inductor's caches are disabled here")
    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        first = _step(_checkpointed, {})
        second = _step(_checkpointed, {})
        assert counters["inductor"]["fxgraph_cache_hit"] > 0, "the second compile is served from the cache"
    assert first == second == {"selection_sites": 1, "selection_rewritten": 1, "replay_applied": 1}


def test_only_checkpointed_graphs_with_a_selection_skip_the_autograd_cache():
    graphs = []

    def keep(gm, example_inputs):
        hyscale_compile.backend.hyscale(gm, example_inputs, options={"compiler": "eager"})
        graphs.append(replay.counts_in_joint_graph(gm))
        return gm.forward

    def by_hand(q, kx, w):  # the operator called by hand: the Dynamo graph holds its overload packet
        layer = lambda q, kx, w: hyscale_compile.indexer_topk(q, kx, 2, weights=w, scale=1.0)[0].sum()
        return checkpoint(layer, q, kx, w, use_reentrant=False)

    for fn in (_checkpointed, _layer, by_hand):
        torch._dynamo.reset()
        torch.compile(fn, backend=keep)(*_training_inputs())
    assert graphs == [True, False, True]


# ---------------------------------------------------------------------------------------------
# debug dumps of the replay pass


def test_debug_dir_dumps_the_replay_pass_and_the_partitioned_graphs(tmp_path):
    _step(_checkpointed, {"compiler": "aot_eager", "debug_dir": str(tmp_path)})
    names = sorted(os.listdir(tmp_path))
    for suffix in ("_replay_joint_before.py", "_replay_joint_after.py", "_partition_forward.py",
                   "_partition_backward.py"):
        assert [n for n in names if n.endswith(suffix)], names
    after = (tmp_path / next(n for n in names if n.endswith("_replay_joint_after.py"))).read_text()
    assert "hyscale.rescore.default(q = " in after and "indices = " in after
    backward = (tmp_path / next(n for n in names if n.endswith("_partition_backward.py"))).read_text()
    assert "hyscale.rescore" in backward and "hyscale.select" not in backward


# ---------------------------------------------------------------------------------------------
# explain() beside compiled models


class _Broken(torch.nn.Module):
    """An indexer with a graph break before the selection (the score arrives as a graph input)."""

    def forward(self, q, k, w):
        s = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, k))).sum(2)
        torch._dynamo.graph_break()
        return s.topk(indexers.K, dim=-1).indices


@pytest.mark.parametrize("make", [indexers.weighted_sum, lambda: (_Broken(), indexers.weighted_sum()[1])],
                         ids=["one-graph", "graph-break"])
def test_explain_leaves_a_compiled_model_alone(make):
    model, args = make()
    compiled = torch.compile(model, backend="hyscale", options={"compiler": "eager"})
    compiled(*args)
    code = type(model).forward.__code__
    entries = list(_debug_get_cache_entry_list(code))
    hyscale_counts = dict(counters["hyscale"])
    first = hyscale_compile.explain(model, *args)
    again = hyscale_compile.explain(compiled, *args)
    assert [s.decision for s in first.sites] == [s.decision for s in again.sites] and first.sites
    assert dict(counters["hyscale"]) == hyscale_counts, "explain() does not count as a compile"
    frames = dict(counters["frames"])
    compiled(*args)
    assert dict(counters["frames"]) == frames, "the compiled model did not compile again"
    now = list(_debug_get_cache_entry_list(code))
    assert all(any(e is x for x in now) and e.code is not None for e in entries), "the model's entries stay"
    assert all(e.code is None for e in now if not any(e is x for x in entries)), "explain's entries are dropped"
    if make is indexers.weighted_sum:
        assert now == entries, "a one-graph model gets no entry of explain's at all"


def test_explain_of_code_without_a_file_names_no_frame_of_its_own():
    namespace: dict = {}
    exec(textwrap.dedent('''
        import torch
        def indexer(q, kx):
            score = torch.einsum("bthd,bsd->bts", q, kx)
            return score.topk(3, dim=-1).indices, torch.log_softmax(score, -1)
    '''), namespace)
    got = hyscale_compile.explain(namespace["indexer"], torch.randn(1, 4, 2, 8), torch.randn(1, 6, 8))
    assert got.sites and "hyscale_explain" not in str(got) and "hyscale_explain" not in json.dumps(got.as_dict())


# ---------------------------------------------------------------------------------------------
# command line and packaging


def test_module_runs_without_runpy_warning_and_prints_json(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["explain", "indexers:weighted_sum", "--json"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(SystemExit) as done:
            runpy.run_module("hyscale_compile.explain", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rewritten"] == 1 and out["sites"][0]["mask_kind"] == "causal"


def test_package_metadata():
    assert isinstance(hyscale_compile.__version__, str) and hyscale_compile.__version__
    assert (ROOT / "hyscale_compile" / "py.typed").exists()
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text() or "Redistribution" in (ROOT / "LICENSE").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"py.typed"' in pyproject and '"hyscale"' in pyproject
    assert (ROOT / "CHANGELOG.md").exists()


def test_log_name_module_imports_nothing():
    source = (ROOT / "hyscale.py").read_text()
    assert "import" not in textwrap.dedent(source).split('"""')[-1]
