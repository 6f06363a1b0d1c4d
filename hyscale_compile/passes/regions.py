"""Values across checkpointed regions: what a checkpoint body's input is in the graph that calls it, and what a
caller's item of the region's result is in the body.

Dynamo traces ``torch.utils.checkpoint`` into a call of ``tag_activation_checkpoint(body, *operands)``, the body
a graph of its own whose placeholders are the operands in order and whose output tuple is the call's result.
HF models checkpoint each decoder layer, so a GLM-style shared layer's attention (in one body) reads indices that
a top-k in the previous layer's body selected: the attention pass follows them through these links. Only this
higher-order op is followed: it runs its body once on its operands as they are (and again, on the same saved
operands, for the backward's recomputation), where others (``map``, ``scan``, ``cond``) slice their operands or
may not run a body at all.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx

from .graph_ops import attr_of


def _checkpoint_op():
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    return tag_activation_checkpoint


@dataclass
class Links:
    """For each checkpoint body called exactly once: its call node (in the caller's graph)."""

    calls: dict[fx.Graph, fx.Node] = field(default_factory=dict)
    bodies: dict[fx.Node, fx.GraphModule] = field(default_factory=dict)

    def across(self, node: fx.Node) -> fx.Node | None:
        """The node that ``node`` stands for in the neighbouring graph (a body's placeholder: the caller's
        operand; a caller's ``getitem`` of the region's result: the body's output value), or None."""
        if node.op == "placeholder":
            call = self.calls.get(node.graph)
            if call is None:
                return None
            inputs = [n for n in node.graph.nodes if n.op == "placeholder"]
            operands = call.args[1:]
            if len(inputs) != len(operands):
                return None
            got = operands[inputs.index(node)]
            return got if isinstance(got, fx.Node) else None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            body = self.bodies.get(node.args[0])
            if body is None or not isinstance(node.args[1], int):
                return None
            out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
            values = out.args[0]
            if not isinstance(values, (tuple, list)) or not 0 <= node.args[1] < len(values):
                return None
            got = values[node.args[1]]
            return got if isinstance(got, fx.Node) else None
        return None


def links(gm: fx.GraphModule) -> Links:
    """The checkpoint calls of ``gm`` and its subgraphs, each with its body (a body called more than once, or
    given by anything but a get_attr of a graph module, is not linked: its inputs stand for several values)."""
    op = _checkpoint_op()
    found = Links()
    uses: dict[fx.Graph, list[fx.Node]] = {}
    for _, mod in gm.named_modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for n in mod.graph.nodes:
            if n.op != "call_function" or n.target is not op or not n.args or not isinstance(n.args[0], fx.Node):
                continue
            getter = n.args[0]
            body = attr_of(getter) if getter.op == "get_attr" else None
            if isinstance(body, fx.GraphModule):
                uses.setdefault(body.graph, []).append(n)
                found.bodies[n] = body
    for graph, calls in uses.items():
        if len(calls) == 1:
            found.calls[graph] = calls[0]
        else:
            for call in calls:
                found.bodies.pop(call, None)
    return found


def region_input(node: fx.Node) -> bool:
    """Whether ``node`` is an input of a higher-order op's body (a checkpointed region's), not one of the
    compiled function's own (Dynamo records those with their source)."""
    return node.op == "placeholder" and "grapharg" not in node.meta
