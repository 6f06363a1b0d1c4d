"""HyTopK runtime statistics, kept as device tensors so the hot path never waits for the host.

HyTopK's check kernel adds to the per-device ``counters`` on the device (CUDA-graph safe once
allocated); ``read`` copies them to the host on demand (that one call synchronizes). They count the
pipeline's calls: a call on the table route (table_path.py: small calls) runs no check and adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FALLBACK_ROWS = 64  # past this many flagged rows in one call, a call counts as a fallback

_counters: dict[torch.device, Tensor] = {}
# slots: calls, rows, rows flagged (recovered), fallback calls, candidates kept (sum over rows)
_CALLS, _ROWS, _RECOVERED, _FALLBACKS, _CANDIDATES = range(5)


@dataclass(frozen=True)
class Stats:
    calls: int
    rows: int
    rows_recovered: int
    fallbacks: int
    mean_candidates: float


def counters(device: torch.device) -> Tensor:
    """The device's int64 counters, in slot order (calls, rows, recovered, fallbacks, candidates):
    HyTopK's check kernel adds each select call to them on the device."""
    if device not in _counters:
        _counters[device] = torch.zeros(5, dtype=torch.int64, device=device)
    return _counters[device]


def read(device: torch.device | str | None = None) -> Stats:
    """Totals since the last reset, for one device (default: summed over every device seen)."""
    devs = list(_counters) if device is None else [_normal(torch.device(device))]
    tot = [0] * 5
    for d in devs:
        if d in _counters:
            for i, v in enumerate(_counters[d].tolist()):
                tot[i] += v
    rows = tot[_ROWS]
    return Stats(calls=tot[_CALLS], rows=rows, rows_recovered=tot[_RECOVERED], fallbacks=tot[_FALLBACKS],
                 mean_candidates=tot[_CANDIDATES] / rows if rows else 0.0)


def _normal(d: torch.device) -> torch.device:
    """'cuda' means the current CUDA device, as tensors name it ('cuda:0')."""
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def reset() -> None:
    for c in _counters.values():
        c.zero_()
