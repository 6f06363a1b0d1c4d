"""Step 1 of the attention pass: the sites.

A site is a ``scatter`` of a selection's indices into a constant-filled tensor (the *index mask*, e.g. HF's
``idx.new_ones((B, T, S), dtype=bool).scatter(-1, idx.long(), False)``) whose value reaches one attention
through mask operations: views, ``~``, ``&``, ``|``, ``masked_fill``, ``where``, ``+``, ``-``, ``*``,
comparisons. The attention is
``scaled_dot_product_attention`` reading the mask as ``attn_mask``, or the eager chain
``matmul(q, k^T) * scale (+ mask) -> softmax -> [.to] -> [dropout] -> matmul(., v)``.

This module finds the parts (where the indices come from, which nodes build the mask, the attention's q, k, v
and scale) and rejects what is not that shape; ``attention_masks`` reads what the mask means.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import fx

from .graph_ops import (
    arg,
    dtype,
    held,
    infer_value,
    is_one,
    normalize_dim,
    op_name,
    same_size,
    shape,
    source_line,
    written_in_place,
)
from .index_expr import Reject
from .regions import Links, region_input
from .report import input_name
from .sites import describe

# In-place forms of mask operations (``index_mask += causal``, ``scores += index_mask``): read as the
# out-of-place op when the tensor they write is a mask intermediate (checked by ``Site.check_readers``).
_INPLACE = {operator.iadd: "add", operator.isub: "sub", operator.iand: "and", operator.ior: "or"}
_INPLACE_METHODS = {"masked_fill_": "masked_fill", "add_": "add", "sub_": "sub", "logical_and_": "and",
                    "logical_or_": "or", "bitwise_and_": "and", "bitwise_or_": "or"}

# What a mask passes through on its way from the scatter to the attention.
MASK_OPS = {"unsqueeze", "squeeze", "expand", "reshape", "getitem", "to", "float", "identity", "invert", "and", "or",
            "masked_fill", "where", "add", "sub", "mul", "neg", "eq", "ne", "lt", "le", "gt", "ge"}
# Arithmetic and comparisons a mask may go through (``(1.0 - keep.float()) * finfo.min``, ``keep == 0``): evaluated
# exactly like the rest (attention_masks), so a spelling that does not hide exactly is still told apart.
MASK_ARITHMETIC = {"mul", "neg", "eq", "ne", "lt", "le", "gt", "ge"}
VIEWS = {"unsqueeze", "squeeze", "expand", "reshape", "getitem", "identity"}

# Tensors filled with one constant: what a scatter writes into, and constants inside masks.
CONSTANT_TENSORS = {"ones": 1, "ones_like": 1, "new_ones": 1, "zeros": 0, "zeros_like": 0, "new_zeros": 0,
                    "full": None, "full_like": None, "new_full": None, "tensor": None}


# meta key of the nodes attention_rewrite inserts: the source line of the attention they replace
REWRITTEN_FROM = "hyscale_attention_rewritten_from"


def same_shape(a, b) -> bool:
    """Two shapes provably equal (symbolic sizes compared without adding guards)."""
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def mask_op(node) -> tuple[str | None, bool]:
    """(canonical name, writes its first argument in place) of a node, also for the in-place forms."""
    if not isinstance(node, fx.Node):
        return None, False
    if node.op == "call_function" and node.target in _INPLACE:
        return _INPLACE[node.target], True
    if node.op == "call_method" and node.target in _INPLACE_METHODS:
        return _INPLACE_METHODS[node.target], True
    return op_name(node), False


def constant_fill(node) -> object:
    """The one value a constant-filled tensor holds (``new_ones``, ``full(v)``, ``torch.tensor(v)`` ...), or None."""
    name = op_name(node)
    if name not in CONSTANT_TENSORS:
        return None
    v = CONSTANT_TENSORS[name]
    if v is not None:
        return v
    if name == "tensor":
        x = node.args[0] if node.args else None
        if written_in_place(node) or node.kwargs.get("requires_grad"):
            return None
    else:
        x = arg(node, 2 if name == "new_full" else 1, "fill_value")
    if isinstance(x, (bool, int, float)):
        return held(x, dtype(node) or node.kwargs.get("dtype"))  # as the tensor holds it: 2.5 in int64 is 2
    return None


@dataclass
class Attention:
    """One attention call, as the model wrote it: q [B, H, T, D], k [B, Hk, S, D], v [B, Hk, S, Dv]."""

    kind: str  # "sdpa" or "eager"
    node: fx.Node  # the node whose value is the attention output [B, H, T, Dv]
    mask: fx.Node  # the mask the attention reads: SDPA's attn_mask, or the softmax's input (eager)
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float
    dtype: torch.dtype  # what its products compute in: q's dtype, or autocast's (then q, k, v are cast to it)
    logits: fx.Node | None = None  # eager: the scaled q.k^T, [B, H, T, S]
    product: fx.Node | None = None  # eager: the q.k^T matmul, where the model reads q and k
    nodes: tuple[fx.Node, ...] = ()  # eager: the computation from q.k^T to the output (dies with the rewrite)
    dropout: str = "none"  # how dropout was found to be the identity ("p=0", "eval"), for the report


@dataclass
class Site:
    scatter: fx.Node
    base: fx.Node  # the constant-filled tensor scattered into
    index: fx.Node  # the scatter's index argument
    origin: fx.Node  # the selection the indices come from (topk, sort, argsort or hyscale.select)
    picked: object  # the number written at the picks
    fill: object  # the number everywhere else
    k: object  # picks per row: int or SymInt
    index_shape: tuple = ()  # the indices' shape (also where a pass inserted the node without recording it)
    chain: set[fx.Node] = field(default_factory=set)  # mask nodes, scatter to attention (both included)
    attention: Attention | None = None
    crossed: tuple[fx.Node, ...] = ()  # the indices' nodes in other graphs (checkpointed regions, their callers)

    @property
    def line(self) -> str:
        return source_line(self.scatter)


def scalar(x) -> object:
    """A number given as a Python number or a 0-d constant tensor made in the graph."""
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, fx.Node) and shape(x) == ():
        return constant_fill(x)
    return None


def is_index_scatter(node: fx.Node) -> bool:
    """``x.scatter(dim, index, number)`` / ``scatter_`` (not ``scatter_add``, not ``reduce=``)."""
    if op_name(node) != "scatter" or "reduce" in node.kwargs:
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name not in ("scatter", "scatter_"):
        return False
    return isinstance(scalar(arg(node, 3, "value", node.kwargs.get("src"))), (bool, int, float))


def consumer(node: fx.Node, limit: int = 32) -> fx.Node | None:
    """The first attention (an SDPA call reading it as its mask, or the softmax of an eager attention) the
    scatter's value reaches through mask operations."""
    todo, seen = deque([node]), {node}
    while todo and len(seen) < limit:
        n = todo.popleft()
        for u in n.users:
            name, _ = mask_op(u)
            if name == "sdpa" and _sdpa_mask(u) is n or name == "softmax" and is_eager_attention(u):
                return u
            if name in MASK_OPS and u not in seen:
                seen.add(u)
                todo.append(u)
    return None


