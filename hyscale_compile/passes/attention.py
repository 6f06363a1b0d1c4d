"""The attention pass: dense attention under a scattered top-k mask becomes ``hyscale.sparse_attention``.

DSA models (HF DeepSeek-V3.2, GLM-MoE-DSA) scatter each query's selected key positions into a dense [B, T, S]
mask, combine it with the causal / padding mask, and run dense attention over all S keys. For every such
scatter of a Dynamo graph and of the checkpoint bodies it calls (run after the selection pass, so the indices
are usually ``hyscale.select``'s):

  1. the site: the indices' origin, the mask nodes, the attention (``attention_sites``);
  2. what the mask means, evaluated rather than matched, and what the op needs to compute the same attention,
     rows without a visible pick included (``attention_masks``); that nothing changes what the op reads
     between the mask's construction and the attention;
  3. the rewrite, in the latent MLA layout where the model's structure allows it (``attention_mla``), else on
     the model's per-head q, k, v (``attention_rewrite``).

A site that fails any step is left exactly as it was, and its report says why. Counters: ``attention_sites``,
``attention_rewritten``, ``attention_rejected``.
"""

from __future__ import annotations

import os

import torch
from torch import fx
from torch._dynamo.utils import counters

from . import attention_cost as cost_
from . import attention_masks as masks_
from . import attention_rewrite as rewrite_
from . import attention_sites as sites_
from . import debug, inplace, regions, selection
from .attention_mla import NotLatent, match
from .graph_ops import (
    Aliases,
    arg,
    dtype,
    first_write,
    grad_enabled_at,
    mutates,
    op_name,
    requires_grad,
    shape,
    source_line,
    value,
    written_by,
)
from .index_expr import Reject
from .report import SiteReport, human_bytes, record, symbolic_bytes
from .sites import describe

# Tests set HYSCALE_STRICT=1 so that an internal error fails loudly instead of skipping the site.
STRICT = os.environ.get("HYSCALE_STRICT", "0") == "1"


def _graph_modules(gm: fx.GraphModule):
    """The graph and every subgraph module it owns (checkpoint bodies, other higher-order op bodies)."""
    for name, mod in gm.named_modules():
        if isinstance(mod, fx.GraphModule):
            yield (name or "graph"), mod


def run(gm: fx.GraphModule, debug_dir: str | None = None, always: bool | None = None,
        keep_latent: bool = True) -> list[SiteReport]:
    """Rewrite every provable attention site of ``gm`` and its subgraphs where the op is estimated faster than
    the model's attention (``attention_cost``), or every provable one with ``always`` (None: the default,
    ``HYSCALE_ATTENTION``); one report per site. ``keep_latent`` False: absorbed MLA sites recompute their latent
    output o' in the backward instead of keeping it (options["recompute_latent"])."""
    always = cost_.always() if always is None else always
    reports: list[SiteReport] = []
    dumping = bool(debug_dir) or debug.tracing()
    links = regions.links(gm)
    for name, sub in list(_graph_modules(gm)):
        before = sub.print_readable(print_output=False) if dumping else ""
        found = sites_.candidates(sub.graph)
        for node in found:
            if node.graph is sub.graph and node in sub.graph.nodes:
                reports.append(_run_site(sub, name, node, always, keep_latent, links))
        if dumping and found:
            debug.dump(name, before, sub, debug_dir, pass_name="attention")
    if any(r.decision == "rewritten" for r in reports):  # a site's selection may sit in another graph (its order)
        for _, sub in _graph_modules(gm):
            sub.graph.lint()
            sub.recompile()
    return reports


