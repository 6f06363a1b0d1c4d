"""Sparse attention kernels on a CUDA device at real sizes (skipped without one): the MLA latent layer
(H = 128, Dqk = 576, v = k[..., :512], k = 2048), GQA and HF's expanded MHA, rows with few visible keys,
against dense masked attention and the reference; bitwise repeatability; torch.compile (Inductor)."""

from __future__ import annotations

import pytest
import torch
from sparse_attention_cases import dense_attention, finite

import hyscale_compile
from hyscale_compile.runtime import dispatch
from hyscale_compile.runtime import sparse_attention as sa
from hyscale_compile.runtime.sparse_attention import Picks, backward, forward, naive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# name -> (H, G, Dqk, Dv, alias)
LAYOUTS = {"mla": (128, 1, 576, 512, True), "gqa": (32, 8, 128, 128, False), "mha": (16, 16, 192, 128, False)}


def problem(layout, S, T, K=2048, offset=None, early=False, key_mask=False, dtype=torch.bfloat16, seed=0):
    """Queries at the end of an S-key context (offset S - T) unless ``early`` (offset 0: row t sees t + 1
    keys, fewer than K, and most picks are not visible, as a top-k over masked scores returns them).
    Picks are the top K of random scores over all S keys (distinct, in range)."""
    H, G, Dqk, Dv, alias = LAYOUTS[layout]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, Dqk, device="cuda", generator=g).to(dtype)
    k = torch.randn(1, S, G, Dqk, device="cuda", generator=g).to(dtype)
    v = k[..., :Dv] if alias else torch.randn(1, S, G, Dv, device="cuda", generator=g).to(dtype)
    off = 0 if early else S - T
    score = torch.rand(1, T, S, device="cuda", generator=g)
    if not early:  # late rows pick among their visible keys, as a top-k over causally masked scores
        score = score.masked_fill(torch.arange(S, device="cuda") > torch.arange(T, device="cuda")[:, None] + off, -1)
    idx = score.topk(K, dim=-1).indices.to(torch.int32)
    mask = torch.rand(1, S, device="cuda", generator=g) > 0.3 if key_mask else None
    dout = torch.randn(1, T, H, Dv, device="cuda", generator=g).to(dtype)
    return q, k, v, idx, Picks(causal=True, offset=off, key_mask=mask), dout


def run(impl, q, k, v, idx, picks, dout, empty="zero", scale=0.1):
    fwd = forward.forward if impl == "triton" else naive.forward
    bwd = backward.backward if impl == "triton" else naive.backward
    out, lse = fwd(q, k, v, idx, scale, picks, empty)
    dq, dk, dv = bwd(dout, sa.row_delta(dout, out, None), q, k, v, lse, idx, scale, picks, empty)
    return out, lse, dq, dk, dv


def close(got, want, tol=2e-2):
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        b = finite(b).float()
        torch.testing.assert_close(finite(a).float(), b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("layout,S,T", [("mla", 8192, 256), ("mla", 32768, 128), ("gqa", 16384, 512),
                                        ("mha", 16384, 256)])
def test_against_reference(layout, S, T):
    args = problem(layout, S, T, seed=S + T)
    got = run("triton", *args)
    close(got, run("naive", *args))
    again = run("triton", *args)
    for a, b in zip(got, again):  # deterministic: the same bits, run after run
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["mla", "gqa"])
def test_forward_against_dense_masked_attention(layout):
    """Dense attention over all S keys under (index mask AND causal), fp32 from the same bf16 inputs."""
    q, k, v, idx, picks, _ = problem(layout, 8192, 128, seed=1)
    out, lse = forward.forward(q, k, v, idx, 0.1, picks, "zero")
    want_out, want_lse = dense_attention(q.float(), k.float(), v.float(), idx, 0.1, picks.offset)
    close((out, lse), (want_out, want_lse))


@pytest.mark.parametrize("layout,empty", [("mla", "zero"), ("mla", "mean"), ("gqa", "mean"), ("mha", "zero")])
def test_rows_with_few_visible_keys(layout, empty):
    """offset 0: row t sees t + 1 keys, so most of its 2048 picks are dropped (rows with 1, 2, ... visible),
    and a padding mask empties some rows entirely."""
    args = problem(layout, 4096, 96, early=True, key_mask=True, seed=2)
    got = run("triton", *args, empty=empty)
    assert bool(torch.isinf(got[1]).any()) and bool(torch.isfinite(got[1]).any())
    close(got, run("naive", *args, empty=empty))


