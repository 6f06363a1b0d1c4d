"""What one select call will do, decided once from its sizes: ``Plan``, and ``Tuning`` to override it.

Every rule here is a default measured on the H200; the measurements are in benchmarks/NOTES-selection.md
("Defaults and the measurements behind them"), under the name of the rule. The rules never change what
a call returns, only how fast: results are exact and bitwise the same under any plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .env import compiles_ptx, interpreting, multiprocessors
from .filter_append import APPEND_ATOMIC, APPEND_PTX, APPEND_RESERVED
from .final_pivots import lists_fit_rows
from .final_sort import SORT_MAX
from .problem import Problem, capturing, cdiv
from .reference import Visibility
from .score_tile import TileConfig

RESERVED_APPEND_MAX_HEADS = 32  # up to this many heads the filter reserves slots at any share (see append_kind)
# The table route (table_path.py) up to this size of the int64 composite table [R, S]: the table is then small
# enough that writing it and ranking it costs the device less than the pipeline's stages (a call captured into a
# CUDA graph pays no host work on replay: the device time decides). Past it the table is what the pipeline saves
# (benchmarks/NOTES-selection.md, "Defaults and the measurements behind them": table route). A captured call's
# graph keeps its table in its pool: up to 128 MiB, twice the plain path's fp32 table of the same call.
TABLE_MAX_BYTES = 128 << 20
# An uncaptured call pays its host work every time, and at these sizes that is most of it: the pipeline issues
# six launches and a few dozen torch ops, the table route two or three launches. So an uncaptured call takes the
# table route up to EAGER_TABLE_FACTOR times TABLE_MAX_BYTES, where writing the table still costs the device
# less than the pipeline's host work takes (NOTES-selection.md, "Defaults ...": table route).
EAGER_TABLE_FACTOR = 2
# The table route ranks its table with a ranker of its own (table_rank.py) instead of torch.topk and the values
# launch: on a decode step torch.topk over int64 is some 34 kernels of host work. Up to RANK_MAX_KEYS keys a row,
# one launch of one program a row ("row"); past that, where the rows are too few to fill the device (fewer than
# RANK_SPLIT_MAX_ROWS), the row's pass is split over programs ("split": three launches), faster on the device than
# one program a row and than torch.topk's passes (NOTES-selection.md, "Defaults ...": table ranker).
RANK_MAX_KEYS = 32768
RANK_SPLIT_MAX_ROWS = 128  # about the H200's 132 SMs: from there one program a row keeps them all busy
RANK_SPLIT = True  # False: torch.topk where the rules would split
RANKERS = ("topk", "row", "split")


@dataclass(frozen=True)
class Tuning:
    """Overrides of the default rules for one call (tests force recovery with them, benchmarks sweep
    them); None keeps the rule."""

    tile: TileConfig | None = None  # the tile shape and its launch options (default: score_tile.TILE)
    capacity: int | None = None  # candidate slots per row (a tiny one forces overflow -> recovery)
    target: int | None = None  # candidates aimed for per row (a tiny one forces too-few -> recovery)
    samples: int | None = None  # sample positions per query block
    programs: int | None = None  # programs to aim for per launch
    sample_split: int | None = None  # sampling programs per query block (default: one per two sample tiles)
    table: bool | None = None  # True: the table route, False: the pipeline (default: table_route's rule)
    ranker: str | None = None  # the table route's ranker, one of RANKERS (default: table_ranker's rule)


DEFAULT = Tuning()


@dataclass(frozen=True)
class Plan:
    """Sizes and launch choices of one select call (``make_plan``)."""

    k: int
    target: int  # candidates aimed for per row
    capacity: int  # candidate slots per row (C); k more after them hold the out-of-range extras
    samples: int  # sample positions per query block (M)
    sampled: bool  # whether any row's context passes the capacity (else no sampling, no threshold)
    programs: int  # programs to aim for per launch
    sample_split: int  # sampling programs per query block
    filter_split: int  # key splits per query block of the filter
    append: int  # the filter's append (APPEND_*)
    asm: bool  # the appends' steps in PTX (not under the interpreter)
    filter_options: dict  # the filter's launch options beyond its tile's
    row_lists: bool  # the final select keeps its lists in the rows' unused slots
    table: bool = False  # the table route (table_path.py) instead of the pipeline: the fields above go unused
    ranker: str = "topk"  # on the table route, what ranks the table: torch.topk, or table_rank.py's "row" / "split"

    @property
    def width(self) -> int:
        """Slots of a row buffer: the candidates, then the extras."""
        return self.capacity + self.k


def sizes(k: int, S: int, tuning: Tuning = DEFAULT) -> tuple[int, int, int]:
    """(target, capacity, samples): aim for 3k + 1024 candidates, room for 1.5x that plus slack."""
    target = tuning.target if tuning.target is not None else 3 * k + 1024
    cap = tuning.capacity if tuning.capacity is not None else ((3 * target) // 2 + 1024 + 63) // 64 * 64
    cap = max(1, min(cap, S))
    m = tuning.samples if tuning.samples is not None else min(max(4096, S // 128), 8192)
    return target, cap, max(1, min(m, S))


def make_plan(pb: Problem, k: int, tuning: Tuning = DEFAULT) -> Plan:
    table = table_route(pb.rows, pb.S, tuning, captured=capturing(pb.device))
    target, cap, M = sizes(k, pb.S, tuning)
    programs = device_programs(pb.device, tuning)
    append, asm = append_kind(pb.tile, pb.S, pb.H, cap, asm=compiles_ptx())
    return Plan(k=k, target=target, capacity=cap, samples=M, sampled=pb.S > cap, programs=programs,
                sample_split=tuning.sample_split or cdiv(M, 2 * pb.tile.bs),
                filter_split=filter_split(pb, programs), append=append, asm=asm,
                # the table route runs no filter: its descriptors are not even built
                filter_options={} if table else filter_options(pb.tile, bool(pb.descriptors), append, asm),
                row_lists=row_lists(k, pb.S, target, cap, pb.vis), table=table)


@functools.lru_cache(maxsize=64)  # Plans are frozen; a decode step asks for the same one every call
def table_plan(k: int, ranker: str = "topk") -> Plan:
    """The plan of a call that takes the table route, which reads k and the ranker alone: what ``select`` runs
    (make_plan's pipeline sizes and launch choices would be host work for nothing on a decode step; benchmarks
    and tests that run pipeline stages on such sizes still get them from make_plan)."""
    return Plan(k=k, target=0, capacity=0, samples=0, sampled=False, programs=0, sample_split=0, filter_split=0,
                append=0, asm=False, filter_options={}, row_lists=False, table=True, ranker=ranker)


def table_ranker(k: int, rows: int, S: int, tuning: Tuning = DEFAULT) -> str:
    """What ranks a table-route call's table of ``rows`` rows of S keys (one of RANKERS): where its in-register sort
    holds the k winners, table_rank.py's one program a row up to RANK_MAX_KEYS keys or from RANK_SPLIT_MAX_ROWS
    rows, its split pass for fewer, longer rows (with RANK_SPLIT); else torch.topk. Not under the interpreter by
    default, where its sorts are slow: tests there ask for a ranker with a tuning's ``ranker``."""
    if tuning.ranker is not None:
        if tuning.ranker not in RANKERS:
            raise ValueError(f"Tuning.ranker: {tuning.ranker!r} is none of {RANKERS}")
        if tuning.ranker != "topk" and k > SORT_MAX:
            raise ValueError(f"Tuning.ranker: {tuning.ranker!r} sorts at most {SORT_MAX} winners, k is {k}")
        return tuning.ranker
    if k > SORT_MAX or interpreting():
        return "topk"
    if S <= RANK_MAX_KEYS or rows >= RANK_SPLIT_MAX_ROWS:
        return "row"
    return "split" if RANK_SPLIT else "topk"


