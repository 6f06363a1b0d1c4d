"""The device benchmarks still run: each one's --smoke mode (tiny shapes, CPU interpreter, prints only).

A benchmark that breaks is found here, not in a device call that costs the project's GPU time. Every
script under benchmarks/ (the published ones and benchmarks/tuning/) is listed: a new one must be too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = ["selection.py", "training.py", "context_parallel.py", "precision.py", "sparse_attention.py", "model.py",
           "families.py", "decode_host.py", "tuning/tune_selection.py",
           "tuning/tune_descriptors.py", "tuning/tune_floor_ws.py", "tuning/tune_replay.py", "tuning/tune_rescore.py",
           "tuning/recovery.py",
           "tuning/host_overhead.py", "tuning/candidate_target.py", "tuning/tune_sparse_backward.py",
           "tuning/host_pieces.py", "tuning/ranker_rows.py", "tuning/tune_rescore_gluon.py"]
# the longest smoke runs, longest first (CPU, the interpreter: 41, 36, 25, 19, 19, 18 s)
SLOWEST = ("tuning/tune_selection.py", "tuning/tune_floor_ws.py", "tuning/tune_replay.py", "model.py", "selection.py",
           "tuning/tune_descriptors.py")
LIBRARIES = ["floor.py", "host_timers.py", "peers/__init__.py", "peers/__main__.py", "tuning/rescore_gluon.py"]  # imported by the scripts, not run


def test_every_script_is_smoke_tested():
    found = {str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("*.py")}
    listed = set(SCRIPTS + LIBRARIES)
    assert found == listed, f"listed here but missing, or there but not listed: {sorted(found ^ listed)}"


def _smoke(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke_runs(request) -> dict:
    """The selected scripts' smoke runs, started together (a process a CPU): each is mostly its own imports and
    the interpreter, one core's work, and run one after another they were minutes of the suite."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [item.callspec.params["script"] for item in request.session.items
                if item.originalname == "test_benchmark_smoke_runs" and hasattr(item, "callspec")]
    # the longest first: on CI's two cores a long one started last is the fixture's tail
    selected.sort(key=lambda s: SLOWEST.index(s) if s in SLOWEST else len(SLOWEST))
    with ThreadPoolExecutor(max(1, min(len(selected), os.cpu_count() or 1))) as pool:
        return dict(zip(selected, pool.map(_smoke, selected)))


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_runs(script, smoke_runs):
    done = smoke_runs[script] if script in smoke_runs else _smoke(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a smoke run prints its rows"
