"""Selection replay's rescore: the values of given positions, bit-identical to what select returns.

Under activation recomputation the backward needs the selected values again; rescoring only the k
saved positions per row costs k score dots instead of the whole context. Each program takes one
query row's picks BJ at a time: the gathered keys times all the row's heads in one MMA, then the
heads summed in order with score_tile's per-head step (``act_fma``), so every value has the bits
select computed for it. A key's head scores come out of the MMA spread over four threads; on NVIDIA GPUs
``quad_transpose`` gathers them into one thread by warp shuffles (where the compiled layout is the one it
assumes), elsewhere Triton moves them through shared memory.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import fast_launch
from .columns import columns
from .env import compiles_ptx, interpreting
from .problem import Problem, cdiv
from .quad_transpose import layout_holds, quad_transposed_columns, row_order
from .reference import Visibility
from .score_tile import act_fma, tile_values

log = logging.getLogger("hyscale")

# Rescore tile: RESCORE_BJ gathered keys x all heads (up to RESCORE_MAX_BH) per MMA, RESCORE_BLOCKS
# such blocks per program, loaded RESCORE_STAGES ahead of use: faster than 64 keys x 16-head MMAs with
# per-block weight loads at every training shape, and 16 blocks a program faster than 8 or 4 at each of them
# (benchmarks/NOTES-selection.md, "Defaults and the measurements behind them": rescore tile).
RESCORE_BJ = 128  # most gathered keys per MMA (its M); 64 where a stage would pass RESCORE_STAGE_BYTES
RESCORE_STAGE_BYTES = 32768
RESCORE_MAX_BH = 64  # most heads per MMA (its N); 16 is the smallest tensor-core N
RESCORE_BLOCKS = 16
RESCORE_STAGES = 3
RESCORE_WARPS = 4
RESCORE_W_ONCE = True  # the row's head weights loaded once per program, not per block
# Tuning knobs (benchmarks/tuning/tune_rescore.py), defaults leave the kernel as it was:
RESCORE_GROUPS = 1  # head groups of heads_per_mma unrolled per block (e.g. MAX_BH=32, GROUPS=2 at H=64: two
# [BJ, 32] MMAs, each column-split and summed before the next); past that a runtime loop over groups
RESCORE_QUAD = True  # a key's heads gathered into one thread by quad_transpose (False: columns' splits, through
# shared memory on the GPU); the shuffles run only where the compiled layout passes quad_transpose.layout_holds
RESCORE_MAXNREG = None  # a register cap for the launch (more programs per SM), None: ptxas decides


def rescore(q: Tensor, kx: Tensor, weights: Tensor | None, indices: Tensor, scale: float, relu: bool,
            vis: Visibility, fill: float) -> Tensor:
    """Values at the given positions, bit-identical to what ``select`` returns for them."""
    B, T = q.shape[0], q.shape[1]
    K = indices.shape[-1]
    out = torch.empty(B, T, K, dtype=torch.float32, device=q.device)
    if K == 0 or B * T == 0:
        return out
    pb = Problem(q, kx, weights, scale, relu, vis, fill)
    idx = indices.to(torch.int64).contiguous()
    bj, bh = rescore_shape(pb.H, pb.consts["BLOCK_D"], pb.kx.element_size(), pb.consts["PREC"])
    ng = unrolled_groups(pb.H, bh)
    quad = RESCORE_QUAD and bj == 128 and bh in (32, 64) and ng > 0 and RESCORE_WARPS == 4
    consts = dict(pb.consts, H=pb.H, BJ=bj, BH=bh, NG=ng, W_ONCE=RESCORE_W_ONCE, QUAD=quad,
                  PTX=quad and compiles_ptx())
    del consts["BT"], consts["BS"]
    picks = bj * RESCORE_BLOCKS
    grid = (B * T, cdiv(K, picks))
    args = (pb.q, pb.kx, pb.wt, pb.lo, pb.hi, idx, out, pb.mask, pb.bias, T, pb.S, K, pb.scale, pb.fill, picks,
            *pb.strides)
    kw = dict(consts, **launch_options())
    if kw["PTX"] and not _shuffles_hold(fast_launch.compiled(rescore_kernel, grid, args, kw)):
        kw.update(QUAD=False, PTX=False)
    fast_launch.launch(rescore_kernel, grid, args, kw)
    return out


_SHUFFLES_HOLD: dict[str, bool] = {}  # compiled kernel's hash -> quad_transpose.layout_holds of its IR


def _shuffles_hold(kernel) -> bool:
    """Whether ``kernel``, the rescore compiled with the quad transpose's PTX, lays its MMA result out as the
    shuffles assume (its IR read once per compiled kernel)."""
    holds = _SHUFFLES_HOLD.get(kernel.hash)
    if holds is None:
        holds = _SHUFFLES_HOLD[kernel.hash] = layout_holds(kernel.asm["ttgir"])
        if not holds:
            log.warning("hyscale: the rescore's MMA layout is not the one its warp shuffles assume (Triton %s); "
                        "its head scores go through shared memory instead (same values, slower)", triton.__version__)
    return holds


def launch_options() -> dict:
    """num_warps, num_stages and (off the interpreter, where set) maxnreg of a rescore launch."""
    opts = dict(num_warps=RESCORE_WARPS, num_stages=RESCORE_STAGES)
    if RESCORE_MAXNREG and not interpreting():
        opts["maxnreg"] = RESCORE_MAXNREG
    return opts


def unrolled_groups(H: int, bh: int) -> int:
    """Head groups of bh per block, unrolled (the row's q groups loaded once per program), or 0 for a
    runtime loop over groups (H past RESCORE_GROUPS groups)."""
    n = cdiv(H, bh)
    return n if n <= max(1, RESCORE_GROUPS) else 0


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


@triton.jit
def _load_heads(q_row, c, sqh, offs_d, d_ok, H: tl.constexpr, BH: tl.constexpr):
    """Heads c .. c+BH-1 of one query row as the [D, BH] operand of the rescore MMA (missing heads 0)."""
    hh = tl.arange(0, BH)
    return tl.load(q_row + (c + hh)[None, :] * sqh + offs_d[:, None], mask=(c + hh < H)[None, :] & d_ok[:, None],
                   other=0.0)


@triton.jit
def _row_weights(w_row, swh, scale, H: tl.constexpr, BH: tl.constexpr):
    """The row's BH head weights times the scale as scalars (score_tile's product; past H unused), loaded once per
    program: loaded per block they were 64 uniform loads per thread per 64 keys at H=64, 8x the load
    instructions of the key gathers."""
    ws = ()
    for h in tl.static_range(BH):
        ws = ws + (tl.load(w_row + h * swh, mask=h < H, other=0.0) * scale,)
    return ws


@triton.jit
def _head_scores(kg, qt, BH: tl.constexpr, PREC: tl.constexpr, QUAD: tl.constexpr = False,
                 PTX: tl.constexpr = False):
    """The BH heads' dots of the gathered keys kg: one [BJ, D] x [D, BH] MMA, each head's column moved
    out by splits (no arithmetic, no cross-thread sums: a where + sum per head cost BH times the work
    and failed triton's pipeliner at H=64); with QUAD each of them holds one key a thread, rows in the order
    ``quad_transpose.row_order`` undoes."""
    if PREC == "upcast":
        s = tl.dot(kg.to(tl.float32), qt.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        s = tl.dot(kg, qt, input_precision=PREC, out_dtype=tl.float32)
    if QUAD:
        return quad_transposed_columns(s, BH, PTX)
    return columns(s, BH)


@triton.jit
def gather_keys(idx_ptr, kx_ptr, r, b, K, skb, sks, j0, j_hi, S, offs_d, d_ok, BJ: tl.constexpr):
    """Picks j0 .. j0 + BJ of row r (those below j_hi): (j, j in range, key positions with dropped ones at 0,
    positions in [0, S), their key rows [BJ, D] gathered, 0 where dropped). The rescore's loads, which its
    gather floor (benchmarks/floor.py) walks too."""
    j = j0 + tl.arange(0, BJ)
    j_ok = j < j_hi
    cols = tl.load(idx_ptr + r * K + j, mask=j_ok, other=0)
    c_ok = j_ok & (cols >= 0) & (cols < S)
    cols = tl.where(c_ok, cols, 0)
    kg = tl.load(kx_ptr + b * skb + cols[:, None] * sks + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :],
                 other=0.0)
    return j, j_ok, cols, c_ok, kg


@triton.jit
def rescore_kernel(q_ptr, kx_ptr, w_ptr, lo_ptr, hi_ptr, idx_ptr, out_ptr, mask_ptr, bias_ptr,
                   T, S, K, scale, fill, picks,
                   sqb, sqt, sqh, skb, sks, swb, swt, swh, smb, smt, sms, sbb, sbt, sbs,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BJ: tl.constexpr, BH: tl.constexpr,
                   ACT: tl.constexpr, HAS_W: tl.constexpr, PREC: tl.constexpr,
                   HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, W_ONCE: tl.constexpr = True,
                   NG: tl.constexpr = 1, QUAD: tl.constexpr = False, PTX: tl.constexpr = False):
    """Values of one query row at ``picks`` given positions, BJ at a time: the gathered keys times the
    row's heads in one [BJ, D] x [D, BH] MMA (BH >= H, up to 64; past that a loop over groups of BH
    heads), then the heads summed in order with score_tile's per-head step.

    Each score is the same fp32 dot (16-bit products are exact, accumulated by the tensor core in
    the same k order) followed by the same act + FMA chain as in the filter, so the values equal
    select's bit for bit; the GPU tests check that, and the interpreter tests check it against a kernel
    that scores whole filter tiles.
    The loop over blocks is software-pipelined (the launch's num_stages), so the dependent index -> key
    loads of the next blocks are in flight during this one's math. H is a constexpr: at H <= BH the head loop
    unrolls, the block loop is the innermost loop (the one the pipeliner works on) and the row's q is
    loaded once, its weights too with W_ONCE (64 more registers at H=64). A runtime loop over 16-head
    groups at H=64 left the block loop unpipelined. NG > 1 unrolls NG groups of BH heads (one MMA each,
    the heads still summed in order); NG == 0 is the runtime loop over groups.
    QUAD (BJ = 128, BH of 32 or 64, 4 warps): each MMA's columns regrouped by ``quad_transpose``, by warp shuffles
    with PTX, by splits and joins without; the values are the same either way, only their threads differ.
    """
    r = tl.program_id(0).to(tl.int64)  # row b * T + t
    b = r // T
    t = r % T
    j_lo = tl.program_id(1).to(tl.int64) * picks
    j_hi = tl.minimum(j_lo + picks, K)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    one = tl.arange(0, 1).to(tl.int64)
    lo = tl.load(lo_ptr + r + one)
    hi = tl.load(hi_ptr + r + one)
    row_ok = one == 0
    q_row = q_ptr + b * sqb + t * sqt
    w_row = w_ptr + b * swb + t * swt
    if NG > 0:  # the row's heads and weights, loaded once for all its blocks
        q_all = ()
        for g in tl.static_range(NG):
            q_all = q_all + (_load_heads(q_row, g * BH, sqh, offs_d, d_ok, H, BH),)
        if HAS_W and W_ONCE:
            w_all = _row_weights(w_row, swh, scale, H, NG * BH)
    for j0 in range(j_lo, j_hi, BJ):
        j, j_ok, cols, c_ok, kg = gather_keys(idx_ptr, kx_ptr, r, b, K, skb, sks, j0, j_hi, S, offs_d, d_ok, BJ)
        acc = tl.zeros((BJ,), dtype=tl.float32)
        if NG > 0:  # NG MMAs, unrolled, so the block loop stays the innermost (pipelined) loop
            for g in tl.static_range(NG):
                sh = _head_scores(kg, q_all[g], BH, PREC, QUAD, PTX)
                for i in tl.static_range(BH):  # heads in order, score_tile's step
                    if g * BH + i < H:
                        if not HAS_W:
                            w = scale
                        elif W_ONCE:
                            w = w_all[g * BH + i]
                        else:
                            w = tl.load(w_row + (g * BH + i) * swh) * scale
                        acc = act_fma(sh[i], w, acc, ACT)
        else:  # a runtime loop over head groups (past RESCORE_GROUPS groups)
            for c in range(0, H, BH):
                sh = _head_scores(kg, _load_heads(q_row, c, sqh, offs_d, d_ok, H, BH), BH, PREC)
                for i in tl.static_range(BH):
                    if c + i < H:
                        acc = act_fma(sh[i], tl.load(w_row + (c + i) * swh) * scale if HAS_W else scale, acc, ACT)
        if QUAD:
            acc = row_order(acc)
        val, _ = tile_values(acc[None, :], one + b, one + t, cols, row_ok, c_ok, lo, hi, fill,
                             mask_ptr, smb, smt, sms, bias_ptr, sbb, sbt, sbs, HAS_MASK, HAS_BIAS)
        tl.store(out_ptr + r * K + j, canonical(tl.reshape(val, (BJ,))), mask=j_ok)


@triton.jit
def canonical(v):
    """NaN as 0x7FC00000 and -0.0 as +0.0: the values select returns (they come back from order keys)."""
    v = tl.where(v != v, float("nan"), v)
    return tl.where(v == 0.0, 0.0, v)
