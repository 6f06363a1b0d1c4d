"""The operator contract (docs/design.md, section 3) on the CPU reference, against a brute force."""

from __future__ import annotations

import math

import pytest
import torch

import hyscale_compile
from hyscale_compile.runtime import reference
from hyscale_compile.testing import assert_same_topk

NEG = float("-inf")


def brute_force(q, kx, k, w=None, scale=1.0, relu=True, offset=None, starts=None, ends=None, mask=None,
                fill=NEG):
    """Dense scores, then a per-row Python sort by (value desc, position asc), NaN first."""
    B, T, H, D = q.shape
    S = kx.shape[1]
    s = torch.einsum("bthd,bsd->bths", q.double(), kx.double()) * scale
    s = s.relu() if relu else s
    s = (s * (w.double()[..., None] if w is not None else 1)).sum(2).float()
    pos = torch.arange(S)
    vis = torch.ones(B, T, S, dtype=torch.bool)
    if offset is not None:
        off = offset if isinstance(offset, torch.Tensor) else torch.full((B,), offset)
        vis &= pos[None, None] <= (torch.arange(T)[None, :, None] + off[:, None, None])
    if starts is not None:
        vis &= (pos >= starts[..., None]) & (pos < ends[..., None])
    if mask is not None and mask.dtype == torch.bool:
        vis &= mask.expand(B, T, S)
    elif mask is not None:
        s = s + mask
    s = torch.where(vis, s, torch.full_like(s, fill))
    vals, idx = torch.empty(B, T, k), torch.empty(B, T, k, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            row = s[b, t].tolist()
            order = sorted(range(S), key=lambda j: (0 if math.isnan(row[j]) else 1, -row[j] if not
                                                    math.isnan(row[j]) else 0, j))[:k]
            idx[b, t] = torch.tensor(order)
            vals[b, t] = s[b, t, order]
    return vals, idx, s


def exact_inputs(B=2, T=5, H=3, D=4, S=13, seed=0, levels=3):
    """Small integers: every summation order gives the same fp32 result, so ties are real ties."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (B, T, H, D), generator=g).float()
    kx = torch.randint(-levels, levels + 1, (B, S, D), generator=g).float()
    w = torch.randint(-2, 3, (B, T, H), generator=g).float()
    return q, kx, w


def check_exact(q, kx, k, **kw):
    v, i = hyscale_compile.indexer_topk(q, kx, k, **{a: b for a, b in kw.items() if a != "offset"},
                                        query_offset=kw.get("offset"))
    rv, ri, _ = brute_force(q, kx, k, w=kw.get("weights"), scale=kw.get("scale", 1.0), relu=kw.get("relu", True),
                            offset=kw.get("offset"), starts=kw.get("starts"), ends=kw.get("ends"),
                            mask=kw.get("mask"), fill=kw.get("fill", NEG))
    torch.testing.assert_close(i, ri, rtol=0, atol=0)
    torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)
    return v, i


@pytest.mark.parametrize("seed", range(3))
def test_ties_and_relu_zeros_break_by_lowest_position(seed):
    q, kx, w = exact_inputs(seed=seed, levels=1)  # few distinct values: many ties, many relu zeros
    check_exact(q, kx, 6, weights=w)
    check_exact(q, kx, 6, weights=None)


def test_all_equal_scores_pick_first_positions():
    q = torch.ones(1, 3, 2, 4)
    kx = torch.ones(1, 10, 4)
    _, i = check_exact(q, kx, 4)
    assert i.tolist() == [[[0, 1, 2, 3]] * 3]


def test_causal_rows_with_fewer_than_k_visible_pad_with_masked_positions():
    q, kx, w = exact_inputs(T=5, S=5)
    v, i = check_exact(q, kx, 4, weights=w, offset=0)
    # row 0 sees only key 0: then masked keys 1, 2, 3 with value -inf, lowest first
    assert i[0, 0].tolist()[0] == 0 and i[0, 0].tolist()[1:] == [1, 2, 3]
    assert torch.isinf(v[0, 0, 1:]).all()


def test_fill_value_of_the_model_is_kept():
    q, kx, w = exact_inputs(T=4, S=4)
    fmin = torch.finfo(torch.float32).min
    v, _ = check_exact(q, kx, 3, weights=w, offset=0, fill=fmin)
    assert v[0, 0, 1].item() == fmin


def test_nan_ranks_first_like_torch_topk():
    q, kx, w = exact_inputs()
    kx[0, 7, 0] = float("nan")
    v, i = check_exact(q, kx, 3, weights=w)
    assert (i[0, :, 0] == 7).all() and torch.isnan(v[0, :, 0]).all()
    tv, ti = brute_force(q, kx, 3, w=w)[2].topk(3)
    assert (ti[0, :, 0] == 7).all()


def test_k_equals_S_and_offsets_tensor_windows_and_masks():
    q, kx, w = exact_inputs(B=2, T=4, S=7)
    check_exact(q, kx, 7, weights=w)
    check_exact(q, kx, 3, weights=w, offset=torch.tensor([3, 1]))
    starts = torch.tensor([[0, 1, 2, 3], [2, 2, 0, 5]])
    ends = starts + torch.tensor([[2, 3, 4, 1], [5, 1, 7, 2]])
    check_exact(q, kx, 3, weights=w, starts=starts, ends=ends)
    bool_mask = torch.rand(4, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    check_exact(q, kx, 3, weights=w, mask=bool_mask)
    bias = torch.zeros(2, 1, 7).masked_fill(torch.rand(2, 1, 7) > 0.5, NEG)
    check_exact(q, kx, 3, weights=w, mask=bias)


def test_relu_off_and_scale():
    q, kx, w = exact_inputs()
    check_exact(q, kx, 5, weights=w, relu=False, scale=0.5)


def test_blocked_reference_equals_one_block(monkeypatch):
    """Exact inputs (multiples of 1/8, weights of 1/4): BLAS may sum a block in another order than the whole
    table, so bitwise equality across blockings holds only where every partial sum is exact."""
    g = torch.Generator().manual_seed(0)
    q, kx = torch.randint(-4, 5, (2, 9, 3, 8), generator=g) / 8, torch.randint(-4, 5, (2, 17, 8), generator=g) / 8
    w = torch.randint(-4, 5, (2, 9, 3), generator=g) / 4
    full = hyscale_compile.indexer_topk(q, kx, 5, weights=w, query_offset=8)
    monkeypatch.setattr(reference, "_BLOCK_ELEMS", 2 * 3 * 17 * 2)  # two query rows per block
    blocked = hyscale_compile.indexer_topk(q, kx, 5, weights=w, query_offset=8)
    assert torch.equal(full[0], blocked[0]) and torch.equal(full[1], blocked[1])


def test_rescore_equals_selected_values_bitwise():
    torch.manual_seed(0)
    q, kx, w = torch.randn(2, 6, 3, 8), torch.randn(2, 11, 8), torch.randn(2, 6, 3)
    v, i = torch.ops.hyscale.select(q, kx, w, 5, 0.3, True, True, 5, None, None, None, None, None, NEG, True)
    r = torch.ops.hyscale.rescore(q, kx, w, i, 0.3, True, True, 5, None, None, None, None, None, NEG)
    assert torch.equal(v, r)


def test_random_bf16_inputs_match_up_to_near_ties():
    torch.manual_seed(0)
    q, kx, w = torch.randn(2, 7, 4, 16).bfloat16(), torch.randn(2, 23, 16).bfloat16(), torch.randn(2, 7, 4)
    v, i = hyscale_compile.indexer_topk(q, kx, 6, weights=w, scale=0.25, query_offset=16)
    rv, ri, _ = brute_force(q.float(), kx.float(), 6, w=w, scale=0.25, offset=16)
    assert_same_topk(v, i, rv, ri, rtol=1e-5, atol=1e-5)


def test_sparse_gradients_equal_dense_autograd():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, requires_grad=True)
    kx = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(2, 5, 3, requires_grad=True)
    v, i = hyscale_compile.indexer_topk(q, kx, 4, weights=w, scale=0.3, query_offset=4)
    g = torch.randn_like(v)
    mine = torch.autograd.grad((v.nan_to_num(neginf=0) * g).sum(), (q, kx, w))
    dense = (w[..., None] * torch.relu(0.3 * torch.einsum("bthd,bsd->bths", q, kx))).sum(2)
    vis = torch.arange(9)[None, None] <= torch.arange(5)[None, :, None] + 4
    dense = dense.masked_fill(~vis, NEG)
    ref = torch.autograd.grad((dense.gather(-1, i).nan_to_num(neginf=0) * g).sum(), (q, kx, w))
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(k=20), "k=20 is larger than the number of keys S=13"),
    (dict(q=torch.randn(2, 5, 8)), "q must be [B, T, H, D]"),
    (dict(kx=torch.randn(2, 13, 5)), "kx head dim 5 != q head dim 4"),
    (dict(weights=torch.randn(2, 5, 7)), "weights must broadcast to [B, T, H]"),
    (dict(q=torch.randn(2, 5, 3, 4).double()), "q dtype torch.float64 unsupported"),
    (dict(starts=torch.zeros(2, 5), ends=torch.ones(2, 5)), "starts must be an integer tensor"),
])
def test_errors_name_the_argument(bad, message):
    q, kx, w = exact_inputs()
    args = dict(q=q, kx=kx, k=3, weights=w)
    args.update(bad)
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hyscale_compile.indexer_topk(args.pop("q"), args.pop("kx"), args.pop("k"), **args)


def test_fake_rule_with_symbolic_sizes():
    def f(q, kx, w):
        return hyscale_compile.indexer_topk(q, kx, 3, weights=w, query_offset=kx.shape[1] - q.shape[1])

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for T, S in ((4, 9), (6, 13)):
        q, kx, w = torch.randn(1, T, 2, 8), torch.randn(1, S, 8), torch.randn(1, T, 2)
        got, want = compiled(q, kx, w), f(q, kx, w)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_backward_through_inductor_with_non_contiguous_keys():
    """The fake rule of sparse_backward promises contiguous gradients, as the kernels return them."""
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8, requires_grad=True)
    kx_t = torch.randn(9, 2, 8, requires_grad=True)  # [S, B, D]: kx is a transposed view
    w = torch.randn(2, 5, 3, requires_grad=True)

    def loss(q, kx_t, w):
        v, _ = hyscale_compile.indexer_topk(q, kx_t.transpose(0, 1), 4, weights=w, query_offset=4)
        return v.nan_to_num(neginf=0).sum()

    grads = torch.autograd.grad(torch.compile(loss, backend="inductor")(q, kx_t, w), (q, kx_t, w))
    want = torch.autograd.grad(loss(q, kx_t, w), (q, kx_t, w))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_eager_call_skips_the_dispatch_only_where_it_adds_nothing(monkeypatch):
    """indexer_topk calls the op's body itself in a plain eager call (same result, bit for bit); the op's
    dispatch stays wherever it does something: autograd, a dispatch mode, the profiler, a compile."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyscale_compile.lowering import ops

    q, kx, w = exact_inputs(S=13)
    direct = []
    body = ops.select_body
    monkeypatch.setattr(ops, "select_body", lambda *a, **kw: direct.append(1) or body(*a, **kw))

    def call(q=q, kx=kx, w=w):
        direct.clear()
        out = hyscale_compile.indexer_topk(q, kx, 4, weights=w, scale=0.5, query_offset=9)
        return out, bool(direct)

    (v, i), took = call()
    assert took
    ov, oi = torch.ops.hyscale.select(q, kx, w, 4, 0.5, True, True, 9, None, None, None, None, None, NEG, True)
    assert torch.equal(v.view(torch.int32), ov.view(torch.int32)) and torch.equal(i, oi)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert not call()[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not call()[1]
    qg = q.clone().requires_grad_()
    (v, _), took = call(q=qg)
    assert not took and v.requires_grad
    with torch.no_grad():
        assert call(q=qg)[1]
    assert not call(q=torch.nn.Parameter(q.clone(), requires_grad=False))[1]  # a subclass: the dispatch decides
    targets = []

    def backend(gm, inputs):
        targets.extend(n.target for n in gm.graph.nodes)
        return gm

    compiled = torch.compile(lambda q, kx, w: call(q, kx, w)[0], backend=backend, fullgraph=True)
    got = compiled(q, kx, w)
    assert torch.ops.hyscale.select.default in targets or torch.ops.hyscale.select in targets, targets
    assert torch.equal(got[1], i) and torch.equal(got[0].view(torch.int32), v.view(torch.int32))


def test_checks_kept_per_sizes_still_fail_on_new_ones():
    """The op's checks are skipped for sizes, dtypes and devices that passed before, never for new ones."""
    q, kx, w = exact_inputs()
    for _ in range(2):
        hyscale_compile.indexer_topk(q, kx, 3, weights=w)
    with pytest.raises(RuntimeError, match="k=14 is larger"):
        hyscale_compile.indexer_topk(q, kx, 14, weights=w)
    with pytest.raises(RuntimeError, match="weights must broadcast"):
        hyscale_compile.indexer_topk(q, kx, 3, weights=w[:, :, :2])
    with pytest.raises(RuntimeError, match="q dtype torch.float64"):
        hyscale_compile.indexer_topk(q.double(), kx, 3, weights=w)
