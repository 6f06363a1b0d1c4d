"""HyTopK kernels under the Triton interpreter, bitwise against the CPU reference.

Inputs are small multiples of 1/8 with small D and H, so every score is exact in any summation
order and the kernels must match the reference bit for bit (values and indices). Knobs force the
sampled threshold, overflowing buffers, too-few candidates, and more than 64 flagged rows: each test
passes its overrides to the call (``plan.Tuning``), nothing global changes.
"""

from __future__ import annotations

import dataclasses
import math

import filter_contract
import pytest
import torch
from rescore_tile import rescore_by_tiles

from hyscale_compile.runtime import dispatch, hytopk, plan, problem, reference, rescore, sample, score_tile, stats
from hyscale_compile.runtime import final_select as fs
from hyscale_compile.runtime.plan import DEFAULT, Tuning, make_plan
from hyscale_compile.runtime.problem import Problem
from hyscale_compile.runtime.reference import Visibility
from hyscale_compile.testing import assert_same_topk

NEG_INF = float("-inf")
ALL_VISIBLE = Visibility()


def tile(**changes) -> score_tile.TileConfig:
    return dataclasses.replace(score_tile.TILE, **changes)


def eighths(shape, lo=-4, hi=5, dtype=torch.bfloat16, gen=None):
    return (torch.randint(lo, hi, shape, generator=gen) / 8).to(dtype)


