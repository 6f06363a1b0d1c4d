"""Read in-place updates of score intermediates as out-of-place ops (Megatron writes ``relu_``, ``mul_``,
``masked_fill_``, ``+=`` on its score chunks).

In a Dynamo graph ``s.mul_(w)`` is a node, and later reads of ``s`` still name the old node: the chain
from the dot to the top-k is hidden behind the mutation. When ``s`` is a fresh tensor of this graph
(not an input, not a view, and no view of it exists), turning the update into ``mul`` and pointing
every later read of ``s`` at it is exact. Every change is recorded so a rejected site can be put back
byte for byte.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from .graph_ops import op_name

_FUNCTIONS = {operator.iadd: operator.add, operator.imul: operator.mul, operator.itruediv: operator.truediv,
              operator.isub: operator.sub, torch.relu_: torch.relu}
_METHODS = {"relu_", "mul_", "div_", "add_", "sub_", "masked_fill_", "triu_", "tril_", "clamp_", "clamp_min_"}
_VIEWS = {"transpose", "permute", "unsqueeze", "squeeze", "reshape", "getitem", "expand", "detach"}
# Users that provably make a new tensor (never an alias): reading before the update is then harmless.
# (.float()/.to()/.contiguous()/.detach() may return their input itself, so they are not here.)
_NEW_TENSORS = {"full", "ones", "zeros", "arange", "full_like", "ones_like", "zeros_like", "new_full", "new_ones",
                "new_zeros"}
_FRESH_RESULT = {"relu", "clamp", "mul", "div", "add", "sub", "neg", "sum", "einsum", "matmul", "masked_fill",
                 "where", "topk", "sort", "gather", "and", "or", "le", "lt", "ge", "gt", "invert"}


@dataclass
class Undo:
    targets: list[tuple[fx.Node, object]] = field(default_factory=list)
    args: list[tuple[fx.Node, tuple, dict]] = field(default_factory=list)

    def __call__(self) -> None:
        for node, args, kwargs in reversed(self.args):
            node.args, node.kwargs = args, kwargs
        for node, target in reversed(self.targets):
            node.target = target


def _is_update(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target is F.relu:
        return bool(n.kwargs.get("inplace")) or (len(n.args) > 1 and bool(n.args[1]))
    return (n.op == "call_function" and n.target in _FUNCTIONS) or (n.op == "call_method" and n.target in _METHODS)


def _out_of_place(n: fx.Node) -> None:
    if n.target is F.relu:
        n.args, n.kwargs = n.args[:1], {k: v for k, v in n.kwargs.items() if k != "inplace"}
    elif n.op == "call_function":
        n.target = _FUNCTIONS[n.target]
    else:
        n.target = n.target[:-1]


def _fresh(x, update: fx.Node, order: dict) -> bool:
    """A tensor this graph computed, with no alias that is read again (so no one else sees the update).

    ``x`` may be a view (e.g. a transpose) when every tensor under it is read only by the next view.
    """
    if not isinstance(x, fx.Node) or any(
            u is not update and op_name(u) not in _FRESH_RESULT and order[u] < order[update] for u in x.users):
        return False
    if any(u.op == "output" or op_name(u) in _VIEWS or op_name(u) == "identity" for u in x.users):
        return False
    while op_name(x) in _VIEWS or op_name(x) in ("identity", "float", "to"):
        x = x.args[0]
        if not isinstance(x, fx.Node) or len(x.users) != 1:
            return False
    return op_name(x) in _FRESH_RESULT or op_name(x) in _NEW_TENSORS


def functionalize_ancestors(graph: fx.Graph, root: fx.Node) -> Undo:
    """Rewrite the in-place updates that feed ``root`` as out-of-place ops; return how to undo it."""
    undo = Undo()
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = True
    while changed:  # each rewrite can expose the next update further up the chain
        changed = False
        ancestors = _ancestors(root)
        for n in sorted((u for a in ancestors for u in a.users if _is_update(u)), key=order.get):
            x = n.args[0]
            later = [u for u in x.users if u is not n and order[u] > order[n]]
            if not _fresh(x, n, order) or any(_is_update(u) for u in x.users if u is not n and order[u] < order[n]):
                continue
            undo.targets.append((n, n.target))
            undo.args.append((n, n.args, n.kwargs))
            _out_of_place(n)
            for u in later:
                undo.args.append((u, u.args, u.kwargs))
                u.args = _replace(u.args, x, n)
                u.kwargs = _replace(u.kwargs, x, n)
            changed = True
            break
    return undo


def _replace(a, old: fx.Node, new: fx.Node):
    return fx.node.map_arg(a, lambda x: new if x is old else x)


def _ancestors(root: fx.Node) -> set[fx.Node]:
    seen, todo = {root}, [root]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen
