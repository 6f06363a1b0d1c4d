"""The attention pass: dense attention under a scattered top-k mask becomes ``hyscale.sparse_attention``.

HF DeepSeek-V3.2 and GLM-MoE-DSA (with a shared "FSF" layer), SDPA and eager attention, with and without left
padding: every DSA attention site is rewritten (in the absorbed MLA layout), logits and gradients equal eager's;
small modules (tests/models/dsa_attention.py) cover the other spellings, the per-head and grouped layouts, and
each rejection with its reason.

Tolerances: the rewrite computes the same softmax over the same keys; what changes is the order of sums (the op
gathers k keys instead of reducing over S masked ones; the absorbed MLA layout multiplies q by the up-projection
before the dot product instead of expanding the keys). In fp32 that is ~2e-7 on logits of magnitude ~0.6 and
~1e-6 relative on gradients; one different pick changes the logits by 4e-2 or more (tests/test_hf_models.py), so
rtol=atol=1e-5 on logits and rtol=1e-4 on gradients separate rounding from a wrong attention by orders of
magnitude. The picks are eager's own: the HF selection is well posed (no near-tie at the k-th place, checked),
and the small modules select from an input score the selection pass leaves alone.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import flat, rewritten_with_attention
from models import dsa_attention as da
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import TestCase

import hyscale_compile
from hyscale_compile.backend import HyscaleOptions
from hyscale_compile.passes import attention, report, selection
from hyscale_compile.passes.debug import compact

LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _hf():
    pytest.importorskip("transformers")
    from models import hf

    return hf


def _hf_model(name: str, **kw):
    hf = _hf()
    if name == "glm_moe_dsa":
        return hf.tiny_glm_moe_dsa(indexer_pattern="FSF", **kw)
    return hf.tiny_deepseek_v32(**kw)


def _well_posed(model, inputs):
    from test_hf_models import _assert_selection_well_posed

    _assert_selection_well_posed(model, inputs)


# ---------------------------------------------------------------------------------------------
# HF models


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_hf_every_dsa_attention_site_rewritten(name, attn, padding):
    model, inputs = _hf_model(name, attn_implementation=attn, padding=padding)
    _well_posed(model, inputs)
    with torch.no_grad(), report.collect() as reports:
        expected = model(**inputs).logits
        actual = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(**inputs).logits
    torch.testing.assert_close(actual, expected, **LOGITS_TOL)
    layers = len(model.model.layers)  # GLM "FSF": layer 1 scatters layer 0's indices again: 3 sites, 2 selections
    assert counters["hyscale"]["attention_rewritten"] == layers, dict(counters["hyscale"])
    assert counters["hyscale"]["attention_rejected"] == 0
    sites = [r for r in reports if r.kind == "attention"]
    assert all(r.layout.startswith("MLA latent (16 + 8") for r in sites)
    assert {r.mask_kind for r in sites} == {"causal + key mask" if padding else "causal"}
    empty = "mean of v" in sites[0].reason
    assert empty == (attn == "eager"), sites[0].reason


@pytest.mark.parametrize("name, attn, compiler", [
    ("deepseek_v32", "sdpa", "aot_eager"),
    ("glm_moe_dsa", "eager", "aot_eager"),
    ("deepseek_v32", "eager", "inductor"),
])
def test_hf_training_gradients_equal_eager(name, attn, compiler):
    """model.train() (attention dropout 0), left padding, HF's own loss: parameter gradients equal eager's. The
    padded query rows see no key: SDPA gives them 0, eager the mean of v and, through its additive finfo.min
    mask, a gradient to q and k that ``hyscale.empty_rows_like_eager`` reproduces."""
    model, inputs = _hf_model(name, attn_implementation=attn, padding=True)
    _well_posed(model, inputs)
    model.train()
    step = hf_training_step(model, inputs)
    want = step(model)
    got = step(torch.compile(model, backend="hyscale", options={"compiler": compiler}))
    assert counters["hyscale"]["attention_rewritten"] == len(model.model.layers), dict(counters["hyscale"])
    assert_step_equal(got, want)


def hf_training_step(model, inputs):
    """One step as HF trains: its own loss over the labels of the unpadded tokens, backward; the step of a model
    (compiled or not) returns (logits, the parameters' gradients)."""
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)

    def step(m):
        model.zero_grad()
        out = m(**inputs, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    return step


def assert_step_equal(got, want):
    """Logits and every parameter's gradient of two training steps equal (eager's tolerances of switching SDPA
    backends)."""
    (actual, grads), (expected, expected_grads) = got, want
    torch.testing.assert_close(actual, expected, **LOGITS_TOL)
    assert grads.keys() == expected_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], expected_grads[n], **GRAD_TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_bf16_as_close_to_fp32_as_eager(attn):
    """bf16 model: the rewrite sums in another order, so its logits differ from eager's by bf16 rounding (an ulp
    of ~4e-3 at these magnitudes). Measured against the same model in fp32, they are as close as eager's."""
    model, inputs = _hf_model("deepseek_v32", attn_implementation=attn, padding=True)
    _well_posed(model, inputs)
    with torch.no_grad():
        exact = model(**inputs).logits
        model.to(torch.bfloat16)
        expected = model(**inputs).logits.float()
        actual = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(**inputs).logits.float()
    assert counters["hyscale"]["attention_rewritten"] == 2, dict(counters["hyscale"])
    ours, theirs = (actual - exact).abs(), (expected - exact).abs()
    assert ours.max() <= 2 * theirs.max() and ours.mean() <= 1.5 * theirs.mean(), (ours.max(), theirs.max())


