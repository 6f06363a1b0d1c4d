"""The Triton kernels compile for an sm_90 GPU (ptxas included) and fit its shared memory, checked on a machine
without one (tests/kernels/compile_for_gpu.py: a stand-in driver, nothing launched). The interpreter runs of
the rest of the suite execute the kernels' logic but never compile them: inline PTX, 16-bit tensor-core
dots, tf32x3 and register-heavy tiles are only exercised here. CI runs the paths a training step takes
(selection forward, sparse backward in each precision, sparse attention forward and backward); the script
with no argument compiles every variant the entry points launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent / "kernels" / "compile_for_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels themselves (tests/gpu)")
def test_training_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "backward", "attention"], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "kernel variants for sm_90" in done.stdout
    for name in ("filter_kernel", "tie_fill_kernel", "final_select_kernel", "table_kernel", "rank_kernel",
                 "split_pass_kernel", "split_finish_kernel", "_row_kernel", "_contrib_kernel", "_segment_kernel",
                 "_fwd_kernel"):
        assert name in done.stdout, done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels themselves (tests/gpu)")
def test_rescore_shuffles_hold_for_sm90():
    """The sm_90 build of the rescore lays its MMA result out as the quad transpose's warp shuffles assume
    (``quad_transpose.layout_holds`` on the compiled IR), at 64 and at 32 heads a MMA: the GPU then takes the
    shuffles, not the fallback through shared memory. A Triton whose layout differs fails here first."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "rescore"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    for H in (64, 32):
        assert f"rescore shuffles hold at H={H}: [True]" in done.stdout, done.stdout
