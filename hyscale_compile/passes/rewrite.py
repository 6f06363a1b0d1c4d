"""Step 3 of the selection pass: replace a proven site by ``torch.ops.hyscale.select``.

The op takes [B, T, H, D] queries, [B, S, D] keys and [B, T, H] weights; the model's tensors are laid out
that way by views (``Batching.place``), the model's own 16-bit tensors are passed under their upcasts, and
the op's [B, T, k] outputs are put back in the layout the model's top-k produced. Inputs whose gradient
eager never carries through the selection are detached (``legality.gradient_cuts``). Every node inserted
carries the top-k's stack trace, so dumps and Inductor's provenance point at the user's line.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from . import masks
from .graph_ops import dtype, is_tensor, op_name, own_copies, shape, value, writes_before_backward
from .index_expr import Leaf, Reject, Score, positive_scale
from .legality import check_operands, requires_grad
from .operands import peel
from .sites import Site


def canonical(graph: fx.Graph, node: fx.Node, labels: tuple, order: tuple) -> fx.Node:
    """A view of ``node`` with dims in ``order`` (labels); size-1 dims are inserted for missing labels."""
    for d in reversed([i for i, lab in enumerate(labels) if lab is None]):
        node = graph.call_method("squeeze", (node, d))
    present = [lab for lab in labels if lab is not None]
    wanted = [lab for lab in order if lab in present]
    if any(lab not in order for lab in present):
        raise Reject("an input has a dimension outside the indexer form")
    perm = [present.index(lab) for lab in wanted]
    if perm != list(range(len(perm))):
        node = graph.call_method("permute", (node, *perm))
    for i, lab in enumerate(order):
        if lab not in present:
            node = graph.call_method("unsqueeze", (node, i))
    return node


@dataclass
class Batching:
    """How the score's batch dims become the op's one batch dim.

    One (or no) batch dim: it is the op's batch. Several (e.g. [B, G, T, S] per-group selection): every
    input is laid out with all of them, expanded to full size and flattened into one; the outputs are
    unflattened. An input that has none of them broadcasts as a size-1 batch (no copy).
    """

    labels: tuple
    sizes: tuple  # per label: an int or a node computing the (symbolic) size

    def place(self, graph: fx.Graph, node: fx.Node, labels: tuple, rest: tuple, full: bool = False) -> fx.Node:
        if len(self.labels) <= 1:
            return canonical(graph, node, labels, (self.labels[0] if self.labels else None, *rest))
        if not full and not set(self.labels) & set(labels):
            return canonical(graph, node, labels, (None, *rest))
        x = canonical(graph, node, labels, (*self.labels, *rest))
        x = graph.call_method("expand", (x, *self.sizes, *([-1] * len(rest))))
        return graph.call_method("flatten", (x, 0, len(self.labels) - 1))

    def restore(self, graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, tuple]:
        """From the op's [B', T, k] to [*batch, T, k]; returns the node and its leading labels."""
        if len(self.labels) <= 1:
            if not self.labels:
                return graph.call_method("squeeze", (node, 0)), ()
            return node, self.labels
        return graph.call_method("unflatten", (node, 0, tuple(self.sizes))), self.labels


def label_size(graph: fx.Graph, sc: Score, label) -> object:
    """The size of a label's dim as an int, or a node computing it (1 for labels no tensor has)."""
    for leaf in (sc.q, sc.k):
        if label is not None and label in leaf.labels:
            i = leaf.labels.index(label)
            size = shape(leaf.node)[i]
            return size if isinstance(size, int) else graph.call_method("size", (leaf.node, i))
    return 1


def _batching(graph: fx.Graph, sc: Score) -> Batching:
    return Batching(sc.batch_all, tuple(label_size(graph, sc, lab) for lab in sc.batch_all))