def _run_site(gm: fx.GraphModule, graph_name: str, scatter: fx.Node, always: bool = False,
              keep_latent: bool = True, links: regions.Links | None = None) -> SiteReport:
    report = SiteReport(graph=graph_name, node=scatter.name, source=source_line(scatter), decision="rejected",
                        reason="", kind="attention")
    undo = _functionalize_scatter(gm.graph, scatter)
    try:
        consumer = sites_.consumer(scatter)
        if consumer is not None:  # ``m += causal``, ``full(-inf).triu_(1)``: read in-place updates of fresh tensors
            undo = _chain(undo, inplace.functionalize_ancestors(gm.graph, consumer))
        site = find(scatter, links)
        report.k = str(site.k)
        _describe(report, site)
        plan = masks_.plan(site)
        report.mask_kind = plan.kind
        _check_gain(site)
        latent, why_not = _latent(site)
        check_no_mutation_between(site, plan)
        check_no_mutation_across(site)
        check_grad_mode(site)
        estimate = _check_pays(site, latent, always, why_not)
        layout, notes = _layout(site, latent), _notes(site, plan, latent, why_not)
        notes.append(estimate)
        if latent is not None and not keep_latent:
            notes.append("o' (the per-head latent output) recomputed in the backward, not kept "
                         "(options['recompute_latent'])")
        rewrite_.rewrite(gm, site, plan, latent, keep_latent)
        notes.extend(_order_the_picks(site.origin))
        report.decision, report.layout, report.reason = "rewritten", layout, "; ".join(notes)
    except Exception as err:  # a Reject, or a bug of ours, which must never break the user's compile
        undo()
        if not isinstance(err, Reject) and STRICT:
            raise
        report.reason = err.reason if isinstance(err, Reject) else (
            f"hyscale internal error, site left alone (please report): {type(err).__name__}: {err}")
    record(report)
    return report


def _order_the_picks(origin: fx.Node) -> list[str]:
    """Make the selection feeding a rewritten site return its picks in a reproducible order.

    The dense mask reads the indices as a set, so the selection pass may have asked hyscale.select for them
    unsorted (in the order of the filter's atomic appends, which changes from run to run), and a model may ask
    for sorted=False itself (torch.topk, indexer_topk, the op). The sparse op sums its picks in the order given:
    in that order's rounding, so unordered picks would make a deterministic model's output change from run to
    run. The sorted order is one of the orders a sorted=False top-k may return, so asking for it changes nothing
    else the graph reads."""
    if origin.target in (torch.ops.hyscale.select.default, torch.ops.hyscale.select):
        where, words = _SELECT_SORTED, "the selection now returns its picks sorted"
    elif op_name(origin) == "topk":
        where, words = _TOPK_SORTED, "the model's topk(sorted=False) now returns its picks sorted"
    else:
        return []
    if not _set_true(origin, *where):
        return []
    report = origin.meta.pop(selection.UNSORTED_REPORT, None)
    if report is not None:  # the selection pass counted it unsorted and said so
        counters["hyscale"]["selection_unsorted"] -= 1
        report.reason = report.reason.replace(selection.UNSORTED_NOTE, _SORTED_AFTER_ALL)
    return [f"{words} (the sparse op's sums follow their order)"]


# (position in the call's arguments, keyword) of the sorted flag: hyscale::select's schema, torch.topk's
_SELECT_SORTED, _TOPK_SORTED = (14, "sorted"), (4, "sorted")
_SORTED_AFTER_ALL = ("only the set of indices is read (a constant scattered at them), but the sparse attention "
                     "reading them sums in their order: selected sorted")


def _set_true(node: fx.Node, position: int, keyword: str) -> bool:
    """Set a call's flag to True, by keyword or position as the call passes it; whether it was False."""
    if keyword in node.kwargs:
        if node.kwargs[keyword] is not False:
            return False
        node.kwargs = {**node.kwargs, keyword: True}
        return True
    if len(node.args) > position:
        if node.args[position] is not False:
            return False
        node.args = (*node.args[:position], True, *node.args[position + 1:])
        return True
    return False  # the default: sorted


def _chain(first: inplace.Undo, second: inplace.Undo) -> inplace.Undo:
    """One undo for two rewrites: the later one is undone first."""
    return inplace.Undo(first.targets + second.targets, first.args + second.args)


