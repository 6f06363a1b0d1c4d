"""Triton sparse attention (forward and backward) against the reference: in the interpreter on the CPU,
natively on a GPU. Tiny sizes; bitwise repeatability; chunks, slices, split passes and head blocks."""

from __future__ import annotations

import pytest
import torch
from sparse_attention_cases import CASES, Case, finite, make, nonfinite_key0_unkept
from sparse_attention_cases import close as _close

import hyscale_compile
from hyscale_compile.runtime import dispatch
from hyscale_compile.runtime import sparse_attention as sa
from hyscale_compile.runtime.sparse_attention import Picks, backward, common, forward, naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _picks(offset, key_mask) -> Picks:
    if isinstance(offset, torch.Tensor):
        return Picks(causal=True, offsets=offset, key_mask=key_mask)
    return Picks(causal=offset is not None, offset=offset or 0, key_mask=key_mask)


def _problem(case: Case, dtype=torch.float32, seed=0):
    q, k, v, idx, offset, key_mask = make(case, dtype=dtype, device=DEVICE, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape[:3] + (case.Dv,), generator=g).to(DEVICE, dtype)
    return q, k, v, idx, _picks(offset, key_mask), dout


def _run(impl, q, k, v, idx, picks, dout, empty="zero", scale=0.4):
    fwd = forward.forward if impl == "triton" else naive.forward
    bwd = backward.backward if impl == "triton" else naive.backward
    out, lse = fwd(q, k, v, idx, scale, picks, empty)
    delta = sa.row_delta(dout, out, None)
    return (out, lse) + tuple(bwd(dout, delta, q, k, v, lse, idx, scale, picks, empty))


def _same(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,empty", [(name, "zero") for name in sorted(CASES)]
                         + [(name, "mean") for name in ("causal_few", "gqa", "mla")])
def test_triton_matches_reference(name, empty):
    q, k, v, idx, picks, dout = _problem(CASES[name])
    want = _run("naive", q, k, v, idx, picks, dout, empty)
    got = _run("triton", q, k, v, idx, picks, dout, empty)
    _close(got, want, 2e-5)
    if name in ("causal_few", "mla"):
        _same(got, _run("triton", q, k, v, idx, picks, dout, empty))  # the same bits, run after run


