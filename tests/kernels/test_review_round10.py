"""Round 10 review: the backward that recomputes the forward's output (out=) takes its row term from the contribution
kernel's row sums of p * dp, its dq programs split the value columns OUT_COL_SPLIT ways, the dq kernel takes 64 / 128
picks a block, and the 16-bit MLA-wide forward 64. Against the reference (naive.py), run after run, and with dkv the
bits of the backward that keeps the output."""

from __future__ import annotations

import pytest
import torch
from sparse_attention_cases import Case, finite, nonfinite_key0_unkept
from sparse_attention_cases import close as _close
from test_sparse_attention_interpret import DEVICE, LATENT_CASES, _latent_problem, _picks, _problem, _run_latent

from hyscale_compile.runtime import sparse_attention as sa
from hyscale_compile.runtime.sparse_attention import backward, common, forward, naive


def _same(got, want):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def _dlse(q, seed=9):
    return torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _chunks(monkeypatch) -> list[tuple[int, int]]:
    """Records (t0, R) of each chunk whose row term the host forms."""
    seen = []
    row_term = backward._row_term

    def spy(rd, NKB, shift, lse, t0, R):
        seen.append((t0, R))
        return row_term(rd, NKB, shift, lse, t0, R)

    monkeypatch.setattr(backward, "_row_term", spy)
    return seen


def _check_recompute(q, kv, idx, picks, dout, Dv, empty="zero", dlse=None, tol=2e-5, repeat=False):
    """out= against the reference's recomputation, against the backward that keeps the output (the same out, lse
    and dkv bits; dq up to roundings, the caller's delta being from the exact fp32 output); ``repeat``: the same
    bits run after run."""
    got = _run_latent("triton", q, kv, idx, picks, dout, Dv, empty, dlse=dlse, recompute=True)
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, Dv, empty, dlse=dlse, recompute=True), tol)
    kept = _run_latent("triton", q, kv, idx, picks, dout, Dv, empty, dlse=dlse)
    _same(got[:2] + got[3:4], kept[:2] + kept[3:])
    _close(got[2:3], kept[2:3], tol)
    _close(got[4:], got[:1], tol)  # the recomputed output is the forward's
    if repeat:
        _same(got, _run_latent("triton", q, kv, idx, picks, dout, Dv, empty, dlse=dlse, recompute=True))
    return got


# (case, CONTRIB_HEAD_BLOCK or None, empty). fp32 halves the contribution head block: 16 -> 8 heads a block.
RECOMPUTE_CLASSES = {
    # 12 heads in contribution blocks of 8 (the second partial), rows with 0, 1, a few kept picks, K = 11
    "multi_hb_few": (Case(B=2, T=6, H=12, G=1, Dqk=40, Dv=32, S=29, K=11, offset=1, alias=True), 16, "zero"),
    # two kv groups (the latent entry takes kv [B, S, G, Dqk]; v = kv[..., :Dv] is taken below) of 9 heads each, in blocks of 8; odd head count a group
    "groups_multi_hb": (Case(B=2, T=3, H=18, G=2, Dqk=40, Dv=32, S=17, K=9, offset=3), 16, "zero"),
    "groups_odd": (Case(B=1, T=4, H=6, G=2, Dqk=36, Dv=24, S=15, K=7, offset=2), None, "mean"),
    # per-batch offsets with a key mask, Dv not a power of two (the upper column block partly masked)
    "offsets_key_mask": (Case(B=2, T=5, H=3, G=1, Dqk=44, Dv=24, S=19, K=10, offset="tensor", key_mask=True,
                              alias=True, dropped=4), None, "zero"),
    # K = 3, below every pass's block (16 picks); 5 heads (a padded head block)
    "k_below_block": (Case(B=2, T=4, H=5, G=1, Dqk=40, Dv=32, S=9, K=3, offset=3, alias=True), None, "zero"),
}


