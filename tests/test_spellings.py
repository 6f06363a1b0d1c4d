"""Every indexer spelling found in the wild (tests/models/spellings.py): rewritten and equal to eager, or
left alone with its reason.

Eager runs with ``torch.topk`` breaking ties by lowest position (the operator's documented order) so that
compiled and eager can be compared exactly, padded rows and ReLU-zero ties included.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from models import spellings
from torch._dynamo.utils import counters

import hyscale_compile
from hyscale_compile.runtime.reference import order_key

_topk = torch.topk


def _topk_ties_by_position(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    if not largest:
        return _topk(input, k, dim, largest, sorted)
    idx = torch.sort(order_key(input.movedim(dim, -1)), dim=-1, descending=True, stable=True).indices[..., :k]
    idx = idx.movedim(-1, dim)
    return torch.return_types.topk((input.gather(dim, idx), idx))


@contextlib.contextmanager
def ties_by_position():
    old_fn, old_method = torch.topk, torch.Tensor.topk
    torch.topk = torch.Tensor.topk = _topk_ties_by_position
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = old_fn, old_method


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _flat(item)]


@pytest.mark.parametrize("name", sorted(spellings.SPELLINGS))
def test_spelling(name):
    module, inputs, expected = spellings.SPELLINGS[name](0)
    report = hyscale_compile.explain(module, *inputs)
    sites = getattr(module, "SITES", 1)
    decisions = [s.decision for s in report.sites]
    if expected == "rewrite":
        assert decisions.count("rewritten") == sites, str(report)
    else:
        assert "rewritten" not in decisions and report.sites, str(report)
        assert all(s.reason for s in report.sites)
    counters.clear()
    if expected == "reject":  # left alone: the model must still run, and equal eager's own top-k exactly
        out = _flat(torch.compile(module, backend="hyscale", options={"compiler": "eager"})(*inputs))
        ref = _flat(module(*inputs))
    else:
        out = _flat(torch.compile(module, backend="hyscale")(*inputs))
        with ties_by_position():
            ref = _flat(module(*inputs))
    for o, r in zip(out, ref, strict=True):
        if o.is_floating_point():
            torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)
        else:
            assert torch.equal(o, r)


def test_window_and_causal_kinds_are_used():
    kinds = {}
    for name in ("deepgemm_ragged_windows", "megatron_thd_minus_one", "deepseek_v4_compressed_keys",
                 "megatron_chunk_inplace", "no_head_weights"):
        module, inputs, _ = spellings.SPELLINGS[name](0)
        kinds[name] = hyscale_compile.explain(module, *inputs).sites[0].mask_kind
    assert kinds == {"deepgemm_ragged_windows": "window", "megatron_thd_minus_one": "window",
                     "deepseek_v4_compressed_keys": "window", "megatron_chunk_inplace": "causal",
                     "no_head_weights": "causal"}


def test_rejections_say_why():
    reasons = {}
    for name in ("nsa_block_selection", "dense_warmup_kl", "minimax_m3_block_max"):
        module, inputs, _ = spellings.SPELLINGS[name](0)
        reasons[name] = hyscale_compile.explain(module, *inputs).sites[0].reason
    assert "score table is read by log_softmax" in reasons["dense_warmup_kl"]
    assert "not part of the indexer form" in reasons["nsa_block_selection"]
    assert "amax" in reasons["minimax_m3_block_max"]
