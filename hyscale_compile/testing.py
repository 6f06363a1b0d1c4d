"""Comparison rules shared by every test (and usable by users checking their own models)."""

from __future__ import annotations

import torch
from torch import Tensor


def _close(a: Tensor, b: Tensor, rtol: float, atol: float) -> Tensor:
    a, b = a.double(), b.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    near = (a - b).abs() <= atol + rtol * b.abs()
    return both_nan | same_inf | near


def assert_same_topk(values: Tensor, indices: Tensor, ref_values: Tensor, ref_indices: Tensor,
                     rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Top-k results agree up to rounding and near-ties.

    The rule: sorted values agree within (rtol, atol); indices agree as sets per row, except that an
    index present in one result and not the other must carry a value within (rtol, atol) of the
    other result's k-th (smallest kept) value: a tie or near-tie that rounding may break either way.
    Works for sorted=False results too (rows are compared as sets).
    """
    assert values.shape == ref_values.shape, f"values shape {tuple(values.shape)} != {tuple(ref_values.shape)}"
    assert indices.shape == ref_indices.shape, f"indices shape {tuple(indices.shape)} != {tuple(ref_indices.shape)}"
    if values.numel() == 0:
        return
    k = values.shape[-1]
    v = values.detach().reshape(-1, k).cpu().double()
    rv = ref_values.detach().reshape(-1, k).cpu().double()
    i = indices.detach().reshape(-1, k).cpu().long()
    ri = ref_indices.detach().reshape(-1, k).cpu().long()
    # torch.sort puts NaN last in ascending order; compare sorted rows elementwise.
    vs, rvs = v.sort(-1).values, rv.sort(-1).values
    ok = _close(vs, rvs, rtol, atol)
    bad_rows = (~ok.all(-1)).nonzero().flatten()
    assert bad_rows.numel() == 0, (
        f"top-k values differ in {bad_rows.numel()} rows; first row {bad_rows[0].item()}: "
        f"{vs[bad_rows[0]].tolist()} vs {rvs[bad_rows[0]].tolist()}")
    kth = torch.where(torch.isnan(vs), torch.full_like(vs, float("inf")), vs).min(-1).values
    rkth = torch.where(torch.isnan(rvs), torch.full_like(rvs, float("inf")), rvs).min(-1).values
    for row in range(i.shape[0]):
        mine, theirs = set(i[row].tolist()), set(ri[row].tolist())
        if mine == theirs:
            continue
        for idx, vals, idxs, other_kth in ((mine - theirs, v, i, rkth), (theirs - mine, rv, ri, kth)):
            for x in idx:
                val = vals[row][(idxs[row] == x).nonzero()[0, 0]]
                assert bool(_close(val, other_kth[row], rtol, atol)), (
                    f"row {row}: index {x} (value {val.item()}) is in one result only and is not a near-tie "
                    f"of the k-th value {other_kth[row].item()}")
    assert len(set(i[0].tolist())) == k, "indices within a row must be distinct"
