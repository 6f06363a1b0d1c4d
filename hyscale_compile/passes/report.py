"""What the passes decided at each site, in words a user can act on: counters, the ``hyscale`` log, the
structured-trace table and the text of ``explain()``.

A pass calls ``record`` once per site (counters, ``explain()``'s collection); the backend calls ``publish``
once per compiled graph, after the pass (log lines, the ``hyscale_sites`` trace artifact).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

# TORCH_LOGS="hyscale" enables this logger at INFO, "+hyscale" at DEBUG (see the top-level ``hyscale`` module).
log = logging.getLogger("hyscale")


@dataclass
class SiteReport:
    graph: str  # which compiled graph (Dynamo frame / checkpoint body)
    node: str  # the top-k node's name in that graph
    source: str  # user file:line of the top-k call, then the function: "/abs/model.py:12 (forward)"
    decision: str  # "rewritten" or "rejected"
    reason: str  # why it was rejected, or what was assumed when rewritten ("; "-separated notes)
    k: str = "?"
    shapes: dict | None = None  # q, kx, weights, score (symbolic sizes as strings)
    mask_kind: str = "none"  # none | causal(offset) | window | mask tensor | additive tensor | combinations
    table_bytes_avoided: int | None = None  # bytes of the [T, S] (and [T, H, S]) tables no longer written
    dense_scatter_bytes: int | None = None  # bytes of dense tensors the model scatters the indices into
    # Which pass the site belongs to; also the prefix of its counters ("selection_sites", ...).
    kind: str = "selection"
    # The user's name of the graph input the score is read from, when the score is computed outside this
    # graph (the pass sees no score computation to rewrite). None when the score is computed in the graph.
    graph_input: str | None = None
    # "file:line" of the graph break after which this graph starts, when graph_input is set and Dynamo broke
    # the user's function before the top-k (filled in by ``annotate_graph_inputs`` from ``source``).
    graph_break: str | None = None
    # Attention sites: the layout the op runs in ("MLA latent (...)", "per-head (MHA)", "grouped (...)").
    layout: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def rewritten(self) -> bool:
        return self.decision == "rewritten"


_sinks: list[list[SiteReport]] = []


@contextlib.contextmanager
def collect() -> Iterator[list[SiteReport]]:
    """Collect the reports of every site the pass sees inside the block."""
    sink: list[SiteReport] = []
    _sinks.append(sink)
    try:
        yield sink
    finally:
        _sinks.remove(sink)


def record(report: SiteReport) -> None:
    from torch._dynamo.utils import counters

    counters["hyscale"][f"{report.kind}_sites"] += 1
    counters["hyscale"][f"{report.kind}_{report.decision}"] += 1
    for sink in _sinks:
        sink.append(report)
    history.append(report)
    del history[:-1000]  # bounded: keep the latest sites only


history: list[SiteReport] = []  # every site seen in this process (latest 1000)


def symbolic_bytes(*sizes) -> int | None:
    """Product of sizes in bytes when they are known numbers (a hint for symbolic sizes), else None."""
    total = 1
    for s in sizes:
        if isinstance(s, torch.SymInt):
            s = s.node.hint
        if not isinstance(s, int):
            return None
        total *= s
    return total


# ---------------------------------------------------------------------------------------------
# graph inputs and graph breaks

_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<func>.+)_at_(?P<line>\d+)$")
_SOURCE = re.compile(r"^(?P<file>.*):(?P<line>\d+) \((?P<func>[^()]*)\)$")


def _unresume(func: str) -> tuple[str, int | None]:
    """('forward', 5) for Dynamo's 'torch_dynamo_resume_in_forward_at_5': the function, and the line of the
    latest graph break in it (None when ``func`` is not a resume function)."""
    m = _RESUME.match(func)
    if not m:
        return func, None
    inner, _ = _unresume(m["func"])
    return inner, int(m["line"])


def graph_break_of(source: str) -> str | None:
    """'file:line' of the graph break Dynamo resumed after, when ``source`` lies in a resume function."""
    m = _SOURCE.match(source)
    if not m:
        return None
    _, line = _unresume(m["func"])
    return None if line is None else f"{m['file']}:{line}"


def input_name(placeholder: torch.fx.Node) -> str:
    """The user's name of a Dynamo graph input: ``scores`` for ``L['scores']``, ``self.w`` for a module's."""
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    try:
        name = source.name() if callable(getattr(source, "name", None)) else str(source.name)
    except Exception:  # a source kind without a name: fall back to the placeholder's
        name = None
    if not name:
        return str(placeholder.target)
    name = re.sub(r"^L\['([^']+)'\]", r"\1", name)
    name = re.sub(r"\._modules\['([^']+)'\]", r".\1", name)
    return re.sub(r"\['([A-Za-z_]\w*)'\]", r".\1", name)


def annotate_graph_inputs(gm: torch.fx.GraphModule, reports: list[SiteReport]) -> None:
    """Fill ``graph_input`` (where the pass did not) for sites that select straight from a graph input, and
    ``graph_break`` for every site with a graph input whose graph is Dynamo's resume after a break."""
    modules = dict(gm.named_modules())
    for r in reports:
        if r.graph_input is None:
            sub = modules.get("" if r.graph == "graph" else r.graph)
            graph = getattr(sub, "graph", None)
            node = next((n for n in graph.nodes if n.name == r.node), None) if graph is not None else None
            score = node.args[0] if node is not None and node.args else None
            if isinstance(score, torch.fx.Node) and score.op == "placeholder":
                r.graph_input = input_name(score)
        if r.graph_input is not None and r.graph_break is None:
            r.graph_break = graph_break_of(r.source)