def is_eager_attention(softmax: fx.Node, limit: int = 32) -> bool:
    """Is this softmax the weights of an attention: over scores built from a q.k^T product (through scales, casts
    and mask arithmetic), and multiplied with v (through casts and dropout)? A softmax over a router's or a
    classifier's logits is not, and neither is a mask that only feeds one."""
    n = softmax
    while not any(op_name(u) == "matmul" and u.args[:1] == (n,) for u in n.users):
        nxt = [u for u in n.users if op_name(u) in ("to", "float", "identity", "dropout") and u.args[:1] == (n,)]
        if len(nxt) != 1:
            return False
        n = nxt[0]
    todo, seen = [arg(softmax, 0, "input")], set()
    while todo and len(seen) < limit:
        x = todo.pop()
        if not isinstance(x, fx.Node) or x in seen:
            continue
        seen.add(x)
        if parse_logits(x) is not None:
            return True
        if mask_op(x)[0] in MASK_OPS:
            todo.extend(x.all_input_nodes)
    return False


def reaches_attention(node: fx.Node) -> bool:
    return consumer(node) is not None


def candidates(graph: fx.Graph) -> list[fx.Node]:
    """The scatters of this graph that build a mask read by an attention (each is one site)."""
    return [n for n in graph.nodes if is_index_scatter(n) and reaches_attention(n)]