def inputs(B=2, T=5, H=2, D=16, S=40, dtype=torch.bfloat16, weights=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = eighths((B, T, H, D), dtype=dtype, gen=g)
    kx = eighths((B, S, D), dtype=dtype, gen=g)
    w = (torch.randint(-2, 3, (B, T, H), generator=g) / 4).float() if weights else None
    return q, kx, w


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (-0.0 == +0.0), NaN equal to NaN."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def check(q, kx, w, k, scale=0.5, relu=True, vis=ALL_VISIBLE, fill=NEG_INF, tuning=DEFAULT):
    """The pipeline (forced: at these sizes the plan takes the table route) against the reference, bit
    for bit, and so is the table route (once per call: it has no knobs of the pipeline's)."""
    v, i = hytopk.select(q, kx, w, k, scale, relu, vis, fill, tuning=dataclasses.replace(tuning, table=False))
    rv, ri = reference.select(q, kx, w, k, scale, relu, vis, fill)
    assert same(v, rv), f"values differ:\n{v}\n{rv}"
    assert torch.equal(i, ri), f"indices differ:\n{i}\n{ri}"
    tv, ti = hytopk.select(q, kx, w, k, scale, relu, vis, fill, tuning=Tuning(tile=tuning.tile, table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i), "table route != pipeline"
    r = hytopk.rescore(q, kx, w, i, scale, relu, vis, fill)
    assert same(r, v) and torch.equal(r.view(torch.int32), v.view(torch.int32)), "rescore != select bitwise"
    return v, i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_causal(dtype):
    q, kx, w = inputs(dtype=dtype)
    check(q, kx, w, 6, vis=Visibility(causal=True, offset=35))


@pytest.mark.parametrize("relu,weights", [(False, True), (True, False), (False, False)])
def test_relu_and_weights(relu, weights):
    q, kx, w = inputs(weights=weights, seed=1)
    check(q, kx, w, 7, relu=relu, vis=Visibility(causal=True, offset=30))


def test_odd_sizes_t1_and_k_equals_s():
    q, kx, w = inputs(B=1, T=1, H=3, D=24, S=37, seed=2)
    check(q, kx, w, 37)
    check(q, kx, w, 1, vis=Visibility(causal=True, offset=3))


def test_windows_offsets_and_fill():
    q, kx, w = inputs(B=2, T=6, S=30, seed=3)
    starts = torch.tensor([[0, 2, 5, 9, 28, 3], [1, 1, 1, 0, 7, 29]])
    ends = torch.tensor([[4, 9, 30, 10, 30, 3], [30, 2, 25, 30, 12, 30]])
    for fill in (NEG_INF, -100.0, 0.0, 3.0, float("inf"), float("nan")):
        check(q, kx, w, 5, vis=Visibility(starts=starts, ends=ends), fill=fill)
    offsets = torch.tensor([3, 20])
    check(q, kx, w, 8, vis=Visibility(causal=True, offset=1, offsets=offsets, starts=starts))


def test_mask_and_bias_broadcast():
    B, T, S = 2, 5, 33
    q, kx, w = inputs(B=B, T=T, S=S, seed=4)
    g = torch.Generator().manual_seed(5)
    mask_bt = torch.rand(B, T, S, generator=g) > 0.3
    mask_s = (torch.rand(1, 1, S, generator=g) > 0.5)
    bias_ts = eighths((T, S), gen=g).float()
    bias_ts[1, 3] = NEG_INF
    bias_b = eighths((B, 1, S), gen=g, dtype=torch.float16)
    check(q, kx, w, 6, vis=Visibility(mask=mask_bt))
    check(q, kx, w, 6, vis=Visibility(causal=True, offset=28, mask=mask_s, bias=bias_ts), fill=-1.0)
    check(q, kx, w, 9, vis=Visibility(bias=bias_b, mask=mask_bt[:, :1]), fill=0.5)


@pytest.mark.parametrize("fill", [NEG_INF, -1.0, float("nan")])
def test_key_mask_fast_path(fill):
    """A mask of the key alone ([B, 1, S]: a padding mask broadcast over the queries) runs as HAS_MASK ==
    MASK_KEYS: the filter keeps its tiles inside every row's range (bs=16 makes most of them so), the sampler its
    32-bit range test, both reading one column of the mask a tile. Bitwise the reference: hidden keys compete with
    value ``fill``, NaN scores at visible keys rank first and at hidden ones become the fill, rows whose keys are
    all hidden (batch 1 under the short offset) return masked positions, lowest first."""
    B, T, S = 2, 6, 80
    q, kx, w = inputs(B=B, T=T, S=S, seed=41)
    g = torch.Generator().manual_seed(42)
    keys = torch.rand(B, 1, S, generator=g) > 0.4
    kx[0, 5], kx[0, 60], kx[1, 70] = math.nan, math.nan, math.nan
    keys[0, 0, 5], keys[0, 0, 60], keys[1, 0, 70] = True, False, True  # NaN visible, hidden, visible
    keys[1, 0, :12] = False  # batch 1, offset 5: every row's keys hidden
    assert Problem(q, kx, w, 0.5, True, Visibility(mask=keys), fill).consts["HAS_MASK"] == score_tile.MASK_KEYS
    assert Problem(q, kx, w, 0.5, True, Visibility(mask=keys.expand(B, T, S).clone()),
                   fill).consts["HAS_MASK"] == score_tile.MASK_TABLE
    sampled = Tuning(tile=tile(bs=16), capacity=16, target=10, samples=32)
    check(q, kx, w, 8, vis=Visibility(causal=True, offset=S - T, mask=keys), fill=fill, tuning=sampled)
    if fill == NEG_INF:  # the other ranges once (the fills take the same paths there: interpreter time)
        check(q, kx, w, 8, vis=Visibility(causal=True, offset=5, mask=keys), fill=fill, tuning=Tuning(tile=tile(bs=16)))
        check(q, kx, w, 8, vis=Visibility(mask=keys), fill=fill, tuning=sampled)  # no range at all


def test_few_visible_keys():
    q, kx, w = inputs(B=1, T=6, S=40, seed=6)
    # query t sees t + 1 keys: fewer than k for most rows, masked positions follow lowest first
    check(q, kx, w, 10, vis=Visibility(causal=True))
    check(q, kx, w, 10, vis=Visibility(causal=True), fill=0.0)


def test_adversarial_values():
    B, T, H, D, S = 1, 4, 2, 16, 48
    q, kx, w = inputs(B=B, T=T, H=H, D=D, S=S, seed=7)
    equal_kx = kx[:, :1].expand(B, S, D).contiguous()
    check(q, equal_kx, w, 5)  # all-equal scores: ties everywhere, positions decide
    check(-q.abs(), kx.abs(), None, 5)  # all zero after relu
    ties = kx.clone()
    ties[:, ::3] = kx[:, 1:2]  # a third of the keys tie with key 1
    check(q, ties, w, 20, relu=False)
    ramp = torch.zeros(B, S, D, dtype=torch.bfloat16)
    ramp[..., 0] = torch.arange(S) / 8
    check(q.abs() + 0.125, ramp, None, 7, relu=False)  # scores increase with position
    outl = kx.clone()
    outl[0, 17] = 30.0
    outl[0, 40] = -30.0
    check(q, outl, w, 4, relu=False, vis=Visibility(causal=True, offset=44))
    nan_kx = kx.clone()
    nan_kx[0, 11, 3] = float("nan")
    nan_q = q.clone()
    nan_q[0, 2, 1, 0] = float("inf")
    check(nan_q, nan_kx, w, 6, relu=False)


def test_sampled_threshold_exact():
    """Long-enough rows take the sampled threshold: far fewer candidates than keys, still exact."""
    q, kx, w = inputs(B=1, T=6, S=128, seed=8)
    stats.reset()
    check(q, kx, w, 8, vis=Visibility(causal=True, offset=122), tuning=Tuning(capacity=64, target=40, samples=64))
    s = stats.read()
    assert s.rows == 6 and s.rows_recovered <= 1 and 8 <= s.mean_candidates <= 64


def test_sampled_threshold_split_programs():
    """Samples of one query block spread over several programs (counts summed with atomics)."""
    S = 600
    q = torch.full((1, 3, 1, 16), 0.125)
    kx = torch.zeros(1, S, 16)
    kx[..., 0] = torch.arange(S) / 8 - 30  # distinct scores, so the sampled quantile is sharp
    stats.reset()
    check(q, kx, None, 10, vis=Visibility(causal=True, offset=597), relu=False,
          tuning=Tuning(capacity=200, target=100, samples=300, programs=8))
    s = stats.read()
    assert s.rows_recovered == 0 and 90 <= s.mean_candidates <= 110


@pytest.mark.parametrize("append", [0, 1, 2, 3])
def test_append_variants(append):
    """Each way the filter hands out slots (block scan, per-entry atomic, slots reserved per thread;
    the per-entry PTX one runs as the atomic one here, the reserved one as its triton twin) gives the
    same exact result, on tiles inside and across the rows' ranges."""
    q, kx, w = inputs(B=1, T=6, S=128, seed=15)
    sampled = Tuning(tile=tile(append=append, bs=32), capacity=64, target=40, samples=64)
    check(q, kx, w, 8, vis=Visibility(causal=True, offset=122), tuning=sampled)
    check(q, kx, w, 8, vis=Visibility(starts=torch.tensor([[0, 5, 40, 41, 90, 100]]), causal=True, offset=122),
          tuning=sampled)
    # the last row sees 3 keys, so 5 masked positions (value fill) are in its top 8; every context fits
    # the buffer, so the threshold lets all pass: entries out of range must still never be appended
    check(q, kx, w, 8, vis=Visibility(starts=torch.tensor([[0, 5, 40, 41, 90, 125]]), causal=True, offset=122),
          tuning=Tuning(tile=tile(append=append, bs=32), capacity=128))


def test_reserved_append_at_the_default_tile():
    """The reserved append at 128 keys a tile (32 columns a thread: the split the GPU runs), on tiles
    inside and across the rows' ranges; the variants test above splits 8 columns a thread."""
    q, kx, w = inputs(B=1, T=6, S=300, seed=15)
    check(q, kx, w, 8, vis=Visibility(starts=torch.tensor([[0, 5, 40, 141, 190, 290]]), causal=True, offset=294),
          tuning=Tuning(tile=tile(append=3, bs=128), capacity=64, target=40, samples=128))


@pytest.mark.parametrize("append,bs,masked,windows", [
    (3, 32, False, True), (3, 128, False, True), (3, 256, False, True), (3, 32, True, True), (3, 128, True, True),
    (3, 256, True, True), (3, 32, False, False), (1, 32, False, True), (0, 32, True, True), (3, 32, "keys", False),
    (0, 32, "keys", True), (1, 32, "keys", False)])
def test_filter_capacity_contract(append, bs, masked, windows):
    """tests/filter_contract.py on the interpreter: the reserved append's twin and the other appends,
    at 32 to 256 keys a tile."""
    q, kx, w = inputs(B=1, T=6, H=4, D=32, S=300, seed=31)
    w = w.abs() + 0.25  # positive weights: enough distinct scores for a row to pass exactly C
    cnt, C = filter_contract.check(q, kx, w, 16, append=append, bs=bs, masked=masked, windows=windows)
    exact = (cnt == C).sum() >= 1 or masked == "keys"  # (the key mask's ties leave no row at exactly C)
    assert (cnt > C).sum() >= 2 and exact and (cnt < C).sum() >= 2  # every case was met


def test_append_rule():
    """By default the filter reserves slots per thread, except with many heads (past 32) where few
    entries pass (capacity < S / 16): there it appends per entry. An explicit tile append is kept.
    The interpreter has no PTX: the per-entry PTX append runs as the portable one."""
    many = plan.RESERVED_APPEND_MAX_HEADS + 1
    for H, want_few in ((2, 3), (plan.RESERVED_APPEND_MAX_HEADS, 3), (many, 1)):
        assert plan.append_kind(score_tile.TILE, 2000, H, 125, asm=False) == (3, False), H
        assert plan.append_kind(score_tile.TILE, 2000, H, 124, asm=False) == (want_few, False), H
    assert plan.append_kind(tile(append=0), 2000, many, 125, asm=False) == (0, False)
    q, kx, w = inputs(B=1, T=2, H=many, D=16, S=2000, seed=23)  # what a call plans under the interpreter
    got = make_plan(Problem(q, kx, w, 0.5, True, Visibility(), NEG_INF), 10, Tuning(capacity=124))
    assert (got.append, got.asm) == (1, False)


def test_append_rule_on_gpu():
    """Where there is PTX, the reserved append needs a thread per quarter row at most (inline PTX runs
    once per copy of an element, so copies would reserve and store twice): smaller tiles append per entry."""
    for bt, warps, want in [(64, 4, 3), (16, 4, 2), (32, 4, 3), (32, 8, 2), (64, 8, 3), (128, 8, 3)]:
        assert plan.append_kind(tile(bt=bt, warps=warps, append=None), 2000, 2, 125, asm=True) == (want, True), (
            bt, warps)
    assert plan.append_kind(score_tile.TILE, 2000, 2, 124, asm=True) == (3, True)  # few pass, few heads
    many = plan.RESERVED_APPEND_MAX_HEADS + 1
    assert plan.append_kind(score_tile.TILE, 2000, many, 124, asm=True) == (2, True)  # few pass, many heads


@pytest.mark.parametrize("backend_is_cuda", [True, False])
def test_plans_emit_ptx_only_where_triton_compiles_for_cuda(monkeypatch, backend_is_cuda):
    """A call's plan asks ``env.compiles_ptx`` whether its appends may be inline PTX: off the interpreter on an AMD
    build (Triton's target not CUDA) the per-entry append is the portable one, as under the interpreter."""
    from hyscale_compile.runtime import env

    monkeypatch.setattr(env, "interpreting", lambda: False)
    monkeypatch.setattr(env, "_targets_cuda", lambda: backend_is_cuda)
    many = plan.RESERVED_APPEND_MAX_HEADS + 1
    q, kx, w = inputs(B=1, T=2, H=many, D=16, S=2000, seed=23)
    got = make_plan(Problem(q, kx, w, 0.5, True, Visibility(), NEG_INF), 10, Tuning(capacity=124))
    assert (got.append, got.asm) == ((2, True) if backend_is_cuda else (1, False))


def test_compiles_ptx_asks_the_driver_once():
    """No PTX under the interpreter, whatever the driver; off it, the answer of Triton's active driver (none on a
    CPU-only machine), asked once a process."""
    from hyscale_compile.runtime import env

    assert env.interpreting() and not env.compiles_ptx()
    assert env._targets_cuda() == (torch.cuda.is_available() and torch.version.hip is None)
    assert env._targets_cuda.cache_info().currsize == 1


def test_descriptor_rule():
    """q and kx go through tensor descriptors only where both read as 2-D row-major views of 16-byte
    aligned memory and D is a power of two; everything else keeps the pointer path."""
    q, kx, w = inputs(B=2, T=5, H=2, D=16, S=40)
    tile = score_tile.TILE
    got = score_tile.tma_views(q, kx, tile)
    assert got["TMA"] and list(got["q_desc"].shape) == [10, 32] and list(got["k_desc"].shape) == [80, 16]
    assert list(got["q_desc"].block_shape) == [tile.bt, 16] and list(got["k_desc"].block_shape) == [tile.bs, 16]
    heads_first = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, D] memory seen as [B, T, H, D]
    wide = torch.zeros(2, 5, 2, 24, dtype=q.dtype)[..., :16]  # rows padded: H * D elements apart no more
    cases = {
        "heads first": (heads_first, kx), "row padding": (wide, kx), "D = 24": (inputs(D=24)[0], inputs(D=24)[1]),
        "kx shared by the batch": (q, kx[:1].expand(2, -1, -1)), "kx of batch 1 only": (q, kx[1:]),
        "unaligned base": (torch.zeros(2 * 5 * 2 * 16 + 1, dtype=q.dtype)[1:].view(2, 5, 2, 16), kx),
    }
    for name, (qq, kk) in cases.items():
        assert score_tile.tma_views(qq, kk, tile) == {}, name
    assert score_tile.tma_views(q, kx, dataclasses.replace(tile, tma=False)) == {}
    assert list(score_tile.tma_views(q[:1], kx[:1, 3:], tile)["k_desc"].shape) == [37, 16]  # one batch: any offset


def test_descriptor_rule_empty_and_filter_launch():
    """No descriptor for an empty operand (a TensorDescriptor needs every dimension > 0). Where there is
    PTX and q and kx go by descriptor, both appends of the filter run at 168 registers (none for the
    others); no options where the tile asks for its own append, cap or stages, where the tile is larger,
    or on the pointer path."""
    q, kx, w = inputs(B=1, T=2, H=2, D=16, S=40)
    assert score_tile.tma_views(q[:, :0], kx, score_tile.TILE) == {}
    assert score_tile.tma_views(q, kx[:, :0], score_tile.TILE) == {}
    assert Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF).descriptors
    options = plan.filter_options
    default = score_tile.TILE
    assert options(default, True, 2, False) == {}  # no PTX: no options
    assert options(default, True, 2, True) == {"maxnreg": 168}
    assert options(default, True, 3, True) == {"maxnreg": 168}
    assert options(default, True, 1, True) == {} and options(default, True, 0, True) == {}
    for change in [dict(append=3), dict(maxnreg=200), dict(stages=3), dict(bt=128)]:
        assert options(tile(**change), True, 3, True) == {} and options(tile(**change), True, 2, True) == {}, change
    assert options(default, False, 2, True) == {}  # the pointer path


