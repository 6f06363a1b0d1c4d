"""Graph dumps before and after a pass: files in ``debug_dir`` and ``trace_structured`` artifacts (tlparse)."""

from __future__ import annotations

import itertools
import os

import torch
from torch import fx
from torch._logging import trace_structured

_counter = itertools.count()


def dump(graph_name: str, before: str, gm: fx.GraphModule, debug_dir: str | None, pass_name: str = "selection") -> None:
    after = gm.print_readable(print_output=False)
    for stage, text in (("before", before), ("after", after)):
        trace_structured(
            "artifact",
            metadata_fn=lambda stage=stage: {"name": f"hyscale_{pass_name}_{stage}_{graph_name}", "encoding": "string"},
            payload_fn=lambda text=text: text,
        )
    if debug_dir:
        os.makedirs(debug_dir, exist_ok=True)
        n = next(_counter)
        for stage, text in (("before", before), ("after", after)):
            path = os.path.join(debug_dir, f"{n:03d}_{pass_name}_{graph_name.replace('.', '_')}_{stage}.py")
            with open(path, "w") as f:
                f.write(text)


def compact(gm: fx.GraphModule) -> str:
    """A stable one-line-per-op projection of a graph for golden tests: ops in order, inputs by producer op.

    Node names, object addresses and sizes change across torch versions; the op sequence and the
    non-tensor arguments of our ops do not.
    """
    lines = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            args = [_short(a) for a in n.args] + [f"{k}={_short(v)}" for k, v in n.kwargs.items()]
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
