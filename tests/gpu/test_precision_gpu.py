"""Gradient precision on CUDA: where the model scores in fp32 (16-bit inputs upcast), hyscale's gradients are
as close to a float64 evaluation as Inductor's (the issue's bar: at most 2x); where it scores in bf16, as close
as the model's own 16-bit arithmetic allows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("scoring", ["fp32_scoring", "bf16_scoring"])
def test_gradient_error_at_most_twice_inductors(scoring):
    import precision

    shape = (512, 4096, 16)
    hys = precision.rel_errors("hyscale", shape, 128, 256, "cuda", scoring == "fp32_scoring")
    torch._dynamo.reset()
    ind = precision.rel_errors("inductor", shape, 128, 256, "cuda", scoring == "fp32_scoring")
    for name, h, i in zip(("dq", "dkx", "dw"), hys, ind):
        assert h <= 2 * i + 1e-6, f"{scoring} {name}: hyscale {h:.2e} vs inductor {i:.2e}"
