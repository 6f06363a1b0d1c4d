"""The table route (runtime/table_path.py) under the interpreter: the pipeline's selection, bit for bit.

Small calls write their int64 composite table and rank it with torch.topk instead of running the pipeline;
the result must not tell the routes apart. Each case runs both routes (forced with ``Tuning.table``) and
the reference: values and indices of the table route equal the pipeline's bitwise (sorted), and the
reference's too where every score is exact (multiples of 1/8); on random values, whose sums round,
the reference agrees by the near-tie rule. sorted=False gives each row's same entries.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_compile.runtime import hytopk, plan, reference
from hyscale_compile.runtime.plan import Tuning, make_plan
from hyscale_compile.runtime.problem import Problem
from hyscale_compile.runtime.reference import Visibility
from hyscale_compile.testing import assert_same_topk

NEG_INF = float("-inf")
PIPELINE, TABLE = Tuning(table=False), Tuning(table=True, ranker="topk")
ROW_RANK, SPLIT_RANK = Tuning(table=True, ranker="row"), Tuning(table=True, ranker="split")


def eighths(shape, gen, dtype=torch.bfloat16, lo=-4, hi=5):
    return (torch.randint(lo, hi, shape, generator=gen) / 8).to(dtype)


def exact_inputs(B=2, T=5, H=2, D=16, S=300, dtype=torch.bfloat16, weights=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, kx = eighths((B, T, H, D), g, dtype), eighths((B, S, D), g, dtype)
    w = (torch.randint(-2, 3, (B, T, H), generator=g) / 4).float() if weights else None
    return q, kx, w


def random_inputs(B=2, T=5, H=3, D=32, S=300, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, D, generator=g).to(dtype), torch.randn(B, S, D, generator=g).to(dtype),
            torch.randn(B, T, H, generator=g))


def bits(v: torch.Tensor) -> torch.Tensor:
    return v.view(torch.int32)


def by_position(v: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    i, order = i.sort(dim=-1)
    return v.gather(-1, order), i


ALL_VISIBLE = Visibility()


def routes(q, kx, w, k, vis=ALL_VISIBLE, fill=NEG_INF, scale=0.5, relu=True, exact=True, rankers=False):
    """Both routes and the reference; returns the table route's (values, indices). ``rankers``: the table route
    with our rankers too (one program a row, and the split pass where S >= 128), the same bits (the interpreter runs
    their programs one by one: asked for once per class of input)."""
    args = (q, kx, w, k, scale, relu, vis, fill)
    pv, pi = hytopk.select(*args, tuning=PIPELINE)
    tv, ti = hytopk.select(*args, tuning=TABLE)
    assert torch.equal(bits(tv), bits(pv)), f"values differ from the pipeline's:\n{tv}\n{pv}"
    assert torch.equal(ti, pi), f"indices differ from the pipeline's:\n{ti}\n{pi}"
    for ranker in ((ROW_RANK, SPLIT_RANK) if kx.shape[1] >= 128 else (ROW_RANK,)) if rankers else ():
        ov, oi = hytopk.select(*args, tuning=ranker)
        assert torch.equal(bits(ov), bits(pv)) and torch.equal(oi, pi), f"{ranker.ranker} ranker:\n{ov}\n{pv}\n{oi}\n{pi}"
    rv, ri = reference.select(*args)
    if exact:  # NaN as any NaN (the reference keeps a NaN's bits, the kernels give the canonical one)
        same = (tv == rv) | (tv.isnan() & rv.isnan())
        assert bool(same.all()) and torch.equal(ti, ri), f"reference differs:\n{tv}\n{rv}\n{ti}\n{ri}"
    else:
        assert_same_topk(tv, ti, rv, ri)
    uv, ui = hytopk.select(*args, sorted=False, tuning=TABLE)
    (sv, si), (wv, wi) = by_position(uv, ui), by_position(tv, ti)
    assert torch.equal(si, wi) and torch.equal(bits(sv), bits(wv)), "sorted=False: not the same entries"
    return tv, ti


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_values_causal(dtype):
    """Fresh random values (sums that round): only the same arithmetic gives the pipeline's bits."""
    q, kx, w = random_inputs(dtype=dtype, seed=1)
    routes(q, kx, w, 37, Visibility(causal=True, offset=295), scale=32**-0.5, exact=False)


