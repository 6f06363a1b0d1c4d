"""Step 2 of the selection pass: is replacing the site by ``hyscale.select`` provably the same computation?

Each check is a plain function of the site and its index expression that raises ``Reject`` with a reason a
user can act on, apart from the rewrite itself (as Inductor keeps ``_sfdp_params_check`` apart from the
attention patterns in ``fx_passes/fuse_attention.py``):

* ``check_readers``: nothing but the selection, gathers at the selected indices, and metadata reads (a
  ``full_like(score, ...)`` reads the shape only) reads the score table or an intermediate of it;
* ``check_no_mutation_between``: nothing writes q, k, weights or masks between the score and the selection;
* ``check_gathered_indices``: a gather at the selected indices reads them as the selection returned them;
* ``check_grad_mode``: a gather (or a sort's slice) the op's values stand for runs in the top-k's grad mode;
* ``check_operands``: the inputs are 16/32-bit floats and the keys carry the queries' batch;
* ``check_additive_order``: a tensor added after a masked fill keeps eager's IEEE values;
* ``gradient_cuts``: which inputs eager's autograd never reaches from the selected values (``detach``,
  ``no_grad``); the rewrite cuts the same inputs, so the op's gradients go exactly where eager's go.
"""

from __future__ import annotations

import torch
from torch import fx

from .graph_ops import (
    Aliases,
    depends_on,
    dtype,
    grad_enabled_at,
    is_one,
    is_tensor,
    mutates,
    op_name,
    reads_metadata_only,
    requires_grad,
    shape,
    source_line,
    written_by,
)
from .index_expr import Leaf, Reject, Score
from .operands import peel_path
from .sites import Site, describe, gather_index


def check_readers(site: Site, sc: Score) -> list[fx.Node]:
    """Nothing reads the table or its intermediates but the selection; returns the metadata readers, which the
    rewrite points at a tensor of the same shape, dtype and device."""
    allowed = {site.topk, *site.gathers}
    metadata = []
    for user in site.score_node.users:
        if reads_metadata_only(user, site.score_node):
            metadata.append(user)
        elif user not in allowed:
            raise Reject(f"the score table is read by {describe(user)} at {source_line(user)}, so it must be "
                         "written; selection is left as it is", site.topk)
    chain = set(sc.nodes)
    for leaf in (*sc.pre, *sc.key_pre, *sc.weights, *sc.bias, *sc.keep):
        if depends_on(leaf.node, chain):
            raise Reject("the score is combined with a tensor computed from the score itself, so the table is "
                         "needed", site.topk)
    for n in sc.nodes:
        if n is site.score_node:
            continue
        for user in n.users:
            if reads_metadata_only(user, n):
                metadata.append(user)
            elif user not in chain:
                raise Reject(f"an intermediate of the score ({n.name}, e.g. the per-head scores) is read by "
                             f"{describe(user)} at {source_line(user)}", site.topk)
    return metadata


def check_no_mutation_between(site: Site, sc: Score) -> None:
    """The op reads q, k, weights and masks where the top-k stands; the model read them in the score's chain,
    or at a copy the op reads under (``operands.peel_path``): nothing may change them in between."""
    order = {n: i for i, n in enumerate(site.topk.graph.nodes)}
    walked = [n for leaf in (sc.q, sc.k, *sc.pre, *sc.key_pre, *sc.weights, *sc.bias, *sc.keep)
              for n in peel_path(leaf)[2]]
    first = min(order[n] for n in (*sc.nodes, *walked))
    for n in site.topk.graph.nodes:
        if first < order[n] < order[site.topk] and mutates(n) and not _writes_unread_new_tensor(n, order):
            raise Reject(f"{describe(n)} at {source_line(n)} may change a tensor between the score and the "
                         "selection", site.topk)


def check_gathered_indices(site: Site) -> None:
    """``score.gather(-1, idx)`` is the selected values only where it reads the indices the selection returned: a
    write into them (``idx.clamp_(...)``, ``idx[..., 0] = 0``, through any view) between the selection and the
    gather makes it read the score at other positions, which the op's values are not."""
    if not site.gathers:
        return
    graph = site.topk.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    aliases = Aliases(graph)
    for n in graph.nodes:
        if not order[site.topk] < order[n] < max(order[g] for g in site.gathers) or not mutates(n):
            continue
        targets = written_by(n)
        for g in site.gathers:
            index = gather_index(g)
            if order[n] < order[g] and (targets is None or any(aliases.may_alias(t, index) for t in targets)):
                raise Reject(f"{describe(n)} at {source_line(n)} may write the selected indices before "
                             f"{describe(g)} at {source_line(g)} reads the score at them, so that gather reads other "
                             "positions than the selected ones and needs the score table; gather before changing the "
                             "indices, or change a copy (idx.clone())", site.topk)


