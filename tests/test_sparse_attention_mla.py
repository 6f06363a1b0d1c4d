"""``hyscale::sparse_attention_mla``: the absorbed MLA attention with the absorption inside the op, a block of query
rows at a time. Oracle: the same three steps as graph ops (the attention pass's emission before this op), whose
latent attention is tested against dense attention in test_sparse_attention.py."""

from __future__ import annotations

import pytest
import torch
from sparse_attention_cases import close as _close
from sparse_attention_cases import finite

from hyscale_compile.runtime.sparse_attention import absorbed

Dn, Dr, Dc, Dv = 16, 8, 32, 16


def _problem(B=2, T=11, S=23, H=4, K=7, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dn + Dr, generator=g).to(dtype)
    kv = torch.randn(B, S, 1, Dc + Dr, generator=g).to(dtype)
    w = (torch.randn(H, Dn + Dv, Dc, generator=g) * 0.3).to(dtype)
    idx = torch.stack([torch.randperm(S + 4, generator=g)[:K] - 2 for _ in range(B * T)]).view(B, T, K)
    gout = torch.randn(B, T, H, Dv, generator=g).to(dtype)
    glse = torch.randn(B, T, H, generator=g)
    return q, kv, w, idx, gout, glse


def _graph_ops(q, kv, w, idx, scale, causal, offset, offsets, key_mask, empty):
    """What the attention pass emitted before the op: absorb, latent attention, project."""
    ql = torch.cat([torch.einsum("bthn,hnc->bthc", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
    lat, lse = torch.ops.hyscale.sparse_attention_latent(ql, kv, idx, Dc, scale, causal, offset, offsets, key_mask,
                                                         empty)
    return torch.einsum("bthc,hvc->bthv", lat, w[:, Dn:]), lse


def _op(keep_latent: bool, eager_empty_grad: bool = False):
    """The op as the pass emits it (o' kept or recomputed), its (out, lse)."""
    def run(q, kv, w, idx, *args):
        return torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, *args, eager_empty_grad, keep_latent)[:2]
    return run


def _values_and_grads(fn, q, kv, w, idx, gout, glse, *args):
    leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
    out, lse = fn(*leaves, idx, *args)
    ((out * gout).sum() + (finite(lse) * glse).sum()).backward()
    return (out, lse, *(x.grad for x in leaves))


VISIBILITY = {
    "causal": (True, 12, None, False),
    "few_visible": (True, -3, None, False),  # rows with no visible pick: empty rows
    "offsets": (True, 0, "tensor", False),
    "key_mask": (True, 12, None, True),
    "none": (False, 0, None, False),
}


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("empty", ["zero", "mean"])
@pytest.mark.parametrize("name", sorted(VISIBILITY))
@pytest.mark.parametrize("rows", [1, 4, 100])  # rows a block: 1, uneven blocks (one batch row), all at once
def test_op_equals_the_graph_ops(monkeypatch, name, empty, rows, keep):
    """Values, lse and the gradients of q, kv and w equal the graph ops' for any block of rows, o' kept or
    recomputed, with rows that have no visible pick (a recomputed o' of such rows as the forward gave it: 0 or the
    mean of v), per-batch offsets and a key mask."""
    q, kv, w, idx, gout, glse = _problem(B=1 if rows == 4 else 2, seed=rows)  # B = 1: written in place
    causal, offset, offsets, key_mask = VISIBILITY[name]
    if offsets == "tensor":
        offsets = torch.tensor([12, -4])[:q.shape[0]]
    if key_mask:
        key_mask = torch.rand(q.shape[0], kv.shape[1], generator=torch.Generator().manual_seed(3)) > 0.3
    else:
        key_mask = None
    args = (0.3, causal, offset, offsets, key_mask, empty)
    monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * q.shape[0] * q.shape[2] * (Dc + Dr) * q.element_size())
    got = _values_and_grads(_op(keep), q, kv, w, idx, gout, glse, *args)
    want = _values_and_grads(_graph_ops, q, kv, w, idx, gout, glse, *args)
    _close(got, want, 1e-5)


def test_gradient_of_the_latent_output():
    """o' kept is an output too: a gradient through it (not what the pass's graph takes, but the op's contract)
    reaches q, kv and w as through the graph ops."""
    q, kv, w, idx, _, _ = _problem()
    args = (0.3, True, 12, None, None, "zero")
    g = torch.randn(q.shape[0], q.shape[1], q.shape[2], Dc, generator=torch.Generator().manual_seed(9))

    def graph_ops(q, kv, w, *a):
        ql = torch.cat([torch.einsum("bthn,hnc->bthc", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
        lat, lse = torch.ops.hyscale.sparse_attention_latent(ql, kv, idx, Dc, *a)
        return torch.einsum("bthc,hvc->bthv", lat, w[:, Dn:]), lse, lat

    grads = []
    for fn in (lambda q, kv, w, *a: torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, *a), graph_ops):
        leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
        out, _, lat = fn(*leaves, *args)
        (out.sum() + (lat * g).sum()).backward()
        grads.append([x.grad for x in leaves])
    _close(grads[0], grads[1], 1e-5)


def _rel(a, b):
    a, b = finite(a).double(), finite(b).double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_as_accurate_as_the_graph_ops(seed, keep):
    """16-bit inputs: against the fp32 graph ops, each output and gradient is about as accurate as the bf16 graph
    ops' (which keep o' and take the row term from it). o' kept: the same roundings. o' recomputed: dq and w's
    gradient (from the recomputed o' in fp32) at most as far; kv's, whose contributions take the row term from the
    model's rounded out, within 1.5x."""
    q, kv, w, idx, gout, glse = _problem(dtype=torch.bfloat16, T=40, H=8, seed=seed)
    args = (0.3, True, 12, None, None, "zero")
    got = _values_and_grads(_op(keep), q, kv, w, idx, gout, glse, *args)
    graph = _values_and_grads(_graph_ops, q, kv, w, idx, gout, glse, *args)
    ref = _values_and_grads(_graph_ops, *(x.float() for x in (q, kv, w)), idx, gout.float(), glse, *args)
    bounds = (1, 1, 1, 1, 1) if keep else (1, 1, 1, 1.5, 1)
    for name, a, b, r, most in zip(("out", "lse", "dq", "dkv", "dw"), got, graph, ref, bounds):
        assert a.dtype == b.dtype
        assert _rel(a, r) <= most * _rel(b, r) * 1.05 + 1e-6, (name, _rel(a, r), _rel(b, r))


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_under_torch_compile_with_dynamic_sizes(keep):
    def fn(q, kv, w, idx):
        out, lse, _ = torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, 0.3, True, 12, None, None, "zero",
                                                             False, keep)
        return out.sum(-1) * 2 + finite(lse)

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (5, 7):
        q, kv, w, idx, _, _ = _problem(T=T, seed=T)
        grads = []
        for f in (compiled, fn):
            leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
            y = f(*leaves, idx)
            y.sum().backward()
            grads.append((y, *(x.grad for x in leaves)))
        _close(grads[0], grads[1], 1e-6)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, kv = torch.empty(2, 9, 8, 192, dtype=torch.bfloat16), torch.empty(2, 40, 1, 576, dtype=torch.bfloat16)
        w, idx = torch.empty(8, 256, 512, dtype=torch.bfloat16), torch.empty(2, 9, 16, dtype=torch.int32)
        out, lse, lat = torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, 128, 0.1, True, 0, None, None, "zero")
        assert out.shape == (2, 9, 8, 128) and lse.shape == (2, 9, 8) and lat.shape == (2, 9, 8, 512)
        assert lse.dtype == torch.float32 and out.dtype == lat.dtype == torch.bfloat16
        _, _, none = torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, 128, 0.1, True, 0, None, None, "zero",
                                                            False, False)
        assert none.shape == (0,)