@pytest.mark.parametrize("what", ["k", "v"])
def test_dropped_picks_contribute_nothing(what):
    """Dropped picks load nothing (masked loads, ds 0 outright): a NaN or inf in a key no row keeps reaches no
    output, as in the reference."""
    q, k, v, idx, offset, key_mask = nonfinite_key0_unkept(CASES["key_mask"], what, dtype=torch.float32,
                                                           device=DEVICE)
    picks = _picks(offset, key_mask)
    dout = torch.randn(q.shape[:3] + (CASES["key_mask"].Dv,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = _run("triton", q, k, v, idx, picks, dout)
    assert all(t.isfinite().all() for i, t in enumerate(got) if i != 1)  # lse is -inf for empty rows
    _close(got, _run("naive", q, k, v, idx, picks, dout), 2e-5)


def test_alias_detected_and_same_bits_as_a_copy():
    """v = k[..., :Dv] reads each gathered row once; a copy of v takes the general path with the same split
    (576 -> 512 + 64 there, 24 -> 16 + 8 here), so every output has the same bits."""
    q, k, v, idx, picks, dout = _problem(CASES["mla"])
    assert common.aliases(k, v) and not common.aliases(k, v.clone()) and not common.aliases(k, k[..., 1:17])
    assert common.split(24, 16, True) == common.split(24, 16, False) == (16, 16, 16, 16)
    assert common.split(576, 512, True)[:3] == (512, 512, 64)
    _same(_run("triton", q, k, v, idx, picks, dout), _run("triton", q, k, v.clone(), idx, picks, dout))


def test_rows_chunked_sliced_and_split(monkeypatch):
    """Rows in chunks (contribution buffer of 2 rows: 2, 2, 1), picks in slices (16 + 8), the split backward
    (contribution kernel then dq kernel) with 16-column chunks: dk / dv keep their bits (each key adds its picks in (row, pick)
    order whatever the chunks), dq differs by the slice sums' rounding only."""
    case = Case(T=5, K=24, S=37, H=4, G=2, Dqk=40, Dv=32, offset=30)
    q, k, v, idx, picks, dout = _problem(case, seed=3)
    monkeypatch.setattr(backward, "PICKS", 16)
    whole = _run("triton", q, k, v, idx, picks, dout)
    _close(whole, _run("naive", q, k, v, idx, picks, dout), 2e-5)
    width = 2 * 2 * (40 + 32)  # B * G * (Dqk + Dv)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * 24 * width * 4)
    chunked = _run("triton", q, k, v, idx, picks, dout)
    _same(chunked, whole)
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 3)
    sliced = _run("triton", q, k, v, idx, picks, dout)
    _same(sliced[:2] + sliced[3:], whole[:2] + whole[3:])
    _close(sliced[2:3], whole[2:3], 1e-6)
    monkeypatch.setattr(backward, "SPLIT", True)
    monkeypatch.setattr(backward, "CHUNK", 16)
    assert backward.passes(2, 32, 8, 32, torch.float32, 24)[1][1][:4] == (False, True, 16, 16)
    # the contribution kernel (S in 16-column steps, one contribution a pick for both heads) and the dq kernel
    split = _run("triton", q, k, v, idx, picks, dout)
    _close(split, _run("naive", q, k, v, idx, picks, dout), 2e-5)
    _close(split, whole, 2e-5)


def test_several_head_blocks(monkeypatch):
    """32 heads a group in blocks of 16: two programs per (row, group); their contributions add per key."""
    monkeypatch.setattr(forward, "HEAD_BLOCK", 16)
    monkeypatch.setattr(backward, "HEAD_BLOCK", 16)
    case = Case(B=1, T=3, H=64, G=2, Dqk=16, Dv=16, S=11, K=5, offset=8)
    q, k, v, idx, picks, dout = _problem(case, seed=4)
    for empty in ("zero", "mean"):
        _close(_run("triton", q, k, v, idx, picks, dout, empty), _run("naive", q, k, v, idx, picks, dout, empty),
               2e-5)


def test_segment_sums_keep_their_bits_whatever_the_segment_launch(monkeypatch):
    """Each key's run of contributions is added in sorted order whatever the keys a program, the rows it loads
    before adding them, and its columns: the same bits for every setting. Few keys (runs of 8 to 20 picks,
    longer than a load group, of unequal lengths) and two head blocks (two contribution rows a pick)."""
    monkeypatch.setattr(forward, "HEAD_BLOCK", 16)
    monkeypatch.setattr(backward, "HEAD_BLOCK", 16)
    case = Case(B=2, T=14, H=32, G=1, Dqk=16, Dv=16, S=6, K=4)
    q, k, v, idx, picks, dout = _problem(case, seed=6)
    want = _run("naive", q, k, v, idx, picks, dout)
    first = None
    for keys, rows, cols in ((2, 8, 256), (1, 1, 16), (4, 3, 32), (8, 16, 64)):
        monkeypatch.setattr(backward, "SEGMENT_KEYS", keys)
        monkeypatch.setattr(backward, "SEGMENT_ROWS", rows)
        monkeypatch.setattr(backward, "SEGMENT_COLS", cols)
        got = _run("triton", q, k, v, idx, picks, dout)
        if first is None:
            first = got
            _close(got, want, 2e-5)
        _same(got[3:], first[3:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_inputs(dtype):
    """16-bit q, k, v: fp32 accumulation and softmax, p and ds rounded to the input dtype for their MMAs."""
    q, k, v, idx, picks, dout = _problem(CASES["gqa"], dtype=dtype)
    got = _run("triton", q, k, v, idx, picks, dout)
    want = _run("naive", q.float(), k.float(), v.float(), idx, picks, dout.float())
    for a, b in zip(got, want):
        assert a.dtype == (torch.float32 if a.dim() == 3 else dtype)
        b = finite(b).float()
        torch.testing.assert_close(finite(a).float(), b, rtol=3e-2, atol=3e-2 * max(1.0, b.abs().max().item()))


def test_strided_inputs_and_no_picks():
    """q a transposed view, k and v broadcast over the batch (stride 0), key_mask broadcast too; K = 0."""
    case = CASES["key_mask"]
    q, k, v, idx, picks, dout = _problem(case, seed=6)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    kb, vb = k[:1].expand_as(k), v[:1].expand_as(v)
    mask = picks.key_mask[:1].expand_as(picks.key_mask)
    strided = Picks(causal=True, offset=picks.offset, key_mask=mask)
    _close(_run("triton", qt, kb, vb, idx, strided, dout),
           _run("naive", q, kb.contiguous(), vb.contiguous(), idx, strided, dout), 2e-5)
    none = idx[..., :0]
    for empty in ("zero", "mean"):
        _close(_run("triton", q, k, v, none, picks, dout, empty), _run("naive", q, k, v, none, picks, dout, empty),
               1e-6)


def test_op_autograd_on_the_kernels():
    """The op's autograd on the Triton kernels (forced on the CPU) matches the reference's, aliasing and an
    lse gradient included."""
    case = CASES["mla"]
    q, k, _, idx, picks, dout = _problem(case, seed=7)
    glse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(8)).to(DEVICE)
    results = []
    for backend in ("triton", "reference"):
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        with dispatch.force_backend(backend):
            out, lse = hyscale_compile.sparse_attention(qa, ka, ka[..., :case.Dv], idx, scale=0.4,
                                                        query_offset=picks.offset, return_lse=True, empty="mean")
            ((out * dout).sum() + (finite(lse) * glse).sum()).backward()
        results.append((out, lse, qa.grad, ka.grad))
    _close(*results, 2e-5)


# The latent entry (v = kv[..., :Dv], dv folded into dk) and the contribution kernel (all heads of a group a pick)

LATENT_CASES = {
    "mla": CASES["mla"],
    "few": Case(T=9, H=4, G=1, Dqk=24, Dv=16, K=8, offset=-2, alias=True),  # rows with 0, 1, a few kept picks
    "key_mask": Case(H=4, G=1, Dqk=24, Dv=16, alias=True, key_mask=True, offset=9, dropped=4),
    "offsets": Case(H=2, G=1, Dqk=24, Dv=16, alias=True, offset="tensor"),
    "odd": Case(B=1, T=4, H=5, G=1, Dqk=20, Dv=12, S=17, K=9, alias=True),  # sizes no block divides
    "groups": Case(H=6, G=2, Dqk=24, Dv=16, offset=8),  # two kv groups, v taken as kv[..., :Dv] below
    # value features wide enough that the recomputing dq kernel splits them between two programs (16 columns each)
    "wide": Case(H=3, G=1, Dqk=40, Dv=32, K=9, offset=4, alias=True),
}


def _latent_problem(case: Case, seed=0):
    q, k, _, idx, picks, dout = _problem(case, seed=seed)
    return q, k, idx, picks, dout


def _run_latent(impl, q, kv, idx, picks, dout, Dv, empty="zero", scale=0.4, dlse=None, recompute=False):
    """(out, lse, dq, dkv): the forward on v = kv[..., :Dv], then the latent backward; with ``recompute`` the
    backward also recomputes the forward's output, appended."""
    fwd = forward.forward if impl == "triton" else naive.forward
    bwd = backward.backward_latent if impl == "triton" else naive.backward_latent
    out, lse = fwd(q, kv, kv[..., :Dv], idx, scale, picks, empty)
    delta = sa.row_delta(dout, out, dlse)
    again = torch.full_like(out, float("nan")) if recompute else None
    grads = tuple(bwd(dout, delta, q, kv, Dv, lse, idx, scale, picks, empty, out=again,
                      dlse=dlse if recompute else None))
    return (out, lse) + grads + ((again,) if recompute else ())


@pytest.mark.parametrize("name,empty", [(name, "zero") for name in sorted(LATENT_CASES)]
                         + [("few", "mean"), ("mla", "mean")])
def test_latent_backward_matches_reference(name, empty):
    """dq and dkv = dk + [dv, 0] against the reference's explicit sums (which add dk and dv after the sums over
    picks; the kernel adds them per pick first), with an lse gradient; the same bits run after run."""
    case = LATENT_CASES[name]
    q, kv, idx, picks, dout = _latent_problem(case)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse)
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse), 2e-5)
    # the same total as the op's separate dk and dv
    dq, dk, dv = naive.backward(dout, sa.row_delta(dout, got[0], dlse), q, kv, kv[..., :case.Dv].clone(), got[1],
                                idx, 0.4, picks, empty)
    _close(got[3:], (torch.cat([dk[..., :case.Dv] + dv, dk[..., case.Dv:]], -1),), 2e-5)
    _same(got, _run_latent("triton", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse))


