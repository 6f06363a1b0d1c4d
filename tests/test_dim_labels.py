"""The dim labels both mask readers carry through broadcasting and views (passes/dim_labels.py): a view is read
through only where it keeps every value of its input, whatever op spells it."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from hyscale_compile.passes.dim_labels import operand_labels, view_input_labels
from hyscale_compile.passes.expr import Reject

B, T, S = 2, 5, 7


def _view(src_shape, out_shape, target, *args):
    """A graph node ``target(src, *args)`` whose input and output carry example tensors of the given shapes."""
    g = fx.Graph()
    src = g.placeholder("mask")
    src.meta["example_value"] = torch.empty(src_shape, dtype=torch.bool)
    node = g.call_function(target, (src, *args)) if callable(target) else g.call_method(target, (src, *args))
    node.meta["example_value"] = torch.empty(out_shape, dtype=torch.bool)
    return node


def test_operand_labels_broadcast_right_aligned():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(B, 1, S)
    assert operand_labels(("b", "h", "t", "s"), x) == ("h", None, "s")  # right-aligned: [B,1,S] under 4 dims
    assert operand_labels(("t", "s"), x) is None  # more dims than the output
    assert operand_labels(("b", "t", "s"), g.placeholder("no_meta")) is None


@pytest.mark.parametrize("src, out, target, args, labels, want", [
    ((B, S), (B, 1, S), "unsqueeze", (1,), ("b", None, "s"), ("b", "s")),
    ((B, S), (B, 1, 1, S), operator.getitem, ((slice(None), None, None, slice(None)),), ("b", None, None, "s"),
     ("b", "s")),
    ((B, 1, S), (B, S), operator.getitem, ((slice(None), 0),), ("b", "s"), ("b", None, "s")),  # int on a size-1 dim
    ((B, 1, S), (B, S), "squeeze", (1,), ("b", "s"), ("b", None, "s")),
    ((B, S), (B, 1, S), "reshape", (B, 1, S), ("b", None, "s"), ("b", "s")),
    ((1, S), (B, T, S), "expand", (B, T, S), ("b", "t", "s"), (None, "s")),  # right-aligned, size 1 broadcast
], ids=["unsqueeze", "none-index", "int-on-size-1", "squeeze", "reshape-adds-1", "expand"])
def test_views_that_keep_every_value(src, out, target, args, labels, want):
    assert view_input_labels(_view(src, out, target, *args), labels) == want


@pytest.mark.parametrize("src, out, target, args", [
    ((B, T, S), (B, S), operator.getitem, ((slice(None), 0),)),  # an int index on a real dim drops values
    ((B, T, S), (B, T - 1, S), operator.getitem, ((slice(None), slice(1, None)),)),  # a slice
    ((T, S), (S, T), "reshape", (S, T)),  # same element count, the data moved
    ((B, T * S), (B, T, S), "reshape", (B, T, S)),  # a real dim split in two
], ids=["int-on-real-dim", "slice", "reshape-moves", "reshape-splits"])
def test_views_that_drop_or_move_values_are_rejected(src, out, target, args):
    labels = ("b", "t", "s")[-len(out):]
    with pytest.raises(Reject):
        view_input_labels(_view(src, out, target, *args), labels)
