"""Pick the implementation of each operator for a device: Triton kernels on CUDA, the reference on CPU.

``force_backend("triton")`` runs the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1),
which is how CI checks the kernels without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from torch import Tensor

from . import reference
from .env import triton_available

_forced: str | None = os.environ.get("HYSCALE_RUNTIME") or None


@contextlib.contextmanager
def force_backend(name: str | None) -> Iterator[None]:
    """Use ``name`` ("triton" or "reference") for every call inside the block; None restores the default."""
    global _forced
    if name not in (None, "triton", "reference"):
        raise ValueError(f"force_backend: unknown backend {name!r}; expected 'triton' or 'reference'")
    old, _forced = _forced, name
    try:
        yield
    finally:
        _forced = old


def backend_for(t: Tensor) -> str:
    if _forced is not None:
        return _forced
    return "triton" if t.is_cuda and triton_available() else "reference"


def kernels_for(t: Tensor):
    """The module implementing ``select`` and ``rescore`` for tensors like ``t``."""
    if backend_for(t) == "triton":
        from . import hytopk

        return hytopk
    return reference


def backward_kernels_for(t: Tensor):
    """The module implementing ``sparse_backward`` for tensors like ``t``."""
    if backend_for(t) == "triton":
        from . import sparse_backward

        return sparse_backward
    return reference
