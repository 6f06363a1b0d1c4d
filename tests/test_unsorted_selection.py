"""Sites whose indices are only scattered as a constant (DSA's index mask) select without the final sort:
the pass proves nothing downstream sees the order; other readers keep the sorted selection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import captured, ties_by_position
from torch import nn
from torch._dynamo.utils import counters

import hyscale_compile  # noqa: F401  (registers backend="hyscale" in a source checkout)

T, S, H, D, K = 6, 12, 3, 8, 5


def _score(q, k, w):
    s = F.relu(torch.einsum("bthd,bsd->bths", q, k))
    return torch.einsum("bths,bth->bts", s, w)


class IndexMask(nn.Module):
    """DSA's reference: ``full(-inf).scatter_(-1, topk_indices, 0)`` added to the attention scores."""

    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1)[1]
        mask = torch.full(logits.shape, float("-inf")).scatter_(-1, idx, 0)
        return (logits + mask).softmax(-1)


class BoolMaskThroughCasts(nn.Module):
    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1).indices.to(torch.int32)
        keep = torch.zeros(logits.shape, dtype=torch.bool).scatter(-1, idx.long(), True)
        return logits.masked_fill(~keep, 0.0)


class ValuesRead(IndexMask):
    def forward(self, q, k, w, logits):
        vals, idx = _score(q, k, w).topk(K, dim=-1)
        mask = torch.full(logits.shape, float("-inf")).scatter_(-1, idx, 0)
        return logits + mask, vals


class IndicesReturned(IndexMask):
    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1)[1]
        return torch.full(logits.shape, float("-inf")).scatter_(-1, idx, 0), idx


class TensorSource(IndexMask):
    """scatter pairs each index with an element of src: the order matters."""

    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1)[1]
        src = torch.arange(K, dtype=logits.dtype).expand(idx.shape)
        return torch.zeros_like(logits).scatter(-1, idx, src)


class OtherDim(IndexMask):
    """Scattering along another dim moves each index by its position along the selected one."""

    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1)[1]
        return torch.zeros(1, S, S).scatter_(1, idx, 1.0)


class ScatterAdd(IndexMask):
    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1)[1]
        return torch.zeros_like(logits).scatter_add(-1, idx, torch.ones(idx.shape))


class ModelUnsortedValuesRead(IndexMask):
    """The model's own sorted=False: the op's unsorted order is not reproducible, so this site is sorted."""

    def forward(self, q, k, w, logits):
        vals, idx = _score(q, k, w).topk(K, dim=-1, sorted=False)
        return logits.gather(-1, idx) * vals


class ModelUnsortedIndexMask(IndexMask):
    def forward(self, q, k, w, logits):
        idx = _score(q, k, w).topk(K, dim=-1, sorted=False)[1]
        return logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter(-1, idx, True), 0.0)


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, T, H, D, generator=g), torch.randn(1, S, D, generator=g)
    w, logits = torch.randn(1, T, H, generator=g), torch.randn(1, T, S, generator=g)
    return q, k, w, logits


def _select_sorted_flags(model) -> list[bool]:
    _, after, reports = captured(model, *_inputs())
    assert [r.decision for r in reports] == ["rewritten"], [r.reason for r in reports]
    return [n.kwargs["sorted"] for gm in after for n in gm.graph.nodes if n.target is torch.ops.hyscale.select.default]


@pytest.mark.parametrize("model", [IndexMask(), BoolMaskThroughCasts(), ModelUnsortedIndexMask()],
                         ids=lambda m: type(m).__name__)
def test_constant_scatter_selects_unsorted_and_matches_eager(model):
    assert _select_sorted_flags(model) == [False]
    counters.clear()
    args = _inputs()
    out = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args)  # the pass alone
    assert counters["hyscale"]["selection_unsorted"] == 1
    with ties_by_position():  # relu makes exact ties (zeros); the op breaks them by position
        ref = model(*args)
    assert torch.equal(out, ref)  # the same tensor whatever the order of the indices


@pytest.mark.parametrize("model", [ValuesRead(), IndicesReturned(), TensorSource(), OtherDim(), ScatterAdd(),
                                   ModelUnsortedValuesRead()], ids=lambda m: type(m).__name__)
def test_order_visible_keeps_the_sort(model):
    assert _select_sorted_flags(model) == [True]


def test_report_says_the_sort_was_skipped():
    report = hyscale_compile.explain(IndexMask(), *_inputs())
    assert "selected without the final sort" in report.rewritten[0].reason