def find(scatter: fx.Node, links: regions.Links | None = None) -> sites_.Site:
    """The site of an index-mask scatter (Reject when it is not one the op can replace); ``links`` lets the
    indices come from a top-k in another checkpointed region."""
    base = scatter.args[0]
    fill = sites_.constant_fill(base) if op_name(base) in sites_.CONSTANT_TENSORS else None
    if fill is None or not sites_.same_shape(shape(base), shape(scatter)):
        raise Reject("the indices are scattered into a tensor that is not filled with one constant (new_ones, full, "
                     "zeros ...)", scatter)
    picked = sites_.scalar(arg(scatter, 3, "value", scatter.kwargs.get("src")))
    dim = arg(scatter, 1, "dim")
    if not isinstance(dim, int) or dim not in (-1, len(shape(scatter)) - 1):
        raise Reject("the indices are scattered along another dim than the keys (the last)", scatter)
    index = arg(scatter, 2, "index")
    chain, consumer = sites_.mask_chain(scatter)
    if op_name(consumer) == "sdpa":
        attention = sites_.sdpa(consumer, scatter)
    else:
        attention = sites_.eager(consumer, chain, scatter)
        chain.discard(consumer)
    S = shape(attention.k)[2]
    origin, k, crossed = sites_.index_origin(index, S, scatter, links)
    site = sites_.Site(scatter, base, index, origin, picked, fill, k, sites_.shape_of(index), chain, attention,
                       crossed)
    _check_chain_writes(site)
    return site


def _check_chain_writes(site: sites_.Site) -> None:
    """An in-place mask operation (``m += causal``, ``scores += index_mask``) may write only a mask intermediate or
    the attention's own scores: a tensor the model reads elsewhere would lose the write with the rewrite."""
    att = site.attention
    own = site.chain | {att.logits} | set(att.nodes)
    for n in site.chain:
        _, inplace_ = sites_.mask_op(n)
        if inplace_ and n.args[0] not in own:
            raise Reject(f"{describe(n)} at {source_line(n)} writes the mask into {n.args[0].name} in place, which "
                         "the model reads elsewhere", site.scatter)
        if inplace_ and any(u not in own and u is not att.node for u in n.args[0].users if u is not n):
            raise Reject(f"{n.args[0].name} is written in place by the mask arithmetic and read elsewhere",
                         site.scatter)


def _functionalize_scatter(graph: fx.Graph, scatter: fx.Node) -> inplace.Undo:
    """``m = full(-inf); m.scatter_(-1, idx, 0); scores + m``: read the later reads of ``m`` as reads of the scatter,
    an out-of-place one, when ``m`` is a fresh constant tensor nothing read before (undone on reject)."""
    undo = inplace.Undo()
    if scatter.target != "scatter_":
        return undo
    base = scatter.args[0]
    order = {n: i for i, n in enumerate(graph.nodes)}
    if op_name(base) not in sites_.CONSTANT_TENSORS or any(order[u] < order[scatter] for u in base.users):
        return undo
    undo.targets.append((scatter, scatter.target))
    scatter.target = "scatter"
    for u in [u for u in base.users if u is not scatter and order[u] > order[scatter]]:
        undo.args.append((u, u.args, u.kwargs))
        u.args = fx.node.map_arg(u.args, lambda x: scatter if x is base else x)
        u.kwargs = fx.node.map_arg(u.kwargs, lambda x: scatter if x is base else x)
    return undo


# ---------------------------------------------------------------------------------------------
# legality beyond the mask


