"""HyTopK: exact top-k selection that never writes the score table (shared design notes, section 4).

    sample     -> per row, keys of M evenly spaced positions of its range       (sample_kernel)
    threshold  -> the ceil(target*m/ctx)-th best sample; writes the row's extras (threshold_kernel)
    filter     -> score tiles on chip, append composites >= threshold            (block_kernel)
    check      -> flag rows whose buffer overflowed or may miss part of the top-k, and note which
                  rows' extras can rank at all                                  (check_kernel)
    recovery   -> flagged rows: radix select over recomputed scores              (recover_kernel)
    select     -> top-k of each row buffer by the unique (value, position) composite (final_select)

Every stage runs on the device and nothing reads a count on the host, so a call never
synchronizes and can be captured in a CUDA graph. Results are exact: a row's buffer holds every
entry of its range that ties or beats the threshold, plus its k lowest out-of-range positions
(value ``fill``); a row is flagged whenever that set might not contain its top k.

Recovery and the "full path" past 64 flagged rows are one mechanism: groups of 64 flagged rows
are work items of the same radix-select launches, whose programs read the flagged count on the
device. Up to 64 rows is one group; more rows are more groups (slower, still exact, still no
sync); ``stats`` counts such a call as a fallback. Knobs (``knobs``) shrink the buffer or the
target so tests can force both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from . import score_tile, stats
from .check_kernels import check_block, check_kernel, check_warps
from .env import interpreting
from .filter_kernels import (
    MODE_FILTER,
    block_kernel,
    cdiv,
    rescore_kernel,
    rescore_tile_kernel,
    sample_kernel,
    threshold_kernel,
)
from .final_select import decode, lists_fit_rows, select_composites, select_rows, select_rows_reference, sort_width
from .reference import Visibility, order_key
from .score_tile import act_kind, block_d, precision, tma_views
from .select_kernels import PASSES, recover_kernel


@dataclass
class Knobs:
    """Overrides for tests and tuning; None means the default rule."""

    capacity: int | None = None  # candidate slots per row (a tiny one forces overflow -> recovery)
    target: int | None = None  # candidates aimed for per row (a tiny one forces too-few -> recovery)
    samples: int | None = None  # sample positions per query block
    programs: int | None = None  # programs to aim for per launch
    sample_split: int | None = None  # sampling programs per query block (default: one per two sample tiles)
    rescore_tile: bool = False  # rescore through whole score tiles (slow cross-check of the row kernel)


knobs = Knobs()


@contextlib.contextmanager
def override(**changes) -> Iterator[Knobs]:
    """Set some knobs inside a block (tests force recovery with a tiny capacity this way)."""
    old = {name: getattr(knobs, name) for name in changes}
    for name, v in changes.items():
        setattr(knobs, name, v)
    try:
        yield knobs
    finally:
        for name, v in old.items():
            setattr(knobs, name, v)


def sizes(k: int, S: int) -> tuple[int, int, int]:
    """(target, capacity, samples): aim for 3k + 1024 candidates, room for 1.5x that plus slack."""
    target = knobs.target if knobs.target is not None else 3 * k + 1024
    cap = knobs.capacity if knobs.capacity is not None else ((3 * target) // 2 + 1024 + 63) // 64 * 64
    cap = max(1, min(cap, S))
    m = knobs.samples if knobs.samples is not None else min(max(4096, S // 128), 8192)
    return target, cap, max(1, min(m, S))


def _programs(device: torch.device) -> int:
    if knobs.programs is not None:
        return knobs.programs
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _unit_last(x: Tensor) -> Tensor:
    """Kernels take any strides but a unit last one (broadcast views stay views)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _heads_in_int32(x: Tensor) -> Tensor:
    """The kernels form head offsets h * head_stride in int32: a layout with heads far apart (a q
    stored [B, H, T, D] and viewed [B, T, H, D] at a long context) is made contiguous instead."""
    return x.contiguous() if x.shape[2] * x.stride(2) >= 2**31 else x


