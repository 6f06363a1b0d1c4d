"""Whether the recovery's one launch may run on a grid, and on which: the cooperative-launch policy.

The recovery runs all its passes in one launch with grid barriers between them (the launches were
most of a small training step's host time). A barrier needs every program resident at once, or it
waits forever: a cooperative launch makes the driver refuse a grid it cannot keep resident, so grids
are tried largest first, cooperatively, and a plain launch on half the SMs comes last. Refusals are
remembered per device, and while a CUDA graph is being captured (where a refusal would break the
capture) only grids that ran before are tried.
"""

from __future__ import annotations

import torch

from .env import multiprocessors

# Recovery in one launch on CUDA (all passes, grid barriers between them) instead of PASSES + 1 launches.
# False goes back to one launch per pass (for a GPU shared so that half its SMs cannot hold one program
# each at once).
RECOVER_ONE_LAUNCH = True
# The one launch as a cooperative launch of RECOVER_PROGRAMS_PER_SM programs per SM: a heavy recovery
# (past 64 flagged rows) then has the programs of a full wave, not one per SM on half of them.
RECOVER_COOPERATIVE = True
RECOVER_PROGRAMS_PER_SM = 2

_one_launch_failed: set[tuple[torch.device, int, bool]] = set()  # (device, programs, cooperative) refused
_one_launch_ran: set[tuple] = set()  # ((device, constexprs, tile), programs, cooperative) that ran


def launch_once(launch, variant: tuple, grids: list[tuple[int, bool]], items: int, capturing: bool) -> bool:
    """Run the recovery as one launch on the first grid of ``grids`` ((programs, cooperative)) the device
    takes: a cooperative grid it cannot keep resident is refused with an error that names the
    cooperative launch, and the next is tried; any other error is raised. While a CUDA graph is
    being captured, a refusal would break the capture, so only grids this kernel variant ran on
    before, or plain ones, are tried. True once a launch ran."""
    for grid, cooperative in grids:
        key = (variant, grid, cooperative)
        if capturing and cooperative and key not in _one_launch_ran:
            continue
        try:
            launch(min(items, grid), 0, True, **({"launch_cooperative_grid": True} if cooperative else {}))
        except RuntimeError as e:
            if not cooperative or "cooperative" not in str(e).lower():
                raise
            _one_launch_failed.add((variant[0], grid, cooperative))
            continue
        _one_launch_ran.add(key)
        return True
    return False


def one_launch_grids(dev: torch.device) -> list[tuple[int, bool]]:
    """(programs, cooperative) to try for the one-launch recovery, in order: RECOVER_PROGRAMS_PER_SM per
    SM as a cooperative launch (the driver refuses a grid it cannot keep resident, where a plain launch
    would deadlock at the first barrier); one per SM, cooperative; at last a plain launch on half the
    SMs (a process limited to part of the GPU still holds them all). A grid refused once is skipped
    after, for every kernel variant (a refusal depends on the variant's registers: conservative)."""
    sms = multiprocessors(dev)
    grids = [(sms * RECOVER_PROGRAMS_PER_SM, True), (sms, True)] if RECOVER_COOPERATIVE else []
    return [g for g in grids if (dev, *g) not in _one_launch_failed] + [(max(1, sms // 2), False)]