@pytest.mark.parametrize("name", sorted(RECOMPUTE_CLASSES))
def test_recompute_classes(monkeypatch, name):
    case, contrib_heads, empty = RECOMPUTE_CLASSES[name]
    if contrib_heads is not None:
        monkeypatch.setattr(backward, "CONTRIB_HEAD_BLOCK", contrib_heads)
        HG = case.H // (1 if case.alias else case.G)
        assert backward.contrib_heads(HG, torch.float32) < HG
    assert common.split(case.Dqk, case.Dv, True)[1] // backward.OUT_COL_SPLIT >= 16  # the columns are split
    q, kv, idx, picks, dout = _latent_problem(case, seed=3)
    _check_recompute(q, kv, idx, picks, dout, case.Dv, empty, dlse=_dlse(q), repeat=name == "multi_hb_few")


@pytest.mark.parametrize("cols", [1, 2, 4])
def test_recompute_chunks_slices_and_column_splits(monkeypatch, cols):
    """Chunks of 2 rows of 2 batches (2, 2, 1: chunks past t0 = 0), 3 slices of 4 picks, the value columns in 1, 2, 4
    programs (Dv = 40 in 64 padded columns: with 4, the last column program has no value column, only the tail):
    against the reference; dkv the bits of one chunk, one slice, the output kept."""
    case = Case(B=2, T=5, H=3, G=1, Dqk=48, Dv=40, S=23, K=12, offset=3, alias=True)
    q, kv, idx, picks, dout = _latent_problem(case, seed=5)
    dlse = _dlse(q)
    monkeypatch.setattr(backward, "PICKS", 4)
    whole = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse)
    monkeypatch.setattr(backward, "OUT_COL_SPLIT", cols)
    per_row = case.B * case.K * (case.Dqk * 4 + case.H * 4 * 2)  # contributions, ds and p of a row
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * per_row + per_row // 2)
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 3)
    seen = _chunks(monkeypatch)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True)
    assert seen == [(0, 2), (2, 2), (4, 1)]
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True), 2e-5)
    _same(got[:2] + got[3:4], whole[:2] + whole[3:])
    _close(got[2:3], whole[2:3], 2e-5)
    _close(got[4:], got[:1], 2e-5)
    if cols == 4:
        _same(got, _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True))


@pytest.mark.parametrize("empty", ["zero", "mean"])
def test_recompute_empty_rows_with_infinite_dlse_and_nan_dout(monkeypatch, empty):
    """Empty rows (lse -inf) whose lse gradient is inf and, under "zero" (where their dout reaches nothing), whose
    dout is NaN: eps is 0 there, no NaN reaches dq, the output or dkv; chunks of 2 rows and 2 slices."""
    case = Case(B=2, T=7, H=3, G=1, Dqk=40, Dv=32, S=19, K=8, offset=-2, alias=True)
    q, kv, idx, picks, dout = _latent_problem(case, seed=1)
    _, lse = naive.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, empty)
    blank = torch.isinf(lse)
    counts = picks.kept(idx, 0, case.S).sum(-1)
    assert blank.any() and (counts == 1).any() and (counts >= 2).any()  # rows with 0, 1 and a few picks
    dlse = _dlse(q).masked_fill(blank, float("inf"))
    if empty == "zero":
        dout = dout.masked_fill(blank[..., None], float("nan"))
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * case.B * case.K * (case.Dqk * 4 + case.H * 8))
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    monkeypatch.setattr(backward, "PICKS", 4)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse, recompute=True)
    assert all(t.isfinite().all() for i, t in enumerate(got) if i != 1)
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse, recompute=True), 2e-5)


@pytest.mark.parametrize("what", ["k", "v"])
def test_recompute_nonfinite_unpicked_kv_row(monkeypatch, what):
    """NaN / inf in kv's row 0, which no row keeps (picks of it dropped by range, offsets, key mask): the stored p,
    the row sums of p * dp and the column programs gather nothing of it; 4 column programs."""
    case = Case(B=2, T=5, H=3, G=1, Dqk=72, Dv=64, S=13, K=7, alias=True, offset="tensor", key_mask=True, dropped=4)
    q, kv, _, idx, offset, key_mask = nonfinite_key0_unkept(case, what, dtype=torch.float32, device=DEVICE)
    kv[:, 0] = float("nan") if what == "v" else float("inf")
    picks = _picks(offset, key_mask)
    dout = torch.randn(q.shape[:3] + (case.Dv,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    monkeypatch.setattr(backward, "OUT_COL_SPLIT", 4)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=_dlse(q), recompute=True)
    assert all(t.isfinite().all() for i, t in enumerate(got) if i != 1) and not got[3][:, 0].any()
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, dlse=_dlse(q), recompute=True), 2e-5)


