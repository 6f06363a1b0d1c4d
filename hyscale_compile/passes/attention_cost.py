"""Whether ``hyscale.sparse_attention`` pays at a site: an estimate of the op against the model's dense attention.

The rewrite is legal at every site the pass proves, but not always faster. Dense attention reads each key
tile once for a block of queries; the sparse op gathers each query's k picks, with no reuse between queries.
So the op costs about T * k per-pick units and the dense attention T * S units, and what a unit costs depends
on the layout:

* per-head keys and values (MHA, GQA, MLA not absorbed): every pick gathers G kv heads of Dqk + Dv values,
  and the backward writes and re-reads an fp32 contribution of that width per pick (the deterministic
  reduction of dk and dv). Bandwidth-bound: the op pays only when S is many times k.
* the MLA latent layout: one gathered row of 576 values serves all H heads, and the backward writes one
  contribution of 576 fp32 values a pick for all of them (the latent op folds dv into dk). Compute-bound, like
  dense attention, but on k keys instead of S.

The rates are fitted to ``benchmarks/sparse_attention.py`` on the H200 (the GQA and per-head layouts and the
dense baselines: results/sparse_attention.json, T = S = 8192, k = 2048, bf16) and, for the latent op, to the
sparse kernels of the DeepSeek-V3.2 layer step (results/model.json's profiled kernels at T = 65536: forward,
contribution and dq of fa7ec5a, the segment kernel of a8150ef; the 8K latent row and the 32K step predate them);
the decisions they give are
checked against the layer's measured steps (tests/test_attention_cost.py). They are first-order and will move
with the kernels, which is why the decision is an estimate with a margin and ``options["attention"] = "always"``
overrides it. A training graph (any of q, k, v needs a gradient) counts forward and backward; an inference graph
the forward only. Sizes that are symbolic are read at the sizes the graph was traced with.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# Per-pick rates of the Triton op (milliseconds), fitted as above.
GATHER_BYTES_PER_MS = 6.0e9  # forward: gathered kv bytes
SPARSE_FWD_FLOPS_PER_MS = 1.85e11  # forward: 2 * H * (Dqk + Dv) a pick
SPARSE_FWD_FLOPS_PER_MS_LATENT = 2.17e11  # the latent op's forward (its 16-bit wide tiles take 64 picks a block)
BWD_MS_PER_PICK = 2.05e-6  # backward: fixed cost of a pick (the sort by key, the segment pass)
BWD_MS_PER_CONTRIB = 5.41e-9  # backward: a pick's fp32 contribution values, written and read back
BWD_MS_PER_FLOP = 3.8e-11  # backward: the recomputed products
# The latent op's backward: the contribution and dq kernels (stored ds, one contribution for all heads) per flop,
# and per value of a pick's contribution the segment pass that reads it back, with the sort, delta and copies.
BWD_MS_PER_FLOP_LATENT = 1.32e-11
BWD_LATENT_MS_PER_CONTRIB = 1.62e-9
HEAD_BLOCK = 64  # query heads of one kv group a backward program handles (contribution rows per pick)
# Dense attention as the model runs it (SDPA's kernels over all S keys: a boolean or additive mask skips none).
DENSE_FWD_FLOPS_PER_MS = 3.3e11
DENSE_TRAIN_FLOPS_PER_MS = 2.7e11  # forward + backward
DENSE_TRAIN_PRODUCTS = 3.5  # the backward's five products against the forward's two
# The eager chain writes and reads its [B, H, T, S] logits and probabilities too.
EAGER_PASSES_FWD, EAGER_PASSES_TRAIN = 4, 10
HBM_BYTES_PER_MS = 3.0e9
# Rewrite only where the estimate is this much faster: the fit is rough, and equal is not worth a new kernel.
MARGIN = 1.25


@dataclass(frozen=True)
class Shape:
    """One attention as the op would run it and as the model runs it."""

    B: int
    T: int
    S: int
    H: int  # query heads
    k: int  # picks per query
    itemsize: int
    training: bool
    eager: bool  # the model's attention is the eager matmul-softmax-matmul chain (else SDPA)
    # the op's layout: G kv groups of Dqk + Dv; aliased: the latent MLA op (values are the keys' first features)
    G: int
    Dqk: int
    Dv: int
    aliased: bool
    # the model's dense attention: per-head dims (the expanded ones where the op runs the latent layout)
    dense_Dqk: int
    dense_Dv: int


def sparse_ms(s: Shape) -> float:
    picks = s.B * s.T * min(s.k, s.S)
    gathered = s.G * (s.Dqk + (0 if s.aliased else s.Dv)) * s.itemsize
    flops = 2 * s.H * (s.Dqk + s.Dv)
    rate = SPARSE_FWD_FLOPS_PER_MS_LATENT if s.aliased else SPARSE_FWD_FLOPS_PER_MS
    fwd = picks * max(gathered / GATHER_BYTES_PER_MS, flops / rate)
    if not s.training:
        return fwd
    if s.aliased:  # the latent op: one Dqk-wide contribution a pick and kv group, fitted with its kernels
        return fwd + picks * (s.G * s.Dqk * BWD_LATENT_MS_PER_CONTRIB + flops * BWD_MS_PER_FLOP_LATENT)
    # the row kernel: Dqk + Dv a pick, kv group and block of heads
    contrib = math.ceil(s.H / s.G / HEAD_BLOCK) * s.G * (s.Dqk + s.Dv)
    return fwd + picks * (BWD_MS_PER_PICK + contrib * BWD_MS_PER_CONTRIB + flops * BWD_MS_PER_FLOP)


def dense_ms(s: Shape) -> float:
    pairs = s.B * s.H * s.T * s.S
    flops = 2 * pairs * (s.dense_Dqk + s.dense_Dv)
    ms = flops * DENSE_TRAIN_PRODUCTS / DENSE_TRAIN_FLOPS_PER_MS if s.training else flops / DENSE_FWD_FLOPS_PER_MS
    if s.eager:
        ms += pairs * s.itemsize * (EAGER_PASSES_TRAIN if s.training else EAGER_PASSES_FWD) / HBM_BYTES_PER_MS
    return ms


def pays(s: Shape) -> tuple[bool, str]:
    """(whether the op is estimated faster than the model's attention by MARGIN, the estimate in words)."""
    sp, de = sparse_ms(s), dense_ms(s)
    what = "a training step" if s.training else "a forward"
    words = (f"estimated {_ms(sp)} for the sparse op against {_ms(de)} for the model's dense attention over "
             f"S={s.S} keys ({what}, B={s.B}, T={s.T}, H={s.H}, k={s.k})")
    return sp * MARGIN <= de, words


def _ms(x: float) -> str:
    return f"{x:.3g} ms"


def always() -> bool:
    """``HYSCALE_ATTENTION=always`` makes "always" the default of ``options["attention"]`` (test suites that
    check the rewrite on tiny models, where it never pays)."""
    return os.environ.get("HYSCALE_ATTENTION", "").strip().lower() == "always"


def size_hint(x) -> int | None:
    """An int for a size, symbolic ones at the size they were traced with (no guard is added)."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else None
    return None
