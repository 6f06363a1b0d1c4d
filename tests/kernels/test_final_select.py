"""The final select (each row's exact top k of a raw candidate buffer), bitwise against its reference.

Without a GPU the kernel runs in the Triton interpreter, so sizes stay tiny and most cases use a small
sample (the interpreter's sort is slow); a few go through ``select_rows`` with the defaults. The GPU
test at the end runs the real sizes.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from hyscale_compile.runtime import final_pivots, final_sort, plan, reference
from hyscale_compile.runtime import final_select as fs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -1
SMALL = dict(sample=32, chunk=64, list_chunk=32, warps=1)  # several chunks per row even at W ~ 100


def raw(values: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Raw entries: the fp32 bits high, the position low."""
    bits = values.float().contiguous().view(torch.int32).long()
    return (bits << 32) | pos.long()


def bits_of(x: float | int) -> int:
    """The int32 bit pattern of a float, or the int itself (an exact NaN payload)."""
    if isinstance(x, int):
        return x - (1 << 32) if x >= 1 << 31 else x
    return struct.unpack("<i", struct.pack("<f", x))[0]


def rows_of(values, R: int, W: int, n_valid, *, seed: int, max_pos: int | None = None,
            packed: bool = False) -> torch.Tensor:
    """[R, W] raw buffer: row r holds n_valid[r] entries with unique random positions, the rest empty.

    values: [R, W] fp32 tensor (or int32 bit patterns); empty slots are scattered, or at the end if packed.
    """
    g = torch.Generator().manual_seed(seed)
    bits = values if values.dtype == torch.int32 else values.float().view(torch.int32)
    pos = torch.stack([torch.randperm(4 * W, generator=g)[:W] for _ in range(R)])
    if max_pos is not None:
        pos = max_pos - pos  # the largest positions
    buf = (bits.long() << 32) | pos
    n_valid = torch.as_tensor(n_valid).expand(R).reshape(R, 1)
    rank = torch.arange(W).expand(R, W) if packed else torch.rand(R, W, generator=g).argsort(1).argsort(1)
    return torch.where(rank < n_valid, buf, torch.full_like(buf, SENTINEL)).to(DEV)


