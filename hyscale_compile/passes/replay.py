"""Selection replay: a joint-graph pass so that recomputation never reruns the selection.

Under activation recomputation (torch.utils.checkpoint, selective checkpointing policies) the
min-cut partitioner recomputes tagged forward nodes in the backward, ``hyscale.select`` included:
a second full scoring and top-k over all keys. This pass, run on the joint forward+backward graph
before partitioning, changes that for every ``hyscale.select``:

* the select node and its outputs are tagged ``MUST_SAVE``: the partitioner keeps the indices
  (and never reruns the op); ``ac_graph_id`` is left as it was;
* every value the backward needs of ``values`` is recomputed from ``hyscale.rescore`` on the saved
  indices: backward users of ``values`` read a new rescore node instead, and recompute-tagged
  forward nodes between ``values`` and the backward are cloned onto the rescore. Rescore and the
  clones are tagged for recomputation, so they run in the backward, k scores per query.

Without any recomputation in the graph only the tags change (values are [B, T, k], cheap to keep),
so graphs without checkpointing are never turned into checkpointed ones.

Counter ``replay_applied``: the selection sites whose recomputation this pass rewrote, i.e. a select
inside a checkpointed region whose outputs the backward needs (the partitioner would have run it again
there). Saving the indices of a select that is not recomputed anyway is not counted.

Registered as Inductor's ``joint_custom_pre_pass`` by ``inductor_config_patches``; an existing pass
there is chained, not replaced (torch 2.11/2.12 take one pass, not a list). A hit in AOTAutograd's
cache skips the joint graph and this pass with it; the backend therefore compiles checkpointed graphs
with a selection without that cache (``counts_in_joint_graph``), so the counter is the same warm or cold.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config  # noqa: F401  (read in inductor_config_patches)
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from . import debug
from .report import log, shown

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
# The cache key's sources: this pass, and every op registration (their fake rules and autograd formulas are traced
# into the joint graph, which AOTAutograd's cache keeps: an older formula's backward must not be served after an
# upgrade; the graph handed to Inductor changes with the passes, the runtime is called, not traced).
_SOURCES = (Path(__file__), *sorted((Path(__file__).parent.parent / "lowering").glob("*.py")))


def _must_recompute(node: fx.Node) -> bool:
    return node.meta.get("recompute") in _RECOMPUTE


def _replayable(node: fx.Node) -> bool:
    """A recompute-tagged node we may copy: random ops stay with the partitioner (it threads their seeds).

    Two guards on purpose: the tag names random ops on every torch we support, and ``is_impure`` refuses
    them too where it treats random ops as impure (torch >= 2.6) besides ops with side effects.
    tests/test_replay.py checks that a dropout after the selection keeps its forward draw."""
    tags = getattr(node.target, "tags", ())
    return (node.op == "call_function" and _must_recompute(node) and torch.Tag.nondeterministic_seeded not in tags
            and not node.is_impure())


def _feeds_later_region(node: fx.Node) -> bool:
    region = node.meta.get("ac_graph_id")
    return region is not None and any(
        _must_recompute(u) and u.meta.get("ac_graph_id", region) > region for u in node.users)


def _is_select(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.hyscale.select.default


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a tangent (the partitioner's definition of backward), plus tagged ones."""
    bw: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if "tangents" in str(node.target):
                bw.add(node)
        elif node.op != "output" and (node.meta.get("partitioner_tag") == "is_backward"
                                      or any(a in bw for a in node.all_input_nodes)):
            bw.add(node)
    return bw


def _outputs(select: fx.Node, which: int) -> list[fx.Node]:
    return [u for u in select.users if u.target is operator.getitem and u.args[1] == which]


def _bound_args(node: fx.Node) -> dict[str, Any]:
    """Every argument of an op call by name, defaults filled in (a traced call omits them)."""
    schema = node.target._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    named.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    named.update(node.kwargs)
    return named


def _fake_value(target, kwargs: dict[str, Any]) -> Any:
    """meta["val"] of a new node, from the op's fake rule under the graph's fake mode."""
    from torch._guards import detect_fake_mode

    fake = {k: a.meta["val"] if isinstance(a, fx.Node) else a for k, a in kwargs.items()}
    mode = detect_fake_mode(list(fake.values()))
    if mode is None:
        return None
    with mode:
        return target(**fake)