def test_alias_and_copy_agree_and_chunks_keep_bits(monkeypatch):
    """MLA: v = k[..., :512] (one read per gathered row) and a copy of v give the same bits at the same pick
    block; dk / dv keep their bits when the rows go in several contribution chunks. The forward's rule gives
    the copy half the aliased block (its value rows need their own shared memory), and the block orders the
    softmax's sums, so the comparison pins the block the copy gets."""
    q, k, v, idx, picks, dout = problem("mla", 8192, 64, seed=3)
    with monkeypatch.context() as m:
        m.setattr(forward, "PICKS", 32)
        aliased = run("triton", q, k, v, idx, picks, dout)
        for a, b in zip(aliased, run("triton", q, k, v.clone(), idx, picks, dout)):
            assert torch.equal(a, b)
    monkeypatch.setattr(backward, "PROGRAMS_PER_SM", 0)  # one slice a row: dq's bits do not depend on the chunk
    whole = run("triton", q, k, v, idx, picks, dout)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 5 * 2048 * (1088 * 4 + 128 * 2))  # 5 rows a chunk (and their ds)
    for a, b in zip(run("triton", q, k, v, idx, picks, dout), whole):
        assert torch.equal(a, b)


def test_fp32_inputs():
    args = problem("gqa", 4096, 128, dtype=torch.float32, seed=4)
    close(run("triton", *args), run("naive", *args), tol=1e-4)


def test_op_under_inductor():
    q, k, v, idx, picks, dout = problem("gqa", 4096, 128, seed=5)

    def fn(q, k, v):
        out, lse = hyscale_compile.sparse_attention(q, k, v, idx, scale=0.1, query_offset=picks.offset,
                                                    return_lse=True)
        return out.float().square().sum() + finite(lse).sum()

    compiled = torch.compile(fn)
    grads = []
    for f in (fn, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        f(*leaves).backward()
        grads.append([t.grad for t in leaves])
    close(grads[1], grads[0], tol=1e-3)  # the same op; only the loss's elementwise gradient is Inductor's
    with dispatch.force_backend("reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward()
    close(grads[0], [t.grad for t in leaves])


def test_under_deterministic_algorithms():
    """Nothing the kernels' host side calls (sort, scatter of a permutation, searchsorted) refuses
    torch.use_deterministic_algorithms(True)."""
    q, k, v, idx, picks, _ = problem("gqa", 4096, 64, seed=6)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        hyscale_compile.sparse_attention(*leaves, idx, query_offset=picks.offset, empty="mean").sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(bool(torch.isfinite(t.grad).all()) for t in leaves)


def run_latent(impl, q, kv, idx, picks, dout, Dv=512, empty="zero", scale=0.1):
    fwd = forward.forward if impl == "triton" else naive.forward
    bwd = backward.backward_latent if impl == "triton" else naive.backward_latent
    out, lse = fwd(q, kv, kv[..., :Dv], idx, scale, picks, empty)
    return (out, lse) + tuple(bwd(dout, sa.row_delta(dout, out, None), q, kv, Dv, lse, idx, scale, picks, empty))


@pytest.mark.parametrize("S,T,early,empty", [(8192, 256, False, "zero"), (32768, 128, False, "zero"),
                                             (4096, 96, True, "mean")])
def test_latent_against_reference_and_dense(S, T, early, empty):
    """The latent backward (dv folded into dk, one 576-wide contribution a pick for all 128 heads) at the MLA
    layer's sizes: against the reference, against the op with the view (dk + dv), against dense attention's
    autograd (fp32 from the same bf16 inputs) where it fits, and the same bits run after run."""
    q, k, v, idx, picks, dout = problem("mla", S, T, early=early, key_mask=early, seed=S + T + 7)
    got = run_latent("triton", q, k, idx, picks, dout, empty=empty)
    close(got, run_latent("naive", q, k, idx, picks, dout, empty=empty))
    apart = run("triton", q, k, v, idx, picks, dout, empty=empty)
    close(got[3:], (torch.cat([apart[3][..., :512].float() + apart[4].float(), apart[3][..., 512:].float()], -1),))
    if S <= 8192:
        q64, k64 = (t.detach().float().requires_grad_() for t in (q, k))
        out, _ = dense_attention(q64, k64, k64[..., :512], idx, 0.1, picks.offset, picks.key_mask, empty)
        dq, dkv = torch.autograd.grad(out, (q64, k64), dout.float())
        close(got[2:], (dq, dkv))
    again = run_latent("triton", q, k, idx, picks, dout, empty=empty)
    for a, b in zip(got, again):
        assert torch.equal(a, b)


def test_latent_chunks_keep_bits(monkeypatch):
    """dkv keeps its bits when the rows go in several contribution chunks (5 rows a chunk) and in slices."""
    q, k, _, idx, picks, dout = problem("mla", 8192, 64, seed=11)
    monkeypatch.setattr(backward, "PROGRAMS_PER_SM", 0)
    whole = run_latent("triton", q, k, idx, picks, dout)
    monkeypatch.setattr(backward, "CONTRIB_BYTES", 5 * 2048 * (576 * 4 + 128 * 2))  # contributions and ds
    for a, b in zip(run_latent("triton", q, k, idx, picks, dout), whole):
        assert torch.equal(a, b)
    monkeypatch.setattr(backward, "PROGRAMS_PER_SM", 4)
    sliced = run_latent("triton", q, k, idx, picks, dout)
    assert torch.equal(sliced[3], whole[3])


def test_latent_head_major_q_and_dout_keep_bits():
    """q and dout laid out head-major ([B, H, T, D] in memory: autograd's gradient of the absorbed output
    projection is) give the bits of row-major ones: the contribution kernel reads a chunk's row-major copy."""
    q, k, _, idx, picks, dout = problem("mla", 8192, 64, seed=13)
    want = run_latent("triton", q, k, idx, picks, dout)
    q_hm, dout_hm = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, dout))
    for a, b in zip(run_latent("triton", q_hm, k, idx, picks, dout_hm), want):
        assert torch.equal(a, b)