def check_grad_mode(site: Site) -> None:
    """The op's values, made where the top-k runs and in its grad mode, stand for every gather of the score at the
    selected indices and every ``[..., :k]`` slice of a sort's values; eager makes each of those where it runs. A
    top-k under ``torch.no_grad()`` whose indices a gather outside it reads (the loss on the selected scores: a
    selection is not differentiable, so code selects under no_grad) gives a gather that carries the score's
    gradient, where the op's values would carry none; a gather under no_grad after a top-k outside it, one that
    carries none, where the op's values would. (A top-k's own values are its output: made in its mode either way.)"""
    if not requires_grad(site.score_node):
        return  # the score carries no gradient: nothing read from it does, in any mode
    mode = grad_enabled_at(site.topk)
    # a slice is a view: it carries a gradient where the sort's values do and it is taken with grad enabled
    slices = [v for v in site.values if v.args[0] is not site.topk] if mode else []
    for n in (*site.gathers, *slices):
        if grad_enabled_at(n) == mode:
            continue
        what = "slice of the sorted scores" if n in site.values else describe(n)
        if mode:
            why = (f"the {what} at {source_line(n)} runs under torch.no_grad() and the {op_name(site.topk)} with "
                   f"grad enabled: eager's {what} carries no gradient, the selection's values would carry one; "
                   "read it with grad enabled and .detach() it")
        else:
            why = (f"the {op_name(site.topk)} runs under torch.no_grad() and the {what} at {source_line(n)} with "
                   f"grad enabled: eager's {what} carries the score's gradient, the selection's values, made under "
                   f"no_grad, would carry none; take the {op_name(site.topk)} with grad enabled (its indices carry no "
                   "gradient either way)")
        raise Reject(why, site.topk)


_NEW_TENSORS = ("ones", "zeros", "full", "arange", "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros",
                "new_full")


def _writes_unread_new_tensor(n: fx.Node, order: dict[fx.Node, int]) -> bool:
    """``m = ones(...); m[1, 2:] = False``: a write into a tensor this graph just made, which nothing (no view
    either: a view is a user) has read yet, is seen by every reader of it, eager's and the op's alike."""
    target = n.args[0] if n.args else None
    if not isinstance(target, fx.Node) or op_name(target) not in _NEW_TENSORS:
        return False
    return all(u is n or order[u] > order[n] for u in target.users)


_OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_operands(sc: Score, node: fx.Node) -> None:
    """Inputs the op takes as they are: 16/32-bit floats, and keys that carry the queries' batch."""
    for leaf in (sc.q, sc.k, *sc.pre, *sc.key_pre, *sc.weights):
        if is_tensor(leaf.node) and dtype(leaf.node) not in _OPERAND_DTYPES:
            raise Reject(f"an input of the score is {dtype(leaf.node)}; the selection computes in float32, "
                         "less precisely than the model", node)
    if any(dtype(n) == torch.float16 for n in sc.nodes):
        raise Reject("the model computes the score in float16, whose overflow to inf past 65504 the float32 "
                     "selection would not reproduce; score in bfloat16 or float32 (e.g. q.float(), k.float())",
                     node)
    for lab in sc.batch:
        qs, ks = shape(sc.q.node)[sc.q.labels.index(lab)], shape(sc.k.node)[sc.k.labels.index(lab)]
        if is_one(qs) and not is_one(ks):
            raise Reject("the queries broadcast over the keys' batch dimension", node)


def check_additive_order(sc: Score, node: fx.Node, causal_terms: list[Leaf]) -> None:
    """A float tensor added *after* a masked fill: eager's value at a filled position is fill + x, NaN where x
    is NaN or +inf, and x there receives gradient; the op replaces masked positions last. Exact only for terms
    whose values cannot be NaN or +inf there and that need no gradient: an int or bool term the add converts
    (always finite), or the -inf triangle the mask plan reads from positions (``causal_terms``)."""
    if not sc.filled_before_bias:
        return
    for leaf in sc.bias:
        if leaf.cast is not None or any(leaf is t for t in causal_terms):
            continue
        raise Reject("a float tensor is added to the score after a masked fill; where it holds NaN or +inf, or "
                     "needs a gradient, the masked entries differ from the selection's (which applies masks "
                     "last): add it before the masked_fill, or fill after adding", node)


def eager_gradient_reaches(leaf: Leaf, sc: Score, score_node: fx.Node) -> bool:
    """Does eager's autograd carry a gradient from the selected values back to ``leaf``?

    Along a path of the chain from the node reading the leaf to the score, every tensor must require grad: a
    ``detach()``, a ``torch.no_grad()`` region or an input that never required grad cuts the path (the example
    values Dynamo records carry ``requires_grad`` as eager would set it)."""
    if not requires_grad(leaf.node) or leaf.at is None:
        return False
    chain = set(sc.nodes)
    todo, seen = [leaf.at], set()
    while todo:
        n = todo.pop()
        if n in seen or not requires_grad(n):
            continue
        if n is score_node:
            return True
        seen.add(n)
        todo.extend(u for u in n.users if u in chain)
    return False


def gradient_cuts(sc: Score, score_node: fx.Node) -> set[int]:
    """``id`` of every leaf the rewrite must detach: eager sends it no gradient through the selection."""
    leaves = (sc.q, sc.k, *sc.pre, *sc.key_pre, *sc.weights, *sc.bias)
    return {id(leaf) for leaf in leaves if not eager_gradient_reaches(leaf, sc, score_node)}
