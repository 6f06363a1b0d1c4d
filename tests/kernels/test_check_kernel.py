"""HyTopK's check stage (one program over all rows) against its plain torch twin, which keeps the
formulas of the torch ops the kernel replaced.

Small blocks make the program scan the rows in many steps, so the carried count of flagged rows
is exercised; the rows mix every reason to flag and not to flag. Runs natively on a GPU too.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_compile.runtime import check_kernels as ck

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(R: int, S: int, k: int, cap: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cnt = torch.randint(0, cap + 8, (R,), generator=g, dtype=torch.int32)
    cnt[torch.randint(0, R, (R // 8,), generator=g)] = k - 1  # just short of k: flagged unless extras help
    lo = torch.randint(0, S // 2, (R,), generator=g)
    hi = torch.maximum(lo, torch.randint(0, S + 1, (R,), generator=g))
    thr = torch.randint(-50, 50, (R,), generator=g, dtype=torch.int32)  # about half at or below the fill key
    return [t.to(DEV) for t in (cnt, thr, lo.contiguous(), hi.contiguous())]


@pytest.mark.parametrize("R,block", [(1, 16), (37, 16), (2500, 64), (300, 1024), (5000, 4096)])
def test_check_kernel_matches_reference(R, block):
    S, k, cap, fill_key = 500, 40, 64, 0
    cnt, thr, lo, hi = _rows(R, S, k, cap, seed=R)
    used = torch.full((R,), -7, dtype=torch.int32, device=DEV)
    tail = torch.full((R,), -7, dtype=torch.int32, device=DEV)
    rows = torch.full((R + 1,), -7, dtype=torch.int64, device=DEV)
    nflag = torch.full((1,), -7, dtype=torch.int32, device=DEV)
    counters = torch.tensor([3, 100, 5, 1, 900], dtype=torch.int64, device=DEV)  # added to, not overwritten
    ck.check_kernel[(1,)](cnt, thr, lo, hi, used, tail, rows, nflag, counters, R, S, k, cap, fill_key, 2, BLOCK=block,
                          num_warps=ck.check_warps(block))
    want_used, want_tail, want_rows, want_n, want_kept = ck.check_reference(cnt, thr, lo, hi, S, k, cap, fill_key)
    assert torch.equal(used, want_used) and torch.equal(tail, want_tail)
    assert int(nflag) == want_n
    assert torch.equal(rows[:want_n], want_rows)
    assert counters.tolist() == [4, 100 + R, 5 + want_n, 1 + (want_n > 2), 900 + want_kept]
    if R > 1:
        assert 0 < want_n < R  # the rows exercise both outcomes
        assert 0 < int((want_tail == 0).sum()) < R - want_n  # and rows that need their extras and rows that don't


def test_check_block_bounds():
    assert ck.check_block(1) == 16
    assert ck.check_block(300) == 512
    assert ck.check_block(10**6) == 4096