# ---------------------------------------------------------------------------------------------
# where the indices come from


_INDEX_DTYPES = (torch.int32, torch.int64)


def index_origin(index: fx.Node, S, site_node: fx.Node,
                 links: Links | None = None) -> tuple[fx.Node, object, tuple[fx.Node, ...]]:
    """The selection the scattered indices come from (through int32/int64 casts, and with ``links`` into and out
    of checkpointed regions), its k, and the nodes of other graphs the indices pass through on the way (where
    nothing may write them: ``attention.check_no_mutation_across``).

    A top-k's (``topk``, ``hyscale.select``, a ``sort``/``argsort`` sliced ``[..., :k]``) indices are distinct
    within a row and lie in [0, S) when it selected along S keys: scattering them marks exactly k keys, so the
    op can read them as a set. Anything else could repeat an index (the dense mask counts it once, a sparse
    sum twice) or leave the range."""
    n, crossed = index, []
    while True:
        while op_name(n) in ("to", "identity") and getattr(infer_value(n), "dtype", None) in _INDEX_DTYPES and (
                shape_of(n.args[0]) is None or same_shape(shape_of(n.args[0]), shape_of(n))):
            n = n.args[0]
            if n.graph is not index.graph:
                crossed.append(n)
        up = links.across(n) if links is not None else None
        if up is None:
            break
        n = up
        crossed.append(n)
    sel, k = _selection(n, index, S, site_node)
    return sel, k, tuple(crossed)


def _selection(n: fx.Node, index: fx.Node, S, site_node: fx.Node) -> tuple[fx.Node, object]:
    """The selection whose indices ``n`` is, and its k, the picks per row of the scattered ``index`` (Reject if
    it is none)."""
    why = ("its indices are not a top-k's (a topk, sort or hyscale.select output, through int casts), so they may "
           "repeat within a row or leave [0, S): a repeated key counts once in the dense mask but twice in a sparse "
           "sum")
    if op_name(n) == "getitem" and n.args[1] == 1 and isinstance(n.args[0], fx.Node):
        sel = n.args[0]
        if sel.op == "call_function" and sel.target in (torch.ops.hyscale.select.default, torch.ops.hyscale.select):
            kx = sel.kwargs.get("kx", sel.args[1] if len(sel.args) > 1 else None)
            kx_shape = shape_of(kx)
            _check_range(kx_shape[1] if kx_shape else None, S, site_node)
            return sel, _picks_per_row(index, site_node)
        if op_name(sel) == "topk":
            src = arg(sel, 0, "input")
            dim = arg(sel, 2, "dim", -1)
            if not isinstance(dim, int) or shape(src) is None or normalize_dim(dim, len(shape(src))) != len(
                    shape(src)) - 1:
                raise Reject(f"the mask is scattered from top-k indices taken along another dim than the last; {why}",
                             site_node)
            _check_range(shape(src)[-1], S, site_node)
            return sel, _picks_per_row(index, site_node)
    if op_name(n) == "getitem" and _is_leading_slice(n):
        src = n.args[0]
        inner = src.args[0] if op_name(src) == "getitem" and src.args[1] == 1 else src
        if op_name(inner) in ("sort", "argsort") and (op_name(inner) == "argsort" or src is not inner):
            x = arg(inner, 0, "input")
            dim = arg(inner, 1, "dim", -1)
            if isinstance(dim, int) and shape(x) is not None and normalize_dim(dim, len(shape(x))) == len(shape(x)) - 1:
                _check_range(shape(x)[-1], S, site_node)
                return inner, _picks_per_row(index, site_node)
    if isinstance(n, fx.Node) and region_input(n):
        what = (f"`{n.target}`, an input of a region the pass could not follow to its top-k (a checkpoint body "
                "called more than once, or another higher-order op's body)")
    elif isinstance(n, fx.Node) and n.op == "placeholder":
        what = f"the graph input `{input_name(n)}`"
    else:
        what = describe(n)
    raise Reject(f"the index mask is scattered from {what}: {why}", site_node)