def test_exact_values_match_reference():
    q, kx, w = exact_inputs(seed=2)
    routes(q, kx, w, 37, Visibility(causal=True, offset=295), rankers=True)
    routes(q, kx, w, 20, relu=False)  # no causal mask, no ReLU


@pytest.mark.parametrize("weights,scale,relu", [(False, 0.5, True), (True, -0.25, True), (False, -0.5, False)])
def test_one_head_no_weights_negative_scale(weights, scale, relu):
    q, kx, w = exact_inputs(B=1, T=3, H=1, S=200, weights=weights, seed=3)
    routes(q, kx, w, 13, Visibility(causal=True, offset=197), scale=scale, relu=relu)


def test_ties_all_equal_and_duplicate_keys():
    q, kx, w = exact_inputs(B=1, T=4, S=260, seed=4)
    routes(q, kx[:, :1].expand(1, 260, 16).contiguous(), w, 40, rankers=True)  # every key the same: positions decide
    g = torch.Generator().manual_seed(5)
    routes(q, kx[:, torch.randint(0, 4, (260,), generator=g)], w, 40, Visibility(causal=True, offset=250), rankers=True)


def test_relu_zeros():
    """Most keys score 0 after the ReLU (the k-th value is 0), and -0.0 equals +0.0."""
    q, kx, w = exact_inputs(B=1, T=4, S=260, seed=6)
    q, kx, w = q.abs() + 0.125, -(kx.abs() + 0.125), w.abs()
    kx[:, [7, 50, 51, 90, 140]] *= -1
    _, i = routes(q, kx, w, 21, rankers=True)
    assert (i[..., :5].sort(-1).values == torch.tensor([7, 50, 51, 90, 140])).all()
    routes(-q, kx, w, 21, relu=False)  # negative scores: -0.0 never below +0.0


def test_nan_and_inf():
    q, kx, w = exact_inputs(B=1, T=4, S=150, seed=7)
    q[0, 1, 0, 2] = float("nan")  # row 1: every score NaN (ranks above +inf)
    q[0, 2, 1, 0] = float("inf")
    kx[0, 11, 3] = float("nan")
    routes(q, kx, w, 9, relu=False)
    routes(q, kx, w, 9, Visibility(causal=True, offset=140), rankers=True)


@pytest.mark.parametrize("fill", [NEG_INF, -1.0, 0.0, float("inf"), float("nan")])
def test_few_visible_keys(fill):
    """More queries than keys and a causal offset below 0: early rows see fewer than k keys or none; their
    masked picks follow, lowest position first, with the fill (which may outrank every visible key)."""
    q, kx, w = exact_inputs(B=1, T=9, S=7, seed=8)
    routes(q, kx, w, 5, Visibility(causal=True, offset=-3), fill=fill, rankers=fill in (NEG_INF, float("nan")))


def test_all_masked_rows_mask_and_bias():
    B, T, S = 2, 5, 140
    q, kx, w = exact_inputs(B=B, T=T, S=S, seed=9)
    g = torch.Generator().manual_seed(10)
    mask = torch.rand(B, T, S, generator=g) > 0.3
    mask[1, 2] = False  # a row with no visible key
    key_mask = torch.rand(B, 1, S, generator=g) > 0.4  # padding: one mask over the keys of each sequence
    bias = eighths((T, S), g).float()
    bias[1, 3] = NEG_INF
    bias[2, 5] = float("nan")
    routes(q, kx, w, 11, Visibility(mask=mask), fill=-2.0)
    routes(q, kx, w, 11, Visibility(causal=True, offset=130, mask=key_mask, bias=bias), rankers=True)
    routes(q, kx, w, 11, Visibility(bias=eighths((B, 1, S), g, torch.float16), mask=key_mask[:, :, :1].expand(
        B, 1, S)), fill=0.5)


def test_windows_and_per_sequence_offsets():
    B, T, S = 2, 6, 170
    q, kx, w = exact_inputs(B=B, T=T, S=S, seed=11)
    starts = torch.tensor([[0, 2, 50, 90, 168, 3], [1, 1, 1, 0, 129, 169]])
    ends = torch.tensor([[4, 170, 120, 100, 170, 3], [170, 2, 25, 170, 140, 170]])
    routes(q, kx, w, 9, Visibility(starts=starts, ends=ends), fill=-5.0, rankers=True)
    routes(q, kx, w, 9, Visibility(causal=True, offsets=torch.tensor([3, 160]), starts=starts))