def check_no_mutation_between(site: sites_.Site, plan: masks_.MaskPlan) -> None:
    """Nothing may write in place (any spelling: ``x.mul_``, ``x[i] = v``, ``x += 1``, ``torch._foreach_add_``,
    ``out=``, a module call) a tensor the pass reads, or one sharing its memory, where that would change what the
    op computes:

    * what the pass reads by its construction (the q.k^T product, its scale and casts; the mask expression, its
      constants and the model's masks; the index mask and the indices, whose top-k origin makes them distinct):
      from where it is made up to the attention, since a write would change the value the pass inferred;
    * what the op reads as a value at the attention, where the model read it earlier: eager's q and k (read by
      the q.k^T product), keys and values read under HF's ``repeat_kv`` (read where repeated): from the model's
      read up to the attention.

    The latent layout reads more (``latent_write``)."""
    att = site.attention
    reads = [(x, x) for x in (*plan.nodes, site.base, *att.nodes, *_index_chain(site))]
    for x, at in ((att.q, att.product or att.node), (att.k, att.product or att.node), (att.v, att.node)):
        peeled, n = sites_.peel_repeat_kv(x)
        reads.append((peeled, x.args[0].args[0]) if n > 1 else (x, at))
    found = _write_between(site, reads, set(site.chain))
    if found is not None:
        n, x, at = found
        # x read from its construction (a causal mask's arange comparison, a constant): a write anywhere after it
        # is made changes what the model reads, not what the pass inferred
        when = "after it is made" if at is x else "after the model read it"
        raise Reject(f"{describe(n)} at {source_line(n)} may change {x.name} {when} and before the attention, where "
                     "the op would read it as it was", site.scatter)


def check_no_mutation_across(site: sites_.Site) -> None:
    """Indices from a top-k in another graph (a checkpointed region's body or its caller): nothing in a graph they
    pass through may write them, or a tensor sharing their memory, anywhere in it. Stricter than within the
    site's graph, where only writes before the attention count: a caller's write after the region's call would
    change what the backward's recomputation of the region reads."""
    for x in site.crossed:
        n = first_write(x.graph, [x])
        if n is not None:
            raise Reject(f"{describe(n)} at {source_line(n)} may change the indices ({x.name}) on their way from the "
                         "top-k into the checkpointed region of the attention, where the op would read them as the "
                         "top-k made them", site.scatter)


def check_grad_mode(site: sites_.Site) -> None:
    """The op runs where the attention's product with v does, in its grad mode, and sends q and k the gradient of
    the scores wherever they require it; eager's autograd only where every step from the q.k^T product to that
    product ran with grad enabled. A step under ``torch.no_grad()`` (the logits, the mask arithmetic on them, the
    softmax) cuts q's and k's gradient there, which the op would carry through. (SDPA is one call; an attention
    under no_grad gives no gradient either way.)"""
    att = site.attention
    if att.kind != "eager" or not grad_enabled_at(att.node) or not any(
            requires_grad(x) for x in (att.q, att.k)):
        return
    steps, todo = set(att.nodes), [att.logits]
    while todo:  # the mask arithmetic the scores go through on their way to the softmax
        for u in todo.pop().users:
            if u in site.chain and u not in steps:
                steps.add(u)
                todo.append(u)
    for n in site.scatter.graph.nodes:
        if n in steps and not grad_enabled_at(n):
            raise Reject(f"{describe(n)} at {source_line(n)} runs under torch.no_grad(), which cuts the gradient of q "
                         "and k in eager's attention, and the op, run where the product with v is, with grad enabled, "
                         "would carry it through", site.scatter)


def latent_write(site: sites_.Site, latent) -> str | None:
    """Why the latent layout would not compute what the model does, or None: the op reads the latent, rope key and
    up-projection at the attention where the model read them at the expansion, and computes from them what the
    model reads from its per-head keys and values; nothing may write either (any view) in between."""
    order = {n: i for i, n in enumerate(site.scatter.graph.nodes)}
    reads = [(x, min(x.users, key=order.get)) for x in (latent.weight, latent.latent, latent.rope)]
    reads += [(x, x) for x in latent.built]
    found = _write_between(site, reads, {*site.chain, *latent.copies})
    if found is None:
        return None
    n, x, _ = found
    return (f"{describe(n)} at {source_line(n)} may change {x.name} between the expansion and the attention, where "
            "the latent layout would not see it")


