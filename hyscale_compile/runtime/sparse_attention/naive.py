"""Plain-PyTorch reference of ``hyscale::sparse_attention``: the operator contract written as code.

    q [B, T, H, Dqk], k [B, S, G, Dqk], v [B, S, G, Dv], indices [B, T, K]; H % G == 0 and query head h
    reads kv group g = h // (H // G). For each (b, t, h) the kept picks are

        P = { s = indices[b, t, j] : 0 <= s < S and visible(b, t, s) }
        visible = (not causal or s <= t + offset (+ offsets[b])) and (key_mask is None or key_mask[b, s])

    (the caller guarantees that the indices of a row are distinct; picks out of range or not visible are
    dropped), and

        out[b, t, h] = sum_{s in P} softmax_P(scale * q[b, t, h] . k[b, s, g]) * v[b, s, g]
        lse[b, t, h] = logsumexp_{s in P}(scale * q[b, t, h] . k[b, s, g])        (natural log, fp32)

    A row with empty P gives what the model gives: empty="zero" -> out = 0 (SDPA under a boolean mask),
    empty="mean" -> out = the mean of v[b, :, g] over all S keys (eager softmax over scores filled with
    finfo.min); lse = -inf either way, and the backward gives such a row's q and k nothing (and, for
    "mean", 1/S of its output gradient to every v row of its batch and group).

It gathers only the picked rows, a block of query rows at a time, so it runs at sizes the dense masked
attention cannot; it is what runs on the CPU and what the Triton kernels are tested against. Inputs
are computed in fp32 (float64 stays float64, for tests); the backward takes ``delta`` = rowsum(dout *
out) - dlse from the caller, so an lse gradient folds in as for flash-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Upper bound on the elements of one block's gathered rows [B, rows, K, G, Dqk + Dv].
_BLOCK_ELEMS = 1 << 24

EMPTY_RULES = ("zero", "mean")


@dataclass(frozen=True)
class Picks:
    """Which picks of a row count: in range, and visible under the causal limit and the key mask."""

    causal: bool = False
    offset: int = 0
    offsets: Tensor | None = None  # [B] integer, added to offset per batch
    key_mask: Tensor | None = None  # [B, S] bool, True = visible

    def kept(self, idx: Tensor, t0: int, S: int) -> Tensor:
        """Bool [B, R, K]: which picks ``idx`` [B, R, K] of query rows t0..t0+R count."""
        idx = idx.long()
        ok = (idx >= 0) & (idx < S)
        if self.causal:
            lim = torch.arange(t0, t0 + idx.shape[1], device=idx.device).view(1, -1, 1) + self.offset
            if self.offsets is not None:
                lim = lim + self.offsets.to(device=idx.device, dtype=torch.int64).view(-1, 1, 1)
            ok &= idx <= lim
        if self.key_mask is not None:
            safe = torch.where(ok, idx, 0).reshape(idx.shape[0], -1)
            ok &= self.key_mask.gather(1, safe).view(idx.shape)
        return ok


def compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def value_mean(v: Tensor) -> Tensor:
    """[B, G, Dv] mean of v over all S keys, what an empty row gives under empty="mean"."""
    return v.to(compute_dtype(v)).mean(1)


def empty_rows(lse: Tensor) -> Tensor:
    """Bool [B, T, H]: rows with no kept pick (their lse is -inf)."""
    return lse == float("-inf")


def add_mean_grad(dv: Tensor, dout: Tensor, lse: Tensor) -> None:
    """dv [B, S, G, Dv] += what empty="mean" rows send back: 1/S of their output gradient to every key."""
    B, T, H, Dv = dout.shape
    S, G = dv.shape[1], dv.shape[2]
    g = torch.where(empty_rows(lse)[..., None], dout.to(dv.dtype), 0.0)
    dv += (g.view(B, T, G, H // G, Dv).sum((1, 3)) / S)[:, None]


def rows_per_block(B: int, K: int, G: int, width: int, elems: int = _BLOCK_ELEMS) -> int:
    return max(1, elems // max(1, B * K * G * width))


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, S, G, D] at idx [B, R, K] -> [B, R, K, G, D]."""
    b = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
    return x[b, idx]


