"""Read the producer subgraph of a top-k input as one index expression (the indexer form).

Every dimension of every tensor on the path gets a *label*; contractions, sums and views move labels
around instead of positions, so ``einsum("bshd,btd->bsht")``, ``matmul(q, k.T.unsqueeze(1))`` and
``(w[..., None] * relu(s)).sum(2)`` all reduce to the same ``Score``:

    score[B, T, S] = scale * sum_H  prod(weights)[B, T, H] * act(prod(pre)[B, T, H] * q[B, T, H, D] . k[B, S, D])
                     + bias, masked to fill

The walk is top-down, from the top-k input, because only there is it known which dimension holds
the keys (S); at a contraction, the operand holding S is the key side of the dot, or the score
itself when the other operand has no free dimension (a head-weighted sum). Anything outside this
vocabulary raises ``Reject`` with a reason a user can act on.

The data and the dispatch are ``expr``; the handlers ``expr_contract`` (dots and head sums), ``expr_terms``
(scales, factors, additive terms, fills, the activation, casts) and ``expr_views`` (views and identities).
"""

from __future__ import annotations

# The handlers register themselves in expr.HANDLERS when imported: importing this module makes interpret whole.
from . import expr_contract, expr_terms, expr_views  # noqa: F401
from .expr import Label, Leaf, Reject, Score, dim_size, interpret, positive_scale

__all__ = ["Label", "Leaf", "Reject", "Score", "dim_size", "interpret", "positive_scale"]
