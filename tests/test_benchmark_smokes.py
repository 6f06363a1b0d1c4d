"""The device benchmarks still run: each one's --smoke mode (tiny shapes, CPU interpreter, prints only).

A benchmark that breaks is found here, not in a device call that costs the project's GPU time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", ["training.py", "tune_replay.py", "recovery.py", "tune_floor_ws.py",
                                    "tune_descriptors.py", "precision.py", "sparse_attention.py", "model.py"])
def test_benchmark_smoke_runs(script):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a smoke run prints its rows"
