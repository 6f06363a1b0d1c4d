"""Problems and the dense oracle for ``hyscale::sparse_attention`` tests (CPU, interpreter and GPU).

The oracle is what an unmodified model does: scatter the picks into a [B, T, S] mask, AND it with the
causal / padding mask, and run dense softmax attention over all S keys, with -inf fills (SDPA: a fully
masked row gives 0) or finfo.min fills (eager: a fully masked row gives the mean of v).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Case:
    """One problem's shape and visibility; ``offset`` None = no causal mask, "tensor" = per-batch offsets."""

    B: int = 2
    T: int = 5
    H: int = 4
    G: int = 2
    Dqk: int = 24
    Dv: int = 16
    S: int = 13
    K: int = 6
    offset: int | str | None = None
    key_mask: bool = False
    alias: bool = False  # G = 1 and v = k[..., :Dv] (the MLA latent layout)
    dropped: int = 2  # picks drawn from [-dropped, S + dropped): negative and out-of-range ones are dropped


CASES = {
    "plain": Case(),
    "causal": Case(offset=8),
    "causal_few": Case(T=9, offset=-2, K=8),  # rows with 0, 1, a few visible picks
    "offsets": Case(offset="tensor"),
    "key_mask": Case(key_mask=True, offset=9),
    "gqa": Case(H=6, G=3, Dqk=16, offset=8),
    "mha": Case(H=3, G=3, Dqk=20, Dv=12, S=17, K=9),
    "mla": Case(H=4, G=1, Dqk=24, Dv=16, alias=True, offset=8),
}


def make(case: Case, dtype=torch.float64, device="cpu", seed=0, index_dtype=torch.int64):
    """(q, k, v, indices, query_offset, key_mask) on ``device``; v is a view of k when ``case.alias``."""
    g = torch.Generator().manual_seed(seed)
    B, T, S = case.B, case.T, case.S
    G = 1 if case.alias else case.G
    q = torch.randn(B, T, case.H, case.Dqk, generator=g)
    k = torch.randn(B, S, G, case.Dqk, generator=g)
    v = torch.randn(B, S, G, case.Dv, generator=g)
    lo = -case.dropped
    pool = S + 2 * case.dropped
    idx = torch.stack([torch.randperm(pool, generator=g)[:case.K] + lo for _ in range(B * T)]).view(B, T, case.K)
    mask = (torch.rand(B, S, generator=g) > 0.35) if case.key_mask else None
    offset = case.offset
    if offset == "tensor":
        offset = torch.tensor([S - T, 2 - T] + [0] * (B - 2))[:B]
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    if case.alias:
        v = k[..., :case.Dv]
    idx = idx.to(device, index_dtype)
    offset = offset.to(device) if isinstance(offset, Tensor) else offset
    return q, k, v, idx, offset, (mask.to(device) if mask is not None else None)


def nonfinite_key0_unkept(case: Case, what: str, dtype=torch.float64, device="cpu"):
    """``make``'s problem with key 0 kept by no row, though dropped picks (out of range, hidden, masked) remain,
    and a NaN (``what="v"``) or inf (``"k"``) in key 0's row."""
    q, k, v, idx, offset, key_mask = make(case, dtype=dtype, device=device)
    idx = torch.where(idx == 0, -1, idx)
    if what == "v":
        v[:, 0] = float("nan")
    else:
        k[:, 0] = float("inf")
    return q, k, v, idx, offset, key_mask


def kept_dense(indices: Tensor, S: int, offset, key_mask: Tensor | None) -> Tensor:
    """[B, T, S] bool: key s is picked by (b, t) and visible (the index mask AND the causal / padding mask)."""
    B, T, _ = indices.shape
    idx = indices.long()
    inside = (idx >= 0) & (idx < S)
    picked = torch.zeros(B, T, S, dtype=torch.long, device=idx.device)
    picked.scatter_add_(-1, torch.where(inside, idx, 0), inside.long())
    kept = picked > 0
    pos = torch.arange(S, device=idx.device)
    if offset is not None:
        off = offset.view(-1, 1, 1) if isinstance(offset, Tensor) else offset
        kept &= pos.view(1, 1, S) <= torch.arange(T, device=idx.device).view(1, T, 1) + off
    if key_mask is not None:
        kept &= key_mask[:, None, :]
    return kept


def dense_attention(q, k, v, indices, scale, offset=None, key_mask=None, empty="zero"):
    """(out [B, T, H, Dv], lse [B, T, H]) of dense attention over all S keys under the kept mask, in the
    inputs' dtype (float64 for an oracle); differentiable in q, k, v (gradients of finite lse entries)."""
    B, T, H, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    kh = k.repeat_interleave(H // G, dim=2)
    vh = v.repeat_interleave(H // G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kh) * scale
    kept = kept_dense(indices, S, offset, key_mask)[:, None]
    none = ~kept.any(-1, keepdim=True)
    if empty == "mean":  # eager: masked_fill(finfo.min), softmax over all S keys
        p = s.masked_fill(~kept, torch.finfo(s.dtype).min).softmax(-1)
    else:  # SDPA with a boolean mask: a fully masked row gives 0 (no NaN reaches the gradients)
        p = torch.where(none, 0.0, s.masked_fill(~kept | none, float("-inf")).softmax(-1).nan_to_num())
    out = torch.einsum("bhts,bshd->bthd", p, vh)
    lse = torch.where(none, float("-inf"), s.masked_fill(~kept, float("-inf")).logsumexp(-1, keepdim=True))
    return out, lse[..., 0].transpose(1, 2)


def finite(x: Tensor) -> Tensor:
    return torch.where(torch.isinf(x), 0.0, x)


def close(got, want, tol) -> None:
    """Each pair alike in dtype, shape and where it is inf, and close (as float64) where finite."""
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(finite(a).double(), finite(b).double(), rtol=tol, atol=tol)
