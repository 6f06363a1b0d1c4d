"""One call's operands as every HyTopK kernel takes them: ``Problem``.

The select and rescore entries build one per call; each stage and the benchmarks' own kernels
launch through it, so every kernel sees the same operands, strides, flags and tile (the same tile
shape gives the same MMA, hence the same score bits in every kernel).
"""

from __future__ import annotations

import copy
import functools
import math
from types import MappingProxyType

import torch
from torch import Tensor

from . import additive_causal, fast_launch, score_tile
from .env import interpreting
from .kept import kept
from .reference import Visibility, order_key
from .score_tile import TileConfig, act_kind, block_d, precision, tma_views


class Problem:
    """Operands, strides, constexpr flags and row ranges of one call, for tiles of ``tile`` (default:
    ``score_tile.TILE`` as it is at construction). It belongs to that call: the tensors it makes (lo and hi on
    first use) are made where the call runs, inside a CUDA graph's capture or outside it, and serve only there."""

    def __init__(self, q: Tensor, kx: Tensor, weights: Tensor | None, scale: float, relu: bool, vis: Visibility,
                 fill: float, tile: TileConfig | None = None):
        self.B, self.T, self.H, self.D = q.shape
        self.S = kx.shape[1]
        self.q, self.kx, self.w = _operands(q, kx, weights)
        self.device = q.device
        self.vis = vis = additive_causal.as_bias(vis, q, kx, weights, float(scale), float(fill))
        self.dummy = dummy = _dummy(self.device)  # for pointers never read: their flag (HAS_*) is off
        self.mask, mstr, self.bias, bstr = _aux(vis, self.B, self.T, self.S, dummy)
        self.wt = self.w if self.w is not None else dummy
        wstr = self.w.stride() if self.w is not None else (0, 0, 0)
        self.scale, self.fill = float(scale), float(fill)
        self.strides = (*self.q.stride()[:3], *self.kx.stride()[:2], *wstr, *mstr, *bstr)
        # the tile as it is now (tuners change score_tile.TILE), the constexprs and the launch options
        self.tile, self.consts, self._options = _statics(
            score_tile.TILE if tile is None else tile, self.D, act_kind(relu, scale), self.w is not None,
            precision(self.q.dtype), mask_kind(vis.mask, mstr, self.T), vis.bias is not None)
        self.n_tblk = cdiv(self.T, self.tile.bt)

    @functools.cached_property
    def _ranges(self) -> tuple[Tensor, Tensor]:
        return ranges(self.vis, self.B, self.T, self.S, self.device)

    @property
    def lo(self) -> Tensor:
        """int64 [B, T]: each row's first visible key (built on first use: ``first`` spares the table route)."""
        return self._ranges[0]

    @property
    def hi(self) -> Tensor:
        """int64 [B, T]: one past each row's last visible key."""
        return self._ranges[1]

    @property
    def first(self) -> int | None:
        """Where the row ranges follow from the sizes alone (no windows, no per-batch offsets): row t sees keys
        [0, min(max(t + first, 0), S)), so a kernel can form them itself instead of reading lo and hi (which then
        need not be built: on a decode step whose offset moves every call, a few ops of host work). Else None."""
        return sizes_first(self.vis, self.T, self.S)

    @property
    def rows(self) -> int:
        return self.B * self.T

    @functools.cached_property
    def descriptors(self) -> dict:
        """The filter's q and kx tensor descriptors, or {}: built on first use (rescore never needs them)."""
        return tma_views(self.q, self.kx, self.tile)

    def launch(self, kernel, grid, *args, **extra) -> None:
        """kernel[grid](args, strides, consts, extra) (by ``fast_launch``); extra may also override num_stages /
        maxnreg."""
        opts = self._options
        if opts is None or not _LAUNCH_OPTIONS.isdisjoint(extra):
            opts = dict(num_warps=self.tile.warps, num_stages=self.tile.stages, maxnreg=self.tile.maxnreg)
            opts.update((o, extra.pop(o)) for o in list(extra) if o in opts)
            if not opts["maxnreg"] or interpreting():
                del opts["maxnreg"]
        fast_launch.launch(kernel, grid, (*args, *self.strides), {**self.consts, **extra, **opts})


