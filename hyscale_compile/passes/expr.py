"""The index expression's data and its dispatch: ``Leaf``, ``Score``, ``Reject`` and ``interpret``.

``interpret(node, s_dim)`` reads what ``node`` computes as a ``Score``, by the handler registered for its op
(``HANDLERS``: contractions in ``expr_contract``, scales, additive terms, fills and the activation in
``expr_terms``, views in ``expr_views``; ``index_expr`` imports all three). The helpers here are what several
handlers share: lining a tensor up with the score, reading a constant, refusing arithmetic after a float64
upcast, and the one scale of the canonical form.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from .graph_ops import (
    depends_on,
    held,
    is_one,
    is_tensor,
    named_arg,
    op_name,
    shape,
    source_line,
    written_in_place,
)

_labels = itertools.count()

Label = int | None  # None: a size-1 dimension that only broadcasts


def new_label() -> int:
    """A label no dimension has had yet."""
    return next(_labels)


class Reject(Exception):
    """The site is not the indexer form (or cannot be proven to be); the message says why."""

    def __init__(self, reason: str, node: fx.Node | None = None, graph_input: fx.Node | None = None) -> None:
        where = f" (at {source_line(node)})" if node is not None else ""
        super().__init__(reason + where)
        self.reason = reason + where
        self.graph_input = graph_input  # the placeholder the score is read from, when it is not computed here


@dataclass(frozen=True)
class Leaf:
    """A tensor the model computed itself (q, k, weights, masks), with the label of each of its dims."""

    node: fx.Node
    labels: tuple[Label, ...]
    negate: bool = False  # bool masks: the tensor marks *hidden* positions; additive terms: it is subtracted
    at: fx.Node | None = field(default=None, compare=False)  # the node of the score's chain that reads it
    cast: torch.dtype | None = None  # an additive term the model's add converts first (int or bool to float)


@dataclass(frozen=True)
class Score:
    dims: tuple[Label, ...]  # label of each dim of the tensor this Score stands for
    q: Leaf
    k: Leaf
    key: int  # S
    contracted: int  # D
    batch: tuple[int, ...]  # labels shared by q and k
    query_free: tuple[int, ...]  # T, H (if present) and any query-only batch dims, not yet told apart
    head: int | None = None  # the summed label, once summed
    relu: bool = False
    pre_scale: float = 1.0
    post_scale: float = 1.0
    pre: tuple[Leaf, ...] = ()  # tensor factors applied before the activation
    key_pre: tuple[Leaf, ...] = ()  # per-key factors before the activation (fold into k)
    weights: tuple[Leaf, ...] = ()
    bias: tuple[Leaf, ...] = ()
    keep: tuple[Leaf, ...] = ()  # bool masks
    fill: float | None = None
    filled_before_bias: bool = False
    virtual_query: Label = None  # decode with the query dim squeezed away: a size-1 query dim of our own
    wide: bool = False  # cast to float64: only views and casts may follow (the op computes in float32)
    nodes: tuple[fx.Node, ...] = field(default=())  # the chain, bottom-up; all must die with the rewrite
    node_dims: tuple[tuple[fx.Node, tuple], ...] = field(default=())  # each chain node's dim labels

    def with_node(self, node: fx.Node, **changes) -> Score:
        new = replace(self, nodes=self.nodes + (node,), **changes)
        return replace(new, node_dims=new.node_dims + ((node, new.dims),))

    @property
    def masked(self) -> bool:
        return bool(self.bias or self.keep) or self.fill is not None

    @property
    def query(self) -> int:
        """T: of the query-only dims that survive the head sum, the innermost (the others are batch dims)."""
        rest = [lab for lab in self.dims if lab in self.query_free and lab != self.head]
        return rest[-1] if rest else self.virtual_query

    @property
    def batch_all(self) -> tuple[int, ...]:
        """Every batch dim of the selection, in score order: shared ones, and query-only ones k broadcasts over."""
        extra = {lab for lab in self.query_free if lab not in (self.head, self.query)}
        return tuple(lab for lab in self.dims if lab in extra or lab in self.batch)


# ---------------------------------------------------------------------------------------------
# contractions (einsum, matmul, bmm)
HANDLERS: dict[str, Callable[[fx.Node, int], Score]] = {}  # op name -> handler(node, s_dim)


def interpret(node, s_dim: int) -> Score:
    """The Score that ``node`` computes, given that its dim ``s_dim`` runs over key positions."""
    if not isinstance(node, fx.Node) or not is_tensor(node):
        raise Reject("the selected tensor is not computed in this graph", None)
    name = op_name(node)
    handler = HANDLERS.get(name)
    if handler is None:
        if node.op == "placeholder":
            raise Reject("the score is an input of this compiled graph, not computed in it", graph_input=node)
        what = node.target if node.op != "get_attr" else f"the module attribute {node.target!r}"
        raise Reject(f"the score is produced by {getattr(what, '__name__', what)}, which is not part of the "
                     "indexer form (q.k -> relu -> head-weighted sum -> mask)", node)
    return handler(node, s_dim)


def dim_size(sc: Score, label: Label):
    """The size of a label's dim, from the leaf that has it (None for a label no tensor has)."""
    for leaf in (sc.q, sc.k):
        if label in leaf.labels:
            return shape(leaf.node)[leaf.labels.index(label)]
    return None


