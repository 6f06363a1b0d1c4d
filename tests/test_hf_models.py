"""The HF transformers DSA models (DeepSeek-V3.2, GLM-MoE-DSA), unmodified, compiled with backend="hyscale".

Tiny random configs on CPU (tests/models/hf.py). Two kinds of checks:

* logits of the compiled model equal eager (Inductor compiles the rewritten graph);
* every indexer site is rewritten (counters["hyscale"]["selection_rewritten"] == one per layer that runs an
  indexer), and the MoE router's top-k nodes are not.

Tolerance of the logits: the indexer only produces indices, so once the selection is the same the only
differences come from Inductor's fp32 arithmetic (fused RMSNorm/softmax reductions in another order). On these
models that is about 1.5e-7 on logits of magnitude ~0.6. A single different selected key changes the logits of
the rows that see it by 4e-2 to 1e-1 (measured by comparing index_topk=8 with 7: HF's default initializer_range
0.02 is enough to make the selection visible in the logits). atol=rtol=1e-5 is 60x above the
rounding noise and 4000x below the effect of one wrong key. ``_assert_selection_well_posed`` checks that the
eager scores have no tie or near-tie at the k-th place, so that rounding alone cannot change the selection.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")

from models.hf import indexer_sites, tiny_deepseek_v32, tiny_glm_moe_dsa  # noqa: E402

LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)

CASES = {
    # index_topk < S: a real selection; rows t < k - 1 have fewer visible keys than k (masked picks).
    "deepseek_v32": (tiny_deepseek_v32, dict(index_topk=8, seq_len=16)),
    # index_topk >= S: min(index_topk, S) == S, every key is selected.
    "deepseek_v32_k_ge_s": (tiny_deepseek_v32, dict(index_topk=32, seq_len=16)),
    # Eager attention: the indexer mask is additive with torch.finfo(float32).min, plus left padding.
    "deepseek_v32_eager_attn_padded": (
        tiny_deepseek_v32,
        dict(index_topk=8, seq_len=16, attn_implementation="eager", padding=True),
    ),
    # Layers F, S, F: layer 1 reuses layer 0's indices (2 indexer sites, 3 scatters).
    "glm_moe_dsa": (tiny_glm_moe_dsa, dict(index_topk=8, seq_len=16, indexer_pattern="FSF")),
}

# Cheaper cases for the rewrite counters (options={"compiler": "eager"}: the pass runs, Inductor does not).
COUNTER_CASES = dict(
    CASES,
    # A MoE layer adds three router top-k nodes that are not indexer sites.
    deepseek_v32_moe=(tiny_deepseek_v32, dict(index_topk=8, seq_len=16, moe=True)),
    glm_moe_dsa_moe=(tiny_glm_moe_dsa, dict(index_topk=8, seq_len=16, indexer_pattern="FSF", moe=True)),
    deepseek_v32_bf16=(tiny_deepseek_v32, dict(index_topk=8, seq_len=16, dtype=torch.bfloat16)),
    deepseek_v32_no_cache=(tiny_deepseek_v32, dict(index_topk=8, seq_len=16, use_cache=False)),
)


class _RecordTopk(TorchFunctionMode):
    """Records (input, k) of every Tensor.topk / torch.topk call made while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            k = args[1] if len(args) > 1 else kwargs["k"]
            self.calls.append((args[0].detach().clone(), k))
        return func(*args, **kwargs)


def _assert_selection_well_posed(model, inputs, rel_gap=1e-4):
    """Eager indexer scores have a clear gap between the k-th and the (k+1)-th visible key of every row.

    Visible = finite and above -1e38 (the models mask with -inf or finfo.min). Rows with at most k visible keys
    select all of them, whatever the rounding. Without this, a correct rewrite could legitimately pick another
    key and the logits comparison would not be a test of the pass.
    """
    rec = _RecordTopk()
    with torch.no_grad(), rec:
        model(**inputs)
    indexer_calls = [(s, k) for s, k in rec.calls if s.dim() == 3 and s.shape[-1] == s.shape[-2]]
    assert indexer_calls, "no indexer top-k call seen"
    for scores, k in indexer_calls:
        scores = scores.float()
        if k >= scores.shape[-1]:
            continue
        visible = scores > -1e38
        ranked = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
        kth, next_ = ranked[..., k - 1], ranked[..., k]
        rows = visible.sum(-1) > k
        gap = (kth - next_)[rows]
        scale = kth[rows].abs().clamp_min(1e-6)
        assert (gap > rel_gap * scale).all(), f"near-tie at the k-th place: min relative gap {(gap / scale).min()}"


