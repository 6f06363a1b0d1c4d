"""Precision follows the model: which MMA path the sparse backward takes, and the bf16 split it relies on.

The kernels' own precision is measured on the GPU (tests/gpu/test_precision_gpu.py, benchmarks/precision.py);
here: the path chosen for each operand dtype and model, that the pass asks for 16-bit gradients only where the
model scores in 16-bit, and that splitting an fp32 value into three bf16 terms is exact.
"""

from __future__ import annotations

import torch
from helpers import captured

from hyscale_compile.runtime import sparse_backward as sb


def test_grad_path_per_operand_dtype():
    bf, hf, f = (torch.empty(1, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert sb.grad_path(bf, bf, low_precision=False) == sb.GRAD_SPLIT3
    assert sb.grad_path(bf, bf, low_precision=True) == sb.GRAD_LOW
    assert sb.grad_path(hf, hf, low_precision=False) == sb.GRAD_FP32  # fp16 cannot hold the split's range
    assert sb.grad_path(hf, hf, low_precision=True) == sb.GRAD_LOW
    assert sb.grad_path(f, f, low_precision=True) == sb.GRAD_FP32
    assert sb.grad_path(bf, f, low_precision=True) == sb.GRAD_FP32


def test_three_bf16_terms_hold_an_fp32_value_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp(torch.randn(100_000, generator=g) * 10)
    hi = x.bfloat16()
    rest = x - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    assert torch.equal(hi.float() + mid.float() + lo.float(), x)


def _indexer(upcast: bool):
    def model(q, kx, w):
        if upcast:
            q, kx = q.float(), kx.float()
        s = (torch.relu(torch.einsum("bthd,bsd->bths", q, kx)) * w[..., None]).sum(2)
        return s.topk(4)

    return model


def test_the_pass_asks_for_16bit_gradients_only_where_the_model_scores_in_16bit():
    q, kx, w = torch.randn(1, 5, 2, 8).bfloat16(), torch.randn(1, 9, 8).bfloat16(), torch.randn(1, 5, 2)
    flags = {}
    for upcast in (True, False):
        _, after, _ = captured(_indexer(upcast), q, kx, w.bfloat16() if not upcast else w)
        (select,) = [n for gm in after for n in gm.graph.nodes if n.target is torch.ops.hyscale.select.default]
        flags[upcast] = select.kwargs["low_precision_grad"]
    assert flags == {True: False, False: True}
