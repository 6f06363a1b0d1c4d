"""Run Triton kernels on CPU: TRITON_INTERPRET=1, set before triton is imported anywhere.

The interpreter of triton 3.6 converts loop bounds with ``int(array)``, which numpy >= 2.4 refuses
for one-element arrays; the shim below makes runtime loop bounds work (the compiled path is untouched).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_original_patch = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope) -> None:
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
