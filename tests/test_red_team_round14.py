"""Review round 14: attention and indexer code of the newer model families and of inference / training set-ups the
earlier rounds did not try.

Found and fixed (attention_sites.eager, attention_masks._Expr._ev): eager attention whose softmax weights or scores
are rounded to a narrower dtype on the way, in a model whose attention otherwise computes in float32, was rewritten
as if they were not. ``softmax(a, -1).bfloat16().float() @ v`` (weights rounded to bfloat16 and back),
``torch.softmax(a, -1, torch.float16).float() @ v`` (the dtype given by position, which the pass read only as a
keyword: the scores are cast to float16 before the softmax) and ``a.masked_fill(~keep, -inf).bfloat16()
.softmax(-1, dtype=torch.float32) @ v`` (the masked scores rounded to bfloat16 in the mask chain, where the
evaluation cast only the constant it carries) gave outputs 1e-3 apart from eager's (relative 0.15 .. 2): the op
computes weights and scores in the product's dtype. Such casts now leave the site alone with the reason; casts up
to float32 and to the product's dtype (HF's ``softmax(dtype=float32).to(q.dtype)``, autocast) are still rewritten.

Tried besides, all already right: SDPA inside ``sdpa_kernel`` contexts (one backend, a list); float SDPA masks of
-inf (rewritten), finfo.min (left alone: a row could be empty, where SDPA's gradient depends on its kernel) and -1e9
(left alone: does not hide exactly); attention weights read by a second consumer; one mask read by two SDPA calls and
two masks from one selection with the default and an explicit scale; selective checkpointing
(``create_selective_checkpoint_contexts``) and reentrant checkpointing with gradients of some inputs only; the
selection in a ``torch.compiler.disable`` function or before a graph break (the indices a graph input: left alone,
the reason names it); a decode step under ``inference_mode`` writing the new key into a cache buffer; DeepSeek-V4
style sparse attention over mean-pooled block keys under a block-causal mask beside a sliding-window branch (the
mask read at the picks), compressed picks mapped back to tokens (``idx * block + arange``) and picks padded with an
out-of-range or -1 marker (left alone: not a top-k's); rows with no visible key behind finfo.min (the mean of v);
hand-written sparse attention gathering k / v at the picks (``index_select``, advanced indexing: no site); chunked
prefill at cache positions held in a tensor, consecutive or not (a window for the selection, the mask read at the
picks for the attention); ``k = min(index_topk, S)`` under dynamic=True with S crossing index_topk; autocast around
HF's eager attention.

Otherwise every rewritten site matched eager (outputs and gradients of every input) and every other site was
left alone with a reason. Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, ties_by_position
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hyscale_compile.passes import report

B, T, S, H, D, K = 2, 6, 8, 2, 8, 4
HI, DI = 3, 8  # the indexer's heads and dim
NEG = float("-inf")
MIN = torch.finfo(torch.float32).min
ALL = (0, 1, 2, 3, 4, 5)


def _causal(t=T, s=S, off=None):
    off = s - t if off is None else off
    return torch.arange(s)[None, :] <= torch.arange(t)[:, None] + off


def _score(q, k, w):
    return (torch.einsum("bthd,bsd->bths", q, k).relu() * w[..., None]).sum(2) * DI ** -0.5


def _picks(qi, ki, w, t=T, s=S):
    return _score(qi, ki, w).masked_fill(~_causal(t, s), NEG).topk(K).indices


def _picked(idx, s=S):
    return torch.zeros(idx.shape[0], idx.shape[1], s, dtype=torch.bool).scatter(-1, idx, True)


def _inputs(seed=0, t=T, s=S, dt=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, t, HI, DI, generator=g), torch.randn(B, s, DI, generator=g),
            torch.randn(B, t, HI, generator=g), *(torch.randn(B, H, n, D, generator=g).to(dt) for n in (t, s, s)))


def _check_sites(fn, args, expect, grad=ALL, compiler="eager", **tol):
    """check_compiled (ties broken by position where a selection is rewritten, the operator's rule; eager's torch.topk
    where none is, as the compiled graph then runs it too); ``expect``:
    (kind, decision, words of the reason or the mask kind) of each site, in order."""
    sel = [e[1] for e in expect if e[0] == "selection"]
    ties = bool(sel) and all(d == "rewritten" for d in sel)
    reports = check_compiled(fn, args, grad=grad, ties=ties, compiler=compiler, **tol)
    got = [(r.kind, r.decision) for r in reports]
    assert got == [e[:2] for e in expect], [(r.kind, r.decision, r.reason) for r in reports]
    for r, (_, _, words) in zip(reports, expect, strict=True):
        assert words in r.reason or words == r.mask_kind, (words, r.mask_kind, r.reason)
    return reports


SEL = ("selection", "rewritten", "")


def _rw(words):
    return ("attention", "rewritten", words)


def _rj(words):
    return ("attention", "rejected", words)


def _logits(q, k):
    return q @ k.transpose(-1, -2) * D ** -0.5


def _keep(qi, ki, w):
    return (_picked(_picks(qi, ki, w)) & _causal())[:, None]


# ---------------------------------------------------------------------------------------------
# Found in review: weights or scores rounded to a narrower dtype between the q.k^T product and the product with v


def _weights_rounded_to_bf16(qi, ki, w, q, k, v):
    return _logits(q, k).masked_fill(~_keep(qi, ki, w), MIN).softmax(-1).bfloat16().float() @ v


def _weights_rounded_with_to(qi, ki, w, q, k, v):
    p = F.softmax(_logits(q, k).masked_fill(~_keep(qi, ki, w), MIN), dim=-1)
    return p.to(torch.float16).to(torch.float32) @ v


def _softmax_dtype_by_position(qi, ki, w, q, k, v):
    return torch.softmax(_logits(q, k).masked_fill(~_keep(qi, ki, w), MIN), -1, torch.float16).float() @ v


def _method_softmax_dtype_by_position(qi, ki, w, q, k, v):
    return _logits(q, k).masked_fill(~_keep(qi, ki, w), MIN).softmax(-1, torch.bfloat16).float() @ v


def _scores_rounded_in_the_mask_chain(qi, ki, w, q, k, v):
    keep = _picked(_picks(qi, ki, w))[:, None]  # the picks only: every row has K visible keys
    return _logits(q, k).masked_fill(~keep, NEG).bfloat16().softmax(-1, dtype=torch.float32) @ v


def _scores_rounded_after_the_mask_add(qi, ki, w, q, k, v):
    bias = torch.full((B, T, S), MIN).scatter(-1, _picks(qi, ki, w), 0.0)[:, None]
    return F.softmax((_logits(q, k) + bias).half().float(), -1) @ v


ROUNDED = {
    "weights_rounded_to_bf16": (_weights_rounded_to_bf16, "the attention weights are rounded to torch.bfloat16"),
    "weights_rounded_with_to": (_weights_rounded_with_to, "the attention weights are rounded to torch.float16"),
    "softmax_dtype_by_position": (_softmax_dtype_by_position, "the softmax casts the scores to torch.float16"),
    "method_softmax_dtype_by_position": (_method_softmax_dtype_by_position,
                                         "the softmax casts the scores to torch.bfloat16"),
    "scores_rounded_in_the_mask_chain": (_scores_rounded_in_the_mask_chain,
                                         "rounds the attention scores (torch.float32) to torch.bfloat16"),
    "scores_rounded_after_the_mask_add": (_scores_rounded_after_the_mask_add,
                                          "rounds the attention scores (torch.float32) to torch.float16"),
}


@pytest.mark.parametrize("name", sorted(ROUNDED))
def test_found_in_review_rounded_weights_or_scores_are_left_alone(name):
    """Found in review: rewritten, and 1e-3 apart from eager (the op computes in float32 and rounds nothing)."""
    fn, words = ROUNDED[name]
    _check_sites(fn, _inputs(), [SEL, _rj(words)])


def _hf_eager(q, k, v, keep, fill=None):
    fill = torch.finfo(q.dtype).min if fill is None else fill
    a = _logits(q, k).masked_fill(~keep, fill)
    return F.softmax(a, dim=-1, dtype=torch.float32).to(q.dtype) @ v


LOSSLESS = {  # casts up to float32 or to the product's dtype: still rewritten
    "hf_fp32": lambda qi, ki, w, q, k, v: _hf_eager(q, k, v, _keep(qi, ki, w)),
    "hf_bf16": lambda qi, ki, w, q, k, v: _hf_eager(q.bfloat16(), k.bfloat16(), v.bfloat16(), _keep(qi, ki, w)),
    "weights_float_then_float": lambda qi, ki, w, q, k, v: _logits(q, k).masked_fill(
        ~_keep(qi, ki, w), MIN).softmax(-1).float().to(torch.float32) @ v,
    "softmax_float32_by_position": lambda qi, ki, w, q, k, v: torch.softmax(
        _logits(q, k).masked_fill(~_keep(qi, ki, w), MIN), -1, torch.float32) @ v,
    "bf16_scores_upcast_in_the_chain": lambda qi, ki, w, q, k, v: (
        _logits(q.bfloat16(), k.bfloat16()).float().masked_fill(~_keep(qi, ki, w), MIN).softmax(-1).bfloat16()
        @ v.bfloat16()),
}


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_lossless_casts_still_rewritten(name):
    tol = dict(rtol=2e-2, atol=2e-2) if "bf16" in name else {}
    _check_sites(LOSSLESS[name], _inputs(1), [SEL, _rw("causal")], **tol)


def test_autocast_around_hf_eager_attention_still_rewritten():
    def model(qi, ki, w, q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _hf_eager(q, k, v, _keep(qi, ki, w), fill=torch.finfo(torch.bfloat16).min)

    _check_sites(model, _inputs(2), [("selection", "rewritten", "bfloat16"), _rw("causal")], rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# SDPA under sdpa_kernel, float masks, two attentions, checkpointing, gradients of some inputs only


def _sdpa_in_kernel_context(backends):
    def model(qi, ki, w, q, k, v):
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=_keep(qi, ki, w))

    return model


def _selective_checkpoint(qi, ki, w, q, k, v):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return checkpoint(lambda qi, ki, w, q, k, v: _hf_eager(q, k, v, _keep(qi, ki, w)), qi, ki, w, q, k, v,
                      use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def _two_sdpa_scale_none_and_explicit(qi, ki, w, q, k, v):
    idx = _picks(qi, ki, w)
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None])
    return o1 + F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None], scale=0.3)


@torch.compiler.disable
def _selected_outside(qi, ki, w):
    return _picks(qi, ki, w)


def _selection_in_a_disabled_region(qi, ki, w, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(_selected_outside(qi, ki, w)) & _causal())[:, None])


def _graph_break_between(qi, ki, w, q, k, v):
    idx = _picks(qi, ki, w)
    torch._dynamo.graph_break()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(_picked(idx) & _causal())[:, None])


ATTENTIONS = {  # name: (model, the sites)
    "sdpa_kernel_math": (_sdpa_in_kernel_context(SDPBackend.MATH), [SEL, _rw("causal")]),
    "sdpa_kernel_list": (_sdpa_in_kernel_context([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]),
                         [SEL, _rw("causal")]),
    "sdpa_float_minus_inf": (lambda qi, ki, w, q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(_keep(qi, ki, w), 0.0, NEG)), [SEL, _rw("causal")]),
    # a row could have no visible pick as far as the pass knows: SDPA's gradient there depends on its kernel
    "sdpa_float_finfo_min": (lambda qi, ki, w, q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.zeros(B, 1, T, S).masked_fill(~_keep(qi, ki, w), MIN)),
        [SEL, _rj("depends on the kernel SDPA picks")]),
    "sdpa_float_minus_1e9": (lambda qi, ki, w, q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=(~_keep(qi, ki, w)).float() * -1e9), [SEL, _rj("does not hide them exactly")]),
    "weights_read_twice": (lambda qi, ki, w, q, k, v: (lambda p: (p @ v, p.amax(-1)))(
        F.softmax(_logits(q, k).masked_fill(~_keep(qi, ki, w), MIN), -1)), [SEL, _rj("weights are read by amax")]),
    "one_mask_two_sdpa": (lambda qi, ki, w, q, k, v: (lambda m: F.scaled_dot_product_attention(
        q, k, v, attn_mask=m) + F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3))(_keep(qi, ki, w)),
        [SEL, _rj("feeds 2 attention calls")]),
    "two_masks_scale_none_and_explicit": (_two_sdpa_scale_none_and_explicit, [SEL, _rw("causal"), _rw("causal")]),
    "selective_checkpoint": (_selective_checkpoint, [SEL, _rw("causal")]),
    "selection_in_a_disabled_region": (_selection_in_a_disabled_region, [_rj("the graph input")]),
    "graph_break_between": (_graph_break_between, [SEL, _rj("the graph input `idx`")]),
}


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_attention_sites(name, compiler):
    fn, expect = ATTENTIONS[name]
    _check_sites(fn, _inputs(3), expect, compiler=compiler)


@pytest.mark.parametrize("grad", [(5,), (3,), (4, 5), (1, 3)])
def test_reentrant_checkpoint_gradients_of_some_inputs(grad):
    def model(qi, ki, w, q, k, v):
        return checkpoint(lambda qi, ki, w, q, k, v: _hf_eager(q, k, v, _keep(qi, ki, w)), qi, ki, w, q, k, v,
                          use_reentrant=True)

    _check_sites(model, _inputs(4), [SEL, _rw("causal")], grad=grad, compiler="aot_eager", backward=True)


def test_inference_mode_decode_with_a_cache():
    """A decode step (T = 1) under inference_mode: the new key written into a cache buffer, then attended."""
    def model(qi, ki, w, q, k, v):
        kc, vc = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
        kc[:, :, :-1], vc[:, :, :-1] = k[:, :, :-1], v[:, :, :-1]
        kc[:, :, -1:], vc[:, :, -1:] = k[:, :, -1:] * 2, v[:, :, -1:] * 2
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=_picked(_picks(qi, ki, w, t=1))[:, None])

    with torch.inference_mode():
        _check_sites(model, _inputs(5, t=1), [SEL, _rw("none")], grad=())


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 / NSA layouts, -1 padded picks, hand-written gathers, chunked prefill, k = min(topk, S)

BLK = 2


def _v4_compressed_with_a_window(qi, ki, w, q, k, v):
    """An indexer over mean-pooled block keys; sparse attention over the compressed kv under a block-causal mask
    (block j visible once its last token is); a sliding-window branch over the raw keys; the two gated."""
    sc = S // BLK
    vis = torch.arange(sc)[None, :] * BLK + (BLK - 1) <= torch.arange(T)[:, None] + (S - T)
    idx = _score(qi, ki.view(B, sc, BLK, DI).mean(2), w).masked_fill(~vis, NEG).topk(2).indices
    kc, vc = k.view(B, H, sc, BLK, D).mean(3), v.view(B, H, sc, BLK, D).mean(3)
    keep = torch.zeros(B, T, sc, dtype=torch.bool).scatter(-1, idx, True) & vis
    o_cmp = F.scaled_dot_product_attention(q, kc, vc, attn_mask=keep[:, None])
    window = _causal() & (torch.arange(S)[None, :] > torch.arange(T)[:, None] + (S - T) - 3)
    return o_cmp * 0.3 + F.scaled_dot_product_attention(q, k, v, attn_mask=window) * 0.7


def _compressed_picks_mapped_back(qi, ki, w, q, k, v):
    sc = S // BLK
    vis = torch.arange(sc)[None, :] * BLK <= torch.arange(T)[:, None] + (S - T)
    idx = _score(qi, ki.view(B, sc, BLK, DI).mean(2), w).masked_fill(~vis, NEG).topk(2).indices
    tokens = (idx[..., None] * BLK + torch.arange(BLK)).flatten(-2)
    keep = torch.zeros(B, T, S, dtype=torch.bool).scatter(-1, tokens, True) & _causal()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _minus_one_padded_to_an_extra_column(qi, ki, w, q, k, v):
    """DeepSeek's inference code marks invalid picks (rows with fewer than K visible keys); here sent to a spare
    column S, cut off after the scatter."""
    vals, idx = _score(qi, ki, w).masked_fill(~_causal(off=-2), NEG).topk(K)
    keep = torch.zeros(B, T, S + 1, dtype=torch.bool).scatter(-1, torch.where(vals == NEG, S, idx), True)[..., :S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _minus_one_padded_compared(qi, ki, w, q, k, v):
    vals, idx = _score(qi, ki, w).masked_fill(~_causal(off=-2), NEG).topk(K)
    keep = (torch.where(vals == NEG, -1, idx)[..., None] == torch.arange(S)).any(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])


def _empty_rows_behind_finfo_min(qi, ki, w, q, k, v):
    """Rows 0 and 1 see no key at all: the mean of v, as eager's softmax over finfo.min gives."""
    idx = _score(qi, ki, w).masked_fill(~_causal(off=-2), NEG).topk(K).indices
    a = _logits(q, k).masked_fill(~(_picked(idx) & _causal(off=-2))[:, None], MIN)
    return F.softmax(a, -1, dtype=torch.float32) @ v


