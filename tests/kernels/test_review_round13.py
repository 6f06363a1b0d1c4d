"""Round 13 review: the sparse attention backward's segment kernel takes SEGMENT_KEYS keys a program (each key's
run from the CSR ``bounds`` of the sorted picks) and loads SEGMENT_ROWS rows before adding them in order.

Tried: (1) the kernel alone on synthetic sorted runs (duplicate keys, long and empty runs, dropped picks keyed
B * S, one to three contribution rows a pick, widths no column block divides, int32 and int64 bounds, a
preset accumulator), bitwise against an in-order fp32 sum on the host and against the previous kernel (a
program per SEGMENT_KEYS sorted picks, reconstructed below from a8150ef^) for many keys / rows / columns
settings; (2) the whole backward with the previous ``pick_order`` and kernel swapped in, bitwise (dk, dv, dkv,
and dq untouched) over B = 1..3, G > 1, two head blocks, the latent entry, the split path, chunked rows,
slices, key masks, offsets, rows with no visible pick, duplicate and dropped picks; (3) ``bounds`` against
the previous (keys, ends) pair, the int64 key path read (not runnable: B * S >= 2**31).

Found: the claim holds for every problem the backward builds (its accumulator starts at +0.0, so a padding
add of +0.0 is exact). One deviation outside that: a caller's ``dkv_acc`` holding -0.0 at a key whose
contributions are all -0.0 (p underflowed to 0) came back +0.0 where the run's length is not a multiple of
SEGMENT_ROWS (the masked loads' ``other=0.0`` padding: -0.0 + 0.0 = +0.0), so its bits depended on
SEGMENT_ROWS; the previous kernel did the same only for keys shorter than another key of their program.
Fixed by padding with -0.0, the exact additive identity: every setting gives the in-order sum's bits. A
trap on the way: ``other=-0.0`` does nothing, Triton turns a float -0.0 constant into +0.0 (interpreter and
GPU compile alike); the kernel spells it as bits, and a test compiles it for sm_90 to see them in the PTX.
Also read: the int64 key path (B * S >= 2**31 - 1: int64 keys, arange and bounds values up to the pick
count, int32 bounds while picks < 2**31; the kernel widens bounds to int64 before any address), and
``pick_order`` / ``_segment_kernel`` have no other callers (benchmarks and tests grep clean)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from sparse_attention_cases import Case
from sparse_attention_cases import close as _close
from test_sparse_attention_interpret import LATENT_CASES, _latent_problem, _problem, _run, _run_latent

from hyscale_compile.runtime.sparse_attention import backward, forward


# The previous segment kernel and pick order (a8150ef^), as the reference launch.
@triton.jit
def _old_segment_kernel(contrib_ptr, keys_ptr, ends_ptr, acc_ptr, n, n_keys, W, NHB,
                        BKEY: tl.constexpr, BC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BKEY + tl.arange(0, BKEY)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = i < n
    key = tl.load(keys_ptr + i, mask=inside, other=n_keys).to(tl.int64)
    prev = tl.load(keys_ptr + i - 1, mask=inside & (i > 0), other=-1).to(tl.int64)
    own = inside & (key != prev) & (key < n_keys)
    count = tl.where(own, tl.load(ends_ptr + i, mask=own, other=0).to(tl.int64) - i, 0)
    tile = own[:, None] & (c < W)[None, :]
    acc = tl.load(acc_ptr + key[:, None] * W + c[None, :], mask=tile, other=0.0)
    n_max = tl.max(count, axis=0)
    j = 0
    while j < n_max:
        more = tile & (j < count)[:, None]
        for hb in range(0, NHB):
            acc += tl.load(contrib_ptr + ((i + j) * NHB + hb)[:, None] * W + c[None, :], mask=more, other=0.0)
        j += 1
    tl.store(acc_ptr + key[:, None] * W + c[None, :], acc, mask=tile)


def _old_pick_order(idx, t0, S, picks):
    """The previous pick_order: the same sort, then each sorted position's run end instead of each key's bounds."""
    place, sorted_keys = backward.sorted_picks(idx, t0, S, picks)
    ends = torch.searchsorted(sorted_keys, sorted_keys, right=True, out_int32=place.dtype == torch.int32)
    return place, (sorted_keys, ends)


class _OldLaunch:
    """Stands in for ``backward._segment_kernel`` (with ``_old_pick_order``): the previous kernel's launch."""

    def __init__(self, keys_per_program: int):
        self.bkey = keys_per_program

    def __getitem__(self, grid):
        def launch(contrib, state, acc, n_keys, W, NHB, BKEY, BC, ROWS):
            keys, ends = state
            n = keys.numel()
            _old_segment_kernel[(triton.cdiv(n, self.bkey), triton.cdiv(W, BC))](
                contrib, keys, ends, acc, n, n_keys, W, NHB, BKEY=self.bkey, BC=BC)
        return launch


