"""The selection pass: find every top-k over an indexer score, prove the rewrite legal, rewrite it.

For each ``topk`` node of a Dynamo graph (and of the checkpoint bodies it calls):
  1. read its input as an index expression (``index_expr.interpret``);
  2. prove that nothing but the selection (and gathers at the selected indices) reads the score
     table or any intermediate of its computation, so the table need never exist;
  3. replace the site with ``torch.ops.hyscale.select`` on the model's own q, k, weights and masks.
A site that fails any step is left exactly as it was, and its report says why.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx
from torch._dynamo.utils import counters

from . import debug, inplace, masks
from .graph_ops import arg, dtype, is_one, is_tensor, named_arg, normalize_dim, op_name, shape, source_line
from .index_expr import Leaf, Reject, Score, interpret, positive_scale
from .report import SiteReport, human_bytes, record, symbolic_bytes

# Tests set HYSCALE_STRICT=1 so that an internal error fails loudly instead of skipping the site.
STRICT = os.environ.get("HYSCALE_STRICT", "0") == "1"


@dataclass
class Site:
    topk: fx.Node
    score_node: fx.Node
    s_dim: int
    k: object
    sorted: bool
    values: list[fx.Node]  # getitem(topk, 0)
    indices: list[fx.Node]  # getitem(topk, 1)
    gathers: list[fx.Node]  # score.gather(s_dim, indices)
    extra: tuple[fx.Node, ...] = ()  # other nodes of the selection to erase (a sort's getitems)


def run(gm: fx.GraphModule, debug_dir: str | None = None) -> list[SiteReport]:
    """Rewrite every provable site in ``gm`` and its subgraphs; return one report per top-k site."""
    reports: list[SiteReport] = []
    for name, sub in _graph_modules(gm):
        before = sub.print_readable(print_output=False)
        found = [n for n in sub.graph.nodes if op_name(n) in ("topk", "sort")]
        for node in found:
            reports.append(_run_site(sub, name, node))
        if any(r.decision == "rewritten" and r.graph == name for r in reports):
            sub.graph.lint()
            sub.recompile()
        debug.dump(name, before, sub, debug_dir)
    return reports


def _graph_modules(gm: fx.GraphModule):
    """The graph and every subgraph module it owns (checkpoint bodies, other higher-order op bodies)."""
    for name, mod in gm.named_modules():
        if isinstance(mod, fx.GraphModule):
            yield (name or "graph"), mod


def _run_site(gm: fx.GraphModule, graph_name: str, node: fx.Node) -> SiteReport:
    report = SiteReport(graph=graph_name, node=node.name, source=source_line(node), decision="rejected", reason="")
    undo = inplace.functionalize_ancestors(gm.graph, node)
    try:
        site = _site(node)
        report.k = str(site.k)
        sc = interpret(site.score_node, site.s_dim)
        _check_readers(site, sc)
        _check_no_mutation_between(site, sc)
        _describe(report, site, sc)
        report.dense_scatter_bytes = _dense_scatter_bytes(site)
        # The op's unsorted order is that of atomic appends (not reproducible), so a model's own
        # sorted=False is not taken at its word: only a site where no order can matter goes unsorted.
        unsort = _order_free(site)
        site.sorted = not unsort
        plan = masks.plan(sc)
        report.mask_kind = plan.kind
        _rewrite_or_restore(gm, site, sc, plan)
        report.decision = "rewritten"
        notes = list(plan.notes)
        if dtype(site.score_node) in (torch.bfloat16, torch.float16):
            notes.append(f"the model's score is {dtype(site.score_node)}; selection ranks the exact fp32 score, so "
                         "near-ties its rounding would make may be picked differently")
        if report.dense_scatter_bytes:
            dense = human_bytes(report.dense_scatter_bytes)
            notes.append(f"the model scatters the indices into dense tensors of {dense} downstream (kept: its own)")
        if unsort:
            counters["hyscale"]["selection_unsorted"] += 1
            notes.append("only the set of indices is read (a constant scattered at them): selected without the "
                         "final sort")
        report.reason = "; ".join(notes) or "indexer form proven"
    except Reject as err:
        undo()
        report.reason = err.reason
    except Exception as err:  # a bug of ours must never break the user's compile: leave the site alone
        undo()
        if STRICT:
            raise
        report.reason = f"hyscale internal error, site left alone (please report): {type(err).__name__}: {err}"
    record(report)
    return report


# ---------------------------------------------------------------------------------------------
# step 1: the site


def _site(node: fx.Node) -> Site:
    return _sort_site(node) if op_name(node) == "sort" else _topk_site(node)


def _input_and_dim(node: fx.Node) -> tuple[fx.Node, int, int]:
    """The selected tensor, its rank and the (non-negative) dim selected along, for topk and sort."""
    score = arg(node, 0, "input")
    if not isinstance(score, fx.Node) or shape(score) is None:
        raise Reject(f"the {op_name(node)} input is not a tensor of this graph", node)
    ndim = len(shape(score))
    dim = named_arg(node, "dim", -1)
    if not isinstance(dim, int):
        raise Reject(f"the {op_name(node)} dim is not a constant", node)
    return score, ndim, normalize_dim(dim, ndim)


def _writes_out(node: fx.Node) -> bool:
    return node.kwargs.get("out") is not None


def _sort_site(node: fx.Node) -> Site:
    """``sort(score, descending=True)`` read only through ``[..., :k]`` slices: a top-k, ties by position."""
    score, ndim, s_dim = _input_and_dim(node)
    if _writes_out(node) or not named_arg(node, "descending", False):
        raise Reject("the sort is not a descending sort", node)
    parts, ks = ([], []), set()
    for user in node.users:
        if op_name(user) != "getitem" or user.args[1] not in (0, 1):
            raise Reject(f"the sort result is used by {_what(user)} directly", node)
        for sl in user.users:
            k = _leading_slice(sl, s_dim, ndim)
            if k is None:
                raise Reject("the sorted scores or indices are read beyond a leading [..., :k] slice", node)
            ks.add(k)
            parts[user.args[1]].append(sl)
    size = shape(score)[s_dim]
    if len(ks) != 1 or not all(isinstance(x, int) for x in (*ks, size)):
        raise Reject("the sort is sliced to different or symbolic lengths", node)
    k = min(ks.pop(), size)
    gathers = [u for u in score.users if u is not node and _is_gather_at(u, score, s_dim, ndim, parts[1])]
    return Site(node, score, s_dim, k, True, parts[0], parts[1], gathers, extra=tuple(node.users))


def _leading_slice(node: fx.Node, s_dim: int, ndim: int) -> int | None:
    """k when ``node`` is ``x[..., :k]`` on ``s_dim`` (every other dim whole), else None."""
    if op_name(node) != "getitem":
        return None
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if Ellipsis in idx:
        i = idx.index(Ellipsis)
        idx = idx[:i] + (slice(None),) * (ndim - len(idx) + 1) + idx[i + 1:]
    if len(idx) < ndim:
        idx = idx + (slice(None),) * (ndim - len(idx))
    if len(idx) != ndim or not all(isinstance(x, slice) for x in idx):
        return None
    for d, x in enumerate(idx):
        if d == s_dim:
            if x.start not in (None, 0) or x.step not in (None, 1) or not isinstance(x.stop, int) or x.stop < 0:
                return None
        elif x != slice(None):
            return None
    return idx[s_dim].stop


def _topk_site(node: fx.Node) -> Site:
    score, ndim, s_dim = _input_and_dim(node)
    if _writes_out(node):
        raise Reject("top-k writes into out= tensors", node)
    if not named_arg(node, "largest", True):
        raise Reject("top-k with largest=False selects the lowest scores", node)
    values, indices = [], []
    for user in node.users:
        if op_name(user) != "getitem" or user.args[1] not in (0, 1):
            raise Reject(f"the top-k result is used by {user.target} directly", node)
        (values if user.args[1] == 0 else indices).append(user)
    gathers = [u for u in score.users if u is not node and _is_gather_at(u, score, s_dim, ndim, indices)]
    return Site(node, score, s_dim, named_arg(node, "k"), bool(named_arg(node, "sorted", True)),
                values, indices, gathers)


def _is_gather_at(user: fx.Node, score: fx.Node, s_dim: int, ndim: int, indices: list[fx.Node]) -> bool:
    if op_name(user) != "gather" or named_arg(user, "input") is not score:
        return False
    dim = named_arg(user, "dim")
    return isinstance(dim, int) and normalize_dim(dim, ndim) == s_dim and named_arg(user, "index") in indices


# ---------------------------------------------------------------------------------------------
# step 2: nothing else reads the table


def _check_readers(site: Site, sc: Score) -> None:
    allowed = {site.topk, *site.gathers}
    for user in site.score_node.users:
        if user not in allowed:
            raise Reject(f"the score table is read by {_what(user)} at {source_line(user)}, so it must be "
                         "written; selection is left as it is", site.topk)
    chain = set(sc.nodes)
    for n in sc.nodes:
        if n is site.score_node:
            continue
        for user in n.users:
            if user not in chain:
                raise Reject(f"an intermediate of the score ({n.name}, e.g. the per-head scores) is read by "
                             f"{_what(user)} at {source_line(user)}", site.topk)


def _check_no_mutation_between(site: Site, sc: Score) -> None:
    """The op reads q, k, weights and masks where the top-k stands; nothing may change them in between."""
    order = {n: i for i, n in enumerate(site.topk.graph.nodes)}
    first = min(order[n] for n in sc.nodes)
    for n in site.topk.graph.nodes:
        if first < order[n] < order[site.topk] and mutates(n):
            raise Reject(f"{_what(n)} at {source_line(n)} may change a tensor between the score and the "
                         "selection", site.topk)


def mutates(n: fx.Node) -> bool:
    """Conservatively: could this call write into an existing tensor?"""
    if n.op not in ("call_function", "call_method", "call_module"):
        return False
    if n.op == "call_module" or n.kwargs.get("out") is not None or n.kwargs.get("inplace"):
        return True
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return n.target in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                            operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod,
                            operator.ipow)  # and_, or_, not_ ... are not in-place
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    return isinstance(name, str) and name.endswith("_") and not name.startswith("_") and name != "requires_grad_"


def _what(node: fx.Node) -> str:
    if node.op == "output":
        return "the graph output"
    return getattr(node.target, "__name__", str(node.target))


def _describe(report: SiteReport, site: Site, sc: Score) -> None:
    q, k = shape(sc.q.node), shape(sc.k.node)
    report.shapes = {"q": _fmt(q), "kx": _fmt(k), "score": _fmt(shape(site.score_node))}
    if sc.weights:
        report.shapes["weights"] = _fmt(shape(sc.weights[0].node))
    score_elems = symbolic_bytes(*shape(site.score_node))
    if score_elems is not None:
        avoided = score_elems * 4
        if sc.head is not None:
            head_size = _label_size(sc, sc.head)
            per_head = symbolic_bytes(score_elems, head_size) if head_size is not None else None
            avoided += (per_head or 0) * 4
        report.table_bytes_avoided = avoided


def _order_free(site: Site) -> bool:
    """Nothing downstream sees the order of the selected entries: no value is read, and the indices
    (through dtype casts) only say where a constant is scattered along the selected dim, as in DSA's
    ``full(-inf).scatter_(-1, idx, 0)``, or lend their device (HF's ``idx.new_ones(...)``). A row's
    indices are distinct, so every order writes the same tensor, and the op may skip its final sort."""
    if site.values or site.gathers:
        return False
    return all(_reads_metadata_only(user, n) or _scatters_constant_at(user, n, site.s_dim)
               for user, n in _index_readers(site))


def _index_readers(site: Site) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(reader, the index node it reads) for every reader of the selected indices, through dtype casts
    (.long(), .to(torch.int32)). A reader reached from two index-derived nodes comes once for each."""
    todo, seen = list(site.indices), set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if (user, n) in seen:
                continue
            seen.add((user, n))
            if op_name(user) == "to":
                todo.append(user)
            else:
                yield user, n


# Methods that read only a tensor's shape, dtype or device (HF builds its index mask with new_ones).
_METADATA_METHODS = {"new_ones", "new_zeros", "new_empty", "new_full", "size", "dim"}


def _reads_metadata_only(node: fx.Node, index: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _METADATA_METHODS and node.args[0] is index
            and index not in node.args[1:] and index not in node.kwargs.values())


def _scatters_constant_at(node: fx.Node, index: fx.Node, s_dim: int) -> bool:
    """``x.scatter(dim, index, c)`` / ``scatter_`` with a number c along s_dim (not scatter_add or reduce)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if op_name(node) != "scatter" or name not in ("scatter", "scatter_") or "reduce" in node.kwargs:
        return False
    if len(node.args) > 4 or arg(node, 2, "index") is not index or shape(index) is None:
        return False
    dim, value = arg(node, 1, "dim"), arg(node, 3, "value", node.kwargs.get("src"))
    if not isinstance(dim, int) or not isinstance(value, int | float):  # a bool is an int too
        return False
    return normalize_dim(dim, len(shape(index))) == s_dim


def _dense_scatter_bytes(site: Site) -> int | None:
    """Bytes of dense tensors the model scatters the selected indices into (e.g. HF's [B, T, S] index mask).

    That mask is the model's own choice and stays; the report makes its cost visible.
    """
    total = 0
    for user, n in _index_readers(site):  # a scatter reads one index node: counted once
        if op_name(user) == "scatter" and arg(user, 2, "index") is n:
            b = symbolic_bytes(*shape(user)) if shape(user) is not None else None
            if b is not None:
                total += b * dtype(user).itemsize
    return total or None


def _label_size(sc: Score, label) -> object:
    for leaf in (sc.q, sc.k):
        if label in leaf.labels:
            return shape(leaf.node)[leaf.labels.index(label)]
    return None


def _fmt(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]" if s is not None else "?"


# ---------------------------------------------------------------------------------------------
# step 3: rewrite


def _peel(leaf: Leaf) -> tuple[fx.Node, tuple]:
    """Walk under views and exact 16->32-bit upcasts so the op sees the model's own 16-bit tensor."""
    node, labels = leaf.node, list(leaf.labels)
    while True:
        name, src = op_name(node), node.args[0] if node.args else None
        if name in ("float", "to") and dtype(node) == torch.float32 and dtype(src) in (torch.bfloat16, torch.float16) \
                and shape(src) == shape(node):
            node = src
        elif name == "identity":
            node = src
        elif name == "unsqueeze":
            d = normalize_dim(named_arg(node, "dim"), len(labels))
            if labels[d] is not None:
                break
            del labels[d]
            node = src
        elif name == "transpose":
            a, b = (normalize_dim(x, len(labels)) for x in (named_arg(node, "dim0"), named_arg(node, "dim1")))
            labels[a], labels[b] = labels[b], labels[a]
            node = src
        else:
            break
    return node, tuple(labels)


def _canonical(graph: fx.Graph, node: fx.Node, labels: tuple, order: tuple) -> fx.Node:
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
            return _canonical(graph, node, labels, (self.labels[0] if self.labels else None, *rest))
        if not full and not set(self.labels) & set(labels):
            return _canonical(graph, node, labels, (None, *rest))
        x = _canonical(graph, node, labels, (*self.labels, *rest))
        x = graph.call_method("expand", (x, *self.sizes, *([-1] * len(rest))))
        return graph.call_method("flatten", (x, 0, len(self.labels) - 1))

    def restore(self, graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, tuple]:
        """From the op's [B', T, k] to [*batch, T, k]; returns the node and its leading labels."""
        if len(self.labels) <= 1:
            if not self.labels:
                return graph.call_method("squeeze", (node, 0)), ()
            return node, self.labels
        return graph.call_method("unflatten", (node, 0, tuple(self.sizes))), self.labels


def _check_inputs(sc: Score, node: fx.Node) -> None:
    """Inputs the op takes as they are: 16/32-bit floats, and keys that carry the queries' batch."""
    ok = (torch.bfloat16, torch.float16, torch.float32)
    for leaf in (sc.q, sc.k, *sc.pre, *sc.key_pre, *sc.weights):
        if is_tensor(leaf.node) and dtype(leaf.node) not in ok:
            raise Reject(f"an input of the score is {dtype(leaf.node)}; the selection computes in float32, "
                         "less precisely than the model", node)
    for lab in sc.batch:
        qs, ks = shape(sc.q.node)[sc.q.labels.index(lab)], shape(sc.k.node)[sc.k.labels.index(lab)]
        if is_one(qs) and not is_one(ks):
            raise Reject("the queries broadcast over the keys' batch dimension", node)


def _batching(graph: fx.Graph, sc: Score) -> Batching:
    sizes = []
    for lab in sc.batch_all:
        leaf = sc.q if lab in sc.q.labels else sc.k
        i = leaf.labels.index(lab)
        size = shape(leaf.node)[i]
        sizes.append(size if isinstance(size, int) else graph.call_method("size", (leaf.node, i)))
    return Batching(sc.batch_all, tuple(sizes))


def _factors(graph: fx.Graph, leaves: tuple[Leaf, ...], rest: tuple, batching: Batching
             ) -> tuple[fx.Node | None, list]:
    """The product of tensor factors laid out [batch, *rest], and the symbolic numbers, kept apart."""
    tensors = [batching.place(graph, *_peel(f), rest) for f in leaves if f.labels or is_tensor(f.node)]
    numbers = [f.node for f in leaves if not (f.labels or is_tensor(f.node))]
    product = None
    for t in tensors:
        product = t if product is None else graph.call_function(torch.mul, (product, t))
    return product, numbers


def _rewrite_or_restore(gm: fx.GraphModule, site: Site, sc: Score, plan: masks.MaskPlan) -> None:
    """Rewrite; if a check inside the rewrite fails, remove what it inserted so the graph is unchanged."""
    existing = set(gm.graph.nodes)
    try:
        _rewrite(gm, site, sc, plan)
    except Exception:
        for n in reversed([n for n in gm.graph.nodes if n not in existing]):
            gm.graph.erase_node(n)
        raise


def _rewrite(gm: fx.GraphModule, site: Site, sc: Score, plan: masks.MaskPlan) -> None:
    graph = gm.graph
    scale = positive_scale(sc, site.topk)
    T, H, S, D = sc.query, sc.head, sc.key, sc.contracted
    if {lab for lab in sc.dims if lab is not None} != {*sc.batch_all, T, S}:
        raise Reject("the selected tensor is not laid out as [batch..., query, key]", site.topk)
    _check_inputs(sc, site.topk)
    with graph.inserting_before(site.topk):
        batching = _batching(graph, sc)
        qn, ql = _peel(sc.q)
        kn, kl = _peel(sc.k)
        q = batching.place(graph, qn, ql, (T, H, D), full=True)
        k = batching.place(graph, kn, kl, (S, D), full=True)
        pre, pre_numbers = _factors(graph, sc.pre, (T, H), batching)
        if sc.pre:  # fold into q in fp32: a product of bf16 q and a factor is not bf16-exact
            q = graph.call_method("float", (q,))
        if pre is not None:
            q = graph.call_function(torch.mul, (q, graph.call_method("unsqueeze", (pre, -1))))
        for c in pre_numbers:
            q = graph.call_function(operator.mul, (q, c))
        kpre, _ = _factors(graph, sc.key_pre, (S,), batching)
        if kpre is not None:
            k = graph.call_function(torch.mul, (graph.call_method("float", (k,)),
                                                graph.call_method("unsqueeze", (kpre, -1))))
        q_dtype = torch.float32 if sc.pre else dtype(qn)
        k_dtype = torch.float32 if sc.key_pre else dtype(kn)
        if q_dtype != k_dtype:  # one side is genuinely fp32 (or mixed 16-bit types): score both in fp32
            q = graph.call_method("float", (q,)) if q_dtype != torch.float32 else q
            k = graph.call_method("float", (k,)) if k_dtype != torch.float32 else k
        w, w_numbers = _factors(graph, sc.weights, (T, H), batching)
        for c in w_numbers:
            w = graph.call_function(operator.mul, (w, c))
        if sc.post_scale < 0:
            w = graph.call_function(torch.neg, (w,))
        if w is not None and any(dtype(f.node) != torch.float32 for f in sc.weights):
            w = graph.call_method("float", (w,))
        bool_mask, bias = plan.emit(graph, batching.place, T, S)
        values, indices = _call_select(graph, q, k, w, site, scale, sc, plan, bool_mask, bias)
        values, indices = (_to_layout(graph, x, sc, batching, T, S) for x in (values, indices))
        if dtype(site.score_node) != torch.float32:
            values = graph.call_method("to", (values, dtype(site.score_node)))
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
_PURE = {"unsqueeze", "transpose", "permute", "identity", "float", "to", "squeeze", "reshape", "getitem",
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


def _call_select(graph, q, k, w, site: Site, scale: float, sc: Score, plan, bool_mask, bias):
    out = graph.call_function(
        torch.ops.hyscale.select.default,
        (q, k, w, site.k, scale, sc.relu, plan.causal, plan.offset, None, plan.starts, plan.ends,
         bool_mask, bias, plan.fill, site.sorted))
    return graph.call_function(operator.getitem, (out, 0)), graph.call_function(operator.getitem, (out, 1))


def _to_layout(graph: fx.Graph, node: fx.Node, sc: Score, batching: Batching, T, S) -> fx.Node:
    """From the op's [B, T, k] to the layout the model's top-k produced (its score's dims, S -> k)."""
    node, lead = batching.restore(graph, node)
    canon = (*lead, T, S)
    real = [lab for lab in sc.dims if lab is not None]
    perm = [canon.index(lab) for lab in real]
    if perm != list(range(len(perm))):
        node = graph.call_method("permute", (node, *perm))
    for i, lab in enumerate(sc.dims):
        if lab is None:
            node = graph.call_method("unsqueeze", (node, i))
    return node
