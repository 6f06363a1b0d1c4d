"""The filter's capacity contract, checked on its own (shared by the interpreter and GPU tests).

Row thresholds are picked so that some rows pass fewer entries than the capacity C, about C, or
more. Every row counts all its passing entries; a row within C holds exactly them; an overflowed
row (which the check stage recovers whole) holds only passing entries, each once, and nothing is
written past C or past the last row: the reserved append writes none of a thread's entries whose
slots would pass C. Inputs should be exact (multiples of 1/8) so the reference's values are the
kernel's bits.
"""

from __future__ import annotations

import dataclasses

import torch

from hyscale_compile.runtime import reference, score_tile
from hyscale_compile.runtime.filter import filter_rows
from hyscale_compile.runtime.plan import Tuning, make_plan
from hyscale_compile.runtime.problem import Problem
from hyscale_compile.runtime.reference import Visibility

GUARD = 0x5A5A5A5A5A5A5A5A
WANTED = [5, 16, 17, 40, 120, 7]  # passing entries per row for C = 16 (ties aside), scaled by C / 16


def check(q: torch.Tensor, kx: torch.Tensor, w: torch.Tensor, C: int, append: int, bs: int, masked: bool,
          windows: bool) -> tuple[torch.Tensor, int]:
    """Run the filter with tile append / keys per tile as given; assert the contract; return (counts, C).

    windows: per-row starts, so tiles cross the rows' ranges (without them the tiles below the
    diagonal lie inside every row's range); masked: a bool mask on top (its ok kept as bits), "keys": one of the
    key alone ([B, 1, S], the filter's MASK_KEYS path)."""
    B, T, S = q.shape[0], q.shape[1], kx.shape[1]
    assert B == 1
    dev = q.device
    g = torch.Generator().manual_seed(5)
    starts = (torch.arange(T) * (S // (T + 1))).view(1, T).to(dev) if windows else None
    mask = (torch.rand(B, 1 if masked == "keys" else T, S, generator=g) > 0.2).to(dev) if masked else None
    vis = Visibility(causal=True, offset=S - T, starts=starts, mask=mask)
    val = reference.value_rows(q, kx, w, 0.5, True, vis, float("-inf"), 0, T)[0]
    visible = vis.at(0, T, torch.arange(S, device=dev).view(1, 1, S), (B, T, S))[0]
    keys = reference.order_key(val)
    thr = torch.empty(T, dtype=torch.int32, device=dev)
    for r in range(T):  # the threshold whose count of passing entries comes closest to the wanted one
        m = max(1, WANTED[r % len(WANTED)] * C // 16)
        distinct, per = torch.unique(keys[r][visible[r]], sorted=True, return_counts=True)
        at_or_above = per.flip(0).cumsum(0).flip(0)  # entries >= each distinct key
        thr[r] = distinct[(at_or_above - m).abs().argmin()]
    tuning = Tuning(tile=dataclasses.replace(score_tile.TILE, append=append, bs=bs), capacity=C)
    pb = Problem(q, kx, w, 0.5, True, vis, float("-inf"), tuning.tile)
    guarded = torch.full((T + pb.tile.bt, C + 8), GUARD, dtype=torch.int64, device=dev)
    buf = guarded[:T]  # the rows after it: a guard for the query block's rows past T
    cnt = filter_rows(pb, make_plan(pb, 16, tuning), thr, buf)
    assert (guarded[T:] == GUARD).all(), "written past the last row"
    raw = (val.view(torch.int32).long() << 32) | torch.arange(S, device=dev)
    for r in range(T):
        passing = raw[r][visible[r] & (keys[r] >= thr[r])]
        assert int(cnt[r]) == passing.numel(), (r, int(cnt[r]), passing.numel())
        assert (buf[r, C:] == GUARD).all(), f"row {r}: written past the capacity"
        if passing.numel() <= C:
            assert torch.equal(buf[r, :passing.numel()].sort().values, passing.sort().values), r
            assert (buf[r, passing.numel():] == GUARD).all(), r
        else:
            written = buf[r, :C][buf[r, :C] != GUARD]
            assert torch.isin(written, passing).all(), f"row {r}: wrote an entry that does not pass"
            assert written.unique().numel() == written.numel(), f"row {r}: an entry written twice"
    return cnt, C