def table_route(rows: int, S: int, tuning: Tuning = DEFAULT, *, captured: bool) -> bool:
    """Whether a call of ``rows`` query rows over S keys writes its composite table and runs torch.topk
    (table_path.py) instead of the pipeline: where that int64 table [rows, S] takes at most
    TABLE_MAX_BYTES in a call being ``captured`` into a CUDA graph, EAGER_TABLE_FACTOR times that in one
    that is not: decode steps and other small calls (the pipeline's promise never to write the table is about
    the tables that matter: large ones). A tuning's ``table`` forces either route."""
    if tuning.table is not None:
        return tuning.table
    return rows * S * 8 <= TABLE_MAX_BYTES * (1 if captured else EAGER_TABLE_FACTOR)


def device_programs(device: torch.device, tuning: Tuning = DEFAULT) -> int:
    """Programs to aim for per launch: four per SM (two on the CPU, where the interpreter runs them in turn)."""
    if tuning.programs is not None:
        return tuning.programs
    return 4 * multiprocessors(device) if device.type == "cuda" else 2


def filter_split(pb: Problem, programs: int) -> int:
    """Key splits per query block: enough to fill the device, and at least 32 so that the programs in
    flight together cover few query blocks (their q stays in L2 even at H=64)."""
    return max(1, min(cdiv(pb.S, pb.tile.bs), max(32, cdiv(programs, pb.n_tblk * pb.B))))


