"""HyTopK's check stage (one program over all rows) against what the reference says a row's buffer holds.

Rows come from a problem scored by the plain-PyTorch reference, each with a threshold that lets some of
its entries pass: none, all, about k or about the capacity C. A row's buffer then holds (the filter's
contract) every in-range entry at or above the threshold when there are at most C of them, and after its
C slots its k lowest out-of-range positions, whose value is the fill. The check must flag exactly the
rows whose buffer cannot be trusted to hold their top k (more than C passed, or fewer than k entries
pass in all), and for every other row say which slots to read so that the reference's top k lies within
them. Small blocks make the program scan the rows in many steps, so the carried count of flagged rows
is exercised. Runs natively on a GPU too.
"""

from __future__ import annotations

import pytest
import torch

from hyscale_compile.runtime import check, problem, reference
from hyscale_compile.runtime.reference import Visibility

DEV = "cuda" if torch.cuda.is_available() else "cpu"
S, K, CAP, FILL = 64, 10, 16, 0.0
INT32_MIN = -(2**31)


def _problem(R: int, seed: int):
    """R rows of exact scores (multiples of 1/8 and 1/4) with windows of every length, some empty."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-4, 5, (1, R, 2, 16), generator=g) / 8
    kx = torch.randint(-4, 5, (1, S, 16), generator=g) / 8
    w = torch.randint(-2, 3, (1, R, 2), generator=g) / 4
    starts = torch.randint(0, S // 2, (1, R), generator=g)
    ends = starts + torch.randint(0, S // 2 + 1, (1, R), generator=g)
    return q, kx, w, Visibility(starts=starts, ends=ends)


def _thresholds(keys: torch.Tensor, in_range: torch.Tensor, fill_key: int) -> torch.Tensor:
    """Per row, by r % 6: every entry passes (a row that was not sampled), none does, the fill's own key,
    or the key of the m-th best in-range entry for m = K - 1, K + 2 and CAP + 2 (ties may pass more)."""
    thr = torch.empty(keys.shape[0], dtype=torch.int64)
    for r in range(keys.shape[0]):
        case = r % 6
        mine = keys[r][in_range[r]].sort(descending=True).values
        if case == 0 or mine.numel() == 0:
            thr[r] = INT32_MIN
        elif case == 1:
            thr[r] = int(keys.max()) + 1
        elif case == 2:
            thr[r] = fill_key
        else:
            m = (K - 1, K + 2, CAP + 2)[case - 3]
            thr[r] = mine[min(m, mine.numel()) - 1]
    return thr


@pytest.mark.parametrize("R,block", [(1, 16), (37, 16), (2500, 64), (300, 1024), (5000, 4096)])
def test_check_kernel_against_reference(R, block):
    q, kx, w, vis = _problem(R, seed=R)
    values = reference.value_rows(q, kx, w, 0.5, False, vis, FILL, 0, R)[0]  # [R, S], fill where not visible
    keys = reference.order_key(values)
    lo, hi = (t.view(R) for t in problem.ranges(vis, 1, R, S, torch.device("cpu")))
    pos = torch.arange(S)
    in_range = (pos >= lo[:, None]) & (pos < hi[:, None])
    fill_key = problem.fill_key(FILL)
    thr = _thresholds(keys, in_range, fill_key)
    passing = in_range & (keys >= thr[:, None])  # what the filter appends (and counts past C)
    cnt = passing.sum(1).to(torch.int32)
    extras = (S - (hi - lo)).clamp(max=K)  # the k lowest out-of-range positions, of value FILL
    extras_pass = fill_key >= thr
    flagged = (cnt > CAP) | (cnt + torch.where(extras_pass, extras, 0) < K)  # overflowed, or short of k

    used = torch.full((R,), -7, dtype=torch.int32, device=DEV)
    tail = torch.full((R,), -7, dtype=torch.int32, device=DEV)
    rows = torch.full((R + 1,), -7, dtype=torch.int64, device=DEV)
    nflag = torch.full((1,), -7, dtype=torch.int32, device=DEV)
    counters = torch.tensor([3, 100, 5, 1, 900], dtype=torch.int64, device=DEV)  # added to, not overwritten
    check.check_kernel[(1,)](cnt.to(DEV), thr.to(torch.int32).to(DEV), lo.to(DEV), hi.to(DEV), used, tail, rows,
                             nflag, counters, R, S, K, CAP, fill_key, 2, BLOCK=block,
                             num_warps=check.check_warps(block))
    used, tail, rows, n = used.cpu(), tail.cpu(), rows.cpu(), int(nflag)

    assert n == int(flagged.sum()) and torch.equal(rows[:n], flagged.nonzero().flatten())  # listed in row order
    assert torch.equal(used[flagged], torch.full_like(used[flagged], min(K, CAP)))  # recovery writes k from 0
    assert (tail[flagged] == K).all()  # and may write past C
    ok = ~flagged
    assert torch.equal(used[ok], cnt[ok])  # every candidate of a row within C
    assert torch.equal(tail[ok], torch.where(extras_pass, extras, 0).to(torch.int32)[ok])  # extras only if they pass
    _, top = reference.select(q, kx, w, K, 0.5, False, vis, FILL)
    for r in ok.nonzero().flatten().tolist():  # the reference's top k lies within the slots the row reads
        j = torch.arange(int(tail[r]))
        read = set(pos[passing[r]].tolist()) | set(torch.where(j < lo[r], j, hi[r] + j - lo[r]).tolist())
        assert set(top[0, r].tolist()) <= read, r
    kept = int(cnt.clamp(max=CAP).sum())
    assert counters.tolist() == [4, 100 + R, 5 + n, 1 + (n > 2), 900 + kept]
    if R > 1:  # the rows exercise every outcome
        assert 0 < n < R and bool(((tail == 0) & ok).any()) and bool(((tail > 0) & ok).any())


def test_check_block_bounds():
    assert check.check_block(1) == 16
    assert check.check_block(300) == 512
    assert check.check_block(10**6) == 4096
