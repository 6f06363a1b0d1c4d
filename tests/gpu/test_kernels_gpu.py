"""HyTopK kernels on a CUDA device at real sizes (skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

from hyscale_compile.runtime.reference import Visibility
from hyscale_compile.testing import assert_same_topk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEG_INF = float("-inf")


def _mods():
    from hyscale_compile.runtime import hytopk, reference, stats

    return hytopk, reference, stats


def tuning(**kw):
    """A Tuning of the pipeline (these tests' knobs are the pipeline's; small calls would take the table route)."""
    from hyscale_compile.runtime.plan import Tuning

    return Tuning(**{"table": False, **kw})


def exact_inputs(B, T, H, D, S, dtype=torch.bfloat16, seed=0):
    """Multiples of 1/8: every score is exact in any order, so results must match bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randint(-4, 5, (B, T, H, D), device="cuda", generator=g) / 8).to(dtype)
    kx = (torch.randint(-4, 5, (B, S, D), device="cuda", generator=g) / 8).to(dtype)
    w = (torch.randint(-2, 3, (B, T, H), device="cuda", generator=g) / 4).float()
    return q, kx, w


def same(a, b) -> bool:
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def sync_free_and_replayed(call):
    """``call()`` once with synchronization as an error, then captured into a CUDA graph (after a warm-up on a side
    stream) and replayed; returns (what the sync-free call returned, what the replay wrote)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


def check_exact(q, kx, w, k, vis, fill=NEG_INF, relu=True, scale=0.5, over=None):
    """The pipeline (``over``, or forced) against the reference, and the table route the same bits."""
    hytopk, reference, _ = _mods()
    v, i = hytopk.select(q, kx, w, k, scale, relu, vis, fill, tuning=over or tuning())
    rv, ri = reference.select(q, kx, w, k, scale, relu, vis, fill)
    assert same(v, rv)
    assert torch.equal(i, ri)
    r = hytopk.rescore(q, kx, w, i, scale, relu, vis, fill)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))
    tv, ti = hytopk.select(q, kx, w, k, scale, relu, vis, fill, tuning=tuning(table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i), "table route != pipeline"
    return v, i


@pytest.mark.parametrize("H,D,k", [(16, 128, 2048), (64, 128, 512), (1, 64, 1024), (5, 64, 100)])
def test_exact_causal(H, D, k):
    q, kx, w = exact_inputs(1, 300, H, D, 20000, seed=H)
    check_exact(q, kx, w, k, Visibility(causal=True, offset=20000 - 300))


def test_exact_windows_mask_bias_fill():
    B, T, S = 2, 130, 9000
    q, kx, w = exact_inputs(B, T, 8, 128, S, dtype=torch.float16, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    starts = torch.randint(0, S, (B, T), device="cuda", generator=g)
    ends = (starts + torch.randint(0, 5000, (B, T), device="cuda", generator=g)).clamp(max=S)
    mask = torch.rand(1, 1, S, device="cuda", generator=g) > 0.2
    bias = (torch.randint(-4, 5, (T, S), device="cuda", generator=g) / 8).float()
    check_exact(q, kx, w, 700, Visibility(starts=starts, ends=ends, mask=mask, bias=bias), fill=-3.0)
    check_exact(q, kx, None, 256, Visibility(causal=True, offset=-5), relu=False)


def test_forced_recovery_and_fallback_exact():
    _, _, stats = _mods()
    q, kx, w = exact_inputs(1, 200, 4, 64, 12000, seed=5)
    vis = Visibility(causal=True, offset=12000 - 200)
    stats.reset()
    check_exact(q, kx, w, 256, vis, over=tuning(capacity=280, target=300))  # most rows overflow: > 64 flagged
    s = stats.read()
    assert s.rows_recovered > 64 and s.fallbacks == 1
    stats.reset()
    q1 = q[:, :40].contiguous()
    check_exact(q1, kx, w[:, :40].contiguous(), 256, Visibility(causal=True, offset=12000 - 40),
                over=tuning(capacity=280, target=300))
    s = stats.read()
    assert 0 < s.rows_recovered <= 64 and s.fallbacks == 0


@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 64),
                                     (torch.bfloat16, 19), (torch.bfloat16, 80), (torch.float32, 40)])
def test_random_near_ties(dtype, H):
    """Random values: near-tie rule against the reference; rescore still bitwise equal to select
    (one MMA over all heads per block of keys, padded to 16, 32 or 64; at 80 heads a loop over groups
    of 64; ieee fp32 operands a loop over groups of 16)."""
    hytopk, reference, _ = _mods()
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1, 256, H, 128, device="cuda", generator=g).to(dtype)
    kx = torch.randn(1, 32768, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(1, 256, H, device="cuda", generator=g)
    vis = Visibility(causal=True, offset=32768 - 256)
    v, i = hytopk.select(q, kx, w, 2048, 1 / math.sqrt(128), True, vis, NEG_INF, tuning=tuning())
    rv, ri = reference.select(q, kx, w, 2048, 1 / math.sqrt(128), True, vis, NEG_INF)
    assert_same_topk(v, i, rv, ri, rtol=1e-4, atol=1e-4)
    r = hytopk.rescore(q, kx, w, i, 1 / math.sqrt(128), True, vis, NEG_INF)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))
    # the table route scores with the filter's tile through pointers (the filter here by descriptor): same bits
    tv, ti = hytopk.select(q, kx, w, 2048, 1 / math.sqrt(128), True, vis, NEG_INF, tuning=tuning(table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i)


@pytest.mark.parametrize("dtype,H", [(torch.bfloat16, 16), (torch.float16, 64), (torch.bfloat16, 5)])
def test_descriptor_path_same_bits(dtype, H):
    """The filter reading q and kx by tensor descriptor (TMA) selects the very bits of the pointer path
    and of the pointer-gathered rescore; two batch elements, T not a multiple of the tile, S not a
    multiple of the key tile (whole-tile reads past a batch's rows and keys must be masked)."""
    import dataclasses

    from hyscale_compile.runtime import score_tile
    from hyscale_compile.runtime.problem import Problem

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm_90 or newer")
    hytopk, _, _ = _mods()
    g = torch.Generator(device="cuda").manual_seed(12)
    B, T, S = 2, 200, 30001
    q = torch.randn(B, T, H, 128, device="cuda", generator=g).to(dtype)
    kx = torch.randn(B, S, 128, device="cuda", generator=g).to(dtype)
    w = torch.randn(B, T, H, device="cuda", generator=g)
    vis = Visibility(causal=True, offset=S - T)
    desc = tuning(tile=dataclasses.replace(score_tile.TILE, tma=True))
    assert Problem(q, kx, w, 0.1, True, vis, NEG_INF, desc.tile).descriptors, "descriptors expected on sm_90+"
    v, i = hytopk.select(q, kx, w, 1024, 0.1, True, vis, NEG_INF, tuning=desc)
    ptr = tuning(tile=dataclasses.replace(score_tile.TILE, tma=False))
    pv, pi = hytopk.select(q, kx, w, 1024, 0.1, True, vis, NEG_INF, tuning=ptr)
    assert torch.equal(v.view(torch.int32), pv.view(torch.int32)) and torch.equal(i, pi)
    r = hytopk.rescore(q, kx, w, i, 0.1, True, vis, NEG_INF)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))


