"""``hyscale::saved_copy``: a copy of a tensor an op keeps for its backward, which the partitioner cannot undo.

Where the graph writes a tensor in place after an op that keeps it for the backward (the model's
``idx.add_(1)``, ``pad.logical_not_()``, or a weight scaled under ``no_grad`` between forward and backward), the
passes give the op a copy (``graph_ops.own_copies``). A ``clone`` is not enough under AOTAutograd's min-cut
partitioner: a clone is cheap to recompute, so the partitioner keeps its input for the backward and clones it
again there, after the write (plain PyTorch compiled with Inductor does the same with ``x @ w.clone()``). A custom
op is not recomputed: its output is what the backward keeps. The gradient passes through unchanged, as a clone's.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("hyscale::saved_copy", mutates_args=())
def saved_copy(x: Tensor) -> Tensor:
    return x.clone()


@saved_copy.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad


saved_copy.register_autograd(_backward)