def test_latent_op_under_inductor():
    """hyscale_compile.sparse_attention_latent in a compiled training step: kv's gradient as the eager op's."""
    q, k, _, idx, picks, _ = problem("mla", 4096, 64, seed=12)

    def fn(q, kv):
        out = hyscale_compile.sparse_attention_latent(q, kv, idx, value_dim=512, scale=0.1,
                                                      query_offset=picks.offset)
        return out.float().square().sum()

    grads = []
    for f in (fn, torch.compile(fn)):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        f(*leaves).backward()
        grads.append([t.grad for t in leaves])
    close(grads[1], grads[0], tol=1e-3)


@pytest.mark.parametrize("cache", [None, "first"])
def test_mla_rewrite_on_the_kernels_with_and_without_the_cache(cache):
    """An MLA module as HF writes it (the key buffer of expand_kv), with HF's first cache update (transformers
    <= 5.17: the per-head keys and values returned) or none: rewritten in the latent layout, the latent op's
    kernels give eager's output and gradients (fp32: the kernels' MMAs in ieee or tf32x3)."""
    from models import dsa_attention as da

    from hyscale_compile.passes import report

    torch.manual_seed(0)
    module = da.MlaAttention("sdpa", heads=16, dc=64, dr=16, dn=32, dv=32, k=24, keys="buffer", cache=cache).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    B, T, S = 2, 40, 96
    args = [torch.randn(B, 16, T, 48, device="cuda", generator=g), torch.randn(B, S, 64, device="cuda", generator=g),
            torch.randn(B, 1, S, 16, device="cuda", generator=g), torch.randn(B, T, S, device="cuda", generator=g)]
    args = [a.requires_grad_() if i < 3 else a for i, a in enumerate(args)]
    leaves = args[:3] + list(module.parameters())

    def run(fn):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o.float() * torch.linspace(-1, 1, o.numel(), device="cuda").view_as(o)).sum() for o in outs)
        return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)

    with report.collect() as reports:
        got = run(torch.compile(module, backend="hyscale", options={"attention": "always"}))
    want = run(module)
    (site,) = [r for r in reports if r.kind == "attention"]
    assert site.decision == "rewritten" and site.layout.startswith("MLA latent"), site.reason
    close(got[0] + list(got[1]), want[0] + list(want[1]), tol=1e-3)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_absorbed_mla_op_at_the_layer_sizes(monkeypatch, keep):
    """hyscale.sparse_attention_mla (the absorption inside the op, several blocks of rows) at DeepSeek-V3.2's head
    sizes: the values and the gradients of q, kv and w of the graph ops it replaces (absorb, latent op, project),
    about as accurate against their fp32 run as they are (o' recomputed in the backward: dq and dw no further,
    kv's gradient within 1.5x), and a backward peak below theirs by at least the q' they keep (and o' where the op
    recomputes it)."""
    from hyscale_compile.runtime.sparse_attention import absorbed

    H, Dn, Dr, Dc, Dv, S, T, K = 128, 128, 64, 512, 128, 4096, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(1, T, H, Dn + Dr, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, S, 1, Dc + Dr, device="cuda", generator=g).bfloat16()
    w = (torch.randn(H, Dn + Dv, Dc, device="cuda", generator=g) * 0.05).bfloat16()
    _, _, _, idx, picks, _ = problem("mla", S, T, K=K, seed=21)
    gout = torch.randn(1, T, H, Dv, device="cuda", generator=g).bfloat16()
    args = (0.1, True, picks.offset, None, None, "zero")

    def graph_ops(q, kv, w):
        ql = torch.cat([torch.einsum("bthn,hnc->bthc", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
        lat, _ = torch.ops.hyscale.sparse_attention_latent(ql, kv, idx, Dc, *args)
        return torch.einsum("bthc,hvc->bthv", lat, w[:, Dn:])

    def op(q, kv, w):
        return torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, *args, False, keep)[0]

    results, peaks = [], []
    monkeypatch.setattr(absorbed, "ROWS_BYTES", 512 * H * (Dc + Dr) * 2)  # 4 blocks of 512 rows
    for fn, dtype in ((op, torch.bfloat16), (graph_ops, torch.bfloat16), (graph_ops, torch.float32)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, kv, w)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(*leaves)
        (out * gout.to(dtype)).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append((out, *(t.grad for t in leaves)))

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for name, a, b, r, most in zip(("out", "dq", "dkv", "dw"), *results, (1, 1, 1 if keep else 1.5, 1)):
        assert rel(a, b) < 1e-2, (name, rel(a, b))
        assert rel(a, r) <= most * rel(b, r) * 1.05, (name, rel(a, r), rel(b, r))
    kept_bytes = T * H * (Dc + Dr) * 2 + (0 if keep else T * H * Dc * 2)  # q' (and o'), their gradients whole too
    assert peaks[0] < peaks[1] - kept_bytes, (peaks, kept_bytes)


def test_hf_glm_shared_layers_under_gradient_checkpointing_on_the_kernels():
    """HF GLM-MoE-DSA (layers F, S, F), SDPA, padded, each layer checkpointed as HF's gradient checkpointing does:
    the shared layer's attention reads the F layer's picks across two checkpoint regions; all three attentions
    are rewritten and the training step's logits and gradients are eager's (fp32: the kernels' MMAs in ieee or
    tf32x3)."""
    from models.hf import tiny_glm_moe_dsa

    from hyscale_compile.passes import report

    model, inputs = tiny_glm_moe_dsa(indexer_pattern="FSF", attn_implementation="sdpa", padding=True)
    model, inputs = model.cuda().train(), {n: t.cuda() for n, t in inputs.items()}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)

    def step(m):
        model.zero_grad()
        out = m(**inputs, labels=labels, use_cache=False)
        out.loss.backward()
        return [out.logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with report.collect() as reports:
        got = step(torch.compile(model, backend="hyscale", options={"attention": "always"}))
    want = step(model)
    sites = [r for r in reports if r.kind == "attention"]
    assert len(sites) == 3 and all(r.decision == "rewritten" for r in sites), [(r.decision, r.reason) for r in sites]
    close(got, want, tol=1e-3)