def _operands(q: Tensor, kx: Tensor, weights: Tensor | None,
              scale: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """One dtype for q and kx (16-bit widened to fp32 is exact); fp32 weights with the scale folded in."""
    dt = torch.promote_types(q.dtype, kx.dtype)
    w = None if weights is None else _heads_in_int32(weights.float() * scale)
    return _heads_in_int32(_unit_last(q.to(dt))), _unit_last(kx.to(dt)), w


def ranges(vis: Visibility, B: int, T: int, S: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's key range [lo, hi) from causal and windows (int64 [B, T]); lo <= hi always."""
    lo = torch.zeros(B, T, dtype=torch.int64, device=device)
    hi = torch.full((B, T), S, dtype=torch.int64, device=device)
    if vis.causal:
        lim = torch.arange(T, device=device, dtype=torch.int64).view(1, T) + (vis.offset + 1)
        if vis.offsets is not None:
            lim = lim + vis.offsets.to(device=device, dtype=torch.int64).view(B, 1)
        hi = torch.minimum(hi, lim)
    if vis.starts is not None:
        lo = torch.maximum(lo, vis.starts.to(device=device, dtype=torch.int64))
    if vis.ends is not None:
        hi = torch.minimum(hi, vis.ends.to(device=device, dtype=torch.int64))
    lo = lo.clamp(0, S)
    hi = torch.maximum(hi.clamp(0, S), lo)
    return lo.contiguous(), hi.contiguous()


def _aux(vis: Visibility, B: int, T: int, S: int, dummy: Tensor) -> tuple[Tensor, tuple, Tensor, tuple]:
    """Mask (as uint8) and bias as broadcast [B, T, S] views: read tile by tile with their strides."""
    if vis.mask is not None:
        m = vis.mask.expand(B, T, S).view(torch.uint8)
        mstr = m.stride()
    else:
        m, mstr = dummy, (0, 0, 0)
    if vis.bias is not None:
        bias = vis.bias.expand(B, T, S)
        bstr = bias.stride()
    else:
        bias, bstr = dummy, (0, 0, 0)
    return m, mstr, bias, bstr


class _Problem:
    """Everything the kernels share: operands, strides, flags, ranges."""

    def __init__(self, q, kx, weights, scale, relu, vis: Visibility, fill):
        self.B, self.T, self.H, self.D = q.shape
        self.S = kx.shape[1]
        self.q, self.kx, self.w = _operands(q, kx, weights, float(scale))
        self.device = q.device
        self.vis = vis
        dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.lo, self.hi = ranges(vis, self.B, self.T, self.S, self.device)
        self.mask, mstr, self.bias, bstr = _aux(vis, self.B, self.T, self.S, dummy)
        wt = self.w if self.w is not None else dummy
        wstr = self.w.stride() if self.w is not None else (0, 0, 0)
        self.wt = wt
        self.scale, self.fill = float(scale), float(fill)
        self.strides = (*self.q.stride()[:3], *self.kx.stride()[:2], *wstr, *mstr, *bstr)
        self.tile = tile = dataclasses.replace(score_tile.TILE)
        self.consts = dict(D=self.D, BLOCK_D=block_d(self.D), BT=tile.bt, BS=tile.bs, ACT=act_kind(relu, scale),
                           HAS_W=self.w is not None, PREC=precision(self.q.dtype),
                           HAS_MASK=vis.mask is not None, HAS_BIAS=vis.bias is not None)
        self.n_tblk = cdiv(self.T, tile.bt)

    @functools.cached_property
    def block_extra(self) -> dict:
        """block_kernel's q and kx descriptors, or {}: built on first use (rescore never needs them)."""
        return tma_views(self.q, self.kx, self.tile)

    def launch(self, kernel, grid, *args, **extra):
        """kernel[grid](args, strides, consts, extra); extra may also override num_stages / maxnreg."""
        opts = dict(num_warps=self.tile.warps, num_stages=self.tile.stages, maxnreg=self.tile.maxnreg)
        opts.update((o, extra.pop(o)) for o in list(extra) if o in opts)
        if not opts["maxnreg"] or interpreting():
            del opts["maxnreg"]
        kernel[grid](*args, *self.strides, **self.consts, **extra, **opts)


def fill_key(fill: float) -> int:
    return _fill_key(fill, math.copysign(1.0, fill))


def fill_bits(fill: float) -> int:
    return _fill_bits(fill, math.copysign(1.0, fill))


# Cached (each call built a CPU tensor, per launch), keyed with the sign too: -0.0 == 0.0 as floats,
# but the bits differ. A NaN never hits the cache (nan != nan): it is computed, as before.
@functools.lru_cache(maxsize=64)
def _fill_key(fill: float, sign: float) -> int:
    return int(order_key(torch.tensor([fill], dtype=torch.float32))[0])


@functools.lru_cache(maxsize=64)
def _fill_bits(fill: float, sign: float) -> int:
    return int(torch.tensor([fill], dtype=torch.float32).view(torch.int32)[0])


def select(q: Tensor, kx: Tensor, weights: Tensor | None, k: int, scale: float, relu: bool,
           vis: Visibility, fill: float, sorted: bool = True) -> tuple[Tensor, Tensor]:
    """Exact top-k per query row, same contract as reference.select; sorted=False returns the same
    entries per row without the final sort, in an unspecified order: the order of the filter's atomic
    appends, which may differ from run to run (the pass asks for it only where no order can matter)."""
    B, T = q.shape[0], q.shape[1]
    if k == 0 or B * T == 0:
        return (torch.empty(B, T, k, dtype=torch.float32, device=q.device),
                torch.empty(B, T, k, dtype=torch.int64, device=q.device))
    pb = _Problem(q, kx, weights, scale, relu, vis, fill)
    buf, used = candidates(pb, k)
    lists = row_lists(k, pb.S, buf.shape[1], vis)
    if interpreting() and sorted:
        # the interpreter runs the final kernel too slowly for whole-select tests; tests/kernels/
        # test_final_select.py checks it against this reference bit for bit. The unsorted order is the
        # kernel's own (no reference gives it), so sorted=False runs the kernel under the interpreter too.
        values, indices = select_rows_reference(buf, k, used)
    elif sorted and sort_width(k) == 0:  # past the in-kernel sort: free the buffer before torch.sort
        comp, _ = select_composites(buf, k, used=used, row_lists=lists)
        del buf
        values, indices = decode(torch.sort(comp, dim=1, descending=True).values)
    else:
        values, indices = select_rows(buf, k, used, sorted=sorted, row_lists=lists)
    return values.view(B, T, k), indices.view(B, T, k)


def row_lists(k: int, S: int, width: int, vis: Visibility) -> bool:
    """Whether the final select keeps its lists in the rows' unused slots (no scratch memory): only
    where every row's context passes the C slots, so that the threshold cut it to about ``target``
    of them. A row of a shorter context keeps every key and may fill its slots (a causal prefill's
    first C rows, windows): with many such rows the pool would run out and they would select over
    their whole buffers, so those calls keep a scratch list per program. Known without looking at
    the device: no windows, and a causal offset (none per batch) past C."""
    target, cap, _ = sizes(k, S)
    if S <= cap or vis.starts is not None or vis.ends is not None:
        return False
    if vis.causal and (vis.offsets is not None or vis.offset + 1 <= cap):  # row 0 sees offset + 1 keys
        return False
    return lists_fit_rows(k, width, cap - target)


def candidates(pb: _Problem, k: int) -> tuple[Tensor, tuple[Tensor, int, Tensor]]:
    """Row buffers [R, C + k] of raw entries that contain each row's exact top k (all stages but the
    last), and which of their slots can hold part of it: (int32 [R] counts, C, int32 [R] tail), the first
    counts[r] of the C candidate slots and the first tail[r] of the k slots past them; the rest is garbage."""
    R = pb.B * pb.T
    buf, thr = sample_threshold(pb, k)
    _, cap, _ = sizes(k, pb.S)
    cnt = filter_rows(pb, thr, buf, cap)
    # check: flag rows that overflowed or may miss part of their top k, list them, count them
    used = torch.empty(R, dtype=torch.int32, device=pb.device)
    tail = torch.empty(R, dtype=torch.int32, device=pb.device)
    rows = torch.empty(R + 1, dtype=torch.int64, device=pb.device)
    nflag = torch.empty(1, dtype=torch.int32, device=pb.device)
    block = check_block(R)
    check_kernel[(1,)](cnt, thr, pb.lo, pb.hi, used, tail, rows, nflag, stats.counters(pb.device), R, pb.S, k, cap,
                       fill_key(pb.fill), stats.FALLBACK_ROWS, BLOCK=block, num_warps=check_warps(block))
    _recover(pb, k, nflag, rows, buf, buf.shape[1])
    return buf, (used, cap, tail)


def sample_threshold(pb: _Problem, k: int) -> tuple[Tensor, Tensor]:
    """(row buffers with the out-of-range extras in place, int32 row thresholds)."""
    buf, samp, msamp = sample(pb, k)
    return buf, threshold(pb, k, buf, samp, msamp)


def sample(pb: _Problem, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(row buffers, the samples' order keys living in them, per-row count of valid samples)."""
    B, T, S = pb.B, pb.T, pb.S
    R = B * T
    _, cap, M = sizes(k, S)
    width = cap + k
    dev = pb.device
    buf = torch.empty(R, width, dtype=torch.int64, device=dev)
    if M <= 2 * width:
        samp = buf.view(torch.int32)  # samples live in the row's own slots until the threshold is taken
    else:  # a small k with a long context (or a tiny capacity): the row's slots hold fewer than M keys
        samp = torch.empty(R, M, dtype=torch.int32, device=dev)
    assert samp.shape[1] >= M  # the kernel writes M keys per row: never into the next row or past the end
    assert M * M < 2**31, f"samples={M}: the sample positions are computed in int32 (at most 46340 samples)"
    msamp = torch.zeros(R, dtype=torch.int32, device=dev)
    if S > cap:
        # two sample tiles a program: on the H200 (M = 4096) 4-14% faster than one at every benchmark shape,
        # and than four at H >= 32 (NOTES-selection.md, v12); the samples are the same bits either way
        split = knobs.sample_split or cdiv(M, 2 * pb.tile.bs)
        pb.launch(sample_kernel, (split, B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, samp, msamp, pb.mask,
                  pb.bias, T, S, pb.H, pb.scale, pb.fill, M, samp.stride(0), split)
    return buf, samp, msamp


def threshold(pb: _Problem, k: int, buf: Tensor, samp: Tensor, msamp: Tensor) -> Tensor:
    """Per-row int32 threshold keys from the samples; writes the extras (candidate slots are left as they are:
    the final select reads only as many as the filter appended)."""
    R, S = pb.B * pb.T, pb.S
    target, cap, M = sizes(k, S)
    width = cap + k
    thr = torch.empty(R, dtype=torch.int32, device=pb.device)
    mb = max(16, 1 << max(0, (M - 1).bit_length()))
    threshold_kernel[(R,)](samp, msamp, buf, pb.lo, pb.hi, thr, S, k, cap, target, M, samp.stride(0), width,
                           fill_bits(pb.fill), SAMPLED=S > cap, MB=mb, EB=1024, num_warps=threshold_warps(mb))
    return thr


def threshold_warps(mb: int) -> int:
    """Few warps: the bisection's steps are block-wide counts, bound by their latency (H200, 4096
    samples, 32 steps: 0.226 ms at 8 warps, 0.177 at 4, 0.167 at 2); 64 int32 keys a thread at most."""
    return max(2, min(8, mb // 2048))


def filter_rows(pb: _Problem, thr: Tensor, buf: Tensor, cap: int, mode: int = MODE_FILTER,
                out: Tensor | None = None) -> Tensor:
    """Append every in-range entry >= its row threshold to the row buffer; returns the row counts."""
    cnt = torch.zeros(pb.B * pb.T, dtype=torch.int32, device=pb.device)
    split = filter_split(pb)
    append, asm = append_kind(pb, cap)
    pb.launch(block_kernel, (split, pb.B, pb.n_tblk), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, thr, cnt,
              buf if out is None else out, pb.mask, pb.bias, pb.T, pb.S, pb.H, pb.scale, pb.fill, cap,
              buf.shape[1], split, MODE=mode, APPEND=append, ASM=asm, **pb.block_extra,
              **filter_launch(pb, append, asm))
    return cnt


def filter_launch(pb: _Problem, append: int, asm: bool) -> dict:
    """Launch options of the filter where its tile leaves them to us: q and kx by descriptor, no append,
    register cap or extra stages asked for, at most 64 accumulator registers a thread. Both appends
    are capped at 168 registers, three tiles in flight per SM instead of two. H200, filter alone, one
    run (NOTES-selection.md, v11), reserved append uncapped -> capped: 3.61 -> 3.62 ms at (4096,
    131072, 16), 14.28 -> 13.45 at H = 64, 7.87 -> 7.06 at (2048, 524288, 16), 14.98 -> 14.18 at
    (8192, 131072, 32); three stages instead (two tiles per SM by shared memory) 3.87 / 15.50 / 7.88 /
    14.70. The per-entry append, which mostly skips its branch where few entries pass: 7.80 -> 7.06
    at (2048, 524288, 16), 27.2 -> 27.0 at (4096, 262144, 64, k=512) (v10). Launch options only: the
    bits do not change."""
    t = pb.tile
    if not asm or not pb.block_extra or t.append is not None or t.maxnreg or t.stages != 2:
        return {}  # measured with descriptors only; pointer loads need more registers
    if t.bt * t.bs > 64 * 32 * t.warps:
        return {}
    return dict(maxnreg=168) if append in (2, 3) else {}


def append_kind(pb: _Problem, cap: int) -> tuple[int, bool]:
    """(APPEND, ASM): the tile's append, or by default the reserved one (3) unless the heads are many and
    few entries pass (about cap / 1.5 of a row's S keys). The reserved append costs every entry the same
    few instructions; the per-entry one (2) is a compare and a skipped branch for an entry that fails,
    and a wait on its atomic for one that passes, which a short tile (few heads) cannot hide.
    H200, filter alone at 168 registers, two runs (results/tune_append_rule.json, NOTES-selection.md v13):
    at H <= 32 the reserved one won 11 of 12 pairs at capacities of 1.1% to 9% of S, by 0.35 ms on
    average ((1024, 1048576, 16, k=2048) 8.08 against 8.96 per entry, both runs); at H = 64 with
    capacity < S / 16 each won 4 of 8, by up to 1.6 ms either way, so the per-entry one stays there;
    with many passes (S = 131072, k = 2048) the reserved one is 0.4-0.8 ms faster at H = 16 and 64.
    The PTX steps only where there is PTX: 2 becomes the portable per-entry append under the
    interpreter, 3 its triton twin. The reserved append needs BS of 32 to 256 and, in PTX, a thread
    for each quarter of a row at most (BT * 4 >= threads): inline PTX runs once per copy of an element."""
    a, asm = pb.tile.append, not interpreting()
    if a is None:
        a = 3 if cap * 16 >= pb.S or pb.H <= RESERVED_APPEND_MAX_HEADS else 2
    if a == 3 and (pb.tile.bs not in (32, 64, 128, 256) or (asm and pb.tile.bt * 4 < 32 * pb.tile.warps)):
        a = 2
    return (1 if a == 2 and not asm else a), asm


RESERVED_APPEND_MAX_HEADS = 32  # up to this many heads the filter reserves slots at any share (see append_kind)


def filter_split(pb: _Problem) -> int:
    """Key splits per query block: enough to fill the device, and at least 32 so that the programs in
    flight together cover few query blocks (their q stays in L2 even at H=64)."""
    return max(1, min(cdiv(pb.S, pb.tile.bs), max(32, cdiv(_programs(pb.device), pb.n_tblk * pb.B))))


def _recover(pb: _Problem, k: int, nflag: Tensor, rows: Tensor, buf: Tensor, width: int) -> None:
    """Rewrite the buffers of the nflag (device count) flagged rows listed in rows with their exact top k,
    for any number of flagged rows."""
    R = pb.B * pb.T
    dev = pb.device
    counts = torch.zeros(PASSES, R, 16, dtype=torch.int32, device=dev)
    ecnt = torch.zeros(R + 1, dtype=torch.int32, device=dev)  # the last one: the grid barrier's counter
    split = max(1, min(cdiv(pb.S, pb.tile.bs), _programs(dev) // 2))
    items = cdiv(R, pb.tile.bt) * split
    fk, fb = fill_key(pb.fill), fill_bits(pb.fill)

    def launch(grid: int, p: int, all_passes: bool, **extra) -> None:
        pb.launch(recover_kernel, (grid,), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, nflag, rows, counts, ecnt, buf,
                  pb.mask, pb.bias, ecnt[R:], pb.B, pb.T, pb.S, pb.H, k, pb.scale, pb.fill, fk, fb, width, R, p,
                  grid, split, cdiv(items, grid), EMIT=p == PASSES, ALL_PASSES=all_passes, NPASS=PASSES, **extra)

    if RECOVER_ONE_LAUNCH and dev.type == "cuda" and not interpreting():
        variant = (dev, tuple(sorted(pb.consts.items())), dataclasses.astuple(pb.tile))
        if launch_once(launch, variant, _one_launch_grids(dev), items, torch.cuda.is_current_stream_capturing()):
            return
    nprog = max(1, min(items, _programs(dev)))
    for p in range(PASSES + 1):
        launch(nprog, p, False)


def launch_once(launch, variant: tuple, grids: list[tuple[int, bool]], items: int, capturing: bool) -> bool:
    """Run the recovery as one launch on the first grid of ``grids`` ((programs, cooperative)) the device
    takes: a cooperative grid it cannot keep resident is refused with an error that names the
    cooperative launch, and the next is tried; any other error is raised. While a CUDA graph is
    being captured, a refusal would break the capture, so only grids this kernel variant ran on
    before, or plain ones, are tried. True once a launch ran."""
    for grid, cooperative in grids:
        key = (variant, grid, cooperative)
        if capturing and cooperative and key not in _one_launch_ran:
            continue
        try:
            launch(min(items, grid), 0, True, **({"launch_cooperative_grid": True} if cooperative else {}))
        except RuntimeError as e:
            if not cooperative or "cooperative" not in str(e).lower():
                raise
            _one_launch_failed.add((variant[0], grid, cooperative))
            continue
        _one_launch_ran.add(key)
        return True
    return False


def _one_launch_grids(dev: torch.device) -> list[tuple[int, bool]]:
    """(programs, cooperative) to try for the one-launch recovery, in order: RECOVER_PROGRAMS_PER_SM per
    SM as a cooperative launch (the driver refuses a grid it cannot keep resident, where a plain launch
    would deadlock at the first barrier); one per SM, cooperative; at last a plain launch on half the
    SMs (a process limited to part of the GPU still holds them all). A grid refused once is skipped
    after, for every kernel variant (a refusal depends on the variant's registers: conservative)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grids = [(sms * RECOVER_PROGRAMS_PER_SM, True), (sms, True)] if RECOVER_COOPERATIVE else []
    return [g for g in grids if (dev, *g) not in _one_launch_failed] + [(max(1, sms // 2), False)]


_one_launch_failed: set[tuple[torch.device, int, bool]] = set()  # (device, programs, cooperative) refused
_one_launch_ran: set[tuple] = set()  # ((device, constexprs, tile), programs, cooperative) that ran


# Recovery in one launch on CUDA (all passes, grid barriers between them) instead of PASSES + 1 launches:
# the launches were most of a small training step's host time. False goes back to one launch per pass
# (for a GPU shared so that half its SMs cannot hold one program each at once).
RECOVER_ONE_LAUNCH = True
# The one launch as a cooperative launch of RECOVER_PROGRAMS_PER_SM programs per SM: a heavy recovery
# (past 64 flagged rows) then has the programs of a full wave, not one per SM on half of them.
RECOVER_COOPERATIVE = True
RECOVER_PROGRAMS_PER_SM = 2


def rescore(q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor, scale: float, relu: bool,
            vis: Visibility, fill: float) -> Tensor:
    """Values at the given positions, bit-identical to what ``select`` returns for them."""
    B, T = q.shape[0], q.shape[1]
    K = indices.shape[-1]
    out = torch.empty(B, T, K, dtype=torch.float32, device=q.device)
    if K == 0 or B * T == 0:
        return out
    pb = _Problem(q, kx, weights, scale, relu, vis, fill)
    idx = indices.to(torch.int64).contiguous()
    if knobs.rescore_tile:
        pb.launch(rescore_tile_kernel, (pb.n_tblk, B, cdiv(K, pb.tile.bs)), pb.q, pb.kx, pb.wt, pb.lo, pb.hi, idx,
                  out, pb.mask, pb.bias, T, pb.S, pb.H, K, pb.scale, pb.fill)
        return out
    bj, bh = rescore_shape(pb.H, pb.consts["BLOCK_D"], pb.kx.element_size(), pb.consts["PREC"])
    consts = dict(pb.consts, H=pb.H, BJ=bj, BH=bh, W_ONCE=RESCORE_W_ONCE)
    del consts["BT"], consts["BS"]
    picks = bj * RESCORE_BLOCKS
    rescore_kernel[(B * T, cdiv(K, picks))](pb.q, pb.kx, pb.wt, pb.lo, pb.hi, idx, out, pb.mask, pb.bias,
                                            T, pb.S, K, pb.scale, pb.fill, picks, *pb.strides, **consts,
                                            num_warps=RESCORE_WARPS, num_stages=RESCORE_STAGES)
    return out


# Rescore tile: RESCORE_BJ gathered keys x all heads (up to RESCORE_MAX_BH) per MMA, RESCORE_BLOCKS
# such blocks per program, loaded RESCORE_STAGES ahead of use. benchmarks/tune_replay.py on the H200
# (k=2048, bf16, D=128; results/tune_replay.json): 128 keys x all heads took 0.186 / 0.365 / 0.668 ms at
# (2048, 65536, 16) / (4096, 131072, 16) / (4096, 131072, 64), against 0.224 / 0.422 / 1.182 ms for
# 64 keys x 16-head MMAs with per-block weight loads.
RESCORE_BJ = 128  # most gathered keys per MMA (its M); 64 where a stage would pass RESCORE_STAGE_BYTES
RESCORE_STAGE_BYTES = 32768
RESCORE_MAX_BH = 64  # most heads per MMA (its N); 16 is the smallest tensor-core N


def rescore_heads_per_mma(H: int) -> int:
    """All heads in one MMA up to RESCORE_MAX_BH: then q is loaded once per program and the block loop
    stays pipelined (at H=64, four 16-head MMAs in a runtime loop left the key gathers unpipelined)."""
    return min(RESCORE_MAX_BH, max(16, 1 << (H - 1).bit_length()))


def rescore_shape(H: int, block_d: int, elsize: int, prec: str) -> tuple[int, int]:
    """(keys, heads) per rescore MMA. fp32 operands scored in ieee fp32 go through a CUDA-core dot,
    where all 64 heads at once spilled (offline sm_90 build): 64 keys x 16 heads, as before. Never
    fewer than 64 keys: below a warpgroup's M the MMA is another instruction (mma.sync, not wgmma)
    than select's tiles use, and nothing promises the same bits from both."""
    if elsize == 4 and prec == "ieee":
        return 64, 16
    return max(64, min(RESCORE_BJ, RESCORE_STAGE_BYTES // (block_d * elsize))), rescore_heads_per_mma(H)


RESCORE_BLOCKS = 8
RESCORE_STAGES = 3
RESCORE_WARPS = 4
RESCORE_W_ONCE = True  # the row's head weights loaded once per program, not per block
