"""What users read: counters, explain(), the command line, debug dumps and structured-trace artifacts."""

from __future__ import annotations

import importlib
import logging
import os

import indexers
import pytest
import torch
from torch._dynamo.utils import counters

import hyscale_compile


def test_counters_and_explain_fields():
    torch.manual_seed(0)
    model, args = indexers.deepseek_v32()
    report = hyscale_compile.explain(model, *args)
    (site,) = report.sites
    assert site.decision == "rewritten" and site.k == "4"
    assert site.mask_kind == "causal (additive)"
    assert site.source.endswith("(forward)") and "indexers.py" in site.source
    assert site.shapes["q"] == f"[{indexers.B}, {indexers.T}, {indexers.H}, {indexers.D}]"
    # the [B, T, S] fp32 table plus the [B, T, H, S] per-head table
    B, T, H, S = indexers.B, indexers.T, indexers.H, indexers.S
    assert site.table_bytes_avoided == 4 * B * T * S * (1 + H)
    assert "1 rewritten" in str(report)
    counters.clear()
    torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args)
    assert counters["hyscale"]["selection_rewritten"] == 1 and counters["hyscale"]["selection_sites"] == 1


def test_explain_reports_rejections_with_reasons():
    model, args = indexers.dense_warmup()
    report = hyscale_compile.explain(model, *args)
    assert [s.decision for s in report.rejected] == ["rejected"]
    assert "log_softmax" in report.rejected[0].reason
    assert "left alone" in str(report)


def test_command_line(capsys):
    explain_module = importlib.import_module("hyscale_compile.explain")  # the package exports the function
    assert explain_module.main(["indexers:weighted_sum"]) == 0
    out = capsys.readouterr().out
    assert "rewritten" in out and "causal" in out


def test_debug_dir_dumps_before_and_after(tmp_path):
    model, args = indexers.glm_dsa()
    torch.compile(model, backend="hyscale", options={"debug_dir": str(tmp_path), "compiler": "eager"})(*args)
    names = sorted(os.listdir(tmp_path))
    before = [n for n in names if n.endswith("_before.py")]
    after = [n for n in names if n.endswith("_after.py")]
    assert before and after
    assert "topk" in (tmp_path / before[0]).read_text()
    assert "hyscale.select" in (tmp_path / after[0]).read_text()


def test_structured_trace_artifacts():
    from torch._logging._internal import trace_log

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, old_level = Keep(), trace_log.level
    trace_log.addHandler(handler)
    trace_log.setLevel(logging.DEBUG)
    try:
        model, args = indexers.weighted_sum()
        torch.compile(model, backend="hyscale", options={"compiler": "eager"})(*args)
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(old_level)
    text = "\n".join(str(r.msg) + str(getattr(r, "metadata", "")) for r in records)
    assert "hyscale_selection_before_graph" in text and "hyscale_selection_after_graph" in text


def test_report_counts_the_dense_mask_the_model_scatters_indices_into():
    pytest.importorskip("transformers")
    from models import hf

    model, inputs = hf.tiny_deepseek_v32(seq_len=16, batch=2)
    with torch.no_grad():
        report = hyscale_compile.explain(model, **inputs)
    site = report.rewritten[0]
    assert site.dense_scatter_bytes == 2 * 16 * 16  # HF's bool [B, T, S] index mask
    assert "scattered into a dense 512 B mask" in site.reason
    # new_ones(...).scatter(-1, idx.long(), False): only the set of indices matters, but the sparse attention
    # that replaces the mask sums the picks in their order, so they are selected sorted after all
    assert "sums in their order: selected sorted" in site.reason
