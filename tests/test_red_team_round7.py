"""Review round 7: the two changes of the round before it. Index masks built with arithmetic and comparisons
(``attention_masks._arithmetic``: ``(1.0 - keep.float()) * finfo.min``, ``keep == 0``, ``keep.float() < 0.5``, ``-x``,
products), tried with 16-bit and integer masks, 0-d tensor constants, NaN / inf fills, -0.0, a learned scalar, a
non-constant factor, autocast; and the absorbed MLA op ``hyscale.sparse_attention_mla`` the latent rewrite emits,
tried with padding, per-batch query offsets, fp32 / bf16, checkpointing, dynamic=True, a latent shared by the
batch, a frozen projection or detached latent, q read elsewhere too, every subset of gradients, the eager and the
inductor compiler, and blocks of one query row (``absorbed.ROWS_BYTES``).

Each "Found in review" test reproduces a bug found then (the model code, what differed), now fixed; the others pin
spellings that were already right. Every test compares the compiled model's outputs and gradients with eager's and
checks the decision the pass made. Tiny sizes: seconds each on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled
from test_red_team_round6 import MIN, D, _attention, _causal, _eager, _hidden, _inputs, _pad, _picks, _sdpa
from torch import nn

HMIN = torch.finfo(torch.float16).min
BMIN = torch.finfo(torch.bfloat16).min


def _keep(s):  # True at the visible keys a query picked
    return _causal() & ~_hidden(_picks(s))


def _added(mask):
    return _eager(lambda x, s: x + mask(s))


def _filled(hidden):
    return _eager(lambda x, s: x.masked_fill(hidden(s), MIN))


# ---------------------------------------------------------------------------------------------
# 1. mask arithmetic


# Found in review, fixed (wrong values): the evaluator holds every mask value as a 0-d tensor, and torch promotes
# two 0-d tensors by full type promotion but a 0-d tensor against a tensor with dims by category only. So
# ``keep.half() <= torch.tensor(0.9999)`` compares in float16 in the model, where 0.9999 is 1.0 and the comparison is
# True at every key (every key hidden: each row is the mean of v), while the evaluator compared in float32, found
# exactly the unpicked keys hidden and rewrote the site: all 160 outputs off (up to 1.7), the SDPA spelling
# (``~(...)`` as a boolean mask) likewise. Operands the model has with dims are now computed with one dim
# (attention_masks._arithmetic), so the comparison runs the model's kernel on the model's kinds of operands.
@pytest.mark.parametrize("attn,decision", [
    (_filled(lambda s: _keep(s).half() <= torch.tensor(0.9999)), "rejected"),
    (_sdpa(lambda s: ~(_keep(s).half() <= torch.tensor(0.9999))), "rejected"),
    (_filled(lambda s: _keep(s).to(torch.bfloat16) <= torch.tensor(0.999)), "rejected"),
    # the other way round: float16's 1.0001 is 1.0, so this is exactly the unpicked keys (it was rejected)
    (_filled(lambda s: _keep(s).half() < torch.tensor(1.0001, dtype=torch.float64)), "rewritten"),
], ids=["fp16_le", "fp16_le_sdpa", "bf16_le", "fp16_lt_f64"])
def test_comparison_with_a_0d_tensor_constant_promotes_as_the_model(attn, decision):
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
    assert [s.decision for s in sites] == [decision], [s.reason for s in sites]
    assert decision == "rewritten" or "polarity" in sites[0].reason, sites[0].reason


class _LearnedFill(nn.Module):
    def __init__(self):
        super().__init__()
        self.fill = nn.Parameter(torch.tensor(MIN))

    def forward(self, q, k, v, s):
        w = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + (1.0 - _keep(s).float()) * self.fill, -1)
        return w @ v


def _autocast(sdpa: bool):
    def attn(q, k, v, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m = (1.0 - _keep(s).float()) * MIN
            if sdpa:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            return torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + m, -1) @ v

    return attn


# (model, the decision, a phrase of the reason): spellings tried in review that were already right
SPELLINGS = {
    # the same comparisons where the constant does not round onto a mask value: exact, rewritten
    "bf16_lt_0d_tensor": (_filled(lambda s: _keep(s).to(torch.bfloat16) < torch.tensor(0.999)), "rewritten", ""),
    "fp16_ge_0d_fp16_sdpa": (_sdpa(lambda s: _keep(s).half() >= torch.tensor(0.5, dtype=torch.float16)),
                             "rewritten", ""),
    "int_mask": (_added(lambda s: (1 - _keep(s).int()) * MIN), "rewritten", ""),
    "int_eq_zero": (_filled(lambda s: _keep(s).int() == 0), "rewritten", ""),
    "times_0d_tensor_min": (_added(lambda s: (1.0 - _keep(s).float()) * torch.tensor(MIN)), "rewritten", ""),
    "times_0d_f64_min": (_added(lambda s: (1.0 - _keep(s).float()) * torch.tensor(MIN, dtype=torch.float64)),
                         "rewritten", ""),
    "negative_zero_at_kept": (_added(lambda s: -torch.where(_keep(s), 0.0, -MIN)), "rewritten", ""),
    "nan_compared": (_filled(lambda s: (1.0 - _keep(s).float()) * float("inf") > 0), "rewritten", ""),
    "product_with_padding": (_added(lambda s: (1.0 - _keep(s).float() * _pad(s).float()) * MIN), "rewritten", ""),
    "negated_compared": (_filled(lambda s: -_keep(s).float() >= 0), "rewritten", ""),
    # 0 * -inf = NaN at the kept keys
    "times_minus_inf": (_added(lambda s: (1.0 - _keep(s).float()) * float("-inf")), "rejected", "nan"),
    # finfo.min * 2 and float32's min rounded to bf16 / fp16 overflow to -inf: an empty row is NaN in eager
    "min_times_two": (_added(lambda s: (1.0 - _keep(s).float()) * MIN * 2), "rejected", "gives NaN"),
    "bf16_mask_f32_min": (_added(lambda s: (1.0 - _keep(s).to(torch.bfloat16)) * MIN), "rejected", "gives NaN"),
    "fp16_mask_f32_min": (_added(lambda s: (1.0 - _keep(s).half()) * MIN), "rejected", "gives NaN"),
    # another dtype's min, added to float32 scores: a finite fill of its own (conservative)
    "bf16_mask_bf16_min": (_added(lambda s: (1.0 - _keep(s).to(torch.bfloat16)) * BMIN), "rejected",
                           "does not hide them exactly"),
    "fp16_mask_fp16_min": (_added(lambda s: (1.0 - _keep(s).half()) * HMIN), "rejected", "does not hide them exactly"),
    "int64_min": (_added(lambda s: (1 - _keep(s).long()) * torch.iinfo(torch.int64).min), "rejected",
                  "does not hide them exactly"),
    "learned_fill": (_LearnedFill(), "rejected", "self._parameters.fill"),
    "times_a_tensor_input": (_eager(lambda x, s: x + (1.0 - _keep(s).float()) * (s[:, None] * 0 + MIN)), "rejected",
                             "graph input `score`"),
    "autocast_eager": (_autocast(False), "rewritten", ""),
    "autocast_sdpa": (_autocast(True), "rewritten", ""),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_arithmetic_spellings(name):
    attn, decision, phrase = SPELLINGS[name]
    tol = dict(rtol=2e-2, atol=2e-2) if name.startswith("autocast") else {}
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2), **tol))
    assert [s.decision for s in sites] == [decision], [s.reason for s in sites]
    assert phrase in sites[0].reason, sites[0].reason


def test_scores_scaled_by_the_keep_mask_are_no_mask():
    """``scores * keep + (1 - keep) * min``: equal at kept keys, but the scores are an operand of the product."""
    attn = _eager(lambda x, s: x * _keep(s).float() + (1.0 - _keep(s).float()) * MIN)
    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
    assert sites and all(s.decision == "rejected" for s in sites)
    assert any("scales the scores themselves" in s.reason for s in sites), [s.reason for s in sites]