def test_recompute_takes_the_exact_row_term_from_an_off_delta_with_groups(monkeypatch):
    """The caller's delta off by eps (rounded output) with 2 kv groups of 3 heads, chunks and slices: dq equals the
    backward with the exact delta; dkv that of the caller's delta, bit for bit."""
    case = Case(B=2, T=3, H=6, G=2, Dqk=40, Dv=32, S=17, K=9, offset=3)  # (make's alias forces G = 1)
    q, kv, idx, picks, dout = _latent_problem(case, seed=6)
    assert kv.shape[2] == 2
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * case.B * case.K * (case.G * case.Dqk * 4 + case.H * 8))
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    monkeypatch.setattr(backward, "PICKS", 4)
    dlse = _dlse(q)
    out, lse = forward.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, "zero")
    exact = sa.row_delta(dout, out, dlse)
    off = exact + 0.05 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    again = torch.empty_like(out)
    seen = _chunks(monkeypatch)
    dq, dkv = backward.backward_latent(dout, off, q, kv, case.Dv, lse, idx, 0.4, picks, "zero", out=again, dlse=dlse)
    assert seen == [(0, 2), (2, 1)]
    dq_exact, _ = backward.backward_latent(dout, exact, q, kv, case.Dv, lse, idx, 0.4, picks, "zero")
    _, dkv_off = backward.backward_latent(dout, off, q, kv, case.Dv, lse, idx, 0.4, picks, "zero")
    _close((dq, again), (dq_exact, out), 2e-5)
    _same((dkv,), (dkv_off,))


def test_row_term_indexing_of_a_chunk_past_the_first():
    """_row_term for B = 2 and the chunk t0 = 3, R = 2 of T = 7: rd [B, R, H, NKB] (program row b * R + r) summed over
    its blocks, minus shift at rows t0..t0 + R of each batch, 0 at empty rows whatever shift is; the tail of rd past
    the chunk's rows (a larger first chunk's buffer) is not read."""
    B, T, H, NKB, t0, R, rows = 2, 7, 3, 4, 3, 2, 3
    g = torch.Generator().manual_seed(0)
    rd = torch.randn(B * rows * H * NKB, generator=g)
    rd[B * R * H * NKB:] = float("nan")
    shift = torch.randn(B, T, H, generator=g)
    lse = torch.randn(B, T, H, generator=g)
    lse[1, 4] = float("-inf")
    shift[1, 4, 0], shift[1, 4, 1] = float("inf"), float("nan")
    got = backward._row_term(rd, NKB, shift, lse, t0, R)
    want = torch.empty(B, R, H)
    blocks = rd[:B * R * H * NKB].view(B * R, H, NKB)
    for b in range(B):
        for r in range(R):
            for h in range(H):
                t = t0 + r
                s = sum(blocks[b * R + r, h, j].item() for j in range(NKB))  # block order
                want[b, r, h] = 0.0 if lse[b, t, h] == float("-inf") else s - shift[b, t, h].item()
    assert got.shape == (B, R, H) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got[1, 1] == 0).all()