def test_ranges_one_key_into_a_tile():
    """Ranges [127, 129) and [255, 257): one key in the last position of a key tile and one in the first of
    the next (128 keys a tile). A tile outside every range of its query block is not scored; these are in."""
    q, kx, w = exact_inputs(B=1, T=2, S=300, seed=16)
    routes(q, kx, w, 6, Visibility(starts=torch.tensor([[127, 255]]), ends=torch.tensor([[129, 257]])), fill=-9.0)


def test_additive_causal():
    q, kx, w = exact_inputs(B=2, T=5, S=140, seed=12)
    q[0, 2, 1, 3] = float("nan")  # NaN behind the additive mask stays NaN (ranks first)
    routes(q, kx, w, 8, Visibility(causal=True, offset=130, causal_additive=True))


def test_odd_sizes():
    """S not a multiple of the key tile, T of the query tile, k not a power of two, k = S."""
    q, kx, w = exact_inputs(B=1, T=67, H=3, D=24, S=131, seed=13)
    routes(q, kx, w, 19, Visibility(causal=True, offset=70))
    q, kx, w = exact_inputs(B=1, T=1, H=3, D=24, S=37, seed=14)
    routes(q, kx, w, 37, rankers=True)


def _problem(B, T, S, H=64, D=128):
    """A Problem of the given sizes over broadcast views (no memory of that size): for the plan only."""
    q = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16).expand(B, T, H, D)
    kx = torch.zeros(1, 1, D, dtype=torch.bfloat16).expand(B, S, D)
    return Problem(q, kx, None, 1.0, True, Visibility(causal=True, offset=S - T), NEG_INF)


def test_plan_routes_decode_to_the_table_and_prefill_to_the_pipeline():
    # the plan of an uncaptured call (a CPU call never is captured): the table route up to 2x the captured limit
    for B, T, S in [(1, 1, 32768), (1, 16, 131072), (1, 64, 131072), (1, 256, 32768), (1, 16, 1 << 20),
                    (8, 1, 131072), (1, 256, 131072), (1, 32, 1 << 20)]:
        assert make_plan(_problem(B, T, S), 2048).table, (B, T, S)
    for B, T, S in [(1, 4096, 131072), (1, 512, 131072), (1, 64, 1 << 20), (2, 4096, 8192), (2, 256, 131072)]:
        assert not make_plan(_problem(B, T, S), 2048).table, (B, T, S)
    limit = plan.TABLE_MAX_BYTES // 8  # keys of one row whose int64 table fills the captured limit
    assert plan.table_route(1, limit, captured=True) and not plan.table_route(1, limit + 1, captured=True)
    eager = limit * plan.EAGER_TABLE_FACTOR
    assert plan.table_route(1, eager, captured=False) and not plan.table_route(1, eager + 1, captured=False)
    assert plan.table_route(16, 1 << 20, captured=True) and not plan.table_route(256, 131072, captured=True)
    assert plan.table_route(256, 131072, captured=False)
    decode, prefill = _problem(1, 1, 32768), _problem(1, 4096, 131072)
    assert not make_plan(decode, 2048, PIPELINE).table and make_plan(prefill, 2048, TABLE).table  # forced
    assert make_plan(decode, 2048).filter_options == {}  # the table route builds no descriptors
    assert plan.table_plan(2048).table and plan.table_plan(2048).k == 2048  # what select runs there


def test_operator_takes_the_table_route():
    """Through the operator (what a compiled model calls): a small call is the table route's, bitwise."""
    from hyscale_compile.runtime import dispatch

    q, kx, w = random_inputs(B=1, T=3, S=200, seed=15)
    with dispatch.force_backend("triton"):
        v, i = torch.ops.hyscale.select(q, kx, w, 16, 0.25, True, True, 197, None, None, None, None, None, NEG_INF,
                                        True)
    tv, ti = hytopk.select(q, kx, w, 16, 0.25, True, Visibility(causal=True, offset=197), NEG_INF, tuning=TABLE)
    assert torch.equal(bits(v), bits(tv)) and torch.equal(i, ti)