def test_hf_inductor_logits_equal_eager():
    model, inputs = _hf_model("glm_moe_dsa", attn_implementation="sdpa", padding=True)
    _well_posed(model, inputs)
    with torch.no_grad():
        expected = model(**inputs).logits
        actual = torch.compile(model, backend="hyscale")(**inputs).logits
    torch.testing.assert_close(actual, expected, **LOGITS_TOL)
    assert counters["hyscale"]["attention_rewritten"] == 3


def test_hf_every_key_selected_is_left_dense():
    """index_topk >= S: every key is picked; the sparse op would gather all S keys per query where dense
    attention reads each once, so the site stays dense (reported as such)."""
    model, inputs = _hf_model("deepseek_v32", index_topk=32)
    with torch.no_grad():
        report_ = hyscale_compile.explain(model, **inputs)
    sites = [s for s in report_.sites if s.kind == "attention"]
    assert [s.decision for s in sites] == ["rejected", "rejected"]
    assert all(s.reason.startswith("nothing to gain: k=16 picks per query of S=16 keys") for s in sites)


def test_hf_output_attentions_is_rejected():
    model, inputs = _hf_model("deepseek_v32", attn_implementation="eager")
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True)
        with report.collect() as reports:
            actual = torch.compile(model, backend="hyscale", options={"compiler": "eager"})(
                **inputs, output_attentions=True)
    sites = [r for r in reports if r.kind == "attention"]
    assert [r.decision for r in sites] == ["rejected", "rejected"]
    assert all("attention weights are read by the graph output" in r.reason for r in sites)
    assert "output_attentions=True" in sites[0].reason
    torch.testing.assert_close(actual.logits, expected.logits, **LOGITS_TOL)
    for a, b in zip(actual.attentions, expected.attentions):
        torch.testing.assert_close(a, b, **LOGITS_TOL)


def test_hf_attention_dropout_in_training_is_rejected():
    model, inputs = _hf_model("deepseek_v32", attention_dropout=0.1)
    model.train()
    report_ = hyscale_compile.explain(model, **inputs)
    sites = [s for s in report_.sites if s.kind == "attention"]
    assert [s.decision for s in sites] == ["rejected", "rejected"]
    assert all("dropout_p=0.1" in s.reason for s in sites)


def test_hf_sequence_length_changes_recompile_once():
    """Automatic dynamic: the second length compiles symbolic T = S; both graphs have every site rewritten."""
    from hyscale_compile.backend import hyscale

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return hyscale(gm, example_inputs, options={"compiler": "eager"})

    model, _ = _hf_model("glm_moe_dsa", attn_implementation="eager")
    compiled = torch.compile(model, backend=backend)
    for seq_len in (16, 20, 24):
        _, inputs = _hf_model("glm_moe_dsa", attn_implementation="eager", seq_len=seq_len, padding=True)
        _well_posed(model, inputs)
        with torch.no_grad():
            torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits, **LOGITS_TOL)
    assert len(graphs) == 2
    assert counters["hyscale"]["attention_rewritten"] == 3 * len(graphs), dict(counters["hyscale"])


