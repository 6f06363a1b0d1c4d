"""Graph dumps before and after a pass: files in ``debug_dir`` and ``trace_structured`` artifacts (tlparse).

Files, numbered in the order they are written:

    NNN_selection_<graph>_before.py / _after.py   each Dynamo graph (and checkpoint body), selection pass
    NNN_replay_joint_before.py / _after.py        the joint forward+backward graph, replay pass
    NNN_partition_forward.py / _backward.py       the forward and backward graphs the partitioner made of it
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._logging import trace_structured

_counter = itertools.count()


def tracing() -> bool:
    """Whether a structured trace (TORCH_TRACE, tlparse) is being written."""
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def graph_text(graph: fx.Graph) -> str:
    """Readable code of a graph (what ``print_readable`` shows), generated from the graph as it is now."""
    return graph.python_code(root_module="self", verbose=True).src


def dump_stages(pass_name: str, graph_name: str, stages: dict[str, Callable[[], str]], debug_dir: str | None,
                trace: bool = True) -> None:
    """Write each stage's text (computed only when something reads it) to the trace and to ``debug_dir``."""
    if trace:
        for stage, text in stages.items():
            trace_structured(
                "artifact",
                metadata_fn=lambda stage=stage: {"name": _name("hyscale", pass_name, stage, graph_name),
                                                 "encoding": "string"},
                payload_fn=text,
            )
    if debug_dir:
        os.makedirs(debug_dir, exist_ok=True)
        n = next(_counter)
        for stage, text in stages.items():
            path = os.path.join(debug_dir, _name(f"{n:03d}", pass_name, graph_name.replace(".", "_"), stage) + ".py")
            with open(path, "w") as f:
                f.write(text())


def _name(*parts: str) -> str:
    return "_".join(p for p in parts if p)


def dump(graph_name: str, before: str, gm: fx.GraphModule, debug_dir: str | None, pass_name: str = "selection") -> None:
    after = gm.print_readable(print_output=False)
    dump_stages(pass_name, graph_name, {"before": lambda: before, "after": lambda: after}, debug_dir)


def dump_partitioned(graph: fx.Graph, debug_dir: str) -> None:
    """One graph the partitioner made of the joint graph (files only: the trace has aot_*_graph already)."""
    backward = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)
    dump_stages("partition", "backward" if backward else "forward", {"": lambda: graph_text(graph)}, debug_dir,
                trace=False)


class PartitionDump(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor post-grad pre-pass that writes the partitioned forward and backward graphs (debug_dir only)."""

    def __init__(self, debug_dir: str):
        self.debug_dir = debug_dir

    def __call__(self, graph: fx.Graph) -> None:
        dump_partitioned(graph, self.debug_dir)

    def uuid(self) -> Any:
        return None  # debug_dir compiles without caches anyway


def inductor_config_patches(current: dict[str, Any], debug_dir: str) -> dict[str, Any]:
    from .replay import install_pass

    return install_pass(current, "post_grad_custom_pre_pass", PartitionDump(debug_dir))


def compact(gm: fx.GraphModule) -> str:
    """A stable one-line-per-op projection of a graph for golden tests: ops in order, inputs by producer op.

    Node names, object addresses and sizes change across torch versions; the op sequence and the
    non-tensor arguments of our ops do not. Keyword arguments are shown for operator overloads (ours among
    them), as ``name=value``.
    """
    lines = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            args = [_short(a) for a in n.args]
            if isinstance(n.target, torch._ops.OpOverload):
                args += [f"{k}={_short(v)}" for k, v in n.kwargs.items()]
            lines.append(f"{_target(n)}({', '.join(args)})")
    return "\n".join(lines)


def _target(n: fx.Node) -> str:
    if n.op == "call_method":
        return "." + n.target
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t.overloadpacket._qualified_op_name).replace("::", ".")
    return getattr(t, "__name__", str(t))


def _short(a) -> str:
    if isinstance(a, fx.Node):
        return "in" if a.op == "placeholder" else _target(a)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in a) + "]"
    if isinstance(a, float):
        return f"{a:.6g}"
    return str(a)