_LAUNCH_OPTIONS = frozenset(("num_warps", "num_stages", "maxnreg"))


def mask_kind(mask: Tensor | None, strides: tuple, T: int) -> int:
    """HAS_MASK of a call: score_tile.MASK_NONE, MASK_TABLE, or MASK_KEYS where the mask is the same for every
    query row (stride 0 along T after broadcasting, or one row): the filter and the sampler then read one [BS]
    column of it per key tile and keep their fast paths."""
    if mask is None:
        return score_tile.MASK_NONE.value
    return (score_tile.MASK_KEYS if strides[1] == 0 or T == 1 else score_tile.MASK_TABLE).value


def _statics(tile: TileConfig, D: int, act: int, has_w: bool, prec: str, has_mask: int,
             has_bias: bool) -> tuple[TileConfig, MappingProxyType, dict | None]:
    """(a copy of ``tile``, the kernels' constexprs, the launch options of a launch that overrides none, or None
    where the tile caps registers: whether the cap applies is asked per launch), kept per their inputs, the
    tile's fields among them: a decode step asks for the same ones every call, and building them is host work
    each call. Shared by the Problems of one key, so read only (the constexprs a read-only mapping)."""
    key = (tuple(tile.__dict__.values()), D, act, has_w, prec, has_mask, has_bias)
    return kept(_STATICS, key, lambda: _make_statics(tile, D, act, has_w, prec, has_mask, has_bias), _KEPT_MAX)


def _make_statics(tile, D, act, has_w, prec, has_mask, has_bias):
    tile = copy.copy(tile)
    consts = dict(D=D, BLOCK_D=block_d(D), BT=tile.bt, BS=tile.bs, ACT=act, HAS_W=has_w, PREC=prec,
                  HAS_MASK=has_mask, HAS_BIAS=has_bias)
    options = None if tile.maxnreg else dict(num_warps=tile.warps, num_stages=tile.stages)
    return tile, MappingProxyType(consts), options


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unit_last(x: Tensor) -> Tensor:
    """Kernels take any strides but a unit last one (broadcast views stay views)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _heads_in_int32(x: Tensor) -> Tensor:
    """The kernels form head offsets h * head_stride in int32: a layout with heads far apart (a q
    stored [B, H, T, D] and viewed [B, T, H, D] at a long context) is made contiguous instead."""
    return x.contiguous() if x.shape[2] * x.stride(2) >= 2**31 else x


def _operands(q: Tensor, kx: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One dtype for q and kx (16-bit widened to fp32 is exact); fp32 weights (the kernels multiply them by the
    scale: score_tile). No op where nothing changes (each one is host work, also when it returns its input)."""
    if q.dtype != kx.dtype:
        dt = torch.promote_types(q.dtype, kx.dtype)
        q, kx = q.to(dt), kx.to(dt)
    if weights is not None:
        weights = _heads_in_int32(weights if weights.dtype == torch.float32 else weights.float())
    return _heads_in_int32(_unit_last(q)), _unit_last(kx), weights


def sizes_first(vis: Visibility, T: int, S: int) -> int | None:
    """Where the row ranges are a function of the sizes alone (causal with an int offset, or none; no windows, no
    per-batch offsets): ``first`` such that row t sees [0, clamp(t + first, 0, S)). Else None. Clamped to [-T, S],
    which gives the same ranges for rows 0..T-1 and keeps it an int32 kernel argument."""
    if vis.starts is not None or vis.ends is not None or vis.offsets is not None:
        return None
    return min(max(int(vis.offset) + 1, -T), S) if vis.causal else S