def check(buf: torch.Tensor, k: int, fast: bool | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """select == reference, bit for bit: with kw both the in-kernel sort (select_sorted) and the
    composites through torch.sort (select_composites); without kw select_rows."""
    ref_v, ref_i = fs.select_rows_reference(buf, k, kw.get("used"))
    if kw:
        comp, took = fs.select_composites(buf, k, **kw)
        results = [(*final_sort.decode(torch.sort(comp, dim=1, descending=True).values), took)]
        results.append(fs.select_sorted(buf, k, **kw))
    else:
        results = [(*fs.select_rows(buf, k), None)]
    for values, indices, took in results:
        if fast is not None and took is not None:
            assert bool((took == int(fast)).all()), f"fast path per row {took.tolist()}, wanted {fast}"
        assert values.dtype == torch.float32 and indices.dtype == torch.int64 and values.shape == (buf.shape[0], k)
        assert torch.equal(values.view(torch.int32), ref_v.view(torch.int32)), f"values differ:\n{values}\n{ref_v}"
        assert torch.equal(indices, ref_i), f"indices differ:\n{indices}\n{ref_i}"
    return values, indices


def brute_force(buf: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's top k by a Python sort: (canonical value bits, positions)."""
    def rank(b: int) -> tuple[int, float]:
        v = struct.unpack("<f", struct.pack("<i", b))[0]
        return (1, 0.0) if math.isnan(v) else (0, v + 0.0)  # NaN above everything, -0.0 == +0.0

    out_v, out_i = [], []
    for row in buf.tolist():
        entries = [(e >> 32, e & 0xFFFFFFFF) for e in row if e != SENTINEL]
        best = sorted(entries, key=lambda e: (rank(e[0]), -e[1]), reverse=True)[:k]
        canon = [0x7FC00000 if rank(b)[0] else bits_of(rank(b)[1]) for b, _ in best]
        out_v.append(canon)
        out_i.append([p for _, p in best])
    return out_v, out_i


SPECIALS = [float("nan"), -float("nan"), 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0xFF800001, float("inf"),
            -float("inf"), 0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38]


def special_values(R: int, W: int, seed: int) -> torch.Tensor:
    """int32 bit patterns: NaNs of both signs and several payloads, infinities, signed zeros, denormals."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(SPECIALS) + 4, (R, W), generator=g)
    pool = torch.tensor([bits_of(x) for x in SPECIALS], dtype=torch.int32)
    rnd = (torch.randint(-3, 4, (R, W), generator=g) / 2).float().view(torch.int32)
    return torch.where(pick < len(SPECIALS), pool[pick.clamp(max=len(SPECIALS) - 1)], rnd)


def test_reference_against_brute_force():
    R, W, k = 4, 40, 9
    buf = rows_of(special_values(R, W, seed=1), R, W, [9, 20, 33, 40], seed=2)
    ref_v, ref_i = fs.select_rows_reference(buf, k)
    want_v, want_i = brute_force(buf.cpu(), k)
    assert ref_v.view(torch.int32).tolist() == want_v
    assert ref_i.tolist() == want_i


def test_decode_matches_reference_decode():
    R, W = 3, 50
    buf = rows_of(special_values(R, W, seed=3), R, W, W, seed=4)
    comp, _ = fs.select_composites(buf, W, **SMALL)
    v, i = final_sort.decode(torch.sort(comp, dim=1, descending=True).values)
    ref_v, ref_i = fs.select_rows_reference(buf, W)
    assert torch.equal(v.view(torch.int32), ref_v.view(torch.int32)) and torch.equal(i, ref_i)


@pytest.mark.parametrize("R,W,k", [(4, 300, 10), (3, 257, 64), (5, 97, 1), (2, 128, 128), (3, 131, 130)])
def test_random_values_scattered_empties(R, W, k):
    g = torch.Generator().manual_seed(W + k)
    values = torch.randn(R, W, generator=g)
    n_valid = torch.randint(k, W + 1, (R,), generator=g)
    check(rows_of(values, R, W, n_valid, seed=k), k, **SMALL)


def test_public_entry_default_sizes():
    """select_rows with its defaults: a short row (W < sample: it repeats in the sample) and a longer one."""
    g = torch.Generator().manual_seed(5)
    check(rows_of(torch.randn(2, 37, generator=g), 2, 37, [37, 12], seed=6), 5)
    check(rows_of(torch.randn(2, 700, generator=g), 2, 700, [700, 300], seed=7, packed=True), 90)


def test_all_equal_values():
    R, W, k = 3, 150, 20
    check(rows_of(torch.full((R, W), 0.5), R, W, [150, 60, 20], seed=8), k, fast=True, **SMALL)


def test_ties_at_the_kth_value_break_by_position():
    R, W, k = 4, 200, 30
    g = torch.Generator().manual_seed(9)
    values = torch.randint(0, 4, (R, W), generator=g).float()  # four values: ties straddle the k-th
    values[:, :3] = float("nan")
    check(rows_of(values, R, W, [200, 150, 90, 30], seed=10), k, fast=True, **SMALL)


def test_signed_zeros_come_back_positive():
    R, W, k = 3, 120, 40
    g = torch.Generator().manual_seed(11)
    values = torch.where(torch.rand(R, W, generator=g) < 0.5, 0.0, -0.0)
    values[:, ::7] = -1.0
    values[0, ::5] = 2.0
    v, _ = check(rows_of(values, R, W, [120, 80, 40], seed=12), k, fast=True, **SMALL)
    assert bool((v == 0).any()) and not bool((v.view(torch.int32) == bits_of(-0.0)).any())


def test_nan_payloads_and_infinities():
    R, W = 4, 160
    buf = rows_of(special_values(R, W, seed=13), R, W, [160, 100, 41, 40], seed=14)
    for k in (1, 17, 40):
        check(buf, k, **SMALL)
    v, _ = fs.select_rows_reference(buf, 40)
    nan = torch.isnan(v)
    assert bool(nan.any()) and bool((v.view(torch.int32)[nan] == 0x7FC00000).all())


def test_exactly_k_entries():
    R, W, k = 3, 180, 25
    g = torch.Generator().manual_seed(15)
    check(rows_of(torch.randn(R, W, generator=g), R, W, k, seed=16), k, **SMALL)
    check(rows_of(torch.randn(R, W, generator=g), R, W, k, seed=17, packed=True), k, **SMALL)


def test_k_equals_w_and_k_one():
    R, W = 3, 77
    g = torch.Generator().manual_seed(18)
    buf = rows_of(torch.randn(R, W, generator=g), R, W, W, seed=19)
    check(buf, W, **SMALL)
    check(buf, 1, **SMALL)
    check(rows_of(torch.randn(R, W, generator=g), R, W, [1, 40, 77], seed=20), 1, **SMALL)
    v, i = fs.select_rows(torch.empty(0, W, dtype=torch.int64, device=DEV), 5)
    assert v.shape == i.shape == (0, 5)


def test_largest_positions():
    R, W, k = 3, 140, 33
    g = torch.Generator().manual_seed(21)
    values = torch.randint(-2, 3, (R, W), generator=g).float()  # ties, so positions decide
    check(rows_of(values, R, W, [140, 90, 33], seed=22, max_pos=2**31 - 2), k, **SMALL)


def test_slow_path_is_exact():
    """A list too small for the entries between the pivots: every row selects over its whole buffer."""
    R, W, k = 3, 230, 31
    g = torch.Generator().manual_seed(23)
    values = torch.randint(-3, 4, (R, W), generator=g) / 4
    buf = rows_of(values, R, W, [230, 120, 31], seed=24, max_pos=2**31 - 2)
    check(buf, k, fast=False, **dict(SMALL, cap=1))
    check(buf, k, fast=False, **dict(SMALL, ranks=(0, 0)))  # hi == lo: nothing between them


def test_pivot_edges():
    """Pivots past either end of the sample, an upper pivot with k or more above it, empty slots as pivots."""
    R, W, k = 3, 100, 12
    g = torch.Generator().manual_seed(25)
    full = rows_of(torch.randn(R, W, generator=g), R, W, W, seed=26)
    sparse = rows_of(torch.randn(R, W, generator=g), R, W, [50, 30, 12], seed=27)
    for buf in (full, sparse):
        check(buf, k, fast=True, **dict(SMALL, ranks=(-1, 32), cap=W))  # no pivots: the whole row is the list
        check(buf, k, **dict(SMALL, ranks=(-1, 31), cap=W))  # lo may be an empty slot (it admits no empties)
    check(full, k, fast=False, **dict(SMALL, ranks=(31, 32), cap=W))  # hi is the lowest sample: >= k above it
    check(sparse, k, fast=True, **dict(SMALL, ranks=(31, 32), cap=W))  # hi an empty slot: nothing is sure


def test_unused_slots_are_never_read():
    """used = (counts, C): slots [counts[r], C) hold garbage (the filter's unused candidate slots, old
    samples) that must not count; the extras after C do, and so do sentinels among them."""
    R, W, C, k = 4, 160, 120, 14
    g = torch.Generator().manual_seed(30)
    buf = rows_of(torch.randint(-4, 5, (R, W), generator=g) / 2, R, W, W, seed=31)
    garbage = raw(torch.full((R, W), 1e30), torch.arange(W).expand(R, W))  # would win everything if read
    counts = torch.tensor([0, 7, 60, C], dtype=torch.int32)
    slot = torch.arange(W)
    hole = (slot >= counts.view(-1, 1)) & (slot < C)
    buf = torch.where(hole.to(DEV), garbage.to(DEV), buf)
    buf[0, C + 20:] = SENTINEL  # row 0: 20 extras only
    used = (counts.to(DEV), C)
    v, _ = check(buf, k, used=used, **SMALL)
    assert not bool((v == 1e30).any())
    check(buf, k, fast=False, used=used, **dict(SMALL, cap=1))  # the slow path jumps the hole too
    check(buf, 20, used=used, **dict(SMALL, ranks=(-1, 32), cap=W))
    v2, i2 = fs.select_rows(buf, k, used)
    r2 = fs.select_rows_reference(buf, k, used)
    assert torch.equal(v2.view(torch.int32), r2[0].view(torch.int32)) and torch.equal(i2, r2[1])


def test_slots_past_the_tail_are_never_read():
    """used = (counts, C, tail): of the slots from C only the first tail[r] count (the check stage sets
    tail = 0 where the row's threshold lies above the fill); the rest hold garbage that would win. Both
    paths, a tail of every length, and the reference, which must agree with a buffer cut to its tails."""
    R, W, C, k = 4, 160, 120, 14
    g = torch.Generator().manual_seed(40)
    buf = rows_of(torch.randint(-4, 5, (R, W), generator=g) / 2, R, W, W, seed=41)
    counts = torch.tensor([C, 50, 14, 30], dtype=torch.int32)
    tail = torch.tensor([0, 3, W - C, 0], dtype=torch.int32)  # row 2: its top k needs its extras
    slot = torch.arange(W)
    past = slot >= C + tail.view(-1, 1)
    garbage = raw(torch.full((R, W), 1e30), slot.expand(R, W))
    buf = torch.where(past.to(DEV), garbage.to(DEV), buf)
    used = (counts.to(DEV), C, tail.to(DEV))
    v, _ = check(buf, k, used=used, **SMALL)
    assert not bool((v == 1e30).any())
    check(buf, k, fast=False, used=used, **dict(SMALL, cap=1))
    check(buf, k, used=used, **dict(SMALL, row_lists=True, cap=W))
    cut = torch.where(past.to(DEV), SENTINEL, buf)
    assert all(torch.equal(a, b) for a, b in zip(fs.select_rows_reference(buf, k, used),
                                                 fs.select_rows_reference(cut, k, used[:2])))


@pytest.mark.parametrize("case", ["rooms", "pool", "no_pool"])
def test_row_lists(case):
    """row_lists: each row's list in its own unused slots [counts[r], C), or where fewer than list_room
    of those are left, in a list of the pool; with no pool list left such a row selects over its whole
    buffer. Every path is exact, and the slots the select reads stay as they were."""
    R, W, C, k = 3, 300, 260, 10
    room = final_pivots.list_room(k, W, SMALL["sample"])
    counts, fast, pool, ranks = {
        "rooms": ([20, 30, C - room], True, 0, None),  # every row has room (the last exactly enough)
        "pool": ([150, 250, C], True, R, (-1, 31)),  # none has: each takes a pool list
        "no_pool": ([150, 250, C], False, 0, (-1, 31)),  # nor a pool list: the whole row
    }[case]
    g = torch.Generator().manual_seed(34)
    buf = rows_of(torch.randint(-6, 7, (R, W), generator=g) / 2, R, W, W, seed=35)  # ties at the k-th
    counts_t = torch.tensor(counts, dtype=torch.int32).to(DEV)
    read = ((torch.arange(W) < counts_t.cpu().view(-1, 1)) | (torch.arange(W) >= C)).to(DEV)
    before = buf.clone()
    check(buf, k, fast=fast, **dict(SMALL, used=(counts_t, C), row_lists=True, pool=pool, ranks=ranks, cap=W))
    assert torch.equal(buf[read], before[read])
    assert torch.equal(buf, before) == (case == "pool")  # a row with a pool list writes nothing in its own slots


def test_row_lists_need_used_and_the_rule_picks_them():
    buf = rows_of(torch.randn(2, 50), 2, 50, 50, seed=36)
    with pytest.raises(AssertionError, match="row_lists"):
        fs.select_composites(buf, 5, row_lists=True, **SMALL)
    from hyscale_compile.runtime.reference import Visibility

    def rule(k, S, vis):
        target, cap, _ = plan.sizes(k, S)
        return plan.row_lists(k, S, target, cap, vis)

    T = 4096
    for k, S in ((2048, 131072), (2048, 524288), (512, 262144), (16, 2**20), (1024, 65536)):
        # every row sampled: queries at the end of a long context, or no causal limit at all
        assert rule(k, S, Visibility(causal=True, offset=S - T)), (k, S)
        assert rule(k, S, Visibility()), (k, S)
    _, cap, _ = plan.sizes(2048, 131072)
    assert rule(2048, 131072, Visibility(causal=True, offset=cap))  # row 0 sees cap + 1 keys
    assert not rule(2048, 131072, Visibility(causal=True, offset=cap - 1))  # row 0 sees cap: not sampled
    assert not rule(2048, 131072, Visibility(causal=True))  # a prefill: its first rows keep every key
    assert not rule(2048, 131072, Visibility(causal=True, offset=10**6, offsets=torch.zeros(1)))  # unknown
    assert not rule(2048, 131072, Visibility(starts=torch.zeros(1, T), ends=torch.full((1, T), 9000)))
    assert not rule(2048, 8000, Visibility())  # not sampled at all: a row may fill all its slots
    assert final_pivots.lists_fit_rows(2048, 13824, final_pivots.list_room(2048, 13824))
    assert not final_pivots.lists_fit_rows(2048, 13824, final_pivots.list_room(2048, 13824) - 1)


def _row_sorted(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows put in (value desc, position asc) order, as the reference returns them."""
    comp = (reference.order_key(values).long() << 32) | (0xFFFFFFFF - indices)
    order = torch.sort(comp, dim=1, descending=True).indices
    return values.gather(1, order), indices.gather(1, order)


@pytest.mark.parametrize("sort_max", [2048, 16])  # in-kernel decode, and composites + decode past it
def test_unsorted_rows_hold_the_same_entries(sort_max, monkeypatch):
    """sorted=False: each row's k winners, decoded where they lie, in an order that repeats run to run."""
    monkeypatch.setattr(final_sort, "SORT_MAX", sort_max)
    R, W, k = 3, 150, 21
    g = torch.Generator().manual_seed(32)
    buf = rows_of(torch.randint(-3, 4, (R, W), generator=g) / 2, R, W, [150, 90, 60], seed=33, packed=True)
    used = (torch.tensor([100, 60, 40], dtype=torch.int32).to(DEV), 120)  # row 1: slots 60..89 are stale
    ref_v, ref_i = fs.select_rows_reference(buf, k, used)
    v, i, _ = fs.select_sorted(buf, k, used=used, sort=False, **SMALL)
    v2, i2, _ = fs.select_sorted(buf, k, used=used, sort=False, **SMALL)
    assert torch.equal(v.view(torch.int32), v2.view(torch.int32)) and torch.equal(i, i2)
    assert not torch.equal(i, ref_i)  # not sorted by chance (the test would prove nothing)
    sv, si = _row_sorted(v, i)
    assert torch.equal(sv.view(torch.int32), ref_v.view(torch.int32)) and torch.equal(si, ref_i)


def test_k_past_the_in_kernel_sort(monkeypatch):
    """Past SORT_MAX the kernel leaves the winners unsorted and torch.sort orders them: still exact."""
    R, W, k = 3, 90, 20
    g = torch.Generator().manual_seed(28)
    buf = rows_of(torch.randint(-3, 4, (R, W), generator=g).float(), R, W, [90, 45, 20], seed=29)
    monkeypatch.setattr(final_sort, "SORT_MAX", 16)
    assert final_sort.sort_width(k) == 0 and final_sort.sort_width(16) == 16
    check(buf, k, **SMALL)
    check(buf, 16, **SMALL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("R,W,k", [(4096, 13824, 2048), (1024, 5376, 512), (1024, 7000, 1000), (256, 16000, 3000)])
@pytest.mark.parametrize("kind", ["scattered", "packed_relu", "few_values"])
def test_gpu_real_sizes(R, W, k, kind):
    """Real sizes, bitwise against the reference; nearly every row should take the fast path."""
    g = torch.Generator(device="cuda").manual_seed(R + W + k)
    values = torch.randn(R, W, device="cuda", generator=g)
    pos = torch.rand(R, W, device="cuda", generator=g).argsort(1)
    if kind == "scattered":
        pos = pos * 37 + torch.randint(0, 37, (R, 1), device="cuda", generator=g)
        n_valid = torch.randint(k, W + 1, (R, 1), device="cuda", generator=g)
        rank = torch.rand(R, W, device="cuda", generator=g).argsort(1).argsort(1)
    elif kind == "packed_relu":  # the filter's layout: about 3k + 1024 entries first, many of them 0.0
        values = values.relu()
        n_valid = torch.randint(k, min(W, 3 * k + 1024) + 1, (R, 1), device="cuda", generator=g)
        rank = torch.arange(W, device="cuda").expand(R, W)
    else:  # ties everywhere, the largest positions
        values = torch.randint(-3, 4, (R, W), device="cuda", generator=g).float()
        pos = 2**31 - 2 - pos * ((2**31 - 2) // W)  # spread down to 0: positions stay in [0, 2**31 - 1)
        n_valid = torch.full((R, 1), W, device="cuda")
        rank = torch.zeros(R, W, dtype=torch.int64, device="cuda")
    buf = torch.where(rank < n_valid, raw(values, pos), SENTINEL)
    comp, took = fs.select_composites(buf, k)
    values, indices = final_sort.decode(torch.sort(comp, dim=1, descending=True).values)
    ref_v, ref_i = fs.select_rows_reference(buf, k)
    assert torch.equal(values.view(torch.int32), ref_v.view(torch.int32))
    assert torch.equal(indices, ref_i)
    v2, i2 = fs.select_rows(buf, k)
    assert torch.equal(v2.view(torch.int32), ref_v.view(torch.int32)) and torch.equal(i2, ref_i)
    v3, i3 = _row_sorted(*fs.select_rows(buf, k, sorted=False))
    assert torch.equal(v3.view(torch.int32), ref_v.view(torch.int32)) and torch.equal(i3, ref_i)
    rate = took.float().mean().item()
    assert rate > 0.99, f"only {rate:.4f} of rows took the fast path (a performance problem, results are exact)"