class _Operands:
    """Places the model's tensors for the op, detaching those eager sends no gradient to."""

    def __init__(self, graph: fx.Graph, batching: Batching, cuts: set[int]):
        self.graph, self.batching, self.cuts = graph, batching, cuts

    def place(self, leaf: Leaf, rest: tuple, full: bool = False) -> fx.Node:
        node, labels = peel(leaf)
        if id(leaf) in self.cuts and requires_grad(node):
            node = self.graph.call_method("detach", (node,))
        return self.batching.place(self.graph, node, labels, rest, full=full)

    def factors(self, leaves: tuple[Leaf, ...], rest: tuple) -> tuple[fx.Node | None, list]:
        """The product of tensor factors laid out [batch, *rest], and the symbolic numbers, kept apart."""
        tensor_leaves = [f for f in leaves if f.labels or is_tensor(f.node)]
        tensors = [self.place(f, rest) for f in tensor_leaves]
        numbers = [f.node for f in leaves if not (f.labels or is_tensor(f.node))]
        if len(tensors) > 1:  # eager multiplies each into the score on its own: never round their product to 16 bits
            half = (torch.bfloat16, torch.float16)
            tensors = [self.graph.call_method("float", (t,)) if dtype(peel(f)[0]) in half else t
                       for f, t in zip(tensor_leaves, tensors, strict=True)]
        product = None
        for t in tensors:
            product = t if product is None else self.graph.call_function(torch.mul, (product, t))
        return product, numbers


def rewrite(gm: fx.GraphModule, site: Site, sc: Score, plan: masks.MaskPlan, cuts: set[int],
            metadata_readers: list[fx.Node]) -> None:
    """Rewrite; if a check inside the rewrite fails, remove what it inserted so the graph is unchanged."""
    scale = positive_scale(sc, site.topk)
    if {lab for lab in sc.dims if lab is not None} | {sc.query} != {*sc.batch_all, sc.query, sc.key}:
        raise Reject("the selected tensor is not laid out as [batch..., query, key]", site.topk)
    check_operands(sc, site.topk)
    existing = set(gm.graph.nodes)
    written, by_caller = writes_before_backward(site.topk, requires_grad(site.score_node))
    try:
        values, indices = _emit(gm.graph, site, sc, plan, scale, cuts)
        own_copies(gm.graph, site.select, _SAVED, written)
        own_copies(gm.graph, site.select, _SAVED_SMALL, by_caller)
    except Exception:
        for n in reversed([n for n in gm.graph.nodes if n not in existing]):
            gm.graph.erase_node(n)
        raise
    _inherit_meta([n for n in gm.graph.nodes if n not in existing], site.topk)
    _replace_metadata_readers(gm.graph, sc, metadata_readers)
    _replace_outputs(gm.graph, site, sc, values, indices)


# The select arguments its autograd formula keeps for the backward (lowering/ops.py ``_setup``): copied where the
# graph writes them after the selection; the [B, T] row bounds also where they are the graph's inputs or outputs,
# which the caller may write before the backward (the model's comparisons with them kept none of them).
_SAVED = ("q", "kx", "weights", "offsets", "starts", "ends", "mask")
_SAVED_SMALL = ("offsets", "starts", "ends")


