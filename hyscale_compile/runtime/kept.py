"""A bounded cache of host work a decode step repeats every call (checks that passed, ranges, launch constants).

A leaf module (it imports nothing of ours): the operator's checks and the runtime's Problem share it.
"""

from __future__ import annotations


def kept(cache: dict, key: tuple, make, limit: int):
    """cache[key], made on a miss (a ``make`` that raises keeps nothing); the oldest entry goes past ``limit``
    (decode steps grow the offset by one a call: the newest are the ones asked for again)."""
    got = cache.get(key)
    if got is None:
        got = make()
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = got
    return got