def _gathered_by_index_select(qi, ki, w, q, k, v):
    idx = _score(qi, ki, w).masked_fill(~_causal(), NEG).topk(K).indices
    kk, vv = (torch.stack([torch.stack([x[b].index_select(1, idx[b, t]) for t in range(T)], 1) for b in range(B)])
              for x in (k, v))
    return (((q[:, :, :, None] * kk).sum(-1) * D ** -0.5).softmax(-1)[..., None] * vv).sum(-2)


def _gathered_by_advanced_indexing(qi, ki, w, q, k, v):
    vals, idx = _score(qi, ki, w).masked_fill(~_causal(off=-1), MIN).topk(K)
    bi = torch.arange(B)[:, None, None]
    kk, vv = k.transpose(1, 2)[bi, idx], v.transpose(1, 2)[bi, idx]  # [B, T, K, H, D]
    a = (torch.einsum("bhtd,btkhd->bhtk", q, kk) * D ** -0.5).masked_fill((vals == MIN)[:, None], NEG)
    return torch.einsum("bhtk,btkhd->bhtd", a.softmax(-1), vv)


LAYOUTS = {
    "v4_compressed_with_a_window": (_v4_compressed_with_a_window,
                                    [("selection", "rewritten", ""), _rw("mask read at the picks")]),
    "compressed_picks_mapped_back": (_compressed_picks_mapped_back, [SEL, _rj("not a top-k's")]),
    "minus_one_padded_to_an_extra_column": (_minus_one_padded_to_an_extra_column, [SEL, _rj("not a top-k's")]),
    "minus_one_padded_compared": (_minus_one_padded_compared, [SEL]),
    "empty_rows_behind_finfo_min": (_empty_rows_behind_finfo_min, [SEL, _rw("causal")]),
    "gathered_by_index_select": (_gathered_by_index_select, [SEL]),
    "gathered_by_advanced_indexing": (_gathered_by_advanced_indexing, [SEL]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts(name):
    fn, expect = LAYOUTS[name]
    _check_sites(fn, _inputs(6), expect, compiler="aot_eager")


def _prefill_at_cache_positions(qi, ki, w, q, k, v, cache_position):
    """Chunked prefill: T queries at the positions ``cache_position`` (a tensor: here not consecutive, as in
    tree / speculative decoding) among S cached keys; HF eager attention."""
    visible = torch.arange(S)[None, :] <= cache_position[:, None]
    idx = _score(qi, ki, w).masked_fill(~visible, NEG).topk(K).indices
    return _hf_eager(q, k, v, (_picked(idx) & visible)[:, None])


@pytest.mark.parametrize("positions", [(5, 6, 7), (2, 6, 4)])
def test_prefill_at_cache_positions_held_in_a_tensor(positions):
    args = (*_inputs(7, t=3), torch.tensor(positions))
    _check_sites(_prefill_at_cache_positions, args, [("selection", "rewritten", "window"),
                                                     _rw("mask read at the picks")], grad=(0, 1, 2, 3, 4, 5))


def test_k_from_min_of_topk_and_s_under_dynamic_shapes():
    """``k = min(index_topk, S)`` with S growing past index_topk under dynamic=True: each call is eager's (the
    attention left dense with a reason while the head dim and the lengths are symbols it cannot prove)."""
    def model(qi, ki, w, q, k, v):
        t, s = q.shape[2], k.shape[2]
        visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
        idx = _score(qi, ki, w).masked_fill(~visible, NEG).topk(min(6, s), dim=-1).indices
        keep = torch.zeros(B, t, s, dtype=torch.bool).scatter(-1, idx, True) & visible
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])

    compiled = torch.compile(model, backend="hyscale", options={"compiler": "aot_eager"}, dynamic=True)
    for t, s in ((3, 4), (3, 5), (6, 8), (1, 9)):
        args = _inputs(8, t=t, s=s)
        with report.collect() as reports:
            got = compiled(*args)
        with ties_by_position():
            want = model(*args)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert all(r.decision == "rewritten" for r in reports if r.kind == "selection"), reports
        assert all(r.reason for r in reports if r.decision == "rejected"), reports