def _build(case):
    factory, kwargs = case
    kwargs = dict(kwargs)
    use_cache = kwargs.pop("use_cache", None)
    model, inputs = factory(**kwargs)
    if use_cache is not None:
        inputs["use_cache"] = use_cache
    return model, inputs


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_eager(name):
    model, inputs = _build(CASES[name])
    _assert_selection_well_posed(model, inputs)
    with torch.no_grad():
        expected = model(**inputs).logits
        compiled = torch.compile(model, backend="hyscale")
        actual = compiled(**inputs).logits
    torch.testing.assert_close(actual, expected, **LOGITS_TOL)


@pytest.mark.parametrize("name", list(COUNTER_CASES))
def test_every_indexer_site_rewritten(name):
    model, inputs = _build(COUNTER_CASES[name])
    _assert_selection_well_posed(model, inputs)
    # The selection changes no arithmetic, so logits stay equal to eager's within fp32 rounding also in a bf16 model;
    # the attention pass changes the order of bf16 sums (tests/test_attention_pass.py compares it), so it is off here.
    options = {"compiler": "eager", "attention": model.dtype != torch.bfloat16}
    with torch.no_grad():
        expected = model(**inputs).logits
        actual = torch.compile(model, backend="hyscale", options=options)(**inputs).logits
    torch.testing.assert_close(actual, expected, **LOGITS_TOL)
    sites = indexer_sites(model)
    assert counters["hyscale"]["selection_rewritten"] == sites, dict(counters["hyscale"])


def test_factories_are_deterministic():
    for factory, kwargs in (CASES["deepseek_v32"], CASES["glm_moe_dsa"]):
        (m1, x1), (m2, x2) = factory(seed=3, **kwargs), factory(seed=3, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
        assert all(torch.equal(x1[key], x2[key]) for key in x1)
        (m3, _) = factory(seed=4, **kwargs)
        assert not torch.equal(m1.lm_head.weight, m3.lm_head.weight)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_sequence_length_changes_recompile_once(name):
    """Five sequence lengths: the first call compiles a static graph, the second a dynamic one (automatic
    dynamic), then no more compiles; every graph has all its indexer sites rewritten (k = min(index_topk, S) is
    a SymInt in the dynamic graph)."""
    from hyscale_compile.backend import hyscale

    factory, kwargs = CASES[name]
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return hyscale(gm, example_inputs, options={"compiler": "eager"})

    model, _ = factory(**kwargs)
    compiled = torch.compile(model, backend=counting_backend)
    for seq_len in (16, 20, 24, 28, 32):
        _, inputs = factory(**dict(kwargs, seq_len=seq_len))
        _assert_selection_well_posed(model, inputs)
        with torch.no_grad():
            expected = model(**inputs).logits
            actual = compiled(**inputs).logits
        torch.testing.assert_close(actual, expected, **LOGITS_TOL)
    assert len(graphs) <= 2, f"{len(graphs)} compiles for 5 sequence lengths"
    assert counters["hyscale"]["selection_rewritten"] == indexer_sites(model) * len(graphs), dict(counters["hyscale"])


def _dynamo_graphs(model, inputs) -> list[torch.fx.GraphModule]:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=record)(**inputs)
    return graphs


