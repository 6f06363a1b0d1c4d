"""Unmodified models compiled with backend="hyscale" on CUDA: the rewritten sites run the HyTopK kernels
and match eager (which breaks ties by position here, as the operator does); training through a
checkpointed indexer gives eager's gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import flat, ties_by_position
from models import spellings
from torch._dynamo.utils import counters

import hyscale_compile  # noqa: F401  (registers backend="hyscale" in a source checkout)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NAMES = ["megatron_sequence_first", "deepgemm_ragged_windows", "no_head_weights", "finfo_min_fill",
         "deepseek_v4_compressed_keys", "sort_instead_of_topk", "several_sites", "scale_on_query_per_position"]


def _cuda(x):
    return x.cuda() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("name", NAMES)
def test_compiled_spelling_on_cuda(name):
    module, inputs, _ = spellings.SPELLINGS[name](0)
    module, inputs = module.cuda(), tuple(_cuda(x) for x in inputs)
    out = flat(torch.compile(module, backend="hyscale")(*inputs))
    assert counters["hyscale"]["selection_rewritten"] == getattr(module, "SITES", 1)
    with ties_by_position():
        ref = flat(module(*inputs))
    for o, r in zip(out, ref, strict=True):
        assert o.device.type == "cuda"
        if o.is_floating_point():
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4, equal_nan=True)
        else:
            assert torch.equal(o, r)


def test_checkpointed_training_step_on_cuda():
    from torch.utils.checkpoint import checkpoint

    def layer(q, kx, w):
        T, S = q.shape[1], kx.shape[1]
        score = (w[..., None] * torch.relu(torch.einsum("bthd,bsd->bths", q, kx))).sum(2)
        future = torch.arange(S, device=q.device)[None, :] > torch.arange(T, device=q.device)[:, None] + (S - T)
        score = score.masked_fill(future, float("-inf"))
        values, _ = score.topk(64, dim=-1)
        return torch.log_softmax(values, -1).sum()

    def step(q, kx, w):
        return checkpoint(layer, q, kx, w, use_reentrant=False)

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 256, 8, 64, device="cuda", generator=g).requires_grad_()
    kx = torch.randn(1, 1024, 64, device="cuda", generator=g).requires_grad_()
    w = torch.randn(1, 256, 8, device="cuda", generator=g).requires_grad_()
    grads = torch.autograd.grad(torch.compile(step, backend="hyscale")(q, kx, w), (q, kx, w))
    assert counters["hyscale"]["selection_rewritten"] == 1 and counters["hyscale"]["replay_applied"] == 1
    want = torch.autograd.grad(step(q, kx, w), (q, kx, w))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
