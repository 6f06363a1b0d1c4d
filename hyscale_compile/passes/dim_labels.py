"""Dim labels carried through broadcasting and views: which dims of a tensor are the scores' (b, h, t, s).

Both mask readers (the selection's split of a bool mask, the attention pass's partner masks) label each dim of
a mask operand with the score dim it runs along, or None where it is size 1 (broadcast). These are the two
steps they share: an operand of an elementwise op, and the input of a view that keeps every value.
"""

from __future__ import annotations

from torch import fx

from .expr import Reject
from .graph_ops import arg, is_one, normalize_dim, op_name, same_size, shape

# Views that keep every value of their input (what ``view_input_labels`` reads through; anything else is a
# tensor of its own to the readers). ``to`` / ``float`` keep values only where the readers check the dtypes.
VALUE_VIEWS = ("identity", "to", "float", "expand", "unsqueeze", "squeeze", "reshape", "getitem")


def operand_labels(out_labels: tuple, x) -> tuple | None:
    """Labels of operand ``x`` of an elementwise op whose output has ``out_labels`` (right-aligned broadcasting;
    size-1 dims are None); None where ``x``'s shape is unknown or has more dims than the output."""
    sx = shape(x)
    if sx is None or len(sx) > len(out_labels):
        return None
    off = len(out_labels) - len(sx)
    return tuple(None if is_one(d) else out_labels[off + i] for i, d in enumerate(sx))


def view_input_labels(node: fx.Node, labels: tuple) -> tuple:
    """Labels of the input of view ``node`` given the view's, where the view keeps every value of its input:
    size-1 dims added, dropped or broadcast, the same real dims in the same order (an int index only on a size-1
    dim). Raises Reject otherwise (a slice, an advanced index, a reshape that moves data)."""
    name = op_name(node)
    src = node.args[0]
    si, so = shape(src), shape(node)
    if si is None or so is None:
        raise Reject(f"a mask's shape is unknown ({node.name})")
    if name in ("identity", "to", "float", "expand"):
        inner = operand_labels(labels, src)
        if inner is None:
            raise Reject(f"a mask is broadcast from more dims ({node.name})")
        return inner
    if name == "unsqueeze":
        d = normalize_dim(arg(node, 1, "dim"), len(so))
        return labels[:d] + labels[d + 1:]
    if name == "getitem":
        idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(i is None or i is Ellipsis or i == slice(None) or (isinstance(i, int) and not isinstance(i, bool))
                   for i in idx):
            raise Reject(f"a mask is sliced ({node.name}) on its way to the attention")
    real_in = [i for i, d in enumerate(si) if not is_one(d)]
    real_out = [j for j, d in enumerate(so) if not is_one(d)]
    if len(real_in) != len(real_out) or not all(same_size(si[i], so[j]) for i, j in zip(real_in, real_out)):
        raise Reject(f"a mask is reshaped ({node.name}) beyond adding or removing size-1 dims")
    inner: list = [None] * len(si)
    for i, j in zip(real_in, real_out):
        inner[i] = labels[j]
    return tuple(inner)
