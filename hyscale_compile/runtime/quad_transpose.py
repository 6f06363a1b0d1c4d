"""A warpgroup MMA's [128, N] fp32 result with each row's N columns moved into one thread, by warp shuffles.

The rescore sums a key's heads in order, so all of a key's head scores must sit in one thread. In the MMA's
accumulator layout four threads of a quad share each row (columns 2c, 2c + 1, 8 + 2c, ... in thread c), and
Triton moves such a tile through shared memory to regroup it (``columns``: a store and a load of the whole tile,
256 bytes a key at N = 64, with two barriers). Here the quad's four threads trade columns for rows instead: with
128 rows and four warps each quad holds four rows (rows r, r + 8, r + 64, r + 72 of its warp's slice), so after
two butterfly exchanges each thread holds one row and all its columns. Nothing is computed: every value moves
bit for bit, and the head sum after it is score_tile's chain, in the same order.

The exchanges are written as PTX (``shfl.sync.bfly``) on each register, so they rely on the tile still having
the MMA's layout where they run: register bits column 1, row 8, columns 8 .. N/2, row 64; lane bits columns 2
and 4, rows 1, 2 and 4; warp bits rows 16 and 32 (as sm_90's ``wgmma`` with 4 warps lays a [128, N] tile out).
``layout_holds`` checks the compiled kernel's IR for it before the rescore may launch this path
(``rescore._shuffles_hold``); the interpreter, which has no PTX, runs the splits and joins instead.
"""

from __future__ import annotations

import ast
import math
import re

import triton
import triton.language as tl

from .columns import columns