@pytest.mark.parametrize("tma", [True, False])
def test_descriptor_and_pointer_paths(tma):
    """Both ways of reading q and kx give the reference's bits. The descriptor path reads whole tiles:
    rows past T are the next batch element's (here NaN and huge values) and keys past S the next
    batch's keys; the kernel must mask both exactly as it masks the pointer path's zeros."""
    q, kx, w = inputs(B=3, T=5, H=2, D=16, S=45, seed=31)
    q[1, 2:] = float("nan")
    kx[1, :3] = 1e4
    path = Tuning(tile=tile(tma=tma))
    assert bool(Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF, path.tile).descriptors) == tma
    check(q, kx, w, 6, vis=Visibility(causal=True, offset=38), tuning=path)
    check(q, kx, w, 6, vis=Visibility(starts=torch.tensor([[0, 5, 40, 41, 44]] * 3)), fill=-1.0, tuning=path)
    sampled = Tuning(tile=path.tile, capacity=16, target=12, samples=16)  # sampled threshold, filtered appends
    check(q, kx, w, 4, vis=Visibility(causal=True, offset=40), tuning=sampled)
    for append in (0, 1, 3):  # 32 keys a tile: the first lies inside every row's range (no range test)
        check(q, kx, w, 6, vis=Visibility(causal=True, offset=38),
              tuning=Tuning(tile=tile(tma=tma, bt=16, bs=32, append=append)))