def ranges(vis: Visibility, B: int, T: int, S: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's key range [lo, hi) from causal and windows (int64 [B, T]); lo <= hi always."""
    first = sizes_first(vis, T, S)
    if first is not None:
        return _static_ranges(B, T, S, first, device)
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


def _static_ranges(B: int, T: int, S: int, first: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Ranges that follow from the sizes alone (``sizes_first``), kept per sizes and stream:
    a decode step asks for the same ones every call, and building them is three launches of host work. Nothing
    writes them (the kernels only read lo and hi).

    Neither kept nor taken from the kept ones while a CUDA graph captures: a tensor made during capture holds
    its values only once the graph replays, and a kept one handed to a graph would be freed when a newer key
    evicts it while the graph still reads it (a graph's own are in its pool, which it keeps). The stream is part
    of the key: an evicted tensor's memory goes back to its stream's pool, reused only by work ordered after
    the kernels that read it."""
    if capturing(device):
        return _build_ranges(B, T, S, first, device, _new_zeros(B, T, device))
    return kept(_RANGES, (B, T, S, first, device, _stream(device)),
                lambda: _build_ranges(B, T, S, first, device, _zeros(B, T, device)), _KEPT_MAX)


def _build_ranges(B: int, T: int, S: int, first: int, device: torch.device, lo: Tensor) -> tuple[Tensor, Tensor]:
    hi = torch.arange(first, first + T, dtype=torch.int64, device=device).clamp_(0, S)  # no causal mask: all S
    return lo, hi.view(1, T) if B == 1 else hi.expand(B, T).contiguous()


_RANGES: dict[tuple, tuple[Tensor, Tensor]] = {}
_STATICS: dict[tuple, tuple] = {}
_ZEROS: dict[tuple, Tensor] = {}
_KEPT_MAX = 64
_DUMMIES: dict[torch.device, Tensor] = {}


def _zeros(B: int, T: int, device: torch.device) -> Tensor:
    """lo of every row without windows: zeros of [B, T] int64, kept per size (a decode step's offset changes
    every call, its row count does not). Read-only, as _static_ranges."""
    return kept(_ZEROS, (B, T, device, _stream(device)), lambda: _new_zeros(B, T, device), _KEPT_MAX)


def _new_zeros(B: int, T: int, device: torch.device) -> Tensor:
    return torch.zeros(B, T, dtype=torch.int64, device=device)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph (never off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device):
    """The current stream's handle on ``device`` (the raw query Triton's launches make: torch.cuda.current_stream
    builds a Stream object, several microseconds of a decode step's host work)."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None


def _dummy(device: torch.device) -> Tensor:
    """One fp32 element per device for the pointers whose flag is off: never read or written, never freed (kept
    for good, so a graph that captured it never sees it freed)."""
    got = _DUMMIES.get(device)
    if got is None:
        got = torch.empty(1, dtype=torch.float32, device=device)
        if not capturing(device):
            _DUMMIES[device] = got
    return got


def _aux(vis: Visibility, B: int, T: int, S: int, dummy: Tensor) -> tuple[Tensor, tuple, Tensor, tuple]:
    """Mask (as uint8) and bias as broadcast [B, T, S] views: read tile by tile with their strides."""
    if vis.mask is not None:
        m = vis.mask.expand(B, T, S).view(torch.uint8)
        mstr = m.stride()
    else:
        m, mstr = dummy, (0, 0, 0)
    if isinstance(vis.bias, additive_causal.StridedBias):
        bias, bstr = vis.bias.base, vis.bias.strides
    elif vis.bias is not None:
        bias = vis.bias.expand(B, T, S)
        bstr = bias.stride()
    else:
        bias, bstr = dummy, (0, 0, 0)
    return m, mstr, bias, bstr


def fill_key(fill: float) -> int:
    """The int32 order key of the fill value (what the check and the recovery compare with)."""
    return _fill_key(fill, math.copysign(1.0, fill))


def fill_bits(fill: float) -> int:
    """The fill value's fp32 bits as an int32 (what the kernels write for masked positions)."""
    return _fill_bits(fill, math.copysign(1.0, fill))


# Cached (each call built a CPU tensor, per launch), keyed with the sign too: -0.0 == 0.0 as floats,
# but the bits differ. A NaN never hits the cache (nan != nan): it is computed, as before.
@functools.lru_cache(maxsize=64)
def _fill_key(fill: float, sign: float) -> int:
    return int(order_key(torch.tensor([fill], dtype=torch.float32))[0])


@functools.lru_cache(maxsize=64)
def _fill_bits(fill: float, sign: float) -> int:
    return int(torch.tensor([fill], dtype=torch.float32).view(torch.int32)[0])