def test_ranges_kept_per_sizes_are_the_computed_ones():
    """Causal ranges with an int offset are kept per sizes (a decode step's host work): each equals the ranges
    computed afresh, a new offset gets its own, and the kept lo is shared, never written."""
    from hyscale_compile.runtime import problem

    cpu = torch.device("cpu")
    for B, T, S, off in [(1, 1, 50, 49), (1, 1, 50, 20), (2, 3, 40, 37), (1, 4, 40, -2), (1, 4, 40, 60)]:
        for causal in (True, False):
            vis = Visibility(causal=causal, offset=off)
            lo, hi = problem.ranges(vis, B, T, S, cpu)
            again = problem.ranges(vis, B, T, S, cpu)
            assert again[0] is lo and again[1] is hi  # kept
            want_hi = (torch.arange(T) + off + 1).clamp(0, S) if causal else torch.full((T,), S)
            assert torch.equal(lo.expand(B, T), torch.zeros(B, T, dtype=torch.int64))
            assert torch.equal(hi.expand(B, T), want_hi.expand(B, T)), (B, T, S, off, causal)
    windows = Visibility(causal=True, offset=5, starts=torch.tensor([[2]]))  # windows: computed every call
    assert problem.ranges(windows, 1, 1, 10, cpu)[0] is not problem.ranges(windows, 1, 1, 10, cpu)[0]


def test_values_kernel_decodes_as_the_torch_ops():
    """final_sort.values (one launch) gives decode_values' bits for every kind of key: NaN, infinities, both
    zeros (canonical +0), negatives, the fill, any position."""
    from hyscale_compile.runtime import final_sort

    g = torch.Generator().manual_seed(3)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -1.5, 1e-45, -1e-45])
    floats = torch.cat([special, torch.randn(1200, generator=g)])
    key = bits(floats)
    key = torch.where(floats == 0, 0, key)
    key = torch.where(floats.isnan(), 0x7FC00000, key)
    key = torch.where(key >= 0, key, key ^ 0x7FFFFFFF).long()
    pos = torch.randint(0, 2**31, key.shape, generator=g)
    comp = ((key << 32) | (2**32 - 1 - pos)).view(3, 1, -1)  # [B, T, k] as torch.topk returns it
    got, want = final_sort.values(comp), final_sort.decode_values(comp)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(bits(got), bits(want))


def test_problem_statics_are_kept_per_tile_and_flags():
    """Problem keeps its tile copy, constexprs and launch options per their inputs: the same call shares them,
    another tile, scale sign or weights gets its own, and a tile changed in place after is a new key."""
    import dataclasses

    from hyscale_compile.runtime import score_tile

    q, kx, w = exact_inputs()
    a, b = (Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF) for _ in range(2))
    assert a.consts is b.consts and a.tile is b.tile
    c = Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF, dataclasses.replace(score_tile.TILE, bt=32))
    assert c.consts["BT"] == c.tile.bt == 32 and a.consts["BT"] == a.tile.bt == score_tile.TILE.bt
    d = Problem(q, kx, None, -0.5, True, ALL_VISIBLE, NEG_INF)
    assert d.consts["HAS_W"] is False and d.consts["ACT"] != a.consts["ACT"]
    with pytest.raises(TypeError):
        a.consts["BT"] = 1  # shared: read only
    bs = score_tile.TILE.bs
    score_tile.TILE.bs = bs // 2
    try:
        e = Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF)
        assert e.consts["BS"] == e.tile.bs == bs // 2 and a.consts["BS"] == a.tile.bs == bs
    finally:
        score_tile.TILE.bs = bs


def test_the_route_rule_asks_the_stream_whether_it_captures(monkeypatch):
    """The plan's capture test is torch's own (a CPU build has none to call, so it is stood in for here)."""
    from hyscale_compile.runtime import problem

    cuda = torch.device("cuda")
    for state in (True, False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda state=state: state)
        assert problem.capturing(cuda) is state
    assert problem.capturing(torch.device("cpu")) is False


def _composites(values: torch.Tensor) -> torch.Tensor:
    """The table kernel's composites of fp32 ``values`` [..., W] (reference.order_key, position low)."""
    key = reference.order_key(values.float()).to(torch.int64)
    return (key << 32) | (0xFFFFFFFF - torch.arange(values.shape[-1]))


