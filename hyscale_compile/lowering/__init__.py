"""Operators emitted by the passes (custom ops, fake rules, autograd) and the functional API."""

from . import attention_mla, attention_rows, ops, saved_copy  # noqa: F401  (registers torch.ops.hyscale.*)