def test_empty_rows_like_eager_gives_the_additive_masks_gradient():
    """sparse_attention(empty="mean") followed by empty_rows_like_eager has the values and the gradients of
    dense attention under an *added* finfo.min mask, rows with no visible pick included (grouped heads)."""
    from sparse_attention_cases import Case, kept_dense, make

    case = Case(H=4, G=2, Dqk=8, Dv=6, T=7, S=9, K=4, offset=-2)  # rows 0 and 1 see no key at all
    q, k, v, idx, offset, _ = make(case, dtype=torch.float32, seed=3)
    kept = kept_dense(idx, case.S, offset, None)
    assert (~kept.any(-1)).any() and kept.any(-1).any()
    gout = torch.randn(case.B, case.T, case.H, case.Dv, generator=torch.Generator().manual_seed(4))

    def sparse(q, k, v):
        out, lse = torch.ops.hyscale.sparse_attention(q, k, v, idx, 0.5, True, offset, None, None, "mean")
        return torch.ops.hyscale.empty_rows_like_eager(out, q, k, v, lse, 0.5)

    def dense(q, k, v):
        n = case.H // case.G
        kh, vh = (t.repeat_interleave(n, 2).transpose(1, 2) for t in (k, v))
        mask = torch.where(kept, 0.0, torch.finfo(torch.float32).min)[:, None]
        w = (q.transpose(1, 2) @ kh.transpose(-1, -2)) * 0.5 + mask
        return (w.softmax(-1) @ vh).transpose(1, 2)

    results = []
    for fn in (sparse, dense):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results.append((out.detach(), torch.autograd.grad((out * gout).sum(), leaves)))
    (out, grads), (want, want_grads) = results
    torch.testing.assert_close(out, want, **LOGITS_TOL)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **GRAD_TOL)


# ---------------------------------------------------------------------------------------------
# the spellings