def _picks_per_row(index: fx.Node, site_node: fx.Node):
    s = shape_of(index)
    if not s:
        raise Reject("the shape of the scattered indices is unknown", site_node)
    return s[-1]


def shape_of(node) -> tuple | None:
    """The shape of a node, also of one a pass inserted without recording its example value."""
    v = infer_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _is_leading_slice(node: fx.Node) -> bool:
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not idx or not isinstance(idx[-1], slice):
        return False
    last = idx[-1]
    return last.start in (None, 0) and last.step in (None, 1) and all(
        i is Ellipsis or i == slice(None) for i in idx[:-1])


def _check_range(selected_from, S, node: fx.Node) -> None:
    if selected_from is None or not same_size(selected_from, S):
        raise Reject(f"the indices were selected among {selected_from} keys and scattered along {S}: they are not "
                     f"provably in range{_symbolic_hint(selected_from, S)}", node)


def differ(a, b) -> str:
    """Words for two sizes ``same_size`` could not prove equal: they differ, or are symbols it cannot compare."""
    if isinstance(a, int) and isinstance(b, int):
        return f"differ ({a} and {b})"
    return f"are not provably equal ({a} and {b}){_symbolic_hint(a, b)}"


def _symbolic_hint(a, b) -> str:
    """Where a symbolic size is involved: Dynamo gives sizes separate symbols once they have changed independently
    (a recompilation for new shapes), and the pass adds no guard; the model can state the equality itself."""
    if a is None or b is None or isinstance(a, int) and isinstance(b, int):
        return ""
    return (" (Dynamo gave them separate symbols, e.g. after recompiling for new shapes, and the pass adds no "
            "guards: torch._check(x.shape[i] == y.shape[j]) on the two sizes in the model proves them equal)")


# ---------------------------------------------------------------------------------------------
# the mask chain, forward from the scatter


def mask_chain(scatter: fx.Node) -> tuple[set[fx.Node], fx.Node]:
    """The mask nodes from the scatter up to the attention (both included), and the attention node (an SDPA
    call or a softmax). Every mask node must be read by mask nodes or the attention only."""
    chain, todo, found = {scatter}, [scatter], []
    while todo:
        n = todo.pop()
        for u in n.users:
            name, _ = mask_op(u)
            if name == "sdpa" and _sdpa_mask(u) is n or name == "softmax" and arg(u, 0, "input") is n:
                if u not in found:
                    found.append(u)
            elif name in MASK_OPS:
                if u not in chain:
                    chain.add(u)
                    todo.append(u)
            else:
                what = "index mask" if n is scatter else "mask combining the index mask with the model's mask"
                raise Reject(f"the {what} ({n.name}) is read by {_reader(u)}, so it must be built; attention is "
                             "left dense", scatter)
    if len(found) != 1:
        raise Reject("the index mask feeds no attention" if not found else
                     f"the index mask feeds {len(found)} attention calls (one sparse attention per mask is rewritten)",
                     scatter)
    chain.add(found[0])
    return chain, found[0]


def _reader(u: fx.Node) -> str:
    """Who reads a mask node, in the report: the model's op, or the sparse attention another site was rewritten
    into (which reads a mask combined with its own index mask at its picks: ``~hidden1 & ~hidden2``)."""
    line = u.meta.get(REWRITTEN_FROM)
    if line is not None:
        return (f"the sparse attention that replaced the attention at {line}, which reads it at its own picks (the "
                "two index masks are combined)")
    return f"{describe(u)} at {source_line(u)}"


def _sdpa_mask(node: fx.Node):
    return arg(node, 3, "attn_mask")


