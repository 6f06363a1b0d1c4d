"""Where the runtime's kernels run: the Triton interpreter or a device (and its SMs), and whether Triton is there.

A leaf module (it imports nothing of ours), so every kernel module can ask without import cycles.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton: the reference runs, and nothing asks
    _knobs = None


def interpreting() -> bool:
    """Triton kernels run in the interpreter (on the CPU, programs one after another): Triton's own knob, the one
    its ``jit`` reads to decide (TRITON_INTERPRET, read as Triton reads it; asked several times a call, and the
    knob costs a fraction of an environment lookup of our own)."""
    if _knobs is None:
        return os.environ.get("TRITON_INTERPRET") == "1"
    return bool(_knobs.runtime.interpret)


def compiles_ptx() -> bool:
    """Triton compiles kernels for an NVIDIA GPU here (not the interpreter, not AMD), so inline PTX may be used.
    Asked on every select and rescore call: the interpreter's knob is read each time (tests flip it), the driver's
    target once."""
    return not interpreting() and _targets_cuda()


@functools.cache
def _targets_cuda() -> bool:
    """Whether Triton's active driver compiles for CUDA (False where there is none: a CPU-only machine)."""
    try:
        from triton.runtime import driver

        return driver.active.get_current_target().backend == "cuda"
    except (ImportError, RuntimeError):
        return False


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=16)  # launches size their grids by it on every call; it never changes
def multiprocessors(device: torch.device) -> int:
    """The device's SMs (one off CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