@pytest.mark.parametrize("bad,match", [
    (dict(nope_dim=0), "nope_dim 0 must be in"),
    (dict(nope_dim=Dn + Dr), "nope_dim 24 must be in"),
    (dict(w=torch.zeros(3, Dn + Dv, Dc)), "w must have q's 4 heads"),
    (dict(w=torch.zeros(4, Dn + Dv)), "w must be \\[H, Dn \\+ Dv, Dc\\]"),
    (dict(w=torch.zeros(4, Dn + Dv, Dc, dtype=torch.bfloat16)), "w must have q's dtype"),
    (dict(kv=torch.zeros(2, 23, 2, Dc + Dr)), "one latent row a key"),
    (dict(kv=torch.zeros(2, 23, 1, Dc + Dr + 1)), "kv's features 41 != the latent 32"),
    (dict(idx=torch.zeros(2, 11, 3)), "indices must be int32 or int64"),
])
def test_argument_errors_name_the_argument(bad, match):
    q, kv, w, idx, _, _ = _problem()
    args = dict(q=q, kv=kv, w=w, idx=idx, nope_dim=Dn)
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.hyscale.sparse_attention_mla(args["q"], args["kv"], args["w"], args["idx"], args["nope_dim"], 0.3,
                                               True, 0, None, None, "zero")


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_no_zero_gradient_is_made_for_the_other_outputs(monkeypatch, compiled, keep):
    """Where only out is read (the pass's graph), the backward gets None for o' and lse, not zeros the size of o',
    eagerly and in AOTAutograd's traced backward; without keep_latent nothing [B, T, H, Dc] is saved."""
    seen = []
    real = absorbed.backward

    def spy(dout, dlse, dlat, *args):
        seen.append((dlse, dlat))
        return real(dout, dlse, dlat, *args)

    monkeypatch.setattr(absorbed, "backward", spy)
    q, kv, w, idx, gout, _ = _problem()

    def fn(q, kv, w):
        return torch.ops.hyscale.sparse_attention_mla(q, kv, w, idx, Dn, 0.3, True, 12, None, None, "zero", False,
                                                      keep)[0]

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in (q, kv, w)]
    y = fn(*leaves)
    if not compiled:
        Dc_sized = [t for t in y.grad_fn.saved_tensors if t is not None and t.dim() == 4 and t.shape[-1] == Dc]
        assert len(Dc_sized) == (1 if keep else 0), "o' kept for the backward exactly where asked"
    (y * gout).sum().backward()
    assert seen and all(dlse is None and dlat is None for dlse, dlat in seen)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("rows", [2, 100])
