"""Sizes of the final select's pivots and lists: host rules, no kernels.

A row's pivots are two ranks of a strided sample of its buffer, MARGIN_SD standard deviations of the
sample rank either side of the k-th; the entries between them go to a list (the program's scratch,
the row's own unused slots, or a list of a shared pool), sized from the expected count between.
"""

from __future__ import annotations

import functools
import math

SAMPLE = 512  # sample entries per row for the pivots
MARGIN_SD = 4.5  # pivot ranks this many standard deviations of the sample rank away from the k-th


def _ranks_between(i_hi: int, i_lo: int, S: int) -> int:
    """Sample ranks from just below the hi pivot to the lo pivot, clipped to the sample (a rank outside
    [0, S) means no pivot there): each stands for W / S slots of the row."""
    return min(i_lo, S - 1) - max(i_hi, -1)


@functools.lru_cache(maxsize=256)  # a pure function of sizes, asked a few times per call
def pivot_ranks(k: int, W: int, S: int = SAMPLE) -> tuple[int, int, int]:
    """(i_hi, i_lo, cap): sample ranks (descending, 0-based) of the pivots and the scratch list size.

    About k*S/W of the S sampled slots hold an entry >= the row's k-th (empty slots rank lowest),
    with standard deviation sqrt(S p (1 - p)), p = k/W; the pivots sit MARGIN_SD of those (plus a
    repeat of a short row) away on either side. Ranks outside [0, S) mean "no pivot there". The list
    gets twice the expected count of entries between the pivots (that count varies by about
    1/sqrt(ranks between) of itself).
    """
    p = k / W
    margin = math.ceil(MARGIN_SD * math.sqrt(S * p * (1 - p)) + S / W) + 1  # S/W: a short row repeats in the sample
    i_hi = math.floor(k * S / W) - 1 - margin
    i_lo = math.ceil(k * S / W) - 1 + margin
    between = _ranks_between(i_hi, i_lo, S) * W / S
    return i_hi, i_lo, max(1, min(W, int(2 * between) + 64))


@functools.lru_cache(maxsize=256)
def list_room(k: int, W: int, S: int = SAMPLE) -> int:
    """Unused slots a row needs to hold its own list: the expected count between the pivots and three
    of its standard deviations (it varies by about 1/sqrt(ranks between) of itself)."""
    i_hi, i_lo, _ = pivot_ranks(k, W, S)
    ranks = max(1, _ranks_between(i_hi, i_lo, S))
    between = ranks * W / S
    return math.ceil(between + 3 * between / math.sqrt(ranks)) + 64


def lists_fit_rows(k: int, W: int, room: int, S: int = SAMPLE) -> bool:
    """Whether rows with about ``room`` unused candidate slots (the typical row) can hold their own
    lists (row_lists); a row with less than ``list_room`` takes a list from the pool."""
    return room >= list_room(k, W, S)


def pool_lists(R: int) -> int:
    """Lists of the pool for rows short of room, which with row_lists chosen by ``plan.row_lists``
    come from the spread of the threshold alone: one for every 16 rows. Each such row without a pool
    list selects over its whole buffer, slower (benchmarks/NOTES-selection.md, "Defaults and the
    measurements behind them": pool lists)."""
    return max(16, R // 16)