@pytest.mark.parametrize("name,empty", [("mla", "zero"), ("key_mask", "zero"), ("offsets", "zero"), ("odd", "zero"),
                                        ("few", "mean"), ("wide", "zero")])  # (groups: the latent layout has one kv row)
def test_latent_backward_recomputes_the_output(name, empty):
    """out= : the forward's output recomputed from the backward's p (empty rows as the forward gives them: 0 or the
    mean of v) equals the forward's and the reference's recomputation; with the caller's delta from the exact
    output (fp32) dq's corrected row term changes nothing but roundings, and dkv keeps its bits."""
    case = LATENT_CASES[name]
    q, kv, idx, picks, dout = _latent_problem(case)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse, recompute=True)
    plain = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse)
    _same(got[:2] + got[3:4], plain[:2] + plain[3:])
    _close(got[2:3], plain[2:3], 2e-5)
    _close(got[4:], got[:1], 2e-5)
    _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, empty, dlse=dlse, recompute=True), 2e-5)


@pytest.mark.parametrize("name,sliced", [("mla", False), ("mla", True), ("wide", True)])
def test_latent_dq_takes_the_row_term_of_the_recomputed_output(monkeypatch, name, sliced):
    """Where the caller's delta is off by eps per row and head (an output it rounded), dq equals the backward run
    with the delta of the exact output (the correction in each slice's partial, whose sum the host forms), and
    dkv is that of the caller's delta (its contributions precede the recomputed output)."""
    case = LATENT_CASES[name]
    q, kv, idx, picks, dout = _latent_problem(case, seed=4)
    if sliced:
        monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    out, lse = forward.forward(q, kv, kv[..., :case.Dv], idx, 0.4, picks, "zero")
    exact = sa.row_delta(dout, out, None)
    off = exact + 0.05 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    again = torch.empty_like(out)
    dq, dkv = backward.backward_latent(dout, off, q, kv, case.Dv, lse, idx, 0.4, picks, "zero", out=again)
    dq_exact, _ = backward.backward_latent(dout, exact, q, kv, case.Dv, lse, idx, 0.4, picks, "zero")
    _, dkv_off = backward.backward_latent(dout, off, q, kv, case.Dv, lse, idx, 0.4, picks, "zero")
    _close((dq,), (dq_exact,), 2e-5)
    _same((dkv,), (dkv_off,))
    assert not torch.allclose(dq, backward.backward_latent(dout, off, q, kv, case.Dv, lse, idx, 0.4, picks,
                                                           "zero")[0], atol=1e-4)