@pytest.mark.parametrize("weights", [True, False])
def test_negative_scale_relu(weights):
    """relu(scale * x) with scale < 0 is evaluated as (scale * w) * min(x, 0): same selection."""
    q, kx, w = inputs(B=1, T=5, S=48, seed=16, weights=weights)
    check(q, kx, w, 7, scale=-0.25, vis=Visibility(causal=True, offset=40))


def test_rescore_shape_rule():
    """Keys x heads per rescore MMA: all heads (padded to 16 / 32 / 64, then groups of 64), 128 keys for
    16-bit operands at D <= 128, 64 where a stage would pass 32 KB (never fewer: another MMA than
    select's), and 64 x 16 for fp32 scored in ieee fp32 (a CUDA-core dot)."""
    shape = rescore.rescore_shape
    assert [shape(H, 128, 2, "ieee")[1] for H in (1, 16, 17, 32, 33, 64, 65, 200)] == [16, 16, 32, 32, 64, 64, 64, 64]
    assert shape(64, 128, 2, "ieee") == (128, 64)
    assert shape(16, 64, 2, "upcast") == (128, 16)
    assert shape(16, 256, 2, "ieee") == (64, 16)
    assert shape(16, 1024, 2, "ieee") == (64, 16)
    assert shape(64, 128, 4, "tf32") == (64, 64)
    assert shape(64, 128, 4, "ieee") == (64, 16)


