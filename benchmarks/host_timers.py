"""Host time spent inside named runtime entries while a block runs: the entries, wrapped with timers.

    with host_timers([(hytopk, "select", "select"), ...]) as totals:
        ...                      # totals[label]: seconds spent inside that entry, summed over its calls

The wrappers cost a little each call, so time the whole call in runs of its own. Nested entries count in
each of them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


@contextlib.contextmanager
def host_timers(entries: list[tuple[object, str, str]]) -> Iterator[dict[str, float]]:
    """Replace each ``module.name`` of ``entries`` (module, name, label) by a timed wrapper for the block."""
    totals: dict[str, float] = {}
    originals = [(mod, name, getattr(mod, name)) for mod, name, _ in entries]

    def wrap(label, fn):
        def inner(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0

        return inner

    for (mod, name, label), (_, _, fn) in zip(entries, originals):
        setattr(mod, name, wrap(label, fn))
    try:
        yield totals
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