def test_recomputing_dq_split_into_column_blocks_as_one_block(monkeypatch):
    """The recomputing dq kernel's column blocks (the B block with the last) give what one block gives: each column
    sums the same picks in the same order; with slices too."""
    case = LATENT_CASES["wide"]
    assert common.split(case.Dqk, case.Dv, True)[1] // backward.OUT_COL_SPLIT >= 16  # the split is taken
    q, kv, idx, picks, dout = _latent_problem(case, seed=3)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(9)).to(DEVICE)
    split = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True)
    monkeypatch.setattr(backward, "OUT_COL_SPLIT", 1)
    whole = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True)
    _close(split, whole, 1e-6)
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 2)
    _close(_run_latent("triton", q, kv, idx, picks, dout, case.Dv, dlse=dlse, recompute=True), whole, 2e-6)


def test_latent_dropped_picks_contribute_nothing():
    """NaN / inf in a key no row keeps (dropped picks gathered nowhere): dq and dkv stay finite and match."""
    case = LATENT_CASES["key_mask"]
    for what in ("k", "v"):  # in the latent layout the value row is the key row: both poison kv's row 0
        q, kv, _, idx, offset, key_mask = nonfinite_key0_unkept(case, what, dtype=torch.float32, device=DEVICE)
        kv[:, 0] = float("nan") if what == "v" else float("inf")
        picks = _picks(offset, key_mask)
        dout = torch.randn(q.shape[:3] + (case.Dv,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        got = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, recompute=True)
        assert got[2].isfinite().all() and got[3].isfinite().all() and not got[3][:, 0].any()
        assert got[4].isfinite().all()
        _close(got, _run_latent("naive", q, kv, idx, picks, dout, case.Dv, recompute=True), 2e-5)


def test_latent_duplicate_picks_count_twice_as_the_reference():
    """The contract asks for distinct picks; a repeated one counts twice, in the reference and in the kernels."""
    case = LATENT_CASES["mla"]
    q, kv, idx, picks, dout = _latent_problem(case, seed=2)
    idx[:, :, 1] = idx[:, :, 0]
    _close(_run_latent("triton", q, kv, idx, picks, dout, case.Dv),
           _run_latent("naive", q, kv, idx, picks, dout, case.Dv), 2e-5)


def test_latent_chunks_slices_and_head_blocks(monkeypatch):
    """dkv keeps its bits whatever the chunks of rows and the slices of picks (each key adds one contribution a
    pick in (row, pick) order); more heads than a contribution head block (36 heads in blocks of 8, fp32 taking
    half the 16-bit block: the fifth partial) add the blocks in order in the program's own buffer rows."""
    case = Case(B=1, T=5, H=36, G=1, Dqk=20, Dv=16, S=23, K=12, offset=18, alias=True)
    q, kv, idx, picks, dout = _latent_problem(case, seed=5)
    monkeypatch.setattr(backward, "PICKS", 4)
    whole = _run_latent("triton", q, kv, idx, picks, dout, case.Dv)
    want = _run_latent("naive", q, kv, idx, picks, dout, case.Dv)
    _close(whole, want, 2e-5)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * 12 * (20 + 36) * 4)  # 2 rows a chunk (contributions, ds)
    monkeypatch.setattr(backward, "_slices", lambda programs, K, BK, device: 3)
    sliced = _run_latent("triton", q, kv, idx, picks, dout, case.Dv)
    _same(sliced[3:], whole[3:])
    _close(sliced[2:3], whole[2:3], 1e-6)
    again = _run_latent("triton", q, kv, idx, picks, dout, case.Dv, recompute=True)
    _close(again[2:], whole[2:] + whole[:1], 2e-5)  # the recomputed output from the slices' partials
    monkeypatch.setattr(backward, "CONTRIB_HEAD_BLOCK", 16)
    assert backward.contrib_heads(36, torch.float32) == 8
    _close(_run_latent("triton", q, kv, idx, picks, dout, case.Dv), want, 2e-5)


