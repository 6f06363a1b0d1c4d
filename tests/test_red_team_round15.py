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
and ``nested_compile_region`` bodies (not followed: left alone, saying so); indices given to a region by closure and
by keyword beside repeated picks (each placeholder mapped to its own operand); writes through a second output of
the selecting region or after the indices passed through a region; ``dynamic=True`` with T and S changing between
calls (rewritten once the model states the sizes' equalities, else left alone); the ``aot_eager`` and ``inductor``
compilers with the replay pass; HF GLM-MoE-DSA and DeepSeek-V3.2 (SDPA) training steps under gradient
checkpointing with ``aot_eager``.

Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_compiled
from test_attention_regions import K, _attend, _ckpt, _inputs, _select
from torch.utils.checkpoint import checkpoint


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


# ---------------------------------------------------------------------------------------------
# tried, already right


def _two_levels_each_way(qi, ki, w, q, k, v):
    """The top-k in a region nested in a region, the attention two levels down in another."""
    idx = _ckpt(lambda a, b, c: _ckpt(_select, a, b, c), qi, ki, w)
    return _ckpt(lambda i, a, b, c: _ckpt(lambda j, x, y, z: _ckpt(_attend, j, x, y, z), i, a, b, c), idx, q, k, v)


def _not_a_topk(i):
    j = torch.zeros_like(i) + torch.arange(K)
    j[..., 1] = 0  # repeated picks, written in a tensor of the region's own
    return j


def _captured_and_by_keyword(qi, ki, w, q, k, v):
    """Indices given to a region by closure and by keyword, beside repeated picks: each placeholder is its own."""
    idx = _ckpt(_select, qi, ki, w)
    bad = _ckpt(_not_a_topk, idx)

    def body(a, b, c, i=None, j=None):
        return 2 * _attend(i, a, b, c) + _attend(j, a, b, c) + 3 * _attend(idx, a, b, c) + _attend(bad, a, b, c)

    return checkpoint(body, q, k, v, j=idx, i=bad, use_reentrant=False)


@pytest.mark.parametrize("model,want", [(_two_levels_each_way, ["rewritten"]),
                                        (_captured_and_by_keyword, ["rejected", "rewritten", "rewritten", "rejected"])])
def test_indices_followed_through_nested_and_captured_region_inputs(model, want):
    reports = check_compiled(model, _inputs(3), grad=(3, 4, 5))
    assert sorted(r.decision for r in reports if r.kind == "attention") == sorted(want)


def _written_through_a_second_output(qi, ki, w, q, k, v):
    def select(a, b, c):
        i = _select(a, b, c)
        return i, i.view(-1)

    i, flat = _ckpt(select, qi, ki, w)
    flat[0] = flat[1]
    return _ckpt(_attend, i, q, k, v)


def _written_after_passing_through_a_region(qi, ki, w, q, k, v):
    idx = _ckpt(_select, qi, ki, w)
    j, q2 = _ckpt(lambda i, a: (i, a * 2), idx, q)
    idx[..., 0] = idx[..., 1]
    return _ckpt(_attend, j, q2, k, v)


@pytest.mark.parametrize("model", [_written_through_a_second_output, _written_after_passing_through_a_region])
def test_writes_through_region_outputs_leave_the_site_alone(model):
    reports = check_compiled(model, _inputs(3))
    got = [(r.decision, r.reason) for r in reports if r.kind == "attention"]
    assert got and all(d == "rejected" and "may change" in why for d, why in got), got


def test_other_higher_order_op_bodies_are_not_followed():
    from torch._higher_order_ops.wrap import wrap

    def model(qi, ki, w, q, k, v):
        idx = _select(qi, ki, w)
        return wrap(lambda i, a, b, c: _attend(i, a, b, c), idx, q, k, v) + torch.cond(
            q.sum() > 0, lambda i, a, b, c: _attend(i, a, b, c), lambda i, a, b, c: -_attend(i, a, b, c), (idx, q, k, v))

    got = [(r.decision, r.reason) for r in check_compiled(model, _inputs(3), grad=(3, 4, 5)) if r.kind == "attention"]
    assert len(got) == 3 and all(d == "rejected" and "could not follow" in why for d, why in got), got