# ---------------------------------------------------------------------------------------------
# the attention: SDPA or the eager chain


def sdpa(node: fx.Node, scatter: fx.Node) -> Attention:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    p, causal = arg(node, 4, "dropout_p", 0.0), arg(node, 5, "is_causal", False)
    scale, gqa = arg(node, 6, "scale", None), bool(arg(node, 7, "enable_gqa", False))
    if not (isinstance(p, (int, float)) and p == 0):
        raise Reject(f"scaled_dot_product_attention runs with dropout_p={p}: the random dropout of dense weights "
                     "has no sparse equivalent here (it is 0 in eval mode, or with attention_dropout=0)", scatter)
    if causal is not False:
        raise Reject("scaled_dot_product_attention has is_causal set besides the mask", scatter)
    _check_layout(q, k, v, scatter, gqa=gqa)
    return Attention("sdpa", node, _sdpa_mask(node), q, k, v, _scale(scale, q, scatter),
                     _compute_dtype(dtype(node), dtype(node), scatter))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(qk: torch.dtype | None, pv: torch.dtype | None, scatter: fx.Node) -> torch.dtype:
    """The dtype the attention's products compute in, as the graph recorded them: q's (and k's and v's), or under
    ``torch.autocast`` (entered in the compiled region or around it) the autocast dtype, which the op then gets
    its q, k and v cast to, as autocast casts them for SDPA and for each matmul."""
    if qk != pv or qk not in _FLOATS:
        raise Reject(f"the attention computes q.k^T in {qk} and its product with v in {pv} (e.g. an autocast region "
                     "ends between them): the op computes in one dtype", scatter)
    return qk


def _scale(scale, q: fx.Node, node: fx.Node) -> float:
    if scale is None:
        d = shape(q)[-1]
        if not isinstance(d, int):
            raise Reject("the softmax scale is the default 1/sqrt(D) of a symbolic head dim", node)
        return d ** -0.5
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise Reject("the softmax scale is not a constant number (e.g. a float attribute Dynamo lifted to a graph input "
                 "under dynamic=True)", node)


def _check_layout(q, k, v, node: fx.Node, gqa: bool = True) -> None:
    sq, sk, sv = shape(q), shape(k), shape(v)
    if any(s is None or len(s) != 4 for s in (sq, sk, sv)):
        raise Reject("the attention's q, k and v are not 4-D [batch, heads, sequence, features] tensors", node)
    for what, a, b in (("keys' and values' lengths", sk[2], sv[2]), ("keys' and values' heads", sk[1], sv[1]),
                       ("queries' and keys' features", sq[3], sk[3])):
        if not same_size(a, b):
            raise Reject(f"the attention's {what} {differ(a, b)}", node)
    for s in (sk, sv):
        if not (same_size(s[0], sq[0]) or is_one(s[0])):
            raise Reject("the keys' batch does not match the queries'", node)
    H, G = sq[1], sk[1]
    if not (same_size(H, G) or is_one(G) or gqa and isinstance(H, int) and isinstance(G, int) and H % G == 0):
        raise Reject(f"{H} query heads read {G} key heads, which this attention does not broadcast", node)
    if not (dtype(q) == dtype(k) == dtype(v)) or dtype(q) not in (torch.float32, torch.bfloat16, torch.float16):
        raise Reject(f"q, k, v are {dtype(q)}, {dtype(k)}, {dtype(v)}: the op takes one 16/32-bit float dtype", node)


