"""Review round 15: the attention pass following the indices across checkpointed regions (``passes/regions.py``,
commit 4cc0398).

Found and fixed (graph_ops.mutates / written_by): a call of a higher-order op (``tag_activation_checkpoint``,
``wrap``, ``invoke_subgraph`` ...) whose body writes one of its inputs in place was not a write. Dynamo keeps such
a write inside the body (``checkpoint(fn, idx, q)`` with ``fn`` doing ``i[..., 0] = i[..., 1]``), so the call
writes the caller's tensor, and the pass read the indices as the top-k made them: a region between the
selection's region and the attention's, a region nested in the selecting region or in the attending one, and (in
one graph, before this change) a region called between a top-k and the attention, each repeating a pick, gave
outputs 0.48 apart from eager's. Such a call now writes every operand where its body (recursively) may write one
of its inputs; the site is left alone with the reason.

Tried besides, all already right: indices crossing two levels of nested checkpoints; a write through a view in a
nested outer body; the same selection function checkpointed twice (two bodies); indices passed twice to one region
and written through the second operand; indices cloned or sliced in the caller (the slice left alone); ``long()``
of int64 indices in the caller (an alias); ``out=`` writes in the caller; ``use_reentrant=True``; selective
checkpointing saving the top-k or the attention; checkpoints under ``torch.no_grad()``; ``torch.cond``, ``wrap``
and ``nested_compile_region`` bodies (not followed: left alone, saying so); the ``aot_eager`` compiler.

Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import pytest
from helpers import check_compiled
from test_attention_regions import _attend, _ckpt, _inputs, _select


def _repeat_a_pick(i, q):
    i[..., 0] = i[..., 1]  # a repeated pick: the dense mask counts it once, a sparse sum twice
    return q * 2


def _written_by_a_region_between(qi, ki, w, q, k, v):
    idx = _ckpt(_select, qi, ki, w)
    return _ckpt(_attend, idx, _ckpt(_repeat_a_pick, idx, q), k, v)


def _written_by_a_region_in_the_selecting_one(qi, ki, w, q, k, v):
    def select(a, b, c):
        i = _select(a, b, c)
        _ckpt(_repeat_a_pick, i, a)
        return i

    return _ckpt(_attend, _ckpt(select, qi, ki, w), q, k, v)


def _written_by_a_region_in_the_attending_one(qi, ki, w, q, k, v):
    def attend(i, a, b, c):
        return _attend(i, _ckpt(_repeat_a_pick, i, a), b, c)

    return _ckpt(attend, _ckpt(_select, qi, ki, w), q, k, v)


def _written_by_a_region_in_one_graph(qi, ki, w, q, k, v):
    idx = _select(qi, ki, w)
    return _attend(idx, _ckpt(_repeat_a_pick, idx, q), k, v)


@pytest.mark.parametrize("model,grad", [(_written_by_a_region_between, (3, 4, 5)),
                                        (_written_by_a_region_in_the_selecting_one, (3, 4, 5)),
                                        (_written_by_a_region_in_the_attending_one, ()),
                                        (_written_by_a_region_in_one_graph, (3, 4, 5))])
def test_found_in_review_a_region_writing_the_indices_is_a_write(model, grad):
    """Found in review: the pass rewrote these (outputs 0.48 from eager's). (The write in the attending region
    fails eager's own checkpoint in the backward: forward only.)"""
    reports = check_compiled(model, _inputs(2), grad=grad)
    got = [(r.decision, r.reason) for r in reports if r.kind == "attention"]
    assert got and all(d == "rejected" and "may change" in why for d, why in got), got
