"""``hyscale::sparse_attention`` on the CPU: the reference against dense masked attention (float64), the
operator's autograd, HF's eager / SDPA masking, torch.compile with fake tensors, argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sparse_attention_cases import CASES, Case, dense_attention, finite, kept_dense, make, nonfinite_key0_unkept

import hyscale_compile
from hyscale_compile.runtime import sparse_attention as sa
from hyscale_compile.runtime.sparse_attention import Picks, naive


def _picks(S, offset, key_mask) -> Picks:
    if isinstance(offset, torch.Tensor):
        return Picks(causal=True, offsets=offset, key_mask=key_mask)
    return Picks(causal=offset is not None, offset=offset or 0, key_mask=key_mask)


def _close(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _same_lse(a, b, tol):
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    _close(finite(a), finite(b), tol)


def _same_as_eager(compiled, fn, leaves, *rest):
    """compiled(*leaves, *rest) gives fn's output and leaf gradients bit for bit."""
    mine, eager = ([t.clone().requires_grad_() for t in leaves] for _ in range(2))
    got, want = compiled(*mine, *rest), fn(*eager, *rest)
    assert torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    for a, b in zip(mine, eager):
        assert torch.equal(a.grad, b.grad)


def _dense_grads(q, k, v, idx, scale, offset, key_mask, empty, gout, glse, alias_dv=None):
    """Autograd of the dense oracle in float64; with ``alias_dv`` v is k[..., :alias_dv] (one leaf)."""
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    v64 = k64[..., :alias_dv] if alias_dv else v.detach().double().requires_grad_()
    out, lse = dense_attention(q64, k64, v64, idx, scale, offset, key_mask, empty)
    loss = (out * gout.double()).sum() + (finite(lse) * glse.double()).sum()
    leaves = [q64, k64] + ([] if alias_dv else [v64])
    return out, lse, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("empty", ["zero", "mean"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_dense(name, empty):
    case = CASES[name]
    q, k, v, idx, offset, key_mask = make(case)
    picks = _picks(case.S, offset, key_mask)
    out, lse = naive.forward(q, k, v, idx, 0.4, picks, empty)
    want_out, want_lse = dense_attention(q, k, v, idx, 0.4, offset, key_mask, empty)
    _close(out, want_out, 1e-12)
    _same_lse(lse, want_lse, 1e-12)
    # backward: explicit formulas against autograd of the dense form (v and k apart, aliasing is the op's)
    g = torch.Generator().manual_seed(1)
    gout, glse = torch.randn(out.shape, generator=g).double(), torch.randn(lse.shape, generator=g).double()
    v_leaf = v.clone() if case.alias else v
    _, _, want = _dense_grads(q, k, v_leaf, idx, 0.4, offset, key_mask, empty, gout, glse)
    got = naive.backward(gout, sa.row_delta(gout, out, finite(glse)), q, k, v_leaf, lse, idx, 0.4, picks, empty)
    for a, b in zip(got, want):
        _close(a, b, 1e-10)


@pytest.mark.parametrize("what", ["k", "v"])
def test_dropped_picks_contribute_nothing(what):
    """A dropped pick is gathered at key 0 and must then count for nothing (its rows replaced by 0, not multiplied
    by p = 0): a NaN or inf in key 0 reaches no row that does not keep key 0, forward or backward."""
    case = CASES["key_mask"]
    q, k, v, idx, offset, key_mask = nonfinite_key0_unkept(case, what)
    picks = _picks(case.S, offset, key_mask)
    assert not picks.kept(idx, 0, case.S).all()
    out, lse = naive.forward(q, k, v, idx, 0.4, picks, "zero")
    assert out.isfinite().all()
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).double()
    dq, dk, dv = naive.backward(gout, sa.row_delta(gout, out, None), q, k, v, lse, idx, 0.4, picks, "zero")
    assert dq.isfinite().all() and dk.isfinite().all() and dv.isfinite().all()
    assert not dk[:, 0].any() and not dv[:, 0].any()


def test_rows_with_few_picks_really_occur():
    """The causal_few case has rows with 0, 1 and several kept picks (what the tests above rely on)."""
    case = CASES["causal_few"]
    _, _, _, idx, offset, key_mask = make(case)
    counts = set(kept_dense(idx, case.S, offset, key_mask).sum(-1).flatten().tolist())
    assert {0, 1} <= counts and max(counts) >= 3


@pytest.mark.parametrize("empty", ["zero", "mean"])
@pytest.mark.parametrize("name", ["causal_few", "gqa", "mla", "offsets"])
def test_op_autograd_matches_dense(name, empty):
    """hyscale_compile.sparse_attention (fp32, CPU reference) with an lse gradient; for the MLA layout v is
    a view of k, so k's gradient collects dk and dv through the view."""
    case = CASES[name]
    q, k, v, idx, offset, key_mask = make(case, dtype=torch.float32)
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    va = ka[..., :case.Dv] if case.alias else v.clone().requires_grad_()
    out, lse = hyscale_compile.sparse_attention(qa, ka, va, idx, scale=0.4, query_offset=offset, key_mask=key_mask,
                                                empty=empty, return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    g = torch.Generator().manual_seed(2)
    gout, glse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    ((out * gout).sum() + (finite(lse) * glse).sum()).backward()
    want_out, want_lse, want = _dense_grads(q, k, v, idx, 0.4, offset, key_mask, empty, gout, glse,
                                            alias_dv=case.Dv if case.alias else None)
    _close(out, want_out, 1e-5)
    _same_lse(lse, want_lse, 1e-5)
    grads = [qa.grad, ka.grad] + ([] if case.alias else [va.grad])
    for a, b in zip(grads, want):
        _close(a, b, 1e-5)


def test_gradient_with_respect_to_v_alone_under_aliasing():
    """v = k[..., :Dv]: autograd.grad w.r.t. v alone is dv (the op does not fold dv into dk)."""
    case = CASES["mla"]
    q, k, _, idx, offset, _ = make(case, dtype=torch.float32)
    ka = k.clone().requires_grad_()
    v = ka[..., :case.Dv]
    out = hyscale_compile.sparse_attention(q, ka, v, idx, scale=0.4, query_offset=offset)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (dv,) = torch.autograd.grad((out * gout).sum(), [v])
    k64 = k.double()
    v64 = k64[..., :case.Dv].clone().requires_grad_()
    ref, _ = dense_attention(q.double(), k64, v64, idx, 0.4, offset)
    (want,) = torch.autograd.grad((ref * gout.double()).sum(), [v64])
    _close(dv, want, 1e-5)


@pytest.mark.parametrize("name", ["causal_few", "key_mask"])
def test_matches_hf_eager_and_sdpa_masking(name):
    """HF's construction: ones(bool).scatter(-1, topk_indices, False) combined with the causal / padding mask,
    then eager (masked_fill(finfo.min), fp32 softmax) -> empty="mean", or SDPA (bool mask) -> empty="zero"."""
    case = CASES[name]
    q, k, v, _, offset, key_mask = make(case, dtype=torch.float32)
    B, T, S, K = case.B, case.T, case.S, case.K
    g = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)  # HF: in range
    index_mask = torch.ones(B, T, S, dtype=torch.bool).scatter(-1, idx, False)  # True = not selected
    allowed = kept_dense(torch.arange(S).expand(B, T, S), S, offset, key_mask)  # causal AND padding
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(case.H // case.G, 2).transpose(1, 2) for t in (k, v))
    scale = case.Dqk ** -0.5
    sdpa = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=(allowed & ~index_mask)[:, None]).transpose(1, 2)
    causal_add = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
    w = (qh @ kh.transpose(-1, -2)) * scale + causal_add
    w = w.masked_fill(index_mask[:, None], torch.finfo(torch.float32).min)
    eager = (w.softmax(-1, dtype=torch.float32) @ vh).transpose(1, 2)
    kw = dict(query_offset=offset, key_mask=key_mask)
    _close(hyscale_compile.sparse_attention(q, k, v, idx, empty="zero", **kw), sdpa, 1e-5)
    _close(hyscale_compile.sparse_attention(q, k, v, idx, empty="mean", **kw), eager, 1e-5)


def test_ties_and_index_dtypes():
    """q = 0: every kept pick ties, out is the mean of the kept values; int32 and int64 indices agree; picks far
    out of range (negative, >= S, past int32) are dropped."""
    case = Case(offset=None)
    q, k, v, idx, _, _ = make(case, dtype=torch.float32)
    q = torch.zeros_like(q)
    out, lse = hyscale_compile.sparse_attention(q, k, v, idx, return_lse=True)
    kept = kept_dense(idx, case.S, None, None).float()  # [B, T, S]
    vh = v.repeat_interleave(case.H // case.G, 2)
    want = torch.einsum("bts,bshd->bthd", kept / kept.sum(-1, keepdim=True), vh)
    _close(out, want, 1e-6)
    _close(lse, kept.sum(-1).log()[..., None].expand_as(lse), 1e-6)
    q, k, v, idx, _, _ = make(case, dtype=torch.float32, seed=5)
    ref = hyscale_compile.sparse_attention(q, k, v, idx)
    assert torch.equal(ref, hyscale_compile.sparse_attention(q, k, v, idx.int()))
    far = torch.where(idx < 0, torch.full_like(idx, -(2**40)), torch.where(idx >= case.S, 2**40, idx))
    assert torch.equal(ref, hyscale_compile.sparse_attention(q, k, v, far))


def test_empty_rows_zero_and_mean():
    q, k, v, idx, _, _ = make(Case(), dtype=torch.float32)
    nothing = torch.full_like(idx, -1)
    out, lse = hyscale_compile.sparse_attention(q, k, v, nothing, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    mean = hyscale_compile.sparse_attention(q, k, v, nothing, empty="mean")
    _close(mean, v.mean(1).repeat_interleave(2, 1)[:, None].expand_as(mean), 1e-6)
    va = v.clone().requires_grad_()
    hyscale_compile.sparse_attention(q, k, va, nothing, empty="mean").sum().backward()
    _close(va.grad, torch.full_like(v, q.shape[1] * 2 / v.shape[1]), 1e-6)  # T rows x 2 heads per group / S


def test_default_scale_and_custom_scale():
    q, k, v, idx, _, _ = make(CASES["plain"], dtype=torch.float32)
    got = hyscale_compile.sparse_attention(q, k, v, idx)
    want, _ = dense_attention(q.double(), k.double(), v.double(), idx, q.shape[-1] ** -0.5)
    _close(got, want, 1e-5)
    want, _ = dense_attention(q.double(), k.double(), v.double(), idx, 2.0)
    _close(hyscale_compile.sparse_attention(q, k, v, idx, scale=2.0), want, 1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_under_torch_compile(dynamic):
    """Fake tensors (symbolic sizes with dynamic=True), forward and backward through AOTAutograd."""
    case = CASES["gqa"]

    def fn(q, k, v, idx, mask):
        out, lse = hyscale_compile.sparse_attention(q, k, v, idx, query_offset=8, key_mask=mask, return_lse=True)
        return out.sum(-1) * 2 + finite(lse)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    for T in (5, 7):
        q, k, v, idx, _, _ = make(Case(H=6, G=3, Dqk=16, T=T), dtype=torch.float32, seed=T)
        mask = torch.rand(case.B, case.S, generator=torch.Generator().manual_seed(T)) > 0.3
        _same_as_eager(compiled, fn, (q, k, v), idx, mask)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 9, 8, 576, dtype=torch.bfloat16), torch.empty(2, 40, 1, 576, dtype=torch.bfloat16)
        idx = torch.empty(2, 9, 16, dtype=torch.int32)
        out, lse = torch.ops.hyscale.sparse_attention(q, k, k[..., :512], idx, 0.1, True, 0, None, None, "zero")
        assert out.shape == (2, 9, 8, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 9, 8) and lse.dtype == torch.float32


def _args():
    q, k, v, idx, _, _ = make(CASES["gqa"], dtype=torch.float32)
    return dict(q=q, k=k, v=v, indices=idx, scale=0.5, causal=False, offset=0, offsets=None, key_mask=None,
                empty="zero")


BAD = {
    "q_dims": (dict(q=lambda a: a["q"][0]), "q must be \\[B, T, H, Dqk\\]"),
    "q_dtype": (dict(q=lambda a: a["q"].double()), "q dtype torch.float64 unsupported"),
    "k_dtype": (dict(k=lambda a: a["k"].half()), "k and v must have q's dtype"),
    "k_dim": (dict(k=lambda a: a["k"][..., :8]), "k feature dim 8 != q feature dim 16"),
    "k_batch": (dict(k=lambda a: a["k"][:1]), "k batch 1 != q batch 2"),
    "v_shape": (dict(v=lambda a: a["v"][:, :5]), "v must be \\[B, S, G, Dv\\]"),
    "groups": (dict(q=lambda a: a["q"][:, :, :5]), "H=5 must be a multiple of the kv groups G=3"),
    "indices_dtype": (dict(indices=lambda a: a["indices"].float()), "indices must be int32 or int64"),
    "indices_shape": (dict(indices=lambda a: a["indices"][:, :3]), "indices must be \\[B, T, K\\]"),
    "offsets_shape": (dict(causal=lambda a: True, offsets=lambda a: torch.zeros(3, dtype=torch.long)),
                      "query_offset tensor \\(offsets\\) must be \\[B\\]"),
    "offsets_dtype": (dict(causal=lambda a: True, offsets=lambda a: torch.zeros(2)), "must be an integer tensor"),
    "key_mask_dtype": (dict(key_mask=lambda a: torch.ones(2, 13)), "key_mask must be bool"),
    "key_mask_shape": (dict(key_mask=lambda a: torch.ones(2, 5, 13, dtype=torch.bool)), "key_mask must be \\[B, S\\]"),
    "empty": (dict(empty=lambda a: "nan"), "empty must be one of"),
    "device": (dict(indices=lambda a: a["indices"].to("meta")), "indices is on meta"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_argument_errors_name_the_argument(bad):
    change, message = BAD[bad]
    args = _args()
    args.update({name: fn(args) for name, fn in change.items()})
    with pytest.raises(RuntimeError, match=message):
        torch.ops.hyscale.sparse_attention(*args.values())


def test_api_rejects_bad_empty_before_running():
    q, k, v, idx, _, _ = make(CASES["plain"], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="empty must be one of"):
        hyscale_compile.sparse_attention(q, k, v, idx, empty="min")


@pytest.mark.parametrize("empty", ["zero", "mean"])
@pytest.mark.parametrize("name", ["mla", "causal_few", "offsets"])
def test_latent_op_matches_dense_and_the_view(name, empty):
    """hyscale_compile.sparse_attention_latent(q, kv, value_dim=Dv): the values of dense attention with v =
    kv[..., :Dv], and kv's gradient (the total through the view), as sparse_attention with the view gives it."""
    case = CASES[name]
    q, k, _, idx, offset, key_mask = make(case, dtype=torch.float32)
    k = k[:, :, :1]  # one kv group: the latent layout
    Dv = case.Dv
    g = torch.Generator().manual_seed(2)
    kw = dict(scale=0.4, query_offset=offset, key_mask=key_mask, empty=empty, return_lse=True)
    grads = []
    for latent in (True, False):
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        if latent:
            out, lse = hyscale_compile.sparse_attention_latent(qa, ka, idx, value_dim=Dv, **kw)
            gout, glse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
        else:
            out, lse = hyscale_compile.sparse_attention(qa, ka, ka[..., :Dv], idx, **kw)
        ((out * gout).sum() + (finite(lse) * glse).sum()).backward()
        grads.append((out, lse, qa.grad, ka.grad))
    want_out, want_lse, want = _dense_grads(q, k, None, idx, 0.4, offset, key_mask, empty, gout, glse, alias_dv=Dv)
    _close(grads[0][0], want_out, 1e-5)
    _same_lse(grads[0][1], want_lse, 1e-5)
    for a, b in zip(grads[0][2:], want):
        _close(a, b, 1e-5)
    for a, b in zip(grads[0], grads[1]):
        _close(a, b, 1e-6)


def test_latent_op_under_torch_compile():
    """Fake tensors and AOTAutograd for the latent op (dynamic sizes)."""
    case = CASES["mla"]

    def fn(q, kv, idx):
        out, lse = hyscale_compile.sparse_attention_latent(q, kv, idx, value_dim=case.Dv, query_offset=8,
                                                           return_lse=True)
        return out.sum(-1) * 2 + finite(lse)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (5, 7):
        q, k, _, idx, _, _ = make(Case(H=4, G=1, Dqk=24, Dv=16, T=T, alias=True), dtype=torch.float32, seed=T)
        _same_as_eager(compiled, fn, (q, k), idx)


def test_latent_op_fake_shapes_and_value_dim_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, kv = torch.empty(2, 9, 8, 576, dtype=torch.bfloat16), torch.empty(2, 40, 1, 576, dtype=torch.bfloat16)
        idx = torch.empty(2, 9, 16, dtype=torch.int32)
        out, lse = torch.ops.hyscale.sparse_attention_latent(q, kv, idx, 512, 0.1, True, 0, None, None, "zero")
        assert out.shape == (2, 9, 8, 512) and lse.shape == (2, 9, 8)
    q, k, _, idx, _, _ = make(CASES["mla"], dtype=torch.float32)
    for bad in (0, 25):
        with pytest.raises(RuntimeError, match="value_dim"):
            torch.ops.hyscale.sparse_attention_latent(q, k, idx, bad, 0.5, False, 0, None, None, "zero")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_delta_in_row_chunks_is_the_whole_rows_sum(monkeypatch, dtype):
    """The row delta upcasts a bounded number of rows at a time (its fp32 temporaries at the MLA layer's size
    would be 17 GB each): any chunking gives the rowsum of the upcast product, for rows not a multiple of the
    chunk, strided inputs and an lse gradient."""
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(2, 11, 3, 8, generator=g).to(dtype)
    out = torch.randn(2, 3, 11, 8, generator=g).to(dtype).transpose(1, 2)  # strided, as an einsum may leave it
    dlse = torch.randn(2, 11, 3, generator=g)
    ct = torch.float32 if dtype != torch.float64 else dtype
    want = (dout.double() * out.double()).sum(-1) - dlse.double()
    for elems in (1, 2 * 3 * 8 * 4, 1 << 26):  # a row a step, 4 rows, all rows
        monkeypatch.setattr(sa, "ROW_DELTA_ELEMS", elems)
        got = sa.row_delta(dout, out, dlse)
        assert got.dtype == ct and got.shape == (2, 11, 3)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
