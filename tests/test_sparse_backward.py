"""Sparse backward of the selection: reference vs dense autograd, Triton kernels vs reference."""

from __future__ import annotations

import os

import torch

# The Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import hyscale_compile  # noqa: E402
from hyscale_compile.runtime import dispatch, reference  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (Visibility factory given B, T, S; fill)
MASKS = {
    "none": lambda B, T, S: Visibility(),
    "causal": lambda B, T, S: Visibility(causal=True, offset=S - T - 3),
    "window": lambda B, T, S: Visibility(starts=torch.randint(0, S // 2, (B, T)),
                                         ends=torch.randint(S // 2, S + 1, (B, T))),
    "bool": lambda B, T, S: Visibility(mask=torch.rand(B, T, S) > 0.4),
}


def _problem(B=2, T=5, H=3, D=8, S=13, K=6, weights=True, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    kx = torch.randn(B, S, D, generator=g).to(device, dtype)
    w = torch.randn(B, T, H, generator=g).to(device, dtype) if weights else None
    gv = torch.randn(B, T, K, generator=g).to(device)
    return q, kx, w, gv


def _vis_to(vis: Visibility, device) -> Visibility:
    mv = lambda t: None if t is None else t.to(device)
    return Visibility(causal=vis.causal, offset=vis.offset, offsets=mv(vis.offsets), starts=mv(vis.starts),
                      ends=mv(vis.ends), mask=mv(vis.mask), bias=mv(vis.bias))


def _dense_grads(q, kx, w, gv, idx, scale, relu, vis: Visibility):
    """Eager autograd of the dense unmodified indexer in float64, loss read at the selected positions."""
    B, T, H, D = q.shape
    S = kx.shape[1]
    q64, kx64 = q.double().requires_grad_(), kx.double().requires_grad_()
    w64 = w.double().requires_grad_() if w is not None else None
    dots = torch.einsum("bthd,bsd->bths", q64, kx64) * scale
    act = torch.relu(dots) if relu else dots
    score = (act * w64[..., None]).sum(2) if w64 is not None else act.sum(2)
    visible = vis.at(0, T, torch.arange(S).view(1, 1, S), (B, T, S))
    if visible is not None:
        score = torch.where(visible, score, torch.full_like(score, float("-inf")))
    picked = score.gather(-1, idx)
    # Masked picks are constants (-inf): drop them from the loss as autograd would give them no path.
    loss = torch.where(torch.isinf(picked), torch.zeros_like(picked), picked * gv.double()).sum()
    inputs = [q64, kx64] + ([w64] if w64 is not None else [])
    grads = torch.autograd.grad(loss, inputs)
    return grads[0], grads[1], (grads[2] if w is not None else None)


def _close(a, b, tol):
    assert (a is None) == (b is None)
    if a is not None:
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# reference vs dense autograd (CPU, float64 oracle)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("weights,relu", [(True, True), (False, True), (True, False)])
def test_reference_matches_dense_autograd(mask, weights, relu):
    q, kx, w, gv = _problem(weights=weights)
    B, T, _, _ = q.shape
    S, K = kx.shape[1], gv.shape[-1]
    vis = MASKS[mask](B, T, S)
    _, idx = reference.select(q, kx, w, K, 0.7, relu, vis, float("-inf"))
    got = reference.sparse_backward(gv, q, kx, w, idx, 0.7, relu, vis)
    want = _dense_grads(q, kx, w, gv, idx, 0.7, relu, vis)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_op_autograd_matches_dense(mask):
    """indexer_topk's autograd (select -> sparse_backward) against the dense indexer."""
    q, kx, w, gv = _problem()
    B, T, _, _ = q.shape
    S, K = kx.shape[1], gv.shape[-1]
    vis = MASKS[mask](B, T, S)
    qa, kxa, wa = (t.clone().requires_grad_() for t in (q, kx, w))
    offset = vis.offset if vis.causal else None
    values, idx = hyscale_compile.indexer_topk(qa, kxa, K, weights=wa, scale=0.7, query_offset=offset)
    torch.where(torch.isinf(values), torch.zeros_like(values), values * gv).sum().backward()
    want = _dense_grads(q, kx, w, gv, idx, 0.7, True, vis)
    for a, b in zip((qa.grad, kxa.grad, wa.grad), want):
        _close(a, b, 1e-5)


# ---------------------------------------------------------------------------------------------
# Triton kernels vs reference (interpreter on CPU, native on CUDA)


def _triton(gv, q, kx, w, idx, scale, relu, vis, deterministic):
    from hyscale_compile.runtime import sparse_backward as sb

    with dispatch.force_backend("triton"):
        assert dispatch.backward_kernels_for(q) is sb
        return sb.sparse_backward(gv, q, kx, w, idx, scale, relu, vis, deterministic=deterministic)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("weights,relu", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_triton_matches_reference(mask, weights, relu, deterministic, monkeypatch):
    from hyscale_compile.runtime import sparse_backward as sb

    monkeypatch.setattr(sb, "PREFER_DETERMINISTIC", False)  # deterministic=False really means atomics
    q, kx, w, gv = _problem(weights=weights, device=DEVICE)
    B, T, _, _ = q.shape
    S, K = kx.shape[1], gv.shape[-1]
    vis = _vis_to(MASKS[mask](B, T, S), DEVICE)
    _, idx = reference.select(q, kx, w, K, 0.7, relu, vis, float("-inf"))
    want = reference.sparse_backward(gv, q, kx, w, idx, 0.7, relu, vis)
    got = _triton(gv, q, kx, w, idx, 0.7, relu, vis, deterministic)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("keys_per_program", [1, 4, 16])
def test_triton_deterministic_is_bitwise_repeatable_with_duplicate_keys(keys_per_program, monkeypatch):
    """Many rows pick the same few keys: the segmented reduction must give the same bits every run,
    and the same bits however many keys a program reduces (each key adds its picks in sorted order)."""
    from hyscale_compile.runtime import sparse_backward as sb

    monkeypatch.setattr(sb, "SEGMENT_KEYS", keys_per_program)
    q, kx, w, gv = _problem(T=9, S=7, K=5, device=DEVICE)
    B, T = q.shape[:2]
    _, idx = reference.select(q, kx, w, 5, 1.0, False, Visibility(), float("-inf"))
    first = _triton(gv, q, kx, w, idx, 1.0, False, Visibility(), True)
    for _ in range(2):
        again = _triton(gv, q, kx, w, idx, 1.0, False, Visibility(), True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    monkeypatch.setattr(sb, "SEGMENT_KEYS", 2)  # 7 keys: the last program has one past the end
    for a, b in zip(first, _triton(gv, q, kx, w, idx, 1.0, False, Visibility(), True)):
        assert torch.equal(a, b)
    want = reference.sparse_backward(gv, q, kx, w, idx, 1.0, False, Visibility())
    for a, b in zip(first, want):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("weights", [True, False])
def test_triton_row_slices_and_chunks(deterministic, weights, monkeypatch):
    """Picks split over slices (partial dq / dw summed on the host), rows split over contribution
    chunks (deterministic path), two batches: slot arithmetic of the partials and chunk offsets
    against the reference. K=40 in 16-pick steps over 3 slices (16, 16, 8): the last slice has a
    partial step. 16 is the smallest tensor-core K, so the test runs on a GPU too."""
    from hyscale_compile.runtime import sparse_backward as sb

    monkeypatch.setattr(sb, "PREFER_DETERMINISTIC", False)
    monkeypatch.setattr(sb, "ROW_PICKS", 16)
    q, kx, w, gv = _problem(B=2, T=7, K=40, S=61, weights=weights, device=DEVICE, seed=4)
    vis = _vis_to(MASKS["causal"](2, 7, 61), DEVICE)
    _, idx = reference.select(q, kx, w, 40, 0.7, True, vis, float("-inf"))
    want = reference.sparse_backward(gv, q, kx, w, idx, 0.7, True, vis)
    whole = _triton(gv, q, kx, w, idx, 0.7, True, vis, deterministic)
    monkeypatch.setattr(sb, "_CONTRIB_BYTES", 2 * 3 * 40 * 8 * 4)  # 3 rows of both batches per chunk
    monkeypatch.setattr(sb, "_slices", lambda rows, K, BK, per_sm, device: 3)
    sliced = _triton(gv, q, kx, w, idx, 0.7, True, vis, deterministic)
    for a, b, c in zip(sliced, whole, want):
        _close(a, c, 1e-5)
        _close(a, b, 1e-6)


@pytest.mark.parametrize("int64_keys", [False, True])
@pytest.mark.parametrize("chunks_per_sort", [1, 2, 3, None])
def test_triton_deterministic_same_bits_however_rows_are_chunked_and_sorted(chunks_per_sort, int64_keys,
                                                                             monkeypatch):
    """Rows in chunks of 3 (3, 3, 1 over T=7, two batches), one sort ordering 1, 2 or all 3 chunks (None:
    the default rule, given room for two), keys and places in int32 or int64: each key still adds its
    picks in (row, pick) order, so dkx has the bits of one unchunked call."""
    from hyscale_compile.runtime import sparse_backward as sb

    q, kx, w, gv = _problem(B=2, T=7, K=40, S=61, device=DEVICE, seed=5)
    vis = _vis_to(MASKS["causal"](2, 7, 61), DEVICE)
    _, idx = reference.select(q, kx, w, 40, 0.7, True, vis, float("-inf"))
    whole = _triton(gv, q, kx, w, idx, 0.7, True, vis, True)
    monkeypatch.setattr(sb, "_CONTRIB_BYTES", 2 * 3 * 40 * 8 * 4)  # 3 rows of both batches per chunk
    if chunks_per_sort is None:  # the default rule, with room for two chunks per sort: groups of 2 and 1
        monkeypatch.setattr(sb, "_ORDER_BYTES", 2 * (sb._ORDER_BYTES_PER_PICK * 2 * 3 * 40 + 16 * 2 * 61))
        assert sb._group_chunks(2, 3, 40, 61) == 2
    else:
        monkeypatch.setattr(sb, "_group_chunks", lambda B, rows, K, S: chunks_per_sort)
    if int64_keys:
        monkeypatch.setattr(sb, "_INT32_KEYS_BELOW", 0)
    chunked = _triton(gv, q, kx, w, idx, 0.7, True, vis, True)
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)


def test_op_under_deterministic_algorithms_uses_deterministic_path(monkeypatch):
    from hyscale_compile.runtime import sparse_backward as sb

    monkeypatch.setattr(sb, "PREFER_DETERMINISTIC", False)
    seen = []
    real = sb.sparse_backward
    monkeypatch.setattr(sb, "sparse_backward", lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    q, kx, w, gv = _problem(device=DEVICE)
    _, idx = reference.select(q, kx, w, gv.shape[-1], 1.0, True, Visibility(), float("-inf"))
    args = (gv, q, kx, w, idx, 1.0, True, False, 0, None, None, None, None)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with dispatch.force_backend("triton"):
            torch.ops.hyscale.sparse_backward(*args)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [True]


def test_triton_mixed_dtypes_and_unit_k():
    q, kx, w, gv = _problem(K=1, device=DEVICE)
    kx = kx.half()
    _, idx = reference.select(q, kx, w, 1, 1.0, True, Visibility(), float("-inf"))
    want = reference.sparse_backward(gv, q, kx, w, idx, 1.0, True, Visibility())
    got = _triton(gv, q, kx, w, idx, 1.0, True, Visibility(), True)
    for a, b in zip(got, want):
        _close(a, b, 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_16bit_operands(dtype):
    q, kx, w, gv = _problem(dtype=dtype, device=DEVICE)
    _, idx = reference.select(q, kx, w, gv.shape[-1], 0.5, True, Visibility(), float("-inf"))
    want = reference.sparse_backward(gv, q, kx, w, idx, 0.5, True, Visibility())
    got = _triton(gv, q, kx, w, idx, 0.5, True, Visibility(), True)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, bf16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_matches_reference(dtype, deterministic, monkeypatch):
    from hyscale_compile.runtime import sparse_backward as sb

    monkeypatch.setattr(sb, "PREFER_DETERMINISTIC", False)
    q, kx, w, gv = _problem(B=2, T=128, H=16, D=128, S=1024, K=64, dtype=dtype, device="cuda")
    vis = Visibility(causal=True, offset=1024 - 128)
    _, idx = reference.select(q, kx, w, 64, 0.1, True, vis, float("-inf"))
    want = reference.sparse_backward(gv, q, kx, w, idx, 0.1, True, vis)
    got = _triton(gv, q, kx, w, idx, 0.1, True, vis, deterministic)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, b.float().abs().max().item()))