def _block(q, k, v, indices, scale, picks: Picks, lse, t0, t1):
    """Shared by forward and backward: gathered rows and scores of query rows t0:t1, grouped by kv group.

    Returns (qg [B, R, G, HG, Dqk], kg, vg [B, R, K, G, D] with dropped picks' rows 0, kept [B, R, K], scores
    [B, R, G, HG, K] with dropped picks at -inf, p = exp(scores - lse) or None when lse is not given). A dropped
    pick reads key 0 (an index in range) and its rows are then replaced by zeros, not multiplied by p = 0: a NaN
    or inf in key 0 must not reach rows that never picked it."""
    B, _, H, Dqk = q.shape
    S, G = k.shape[1], k.shape[2]
    ct = compute_dtype(q)
    idx = indices[:, t0:t1].long()
    kept = picks.kept(idx, t0, S)
    safe = torch.where(kept, idx, 0)
    rows = kept[:, :, :, None, None]
    kg, vg = (torch.where(rows, _gather(x, safe).to(ct), 0.0) for x in (k, v))
    qg = q[:, t0:t1].to(ct).view(B, t1 - t0, G, H // G, Dqk)
    s = torch.einsum("brghd,brkgd->brghk", qg, kg) * scale
    s = s.masked_fill(~kept[:, :, None, None, :], float("-inf"))
    p = None
    if lse is not None:
        m = lse[:, t0:t1].to(ct).view(B, t1 - t0, G, H // G, 1)
        p = torch.where(kept[:, :, None, None, :], torch.exp(s - torch.where(torch.isinf(m), 0.0, m)), 0.0)
    return qg, kg, vg, kept, s, p


def outputs(q: Tensor, Dv: int, lse_dtype: torch.dtype, out: Tensor | None,
            lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """The forward's (out, lse): the caller's where given (checked), else new."""
    B, T, H = q.shape[:3]
    if out is None:
        out = torch.empty(B, T, H, Dv, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, T, H, dtype=lse_dtype, device=q.device)
    assert out.shape == (B, T, H, Dv) and out.dtype == q.dtype and out.is_contiguous(), "out: [B, T, H, Dv], q's dtype"
    assert lse.shape == (B, T, H) and lse.dtype == lse_dtype and lse.is_contiguous(), "lse: [B, T, H]"
    return out, lse


def forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, scale: float, picks: Picks, empty: str,
            out: Tensor | None = None, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] in q's dtype, lse [B, T, H] fp32 (float64 for float64 inputs)), written into ``out`` /
    ``lse`` where given (contiguous)."""
    B, T, H, Dqk = q.shape
    G, Dv, K = k.shape[2], v.shape[3], indices.shape[-1]
    ct = compute_dtype(q)
    out, lse = outputs(q, Dv, ct, out, lse)
    vmean = value_mean(v) if empty == "mean" else None
    step = rows_per_block(B, K, G, Dqk + Dv)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        _, _, vg, _, s, _ = _block(q, k, v, indices, scale, picks, None, t0, t1)
        m = torch.logsumexp(s, dim=-1)  # -inf where no pick is kept
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m)[..., None])
        o = torch.einsum("brghk,brkgd->brghd", p, vg)
        if vmean is not None:
            o = torch.where(torch.isinf(m)[..., None], vmean[:, None, :, None, :], o)
        out[:, t0:t1] = o.reshape(B, t1 - t0, H, Dv).to(q.dtype)
        lse[:, t0:t1] = m.reshape(B, t1 - t0, H)
    return out, lse


def _output(p: Tensor, vg: Tensor, lse: Tensor, vmean: Tensor | None) -> Tensor:
    """[B, R, G, HG, Dv]: the forward's output from p [B, R, G, HG, K] (normalized by lse), its empty rows (lse
    -inf, p 0) per the empty rule (vmean given: empty="mean")."""
    o = torch.einsum("brghk,brkgd->brghd", p, vg)
    if vmean is not None:
        empty = torch.isinf(lse).view(*p.shape[:4], 1)
        o = torch.where(empty, vmean[:, None, :, None, :], o)
    return o


def backward(dout: Tensor, delta: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, indices: Tensor,
             scale: float, picks: Picks, empty: str, fold: bool = False, dkv_acc: Tensor | None = None,
             out: Tensor | None = None, dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv) in the inputs' dtypes. delta [B, T, H] = rowsum(dout * out) - dlse. ``fold``
    (``backward_latent``): dv added into dk's first Dv columns, None for dv; with ``dkv_acc`` ([B, S, G, Dqk] in
    the compute dtype) that sum is added into it and it is returned in place of dk. ``out`` ([B, T, H, Dv]): the
    forward's output, recomputed from p, is written into it (for a caller that did not keep it).

    With ``out``, ``delta`` is the caller's approximation, from an output it did not keep (``dlse``: the lse
    gradient it includes, or None), and dq takes the row term consistent with the recomputed o instead:
    ds' = ds - p * eps, eps = sum_j p_j dp_j - dlse - delta (= rowsum(dout * o) - dlse - delta), so
    dq = scale * (ds @ k - eps * (p @ k)). The softmax backward needs delta = sum_j p_j dp_j for the dp it forms;
    from a rounded output (another rounding of dout than the one dp is formed from: the absorbed MLA op's
    dout * out over the projected features) the difference is not a rounding of ds but a bias p * eps in every
    pick, which dq would sum over the row's picks. The sum over the picks needs no output: the kernels form it
    with dp, before any o exists.
    dk and dv keep the caller's delta (their sums over the rows that pick a key are formed before o is known).

    p = exp(scale * q.k - lse), dp = dout . v, ds = p * (dp - delta); dq = scale * ds @ k,
    dk = scale * ds^T @ q, dv = p^T @ dout over the kept picks; index_add_ is deterministic on the CPU.
    """
    B, T, H, Dqk = q.shape
    S, G, Dv, K = k.shape[1], k.shape[2], v.shape[3], indices.shape[-1]
    ct = compute_dtype(q)
    dq = torch.empty(B, T, H, Dqk, dtype=ct, device=q.device)
    dk = torch.zeros(B * S, G, Dqk, dtype=ct, device=q.device)
    dv = torch.zeros(B * S, G, Dv, dtype=ct, device=q.device)
    vmean = value_mean(v) if out is not None and empty == "mean" else None
    step = rows_per_block(B, K, G, Dqk + Dv)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        R = t1 - t0
        qg, kg, vg, kept, _, p = _block(q, k, v, indices, scale, picks, lse, t0, t1)
        dog = dout[:, t0:t1].to(ct).view(B, R, G, H // G, Dv)
        dp = torch.einsum("brghd,brkgd->brghk", dog, vg)
        ds = torch.where(kept[:, :, None, None, :], p * (dp - delta[:, t0:t1].to(ct).view(B, R, G, H // G, 1)), 0.0)
        dq_t = torch.einsum("brghk,brkgd->brghd", ds, kg)
        if out is not None:
            o = _output(p, vg, lse[:, t0:t1], vmean)
            out[:, t0:t1] = o.reshape(B, R, H, Dv).to(out.dtype)
            # sum_j p_j dp_j: rowsum(dout * o) of the o that p gives, formed from the dp the sums above used
            pdp = torch.where(kept[:, :, None, None, :], p * dp, 0.0)
            eps = pdp.sum(-1, keepdim=True) - delta[:, t0:t1].to(ct).view(B, R, G, H // G, 1)
            if dlse is not None:
                eps = eps - dlse[:, t0:t1].to(ct).view(B, R, G, H // G, 1)
            # an empty row has p = 0: no correction, whatever its delta and dlse are (an infinite lse gradient at
            # its lse of -inf, or the mean of a v with a NaN in a key no row picks, would make eps * 0 NaN)
            eps = torch.where(empty_rows(lse[:, t0:t1]).view(B, R, G, H // G, 1), 0.0, eps)
            dq_t = dq_t - eps * torch.einsum("brghk,brkgd->brghd", p, kg)
        dq[:, t0:t1] = (dq_t * scale).reshape(B, R, H, Dqk)
        flat = (torch.where(kept, indices[:, t0:t1].long(), 0)
                + torch.arange(B, device=q.device).view(-1, 1, 1) * S).reshape(-1)
        rows = kept[:, :, :, None, None]  # a dropped pick adds nothing to key 0 (0 * an inf query is NaN)
        dk_c = torch.where(rows, torch.einsum("brghk,brghd->brkgd", ds, qg) * scale, 0.0)
        dv_c = torch.where(rows, torch.einsum("brghk,brghd->brkgd", p, dog), 0.0)
        dk.index_add_(0, flat, dk_c.reshape(-1, G, Dqk))
        dv.index_add_(0, flat, dv_c.reshape(-1, G, Dv))
    dv = dv.view(B, S, G, Dv)
    if empty == "mean":
        add_mean_grad(dv, dout, lse)
    if fold:
        dk[..., :Dv] += dv.view(B * S, G, Dv)
        if dkv_acc is not None:
            dkv_acc += dk.view(B, S, G, Dqk)
            return dq.to(q.dtype), dkv_acc, None
        return dq.to(q.dtype), dk.view(B, S, G, Dqk).to(k.dtype), None
    return dq.to(q.dtype), dk.view(B, S, G, Dqk).to(k.dtype), dv.to(v.dtype)


def backward_latent(dout: Tensor, delta: Tensor, q: Tensor, kv: Tensor, Dv: int, lse: Tensor, indices: Tensor,
                    scale: float, picks: Picks, empty: str, dkv_acc: Tensor | None = None,
                    out: Tensor | None = None, dlse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dq, dkv) of the latent form, v = kv[..., :Dv]: dkv is the whole gradient of kv, dk with dv added into its
    first Dv columns (in fp32, before the cast to kv's dtype); with ``dkv_acc`` (compute dtype) added into it
    instead, uncast (for a caller that runs the query rows in blocks); ``out`` and ``dlse`` as for ``backward``."""
    dq, dkv, _ = backward(dout, delta, q, kv, kv[..., :Dv], lse, indices, scale, picks, empty, fold=True,
                          dkv_acc=dkv_acc, out=out, dlse=dlse)
    return dq, dkv