def align(sc: Score, node: fx.Node, t: fx.Node) -> Leaf:
    """Labels of a tensor that broadcasts against the score (right-aligned)."""
    if depends_on(t, set(sc.nodes)):  # (legality.check_readers refuses it too, once the whole chain is known)
        raise Reject("the score is combined with a tensor computed from the score itself (a condition on it, or "
                     "its own magnitude: an activation spelled that way is not relu), so the table is needed", node)
    tshape = shape(t)
    if tshape is None or len(tshape) > len(sc.dims):
        raise Reject("a tensor combined with the score would change the score's shape", node)
    if shape(node) is not None and shape(node) != score_shape(node, t):
        raise Reject("a tensor combined with the score broadcasts it to a larger shape", node)
    off = len(sc.dims) - len(tshape)
    labels = []
    for i, size in enumerate(tshape):
        lab = sc.dims[off + i]
        if is_one(size):
            labels.append(None)
        elif lab is None:
            raise Reject("a tensor combined with the score would change the score's shape", node)
        else:
            labels.append(lab)
    return Leaf(t, tuple(labels), at=node)


def score_shape(node: fx.Node, other: fx.Node) -> tuple | None:
    """The shape of the score operand of a binary op (the tensor operand that is not ``other``)."""
    for a in node.all_input_nodes:
        if a is not other and shape(a) is not None and len(shape(a)) == len(shape(node)):
            return shape(a)
    return shape(node)


def check_factor_labels(sc: Score, leaf: Leaf, node: fx.Node) -> None:
    if sc.key in leaf.labels:
        raise Reject("the score is multiplied by a factor that varies with the key position", node)


def scalar(x) -> float | None:
    """A constant number: a Python number, or a 0-d ``torch.tensor(number, dtype=...)`` built in the graph, as that
    tensor holds it (``torch.tensor(2.5, dtype=torch.int64)`` is 2, ``torch.tensor(0.3, dtype=torch.bfloat16)``
    0.30078125, ``torch.tensor(1e39)`` inf in float32)."""
    if isinstance(x, fx.Node) and op_name(x) == "tensor" and len(x.args) == 1 and shape(x) == ():
        if written_in_place(x) or x.kwargs.get("requires_grad"):
            return None
        x = held(x.args[0], x.kwargs.get("dtype"))
    if isinstance(x, bool):
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    return None


def score_and_other(node: fx.Node, s_dim: int) -> tuple[Score, object]:
    """For a binary op, interpret the operand that carries the score; return it with the other operand."""
    a, b = node.args[0], node.args[1] if len(node.args) > 1 else named_arg(node, "other")
    out = shape(node)
    candidates = [x for x in (a, b) if isinstance(x, fx.Node) and is_tensor(x)]
    # the score has the full output shape; a broadcasting factor does not
    candidates.sort(key=lambda x: shape(x) != out)
    last: Reject | None = None
    for cand in candidates:
        if shape(cand) is None or len(shape(cand)) != len(out):
            continue
        try:
            sc = interpret(cand, s_dim)
        except Reject as err:
            last = last or err  # the full-shape operand's reason is the one a user needs
            continue
        return sc, (b if cand is a else a)
    raise last or Reject(f"`{node.target}` does not combine the score with a constant or a factor", node)


def narrow(sc: Score, node: fx.Node) -> Score:
    """Arithmetic on the score: not after a float64 upcast, where the model computes more precisely than the op
    (a fill or bias that float32 cannot hold, a head sum in float64)."""
    if sc.wide:
        raise Reject("the score is cast to float64 and then masked, scaled or summed; the selection computes "
                     "in float32, less precisely than the model", node)
    return sc


def positive_scale(sc: Score, node: fx.Node) -> float:
    """The single scale of the canonical form, after checking that folding it is legal."""
    if sc.relu and sc.pre_scale <= 0:
        raise Reject(f"the scale before relu ({sc.pre_scale}) is not positive", node)
    if not any(w.labels or is_tensor(w.node) for w in sc.weights) and sc.weights:
        raise Reject("the score is scaled by a symbolic number and has no head weights to fold it into", node)
    if sc.post_scale < 0 and not sc.weights:
        raise Reject(f"the score is multiplied by {sc.post_scale}, so selection would pick the smallest scores",
                     node)
    scale = sc.pre_scale * abs(sc.post_scale)
    if not math.isfinite(scale) or scale == 0:
        raise Reject(f"the scale {scale} is not a finite positive number", node)
    return scale