def _emit(graph: fx.Graph, site: Site, sc: Score, plan: masks.MaskPlan, scale: float, cuts: set[int]):
    T, H, S, D = sc.query, sc.head, sc.key, sc.contracted
    with graph.inserting_before(site.topk):
        batching = _batching(graph, sc)
        ops = _Operands(graph, batching, cuts)
        q_dtype, k_dtype = dtype(peel(sc.q)[0]), dtype(peel(sc.k)[0])
        q = ops.place(sc.q, (T, H, D), full=True)
        k = ops.place(sc.k, (S, D), full=True)
        pre, pre_numbers = ops.factors(sc.pre, (T, H))
        if pre_numbers:  # symbolic numbers (a sign unknown at compile time): fold into q in fp32
            q = graph.call_method("float", (q,))
        for c in pre_numbers:
            q = graph.call_function(operator.mul, (q, c))
        q, pre_weight = _split_factor(graph, q, pre, sc.relu, torch.float32 if pre_numbers else q_dtype)
        kpre, _ = ops.factors(sc.key_pre, (S,))
        if kpre is not None:
            k = graph.call_function(torch.mul, (graph.call_method("float", (k,)),
                                                graph.call_method("unsqueeze", (kpre, -1))))
        q_dtype = torch.float32 if pre_numbers else q_dtype
        k_dtype = torch.float32 if sc.key_pre else k_dtype
        if q_dtype != k_dtype:  # one side is genuinely fp32 (or mixed 16-bit types): score both in fp32
            q = graph.call_method("float", (q,)) if q_dtype != torch.float32 else q
            k = graph.call_method("float", (k,)) if k_dtype != torch.float32 else k
        w, w_numbers = ops.factors(sc.weights, (T, H))
        if w is not None and any(dtype(f.node) != torch.float32 for f in sc.weights):
            w = graph.call_method("float", (w,))
        if pre_weight is not None:
            w = pre_weight if w is None else graph.call_function(torch.mul, (pre_weight, w))
        for c in w_numbers:
            w = graph.call_function(operator.mul, (w, c))
        if sc.post_scale < 0:
            w = graph.call_function(torch.neg, (w,))
        bool_mask, bias = plan.emit(graph, ops.place, T, S)
        k_sel = site.k
        if site.k_at_most_keys:  # sort(...)[..., :k] of S keys holds min(k, S) of them
            keys = label_size(graph, sc, S)
            k_sel = min(site.k, keys) if isinstance(keys, int) else graph.call_function(torch.sym_min, (site.k, keys))
        out = graph.call_function(torch.ops.hyscale.select.default, (), dict(
            q=q, kx=k, weights=w, k=k_sel, scale=scale, relu=sc.relu, causal=plan.causal, offset=plan.offset,
            offsets=None, starts=plan.starts, ends=plan.ends, mask=bool_mask, bias=bias, fill=plan.fill,
            sorted=site.sorted, causal_additive=plan.causal_additive,
            low_precision_grad=dtype(sc.q.at) in (torch.bfloat16, torch.float16)))
        site.select = out
        values = graph.call_function(operator.getitem, (out, 0))
        indices = graph.call_function(operator.getitem, (out, 1))
        values, indices = (_to_layout(graph, x, sc, batching, T, S) for x in (values, indices))
        if dtype(site.score_node) != torch.float32:
            values = graph.call_method("to", (values, dtype(site.score_node)))
    return values, indices


def _split_factor(graph: fx.Graph, q: fx.Node, factor: fx.Node | None, relu: bool, q_dtype: torch.dtype):
    """A [B, T, H] tensor factor of the score before the activation, as (q, a head weight) the op takes.

    Without an activation it is a head weight: f * (q.k) is exactly (q.k) * f. Through a ReLU, relu(f * s) ==
    |f| * relu(sign(f) * s) bit for bit for every finite nonzero f (one product, |f * s| == |f| * |s|, and the
    same overflow): the sign goes into q (negating q negates its dot products exactly), the magnitude into the
    weights. Folding f into q instead, (f q).k, would round differently and overflow (or not) where f * (q.k)
    does not, and an infinite f would turn every dot product into NaN. Where head weights or other factors
    meet |f| in the op's one weight, their product rounds once and may overflow where eager's products in turn
    do not; README lists that and the cases still apart (f infinite, or zero against an infinite q.k)."""
    if factor is None:
        return q, None
    factor = graph.call_method("float", (factor,))
    if not relu:
        return q, factor
    sign = graph.call_function(torch.copysign, (graph.call_function(torch.ones_like, (factor,)), factor))
    sign = graph.call_method("to", (sign, q_dtype))  # +-1: exact in every dtype
    q = graph.call_function(torch.mul, (q, graph.call_method("unsqueeze", (sign, -1))))
    return q, graph.call_function(torch.abs, (factor,))


