"""Kernel tests on CPU run the Triton kernels in the interpreter (tests/conftest.py turns it on when there
is no GPU). On a GPU machine the same kernels are tested natively by tests/gpu, so these are not collected."""

import torch

collect_ignore = ["test_kernels_interpret.py"] if torch.cuda.is_available() else []