@pytest.mark.parametrize("H,D,over,dtype,weights", [
    (19, 16, {}, torch.bfloat16, True),  # 32 heads per MMA
    (40, 16, {}, torch.bfloat16, True),  # 64 heads per MMA
    (40, 16, dict(W_ONCE=False), torch.bfloat16, True),
    (40, 64, {}, torch.float16, False),  # no weights: every head weighted by the scale
    (70, 16, {}, torch.bfloat16, True),  # a loop over groups of 64 heads, the second partial
    (19, 16, dict(MAX_BH=16), torch.bfloat16, True),  # groups of 16
    (40, 16, {}, torch.float32, True),  # ieee fp32: groups of 16
    (19, 16, dict(BJ=64, BLOCKS=1), torch.bfloat16, True),  # a row's 100 picks over two programs
    (40, 16, dict(MAX_BH=32, GROUPS=2), torch.bfloat16, True),  # two unrolled 32-head MMAs, the second partial
    (40, 16, dict(MAX_BH=16, GROUPS=4, W_ONCE=False), torch.bfloat16, True),  # three unrolled 16-head MMAs
    (40, 16, dict(MAX_BH=16, GROUPS=4), torch.bfloat16, False),  # unrolled groups, no weights
    (70, 16, dict(GROUPS=2), torch.bfloat16, True),  # two unrolled 64-head MMAs
    (70, 16, dict(MAX_BH=16, GROUPS=2), torch.bfloat16, True),  # past GROUPS: the runtime loop
    (19, 16, dict(BJ=128, STAGE_BYTES=65536, MAXNREG=128, WARPS=8), torch.bfloat16, True),  # launch knobs
    (40, 16, dict(QUAD=False), torch.bfloat16, True),  # 64 heads regrouped through shared memory, not the quads
    (19, 16, dict(QUAD=False), torch.bfloat16, False),
    (64, 16, {}, torch.float16, True),  # every head of the quad transpose's [128, 64] tile in use
])
def test_rescore_row_kernel_equals_tile_kernel(monkeypatch, H, D, over, dtype, weights):
    """The per-row rescore (one MMA over all heads, padded to 32 or 64, or a loop over groups of
    heads) against whole filter tiles (tests/kernels/rescore_tile.py), at any indices. Random fp32
    weights make every sum inexact, so a head taken out of order changes the bits (with the exact
    eighths of ``inputs`` it would not)."""
    for name, value in over.items():
        monkeypatch.setattr(rescore, "RESCORE_" + name, value)
    q, kx, _ = inputs(B=2, T=5, H=H, D=D, S=70, seed=17, dtype=dtype)
    w = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2)) if weights else None
    mask = torch.rand(1, 5, 70, generator=torch.Generator().manual_seed(1)) > 0.3
    vis = Visibility(causal=True, offset=60, mask=mask)
    idx = torch.randint(0, 70, (2, 5, 100))
    fast = hytopk.rescore(q, kx, w, idx, 0.5, True, vis, -7.0)
    slow = rescore_by_tiles(q, kx, w, idx, 0.5, True, vis, -7.0)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))


