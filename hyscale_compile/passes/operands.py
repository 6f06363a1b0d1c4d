"""The model's own tensors under a leaf of the index expression: what the op reads instead of the leaf.

The op takes the model's 16-bit q and k as they are stored (its products are exact in fp32), so a leaf
``q.float()`` is read as ``q``; views and copies (``contiguous``, ``clone``) are walked under too. The op reads
the tensor where the top-k stands, the model read it at the copy: ``legality.check_no_mutation_between``
starts its window at the first node walked under, so a write between the copy and the selection is seen.
"""

from __future__ import annotations

import torch
from torch import fx

from .graph_ops import dtype, named_arg, normalize_dim, op_name, shape
from .index_expr import Leaf


def peel(leaf: Leaf) -> tuple[fx.Node, tuple]:
    """The tensor the op reads for ``leaf`` and its dims' labels."""
    node, labels, _ = peel_path(leaf)
    return node, labels


def peel_path(leaf: Leaf) -> tuple[fx.Node, tuple, list[fx.Node]]:
    """Walk under views, copies and exact 16->32-bit upcasts; also return the nodes walked under.

    Never under a ``detach``: whether the op may pass gradients to the tensor below is decided by the
    gradient cuts, from the leaf as the model reads it."""
    node, labels, path = leaf.node, list(leaf.labels), []
    while True:
        name, src = op_name(node), node.args[0] if node.args else None
        if name in ("float", "to") and dtype(node) == torch.float32 and dtype(src) in (torch.bfloat16, torch.float16) \
                and shape(src) == shape(node):
            pass
        elif name == "identity":
            pass
        elif name == "unsqueeze":
            d = normalize_dim(named_arg(node, "dim"), len(labels))
            if labels[d] is not None:
                break
            del labels[d]
        elif name == "transpose":
            a, b = (normalize_dim(x, len(labels)) for x in (named_arg(node, "dim0"), named_arg(node, "dim1")))
            labels[a], labels[b] = labels[b], labels[a]
        else:
            break
        path.append(node)
        node = src
    return node, tuple(labels), path
