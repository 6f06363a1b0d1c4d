"""Review round 16: grad modes, autograd edge cases, autocast, hooks and in-place code around the passes.

Found and fixed:

* (legality.check_grad_mode) the selection's values stand for every gather of the score at the selected indices,
  and are made where the top-k runs, in its grad mode; eager makes each gather where it runs. A top-k under
  ``torch.no_grad()`` (a selection is not differentiable, so code selects under it, or in a ``@torch.no_grad()``
  helper) whose indices a gather outside it reads for the loss, ``score.gather(-1, idx)`` / ``take_along_dim`` /
  after an ``argsort(descending)[..., :k]``, was rewritten, and the gathered scores carried no gradient (eager's
  carry the score's: q, k and the weights got none at all); the other way round, a gather under no_grad after a
  top-k outside it, they carried one eager's do not (a loss on them would train the indexer where eager's does
  not). Likewise a ``[..., :k]`` slice of a sort's values taken under no_grad. Such sites are now left alone with
  the reason.
* (attention.check_grad_mode) eager attention whose q.k^T logits, the mask arithmetic on them, or the softmax run
  under ``torch.no_grad()`` while the product with v does not: eager's autograd stops q's and k's gradient there,
  the op (run where the product with v is, with grad enabled) carried it through; q and k got gradients (up to 2.5)
  where eager's are 0. (Round 4 fixed the same for the steps of an MLA expansion only.) Such sites are now left
  alone with the reason; an index mask built under no_grad (it carries no gradient) is still rewritten.
* (lowering/ops.py) a custom op's body, and its backward, run in the caller's autocast state; the attention ops
  turned autocast off for their own arithmetic, the selection ops did not. Under an autocast region (the selection
  in one with the ``eager`` compiler, ``indexer_topk`` called in one, a compiled model called in one) select and
  rescore scored in bfloat16 (6e-3 from the op's fp32 scores, which the report and the replay rely on), and a
  ``loss.backward()`` inside ``with torch.autocast(...)`` failed in the selection's backward (index_add_ of
  bfloat16 products into float32 gradients) where eager's runs. select, rescore and sparse_backward now compute
  with autocast off, as documented: their fp32 scores and gradients.

Tried besides, all already right: ``backward(retain_graph=True)`` twice and ``autograd.grad`` twice on a selection
plus sparse attention (eager and aot_eager compilers: the ops' saved tensors survive, same gradients both times);
double backward (``create_graph=True``) raises a clear error (the ops' backward has no autograd formula; AOTAutograd
refuses double backward itself), never silent second-order gradients; the indexer under autocast in bfloat16
(rewritten, the report says so) and in float16 (left alone: fp16 scores overflow); ``out=`` top-k and gathers (left
alone); ``register_hook`` on the per-head scores or the score (left alone: Dynamo keeps the hook in the graph, a
reader of the table) and on q (rewritten, the hook sees the op's gradient, as eager's); hooks on attention logits,
on q before SDPA; ``torch.no_grad()`` around the whole selection (the inputs cut) and around the index mask only.
Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_red_team_round14 import MIN, NEG, SEL, _causal, _check_sites, _inputs, _keep, _logits, _rj, _rw, _score

from hyscale_compile.passes import report

K = 4
IDX = (0, 1, 2)  # the indexer's inputs: qi, ki, w


def _score_masked(qi, ki, w):
    return _score(qi, ki, w).masked_fill(~_causal(), NEG)


# ---------------------------------------------------------------------------------------------
# Found in review: a gather at the selected indices in another grad mode than the top-k


def _topk_under_no_grad_gather_outside(qi, ki, w):
    s = _score_masked(qi, ki, w)
    with torch.no_grad():
        idx = s.topk(K).indices
    return s.gather(-1, idx), idx


def _topk_under_no_grad_take_along_dim_outside(qi, ki, w):
    s = _score_masked(qi, ki, w)
    with torch.no_grad():
        idx = torch.topk(s, K, dim=-1)[1]
    return torch.take_along_dim(s, idx, dim=-1)


def _argsort_under_no_grad_gather_outside(qi, ki, w):
    s = _score_masked(qi, ki, w)
    with torch.no_grad():
        idx = s.argsort(-1, descending=True)[..., :K]
    return s.gather(-1, idx)


@torch.no_grad()
def _select_without_grad(s):
    return s.topk(K).indices


def _selection_helper_under_no_grad(qi, ki, w):
    """The same, the selection a helper decorated with ``@torch.no_grad()``."""
    s = _score_masked(qi, ki, w)
    return s.gather(-1, _select_without_grad(s))


def _gather_under_no_grad_topk_outside(qi, ki, w):
    s = _score_masked(qi, ki, w)
    values, idx = s.topk(K)
    with torch.no_grad():
        again = s.gather(-1, idx)
    return values, again


def _sorted_slice_under_no_grad(qi, ki, w):
    s = _score_masked(qi, ki, w)
    values, idx = s.sort(-1, descending=True)
    with torch.no_grad():
        top = values[..., :K]
    return top, idx[..., :K]


GATHERS = {  # the model, and words of the reason
    "topk_under_no_grad_gather_outside": (_topk_under_no_grad_gather_outside,
                                          "topk runs under torch.no_grad() and the gather"),
    "topk_under_no_grad_take_along_dim_outside": (_topk_under_no_grad_take_along_dim_outside,
                                                  "topk runs under torch.no_grad() and the take_along_dim"),
    "argsort_under_no_grad_gather_outside": (_argsort_under_no_grad_gather_outside,
                                             "argsort runs under torch.no_grad() and the gather"),
    "selection_helper_under_no_grad": (_selection_helper_under_no_grad, "topk runs under torch.no_grad()"),
    "gather_under_no_grad_topk_outside": (_gather_under_no_grad_topk_outside, "gather at"),
    "sorted_slice_under_no_grad": (_sorted_slice_under_no_grad, "slice of the sorted scores at"),
}


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_found_in_review_a_gather_in_another_grad_mode_than_the_selection(name):
    """Found in review: rewritten, and the outputs' requires_grad (and so the gradients of qi, ki, w) differed from
    eager's."""
    model, words = GATHERS[name]
    (r,) = _check_sites(model, _inputs()[:3], [("selection", "rejected", words)], grad=IDX)
    assert "grad enabled" in r.reason, r.reason