@pytest.mark.parametrize("H,over", [(64, {}), (32, {}), (48, {}), (64, {"MAX_BH": 32, "GROUPS": 2})])
def test_rescore_quad_shuffles_taken_and_same_bits(H, over, monkeypatch):
    """The rescore regroups each key's heads by warp shuffles here (its compiled layout passes the check) and
    gives select's bits: random values (every sum inexact), NaN keys, a run of tied keys, two batch elements and
    300 picks a row (a partial last block); the path through shared memory gives the same bits. A second call
    launches the checked variant by fast_launch's launcher."""
    from hyscale_compile.runtime import rescore

    hytopk, _, _ = _mods()
    for name, value in over.items():
        monkeypatch.setattr(rescore, "RESCORE_" + name, value)
    g = torch.Generator(device="cuda").manual_seed(H)
    B, T, S = 2, 37, 5000
    q = torch.randn(B, T, H, 128, device="cuda", generator=g).bfloat16()
    kx = torch.randn(B, S, 128, device="cuda", generator=g)
    kx[:, ::97] = float("nan")
    kx[:, 1000:1200] = kx[:, 1000:1001]
    kx = kx.bfloat16()
    w = torch.randn(B, T, H, device="cuda", generator=g)
    vis = Visibility(causal=True, offset=S - T)
    v, i = hytopk.select(q, kx, w, 300, 0.1, True, vis, NEG_INF)
    rescore._SHUFFLES_HOLD.clear()
    r = hytopk.rescore(q, kx, w, i, 0.1, True, vis, NEG_INF)
    assert rescore._SHUFFLES_HOLD and all(rescore._SHUFFLES_HOLD.values()), "the shuffles' layout check failed"
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))
    from hyscale_compile.runtime import fast_launch

    if fast_launch.FAST:  # the next call finds its checked variant kept: no pass through Triton's binder at all
        binder = []
        run = rescore.rescore_kernel.run
        with monkeypatch.context() as m:
            m.setattr(rescore.rescore_kernel, "run", lambda *a, **kw: binder.append(kw) or run(*a, **kw))
            r = hytopk.rescore(q, kx, w, i, 0.1, True, vis, NEG_INF)
        assert not binder and torch.equal(r.view(torch.int32), v.view(torch.int32))
    monkeypatch.setattr(rescore, "RESCORE_QUAD", False)
    r = hytopk.rescore(q, kx, w, i, 0.1, True, vis, NEG_INF)
    assert torch.equal(r.view(torch.int32), v.view(torch.int32))