def _to_layout(graph: fx.Graph, node: fx.Node, sc: Score, batching: Batching, T, S) -> fx.Node:
    """From the op's [B, T, k] to the layout the model's top-k produced (its score's dims, S -> k)."""
    node, lead = batching.restore(graph, node)
    canon = (*lead, T, S)
    if T == sc.virtual_query:  # decode with the query dim squeezed away: the model's score has none
        node = graph.call_method("squeeze", (node, len(lead)))
        canon = (*lead, S)
    real = [lab for lab in sc.dims if lab is not None]
    perm = [canon.index(lab) for lab in real]
    if perm != list(range(len(perm))):
        node = graph.call_method("permute", (node, *perm))
    for i, lab in enumerate(sc.dims):
        if lab is None:
            node = graph.call_method("unsqueeze", (node, i))
    return node


def _inherit_meta(nodes: list[fx.Node], origin: fx.Node) -> None:
    for n in nodes:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in origin.meta and key not in n.meta:
                n.meta[key] = origin.meta[key]


# What a metadata reader of the score becomes: a fresh tensor of the shape the reader would have read.
_FRESH = {"full_like": torch.full, "zeros_like": torch.zeros, "ones_like": torch.ones, "empty_like": torch.empty,
          "new_full": torch.full, "new_zeros": torch.zeros, "new_ones": torch.ones, "new_empty": torch.empty}


def _replace_metadata_readers(graph: fx.Graph, sc: Score, readers: list[fx.Node]) -> None:
    """``full_like(score, v)`` and kin read only the score's shape, dtype and device: give them a new tensor of
    that shape (sizes from q and k), so the score itself need not exist."""
    dims = dict(sc.node_dims)
    for r in readers:
        src = r.args[0]
        if src not in dims:
            raise Reject(f"the shape of {src.name} is read, and the pass cannot restate it", r)
        v = value(r)
        with graph.inserting_before(r):
            name = op_name(r)
            if name.startswith("new_"):
                size, rest = r.args[1], r.args[2:]
            else:
                size, rest = [label_size(graph, sc, lab) for lab in dims[src]], r.args[1:]
            kwargs = {k: x for k, x in r.kwargs.items() if k in ("requires_grad",)}
            new = graph.call_function(_FRESH[name], (size, *rest), dict(kwargs, dtype=v.dtype, device=v.device))
        new.meta.update({k: r.meta[k] for k in ("stack_trace", "nn_module_stack", "example_value", "val")
                         if k in r.meta})
        r.replace_all_uses_with(new)
        graph.erase_node(r)


def _replace_outputs(graph: fx.Graph, site: Site, sc: Score, values: fx.Node, indices: fx.Node) -> None:
    for i, user in enumerate(site.values + site.gathers):
        if i == 0:
            user.replace_all_uses_with(values)
        else:
            with graph.inserting_before(site.topk):
                user.replace_all_uses_with(graph.call_method("clone", (values,)))
    for user in site.indices:
        user.replace_all_uses_with(indices)
    erased = site.gathers + site.values + site.indices + list(site.extra) + [site.topk] + list(reversed(sc.nodes))
    inputs = {a for n in erased for a in n.all_input_nodes}
    for n in erased:
        if not n.users:
            graph.erase_node(n)
    _erase_dead_inputs(graph, inputs - set(erased))


# Ops that only compute tensors (no side effects): what fed the old score and is now unused can go.
_PURE = {"unsqueeze", "transpose", "permute", "identity", "detach", "float", "to", "squeeze", "reshape", "getitem",
         "invert", "and", "or", "le", "lt", "ge", "gt", "add", "sub", "mul", "neg", "arange", "full", "ones",
         "zeros", "triu", "tril", "tensor", "expand"}


def _erase_dead_inputs(graph: fx.Graph, roots: set[fx.Node]) -> None:
    """Erase the views, casts and mask constructions that only fed the old score (now unused)."""
    todo = list(roots)
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n.users or n.op != "call_function" and n.op != "call_method":
            continue
        if op_name(n) not in _PURE or (op_name(n) == "getitem" and not _is_tensor_index(n)):
            continue
        todo.extend(a for a in n.all_input_nodes)
        graph.erase_node(n)


def _is_tensor_index(n: fx.Node) -> bool:
    return isinstance(n.args[0], fx.Node) and shape(n.args[0]) is not None