class _Replayer:
    """Rewires the backward's reads of one select's values onto a rescore of its saved indices."""

    def __init__(self, graph: fx.Graph, select: fx.Node, bw: set[fx.Node]):
        self.graph, self.select, self.bw = graph, select, bw
        self.values = set(_outputs(select, 0))
        self.memo: dict[fx.Node, fx.Node] = {}
        self.rescores = 0

    def chain(self) -> set[fx.Node]:
        """values and the recompute-tagged forward nodes of the same checkpoint region that read them.

        The walk stops at the region's boundary: a node read by a later region is saved by the
        partitioner (cleanup_recompute_tags), so the backward reads it and needs no copy of it.
        """
        region = self.select.meta.get("ac_graph_id")
        reach = set(self.values)
        for node in self.graph.nodes:
            if (node not in self.bw and _replayable(node) and node.meta.get("ac_graph_id") == region
                    and not _feeds_later_region(node) and any(a in reach for a in node.all_input_nodes)):
                reach.add(node)
        return reach

    def indices(self) -> fx.Node:
        found = _outputs(self.select, 1)
        if found:
            return found[0]
        with self.graph.inserting_after(self.select):
            idx = self.graph.call_function(operator.getitem, (self.select, 1))
        idx.meta.update(val=self.select.meta["val"][1], recompute=CheckpointPolicy.MUST_SAVE)
        if "ac_graph_id" in self.select.meta:
            idx.meta["ac_graph_id"] = self.select.meta["ac_graph_id"]
        return idx

    def rescore(self) -> fx.Node:
        a = _bound_args(self.select)
        target = torch.ops.hyscale.rescore.default
        # by name, so that dumps read rescore(q=..., indices=..., scale=...)
        kwargs = {arg.name: self.indices() if arg.name == "indices" else a[arg.name]
                  for arg in target._schema.arguments}
        node = self.graph.call_function(target, (), kwargs)
        node.meta["val"] = _fake_value(target, kwargs)
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        for key in ("ac_graph_id", "stack_trace", "nn_module_stack"):
            if key in self.select.meta:
                node.meta[key] = self.select.meta[key]
        self.rescores += 1
        return node

    def replay(self, node: fx.Node, chain: set[fx.Node]) -> fx.Node:
        """The backward's copy of ``node``, built before the current insertion point."""
        if node in self.memo:
            return self.memo[node]
        if node in self.values:
            new = self.rescore()
        else:
            remap = lambda x: self.replay(x, chain) if isinstance(x, fx.Node) and x in chain else x
            args = torch.fx.node.map_aggregate(node.args, remap)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, remap)
            new = self.graph.call_function(node.target, args, kwargs)
            new.meta.update(node.meta)
        self.memo[node] = new
        self.bw.add(new)  # copies run in the backward: a later select's replay must see them as readers
        return new

    def run(self) -> int:
        chain = self.chain()
        for user in [n for n in self.graph.nodes if n in self.bw]:
            for arg in [a for a in user.all_input_nodes if a in chain]:
                with self.graph.inserting_before(user):
                    user.replace_input_with(arg, self.replay(arg, chain))
        return self.rescores


def _save_selection(select: fx.Node) -> None:
    for node in [select, *_outputs(select, 0), *_outputs(select, 1)]:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _needed_by_backward(select: fx.Node, bw: set[fx.Node]) -> bool:
    """Whether the backward reads an output of ``select``, directly or through recomputed forward nodes."""
    seen, todo = {select}, [select]
    while todo:
        for user in todo.pop().users:
            if user in bw:
                return True
            if user not in seen and _must_recompute(user):
                seen.add(user)
                todo.append(user)
    return False


def _where(node: fx.Node) -> str:
    from .graph_ops import source_line

    line = source_line(node)
    return f"node {node.name}" if line == "<unknown>" else shown(line)