def test_long_context_million_keys():
    q, kx, w = exact_inputs(1, 16, 4, 64, 1 << 20, seed=7)
    check_exact(q, kx, w, 512, Visibility(causal=True, offset=(1 << 20) - 16))


def test_repeatable_and_sync_free():
    hytopk, _, _ = _mods()
    q, kx, w = exact_inputs(1, 512, 16, 128, 65536, seed=8)
    q = q + torch.randn_like(q) * 0.01  # non-exact values: order of atomics must still not matter
    vis = Visibility(causal=True, offset=65536 - 512)
    v0, i0 = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs = [hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF) for _ in range(10)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for v, i in runs:
        assert torch.equal(v.view(torch.int32), v0.view(torch.int32)) and torch.equal(i, i0)


def test_recovery_sync_free_and_graph_capture():
    hytopk, _, _ = _mods()
    q, kx, w = exact_inputs(1, 64, 8, 128, 16384, seed=9)
    vis = Visibility(causal=True, offset=16384 - 64)
    small = tuning(capacity=700, target=350)

    def select():
        return hytopk.select(q, kx, w, 512, 0.5, True, vis, NEG_INF, tuning=small)

    ref = select()
    for out in sync_free_and_replayed(select):
        assert torch.equal(out[0].view(torch.int32), ref[0].view(torch.int32)) and torch.equal(out[1], ref[1])


@pytest.mark.parametrize("bs,masked,windows", [(128, False, True), (128, True, True), (128, False, False),
                                               (256, True, True)])
def test_reserved_append_capacity_contract(bs, masked, windows):
    """tests/filter_contract.py with the reserved append in PTX (the interpreter runs its triton twin):
    counts, rows within the capacity exact, overflowed rows holding only passing entries, nothing
    written past the capacity or the last row; at the default 128 keys a tile and at 256."""
    import filter_contract

    q, kx, w = exact_inputs(1, 70, 4, 64, 3000, seed=7)
    cnt, C = filter_contract.check(q, kx, w.abs() + 0.25, 64, append=3, bs=bs, masked=masked, windows=windows)
    assert (cnt > C).sum() >= 2 and (cnt <= C).sum() >= 2


@pytest.mark.parametrize("family", ["all_equal", "relu_zero_majority"])
def test_tie_rows_need_no_recovery(family):
    """Every key scoring the same, or most keys 0 after the ReLU (the k-th value is 0): the threshold sits on a
    tie group; the filter keeps what beats it and the tie stage the group's lowest positions, exactly, with no
    row recovered (these rows all overflowed before)."""
    hytopk, _, stats = _mods()
    q, kx, w = exact_inputs(1, 512, 16, 128, 131072, seed=7)
    if family == "all_equal":
        w = torch.zeros_like(w)
    else:
        q, kx, w = q.abs() + 0.125, -(kx.abs() + 0.125), w.abs()
        pos = torch.randperm(131072, device="cuda")[:1000]
        kx[:, pos] = -kx[:, pos]
    stats.reset()
    check_exact(q, kx, w, 2048, Visibility(causal=True, offset=131072 - 512))
    assert stats.read().rows_recovered == 0


