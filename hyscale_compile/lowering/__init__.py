"""Operators emitted by the passes (custom ops, fake rules, autograd) and the functional API."""

from . import ops  # noqa: F401  (registers torch.ops.hyscale.*)