def test_16bit_wide_layer_picks_a_block():
    """The block sizes of the 16-bit MLA-wide tiles: the forward 64 picks, the dq kernel 64 (128 recomputing), and
    the recomputing dq programs split the 512 value columns in two; fp32 keeps its own."""
    wide = common.split(576, 512, True)[1:]
    assert forward.config(128, *wide, torch.bfloat16, 2048)[:2] == (64, 64)
    assert forward.config(128, *wide, torch.float16, 40)[:2] == (64, 64)  # BK at most pow2(K)
    assert forward.config(128, *wide, torch.bfloat16, 20)[1] == 32
    assert forward.config(16, 128, 64, 128, torch.float32, 2048)[1] == 32
    for dtype in (torch.bfloat16, torch.float16):
        assert backward.passes(128, *wide, dtype, 2048, fold=True)[1][0][2] == 64
        assert backward.passes(128, *wide, dtype, 2048, fold=True, recompute=True)[1][0][2] == 128
        assert backward.passes(128, *wide, dtype, 100, fold=True, recompute=True)[1][0][2] == 128  # pow2(100)
    assert backward.passes(128, *wide, torch.float32, 2048, fold=True, recompute=True)[1][0][2] == 16


def _blocky_picks(case: Case, idx: torch.Tensor, block: int) -> torch.Tensor:
    """Row 0 of each batch: its first block of picks all dropped; row 1: its picks past the first block dropped."""
    idx = idx.clone()
    idx[:, 0, :block] = -1
    idx[:, 1, block:] = case.S
    return idx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_wide_forward_at_64_picks(dtype):
    """The forward with the 16-bit MLA-wide config (64 heads x 256 + 32 features, BK = 64), K = 100 (a masked second
    block), a row whose first block is all dropped and one whose second is: out and lse against the reference's
    (fp32 sums of the same 16-bit inputs)."""
    case = Case(B=2, T=3, H=64, G=1, Dqk=288, Dv=256, S=120, K=100, offset=117, alias=True)
    q, kv, _, idx, picks, _ = _problem(case, dtype=dtype, seed=2)
    assert forward.config(64, *common.split(288, 256, True)[1:], dtype, 100)[:2] == (64, 64)
    idx = _blocky_picks(case, idx, 64)
    out, lse = forward.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, "zero")
    want, want_lse = naive.forward(q.float(), kv.float(), kv.float()[..., :case.Dv], idx, 0.4, picks, "zero")
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())
    again = forward.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, "zero")
    _same((out, lse), again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_recompute_at_128_picks(monkeypatch, dtype):
    """The 16-bit recomputing backward: 128 picks a dq and contribution block, K = 160 (a full block and a masked
    one; a row whose first block is all dropped, one whose second is), 2 column programs, 2 slices: against the
    reference's fp32 sums to the inputs' rounding; out, lse and dkv the bits of the backward keeping the output."""
    case = Case(B=1, T=3, H=4, G=1, Dqk=40, Dv=32, S=200, K=160, offset=197, alias=True)
    q, kv, _, idx, picks, dout = _problem(case, dtype=dtype, seed=11)
    assert backward.passes(4, 32, 16, 32, dtype, 160, fold=True, recompute=True)[1][0][2] == 128
    idx = _blocky_picks(case, idx, 128)
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    dlse = _dlse(q)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True)
    want = _run_latent("naive", q.float(), kv.float(), idx, picks, dout.float(), case.Dv, dlse=dlse, recompute=True)
    eps = torch.finfo(dtype).eps
    for a, b in zip(got, want):
        assert a.dtype == (torch.float32 if a.dim() == 3 else dtype)
        b = finite(b).float()
        torch.testing.assert_close(finite(a).float(), b, rtol=4 * eps, atol=4 * eps * max(1.0, b.abs().max().item()))
    kept = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse)
    _same(got[:2] + got[3:4], kept[:2] + kept[3:])
    if dtype == torch.bfloat16:
        _same(got, _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True))


def test_recompute_head_major_dout_keeps_the_bits(monkeypatch):
    """dout head-major (autograd's layout in the absorbed op): the contribution kernel's row-major copy gives the row
    sums of p * dp, so dq and the recomputed output have the bits of a row-major dout, chunked or not."""
    case = LATENT_CASES["wide"]
    q, kv, idx, picks, dout = _latent_problem(case, seed=7)
    dlse = _dlse(q)
    want = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True)
    dout_hm = dout.transpose(1, 2).contiguous().transpose(1, 2)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * case.B * case.K * (case.Dqk * 4 + case.H * 8))
    _same(_run_latent("triton", q, kv, idx, picks, dout_hm, case.Dv, dlse=dlse, recompute=True), want)