def append_kind(tile: TileConfig, S: int, H: int, cap: int, asm: bool) -> tuple[int, bool]:
    """(append, asm): the tile's append (filter_append's APPEND_*), or by default the reserved one
    unless the heads are many and few entries pass (about cap / 1.5 of a row's S keys). The reserved
    append costs every entry the same few instructions; the per-entry one is a compare and a skipped
    branch for an entry that fails, and a wait on its atomic for one that passes, which a short tile
    (few heads) cannot hide. Measured, the reserved one wins up to 32 heads at any share of passing
    keys, and wherever many pass; at 64 heads with few passing the two are even, so the per-entry one
    stays there (benchmarks/NOTES-selection.md, "Defaults and the measurements behind them": append
    rule). The PTX steps only where there is PTX (asm): the PTX per-entry append becomes the portable
    atomic one under the interpreter, the reserved one its triton twin. The reserved append needs BS
    of 32 to 256 and, in PTX, a thread for each quarter of a row at most (BT * 4 >= threads): inline
    PTX runs once per copy of an element."""
    a = tile.append
    if a is None:
        a = APPEND_RESERVED if cap * 16 >= S or H <= RESERVED_APPEND_MAX_HEADS else APPEND_PTX
    if a == APPEND_RESERVED and (tile.bs not in (32, 64, 128, 256) or (asm and tile.bt * 4 < 32 * tile.warps)):
        a = APPEND_PTX
    return int(APPEND_ATOMIC if a == APPEND_PTX and not asm else a), asm


def filter_options(tile: TileConfig, descriptors: bool, append: int, asm: bool) -> dict:
    """Launch options of the filter where its tile leaves them to us: q and kx by descriptor, no append,
    register cap or extra stages asked for, at most 64 accumulator registers a thread. Both PTX appends
    are capped at 168 registers: three tiles in flight per SM instead of two, faster than uncapped and
    than a third pipeline stage (benchmarks/NOTES-selection.md, "Defaults and the measurements behind
    them": filter registers). Launch options only: the bits do not change."""
    if not asm or not descriptors or tile.append is not None or tile.maxnreg or tile.stages != 2:
        return {}  # measured with descriptors only; pointer loads need more registers
    if tile.bt * tile.bs > 64 * 32 * tile.warps:
        return {}
    return dict(maxnreg=168) if append in (APPEND_PTX, APPEND_RESERVED) else {}


def row_lists(k: int, S: int, target: int, cap: int, vis: Visibility) -> bool:
    """Whether the final select keeps its lists in the rows' unused slots (no scratch memory): only
    where every row's context passes the C slots, so that the threshold cut it to about ``target``
    of them. A row of a shorter context keeps every key and may fill its slots (a causal prefill's
    first C rows, windows): with many such rows the pool would run out and they would select over
    their whole buffers, so those calls keep a scratch list per program. Known without looking at
    the device: no windows, and a causal offset (none per batch) past C."""
    if S <= cap or vis.starts is not None or vis.ends is not None:
        return False
    if vis.causal and (vis.offsets is not None or vis.offset + 1 <= cap):  # row 0 sees offset + 1 keys
        return False
    return lists_fit_rows(k, cap + k, cap - target)

