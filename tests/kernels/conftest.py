"""Kernel tests run the Triton kernels on CPU through the interpreter (set before triton loads them)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import triton_interpret  # noqa: E402, F401