@pytest.mark.parametrize("T,S,H", [(1, 32768, 64), (4, 131072, 16), (64, 131072, 64), (16, 1 << 20, 64)])
def test_table_route_at_decode_shapes(T, S, H):
    """Decode shapes take the table route by default; it selects the pipeline's bits (random values: every
    sum inexact, so only the same arithmetic gives the same bits), sorted and unsorted (the same entries),
    without a sync, and from a CUDA graph. T=64 at 131072 keys and T=16 at 2**20 are past the captured limit,
    within the uncaptured one: the plan says so, and a default call captured into a graph (then the pipeline's)
    returns the same bits."""
    hytopk, _, _ = _mods()
    from hyscale_compile.runtime import plan as plan_mod
    from hyscale_compile.runtime.problem import Problem

    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(1, T, H, 128, device="cuda", generator=g).bfloat16()
    kx = torch.randn(1, S, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, T, H, device="cuda", generator=g)
    vis = Visibility(causal=True, offset=S - T)
    pb = Problem(q, kx, w, 0.1, True, vis, NEG_INF)
    assert plan_mod.make_plan(pb, 2048).table == (T * S * 8 <= plan_mod.TABLE_MAX_BYTES * plan_mod.EAGER_TABLE_FACTOR)
    v, i = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, tuning=tuning())
    tv, ti = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, tuning=tuning(table=True))
    assert torch.equal(tv.view(torch.int32), v.view(torch.int32)) and torch.equal(ti, i)
    uv, ui = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, sorted=False, tuning=tuning(table=True))
    order = ui.sort(-1)
    want = i.sort(-1)
    assert torch.equal(order.values, want.values)
    assert torch.equal(uv.gather(-1, order.indices).view(torch.int32), v.gather(-1, want.indices).view(torch.int32))
    table = tuning(table=True)
    _, (gv, gi) = sync_free_and_replayed(lambda: hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, tuning=table))
    assert torch.equal(gv.view(torch.int32), v.view(torch.int32)) and torch.equal(gi, i)
    # the default route of a captured call, which differs from the uncaptured one past TABLE_MAX_BYTES
    assert plan_mod.table_route(T, S, captured=True) == (T * S * 8 <= plan_mod.TABLE_MAX_BYTES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gv, gi = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gv.view(torch.int32), v.view(torch.int32)) and torch.equal(gi, i)


def _decode_family(family, T, S, H, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, 128, device="cuda", generator=g)
    kx = torch.randn(1, S, 128, device="cuda", generator=g)
    w = torch.randn(1, T, H, device="cuda", generator=g)
    if family == "all_equal":  # the weight projection starts at zero: every visible key scores 0
        w = torch.zeros_like(w)
    elif family == "relu_zero_majority":  # ReLU zeroes every head but for every 64th key: the k-th value is 0
        q, kx, w = q.abs(), -kx.abs(), w.abs()
        kx[:, ::64] = kx[:, ::64].abs()
    elif family == "dup_keys":  # 64 distinct keys repeated: exact ties everywhere
        kx = kx[:, torch.arange(S, device="cuda") % 64]
    return q.bfloat16(), kx.bfloat16(), w


@pytest.mark.parametrize("family", ["random", "all_equal", "relu_zero_majority", "dup_keys"])
@pytest.mark.parametrize("T,S,H,k", [(1, 32768, 16, 2048), (16, 131072, 64, 2048), (3, 5001, 5, 100),
                                     (2, 1 << 20, 16, 2048)])