def test_latent_16_bit_takes_128_picks_a_contribution_block():
    """The 16-bit latent backward's contribution kernel takes 128 picks a block (K = 160: a full block and a
    masked one), fp32 keeps 16: against the reference's fp32 sums, to the inputs' rounding."""
    assert backward.passes(4, 16, 8, 16, torch.bfloat16, 160, fold=True)[1][1][2] == 128
    assert backward.passes(4, 16, 8, 16, torch.float32, 160, fold=True)[1][1][2] == 16
    assert backward.passes(128, 512, 64, 512, torch.bfloat16, 2048)[1][1][2] == 64  # wide tiles, no fold
    # the forward: 64 picks a block in the 16-bit MLA layer (32 left its gathers waiting), 16 for fp32's wide tiles
    assert forward.config(128, 512, 64, 512, torch.bfloat16, 2048)[:2] == (64, 64)
    assert forward.config(128, 512, 64, 512, torch.float32, 2048)[:2] == (16, 16)
    # the dq kernel: 64 picks a block, 128 where it recomputes the output (half the A block's columns a program)
    assert backward.passes(128, 512, 64, 512, torch.bfloat16, 2048, fold=True)[1][0][2] == 64
    assert backward.passes(128, 512, 64, 512, torch.bfloat16, 2048, fold=True, recompute=True)[1][0][2] == 128
    case = Case(B=1, T=3, H=4, G=1, Dqk=24, Dv=16, S=200, K=160, offset=197, alias=True)
    q, kv, _, idx, picks, dout = _problem(case, dtype=torch.bfloat16, seed=11)
    _close(_run_latent("triton", q, kv, idx, picks, dout, case.Dv),
           _run_latent("naive", q, kv, idx, picks, dout, case.Dv), 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("alias", [True, False])
@pytest.mark.parametrize("heads, dqk, dv", [(128, 576, 512), (64, 576, 512), (16, 192, 128), (16, 128, 128),
                                             (8, 512, 512), (32, 256, 256), (4, 1024, 1024)])
def test_forward_blocks_fit_shared_memory(dtype, alias, heads, dqk, dv):
    """Found on the device: with v a copy of the MLA latent rather than a view of it, the 16-bit forward took 64
    picks a block and its stages asked for 344 KB of shared memory (sm_90 gives 227): the launch failed. Every
    layout's block now fits, the aliased MLA layer keeps 64 picks and the copy takes 32."""
    _, BDA, BDB, BDV = common.split(dqk, dv, alias)
    BH, BK, _, stages = forward.config(heads, BDA, BDB, BDV, dtype, 2048, alias)
    assert forward.shared_bytes(BH, BK, BDA + BDB, 0 if alias else BDV, dtype, stages) <= forward.SHARED_BYTES
    if (heads, dqk, dv) == (128, 576, 512) and dtype != torch.float32:
        assert BK == (64 if alias else 32)


def test_latent_head_major_q_and_dout_keep_the_bits(monkeypatch):
    """q and dout laid out head-major ([B, H, T, D] in memory, as autograd gives the absorbed projection's
    gradient) are copied a chunk of rows at a time for the contribution kernel: the bits of row-major inputs,
    for chunks of 2 rows (a last chunk of 1) as for one chunk."""
    case = Case(B=2, T=5, H=4, G=1, Dqk=20, Dv=16, S=23, K=12, offset=18, alias=True)
    q, kv, idx, picks, dout = _latent_problem(case, seed=7)
    want = _run_latent("triton", q, kv, idx, picks, dout, case.Dv)
    q_hm, dout_hm = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, dout))
    assert q_hm.stride(2) != q.shape[3] and dout_hm.stride(2) != dout.shape[3]
    _same(_run_latent("triton", q_hm, kv, idx, picks, dout_hm, case.Dv), want)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 2 * 2 * 12 * (20 + 4) * 4)  # 2 rows of 2 batches a chunk
    _same(_run_latent("triton", q_hm, kv, idx, picks, dout_hm, case.Dv), want)