def _old(monkeypatch, keys_per_program=2):
    monkeypatch.setattr(backward, "pick_order", _old_pick_order)
    monkeypatch.setattr(backward, "_segment_kernel", _OldLaunch(keys_per_program))


def _bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same_bits(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


# (1) The kernel alone on synthetic runs


def _runs(seed, n_keys, n_picks, drop):
    """Sorted keys (stable sort of random keys with many duplicates, a share dropped to n_keys)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, n_keys, (max(1, n_keys // 3),), generator=g)  # a few keys take most picks: long runs
    keys = torch.where(torch.rand(n_picks, generator=g) < 0.7, hot[torch.randint(0, hot.numel(), (n_picks,),
                                                                               generator=g)],
                       torch.randint(0, n_keys, (n_picks,), generator=g))
    keys = torch.where(torch.rand(n_picks, generator=g) < drop, n_keys, keys).to(torch.int32)
    return torch.sort(keys, stable=True)[0]


def _contrib(seed, rows, W):
    """Values across 40 binades: their sum's bits depend on the order of the adds."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, W, generator=g) * 2.0 ** torch.randint(-20, 20, (rows, 1), generator=g)).float()


def _in_order(contrib, sorted_keys, acc0, n_keys, NHB):
    want = acc0.clone()
    for i, key in enumerate(sorted_keys.tolist()):
        if key < n_keys:
            for hb in range(NHB):
                want[key] = want[key] + contrib[i * NHB + hb]
    return want


def _new_sum(contrib, sorted_keys, acc0, n_keys, NHB, keys, rows, cols, bounds_dtype=torch.int32):
    bounds = torch.searchsorted(sorted_keys, torch.arange(n_keys + 1, dtype=sorted_keys.dtype)).to(bounds_dtype)
    acc = acc0.clone()
    W = acc.shape[1]
    backward._segment_kernel[(triton.cdiv(n_keys, keys), triton.cdiv(W, cols))](
        contrib, bounds, acc, n_keys, W, NHB, BKEY=keys, BC=cols, ROWS=rows)
    return acc


def _old_sum(contrib, sorted_keys, acc0, n_keys, NHB, keys, cols):
    ends = torch.searchsorted(sorted_keys, sorted_keys, right=True, out_int32=True)
    acc = acc0.clone()
    n, W = sorted_keys.numel(), acc.shape[1]
    _old_segment_kernel[(triton.cdiv(n, keys), triton.cdiv(W, cols))](
        contrib, sorted_keys, ends, acc, n, n_keys, W, NHB, BKEY=keys, BC=cols)
    return acc


@pytest.mark.parametrize("seed", range(6))
def test_segment_kernel_alone_is_the_in_order_sum(seed):
    """Every key's run added row by row in sorted order on the host (IEEE fp32 adds, the same as the kernel's),
    onto a random preset accumulator: the new kernel's bits for several launches, the old kernel's too."""
    g = torch.Generator().manual_seed(100 + seed)
    n_keys = int(torch.randint(3, 12, (1,), generator=g))
    n_picks = int(torch.randint(1, 40, (1,), generator=g))
    NHB = 1 + seed % 3
    W = (5, 16, 23)[seed % 3]
    sorted_keys = _runs(seed, n_keys, n_picks, drop=0.2 if seed % 2 else 0.0)
    contrib = _contrib(seed, n_picks * NHB, W)
    acc0 = _contrib(seed + 50, n_keys, W)
    want = _in_order(contrib, sorted_keys, acc0, n_keys, NHB)
    for keys, rows, cols in ((2, 8, 256), (1, 1, 16), (4, 3, 8), (8, 16, 4), (2, 5, 32)):
        _same_bits([_new_sum(contrib, sorted_keys, acc0, n_keys, NHB, keys, rows, cols)], [want])
    for keys in (1, 2, 4):
        _same_bits([_old_sum(contrib, sorted_keys, acc0, n_keys, NHB, keys, 16)], [want])
    # the int64 bounds of the B * S >= 2**31 path: the same kernel, 64-bit loads
    _same_bits([_new_sum(contrib, sorted_keys, acc0, n_keys, NHB, 2, 3, 16, torch.int64)], [want])


def test_segment_kernel_all_dropped_and_no_picks():
    """Every pick dropped (key B * S): nothing added or stored, the accumulator keeps its bits (NaN too)."""
    n_keys, W = 5, 7
    acc0 = _contrib(1, n_keys, W)
    acc0[2, 3] = float("nan")
    sorted_keys = torch.full((9,), n_keys, dtype=torch.int32)
    contrib = torch.full((9 * 2, W), float("nan"))
    _same_bits([_new_sum(contrib, sorted_keys, acc0, n_keys, 2, 2, 8, 4)], [acc0])


def test_bounds_are_the_previous_runs():
    """``pick_order``'s bounds give each key exactly the run the previous (keys, ends) gave its first position,
    and the same places; dropped picks (out of range, hidden, key-masked, -1) after bounds[B * S]."""
    case = Case(B=3, T=6, H=2, G=1, Dqk=8, Dv=8, S=7, K=9, offset="tensor", key_mask=True, dropped=3)
    _, _, _, idx, picks, _ = _problem(case, seed=2)
    idx = torch.cat([idx, idx[..., :4]], -1)  # duplicate picks in a row
    for t0, R in ((0, 6), (2, 3)):
        part = idx[:, t0:t0 + R]
        place, bounds = backward.pick_order(part, t0, case.S, picks)
        old_place, (keys, ends) = _old_pick_order(part, t0, case.S, picks)
        assert torch.equal(place, old_place) and bounds.dtype == torch.int32
        n_keys = case.B * case.S
        assert bounds.shape == (n_keys + 1,) and int(bounds[0]) == 0
        assert int(bounds[-1]) == int((keys < n_keys).sum())
        for s in range(n_keys):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            assert (keys[lo:hi] == s).all() and int((keys == s).sum()) == hi - lo
            if hi > lo:
                assert int(ends[lo]) == hi


# (2) The whole backward, new against the previous kernel


def _dup_drop(idx, S):
    """Duplicate picks (a row's first picks again) and -1 / past-the-end picks."""
    idx = torch.cat([idx, idx[..., :3]], -1).clone()
    idx[..., -1] = -1
    idx[:, ::2, -2] = S + 3
    return idx


CASES = {
    "b3_groups": (Case(B=3, T=4, H=4, G=2, Dqk=8, Dv=8, S=9, K=7, offset=2), {}),
    "offsets_mask": (Case(B=2, T=5, H=2, G=1, Dqk=8, Dv=8, S=11, K=8, offset="tensor", key_mask=True), {}),
    # causal rows with 0, 1, a few visible picks; rows chunked 2 by 2 (CONTRIB_BYTES), slices
    "few_chunked": (Case(B=2, T=7, H=2, G=1, Dqk=8, Dv=8, S=6, K=8, offset=-2),
                    {"CONTRIB_BYTES": 2 * 2 * 11 * 16 * 4, "_slices": lambda programs, K, BK, device: 3}),
    "head_blocks": (Case(B=2, T=3, H=32, G=1, Dqk=16, Dv=16, S=5, K=6), {"HEAD_BLOCK": 16}),
    "split": (Case(B=2, T=4, H=4, G=2, Dqk=16, Dv=16, S=19, K=10, offset=6), {"SPLIT": True, "CHUNK": 16}),
}


def _setup(monkeypatch, over):
    for name, value in over.items():
        if name == "HEAD_BLOCK":
            monkeypatch.setattr(forward, name, value)
        monkeypatch.setattr(backward, name, value)


class _Spy:
    """Wraps the new launch: records (contribution rows a pick, longest run in rows) of each chunk."""

    def __init__(self):
        self.kernel, self.seen = backward._segment_kernel, []

    def __getitem__(self, grid):
        def launch(contrib, bounds, acc, n_keys, W, NHB, **kw):
            self.seen.append((NHB, int((bounds[1:] - bounds[:-1]).max()) * NHB))
            self.kernel[grid](contrib, bounds, acc, n_keys, W, NHB, **kw)
        return launch


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_keeps_the_previous_kernels_bits(monkeypatch, name):
    """dq, dk, dv (and out, lse) bitwise: two segment launches of the new kernel and the previous kernel."""
    case, over = CASES[name]
    _setup(monkeypatch, over)
    q, k, v, idx, picks, dout = _problem(case, seed=len(name))
    idx = _dup_drop(idx, case.S)
    new = []
    spy = _Spy()
    monkeypatch.setattr(backward, "_segment_kernel", spy)
    for keys, rows, cols in ((2, 8, 256), (4, 3, 8)):
        monkeypatch.setattr(backward, "SEGMENT_KEYS", keys)
        monkeypatch.setattr(backward, "SEGMENT_ROWS", rows)
        monkeypatch.setattr(backward, "SEGMENT_COLS", cols)
        new.append(_run("triton", q, k, v, idx, picks, dout))
    _same_bits(new[1], new[0])
    chunks = len(spy.seen) // 2
    assert chunks == (4 if name == "few_chunked" else 1)  # rows 2, 2, 2, 1
    assert spy.seen[0][0] == (2 if name == "head_blocks" else 1)  # a split backward: one row a pick
    assert max(longest for _, longest in spy.seen) > (2 if name == "few_chunked" else 3)  # longer than a load group
    _old(monkeypatch, keys_per_program=2)
    _same_bits(_run("triton", q, k, v, idx, picks, dout), new[0])


@pytest.mark.parametrize("name,over", [("few", {}), ("wide", {"CONTRIB_BYTES": 3 * 9 * 40 * 4 * 2})])
def test_latent_backward_keeps_the_previous_kernels_bits(monkeypatch, name, over):
    """The latent (folded) entry, one contribution a pick for all heads: dkv's bits, old kernel and new."""
    case = LATENT_CASES[name]
    _setup(monkeypatch, over)
    q, kv, idx, picks, dout = _latent_problem(case, seed=5)
    monkeypatch.setattr(backward, "SEGMENT_ROWS", 3)
    monkeypatch.setattr(backward, "SEGMENT_COLS", 16)
    new = _run_latent("triton", q, kv, idx, picks, dout, case.Dv)
    _close(new, _run_latent("naive", q, kv, idx, picks, dout, case.Dv), 2e-5)
    _old(monkeypatch, keys_per_program=1)
    _same_bits(_run_latent("triton", q, kv, idx, picks, dout, case.Dv), new)


# (3) The one deviation: a caller's accumulator holding -0.0


def _minus_zero_problem():
    """One key picked once, its contribution -0.0 (as a pick whose p underflowed gives: ds = p (dp - delta)
    = -0.0 where dp < delta), onto -0.0 in a caller's accumulator."""
    n_keys, W = 2, 4
    sorted_keys = torch.tensor([0, 1, 1], dtype=torch.int32)
    contrib = torch.full((3, W), -0.0)
    contrib[1:] = 1.0
    acc0 = torch.full((n_keys, W), -0.0)
    return contrib, sorted_keys, acc0, n_keys


def test_minus_zero_in_order():
    """The in-order sum and the previous kernel with a key a program keep -0.0 + -0.0 = -0.0."""
    contrib, sorted_keys, acc0, n_keys = _minus_zero_problem()
    want = _in_order(contrib, sorted_keys, acc0, n_keys, 1)
    assert torch.signbit(want[0]).all()
    _same_bits([_old_sum(contrib, sorted_keys, acc0, n_keys, 1, 1, 16)], [want])
    _same_bits([_new_sum(contrib, sorted_keys, acc0, n_keys, 1, 1, 1, 16)], [want])


def test_minus_zero_whatever_the_rows_in_flight():
    """A run of one row loaded 8 at a time adds 7 padding rows: with other=0.0 a -0.0 sum became +0.0 (an
    xfail until the padding was -0.0)."""
    contrib, sorted_keys, acc0, n_keys = _minus_zero_problem()
    want = _in_order(contrib, sorted_keys, acc0, n_keys, 1)
    for keys, rows in ((1, 8), (2, 3), (4, 16)):
        _same_bits([_new_sum(contrib, sorted_keys, acc0, n_keys, 1, keys, rows, 16)], [want])


_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from hyscale_compile.runtime.sparse_attention import backward
sig = {"contrib_ptr": "*fp32", "bounds_ptr": "*i32", "acc_ptr": "*fp32", "n_keys": "i32", "W": "i32", "NHB": "i32",
       "BKEY": "constexpr", "BC": "constexpr", "ROWS": "constexpr"}
src = ASTSource(backward._segment_kernel, signature=sig, constexprs={"BKEY": 2, "BC": 256, "ROWS": 8})
print(compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_minus_zero_padding_survives_the_gpu_compile():
    """Triton drops a float -0.0's sign (other=-0.0 and tl.full(..., -0.0) both became +0.0 in the TTIR), so
    the kernel spells it as the bits 0x80000000: they reach the sm_90 PTX, not only the interpreter."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(backward.__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "-2147483648" in done.stdout  # mov.b32 of -0.0's bits, the masked loads' other


def test_public_accumulator_is_added_into():
    """backward_latent's dkv_acc (the caller's fp32 buffer): the gradient is added onto what it holds."""
    case = LATENT_CASES["mla"]
    q, kv, idx, picks, dout = _latent_problem(case, seed=1)
    out, lse = forward.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, "zero")
    delta = (dout * out).float().sum(-1)
    _, dkv = backward.backward_latent(dout, delta, q, kv, case.Dv, lse, idx, 0.4, picks, "zero")
    base = _contrib(3, kv.numel() // kv.shape[-1], kv.shape[-1]).view(kv.shape)
    _, added = backward.backward_latent(dout, delta, q, kv, case.Dv, lse, idx, 0.4, picks, "zero",
                                        dkv_acc=base.clone())
    _close([added], [base + dkv], 1e-6)