@pytest.mark.parametrize("kw", [{}, dict(cap=1), dict(ranks=(-1, 10**6)), dict(split=64), dict(split=128, cap=1)])
def test_own_ranker_is_topk_of_the_composites(kw):
    """table_rank.rank against torch.topk over the same composites, decoded: random rows, ties, an all-equal
    row, NaN, -0.0 and -inf fills, k = 1 and k = W; forced slow paths (a list of one slot, no pivots) give the
    same bits, and so does a row's pass split over programs (slots taken by atomics; the fast path's edges are
    test_own_ranker_at_the_fast_paths_edges')."""
    from hyscale_compile.runtime.final_sort import decode
    from hyscale_compile.runtime.table_rank import rank

    g = torch.Generator().manual_seed(17)
    v = torch.randn(2, 3, 150, generator=g)
    v[0, 1] = torch.randint(0, 3, (150,), generator=g).float()  # three values: ties everywhere
    v[0, 2] = 1.0  # all equal: positions decide
    v[1, 0, ::7] = float("nan")
    v[1, 1, 40:] = float("-inf")  # few visible keys, the rest filled
    v[1, 2, ::2] = -0.0
    comp = _composites(v)
    for k in (1, 37, 150):
        got_v, got_i = rank(comp, k, **kw)
        want_v, want_i = decode(torch.topk(comp, k, dim=-1).values)
        assert torch.equal(bits(got_v), bits(want_v)) and torch.equal(got_i, want_i), (k, kw)


def test_plan_picks_the_ranker(monkeypatch):
    """Off the interpreter the table route ranks rows of up to RANK_MAX_KEYS keys with one program a row, and so
    from RANK_SPLIT_MAX_ROWS rows; fewer, longer rows with the split pass; k past the in-register sort with
    torch.topk. A tuning forces any, and names one of them."""
    monkeypatch.setattr(plan, "interpreting", lambda: False)
    top, rows = plan.RANK_MAX_KEYS, plan.RANK_SPLIT_MAX_ROWS
    assert plan.table_ranker(2048, 1, top) == "row" and plan.table_ranker(2048, 1, top + 1) == "split"
    assert plan.table_ranker(2048, rows - 1, 1 << 20) == "split" and plan.table_ranker(2048, rows, top + 1) == "row"
    assert plan.table_ranker(4096, 1, 32768) == "topk"  # past final_sort.SORT_MAX
    monkeypatch.setattr(plan, "RANK_SPLIT", False)
    assert plan.table_ranker(2048, 1, top + 1) == "topk"
    assert plan.table_ranker(2048, 1, 1 << 20, ROW_RANK) == "row" and plan.table_ranker(2048, 1, 32768, TABLE) == "topk"
    with pytest.raises(ValueError, match="Tuning.ranker"):
        plan.table_ranker(2048, 1, 32768, Tuning(ranker="radix"))
    with pytest.raises(ValueError, match="at most 2048 winners"):
        plan.table_ranker(4096, 1, 32768, ROW_RANK)
    monkeypatch.undo()
    assert plan.table_ranker(2048, 1, 32768) == "topk"  # the interpreter's default