def _write_between(site: sites_.Site, reads, skip: set) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(a node that may write x, x, at) for the first write, before the attention, to a tensor x of reads (x, at)
    after its read at ``at``; None if there is none."""
    graph = site.scatter.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    aliases = Aliases(graph)
    end = order[site.attention.node]
    for n in graph.nodes:
        if order[n] >= end:
            break
        if not mutates(n) or n in skip:
            continue
        targets = written_by(n)
        for x, at in reads:
            if isinstance(x, fx.Node) and order[n] > order[at] and (
                    targets is None or any(aliases.may_alias(t, x) for t in targets)):
                return n, x, at
    return None


def _index_chain(site: sites_.Site) -> list[fx.Node]:
    """The indices from the selection to the scatter (through casts)."""
    chain, n = [], site.index
    while isinstance(n, fx.Node) and n is not site.origin and len(chain) < 32:
        chain.append(n)
        n = n.args[0] if n.args else None
    return chain


def _check_gain(site: sites_.Site) -> None:
    """k >= S: every key is picked, and the sparse op would gather all S keys per query where dense attention
    runs one pass over them: nothing to gain, the site stays dense (the model is unchanged)."""
    k, S = site.k, shape(site.attention.k)[2]
    if isinstance(k, int) and isinstance(S, int) and k >= S:
        raise Reject(f"nothing to gain: k={k} picks per query of S={S} keys select every key, and dense attention "
                     "reads each key once where a sparse one gathers them per query; attention is left dense",
                     site.scatter)


def _cost_shape(site: sites_.Site, latent) -> cost_.Shape | None:
    """The site's sizes for the estimate (None when one is symbolic with no traced size)."""
    att = site.attention
    q, k, v = shape(att.q), shape(att.k), shape(att.v)
    if q is None or k is None or v is None or not len(q) == len(k) == len(v) == 4:
        return None
    B, H, T, Dqk = (cost_.size_hint(x) for x in q)
    S, Dv, K = cost_.size_hint(k[2]), cost_.size_hint(v[3]), cost_.size_hint(site.k)
    if None in (B, H, T, Dqk, S, Dv, K):
        return None
    # as AOT autograd decides whether to build a backward: grad mode at compile time (Dynamo guards on it) and
    # an operand that requires grad
    training = torch.is_grad_enabled() and any(getattr(value(x), "requires_grad", True) for x in (att.q, att.k, att.v))
    common = dict(B=B, T=T, S=S, H=H, k=K, itemsize=att.dtype.itemsize, training=training, eager=att.kind == "eager",
                  dense_Dqk=Dqk, dense_Dv=Dv)
    if latent is not None:  # the rope dim is a size of the model's input: symbolic under dynamic=True
        Dc, Dr = cost_.size_hint(latent.Dc), cost_.size_hint(latent.Dr)
        if Dc is None or Dr is None:
            return None
        return cost_.Shape(**common, G=1, Dqk=Dc + Dr, Dv=Dc, aliased=True)
    _, n = sites_.peel_repeat_kv(att.k)
    G = cost_.size_hint(k[1]) if n == 1 else H // n
    if G is None:
        return None
    return cost_.Shape(**common, G=G, Dqk=Dqk, Dv=Dv, aliased=False)


def _check_pays(site: sites_.Site, latent, always: bool, why_not: str | None = None) -> str:
    """Leave the attention dense where the op is estimated slower than the model's (``attention_cost``); the
    estimate in words for the report (a rejection says why an MLA site was estimated in the per-head layout)."""
    s = _cost_shape(site, latent)
    if s is None:
        if always:
            return "no estimate (a size is not known): rewritten as options['attention'] is 'always'"
        raise Reject("the attention's sizes are not all known (symbolic with no traced value), so whether the sparse "
                     "op is faster than the model's dense attention cannot be estimated; options['attention'] = "
                     "'always' rewrites it anyway", site.scatter)
    faster, words = cost_.pays(s)
    if faster:
        return words
    if always:
        return words + ": not faster, rewritten as options['attention'] is 'always'"
    layout = f" in the per-head layout (the MLA up-projection is not absorbed: {why_not})" if why_not else ""
    raise Reject(f"not faster: {words}{layout}; the attention is left dense (options['attention'] = 'always' "
                 "rewrites it anyway, e.g. for the memory of the dense masks)", site.scatter)


