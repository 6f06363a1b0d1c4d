"""HyTopK: exact top-k selection that never writes the score table (docs/design.md, section 4).

Small calls (a composite table of at most plan.TABLE_MAX_BYTES, more where no CUDA graph captures the
call: decode steps) take the table route instead: one kernel writes the table with the same score bits,
torch.topk ranks it (table_path.py); what they would save is less than the pipeline's fixed launches cost.
The pipeline, for the rest:

    sample     -> per row, keys of M evenly spaced positions of its range       (sample.py)
    threshold  -> the ceil(target*m/ctx)-th best sample; writes the row's extras (sample.py)
    filter     -> score tiles on chip, append entries >= threshold             (filter.py, filter_append.py)
                  (only those above it on a tie row: see sample.py)
    ties       -> a tie row's lowest-position entries equal to its threshold    (ties.py)
    check      -> flag rows whose buffer overflowed or may miss part of the top-k, and note which
                  rows' extras can rank at all                                  (check.py)
    recovery   -> flagged rows: radix select over recomputed scores              (recover.py)
    select     -> top-k of each row buffer by the unique (value, position) composite
                                                                                 (final_select.py, final_sort.py)

A ``Problem`` holds the call's operands, a ``Plan`` its sizes and launch choices (decided once);
every stage takes both. Every stage runs on the device and nothing reads a count on the host, so a
call never synchronizes and can be captured in a CUDA graph. Results are exact: a row's buffer
holds every entry of its range that beats the threshold and those that tie it (on a tie row, the
lowest-position ones that can still rank), plus its k lowest out-of-range positions (value ``fill``);
a row is flagged whenever that set might not contain its top k.

Recovery and the "full path" past 64 flagged rows are one mechanism: groups of 64 flagged rows
are work items of the same radix-select launches, whose programs read the flagged count on the
device. Up to 64 rows is one group; more rows are more groups (slower, still exact, still no
sync); ``stats`` counts such a call as a fallback. A ``plan.Tuning`` can shrink the buffer or the
target so that tests force both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import table_path
from .check import check
from .env import interpreting
from .filter import filter_rows
from .final_select import select_composites, select_rows, select_rows_reference
from .final_sort import decode, sort_width
from .plan import DEFAULT, Plan, Tuning, make_plan, table_plan, table_ranker, table_route
from .problem import Problem, capturing
from .recover import recover
from .reference import Visibility
from .rescore import rescore
from .sample import Thresholds, sample, sample_threshold, threshold
from .ties import fill_ties

# The entries (select, rescore) and, for benchmarks and tests that time or check one stage, the stages
# and what they take: one surface, so that no caller needs the kernel modules behind it.
__all__ = ["select", "rescore", "candidates", "Problem", "Plan", "Tuning", "make_plan", "sample", "threshold",
           "sample_threshold", "Thresholds", "filter_rows", "fill_ties", "select_rows"]


def select(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, scale: float, relu: bool,
           vis: Visibility, fill: float, sorted: bool = True, *, tuning: Tuning = DEFAULT) -> tuple[Tensor, Tensor]:
    """Exact top-k per query row, same contract as reference.select; sorted=False returns the same
    entries per row without the final sort, in an unspecified order: the order of the filter's atomic
    appends (on the table route, torch.topk's), which may differ from run to run (the pass asks for it
    only where no order can matter).
    ``tuning`` overrides the plan's rules (tests and tuning runs)."""
    B, T = q.shape[0], q.shape[1]
    if k == 0 or B * T == 0:
        return (torch.empty(B, T, k, dtype=torch.float32, device=q.device),
                torch.empty(B, T, k, dtype=torch.int64, device=q.device))
    pb = Problem(q, kx, weights, scale, relu, vis, fill, tuning.tile)
    table = table_route(pb.rows, pb.S, tuning, captured=capturing(pb.device))
    plan = table_plan(k, table_ranker(k, pb.rows, pb.S, tuning)) if table else make_plan(pb, k, tuning)
    if plan.table:  # a small problem: its composite table and torch.topk (table_path.py)
        return table_path.select(pb, plan, sorted)
    buf, used = candidates(pb, plan)
    if interpreting() and sorted:
        # the interpreter runs the final kernel too slowly for whole-select tests; tests/kernels/
        # test_final_select.py checks it against this reference bit for bit. The unsorted order is the
        # kernel's own (no reference gives it), so sorted=False runs the kernel under the interpreter too.
        values, indices = select_rows_reference(buf, k, used)
    elif sorted and sort_width(k) == 0:  # past the in-kernel sort: free the buffer before torch.sort
        comp, _ = select_composites(buf, k, used=used, row_lists=plan.row_lists)
        del buf
        values, indices = decode(torch.sort(comp, dim=1, descending=True).values)
    else:
        values, indices = select_rows(buf, k, used, sorted=sorted, row_lists=plan.row_lists)
    return values.view(B, T, k), indices.view(B, T, k)


def candidates(pb: Problem, plan: Plan) -> tuple[Tensor, tuple[Tensor, int, Tensor]]:
    """Row buffers [R, C + k] of raw entries that contain each row's exact top k (all stages but the
    last), and which of their slots can hold part of it: (int32 [R] counts, C, int32 [R] tail), the first
    counts[r] of the C candidate slots and the first tail[r] of the k slots past them; the rest is garbage."""
    buf, thr = sample_threshold(pb, plan)
    cnt = filter_rows(pb, plan, thr.filter_key, buf)
    fill_ties(pb, plan, thr, cnt, buf)
    used, tail, rows, nflag = check(pb, plan, cnt, thr.key)
    recover(pb, plan, nflag, rows, buf)
    return buf, (used, plan.capacity, tail)