def _compiled_and_eager(module, args, **options):
    """(compiled outputs, eager outputs, compiled grads, eager grads) of ``module(*args)``; grads of the float
    inputs that require grad and of the module's parameters, for a random output gradient."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + list(module.parameters())

    def run(fn):
        out = flat(fn(*args))
        g = torch.Generator().manual_seed(7)
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in out if o.is_floating_point())
        grads = torch.autograd.grad(loss, leaves) if leaves else ()
        return [o.detach() for o in out], grads

    got = run(torch.compile(module, backend="hyscale", options={"compiler": "eager", **options}))
    want = run(module)
    return got[0], want[0], got[1], want[1]


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("form", sorted(da.REWRITE))
def test_spelling_rewritten_equal_eager(form, padding):
    """Padded: batch 1's first queries see no key (SDPA gives 0, eager the mean of v)."""
    module, args = da.make(form, padding=padding, requires_grad=True)
    with report.collect() as reports:
        out, ref, grads, ref_grads = _compiled_and_eager(module, args)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten", site.reason
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **LOGITS_TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **GRAD_TOL)
    spec = da.REWRITE[form]
    assert ("mean of v" in site.reason) == (spec["empty"] == "mean")
    assert site.layout == ("grouped (4 query heads, 2 kv heads)" if spec.get("groups") else "per-head (MHA)")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mla_absorbed_and_per_head_fallback(attn):
    module, args = da.make_mla(attn, requires_grad=True)
    with report.collect() as reports:
        out, ref, grads, ref_grads = _compiled_and_eager(module, args)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.layout == "MLA latent (16 + 8, one row for 4 heads)"
    assert "absorbed into the queries and the output" in site.reason
    for a, b in zip(out + list(grads), ref + list(ref_grads)):
        torch.testing.assert_close(a, b, **GRAD_TOL)
    # a bias on the up-projection does not absorb: the per-head keys and values are gathered instead
    module, args = da.make_mla(attn, bias=True, requires_grad=True)
    with report.collect() as reports:
        out, ref, grads, ref_grads = _compiled_and_eager(module, args)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.layout == "per-head (MHA)" and "projection without bias" in site.reason
    for a, b in zip(out + list(grads), ref + list(ref_grads)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mla_recompute_latent_option(attn):
    """options["recompute_latent"]: the absorbed op is emitted without keeping o' (keep_latent False), said in the
    report; eager's values and gradients all the same."""
    module, args = da.make_mla(attn, requires_grad=True)
    emitted = []
    real = torch.ops.hyscale.sparse_attention_mla.default

    with report.collect() as reports:
        out, ref, grads, ref_grads = _compiled_and_eager(module, args, recompute_latent=True)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten" and "recomputed in the backward" in site.reason, site.reason
    for a, b in zip(out + list(grads), ref + list(ref_grads)):
        torch.testing.assert_close(a, b, **GRAD_TOL)

    def capture(gm, example_inputs):
        emitted.extend(n.args for n in gm.graph.nodes if n.target is real)
        return gm.forward

    from hyscale_compile import backend as backend_mod
    compiled = torch.compile(module, backend=lambda gm, ex: capture(*_passes_only(gm, ex, backend_mod)))
    compiled(*args)
    assert emitted and all(a[-1] is False for a in emitted), emitted


def _passes_only(gm, example_inputs, backend_mod):
    backend_mod.hyscale(gm, example_inputs, options={"compiler": "eager", "recompute_latent": True,
                                                     "attention": "always"})
    return gm, example_inputs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("keys,cache,latent", [
    ("buffer", None, True), ("cat", "first", True), ("buffer", "first", True), ("cat", "first_fp32", False),
    ("buffer", "past", False), ("written_through_alias", None, False)])
def test_mla_layout_follows_what_the_model_reads(attn, keys, cache, latent):
    """The latent layout where the attention's per-head keys and values are the expansion's values, also where
    something else still reads them (HF's cache up to transformers 5.17: an output of the graph, fed by a cat
    with an empty past); the per-head layout where they are not provably those values (a cat that promotes,
    earlier keys of a cache, a write through a view of the projection): always eager's values and gradients."""
    module, args = da.make_mla(attn, requires_grad=True, keys=keys, cache=cache)
    with report.collect() as reports:
        out, ref, grads, ref_grads = _compiled_and_eager(module, args)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten", site.reason
    assert site.layout.startswith("MLA latent") == latent, site.reason
    if latent:
        assert ("still built for the graph's output" in site.reason) == (cache == "first"), site.reason
    elif keys == "written_through_alias":
        assert "mul_" in site.reason and "latent layout would not see it" in site.reason, site.reason
    for a, b in zip(out + list(grads), ref + list(ref_grads)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def _captured(module, args):
    """(code before the attention pass, code after, attention reports) of each graph."""
    before, after, reports = [], [], []

    def backend(gm, example_inputs):
        selection.run(gm)
        before.append(gm.code)
        reports.extend(attention.run(gm))
        after.append(gm.code)
        return gm.forward

    torch.compile(module, backend=backend)(*args)
    return before, after, reports


@pytest.mark.parametrize("form", sorted(da.REJECT))
def test_rejected_spelling_is_untouched(form):
    module, args = da.make(form, padding=form == "deepseek_reference")
    before, after, reports = _captured(module, args)
    assert [r.decision for r in reports] == ["rejected"], [r.reason for r in reports]
    assert da.REJECT[form] in reports[0].reason, reports[0].reason
    assert before == after, "a rejected site must leave the graph byte-for-byte unchanged"
    assert counters["hyscale"]["attention_rejected"] == 1 and "attention_rewritten" not in counters["hyscale"]


def test_indices_written_before_the_attention_are_rejected():
    class Mutated(torch.nn.Module):
        def forward(self, q, k, v, score):
            idx = score.topk(4, dim=-1).indices
            mask = torch.ones(2, 6, 10, dtype=torch.bool).scatter(-1, idx, False)
            idx.zero_()  # the op would read the indices here, after the write
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None])

    _, args = da.make("sdpa_bool")
    _, _, reports = _captured(Mutated(), args)
    assert [r.decision for r in reports] == ["rejected"]
    assert "zero_" in reports[0].reason and "after it is made and before the attention" in reports[0].reason