def _pass_counts(row: torch.Tensor, samples: int, ranks: tuple[int, int]) -> tuple[int, int]:
    """(sure winners, list entries) of table_rank's pass over one row of composites, on the host: the pivots are
    ranks of the sorted strided sample (no rank there: no hi pivot, every entry >= lo)."""
    W = row.numel()
    samp = row[(torch.arange(samples) * W) // samples].sort(descending=True).values
    hi = samp[ranks[0]].item() if 0 <= ranks[0] < samples else None
    lo = samp[ranks[1]].item() if 0 <= ranks[1] < samples else None
    sure = row >= hi if hi is not None else torch.zeros_like(row, dtype=torch.bool)
    mid = ~sure & (row >= lo if lo is not None else True)
    return int(sure.sum()), int(mid.sum())


@pytest.mark.parametrize("split", [None, 32])
def test_own_ranker_at_the_fast_paths_edges(split):
    """The fast path with its sure winners spread over several chunks (and programs, split), at each edge of its
    test n_hi < k <= n_hi + n_mid, n_mid <= cap: k = n_hi + 1 (one winner from the list), k = n_hi + n_mid (the
    whole list), the list exactly full, and one past each edge (k = n_hi: the winners fill the output before the
    slow path rewrites it; k past the list; the list one short, its entries dropped). The counts are checked on the
    host, so the case keeps its path if the sizes change."""
    from hyscale_compile.runtime.final_sort import decode
    from hyscale_compile.runtime.table_rank import rank

    g = torch.Generator().manual_seed(5)
    v = torch.randn(2, 300, generator=g)
    v[1] = torch.randint(0, 5, (300,), generator=g).float()  # ties: the list's k-th among equal values
    comp = _composites(v)
    sizes = dict(samples=32, chunk=32, list_chunk=32, warps=1, ranks=(8, 20), split=split)
    n_hi, n_mid = _pass_counts(comp[0], 32, (8, 20))
    assert n_hi > 2 * 32 and n_mid > 32, (n_hi, n_mid)  # sure winners in three chunks, a list of two or more
    cases = [(n_hi + 1, n_mid, True), (n_hi + n_mid, n_mid, True), (n_hi + 5, n_mid - 1, False), (n_hi, n_mid, False),
             (n_hi + n_mid + 1, n_mid, False)]
    for k, cap, fast in cases:
        assert (n_hi < k <= n_hi + n_mid and n_mid <= cap) is fast  # row 0's path; row 1's is whichever
        got_v, got_i = rank(comp, k, cap=cap, **sizes)
        want_v, want_i = decode(torch.topk(comp, k, dim=-1).values)
        assert torch.equal(bits(got_v), bits(want_v)) and torch.equal(got_i, want_i), (k, cap, split)


def test_own_ranker_short_rows_and_shapes():
    """Rows shorter than the sample (it repeats entries), of one key, k = 1 and k = W, ties across the sample's
    repeats; any leading dims (none, several, an empty one) give torch.topk's shapes."""
    from hyscale_compile.runtime.final_sort import decode
    from hyscale_compile.runtime.table_rank import rank

    g = torch.Generator().manual_seed(9)
    for W in (1, 2, 3, 5, 15):
        comp = _composites(torch.randint(0, 2, (2, W), generator=g).float())
        for k in sorted({1, (W + 1) // 2, W}):
            for kw in ({}, dict(split=64)):
                got_v, got_i = rank(comp, k, **kw)
                want_v, want_i = decode(torch.topk(comp, k, dim=-1).values)
                assert torch.equal(bits(got_v), bits(want_v)) and torch.equal(got_i, want_i), (W, k, kw)
    for shape in ((9,), (1, 2, 1, 9), (2, 0, 9), (0, 9)):
        comp = _composites(torch.randn(shape, generator=g))
        got_v, got_i = rank(comp, 4)
        want_v, want_i = decode(torch.topk(comp, 4, dim=-1).values)
        assert got_v.shape == got_i.shape == want_i.shape, shape
        assert torch.equal(bits(got_v), bits(want_v)) and torch.equal(got_i, want_i), shape


def test_table_launch_zeroes_the_split_rankers_counters():
    """The table's launch zeroes the split ranker's counters (its first program, before the pass reads them), a
    launch of their own fewer; every one of them, at sizes past the kernel's step of 256 too; and the table is the
    one it writes without them."""
    from hyscale_compile.runtime.table_path import composites

    q, kx, w = random_inputs(B=1, T=3, S=40)
    pb = Problem(q, kx, w, 0.5, True, ALL_VISIBLE, NEG_INF)
    want = composites(pb)
    for n in (2, 6, 300, 513):
        zero = torch.full((n,), 7, dtype=torch.int32)
        assert torch.equal(composites(pb, zero), want) and not zero.any(), n


def test_split_keys_is_a_wave_of_whole_chunks():
    """split_keys: whole RANK_CHUNKs, the fewest with which the pass is one wave of SPLIT_WAVE programs per SM; one
    chunk where the rows are too few to fill it."""
    from hyscale_compile.runtime.table_rank import RANK_CHUNK, SPLIT_WAVE, split_keys

    sms = 132
    wave = SPLIT_WAVE * sms
    assert split_keys(1, 131072, sms) == RANK_CHUNK and split_keys(1, 1 << 20, sms) == RANK_CHUNK
    for rows in (1, 3, 16, 64, 127):
        for W in (32769, 131072, 1 << 20, 3_000_001):
            seg = split_keys(rows, W, sms)
            per_row = -(-W // seg)
            assert seg % RANK_CHUNK == 0 and seg >= RANK_CHUNK, (rows, W)
            assert rows * per_row <= wave or seg == RANK_CHUNK, (rows, W, seg)
            if seg > RANK_CHUNK:  # one chunk less would pass the wave
                assert rows * -(-W // (seg - RANK_CHUNK)) > wave, (rows, W, seg)


@pytest.mark.parametrize("causal", [True, False])
def test_table_forms_the_ranges_it_need_not_read(causal, monkeypatch):
    """Where the ranges follow from the sizes (Problem.first), the table kernel forms them and reads no lo and hi:
    its table is the one it writes from problem.ranges' tensors, at offsets that clamp below and above, that end
    inside the first key tile and past S, and lo and hi are then never built."""
    from hyscale_compile.runtime import problem
    from hyscale_compile.runtime.table_path import composites

    B, S = 2, 150
    for T, offsets in ((5, (-8, -5, -2, 0, 3, 60, S - 5, S, S + 9)), (70, (-71, 0, 63, S - 70, S))):  # 70: two row blocks
        q, kx, w = random_inputs(B=B, T=T, S=S, H=2, D=16)
        for offset in (offsets if causal else (0,)):
            vis = Visibility(causal=causal, offset=offset)
            pb = Problem(q, kx, w, 0.5, True, vis, -7.0)
            assert pb.first is not None and -T <= pb.first <= S
            got = composites(pb)
            assert "_ranges" not in pb.__dict__, offset  # lo and hi were not built
            with monkeypatch.context() as m:
                m.setattr(problem.Problem, "first", property(lambda self: None))
                assert torch.equal(got, composites(Problem(q, kx, w, 0.5, True, vis, -7.0))), (T, offset)
    if causal:  # the additive causal mask with a finite fill is a bias on all keys: first = S, the bias does the rest
        additive = Visibility(causal=True, offset=S - T - 4, causal_additive=True)
        pb = Problem(q, kx, w, 0.5, True, additive, -7.0)
        assert pb.first == S
        got = composites(pb)
        with monkeypatch.context() as m:
            m.setattr(problem.Problem, "first", property(lambda self: None))
            assert torch.equal(got, composites(Problem(q, kx, w, 0.5, True, additive, -7.0)))
    windows = Problem(q, kx, w, 0.5, True, Visibility(causal=causal, starts=torch.full((B, T), 2)), NEG_INF)
    assert windows.first is None


@pytest.mark.parametrize("scale", [0.1, -0.3])
@pytest.mark.parametrize("layout", ["dense", "broadcast", "permuted", "sliced", "fp16"])
def test_weights_times_scale_rounded_as_torch_rounds_it(layout, scale):
    """The kernels multiply each weight by the scale (an fp32 argument): one rounding, torch's. With one head and
    exact dots (eighths) each value is that product times the dot, rounded once, so a product rounded another way
    (the scale applied to the dot, or in fp64) changes bits. Weights of every layout the op hands over: dense, a
    broadcast view (stride 0), permuted and sliced strides, 16-bit; select on both routes, the reference and the
    rescore of the picks agree bit for bit."""
    B, T, S = 2, 5, 200
    q, kx, _ = exact_inputs(B=B, T=T, H=1, S=S, seed=7)
    g = torch.Generator().manual_seed(8)
    w = {"dense": lambda: torch.randn(B, T, 1, generator=g),
         "broadcast": lambda: torch.randn(B, 1, 1, generator=g).expand(B, T, 1),
         "permuted": lambda: torch.randn(T, B, 1, generator=g).permute(1, 0, 2),
         "sliced": lambda: torch.randn(B, 2 * T, 1, generator=g)[:, ::2],
         "fp16": lambda: torch.randn(B, T, 1, generator=g).half()}[layout]()
    vis = Visibility(causal=True, offset=S - T)
    values, indices = routes(q, kx, w, 13, vis, scale=scale, rankers=layout == "dense")
    again = hytopk.rescore(q, kx, w, indices, scale, True, vis, NEG_INF)
    assert torch.equal(bits(again), bits(values))