@triton.jit
def _exchange(x0, x1, MASK: tl.constexpr, PTX: tl.constexpr):
    """Trade lane bit ``MASK`` for the register bit that tells x0 from x1 (row 8 or 64). As tensors: with k the
    column bit 2 * MASK of the last dimension, y_a[p] = x_{k(p)}[p with k set to a]. PTX does it by one shuffle
    per register pair where lane bit MASK is column bit k (``layout_holds``); otherwise the same values are
    moved by splits and joins (the interpreter, and the meaning the PTX must have)."""
    if PTX:
        y0, y1 = tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .pred %p;
            .reg .b32 %t<3>;
            mov.u32 %t0, %laneid;
            and.b32 %t0, %t0, {MASK};
            setp.ne.b32 %p, %t0, 0;
            selp.b32 %t1, $2, $3, %p;
            shfl.sync.bfly.b32 %t2, %t1, {MASK}, 0x1f, 0xffffffff;
            selp.b32 $0, %t2, $2, %p;
            selp.b32 $1, $3, %t2, %p;
            }}""",
            constraints="=r,=r,r,r",
            args=[x0.to(tl.int32, bitcast=True), x1.to(tl.int32, bitcast=True)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return y0.to(tl.float32, bitcast=True), y1.to(tl.float32, bitcast=True)
    else:
        A: tl.constexpr = x0.shape[0]
        B: tl.constexpr = x0.shape[1]
        N: tl.constexpr = x0.shape[2]
        x0k0, x0k1 = tl.split(tl.permute(tl.reshape(x0, (A, B, N // (4 * MASK), 2, 2 * MASK)), (0, 1, 2, 4, 3)))
        x1k0, x1k1 = tl.split(tl.permute(tl.reshape(x1, (A, B, N // (4 * MASK), 2, 2 * MASK)), (0, 1, 2, 4, 3)))
        y0 = tl.reshape(tl.permute(tl.join(x0k0, x1k0), (0, 1, 2, 4, 3)), (A, B, N))
        y1 = tl.reshape(tl.permute(tl.join(x0k1, x1k1), (0, 1, 2, 4, 3)), (A, B, N))
        return y0, y1


@triton.jit
def _row_columns(z, N: tl.constexpr):
    """The N // 4 register columns of one exchanged part [4, 8, N] as [128] tensors, in column order."""
    z = tl.reshape(z, (4, 8, N // 8, 2, 2, 2))  # (rows 16 32, rows 1 2 4, columns 8.., column 4, 2, 1)
    z = tl.permute(z, (0, 1, 3, 4, 2, 5))
    return columns(tl.reshape(z, (128, N // 4)), N // 4)


@triton.jit
def quad_transposed_columns(s, N: tl.constexpr, PTX: tl.constexpr):
    """The N columns of s [128, N] (a 4-warp MMA result, N of 32 or 64) as N [128] tensors in order, each
    thread's entries all of one row: column j of row m is entry i of the j-th tensor, where ``row_order`` of
    a [128] tensor built from those entries gives back row order."""
    x = tl.reshape(s, (2, 4, 2, 8, N))  # (row 64, rows 16 32, row 8, rows 1 2 4, columns)
    x = tl.permute(x, (1, 3, 4, 0, 2))
    lo8, hi8 = tl.split(x)  # row 8 = 0 / 1: [4, 8, N, 2 (row 64)]
    x00, x10 = tl.split(lo8)
    x01, x11 = tl.split(hi8)
    y00, y01 = _exchange(x00, x01, 1, PTX)  # row 64 = 0: column 2 = 0 / 1, row 8 now the lane's bit 0
    y10, y11 = _exchange(x10, x11, 1, PTX)
    z00, z10 = _exchange(y00, y10, 2, PTX)  # column 2 = 0: column 4 = 0 / 1, row 64 now the lane's bit 1
    z01, z11 = _exchange(y01, y11, 2, PTX)
    c00 = _row_columns(z00, N)  # column 4 = 0, column 2 = 0: columns 0 1 8 9 16 17 ...
    c01 = _row_columns(z01, N)
    c10 = _row_columns(z10, N)
    c11 = _row_columns(z11, N)
    out = ()
    for i in tl.static_range(N // 8):
        out = out + (c00[2 * i], c00[2 * i + 1], c01[2 * i], c01[2 * i + 1],
                     c10[2 * i], c10[2 * i + 1], c11[2 * i], c11[2 * i + 1])
    return out


@triton.jit
def row_order(v):
    """A [128] tensor of per-thread row results from ``quad_transposed_columns``'s entries, in row order."""
    v = tl.reshape(v, (4, 8, 2, 2))  # (rows 16 32, rows 1 2 4, lane bit 1: row 64, lane bit 0: row 8)
    return tl.reshape(tl.permute(v, (2, 0, 3, 1)), (128,))


_ALIAS = re.compile(r"^(#[\w.]+) = (#.*)$", re.M)
_SHUFFLE = re.compile(r"tt\.elementwise_inline_asm \"[^\"]*shfl\.sync\.bfly\.b32 %t2, %t1, (\d+),[^\"]*\" \{[^}]*\} "
                      r"[^:\n]*: (.*?) ->")
_TENSOR = re.compile(r"tensor<([\dx]+)x[a-z]\w*, (#[^>]+>?)>")


def _linear_bases(encoding: str) -> dict | None:
    """register / lane / warp / block bases of a ``#ttg.linear`` encoding, or None for any other encoding."""
    if not encoding.startswith("#ttg.linear<"):
        return None
    parts = dict(re.findall(r"(register|lane|warp|block) = (\[[^=]*\])(?:,|\})", encoding))
    try:
        return {k: ast.literal_eval(v) for k, v in parts.items()}
    except (ValueError, SyntaxError):
        return None


def _shuffle_ok(mask: int, shape: list[int], bases: dict | None) -> bool:
    """Lane bit ``mask`` is column bit 2 * mask of the last dimension, and the layout holds every element once."""
    if bases is None or mask not in (1, 2) or sorted(bases) != ["block", "lane", "register", "warp"]:
        return False
    every = [tuple(b) for k in ("register", "lane", "warp", "block") for b in bases[k]]
    units = [b for b in every if len(b) == len(shape) and sum(x != 0 for x in b) == 1
             and all(0 <= x < d and x & (x - 1) == 0 for x, d in zip(b, shape))]
    if len(units) != len(every) or len(set(every)) != len(every) or 1 << len(every) != math.prod(shape):
        return False
    lane = bases["lane"]
    want = tuple([0] * (len(shape) - 1) + [2 * mask])
    return len(lane) == 5 and tuple(lane[mask.bit_length() - 1]) == want


def layout_holds(ttgir: str) -> bool:
    """Whether every shuffle of ``_exchange`` in a compiled kernel's TTGIR meets the lane on the column bit it
    assumes, so the PTX moves exactly what the splits and joins would. False where any operand's layout cannot be
    read (not a ``#ttg.linear``, say): the caller then takes the path through shared memory."""
    aliases = dict(_ALIAS.findall(ttgir))
    found = False
    for mask, operands in _SHUFFLE.findall(ttgir):
        types = _TENSOR.findall(operands)
        if len(types) != 2 or types[0] != types[1]:
            return False
        shape, encoding = types[0]
        encoding = aliases.get(encoding, encoding)
        if not _shuffle_ok(int(mask), [int(d) for d in shape.split("x")], _linear_bases(encoding)):
            return False
        found = True
    return found