def _sorted_under_no_grad_sliced_outside(qi, ki, w):
    """A slice is a view: of a sort's values made under no_grad it carries no gradient in any mode."""
    s = _score_masked(qi, ki, w)
    with torch.no_grad():
        values, idx = s.sort(-1, descending=True)
    return values[..., :K], idx[..., :K]


def _whole_selection_under_no_grad(qi, ki, w):
    with torch.no_grad():
        s = _score_masked(qi, ki, w)
        idx = s.topk(K).indices
    return s.gather(-1, idx), idx


@pytest.mark.parametrize("model", [_sorted_under_no_grad_sliced_outside, _whole_selection_under_no_grad])
def test_grad_modes_that_agree_are_still_rewritten(model):
    _check_sites(model, _inputs(1)[:3], [SEL], grad=IDX)


# ---------------------------------------------------------------------------------------------
# Found in review: eager attention whose logits or softmax run under no_grad


def _logits_under_no_grad(qi, ki, w, q, k, v):
    keep = _keep(qi, ki, w)
    with torch.no_grad():
        a = _logits(q, k)
    return a.masked_fill(~keep, MIN).softmax(-1) @ v


def _masked_scores_under_no_grad(qi, ki, w, q, k, v):
    a = _logits(q, k)
    with torch.no_grad():
        a = a.masked_fill(~_keep(qi, ki, w), MIN)
    return a.softmax(-1) @ v


def _softmax_under_no_grad(qi, ki, w, q, k, v):
    a = _logits(q, k).masked_fill(~_keep(qi, ki, w), MIN)
    with torch.no_grad():
        p = a.softmax(-1)
    return p @ v


NO_GRAD_STEPS = {"logits_under_no_grad": (_logits_under_no_grad, "transpose at"),
                 "masked_scores_under_no_grad": (_masked_scores_under_no_grad, "masked_fill at"),
                 "softmax_under_no_grad": (_softmax_under_no_grad, "softmax at")}


@pytest.mark.parametrize("name", sorted(NO_GRAD_STEPS))
def test_found_in_review_attention_steps_under_no_grad_keep_eagers_gradients(name):
    """Found in review: rewritten, and q and k got gradients (up to 2.5) where eager gives them none."""
    model, words = NO_GRAD_STEPS[name]
    (_, r) = _check_sites(model, _inputs(2), [SEL, _rj("runs under torch.no_grad()")])
    assert words in r.reason, r.reason


def _mask_under_no_grad(qi, ki, w, q, k, v):
    with torch.no_grad():
        keep = _keep(qi, ki, w)
    return _logits(q, k).masked_fill(~keep, MIN).softmax(-1) @ v


def _attention_under_no_grad(qi, ki, w, q, k, v):
    keep = _keep(qi, ki, w)
    with torch.no_grad():
        return _logits(q, k).masked_fill(~keep, MIN).softmax(-1) @ v


@pytest.mark.parametrize("model", [_mask_under_no_grad, _attention_under_no_grad])
def test_no_grad_where_no_gradient_is_cut_still_rewritten(model):
    """The mask carries no gradient; an attention wholly under no_grad gives none either way."""
    _check_sites(model, _inputs(3), [SEL, _rw("causal")])


# ---------------------------------------------------------------------------------------------
# Found in review: the selection ops computed in the caller's autocast dtype