def test_own_ranker_same_bits(family, T, S, H, k):
    """The table route's own rankers (table_rank.py: one program a row, or the row's pass split over programs)
    give torch.topk's ranking of the same table and the pipeline's bits, on tie-heavy rows too; their slow path
    (a list too small for the row, no pivots) as well."""
    hytopk, _, _ = _mods()
    from hyscale_compile.runtime import table_path, table_rank
    from hyscale_compile.runtime.final_sort import decode
    from hyscale_compile.runtime.problem import Problem

    q, kx, w = _decode_family(family, T, S, H)
    vis = Visibility(causal=True, offset=S - T)
    want = hytopk.select(q, kx, w, k, 0.1, True, vis, NEG_INF, tuning=tuning())
    for ranker in ("row", "split", "topk"):
        got = hytopk.select(q, kx, w, k, 0.1, True, vis, NEG_INF, tuning=tuning(table=True, ranker=ranker))
        assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32)) and torch.equal(got[1], want[1])
    comp = table_path.composites(Problem(q, kx, w, 0.1, True, vis, NEG_INF))
    ref_v, ref_i = decode(torch.topk(comp, k, dim=-1).values)
    for kw in ({}, dict(cap=1), dict(ranks=(-1, 10**6)), dict(split=8192), dict(split=8192, cap=1)):
        v, i = table_rank.rank(comp, k, **kw)
        assert torch.equal(v.view(torch.int32), ref_v.view(torch.int32)) and torch.equal(i, ref_i), kw


@pytest.mark.parametrize("ranker", ["row", "split"])
def test_own_ranker_sync_free_and_in_a_graph(ranker):
    """A decode call with our rankers neither synchronizes nor fails to capture, and replays its bits."""
    hytopk, _, _ = _mods()
    T, S, H = 4, 131072, 16
    q, kx, w = _decode_family("random", T, S, H)
    vis = Visibility(causal=True, offset=S - T)
    own = tuning(table=True, ranker=ranker)
    v, i = hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, tuning=own)
    _, (gv, gi) = sync_free_and_replayed(lambda: hytopk.select(q, kx, w, 2048, 0.1, True, vis, NEG_INF, tuning=own))
    assert torch.equal(gv.view(torch.int32), v.view(torch.int32)) and torch.equal(gi, i)


def test_eager_indexer_topk_calls_the_body_sync_free_and_in_a_graph():
    """The by-hand decode call runs the op's body without the op's dispatch: the op's bits, no sync, and it
    captures in a CUDA graph (the table route: its two launches)."""
    import hyscale_compile

    T, S, H = 4, 32768, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, T, H, 128, device="cuda", generator=g).bfloat16()
    kx = torch.randn(1, S, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, T, H, device="cuda", generator=g)

    def call():
        return hyscale_compile.indexer_topk(q, kx, 2048, weights=w, scale=0.1, query_offset=S - T)

    v, i = call()
    ov, oi = torch.ops.hyscale.select(q, kx, w, 2048, 0.1, True, True, S - T, None, None, None, None, None, NEG_INF,
                                      True)
    assert torch.equal(v.view(torch.int32), ov.view(torch.int32)) and torch.equal(i, oi)
    _, (gv, gi) = sync_free_and_replayed(call)
    assert torch.equal(gv.view(torch.int32), v.view(torch.int32)) and torch.equal(gi, i)


@pytest.mark.parametrize("ranker", ["row", "split"])
def test_fast_launch_is_taken_and_gives_tritons_bits(ranker, monkeypatch):
    """On the device the table route's launches take fast_launch's direct path after their first call (the
    variants are kept on the kernels), and a decode sequence whose context grows by a key a step gives the bits of
    Triton's own path at every step, a row length and divisibility the kept variants were not first made with
    included."""
    from hyscale_compile.runtime import fast_launch, table_path, table_rank

    if not fast_launch.FAST:
        pytest.skip("the fast path is for Triton 3.6")
    hytopk, _, _ = _mods()
    T, H = 4, 16
    own = tuning(table=True, ranker=ranker)
    q, kx, w = _decode_family("random", T, 40000, H)
    for S in (32768 + 16, 32768 + 17, 32768 + 18, 33000):
        vis = Visibility(causal=True, offset=S - T)
        fast = hytopk.select(q, kx[:, :S], w, 2048, 0.1, True, vis, NEG_INF, tuning=own)
        with monkeypatch.context() as m:
            m.setattr(fast_launch, "FAST", False)
            slow = hytopk.select(q, kx[:, :S], w, 2048, 0.1, True, vis, NEG_INF, tuning=own)
        assert torch.equal(fast[0].view(torch.int32), slow[0].view(torch.int32)) and torch.equal(fast[1], slow[1]), S
    kernels = [table_path.table_kernel] + ([table_rank.rank_kernel] if ranker == "row"
                                           else [table_rank.split_pass_kernel, table_rank.split_finish_kernel])
    assert all(fast_launch._layout(k).variants for k in kernels)
