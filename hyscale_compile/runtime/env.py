"""Where the runtime's kernels run: the Triton interpreter or a device, and whether Triton is there at all.

A leaf module (it imports nothing of ours), so every kernel module can ask without import cycles.
"""

from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Triton kernels run in the interpreter (on the CPU, programs one after another)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