def _name(node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_graph_facts(attn):
    """The summary facts of tests/models/HF_GRAPHS.md that the selection pass relies on, checked against the
    graphs Dynamo makes of the installed transformers (the listings there are a snapshot; these are not)."""
    model, inputs = tiny_deepseek_v32(index_topk=8, seq_len=16, attn_implementation=attn)
    nodes = [n for gm in _dynamo_graphs(model, inputs) for n in gm.graph.nodes]
    topks = [n for n in nodes if _name(n) == "topk"]
    assert len(topks) == indexer_sites(model)
    for topk in topks:
        # Tensor.topk on the last dim; only the indices are read, cast to int32
        assert topk.op == "call_method" and topk.kwargs.get("dim", -1) == -1
        users = list(topk.users)
        assert [u.args[1] for u in users] == [1]
        (idx,) = users
        assert [_name(u) for u in idx.users] == ["to"] and list(idx.users)[0].args[1] == torch.int32
        # the score: the head-sum matmul of a 4-D matmul, squeezed, then masked
        mask_op = topk.args[0]
        assert _name(mask_op) == ("masked_fill" if attn == "sdpa" else "add")
        squeeze = mask_op.args[0]
        assert _name(squeeze) == "squeeze"
        head_sum = squeeze.args[0]
        assert _name(head_sum) == "matmul" and len(head_sum.meta["example_value"].shape) == 4
        relu = head_sum.args[1]
        assert _name(relu) == "relu"
        # downstream: the int32 indices are scattered (as int64) into a dense bool [B, T, S] index mask
        idx32 = list(idx.users)[0]
        scatters = [u for n in idx32.users for u in n.users if _name(u) == "scatter"]
        assert scatters and all(s.meta["example_value"].dtype == torch.bool for s in scatters)


def test_training_padding_mask_is_causal_and_per_key():
    """The training step (``use_cache=False``, a padded 2-D attention_mask): HF hands the indexer its causal &
    padding mask materialized [B, T, S]; the selection op gets the causal rule as its range and the padding as a
    [B, 1, S] key mask (``masks.split_keep``), never the [B, T, S] tensor, and the step equals eager: the picks
    (HF's own topk indices, read where the model returns them), the loss and every gradient."""
    from hyscale_compile.passes import report
    from hyscale_compile.runtime import reference

    model, inputs = tiny_deepseek_v32(index_topk=8, seq_len=16, padding=True, use_cache=False)
    assert (inputs["attention_mask"] == 0).any()
    _assert_selection_well_posed(model, inputs)
    model.train()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    seen, picks = [], []
    select = reference.select

    def spy(q, kx, w, k, scale, relu, vis, *args, **kwargs):
        seen.append(vis)
        return select(q, kx, w, k, scale, relu, vis, *args, **kwargs)

    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    hooks = [m.register_forward_hook(lambda m, a, out: picks.append(out.detach().sort(-1).values)) for m in indexers]

    def step(m):
        model.zero_grad()
        out = m(**inputs, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    try:
        expected, expected_grads = step(model)
        eager_picks, picks[:] = list(picks), []
        reference.select = spy
        with report.collect() as reports:
            actual, grads = step(torch.compile(model, backend="hyscale",
                                               options={"compiler": "aot_eager", "attention": False}))
    finally:
        reference.select = select
        for h in hooks:
            h.remove()
    sites = [r for r in reports if r.kind == "selection"]
    assert [r.mask_kind for r in sites] == ["causal + key mask"] * 2, [(r.mask_kind, r.reason) for r in sites]
    B, T = inputs["input_ids"].shape
    assert seen and all(v.causal and v.offset == 0 and v.mask is not None and v.mask.shape == (B, 1, T) for v in seen)
    # the visible picks (a row with fewer than k visible keys fills up with masked ones, in no order eager defines)
    visible = (torch.arange(T)[None, :, None] >= torch.arange(T)) & inputs["attention_mask"].bool()[:, None, :]
    assert len(picks) == len(eager_picks) == 2
    for ours, theirs in zip(picks, eager_picks):
        seen_ours, seen_theirs = (visible.gather(-1, p.long()) for p in (ours, theirs))
        a, b = (p.long().where(v, T).sort(-1).values for p, v in ((ours, seen_ours), (theirs, seen_theirs)))
        assert torch.equal(a, b)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], expected_grads[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