def test_contribution_kernel_for_the_view_keeps_dk_and_dv_apart(monkeypatch):
    """sparse_attention with v = k[..., :Dv] through the split backward (the MLA path at real sizes): one
    contribution a pick for all heads, dk and dv apart; the same bits as a copy of v (the same chunk order)."""
    monkeypatch.setattr(backward, "SPLIT", True)
    monkeypatch.setattr(backward, "CHUNK", 8)
    q, k, v, idx, picks, dout = _problem(CASES["mla"], seed=6)
    got = _run("triton", q, k, v, idx, picks, dout)
    _close(got, _run("naive", q, k, v, idx, picks, dout), 2e-5)
    _same(got, _run("triton", q, k, v.clone(), idx, picks, dout))


def test_latent_op_autograd_on_the_kernels():
    """hyscale_compile.sparse_attention_latent on the kernels (forced on the CPU): the values and kv's total
    gradient of sparse_attention with the view, and of the reference."""
    case = CASES["mla"]
    q, k, _, idx, picks, dout = _problem(case, seed=7)
    glse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(8)).to(DEVICE)
    results = []
    for backend, latent in (("triton", True), ("triton", False), ("reference", True)):
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        kw = dict(scale=0.4, query_offset=picks.offset, return_lse=True, empty="mean")
        with dispatch.force_backend(backend):
            if latent:
                out, lse = hyscale_compile.sparse_attention_latent(qa, ka, idx, value_dim=case.Dv, **kw)
            else:
                out, lse = hyscale_compile.sparse_attention(qa, ka, ka[..., :case.Dv], idx, **kw)
            ((out * dout).sum() + (finite(lse) * glse).sum()).backward()
        results.append((out, lse, qa.grad, ka.grad))
    _same(results[0][:3], results[1][:3])  # same forward, same dq pass
    _close(results[0], results[1], 2e-5)
    _close(results[0], results[2], 2e-5)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("rows", [3, 64])
def test_absorbed_mla_op_on_the_kernels(monkeypatch, rows, keep):
    """hyscale.sparse_attention_mla on the kernels (forced on the CPU), 3 rows a block and all at once: values, lse
    and the gradients of q, kv and w (o' kept, or recomputed for w_uv's) as on the reference; kv's gradient summed
    in fp32 across the blocks."""
    from hyscale_compile.runtime.sparse_attention import absorbed

    B, T, S, H, Dn, Dr, Dc, Dv, K = 1, 7, 29, 4, 16, 8, 32, 16, 8
    g = torch.Generator().manual_seed(11)
    q, kv = torch.randn(B, T, H, Dn + Dr, generator=g), torch.randn(B, S, 1, Dc + Dr, generator=g)
    w = torch.randn(H, Dn + Dv, Dc, generator=g) * 0.3
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    gout = torch.randn(B, T, H, Dv, generator=g)
    monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * B * H * (Dc + Dr) * 4)
    results = []
    for backend in ("triton", "reference"):
        leaves = [x.clone().to(DEVICE).requires_grad_() for x in (q, kv, w)]
        with dispatch.force_backend(backend):
            out, lse, _ = torch.ops.hyscale.sparse_attention_mla(*leaves, idx.to(DEVICE), Dn, 0.3, True, S - T - 2,
                                                                 None, None, "mean", False, keep)
            (out * gout.to(DEVICE)).sum().backward()
        results.append((out, lse, *(x.grad for x in leaves)))
    _close(results[0], results[1], 2e-5)
