"""Step 3 of the attention pass: replace a proven site by ``torch.ops.hyscale.sparse_attention``.

The op takes q [B, T, H, D], k [B, S, G, D], v [B, S, G, Dv] (transposed views of the model's [B, H, T, D]
tensors; HF's ``repeat_kv`` is read back to its G key heads), the picks [B, T, K] as the model scattered them,
the causal offset, a [B, S] key mask, and what an empty row gives. A model mask that is no position rule and no
key mask is read at the picks, and the picks it hides are set to -1 (the op drops them). In the latent MLA
layout (``attention_mla``) the up-projection is folded into q and applied to the output: the op is
``hyscale.sparse_attention_mla``, which does both a block of query rows at a time (the per-head latent queries
and their gradients never exist whole) around the latent attention, taking the latent kv row once (the value
being its first Dc features: the view only this rewrite builds, so kv's whole gradient is all anything reads) and
folding dv into dk in its backward. Where eager's gradient of empty rows is added after the attention
(``empty_rows_like_eager``), the op adds it itself (its ``eager_empty_grad``). Under
autocast q, k and v are cast to the dtype the model's attention computes in. The output is put back as the
model's [B, H, T, Dv] with eager's strides; the dense masks, and what only fed them, are erased.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from . import masks
from .attention_masks import MaskPlan, Term
from .attention_mla import Latent
from .attention_sites import REWRITTEN_FROM, Site, peel_repeat_kv, same_shape
from .graph_ops import (
    Aliases,
    dtype,
    is_one,
    mutates,
    normalize_dim,
    op_name,
    own_copies,
    record_values,
    same_size,
    shape,
    source_line,
    value,
    writes_before_backward,
)
from .index_expr import Reject
from .legality import requires_grad
from .rewrite import canonical


def _size(graph: fx.Graph, node: fx.Node, dim: int):
    s = shape(node)[dim]
    return s if isinstance(s, int) else graph.call_method("size", (node, dim))


def _place(graph: fx.Graph, term: Term, order: tuple, sizes: tuple) -> fx.Node:
    """``term`` (labels per dim, None = size 1) as a tensor with dims ``order``, expanded to ``sizes``."""
    return graph.call_method("expand", (canonical(graph, term.node, term.labels, order), *sizes))


def rewrite(gm: fx.GraphModule, site: Site, plan: MaskPlan, latent: Latent | None, keep_latent: bool = True) -> None:
    graph = gm.graph
    att = site.attention
    existing = set(graph.nodes)
    written, by_caller = writes_before_backward(att.node, requires_grad(att.node))
    try:
        with graph.inserting_before(att.node):
            out = _emit(graph, site, plan, latent, keep_latent)
            result, replaced = _model_layout(graph, att, out)
        if _keeps_output(out, keep_latent) and _output_written(graph, att.node, replaced, by_caller):
            # the op keeps its output for the backward, and the model writes it: the model gets a copy, one
            # Inductor cannot remove as a no-op clone (lowering/saved_copy.py)
            with graph.inserting_after(out):
                copy = graph.call_function(torch.ops.hyscale.saved_copy.default, (out,))
            out.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
            out = copy
        for n in [n for n in graph.nodes if n not in existing and n.target in _SAVED]:
            tensors, small = _SAVED[n.target]
            own_copies(graph, n, tensors, written)
            own_copies(graph, n, small, by_caller)
    except Exception:
        for n in reversed([n for n in graph.nodes if n not in existing]):
            graph.erase_node(n)
        raise
    inserted = [n for n in graph.nodes if n not in existing]
    record_values(inserted)
    for n in inserted:
        n.meta[REWRITTEN_FROM] = source_line(att.node)  # for a later site's reasons: a mask this op reads
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in site.scatter.meta and key not in n.meta:
                n.meta[key] = site.scatter.meta[key]
    if replaced is not None:
        replaced.replace_all_uses_with(out)
    else:
        att.node.replace_all_uses_with(result)
    dead = [*([replaced] if replaced is not None else []), att.node, *att.nodes, *site.chain]
    if latent is not None:
        dead.append(latent.expanded)
    erase_dead(graph, dead)


def _keeps_output(out: fx.Node, keep_latent: bool) -> bool:
    """Whether the op whose output ``out`` is keeps it for its backward: ``sparse_attention`` (its row term), the
    absorbed MLA op without keep_latent (its row term and recomputed o'); ``empty_rows_like_eager`` returns a copy."""
    if out.target is not operator.getitem:
        return False
    op = out.args[0].target
    return op is torch.ops.hyscale.sparse_attention.default or (
        op is torch.ops.hyscale.sparse_attention_mla.default and not keep_latent)


def _output_written(graph: fx.Graph, att: fx.Node, replaced: fx.Node | None, written: list[fx.Node] | None) -> bool:
    """Whether the model may write its attention output in place before the backward (``written``: ``writes_after``
    with the caller's writes): the op's output becomes the attention's and, where it ``replaced`` a transpose, the
    copies and reshapes that read it (views of those share their storage)."""
    if written is None:
        return True
    ours = [att, *([replaced, *replaced.users] if replaced is not None else [])]
    aliases = Aliases(graph)
    return any(aliases.may_alias(t, n) for t in written for n in ours)


# The tensor arguments each op's autograd formula keeps for the backward (lowering/attention.py, attention_rows.py):
# (q, k, v: copied where the graph writes them later; the picks, offsets and key mask, [B, T, K] / [B] / [B, S] that
# the model's attention never keeps: also where they are the graph's inputs or outputs, which the caller may write).
_SAVED = {torch.ops.hyscale.sparse_attention.default: ((0, 1, 2), (3, 7, 8)),
          torch.ops.hyscale.sparse_attention_mla.default: ((0, 1, 2), (3, 8, 9)),
          torch.ops.hyscale.empty_rows_like_eager.default: ((1, 2, 3), ())}


def _model_layout(graph: fx.Graph, att, out: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """The op's contiguous [B, T, H, Dv] output as the model's attention output [B, H, T, Dv], with the strides
    eager's had (a view, ``as_strided`` or in-place write of it sees the same memory): contiguous for matmul and
    SDPA on the CPU, a transposed [B, T, H, Dv] for SDPA's flash kernels on CUDA (the example value Dynamo
    recorded says which). Returns (output, None), or (None, the node to read ``out`` in place of) where the model
    only reads its output as ``o.transpose(1, 2)`` and then ``.contiguous()`` or a reshape of that (HF's
    attention functions): ``out`` is that tensor, values and strides, with no copy."""
    x = att.node
    while len(x.users) == 1 and _same_shape_view(next(iter(x.users)), x):  # DeepSeek-V3.2: a reshape to [B, H, T, Dv]
        x = next(iter(x.users))
    (only,) = x.users if len(x.users) == 1 else (None,)
    if op_name(only) == "transpose" and only.args[:1] == (x,) and len(only.args) == 3 and \
            {normalize_dim(d, 4) for d in only.args[1:3] if isinstance(d, int)} == {1, 2} and only.users and \
            all(_copies_or_reshapes(u, only) for u in only.users):
        return None, only
    o = graph.call_method("transpose", (out, 1, 2))
    layout = _strides_of(att.node)
    if layout == "bhtd":
        return graph.call_method("contiguous", (o,)), None
    if layout == "bthd":
        return o, None
    raise Reject(f"the attention output has strides {value(att.node).stride()}, neither contiguous nor a transposed "
                 "[B, T, H, Dv] (the layouts of the op's output)", att.node)


def _same_shape_view(u: fx.Node, x: fx.Node) -> bool:
    """``x.reshape(...)`` / ``x.view(...)`` to x's own shape: x itself, strides and all."""
    return op_name(u) == "reshape" and u.args[:1] == (x,) and shape(u) is not None and same_shape(shape(u), shape(x))


def _copies_or_reshapes(u: fx.Node, x: fx.Node) -> bool:
    """``x.contiguous()`` or ``x.reshape(...)`` / ``view`` / ``flatten``: reads x's values, not its strides."""
    if u.op == "call_method" and u.target == "contiguous":
        return u.args == (x,) and not u.kwargs
    return op_name(u) == "reshape" and u.args[:1] == (x,)


def _strides_of(node: fx.Node) -> str | None:
    """"bhtd" (contiguous [B, H, T, Dv]) or "bthd" (a transposed contiguous [B, T, H, Dv]): the layout of the
    recorded example value, strides of size-1 dims aside; contiguous where none was recorded; None for others."""
    v = value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        return "bhtd"
    B, H, T, D = v.shape
    for name, want in (("bhtd", (H * T * D, T * D, D, 1)), ("bthd", (T * H * D, D, H * D, 1))):
        if all(is_one(n) or same_size(a, b) for n, a, b in zip(v.shape, v.stride(), want)):
            return name
    return None


def _emit(graph: fx.Graph, site: Site, plan: MaskPlan, latent: Latent | None, keep_latent: bool = True) -> fx.Node:
    """The op's output, [B, T, H, Dv] contiguous."""
    att = site.attention
    q = att.q
    B, T = _size(graph, q, 0), _size(graph, q, 2)
    S = _size(graph, att.k, 2)
    cast = att.dtype if att.dtype != dtype(q) else None  # autocast: q, k, v as it casts them for the attention
    idx, index_shape = site.index, site.index_shape
    if len(index_shape) == 2:  # one set of picks [T, K] for the whole batch
        idx, index_shape = graph.call_method("unsqueeze", (idx, 0)), (1, *index_shape)
    if is_one(index_shape[0]) and not is_one(shape(q)[0]):
        idx = graph.call_method("expand", (idx, B, -1, -1))
    # Masks over (batch, query, key) and over (batch, key) (padding) are read at the picks, once, here: the picks
    # they hide become -1, which the op drops as it drops a hidden pick (the same attention, empty rows included),
    # and its kernels load no mask per pick. The indices are a top-k's, in range (``sites``).
    seen = None
    for term in (*plan.pick_terms, *plan.key_terms):
        m = _place(graph, term, ("b", "t", "s"), (B, T, S))
        seen = m if seen is None else graph.call_function(torch.logical_and, (seen, m))
    if seen is not None:
        kept = graph.call_method("gather", (seen, -1, graph.call_method("long", (idx,))))
        idx = graph.call_function(torch.where, (kept, idx, -1))
    offset = masks.emit_sum(graph, plan.offset_terms) if plan.causal else 0
    eager_empty_grad = plan.eager_empty_grad and any(requires_grad(x) for x in (att.q, att.k, att.v))
    if latent is not None:  # the absorption inside the op, a block of query rows at a time
        q, kv = _latent_operands(graph, att.q, latent, B, S)
        out = graph.call_function(torch.ops.hyscale.sparse_attention_mla.default, (
            q, kv, _weight_heads(graph, latent), idx, latent.Dn, float(att.scale), plan.causal, offset, None, None,
            plan.empty, eager_empty_grad, *(() if keep_latent else (False,))))
        return graph.call_function(operator.getitem, (out, 0))
    qx = graph.call_method("transpose", (q if cast is None else graph.call_method("to", (q, cast)), 1, 2))
    kx, vx = (_kv_operand(graph, x, B, shape(q)[0], cast) for x in (att.k, att.v))
    out = graph.call_function(torch.ops.hyscale.sparse_attention.default, (
        qx, kx, vx, idx, float(att.scale), plan.causal, offset, None, None, plan.empty))
    o = graph.call_function(operator.getitem, (out, 0))
    if eager_empty_grad:
        lse = graph.call_function(operator.getitem, (out, 1))
        o = graph.call_function(torch.ops.hyscale.empty_rows_like_eager.default, (o, qx, kx, vx, lse,
                                                                                  float(att.scale)))
    return o


def _kv_operand(graph: fx.Graph, x: fx.Node, B, q_batch, cast) -> fx.Node:
    """[B, Hk, S, D] (HF's repeat_kv read back to its Hk key heads) as the op's [B, S, G, D]."""
    x, _ = peel_repeat_kv(x)
    shared = is_one(shape(x)[0]) and not is_one(q_batch)  # keys shared by the batch: broadcast as SDPA does
    if cast is not None:
        x = graph.call_method("to", (x, cast))
    if shared:
        x = graph.call_method("expand", (x, B, -1, -1, -1))
    return graph.call_method("transpose", (x, 1, 2))


def _weight_heads(graph: fx.Graph, latent: Latent) -> fx.Node:
    return graph.call_method("view", (latent.weight, latent.H, latent.Dn + latent.Dv, latent.Dc))


def _latent_operands(graph: fx.Graph, q: fx.Node, latent: Latent, B, S) -> tuple[fx.Node, fx.Node]:
    """The per-head q [B, T, H, Dn + Dr] (``sparse_attention_mla`` absorbs W_uk into it); kv = [c, r] [B, S, 1, Dc +
    Dr] (v = kv[..., :Dc]). The rope key may be shared by the batch or by the positions ([1, 1, S, Dr], [B, 1, 1,
    Dr]): it is expanded to the latent's [B, S] as the model's expansion over the heads broadcast it; a latent
    shared by the batch ([1, S, Dc], keys and values the attention broadcasts over q's batch) is expanded to q's."""
    qt = graph.call_method("transpose", (q, 1, 2))
    c = latent.latent
    c = graph.call_method("unsqueeze", (c, 2)) if len(shape(c)) == 3 else graph.call_method("transpose", (c, 1, 2))
    if is_one(shape(latent.latent)[0]) and not is_one(shape(q)[0]):  # one latent for the batch: SDPA broadcasts it
        c = graph.call_method("expand", (c, B, -1, -1, -1))
    r = graph.call_method("transpose", (latent.rope, 1, 2))
    rs = shape(latent.rope)
    if not (same_size(rs[0], shape(q)[0]) and same_size(rs[2], shape(latent.latent)[-2])):
        r = graph.call_method("expand", (r, B, S, -1, -1))
    return qt, graph.call_function(torch.cat, ([c, r], -1))


# ---------------------------------------------------------------------------------------------
# what only fed the dense attention

_PURE = {"unsqueeze", "squeeze", "expand", "reshape", "getitem", "to", "float", "identity", "invert", "and", "or",
         "masked_fill", "where", "add", "sub", "mul", "div", "matmul", "softmax", "dropout", "transpose", "permute",
         "scatter", "new_ones", "new_zeros", "new_full", "new_empty", "ones", "zeros", "full", "empty", "ones_like",
         "zeros_like", "full_like", "empty_like", "arange", "le", "lt", "ge", "gt", "linear", "split", "cat",
         "tensor", "sdpa", "detach", "neg", "eq", "ne"}
_CREATORS = {"new_empty", "empty", "new_zeros", "zeros", "new_ones", "ones", "new_full", "full", "empty_like",
             "zeros_like", "ones_like", "full_like"}


def _removable(n: fx.Node) -> bool:
    if n.users or n.op not in ("call_function", "call_method"):
        return False
    return op_name(n) in _PURE and not mutates(n)


def _dead_buffer(n: fx.Node) -> list[fx.Node] | None:
    """A tensor this graph created, read only by views of it that only in-place writes read, and those writes read
    by nothing: the whole group (a buffer written and never read, e.g. HF's key buffer once the attention that read
    it is gone)."""
    if op_name(n) not in _CREATORS:
        return None
    group, todo = [n], list(n.users)
    while todo:
        u = todo.pop()
        if u in group:
            continue
        if u.users and op_name(u) in ("getitem", "reshape", "transpose", "unsqueeze", "expand") and u.args[0] in group:
            group.append(u)
            todo.extend(u.users)
        elif not u.users and mutates(u) and u.op == "call_method" and u.args and u.args[0] in group:
            group.append(u)
        else:
            return None
    return group


def erase_dead(graph: fx.Graph, roots: list[fx.Node]) -> None:
    """Erase ``roots`` and what only they read, where nothing else reads it and it has no side effect."""
    todo, erased = list(dict.fromkeys(roots)), set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    while todo:
        n = todo.pop()
        if n in erased or n.graph is not graph:
            continue
        if _removable(n):
            todo.extend(n.all_input_nodes)
            graph.erase_node(n)
            erased.add(n)
            continue
        group = _dead_buffer(n)
        if group:
            inputs = {a for g in group for a in g.all_input_nodes} - set(group)
            for g in sorted(group, key=lambda x: -order[x]):
                graph.erase_node(g)
                erased.add(g)
            todo.extend(inputs)