def eager(softmax: fx.Node, chain: set[fx.Node], scatter: fx.Node) -> Attention:
    """softmax(scores + mask, dim=-1[, dtype]) -> [.to] -> [dropout] -> matmul(., v), with scores = q.k^T * scale."""
    dim = arg(softmax, 1, "dim")
    x = arg(softmax, 0, "input")
    if not isinstance(dim, int) or shape(x) is None or normalize_dim(dim, len(shape(x))) != len(shape(x)) - 1:
        raise Reject("the softmax is not over the keys (the last dim)", scatter)
    sm_dtype = softmax.kwargs.get("dtype")
    if sm_dtype not in (None, torch.float32):
        raise Reject(f"the softmax computes in {sm_dtype}", scatter)
    nodes, n, how = [softmax], softmax, "none"
    while True:
        users = list(n.users)
        if len(users) != 1:
            readers = ", ".join(f"{describe(u)} at {source_line(u)}" if u.op != "output" else describe(u)
                                for u in users if not (op_name(u) == "matmul" and u.args[0] is n)) or "nothing"
            raise Reject(f"the attention weights are read by {readers}, besides the product with v (the model "
                         "returns them with output_attentions=True); the dense weights must exist", scatter)
        (u,) = users
        name = op_name(u)
        if name in ("to", "float", "identity") and dtype(u) in (torch.float32, torch.bfloat16, torch.float16):
            nodes.append(u)
        elif name == "dropout":
            p, training = arg(u, 1, "p", 0.5), arg(u, 2, "training", u.kwargs.get("train", True))  # torch.dropout's
            if isinstance(p, (int, float)) and p == 0:
                how = "p=0"
            elif training is False:
                how = "eval"
            else:
                raise Reject(f"dropout with p={p} in training mode on the attention weights: its random mask of the "
                             "dense weights has no sparse equivalent (set the attention dropout to 0)", scatter)
            if arg(u, 3, "inplace", False):
                raise Reject("in-place dropout on the attention weights", scatter)
            nodes.append(u)
        elif name == "matmul" and u.args[0] is n and len(u.args) == 2:
            nodes.append(u)
            break
        else:
            raise Reject(f"the attention weights are read by {describe(u)} at {source_line(u)}, not a product with v",
                         scatter)
        n = u
    out = nodes[-1]
    _check_weights_precision(x, nodes[:-1], dtype(out), scatter)
    v = out.args[1]
    logits = _find_logits(x, chain, scatter)
    q, k, scale, lnodes = logits
    _check_layout(q, k, v, scatter, gqa=False)
    product = next(n for n in lnodes if op_name(n) == "matmul")
    return Attention("eager", out, x, q, k, v, scale, _compute_dtype(dtype(product), dtype(out), scatter),
                     logits=lnodes[0], product=product, nodes=tuple(lnodes + nodes), dropout=how)


def _check_weights_precision(x: fx.Node, weights: list[fx.Node], pv: torch.dtype | None, scatter: fx.Node) -> None:
    """The attention weights from the softmax to the product with v are held in float32 or in the product's own
    dtype only: a cast to a narrower dtype on the way (``p.bfloat16().float() @ v`` in a float32 model, a softmax
    given its dtype by position, ``torch.softmax(a, -1, torch.float16)``, which rounds its input too) rounds them
    where the op, computing in the product's dtype, does not."""
    softmax = weights[0]
    if dtype(softmax) != dtype(x) and dtype(softmax) != torch.float32:
        raise Reject(f"the softmax casts the scores to {dtype(softmax)} before it (its dtype argument), rounding them "
                     "where the op does not", scatter)
    for n in weights:
        if dtype(n) not in (torch.float32, pv):
            raise Reject(f"the attention weights are rounded to {dtype(n)} ({describe(n)} at {source_line(n)}) before "
                         f"their product with v in {pv}: the op computes them in {pv} and would not round them",
                         scatter)


def _find_logits(root: fx.Node, chain: set[fx.Node], scatter: fx.Node):
    """The one operand of the softmax's mask arithmetic that is the scaled q.k^T (not built from the scatter)."""
    operands = {a for n in chain | {root} for a in n.all_input_nodes if a not in chain}
    found = [(a, parsed) for a in operands
             if same_shape(shape(a), shape(root)) and dtype(a) is not None and dtype(a).is_floating_point
             and (parsed := parse_logits(a)) is not None]
    if len(found) != 1:
        raise Reject("the softmax input is not the scores q.k^T * scale plus the mask" if not found else
                     "the softmax input adds two q.k^T products", scatter)
    node, (q, k, scale, nodes) = found[0]
    return q, k, scale, nodes