def apply(graph: fx.Graph) -> int:
    """Run selection replay on a joint graph; returns the number of selection sites whose recomputation it
    rewrote (the ``replay_applied`` counter)."""
    selects = [n for n in graph.nodes if _is_select(n)]
    if not selects:
        return 0
    from torch._dynamo.utils import counters

    bw = _backward_nodes(graph)
    recomputing = any(_must_recompute(n) for n in graph.nodes)
    applied = 0
    for select in selects:
        if select in bw:  # a select inside the backward (double backward): not ours to move
            continue
        replayed = _must_recompute(select) and _needed_by_backward(select, bw)
        _save_selection(select)
        rescores = _Replayer(graph, select, bw).run() if recomputing else 0
        if replayed:
            applied += 1
            counters["hyscale"]["replay_applied"] += 1
            how = "rescores the saved indices" if rescores else "reads the saved indices"
            log.info("hyscale: replay: the backward %s of the selection at %s instead of selecting again",
                     how, _where(select))
        else:
            log.debug("hyscale: replay: the selection at %s is not recomputed in the backward; its outputs are "
                      "saved", _where(select))
    graph.lint()
    return applied


def run(graph: fx.Graph, debug_dir: str | None = None) -> int:
    """``apply``, with the joint graph before and after written to the trace and to ``debug_dir``."""
    if not any(_is_select(n) for n in graph.nodes):
        return 0
    wanted = bool(debug_dir) or debug.tracing()
    before = debug.graph_text(graph) if wanted else ""
    applied = apply(graph)
    if wanted:
        after = debug.graph_text(graph)
        debug.dump_stages("replay", "joint", {"before": lambda: before, "after": lambda: after}, debug_dir)
    return applied


def counts_in_joint_graph(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` (a Dynamo graph) has a selection and a checkpointed region: its replay counters come
    from the joint graph, which a hit in AOTAutograd's cache never builds."""
    targets = {n.target for _, m in gm.named_modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    selects = {torch.ops.hyscale.select, torch.ops.hyscale.select.default}  # by hand, or from the selection pass
    return bool(selects & targets) and _checkpoint_op() in targets


def _checkpoint_op() -> Any:
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    return tag_activation_checkpoint


class ReplayPass(CustomGraphPass):
    """Inductor joint-graph pass object; ``uuid`` changes whenever our sources do (FX graph cache key).

    ``debug_dir`` is not part of the key: a compile with a debug_dir does not use Inductor's caches.
    """

    def __init__(self, debug_dir: str | None = None):
        self.debug_dir = debug_dir

    def __call__(self, graph: fx.Graph) -> None:
        run(graph, self.debug_dir)

    def uuid(self) -> Any:
        return get_hash_for_files(tuple(str(p) for p in _SOURCES))


class ChainedPass(CustomGraphPass):
    """Several joint passes as one (torch 2.11/2.12 accept a single pass)."""

    def __init__(self, passes: list[Any]):
        self.passes = passes

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = []
        for p in self.passes:
            u = p.uuid() if hasattr(p, "uuid") else None
            if u is None:
                return None  # an uncacheable member makes the whole chain uncacheable
            ids.append(u)
        return tuple(ids)


def _flatten(p: Any) -> list[Any]:
    if p is None:
        return []
    if isinstance(p, (list, tuple)):
        return [x for item in p for x in _flatten(item)]
    if isinstance(p, ChainedPass):
        return [x for item in p.passes for x in _flatten(item)]
    return [p]


def install_pass(current: dict[str, Any], key: str, new: Any,
                 same: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Inductor config patches that put ``new`` at ``key``, chained after any pass already there (from
    ``current`` patches or the config); an earlier pass for which ``same`` holds is replaced."""
    existing = current[key] if key in current else getattr(torch._inductor.config, key, None)
    same = same or (lambda p: type(p) is type(new))
    passes = [p for p in _flatten(existing) if not same(p)]
    if not passes:
        return {key: new}
    return {key: ChainedPass([*passes, new])}


def inductor_config_patches(current: dict[str, Any], debug_dir: str | None = None) -> dict[str, Any]:
    """Inductor config patches that install the replay pass, chained after any pass already set."""
    return install_pass(current, "joint_custom_pre_pass", ReplayPass(debug_dir),
                        same=lambda p: isinstance(p, ReplayPass))
