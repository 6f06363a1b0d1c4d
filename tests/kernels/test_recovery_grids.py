"""Which grids the one-launch recovery tries, in order, and that a refused grid is not tried again.

The launch itself needs CUDA (grid barriers wait for programs that run at the same time); the choice
of grids is host logic, tested here with a stand-in device of 10 SMs.
"""

from __future__ import annotations

import types

import torch

from hyscale_compile.runtime import hytopk


def test_grids_cooperative_first_then_half_the_sms(monkeypatch):
    dev = torch.device("cuda", 7)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=10))
    monkeypatch.setattr(hytopk, "_one_launch_failed", set())
    monkeypatch.setattr(hytopk, "RECOVER_PROGRAMS_PER_SM", 2)
    assert hytopk._one_launch_grids(dev) == [(20, True), (10, True), (5, False)]
    hytopk._one_launch_failed.add((dev, 20, True))  # the driver refused two per SM once
    assert hytopk._one_launch_grids(dev) == [(10, True), (5, False)]
    assert hytopk._one_launch_grids(torch.device("cuda", 6))[0] == (20, True)  # per device
    monkeypatch.setattr(hytopk, "RECOVER_COOPERATIVE", False)
    assert hytopk._one_launch_grids(dev) == [(5, False)]  # the plain launch is always the last resort