def test_eager_empty_row_gradient_folded_in(monkeypatch, rows, keep):
    """eager_empty_grad: rows with no visible pick (empty="mean") get eager's gradient for an additive finfo.min mask,
    as the graph ops with empty_rows_like_eager after the latent op give it."""
    q, kv, w, idx, gout, glse = _problem(seed=5)
    args = (0.3, True, -3, None, None, "mean")  # rows t < 3 see no key
    monkeypatch.setattr(absorbed, "ROWS_BYTES", rows * q.shape[0] * q.shape[2] * (Dc + Dr) * q.element_size())

    def graph_ops(q, kv, w, idx, *a):
        ql = torch.cat([torch.einsum("bthn,hnc->bthc", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
        lat, lse = torch.ops.hyscale.sparse_attention_latent(ql, kv, idx, Dc, *a)
        lat = torch.ops.hyscale.empty_rows_like_eager(lat, ql, kv, kv[..., :Dc], lse, a[0])
        return torch.einsum("bthc,hvc->bthv", lat, w[:, Dn:]), lse

    got = _values_and_grads(_op(keep, eager_empty_grad=True), q, kv, w, idx, gout, glse, *args)
    want = _values_and_grads(graph_ops, q, kv, w, idx, gout, glse, *args)
    plain = _values_and_grads(_graph_ops, q, kv, w, idx, gout, glse, *args)
    _close(got, want, 1e-5)
    assert not torch.allclose(want[2], plain[2])  # the empty rows' q gradient is there to fold