def _latent(site: sites_.Site):
    att = site.attention
    if att.dtype != dtype(att.q):
        return None, (f"the attention runs under autocast in {att.dtype}, and the absorbed projections would run "
                      "in another precision than the model's")
    try:
        latent = match(att)
    except NotLatent as err:
        return None, str(err)
    why_not = latent_write(site, latent)
    return (None, why_not) if why_not else (latent, None)


# ---------------------------------------------------------------------------------------------
# the report


def _fmt(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]" if s is not None else "?"


def _describe(report: SiteReport, site: sites_.Site) -> None:
    att = site.attention
    report.shapes = {"q": _fmt(shape(att.q)), "k": _fmt(shape(att.k)), "v": _fmt(shape(att.v)),
                     "indices": _fmt(site.index_shape), "attention": f"{att.kind} at {source_line(att.node)}",
                     "selection": source_line(site.origin)}
    mask = shape(site.scatter)
    b = symbolic_bytes(*mask) if mask is not None else None
    report.dense_scatter_bytes = b * dtype(site.scatter).itemsize if b is not None else None


def _layout(site: sites_.Site, latent) -> str:
    if latent is not None:
        return f"MLA latent ({latent.Dc} + {latent.Dr}, one row for {latent.H} heads)"
    _, n = sites_.peel_repeat_kv(site.attention.k)
    H, G = shape(site.attention.q)[1], shape(site.attention.k)[1]
    return "per-head (MHA)" if n == 1 and G == H else f"grouped ({H} query heads, {G if n == 1 else H // n} kv heads)"


def _notes(site: sites_.Site, plan: masks_.MaskPlan, latent, why_not: str | None) -> list[str]:
    att = site.attention
    notes = [f"{att.kind} attention at {source_line(att.node)} reads the k={site.k} picks of each query instead of "
             f"all {shape(att.k)[2]} keys"]
    if site.scatter is not None and shape(site.scatter) is not None:
        b = symbolic_bytes(*shape(site.scatter))
        if b is not None:
            notes.append(f"the dense index mask ({human_bytes(b * dtype(site.scatter).itemsize)}) and its combination "
                         "with the model's mask are no longer built")
    notes.extend(plan.notes)
    if att.dtype != dtype(att.q):
        notes.append(f"the attention runs under autocast: q, k and v are cast to {att.dtype} for the op, as autocast "
                     "casts them for the model's attention")
    if latent is not None:
        Dk = latent.Dn + latent.Dr
        built = (f"are still built for {', '.join(latent.kept_for)}" if latent.kept_for else
                 "are not expanded")
        notes.append(f"the key/value up-projection is absorbed into the queries and the output (MLA latent layout): "
                     f"per-head keys [{latent.H}, S, {Dk}] and values [{latent.H}, S, {latent.Dv}] {built}; "
                     "the scores are the same sums in another order (equal up to rounding)")
    elif why_not:
        notes.append(f"the MLA up-projection is not absorbed ({why_not}): the per-head keys and values are gathered")
    if _additive(site):
        notes.append("NaN or infinite scores at keys a query does not pick no longer reach its row (the model's "
                     "additive mask would carry them)")
    return notes


def _additive(site: sites_.Site) -> bool:
    return dtype(site.attention.mask) != torch.bool



_STILL_BUILT = "(that mask is still built)"


def amend_selection_reports(selection: list[SiteReport], attention: list[SiteReport]) -> None:
    """A selection report says the model still scatters its indices into a dense mask; where every attention that
    mask fed was rewritten, it is no longer built: say so (the selection pass runs first and cannot know)."""
    by_source: dict[str, list[SiteReport]] = {}
    for r in attention:
        if r.shapes and "selection" in r.shapes:
            by_source.setdefault(r.shapes["selection"], []).append(r)
    for r in selection:
        sites = by_source.get(r.source)
        if r.rewritten and sites and all(s.rewritten for s in sites) and _STILL_BUILT in r.reason:
            r.reason = r.reason.replace(_STILL_BUILT, "(the attention pass no longer builds it: "
                                        "hyscale.sparse_attention reads the indices)")
