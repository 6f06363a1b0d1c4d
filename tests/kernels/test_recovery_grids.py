"""Which grids the one-launch recovery tries, in order, and that a refused grid is not tried again.

The launch itself needs CUDA (grid barriers wait for programs that run at the same time); the choice
of grids is host logic, tested here with a stand-in device of 10 SMs.
"""

from __future__ import annotations

import torch

from hyscale_compile.runtime import launch_policy


def test_grids_cooperative_first_then_half_the_sms(monkeypatch):
    dev = torch.device("cuda", 7)
    monkeypatch.setattr(launch_policy, "multiprocessors", lambda d: 10)
    monkeypatch.setattr(launch_policy, "_one_launch_failed", set())
    monkeypatch.setattr(launch_policy, "RECOVER_PROGRAMS_PER_SM", 2)
    assert launch_policy.one_launch_grids(dev) == [(20, True), (10, True), (5, False)]
    launch_policy._one_launch_failed.add((dev, 20, True))  # the driver refused two per SM once
    assert launch_policy.one_launch_grids(dev) == [(10, True), (5, False)]
    assert launch_policy.one_launch_grids(torch.device("cuda", 6))[0] == (20, True)  # per device
    monkeypatch.setattr(launch_policy, "RECOVER_COOPERATIVE", False)
    assert launch_policy.one_launch_grids(dev) == [(5, False)]  # the plain launch is always the last resort


class _Device:
    """A stand-in launch: refuses cooperative grids above ``most`` programs as the CUDA driver does."""

    def __init__(self, most: int, other_error: str | None = None):
        self.most, self.other_error, self.ran = most, other_error, []

    def __call__(self, grid, p, all_passes, launch_cooperative_grid=False):
        if self.other_error:
            raise RuntimeError(self.other_error)
        if launch_cooperative_grid and grid > self.most:
            raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
        self.ran.append((grid, launch_cooperative_grid))


def test_launch_once_takes_the_first_grid_the_device_holds(monkeypatch):
    monkeypatch.setattr(launch_policy, "_one_launch_failed", set())
    monkeypatch.setattr(launch_policy, "_one_launch_ran", set())
    dev = torch.device("cuda", 0)
    grids = [(20, True), (10, True), (5, False)]
    device = _Device(most=12)
    assert launch_policy.launch_once(device, (dev, "v"), grids, items=1000, capturing=False)
    assert device.ran == [(10, True)]  # 20 refused, 10 cooperative ran
    assert (dev, 20, True) in launch_policy._one_launch_failed
    few = _Device(most=12)
    assert launch_policy.launch_once(few, (dev, "v"), grids, items=3, capturing=False)
    assert few.ran == [(3, True)]  # never more programs than work items


def test_launch_once_while_capturing_tries_only_grids_that_ran(monkeypatch):
    monkeypatch.setattr(launch_policy, "_one_launch_failed", set())
    monkeypatch.setattr(launch_policy, "_one_launch_ran", set())
    dev = torch.device("cuda", 0)
    grids = [(20, True), (5, False)]
    device = _Device(most=100)
    assert launch_policy.launch_once(device, (dev, "v"), grids, items=1000, capturing=True)
    assert device.ran == [(5, False)]  # no cooperative grid ran for this variant yet: the plain one
    assert launch_policy.launch_once(device, (dev, "v"), grids, items=1000, capturing=False)
    assert launch_policy.launch_once(device, (dev, "v"), grids, items=1000, capturing=True)
    assert device.ran[1:] == [(20, True), (20, True)]  # known to run: used inside the capture too
    assert launch_policy.launch_once(device, (dev, "w"), grids, items=1000, capturing=True)
    assert device.ran[-1] == (5, False)  # another variant (other registers) has not run cooperatively


def test_launch_once_raises_other_errors():
    import pytest

    with pytest.raises(RuntimeError, match="illegal memory access"):
        launch_policy.launch_once(_Device(most=100, other_error="Triton Error [CUDA]: an illegal memory access"),
                           (torch.device("cuda", 0), "v"), [(20, True), (5, False)], items=1000, capturing=False)