# ---------------------------------------------------------------------------------------------
# what users see


def _inserted(module, args) -> str:
    """The compact projection of the nodes the attention pass inserted (goldens)."""
    kept = []

    def backend(gm, example_inputs):
        selection.run(gm)
        old = set(gm.graph.nodes)
        attention.run(gm)
        lines = compact(gm).splitlines()
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        kept.extend(line for n, line in zip(calls, lines) if n not in old)
        return gm.forward

    with torch.no_grad():
        compiled = torch.compile(module, backend=backend)
        compiled(**args) if isinstance(args, dict) else compiled(*args)
    return "\n".join(kept)


class GoldenGraphs(TestCase):
    def test_grouped_sdpa_with_padding(self):
        self.assertExpectedInline(_inserted(*da.make("sdpa_gqa", padding=True)), """\
.unsqueeze(in, 1)
.expand(.unsqueeze, 2, 6, 10)
.long(getitem)
.gather(.expand, -1, .long)
where(.gather, getitem, -1)
.transpose(in, 1, 2)
.transpose(in, 1, 2)
.transpose(in, 1, 2)
hyscale.sparse_attention(.transpose, .transpose, .transpose, where, 0.353553, True, 4, None, None, zero)
getitem(hyscale.sparse_attention, 0)
.transpose(getitem, 1, 2)
.contiguous(.transpose)""")

    def test_eager_mean_rows_in_training(self):
        module, args = da.make("eager", padding=True, requires_grad=True)
        self.assertExpectedInline(_inserted(module, args), """\
.unsqueeze(in, 1)
.expand(.unsqueeze, 2, 6, 10)
.long(.long)
.gather(.expand, -1, .long)
where(.gather, .long, -1)
.transpose(in, 1, 2)
.transpose(in, 1, 2)
.transpose(in, 1, 2)
hyscale.sparse_attention(.transpose, .transpose, .transpose, where, 0.353553, True, 4, None, None, mean)
getitem(hyscale.sparse_attention, 0)
getitem(hyscale.sparse_attention, 1)
hyscale.empty_rows_like_eager(getitem, .transpose, .transpose, .transpose, getitem, 0.353553)
.transpose(hyscale.empty_rows_like_eager, 1, 2)
.contiguous(.transpose)""")

    def test_hf_deepseek_v32_absorbed_mla(self):
        model, inputs = _hf_model("deepseek_v32", num_layers=1, padding=True)
        self.assertExpectedInline(_inserted(model, inputs), """\
.squeeze(getitem, 2)
.squeeze(.squeeze, 1)
.unsqueeze(.squeeze, 1)
.expand(.unsqueeze, 2, 16, 16)
.long(.long)
.gather(.expand, -1, .long)
where(.gather, .long, -1)
.transpose(cat, 1, 2)
.transpose(cat, 1, 2)
.transpose(cat, 1, 2)
cat([.transpose, .transpose], -1)
.view(in, 4, 32, 16)
hyscale.sparse_attention_mla(.transpose, cat, .view, where, 16, 0.204124, True, 0, None, None, zero, False)
getitem(hyscale.sparse_attention_mla, 0)""")


def test_explain_lists_attention_sites():
    model, inputs = _hf_model("glm_moe_dsa", attn_implementation="sdpa")
    with torch.no_grad():
        report_ = hyscale_compile.explain(model, **inputs)
    text = str(report_)
    assert text.splitlines()[0] == ("hyscale: 2 top-k sites, 2 rewritten, 0 left alone; "
                                    "3 attention sites, 3 rewritten, 0 left alone")
    assert "layout: MLA latent (16 + 8, one row for 4 heads)" in text
    sites = [s for s in report_.sites if s.kind == "attention"]
    assert len(sites) == 3 and all("modeling_glm_moe_dsa.py" in s.source for s in sites)
    assert sites[0].shapes["indices"] == "[2, 16, 8]" and sites[0].dense_scatter_bytes == 2 * 16 * 16
    assert "attention_sites" not in counters["hyscale"]  # explain does not count
    # the selection sites no longer claim their indices are scattered into a mask that is still built
    selections = [s for s in report_.sites if s.kind == "selection"]
    assert all("the attention pass no longer builds it" in s.reason for s in selections), selections[0].reason


