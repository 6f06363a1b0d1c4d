"""The selection pass: find every top-k over an indexer score, prove the rewrite legal, rewrite it.

For each ``topk`` (or descending ``sort`` / ``argsort`` sliced to k) of a Dynamo graph and of the
checkpoint bodies it calls:
  1. the site and its readers (``sites``), and its input read as an index expression (``index_expr``);
  2. the proof that ``hyscale.select`` computes the same values, indices and gradients (``legality``);
  3. the rewrite onto the model's own q, k, weights and masks (``rewrite``, masks by ``masks``).
A site that fails any step is left exactly as it was, and its report says why.
"""

from __future__ import annotations

import os

import torch
from torch import fx
from torch._dynamo.utils import counters

from . import debug, inplace, legality, masks, rewrite, sites
from .graph_ops import dtype, named_arg, op_name, shape, source_line
from .index_expr import Reject, Score, dim_size, interpret
from .report import SiteReport, human_bytes, input_name, record, symbolic_bytes

# Tests set HYSCALE_STRICT=1 so that an internal error fails loudly instead of skipping the site.
STRICT = os.environ.get("HYSCALE_STRICT", "0") == "1"


def run(gm: fx.GraphModule, debug_dir: str | None = None) -> list[SiteReport]:
    """Rewrite every provable site in ``gm`` and its subgraphs; return one report per top-k site."""
    reports: list[SiteReport] = []
    dumping = bool(debug_dir) or debug.tracing()
    for name, sub in _graph_modules(gm):
        before = sub.print_readable(print_output=False) if dumping else ""
        found = [n for n in sub.graph.nodes if op_name(n) in sites.SELECTIONS]
        for node in found:
            if node.graph is sub.graph and (op_name(node) == "topk" or _sorted_descending(node)):
                reports.append(_run_site(sub, name, node))
        if any(r.decision == "rewritten" and r.graph == name for r in reports):
            sub.graph.lint()
            sub.recompile()
        if dumping:
            debug.dump(name, before, sub, debug_dir)
    return reports


def _sorted_descending(node: fx.Node) -> bool:
    """Only a descending sort can be a top-k: an ascending one is not a selection site at all."""
    return bool(named_arg(node, "descending", False))


def _graph_modules(gm: fx.GraphModule):
    """The graph and every subgraph module it owns (checkpoint bodies, other higher-order op bodies)."""
    for name, mod in gm.named_modules():
        if isinstance(mod, fx.GraphModule):
            yield (name or "graph"), mod


def _run_site(gm: fx.GraphModule, graph_name: str, node: fx.Node) -> SiteReport:
    report = SiteReport(graph=graph_name, node=node.name, source=source_line(node), decision="rejected", reason="")
    undo = inplace.functionalize_ancestors(gm.graph, node)
    try:
        site = sites.find(node)
        report.k = str(site.k)
        sc = interpret(site.score_node, site.s_dim)
        _describe(report, site, sc)
        report.dense_scatter_bytes = sites.dense_scatter_bytes(site)
        plan = masks.plan(sc)
        report.mask_kind = plan.kind
        metadata_readers = legality.check_readers(site, sc)
        legality.check_no_mutation_between(site, sc)
        legality.check_gathered_indices(site)
        legality.check_grad_mode(site)
        legality.check_additive_order(sc, site.topk, [b for b in sc.bias if not any(b is p for p in plan.bias)])
        cuts = legality.gradient_cuts(sc, site.score_node)
        # The op's unsorted order is that of atomic appends (not reproducible), so a model's own
        # sorted=False is not taken at its word: only a site where no order can matter goes unsorted.
        unsort = sites.order_free(site)
        site.sorted = not unsort
        rewrite.rewrite(gm, site, sc, plan, cuts, metadata_readers)
        report.decision = "rewritten"
        report.reason = "; ".join(_notes(site, sc, plan, report, unsort, cuts)) or "indexer form proven"
        if unsort:
            counters["hyscale"]["selection_unsorted"] += 1
            site.select.meta[UNSORTED_REPORT] = report  # the attention pass may ask for the sort after all
    except Reject as err:
        undo()
        report.reason = err.reason
        if err.graph_input is not None:
            report.graph_input = input_name(err.graph_input)
    except Exception as err:  # a bug of ours must never break the user's compile: leave the site alone
        undo()
        if STRICT:
            raise
        report.reason = f"hyscale internal error, site left alone (please report): {type(err).__name__}: {err}"
    record(report)
    return report


# The meta key under which an unsorted select keeps its report (counted in ``selection_unsorted``), and the
# report's words for it: the attention pass amends both where it makes the select sort (passes/attention.py).
UNSORTED_REPORT = "hyscale_unsorted_report"
UNSORTED_NOTE = "only the set of indices is read (a constant scattered at them): selected without the final sort"


def forget_reports(gm: torch.fx.GraphModule) -> None:
    """Drop the reports kept in the selects' meta once the passes are done (the compiled graph needs none)."""
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            for node in mod.graph.nodes:
                node.meta.pop(UNSORTED_REPORT, None)


def _notes(site: sites.Site, sc: Score, plan: masks.MaskPlan, report: SiteReport, unsort: bool,
           cuts: set[int]) -> list[str]:
    """What a user should know about a rewritten site."""
    notes = list(plan.notes)
    low = [dtype(n) for n in sc.nodes if dtype(n) in (torch.bfloat16, torch.float16)]
    if low:
        notes.append(f"the model computes part of the score in {low[0]}; selection ranks the exact fp32 score, "
                     "so near-ties its rounding would make may be picked differently")
    if any(id(leaf) in cuts and legality.requires_grad(leaf.node) for leaf in (sc.q, sc.k, *sc.weights)):
        notes.append("inputs the model detaches (or scores under no_grad) get no gradient from the selection, "
                     "as in eager")
    if report.dense_scatter_bytes:
        dense = human_bytes(report.dense_scatter_bytes)
        notes.append(f"the selected indices are then scattered into a dense {dense} mask by the model's own code "
                     "(that mask is still built)")
    if unsort:
        notes.append(UNSORTED_NOTE)
    return notes


def _describe(report: SiteReport, site: sites.Site, sc: Score) -> None:
    q, k = shape(sc.q.node), shape(sc.k.node)
    report.shapes = {"q": _fmt(q), "kx": _fmt(k), "score": _fmt(shape(site.score_node))}
    if sc.weights:
        report.shapes["weights"] = _fmt(shape(sc.weights[0].node))
    score_elems = symbolic_bytes(*shape(site.score_node))
    if score_elems is not None:
        avoided = score_elems * 4
        if sc.head is not None:
            head_size = dim_size(sc, sc.head)
            per_head = symbolic_bytes(score_elems, head_size) if head_size is not None else None
            avoided += (per_head or 0) * 4
        report.table_bytes_avoided = avoided


def _fmt(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]" if s is not None else "?"
