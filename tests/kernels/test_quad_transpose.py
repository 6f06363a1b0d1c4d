"""The rescore's quad transpose (runtime/quad_transpose.py): what its moves mean, checked under the interpreter, and
the layout check that lets the GPU do them by warp shuffles.

The interpreter runs the split-and-join form of each exchange, the meaning the PTX form must have; the GPU tests
check the PTX form against select bit for bit, and tests/test_compile_for_gpu.py that the sm_90 build of the
rescore passes ``layout_holds``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hyscale_compile.runtime import quad_transpose as qt


@triton.jit
def _exchange_kernel(x0_ptr, x1_ptr, y0_ptr, y1_ptr, N: tl.constexpr, MASK: tl.constexpr):
    offs = tl.reshape(tl.arange(0, 32 * N), (4, 8, N))
    y0, y1 = qt._exchange(tl.load(x0_ptr + offs), tl.load(x1_ptr + offs), MASK, False)
    tl.store(y0_ptr + offs, y0)
    tl.store(y1_ptr + offs, y1)


@pytest.mark.parametrize("N", [32, 64])
@pytest.mark.parametrize("mask", [1, 2])
def test_exchange_means_what_its_docstring_says(N, mask):
    """y_a[p] = x_{k(p)}[p with k set to a], k the column bit 2 * mask: distinct values, so any other move fails."""
    x0 = torch.arange(32 * N, dtype=torch.float32).reshape(4, 8, N)
    x1 = -1 - x0
    y0, y1 = torch.empty_like(x0), torch.empty_like(x0)
    _exchange_kernel[(1,)](x0, x1, y0, y1, N=N, MASK=mask)
    col = torch.arange(N)
    k = (col // (2 * mask)) % 2 == 1  # the column bit, per column
    for a, y in ((0, y0), (1, y1)):
        src = col - k.long() * 2 * mask + a * 2 * mask  # p with k set to a
        want = torch.where(k, x1[..., src], x0[..., src])
        assert torch.equal(y, want)


@triton.jit
def _round_trip_kernel(s_ptr, out_ptr, N: tl.constexpr):
    rows = tl.arange(0, 128)
    cols = tl.arange(0, N)
    s = tl.load(s_ptr + rows[:, None] * N + cols[None, :])
    heads = qt.quad_transposed_columns(s, N, False)
    for h in tl.static_range(N):
        tl.store(out_ptr + rows * N + h, qt.row_order(heads[h]))


@pytest.mark.parametrize("N", [32, 64])
def test_columns_in_order_and_rows_back_in_order(N):
    """Column h of the result, put in row order, is column h of s: every entry of a [128, N] tile distinct."""
    s = torch.randn(128, N, generator=torch.Generator().manual_seed(N))
    s = s + torch.arange(128 * N).reshape(128, N) * 1000.0  # distinct whatever randn gives
    out = torch.empty_like(s)
    _round_trip_kernel[(1,)](s, out, N=N)
    assert torch.equal(out.view(torch.int32), s.view(torch.int32))


# A compiled rescore's shuffle, as Triton 3.6 writes it for sm_90 (4 warps, a [128, 64] wgmma result).
_LINEAR = ("#ttg.linear<{register = [[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 0, 32]], lane = [[0, 0, 2], [0, 0, 4], "
           "[0, 1, 0], [0, 2, 0], [0, 4, 0]], warp = [[1, 0, 0], [2, 0, 0]], block = []}>")


def _ir(linear: str = _LINEAR, mask: int = 1, second: str = "#linear4") -> str:
    asm = (f'"{{\\0A .reg .pred %p;\\0A mov.u32 %t0, %laneid;\\0A and.b32 %t0, %t0, {mask};\\0A '
           f'shfl.sync.bfly.b32 %t2, %t1, {mask}, 0x1f, 0xffffffff;\\0A }}"')
    return (f"#linear4 = {linear}\n#mma = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], "
            f"instrShape = [16, 64, 16]}}>\nmodule {{\n"
            f"  %sh:2 = tt.elementwise_inline_asm {asm} {{constraints = \"=r,=r,r,r\", packed_element = 1 : i32, "
            f"pure = true}} %a, %b : tensor<4x8x64xi32, #linear4>, tensor<4x8x64xi32, {second}> -> "
            f"tensor<4x8x64xi32, #linear4>, tensor<4x8x64xi32, #linear4> loc(#loc1)\n}}\n")


def test_layout_holds_on_the_layout_the_shuffles_assume():
    assert qt.layout_holds(_ir(mask=1)) and qt.layout_holds(_ir(mask=2))


@pytest.mark.parametrize("case", ["lanes_swapped", "broadcast", "other_operand", "not_linear", "no_shuffle",
                                  "repeated_basis", "past_the_dimension", "mask_4"])
def test_layout_holds_refuses_anything_else(case):
    """Each of these would make a shuffle move other elements than the split-and-join form (or cannot be read)."""
    ir = {
        "lanes_swapped": lambda: _ir(_LINEAR.replace("lane = [[0, 0, 2], [0, 0, 4]", "lane = [[0, 0, 4], [0, 0, 2]")),
        "broadcast": lambda: _ir(_LINEAR.replace("warp = [[1, 0, 0], [2, 0, 0]]", "warp = [[1, 0, 0], [0, 0, 0]]")),
        "other_operand": lambda: _ir(second="#mma"),
        "not_linear": lambda: _ir("#ttg.blocked<{sizePerThread = [1, 1, 16], threadsPerWarp = [1, 8, 4], "
                                  "warpsPerCTA = [4, 1, 1], order = [2, 1, 0]}>"),
        "no_shuffle": lambda: _ir().replace("shfl.sync.bfly", "shfl.sync.idx"),
        "repeated_basis": lambda: _ir(_LINEAR.replace("[0, 0, 32]]", "[0, 0, 16]]")),
        "past_the_dimension": lambda: _ir(_LINEAR.replace("[0, 0, 32]]", "[0, 0, 64]]")),
        "mask_4": lambda: _ir(mask=4),
    }[case]()
    assert not qt.layout_holds(ir)
