"""What the selection pass decided at each top-k site, in words a user can act on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch


@dataclass
class SiteReport:
    graph: str  # which compiled graph (Dynamo frame / checkpoint body)
    node: str  # the top-k node's name in that graph
    source: str  # user file:line of the top-k call
    decision: str  # "rewritten" or "rejected"
    reason: str  # why it was rejected, or what was assumed when rewritten
    k: str = "?"
    shapes: dict | None = None  # q, kx, weights, score (symbolic sizes as strings)
    mask_kind: str = "none"  # none | causal(offset) | window | mask tensor | additive tensor | combinations
    table_bytes_avoided: int | None = None  # bytes of the [T, S] (and [T, H, S]) tables no longer written
    dense_scatter_bytes: int | None = None  # bytes of dense tensors the model scatters the indices into

    def as_dict(self) -> dict:
        return asdict(self)


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

    counters["hyscale"]["selection_sites"] += 1
    counters["hyscale"]["selection_" + report.decision] += 1
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


def format_table(reports: list[SiteReport]) -> str:
    if not reports:
        return "hyscale: no top-k site found"
    rows = [("site", "decision", "k", "mask", "table avoided", "reason")]
    for r in reports:
        avoided = "-" if r.table_bytes_avoided is None else human_bytes(r.table_bytes_avoided)
        rows.append((r.source, r.decision, r.k, r.mask_kind, avoided if r.decision == "rewritten" else "-",
                     r.reason))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + str(row[-1]))
    rewritten = sum(r.decision == "rewritten" for r in reports)
    lines.append(f"hyscale: {len(reports)} top-k sites, {rewritten} rewritten, {len(reports) - rewritten} left alone")
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
