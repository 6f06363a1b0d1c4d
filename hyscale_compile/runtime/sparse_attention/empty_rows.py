"""The gradient a model's additive ``finfo.min`` mask gives a row with no visible key (``lowering/attention_rows.py``
says where it comes from): with p = 1/S on every key and g the row's output gradient,

    d score[s] = (g . (v[s] - mean(v))) / S,   dq = scale * sum_s d score[s] k[s],   dk[s] += scale * d score[s] q

computed for the empty rows only (gathered: their cost is the model's, against all S keys, and nothing when no
row is empty).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Upper bound on the elements of one chunk's [rows, H, S] score gradients.
_CHUNK_ELEMS = 1 << 24


def eager_gradient(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(dq, dk) in the compute dtype (fp32, float64 for float64): eager's softmax gradient on the rows with no
    visible pick (lse = -inf), zero elsewhere; deterministic (no atomics)."""
    B, T, H, Dqk = q.shape
    S, G, Dv = k.shape[1], k.shape[2], v.shape[3]
    HG = H // G
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(B, T, H, Dqk, dtype=ct, device=q.device)
    dk = torch.zeros(B, S, G, Dqk, dtype=ct, device=q.device)
    empty = lse == float("-inf")  # [B, T, H]
    rows = empty.any(-1).nonzero()  # (b, t) with an empty head (a host sync; only graphs that can have such rows)
    if rows.numel() and S:
        vc = v.to(ct) - v.to(ct).mean(1, keepdim=True)  # [B, S, G, Dv]
        step = max(1, _CHUNK_ELEMS // max(1, H * S))
        for b in rows[:, 0].unique().tolist():
            ts = rows[rows[:, 0] == b, 1]
            kb, vb = k[b].to(ct), vc[b]
            for i in range(0, ts.numel(), step):
                t = ts[i:i + step]
                R = t.numel()
                keep = empty[b, t].to(ct).view(R, G, HG, 1)
                g = grad[b, t].to(ct).view(R, G, HG, Dv) * keep
                ds = torch.einsum("rghd,sgd->rghs", g, vb) / S
                dq[b, t] = (torch.einsum("rghs,sgd->rghd", ds, kb) * scale).reshape(R, H, Dqk)
                dk[b] += torch.einsum("rghs,rghd->sgd", ds, q[b, t].to(ct).view(R, G, HG, Dqk)) * scale
    return dq, dk