# ---------------------------------------------------------------------------------------------
# what users read


# explain()'s top-level caller, the one frame of a stack trace that is ours: Dynamo keeps it when it drops the
# user's frames (code without a source file: exec, a REPL), and then it is no user source line.
EXPLAIN_FILE = "<hyscale_compile.explain>"
_EXPLAIN_FRAME = re.compile(re.escape(EXPLAIN_FILE) + r":\d+ \([^()]*\)")


def scrub(text: str) -> str:
    """``text`` with explain()'s own frame shown as the unknown source it stands for."""
    return _EXPLAIN_FRAME.sub("<unknown>", text) if EXPLAIN_FILE in text else text


def shown(text: str) -> str:
    """A path or a sentence as shown to users: paths under the current directory relative to it, and
    Dynamo's resume functions by the user's own function name."""
    text = scrub(text)
    cwd = os.getcwd()
    if cwd != os.sep:
        text = text.replace(cwd + os.sep, "")
    return re.sub(r"\btorch_dynamo_resume_in_\w+_at_\d+\b", lambda m: _unresume(m[0])[0], text)


def notes(r: SiteReport) -> list[str]:
    """The reason, and what the user can do about a graph input."""
    out = [shown(r.reason)] if r.reason else []
    if r.graph_input is not None:
        if r.graph_break is not None:
            out.append(f"the score reaches this graph as its input `{r.graph_input}` because Dynamo broke the "
                       f"graph at {shown(r.graph_break)}; remove that graph break (TORCH_LOGS=\"graph_breaks\" "
                       "says why it happened) so that the score is computed in the same graph as the top-k")
        else:
            out.append(f"the score is computed outside the compiled code and passed in as `{r.graph_input}`; "
                       "compile the function that computes it as well")
    return out


_WHAT = {"selection": "top-k", "attention": "attention"}


def _what(r: SiteReport) -> str:
    return _WHAT.get(r.kind, r.kind)


def _facts(r: SiteReport) -> str:
    parts = [f"k={r.k}"]
    if r.rewritten and r.mask_kind != "none":
        parts.append(f"mask: {r.mask_kind}")
    if r.rewritten and r.layout:
        parts.append(f"layout: {r.layout}")
    if r.rewritten and r.table_bytes_avoided:
        parts.append(f"score tables not written: {human_bytes(r.table_bytes_avoided)} per call")
    return ", ".join(parts)


def headline(r: SiteReport) -> str:
    """One line per site: the INFO line of TORCH_LOGS="hyscale"."""
    where = shown(r.source)
    if r.rewritten:
        return f"rewrote the {_what(r)} at {where} ({_facts(r)})"
    return f"left the {_what(r)} at {where} alone: " + "; ".join(notes(r))


def details(r: SiteReport) -> str:
    """The DEBUG lines of TORCH_LOGS="+hyscale": everything ``explain()`` knows about the site."""
    shapes = ", ".join(f"{k} {v}" for k, v in (r.shapes or {}).items()) or "unknown"
    lines = [f"  graph {r.graph!r}, node {r.node!r}; {_facts(r)}; shapes: {shapes}; mask: {r.mask_kind}"]
    if r.dense_scatter_bytes:
        lines.append(f"  dense tensors the model scatters the indices into: {human_bytes(r.dense_scatter_bytes)}")
    lines.extend(f"  - {n}" for n in notes(r))
    return "\n".join(lines)


def summary(reports: list[SiteReport]) -> str:
    """"hyscale: 2 top-k sites, 2 rewritten, 0 left alone; 3 attention sites, 3 rewritten, 0 left alone"."""
    kinds = list(dict.fromkeys(r.kind for r in reports)) or ["selection"]
    parts = []
    for kind in kinds:
        of = [r for r in reports if r.kind == kind]
        rewritten = sum(r.rewritten for r in of)
        what = _WHAT.get(kind, kind)
        parts.append(f"{len(of)} {what} site{'s' if len(of) != 1 else ''}, {rewritten} rewritten, "
                     f"{len(of) - rewritten} left alone")
    return "hyscale: " + "; ".join(parts)


def format_table(reports: list[SiteReport]) -> str:
    """The text of ``explain()``: a summary line, then each site with its decision, facts and reasons."""
    if not reports:
        return "hyscale: no top-k or attention site found"
    lines = [summary(reports)]
    for r in reports:
        lines.append(f"{'rewritten ' if r.rewritten else 'left alone'}  {shown(r.source)}  ({_facts(r)})")
        for n in notes(r):
            lines.extend(textwrap.wrap(n, width=110, initial_indent="  - ", subsequent_indent="    ",
                                       break_on_hyphens=False))
    return "\n".join(lines)


def publish(gm: torch.fx.GraphModule, reports: list[SiteReport]) -> None:
    """After a pass over one Dynamo graph: log each site, and put the table into the structured trace."""
    annotate_graph_inputs(gm, reports)
    for r in reports:
        log.info("hyscale: %s", headline(r))
        log.debug("hyscale: %s site %s:\n%s", _what(r), shown(r.source), details(r))
    if reports:
        log.debug("%s in this graph", summary(reports))
        from torch._logging import trace_structured

        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "hyscale_sites", "encoding": "json"},
            payload_fn=lambda: [r.as_dict() for r in reports],
        )


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