def test_log_line_per_attention_site():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("hyscale")
    handler, old = Keep(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        module, args = da.make("sdpa_bool")
        torch.compile(module, backend="hyscale", options={"compiler": "eager"})(*args)
        module, args = da.make("wrong_polarity")
        torch.compile(module, backend="hyscale", options={"compiler": "eager"})(*args)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    info = [r.getMessage() for r in records if r.levelno == logging.INFO and " the attention at " in r.getMessage()]
    assert len(info) == 2, info
    assert info[0].startswith("hyscale: rewrote the attention at ") and "dsa_attention.py:" in info[0]
    assert "(k=4, mask: causal, layout: per-head (MHA))" in info[0]
    assert info[1].startswith("hyscale: left the attention at ") and "does not keep exactly the picked keys" in info[1]


def test_attention_option():
    module, args = da.make("sdpa_bool")
    torch.compile(module, backend="hyscale", options={"compiler": "eager", "attention": False})(*args)
    assert "attention_sites" not in counters["hyscale"]
    with pytest.raises(ValueError, match=r"options\['attention'\] must be True, False or 'always', got 'no'"):
        HyscaleOptions.parse({"attention": "no"})
    with pytest.raises(TypeError, match=r"options\['attention'\] must be True, False or 'always', got 1 \(int\)"):
        HyscaleOptions.parse({"attention": 1})


def test_debug_dir_dumps_the_attention_pass(tmp_path):
    module, args = da.make("sdpa_bool")
    torch.compile(module, backend="hyscale", options={"compiler": "eager", "debug_dir": str(tmp_path)})(*args)
    names = sorted(os.listdir(tmp_path))
    before = [n for n in names if "_attention_" in n and n.endswith("_before.py")]
    after = [n for n in names if "_attention_" in n and n.endswith("_after.py")]
    assert before and after
    assert "scatter" in (tmp_path / before[0]).read_text()
    assert "hyscale.sparse_attention" in (tmp_path / after[0]).read_text()


# ---------------------------------------------------------------------------------------------
# the order of the picks


class _UnsortedTopkAttention(torch.nn.Module):
    """sdpa_bool with the model's own topk(sorted=False): the mask reads the picks as a set."""

    def forward(self, q, k, v, score):
        idx = score.topk(4, dim=-1, sorted=False).indices
        Tq, Sk = q.shape[2], k.shape[2]
        causal = torch.arange(Sk)[None, :] <= torch.arange(Tq)[:, None] + (Sk - Tq)
        index_mask = torch.ones(q.shape[0], Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~index_mask[:, None])


def test_unordered_picks_are_ordered_where_the_sparse_op_reads_them():
    """The sparse op sums its picks in the order given, so an order that changes from run to run (the select's
    unsorted atomic appends, or whatever topk(sorted=False) returns) would make the model's output change with
    it: where the attention is rewritten the selection returns its picks sorted, and the reports say so."""
    _, args = da.make("sdpa_bool")
    _, graphs, reports = rewritten_with_attention(_UnsortedTopkAttention(), *args[:4])
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten" and "now returns its picks sorted" in site.reason, site.reason
    topks = [n for gm in graphs for n in gm.graph.nodes if "topk" in str(n.target)]
    assert topks and all(n.kwargs.get("sorted", n.args[4] if len(n.args) > 4 else True) is True for n in topks)

    model, inputs = _hf_model("deepseek_v32", attn_implementation="sdpa")
    counters.clear()
    with torch.no_grad(), report.collect() as reports:
        torch.compile(model, backend="hyscale", options={"compiler": "eager"})(**inputs)
    assert counters["hyscale"]["attention_rewritten"] == len(model.model.layers)
    assert counters["hyscale"]["selection_unsorted"] == 0, dict(counters["hyscale"])  # selected sorted after all
    chosen = [r for r in reports if r.kind != "attention" and r.rewritten]
    assert chosen and all("sums in their order: selected sorted" in r.reason for r in chosen), [r.reason for r in chosen]