@pytest.mark.parametrize("case", ["overflow", "too_few"])
def test_recovery_exact(case):
    q, kx, w = inputs(B=2, T=2, S=120, seed=9)
    kw = dict(capacity=12, target=6, samples=32) if case == "overflow" else dict(capacity=64, target=1, samples=32)
    stats.reset()
    check(q, kx, w, 10, vis=Visibility(causal=True, offset=110), tuning=Tuning(**kw))
    s = stats.read()
    assert s.rows_recovered > 0 and s.fallbacks == 0


def test_recovery_ties_and_fill():
    """Recovery with every score tied and masked positions that beat the visible ones."""
    q, kx, w = inputs(B=1, T=3, S=120, seed=10)
    equal_kx = kx[:, :1].expand(1, 120, 16)
    stats.reset()
    tiny = Tuning(capacity=8, target=4, samples=16)
    check(q, equal_kx, w, 12, vis=Visibility(causal=True, offset=100), fill=50.0, tuning=tiny)
    check(q, kx, w, 12, vis=Visibility(starts=torch.tensor([[10, 60, 119]])), fill=NEG_INF, tuning=tiny)
    assert stats.read().rows_recovered > 0


def test_more_samples_than_a_row_buffer_holds():
    """M sample keys need M int32 per row: with a small k and capacity the row's own slots are too few,
    so they go to a buffer of their own (they once ran into the next row and past the buffer's end)."""
    q, kx, w = inputs(B=2, T=4, S=120, seed=13)
    vis = Visibility(causal=True, offset=116)
    tiny = Tuning(capacity=6, target=3, samples=64)
    pb = Problem(q, kx, w, 0.5, True, vis, NEG_INF)
    buf, samp, _ = sample.sample(pb, make_plan(pb, 5, tiny))
    assert buf.shape[1] * 2 < 64 and samp.shape == (8, 64) and samp.data_ptr() != buf.data_ptr()
    check(q, kx, w, 5, vis=vis, tuning=tiny)


