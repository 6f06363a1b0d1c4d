"""Index masks built with arithmetic and comparisons: ``(1.0 - keep.float()) * finfo.min`` (the additive mask HF's
older ``get_extended_attention_mask`` spells), ``keep == 0``, ``keep.float() < 0.5``, ``-x``. The pass evaluates
them exactly as the model computes them (attention_masks._arithmetic), so what hides a key exactly is rewritten and
what does not (a polarity slip, a finite fill, the scores scaled inside the mask) is told apart. Before, these
spellings were no site at all: the attention stayed dense with no reason in the report.

Every case compares the compiled model's outputs and gradients with eager's (check_compiled); the random sweep
does so for every expression, whatever the pass decides."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled
from test_red_team_round6 import MIN, _attention, _causal, _eager, _hidden, _inputs, _pad, _picks, _sdpa


def _keep(s):  # True at the visible keys a query picked
    return _causal() & ~_hidden(_picks(s))


EXACT = {  # additive masks (added to the scores), each 0 where kept and finfo.min elsewhere
    "one_minus_float_times_min": lambda s: (1.0 - _keep(s).float()) * MIN,
    "one_minus_to_times_min": lambda s: (1.0 - _keep(s).to(torch.float32)) * MIN,
    "float_minus_one_times_max": lambda s: (_keep(s).float() - 1.0) * -MIN,
    "negated": lambda s: -((1.0 - _keep(s).float()) * -MIN),
    "where_on_comparison": lambda s: torch.where(_keep(s) == 0, MIN, 0.0),
    "where_on_float_comparison": lambda s: torch.where(_keep(s).float() < 0.5, MIN, 0.0),
    "ne_true": lambda s: torch.zeros(()).masked_fill(_keep(s) != True, MIN),  # noqa: E712
}

NOT_EXACT = {  # these let a hidden key through or hide a kept one: eager's values, whatever the decision
    "bert_fill": lambda s: (1.0 - _keep(s).float()) * -1e4,
    "polarity_slip": lambda s: _keep(s).float() * MIN,
    "wrong_sign": lambda s: (_keep(s).float() - 1.0) * MIN,
    "threshold_never_true": lambda s: torch.where(_keep(s).float() > 1.5, 0.0, MIN),
}


def _added(mask):
    return lambda x, s: x + mask(s)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_arithmetic_masks_are_rewritten(name):
    """Eager attention in training; SDPA for inference (an added fill where a row may have no visible pick is left
    alone in training under SDPA: its fused kernels' gradient for such rows is their own, test_red_team_round6)."""
    for attn, grad in ((_eager(_added(EXACT[name])), (0, 1, 2)), (_sdpa(EXACT[name]), ())):
        sites = _attention(check_compiled(attn, _inputs(), grad=grad))
        assert [s.decision for s in sites] == ["rewritten"], [s.reason for s in sites]


@pytest.mark.parametrize("name", sorted(NOT_EXACT))
def test_masks_that_are_not_exact_keep_eager_values(name):
    for attn in (_eager(_added(NOT_EXACT[name])), _sdpa(NOT_EXACT[name])):
        sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
        assert [s.decision for s in sites] == ["rejected"], [s.reason for s in sites]
        assert sites[0].reason


def test_boolean_mask_from_a_comparison():
    """SDPA's boolean mask built by comparing a float encoding: the same as the boolean mask."""
    sites = _attention(check_compiled(_sdpa(lambda s: (_keep(s).float() * _pad(s).float()) > 0.5), _inputs(),
                                      grad=(0, 1, 2)))
    assert [s.decision for s in sites] == ["rewritten"], [s.reason for s in sites]


def test_scores_scaled_inside_the_mask_arithmetic_are_no_mask():
    def attn(q, k, v, s):
        x = q @ k.transpose(-1, -2)
        w = torch.softmax((x + (1.0 - _keep(s).float()) * MIN) * 0.125, -1)
        return w @ v

    sites = _attention(check_compiled(attn, _inputs(), grad=(0, 1, 2)))
    assert all(site.decision != "rewritten" for site in sites)


def test_bf16_additive_mask_in_its_own_dtype():
    bmin = torch.finfo(torch.bfloat16).min

    def attn(q, k, v, s):
        m = (1.0 - _keep(s).to(torch.bfloat16)) * bmin
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    sites = _attention(check_compiled(attn, _inputs(dt=torch.bfloat16), rtol=2e-2, atol=2e-2))
    assert [s.decision for s in sites] == ["rewritten"], [s.reason for s in sites]


# random encodings: the keep mask as a float v, then one to three of: c - v, v - c, v * c, -v, comparisons with c
_CONSTANTS = ["0.0", "1.0", "0.5", "-1.0", "2.0", "MIN", "-MIN"]


def _random_encoding(rng) -> str:
    e = "K.float()"
    for _ in range(rng.randint(1, 3)):
        c = rng.choice(_CONSTANTS)
        e = rng.choice([f"({c} - {e})", f"({e} - {c})", f"({e} * {c})", f"(-{e})"])
    if rng.random() < 0.4:
        op = rng.choice(["==", "!=", "<", ">", "<=", ">="])
        return f"torch.where({e} {op} {rng.choice(_CONSTANTS)}, 0.0, MIN)"
    return e


def _random_encodings(n: int, seed: int) -> list[str]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        e = _random_encoding(rng)
        if e not in out:
            out.append(e)
    return out


# every affine encoding and every comparison with a few constants: some hide exactly (rewritten), most do not
_AFFINE = [f"(({a} - K.float()) * {b})" for a in ("0.0", "1.0", "2.0") for b in ("MIN", "-MIN", "-1e4")] + \
          [f"((K.float() - {a}) * {b})" for a in ("0.0", "1.0", "2.0") for b in ("MIN", "-MIN", "-1e4")]
_COMPARED = [f"torch.where(K.float() {op} {c}, 0.0, MIN)" for op in ("==", "!=", "<", ">", "<=", ">=")
             for c in ("0.0", "0.5", "1.0")]


@pytest.mark.parametrize("expr", _AFFINE + _COMPARED + _random_encodings(6, seed=3))
def test_arithmetic_encodings_equal_eager(expr):
    enc = eval("lambda K, MIN: " + expr)  # noqa: S307  (the grammar above)
    check_compiled(_eager(_added(lambda s: enc(_keep(s), MIN))), _inputs(), grad=(0, 1, 2))