def test_found_in_review_selection_ops_compute_in_float32_under_autocast():
    """Found in review: a custom op's body runs in its caller's autocast state, and select / rescore computed their
    reference scores in bfloat16 there (values 6e-3 from the op's own fp32 scores: rescore under autocast no
    longer equals select outside it, which the replay relies on)."""
    import hyscale_compile

    qi, ki, w = _inputs(8)[:3]
    off = ki.shape[1] - qi.shape[1]
    want, idx = hyscale_compile.indexer_topk(qi, ki, K, weights=w, scale=0.5, query_offset=off)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_idx = hyscale_compile.indexer_topk(qi, ki, K, weights=w, scale=0.5, query_offset=off)
        again = torch.ops.hyscale.rescore(qi, ki, w, idx, 0.5, True, True, off, None, None, None, None, None, NEG)
    assert torch.equal(got_idx, idx)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_found_in_review_backward_under_autocast(compiler):
    """Found in review: ``loss.backward()`` inside an autocast region (a training loop that indents its backward
    under ``with torch.autocast(...)``) failed in the selection's backward (index_add_ of bfloat16 products into
    float32 gradients), where eager's runs. Now the op's gradients are its fp32 ones: eager's without autocast, and
    eager's under it (whose einsum backward runs in bfloat16) within that rounding."""
    from helpers import ties_by_position

    def fn(qi, ki, w):
        return _score_masked(qi, ki, w).topk(K).values

    def grads(f, autocast):
        xs = [x.clone().requires_grad_() for x in _inputs(9)[:3]]
        values = f(*xs)
        weights = torch.linspace(-1, 2, values.numel()).view(values.shape)
        loss = (torch.where(values.isfinite(), values, 0) * weights).sum()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return torch.autograd.grad(loss, xs)

    torch._dynamo.reset()
    got = grads(torch.compile(fn, backend="hyscale", options={"compiler": compiler}), True)
    with ties_by_position():
        exact, rounded = grads(fn, False), grads(fn, True)
    for a, b, c in zip(got, exact, rounded, strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=2e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------------
# tried, already right


def _selection_and_sdpa(qi, ki, w, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_keep(qi, ki, w))


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_backward_twice_with_retain_graph(compiler):
    """The ops' saved tensors survive a retained graph: the same gradients twice, both equal to eager's."""
    from helpers import ties_by_position

    def grads(fn):
        xs = [x.clone().requires_grad_(i >= 3) for i, x in enumerate(_inputs(4))]
        out = fn(*xs)
        loss = (out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum()
        first = torch.autograd.grad(loss, xs[3:], retain_graph=True)
        loss.backward(retain_graph=True)
        loss.backward()
        return out.detach(), first, [x.grad / 2 for x in xs[3:]]

    torch._dynamo.reset()
    with report.collect() as reports:
        got = grads(torch.compile(_selection_and_sdpa, backend="hyscale", options={"compiler": compiler}))
    assert [r.decision for r in reports] == ["rewritten", "rewritten"], [r.reason for r in reports]
    with ties_by_position():
        want = grads(_selection_and_sdpa)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip([*got[1], *got[2]], [*want[1], *want[2]], strict=True):
        torch.testing.assert_close(a, b)


def test_double_backward_raises_instead_of_wrong_second_order_gradients():
    def fn(qi, ki, w):
        return _score_masked(qi, ki, w).topk(K).values

    xs = [x.clone().requires_grad_() for x in _inputs(5)[:3]]
    torch._dynamo.reset()
    values = torch.compile(fn, backend="hyscale", options={"compiler": "eager"})(*xs)
    loss = torch.where(values.isfinite(), values, 0).sum()
    (dq,) = torch.autograd.grad(loss, xs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(dq.square().sum(), xs[2])


def _indexer_under_autocast(dtype):
    def model(qi, ki, w):
        with torch.autocast("cpu", dtype=dtype):
            s = _score(qi, ki, w)
        return s.masked_fill(~_causal(), NEG).topk(K)

    return model


@pytest.mark.parametrize("dtype,expect", [(torch.bfloat16, ("selection", "rewritten", "bfloat16")),
                                          (torch.float16, ("selection", "rejected", "float16"))])
def test_indexer_under_autocast(dtype, expect):
    _check_sites(_indexer_under_autocast(dtype), _inputs(6)[:3], [expect], grad=IDX, rtol=2e-2, atol=2e-2)


def _hook_on_head_scores(qi, ki, w):
    s = torch.einsum("bthd,bsd->bths", qi, ki)
    s.register_hook(lambda g: g * 3)
    return ((s.relu() * w[..., None]).sum(2) * 8 ** -0.5).masked_fill(~_causal(), NEG).topk(K).values


def _hook_on_queries(qi, ki, w):
    qi = qi * 1.0
    qi.register_hook(lambda g: g * 3)
    return _score_masked(qi, ki, w).topk(K).values


@pytest.mark.parametrize("model,expect", [(_hook_on_head_scores, ("selection", "rejected", "register_hook")),
                                          (_hook_on_queries, SEL)])
def test_gradient_hooks_in_the_indexer(model, expect):
    """Dynamo keeps a hook on an intermediate in the graph: on the scores it reads the table (left alone); on q the
    op's gradient passes through it, as eager's does."""
    _check_sites(model, _inputs(7)[:3], [expect], grad=IDX)