def _sample_keys_reference(values, lo, hi, M: int, bt: int):
    """What sample_kernel writes: per query block, positions blo + (j * bctx) // M of the block's union
    range (j < min(bctx, M)); a row's key there if the position is in its own range, else INT32_MIN."""
    B, T, S = values.shape
    keys = torch.full((B, T, M), -(2**31), dtype=torch.int32)
    for b in range(B):
        for t0 in range(0, T, bt):
            rlo, rhi = lo[b, t0:t0 + bt], hi[b, t0:t0 + bt]
            blo = int(rlo[rhi > rlo].min()) if bool((rhi > rlo).any()) else S
            bctx = max(int(rhi.max()) - blo, 0)
            j = torch.arange(M)
            pos = blo + (j * bctx // M if bctx > M else j)
            ok = (j < min(bctx, M))[None, :] & (pos[None, :] >= rlo[:, None]) & (pos[None, :] < rhi[:, None])
            v = values[b, t0:t0 + bt][:, pos.clamp(max=S - 1)]
            keys[b, t0:t0 + bt] = torch.where(ok, reference.order_key(v), keys[b, t0:t0 + bt])
    return keys


@pytest.mark.parametrize("split", [None, 1])  # the default, and one program over every sample tile
@pytest.mark.parametrize("capacity", [16, 400])  # samples in a buffer of their own, and in the row's slots
@pytest.mark.parametrize("case", ["causal", "windows_mask"])
def test_sample_keys_match_reference(case, capacity, split):
    """The threshold only steers performance (results are exact whatever it is), so the sample keys get
    a test of their own: strided positions (701 keys, 300 samples: step 2, remainder 101), two query
    blocks, rows whose ranges differ, and a mask (masked positions in range are samples of value fill)."""
    B, T, S, M = 2, 70, 701, 300
    q, kx, w = inputs(B=B, T=T, S=S, seed=14)
    if case == "causal":
        vis = Visibility(causal=True, offset=S - T)
    else:
        g = torch.Generator().manual_seed(15)
        starts = torch.randint(0, 300, (B, T), generator=g)
        ends = starts + torch.randint(0, 400, (B, T), generator=g)
        vis = Visibility(starts=starts, ends=ends, mask=torch.rand(B, T, S, generator=g) < 0.8)
    pb = Problem(q, kx, w, 0.5, True, vis, -3.0)
    _, samp, msamp = sample.sample(pb, make_plan(pb, 5, Tuning(capacity=capacity, target=8, samples=M,
                                                               sample_split=split)))
    values = reference.value_rows(q, kx, w, 0.5, True, vis, -3.0, 0, T)
    want = _sample_keys_reference(values, pb.lo, pb.hi, M, pb.tile.bt).view(B * T, M)
    assert torch.equal(samp[:, :M], want)
    assert torch.equal(msamp, (want != -(2**31)).sum(1).to(torch.int32))


def _threshold_reference(samp, msamp, lo, hi, target, C, M):
    """Per row the ceil(target * m / ctx)-th largest of its M sample keys (int32 min where unused)."""
    out = torch.full((samp.shape[0],), -(2**31), dtype=torch.int32)
    for r in range(samp.shape[0]):
        ctx, m = int(hi[r] - lo[r]), int(msamp[r])
        rank = -(-target * m // max(ctx, 1))
        if ctx > C and 1 <= rank <= m:
            out[r] = samp[r, :M].sort(descending=True).values[rank - 1]
    return out


def test_threshold_is_the_ranked_sample():
    """The threshold kernel's bisection against a sort, on the real sample keys and on adversarial
    ones: all equal, ties at the rank, keys sharing their top bytes, the int32 extremes, negatives."""
    T, S, M, target, C = 64, 1000, 300, 40, 16
    q, kx, w = inputs(B=1, T=T, S=S, seed=21)
    pb = Problem(q, kx, w, 0.5, True, Visibility(causal=True, offset=S - T - 500), NEG_INF)
    pl = make_plan(pb, 5, Tuning(capacity=C, target=target, samples=M))
    buf, samp, msamp = sample.sample(pb, pl)
    g = torch.Generator().manual_seed(22)
    lo32, hi32 = -(2**31), 2**31 - 1
    patterns = [
        torch.full((M,), 7),
        torch.randint(0, 3, (M,), generator=g) * 1000,  # heavy ties wherever the rank falls
        0x12345600 + torch.randint(0, 256, (M,), generator=g),  # only the low byte differs
        torch.randint(lo32 + 1, hi32, (M,), generator=g, dtype=torch.int64),
        torch.tensor([hi32, lo32 + 1] * (M // 2)),
        -torch.randint(1, 50, (M,), generator=g),
    ]
    for i, pat in enumerate(patterns):  # rows 48.. keep their real samples
        samp[8 * i:8 * i + 8, :M] = pat.to(torch.int32)
        samp[8 * i + 1, M // 2:] = lo32  # some rows with fewer valid samples
    msamp = (samp[:, :M] != lo32).sum(1).to(torch.int32)
    keys = samp[:, :M].clone()
    thr = sample.threshold(pb, pl, buf, samp, msamp).key
    want = _threshold_reference(keys, msamp, pb.lo.view(-1), pb.hi.view(-1), target, C, M)
    assert (want != -(2**31)).sum() >= 60  # the rank rule applies to (almost) every row
    assert torch.equal(thr, want)


def test_past_64_rows_fallback_exact():
    q, kx, w = inputs(B=1, T=70, H=1, S=100, seed=11)
    stats.reset()
    check(q, kx, w, 6, vis=Visibility(causal=True, offset=30), tuning=Tuning(capacity=4, target=2, samples=16))
    s = stats.read()
    assert s.rows_recovered > 64 and s.fallbacks == 1


def test_rescore_matches_reference_on_any_indices():
    q, kx, w = inputs(B=2, T=5, S=40, seed=12)
    vis = Visibility(causal=True, offset=20, bias=eighths((1, 5, 40)).float())
    idx = torch.randint(0, 40, (2, 5, 9))
    r = hytopk.rescore(q, kx, w, idx, 0.5, True, vis, -7.0)
    assert same(r, reference.rescore(q, kx, w, idx, 0.5, True, vis, -7.0))


def test_random_inputs_near_ties():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 4, 3, 32, generator=g).to(torch.bfloat16)
    kx = torch.randn(1, 64, 32, generator=g).to(torch.bfloat16)
    w = torch.randn(1, 4, 3, generator=g)
    vis = Visibility(causal=True, offset=60)
    v, i = hytopk.select(q, kx, w, 10, 1 / math.sqrt(32), True, vis, NEG_INF, tuning=Tuning(table=False))
    rv, ri = reference.select(q, kx, w, 10, 1 / math.sqrt(32), True, vis, NEG_INF)
    assert_same_topk(v, i, rv, ri)
    tv, ti = hytopk.select(q, kx, w, 10, 1 / math.sqrt(32), True, vis, NEG_INF, tuning=Tuning(table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i)  # the same score bits


@pytest.mark.parametrize("table_max", [0, plan.TABLE_MAX_BYTES], ids=["pipeline", "table"])
def test_op_dispatch_and_repeatability(monkeypatch, table_max):
    monkeypatch.setattr(plan, "TABLE_MAX_BYTES", table_max)
    q, kx, w = inputs(B=1, T=4, S=32, seed=14)
    with dispatch.force_backend("triton"):
        a = torch.ops.hyscale.select(q, kx, w, 5, 0.5, True, True, 28, None, None, None, None, None, NEG_INF, True)
        b = torch.ops.hyscale.select(q, kx, w, 5, 0.5, True, True, 28, None, None, None, None, None, NEG_INF, True)
    rv, ri = reference.select(q, kx, w, 5, 0.5, True, Visibility(causal=True, offset=28), NEG_INF)
    assert same(a[0], rv) and torch.equal(a[1], ri)
    assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)) and torch.equal(a[1], b[1])


def _by_position(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (value, position) pairs in position order: a selection compared as a set."""
    indices, order = indices.sort(dim=-1)
    return values.gather(-1, order), indices


@pytest.mark.parametrize("backend", ["triton", "reference", "triton_table"])
def test_unsorted_select_end_to_end(monkeypatch, backend):
    """sorted=False through the operator, on both backends: each row's entries are the sorted selection's,
    with the same bits; the kernels give the order of their candidate slots (the final select kernel
    runs under the interpreter for it), the reference ascending positions; and neither is the sorted
    order, so a caller that relies on it is caught on the CPU too. The table route (a small call: these
    sizes) gives torch.topk's order, whatever that is."""
    table = backend == "triton_table"
    backend = backend.removesuffix("_table")
    monkeypatch.setattr(plan, "TABLE_MAX_BYTES", plan.TABLE_MAX_BYTES if table else 0)
    q, kx, w = inputs(B=1, T=4, S=48, seed=41)
    args = (q, kx, w, 6, 0.5, True, True, 44, None, None, None, None, None, NEG_INF)
    with dispatch.force_backend(backend):
        sv, si = torch.ops.hyscale.select(*args, True)
        uv, ui = torch.ops.hyscale.select(*args, False)
    rv, ri = reference.select(q, kx, w, 6, 0.5, True, Visibility(causal=True, offset=44), NEG_INF)
    assert same(sv, rv) and torch.equal(si, ri)
    pv, pi = _by_position(uv, ui)
    want_v, want_i = _by_position(rv, ri)
    assert torch.equal(pi, want_i) and torch.equal(pv.view(torch.int32), want_v.view(torch.int32))
    if not table:
        assert not torch.equal(ui, si), "the unsorted selection came back sorted"
    if backend == "reference":
        assert torch.equal(ui, want_i)  # ascending positions


def test_fill_bits_and_keys_tell_signed_zeros_apart():
    """The cached fill conversions: -0.0 == 0.0 as Python floats, but a fill of -0.0 must come back
    as -0.0 bits (masked picks carry the model's fill exactly), whichever was asked first."""
    assert problem.fill_bits(0.0) == 0
    assert problem.fill_bits(-0.0) == -(2**31)
    assert problem.fill_bits(0.0) == 0
    assert problem.fill_key(-0.0) == problem.fill_key(0.0)  # the order ranks them equal, like torch.topk
    nan = float("nan")
    assert problem.fill_bits(nan) == problem.fill_bits(float("nan"))


@pytest.mark.parametrize("case", ["causal_offsets", "partial_extras"])
def test_check_tails_meet_the_final_select_kernel(case):
    """Under the interpreter select() finishes with the reference, so here the check stage's real
    tails go through the final select kernel itself: rows that skip their extras (threshold above the
    fill), rows that read some or all of them, flagged rows; the fast path and the forced slow one."""
    q, kx, w = inputs(B=2, T=4, S=48, seed=40)
    k, relu, fill, kn = {
        "causal_offsets": (6, True, -1.0, dict(capacity=12, target=8, samples=16)),
        "partial_extras": (6, False, 0.5, dict(capacity=16, target=12, samples=16)),
    }[case]
    vis = {"causal_offsets": Visibility(causal=True, offset=10, offsets=torch.tensor([0, 30])),
           "partial_extras": Visibility(causal=True, offset=44)}[case]
    rv, ri = reference.select(q, kx, w, k, 0.5, relu, vis, fill)
    pb = Problem(q, kx, w, 0.5, relu, vis, fill)
    buf, used = hytopk.candidates(pb, make_plan(pb, k, Tuning(**kn)))
    tail, extras = used[2], (pb.S - (pb.hi - pb.lo)).clamp(max=k).reshape(-1)
    if case == "causal_offsets":  # rows that hold extras yet skip them, and rows that read all k
        assert bool(((tail == 0) & (extras > 0)).any()) and bool((tail == k).any())
    else:  # rows that read a few extras: their top k needs them
        assert bool(((tail > 0) & (tail < k)).any())
        cut = (used[0], used[1], torch.zeros_like(tail))
        assert not torch.equal(fs.select_rows_reference(buf, k, used)[1], fs.select_rows_reference(buf, k, cut)[1])
    for kw in (dict(), dict(cap=1)):
        v, i, _ = fs.select_sorted(buf.clone(), k, used=used, sample=32, chunk=64, list_chunk=32, warps=1, **kw)
        assert same(v.view(rv.shape), rv) and torch.equal(i.view(ri.shape), ri)