def _number(x) -> float | None:
    v = scalar(x)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def parse_logits(node: fx.Node):
    """``matmul(q, k.transpose(-2, -1))`` times / divided by constants (and fp32 upcasts): (q, k, scale, nodes)."""
    scale, nodes, n = 1.0, [], node
    while True:
        name = op_name(n)
        if name in ("mul", "div") and len(n.args) == 2 and n.kwargs.get("rounding_mode") is None:
            a, b = n.args
            c = _number(b)
            if c is None and name == "mul":
                c, b, a = _number(a), a, b
            if c is None or c == 0 or not isinstance(a, fx.Node):
                return None
            scale = scale * c if name == "mul" else scale / c
            nodes.append(n)
            n = a
        elif name in ("float", "to") and dtype(n) == torch.float32 and same_shape(shape(n), shape(n.args[0])):
            nodes.append(n)
            n = n.args[0]
        elif name == "matmul":
            break
        else:
            return None
    if len(n.args) != 2 or shape(n) is None or len(shape(n)) != 4:
        return None
    q, kt = n.args
    k = _untransposed(kt)
    if k is None or not (scale > 0):
        return None
    nodes.append(n)
    if kt is not k:
        nodes.append(kt)
    return q, k, scale, nodes


def _untransposed(kt) -> fx.Node | None:
    """k for ``k.transpose(-2, -1)`` / ``k.transpose(2, 3)`` / ``k.permute(0, 1, 3, 2)`` of a 4-D k."""
    if not isinstance(kt, fx.Node) or shape(kt) is None or len(shape(kt)) != 4:
        return None
    name = op_name(kt)
    if name == "transpose":
        dims = {normalize_dim(d, 4) for d in (arg(kt, 1, "dim0"), arg(kt, 2, "dim1")) if isinstance(d, int)}
        return kt.args[0] if dims == {2, 3} else None
    if name == "permute":
        perm = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (list, tuple)) else kt.args[1:]
        return kt.args[0] if [normalize_dim(d, 4) for d in perm] == [0, 1, 3, 2] else None
    return None


def peel_empty_cat(node):
    """x for ``cat([past, x], dim)`` whose other parts are empty and whose result has x's shape and dtype (HF's
    dynamic cache on its first update: ``cat([torch.tensor([]), keys], -2)``): the same values, a copy; else node.
    The dtype is compared because cat promotes: an empty fp32 past makes bf16 keys fp32."""
    if op_name(node) != "cat" or not isinstance(node.args[0], (list, tuple)):
        return node
    full = [p for p in node.args[0] if not (isinstance(p, fx.Node) and _is_empty(shape(p)))]
    if len(full) != 1 or not isinstance(full[0], fx.Node):
        return node
    x = full[0]
    return x if dtype(x) == dtype(node) and same_shape(shape(x), shape(node)) else node


def _is_empty(s) -> bool:
    return s is not None and any(isinstance(d, int) and d == 0 for d in s)


def peel_repeat_kv(node: fx.Node) -> tuple[fx.Node, int]:
    """HF's ``repeat_kv``: ``x[:, :, None].expand(B, G, n, S, D).reshape(B, G * n, S, D)`` -> (x, n); else (node, 1).

    Query head h then reads key head h // n, the op's grouping."""
    if op_name(node) != "reshape":
        return node, 1
    e = node.args[0]
    if op_name(e) != "expand" or shape(e) is None or len(shape(e)) != 5:
        return node, 1
    g = e.args[0]
    if op_name(g) != "getitem" or g.args[1] != (slice(None), slice(None), None, slice(None), slice(None)):
        return node, 1
    x = g.args[0]
    sx, se = shape(x), shape(e)
    if sx is None or len(sx) != 4 or not all(same_size(a, b) for a, b in zip(sx[:2] + sx[2:], se[:2] + se[3:])):
        return node, 1
    if not same_shape(shape(node), (se[0], se[1] * se[2], se[3], se[4])):
        return node, 1
    n = se[2]
    return (x, n) if isinstance(n, int) else (node, 1)
