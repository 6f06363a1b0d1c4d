"""The absorbed (latent) MLA layout: one gathered row of ``[c_kv, k_rope]`` serves every head.

HF's DeepSeek-V3.2 / GLM-MoE-DSA attention expands the latent per head before attention (``expand_kv``)::

    kv    = kv_b_proj(c_kv).view(B, S, H, Dn + Dv).transpose(1, 2)      # [B, H, S, Dn + Dv], no bias
    k_nope, v = kv.split([Dn, Dv], -1)
    k     = cat(k_nope, k_rope.expand(-1, H, -1, -1))                  # or new_empty + copy_ into slices
    q     = [q_nope, q_rope]                                           # [B, H, T, Dn + Dr]

With W = kv_b_proj.weight viewed [H, Dn + Dv, Dc], W_uk = W[:, :Dn], W_uv = W[:, Dn:], for every head h

    q . k_s  = (q_nope W_uk[h]) . c_s + q_rope . r_s        out = (sum_s p_s c_s) W_uv[h]^T

so the attention can run on q' = [q_nope W_uk[h], q_rope] against one latent row [c_s, r_s] (the op's G = 1
layout, v = its first Dc features), and the output is projected per head after (as FlashMLA, TileLang's sparse
MLA and Megatron's absorbed MLA do). The scores are the same numbers up to the order of the sums: the scale is
unchanged. Legal when the projection has no bias, the dtypes agree, and the per-head K and V the model reads
at the attention are the expansion's values: the pass checks that nothing writes them (any view of them)
between the projection and the attention (``attention.latent_write`` reads ``Latent.built``).
Where something else reads them (HF's dynamic cache in transformers <= 5.17 stores the per-head K and V, on its
first update as ``cat([torch.tensor([]), keys], -2)``: a copy, peeled), they are still built for that reader,
and the attention runs in the latent layout all the same; a cache holding earlier keys has no latent for them in
the graph, and the site keeps the per-head layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .attention_sites import Attention, peel_empty_cat, peel_repeat_kv
from .graph_ops import (
    METADATA_READERS,
    arg,
    dtype,
    grad_enabled_at,
    is_one,
    normalize_dim,
    op_name,
    requires_grad,
    same_size,
    shape,
    source_line,
)
from .sites import describe


@dataclass
class Latent:
    weight: fx.Node  # [H * (Dn + Dv), Dc]
    latent: fx.Node  # c_kv, [B, 1, S, Dc] or [B, S, Dc]
    rope: fx.Node  # k_rope before its expansion over heads, [B, 1, S, Dr]
    H: int
    Dn: int
    Dv: int
    Dc: int
    Dr: int
    expanded: fx.Node  # the per-head kv [B, H, S, Dn + Dv]: what no longer needs to exist
    # the model's per-head values from the projection to the attention's k and v (views of them included): the
    # op no longer reads them, so nothing may write them before the attention
    built: tuple[fx.Node, ...] = ()
    copies: tuple[fx.Node, ...] = ()  # the two copy_ that write the key buffer (HF's expand_kv)
    kept_for: tuple[str, ...] = ()  # who else reads the per-head keys and values (they are still built for it)


class NotLatent(Exception):
    """Why the absorbed layout does not apply (the site keeps the per-head gather layout)."""


def _slice_of(node) -> tuple[fx.Node, int, int]:
    """(x, lo, hi) for ``x.split(...)[i]`` or ``x[..., lo:hi]`` along the last dim."""
    if op_name(node) == "getitem" and isinstance(node.args[1], int) and op_name(node.args[0]) == "split":
        sp = node.args[0]
        x, sizes, dim = sp.args[0], arg(sp, 1, "split_size_or_sections"), arg(sp, 2, "dim", 0)
        if shape(x) is None or not isinstance(dim, int) or normalize_dim(dim, len(shape(x))) != len(shape(x)) - 1:
            raise NotLatent("the key / value split is not along the features")
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
            raise NotLatent("the key / value split sizes are not constants")
        i = node.args[1]
        return x, sum(sizes[:i]), sum(sizes[:i + 1])
    if op_name(node) == "getitem" and isinstance(node.args[1], tuple) and len(node.args[1]) == 2 and \
            node.args[1][0] is Ellipsis and isinstance(node.args[1][1], slice):
        x, sl = node.args[0], node.args[1][1]
        n = shape(x)[-1] if shape(x) else None
        lo, hi = sl.start or 0, n if sl.stop is None else sl.stop
        if sl.step not in (None, 1) or not isinstance(n, int) or not isinstance(hi, int):
            raise NotLatent("the key / value slice is not a plain range")
        return x, lo, min(hi, n)
    raise NotLatent(f"{node.name} is not a slice of a per-head projection")


def _expansion(kv: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int, int]:
    """kv = linear(c, W, None).view(B, S, H, X).transpose(1, 2): (linear, W, c, H, X)."""
    if op_name(kv) != "transpose" or {normalize_dim(d, 4) for d in kv.args[1:3]} != {1, 2}:
        raise NotLatent("the per-head keys are not a transposed view of a projection")
    view = kv.args[0]
    if op_name(view) != "reshape" or shape(view) is None or len(shape(view)) != 4:
        raise NotLatent("the per-head keys are not a [B, S, H, D] view of a projection")
    lin = view.args[0]
    if op_name(lin) != "linear" or arg(lin, 2, "bias") is not None:
        raise NotLatent("the keys are not a projection without bias (kv_b_proj)")
    B, S, H, X = shape(view)
    lead = [d for d in shape(lin)[:-1] if not is_one(d)]
    expect = [d for d in (B, S) if not is_one(d)]
    if not (isinstance(H, int) and isinstance(X, int) and shape(lin)[-1] == H * X and len(lead) == len(expect)
            and all(same_size(a, b) for a, b in zip(lead, expect))):
        raise NotLatent("the projection's output is not split into [heads, features]")
    c, w = arg(lin, 0, "input"), arg(lin, 1, "weight")
    if shape(w) is None or len(shape(w)) != 2 or shape(c) is None:
        raise NotLatent("the projection's weight is not a matrix")
    return lin, w, c, H, X


def _rope(node: fx.Node, H: int) -> fx.Node:
    """r for ``r.expand(-1, H, -1, -1)`` with r [B, 1, S, Dr]."""
    if op_name(node) != "expand" or shape(node.args[0]) is None or len(shape(node.args[0])) != 4 or not is_one(
            shape(node.args[0])[1]):
        raise NotLatent("the rope part of the keys is not one key expanded over the heads")
    return node.args[0]


# Readers of the key buffer that copy what they read into a new tensor (HF's cache: a cat), so they cannot write
# it. Not clone or contiguous: op_name names both "identity", and contiguous returns its input when it already
# is (a buffer read by them keeps the per-head layout).
_COPYING_READERS = {"cat"}


def _key_parts(k: fx.Node, att: Attention) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]:
    """(k_nope, k_rope_expanded, the copies) of ``cat((k_nope, k_rope), -1)`` or of a ``new_empty`` buffer written
    by two ``copy_`` into its ``[..., :Dn]`` and ``[..., Dn:]`` slices (HF's ``expand_kv``), which only the
    attention and copying readers read, after both copies."""
    if op_name(k) == "cat":
        parts, dim = k.args[0], arg(k, 1, "dim", 0)
        if normalize_dim(dim, 4) != 3 or len(parts) != 2:
            raise NotLatent("the keys are not [k_nope, k_rope] along the features")
        return parts[0], parts[1], ()
    if op_name(k) != "new_empty":
        raise NotLatent("the keys are neither a concatenation nor a buffer written in two parts")
    writes, readers = {}, []
    for u in k.users:
        if u is att.node or u in att.nodes or op_name(u) in _COPYING_READERS and k not in u.kwargs.values():
            readers.append(u)
            continue
        x, lo, hi = _slice_of(u)
        copies = list(u.users)
        if len(copies) != 1 or op_name(copies[0]) != "copy_" or copies[0].args[0] is not u or copies[0].users:
            raise NotLatent("the key buffer is read or written other than by two copies")
        writes[(lo, hi)] = copies[0]
    n = shape(k)[-1]
    if len(writes) != 2:
        raise NotLatent("the key buffer is not written in exactly two parts")
    (a, b) = sorted(writes)
    if a[0] != 0 or a[1] != b[0] or b[1] != n:
        raise NotLatent("the key buffer's two parts do not cover it")
    order = {x: i for i, x in enumerate(k.graph.nodes)}
    if max(order[c] for c in writes.values()) > min(order[r] for r in (*readers, att.node)):
        raise NotLatent("the key buffer is read before it is written")
    return writes[a].args[1], writes[b].args[1], (writes[a], writes[b])


def match(att: Attention) -> Latent:
    """The latent form of this attention's k and v, or NotLatent with the reason."""
    v, n_rep = peel_repeat_kv(att.v)
    v = peel_empty_cat(v)
    try:
        kv, lo_v, hi_v = _slice_of(v)
        if n_rep != 1 or op_name(kv) != "transpose" or op_name(kv.args[0]) != "reshape" or op_name(
                kv.args[0].args[0]) != "linear":
            raise NotLatent("")
    except NotLatent:  # not the MLA shape at all: nothing to say
        raise NotLatent("") from None
    lin, w, c, H, X = _expansion(kv)
    k = peel_empty_cat(att.k)
    k_nope, k_rope, copies = _key_parts(k, att)
    kv2, lo_k, hi_k = _slice_of(k_nope)
    if kv2 is not kv or lo_k != 0 or hi_k != lo_v or hi_v != shape(kv)[-1]:
        raise NotLatent("the keys and values are not the two parts of one per-head projection")
    Dn, Dv = hi_k, hi_v - lo_v
    r = _rope(k_rope, H)
    Dc, Dr = shape(w)[1], shape(r)[-1]
    if shape(w)[0] != H * X or shape(c)[-1] != Dc:
        raise NotLatent("the projection's weight does not match [heads * (nope + v), latent]")
    if shape(att.q)[1] != H or shape(att.q)[-1] != Dn + Dr:
        raise NotLatent("the queries are not [q_nope, q_rope] per head")
    if not (dtype(w) == dtype(c) == dtype(r) == dtype(att.q)):
        raise NotLatent(f"the latent ({dtype(c)}), the rope key ({dtype(r)}), the weight ({dtype(w)}) and the queries "
                        f"({dtype(att.q)}) differ in dtype")
    c_shape = shape(c)
    if len(c_shape) == 4 and not is_one(c_shape[1]) or len(c_shape) not in (3, 4):
        raise NotLatent("the latent is not [B, S, Dc] or [B, 1, S, Dc]")
    _check_same_grad((v, k_nope), kv, "values and the keys' non-rope part")
    _check_same_grad((k_rope,), r, "keys' rope part")
    built = _built((lin, k_rope, k), (att.k, att.v, *copies))
    _check_grad_mode(built, att)
    return Latent(w, c, r, H, Dn, Dv, Dc, Dr, kv, built, copies, _other_readers(built, att))


def _built(starts: tuple[fx.Node, ...], ends: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    """The nodes on a path from the projection, the expanded rope key or the key buffer to the attention's k or v
    (or to the copies that write the key buffer): the per-head values the model builds. The buffer is a start of
    its own: made by ``q.new_empty`` (say), it is no reader of the projection, and neither is what reads it (a
    cache's cat)."""
    up, todo = set(), list(ends)
    while todo:
        n = todo.pop()
        if n not in up:
            up.add(n)
            todo.extend(n.all_input_nodes)
    down, todo = set(), list(starts)
    while todo:
        n = todo.pop()
        if n in up and n not in down:
            down.add(n)
            todo.extend(n.users)
    return tuple(n for n in starts[0].graph.nodes if n in down)


def _check_grad_mode(built: tuple[fx.Node, ...], att: Attention) -> None:
    """The latent op, which runs where the attention does, sends gradient to the latent, rope key and weight
    wherever they require it; eager's autograd only where every step from them to the attention ran with grad
    enabled. A step under ``torch.no_grad()`` (a frozen projection, a cache update, one copy into the key buffer)
    whose input requires grad cuts it there. A copy reads its source (the buffer it writes may require grad from
    the other copy); a new buffer nothing. An attention under no_grad gives no gradient either way."""
    if not grad_enabled_at(att.node):
        return
    for n in built:
        if op_name(n) == "new_empty":
            continue
        inputs = [n.args[1]] if op_name(n) == "copy_" else n.all_input_nodes
        if not grad_enabled_at(n) and any(requires_grad(x) for x in inputs):
            raise NotLatent(f"{describe(n)} at {source_line(n)} runs under no_grad on a tensor that requires grad: "
                            "eager's gradient stops there, and the latent form would carry it through")


def _other_readers(built: tuple[fx.Node, ...], att: Attention) -> tuple[str, ...]:
    """Who, besides the attention, reads the per-head keys and values (the model's cache, say)."""
    inside = {*built, att.node, *att.nodes}
    words = [("the graph's output (a cache, say)" if u.op == "output" else f"{describe(u)} at {source_line(u)}")
             for x in built for u in x.users
             if u not in inside and not (op_name(u) in METADATA_READERS and u.args[0] is x)]
    return tuple(dict.fromkeys(words))


def _check_same_grad(parts, source: fx.Node, what: str) -> None:
    """The latent form sends each part's gradient into its source (the projection's input and weight, the rope
    key): only right where autograd does too. A part taken under no_grad (or detached) from a source that needs
    a gradient gets none in the model, and the latent backward would give it one."""
    want = requires_grad(source)
    if any(requires_grad(p) != want for p in parts):
        raise NotLatent(f"the per-head {what} do not carry the gradient their source does (a no_grad or detached "
                        "slice): the latent form would give it one")
