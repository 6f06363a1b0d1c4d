"""Elementwise steps of the index expression: constant scales and tensor factors, additive terms (biases and
additive masks), masked fills (``masked_fill``, ``where``), the activation (ReLU and its spellings) and casts.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import fx

from .expr import (
    HANDLERS,
    Leaf,
    Reject,
    Score,
    align,
    interpret,
    narrow,
    scalar,
    score_and_other,
)
from .graph_ops import (
    dtype,
    is_tensor,
    named_arg,
    op_name,
    requires_grad,
    shape,
    value,
)


def scaled(sc: Score, node: fx.Node, c: float) -> Score:
    """Multiply the score by the constant ``c`` (before or after the activation, as it stands)."""
    narrow(sc, node)
    if sc.masked:
        # c * fill must stay the fill and the biases would need scaling too: only a positive c on a score
        # whose masked entries are infinite and that has no additive mask is still the same selection
        if c <= 0 or sc.bias or (sc.fill is not None and abs(sc.fill) != float("inf")):
            raise Reject("the score is scaled after a mask, which changes the masked values", node)
        return sc.with_node(node, post_scale=sc.post_scale * c)
    if sc.relu or sc.head is not None:
        return sc.with_node(node, post_scale=sc.post_scale * c)
    return sc.with_node(node, pre_scale=sc.pre_scale * c)


def _multiply(node: fx.Node, s_dim: int, divide: bool = False) -> Score:
    if divide and node.kwargs.get("rounding_mode") is not None:
        raise Reject(f"the score is divided with rounding_mode={node.kwargs['rounding_mode']!r}, which rounds the "
                     "quotient: no scale", node)
    sc, other = score_and_other(node, s_dim)
    narrow(sc, node)
    if divide and other is node.args[0]:
        raise Reject("the score divides something instead of being divided", node)
    c = scalar(other)
    if c is not None:
        if divide:
            if c == 0:
                raise Reject("the score is divided by zero", node)
            c = 1.0 / c
        return scaled(sc, node, c)
    if isinstance(other, fx.Node) and isinstance(value(other), (torch.SymFloat, torch.SymInt)) and not divide:
        if sc.masked:
            raise Reject("the score is scaled by a symbolic number after a mask", node)
        # a symbolic number (e.g. a float attribute under dynamic=True): its sign is unknown, so it is
        # folded into q before the activation or into the weights after it, never into the scale
        leaf = Leaf(other, (), at=node)
        if sc.relu or sc.head is not None:
            return sc.with_node(node, weights=sc.weights + (leaf,))
        return sc.with_node(node, pre=sc.pre + (leaf,))
    if divide or not is_tensor(other):
        raise Reject("the score is scaled by a value that is not a constant number", node)
    if sc.masked:
        what = "a tensor was added to it" if sc.bias and not (sc.keep or sc.fill is not None) else "a mask"
        raise Reject(f"the score is multiplied by a tensor after {what}, so the added or masked values would be "
                     "scaled too, which the indexer form does not do", node)
    leaf = align(sc, node, other)
    before_act = not (sc.relu or sc.head is not None)
    if sc.key in leaf.labels:
        # act(f_s * q.k_s) == act(q.(f_s k_s)): a per-key factor before the activation folds into the keys
        if before_act and set(leaf.labels) <= {sc.key, None, *sc.batch}:  # k's own batch dims only
            return sc.with_node(node, key_pre=sc.key_pre + (leaf,))
        raise Reject("the score is multiplied by a factor that varies with the key position after the "
                     "activation or with the query too", node)
    if not before_act:
        return sc.with_node(node, weights=sc.weights + (leaf,))
    return sc.with_node(node, pre=sc.pre + (leaf,))


SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _add(node: fx.Node, s_dim: int, subtract: bool = False) -> Score:
    """score + x / score - x with a tensor x (an additive mask or bias): x becomes an additive term."""
    if named_arg(node, "alpha", 1) != 1:
        raise Reject(f"{'sub' if subtract else 'add'} with alpha != 1 is not supported on the score", node)
    sc, other = score_and_other(node, s_dim)
    narrow(sc, node)
    if subtract and other is node.args[0]:
        raise Reject("the score is subtracted from something (a negated score), which is not the indexer form", node)
    if not is_tensor(other):
        raise Reject("a constant is added to the score (only mask or bias tensors are supported)", node)
    if dtype(node) not in SCORE_DTYPES:
        raise Reject(f"adding this tensor makes the score {dtype(node)}; the selection computes in float32, less "
                     "precisely than the model", node)
    leaf = align(sc, node, other)
    if dtype(other) is not None and not dtype(other).is_floating_point:  # the add converts an int or bool tensor
        leaf = replace(leaf, cast=dtype(node))
    if subtract:
        leaf = replace(leaf, negate=True)
    if sc.fill is not None and sc.fill != float("-inf"):
        raise Reject("an additive mask follows a masked fill with a finite value", node)
    return sc.with_node(node, bias=sc.bias + (leaf,), filled_before_bias=sc.filled_before_bias or sc.fill is not None)


def _fill(sc: Score, node: fx.Node, value) -> Score:
    narrow(sc, node)
    v = scalar(value)
    if v is None:
        raise Reject("the masked fill value is not a constant number", node)
    dt = dtype(node)
    if dt is not None and dt.is_floating_point and math.isfinite(v) and abs(v) > torch.finfo(dt).max:
        v = _overflowing_fill(node, value, v, dt)
    if sc.fill is not None and not _same_float(sc.fill, v):
        raise Reject(f"two different fill values ({sc.fill} and {v}) are used on the score", node)
    return sc.with_node(node, fill=v)


def _overflowing_fill(node: fx.Node, value, v: float, dt: torch.dtype) -> float:
    """A fill past ``dt``'s largest value as eager's masked_fill / where writes it into the score: torch rounds some
    to that largest value (where, bfloat16), others to inf, and raises for others (masked_fill, and where given a
    number float32 cannot hold), each op and operand kind its own way, so it is asked."""
    fill = torch.tensor(v, dtype=dtype(value)) if isinstance(value, fx.Node) else value
    score, hidden = torch.zeros(1, dtype=dt), torch.ones(1, dtype=torch.bool)
    try:
        out = score.masked_fill(hidden, fill) if op_name(node) == "masked_fill" else torch.where(hidden, fill, score)
    except (RuntimeError, OverflowError):
        raise Reject(f"the fill value {v} overflows {dt} (eager raises an error here)", node) from None
    return out.item()


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _masked_fill(node: fx.Node, s_dim: int) -> Score:
    sc = interpret(node.args[0], s_dim)
    cond = named_arg(node, "mask")
    leaf = align(sc, node, cond)
    filled = _fill(sc, node, named_arg(node, "value"))
    return replace(filled, keep=sc.keep + (replace(leaf, negate=True),))


def _where(node: fx.Node, s_dim: int) -> Score:
    cond, a, b = named_arg(node, "condition"), named_arg(node, "input"), named_arg(node, "other")
    if isinstance(a, fx.Node) and is_tensor(a) and shape(a) and scalar(b) is not None:
        sc, negate, value = interpret(a, s_dim), False, b
    elif isinstance(b, fx.Node) and is_tensor(b) and shape(b) and scalar(a) is not None:
        sc, negate, value = interpret(b, s_dim), True, a
    else:
        raise Reject("torch.where on the score must choose between the score and a constant", node)
    leaf = replace(align(sc, node, cond), negate=negate)
    filled = _fill(sc, node, value)
    return replace(filled, keep=sc.keep + (leaf,))


# ---------------------------------------------------------------------------------------------
# views, casts, activation, head sum
def _relu(node: fx.Node, s_dim: int) -> Score:
    spelled_otherwise = op_name(node) in ("clamp", "maximum")  # clamp_min is "clamp"
    if spelled_otherwise and not _is_relu_clamp(node):
        raise Reject("the score is clamped to a range other than [0, inf)", node)
    src = node.args[0] if node.args else node.kwargs["input"]
    sc = narrow(interpret(src, s_dim), node)
    if sc.relu and not (sc.weights or sc.head is not None or sc.bias or sc.keep) and sc.post_scale > 0:
        return sc.with_node(node)  # relu(c * relu(x)) == c * relu(x) for c > 0
    if sc.relu or sc.head is not None or sc.bias or sc.keep:
        raise Reject("relu is applied after the head sum or a mask, which is not the indexer form", node)
    if spelled_otherwise and requires_grad(src):
        # the same values as relu, NaN included, but another gradient at exactly 0 (clamp passes it, maximum
        # halves it; relu and the op's backward pass none), and exact zeros are common: a zeroed weight or q row
        raise Reject(f"the ReLU is spelled {op_name(node)}, whose gradient at exactly 0 is not relu's (the op's): "
                     "write torch.relu to have the site rewritten in training", node)
    return sc.with_node(node, relu=True)


def _is_relu_clamp(node: fx.Node) -> bool:
    """clamp(min=0) / clamp_min(0) / clamp(0, inf) / maximum(x, 0-d zero): ReLU spelled otherwise (all keep NaN)."""
    if op_name(node) == "maximum":
        other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        return scalar(other) == 0.0 and shape(other) == ()
    if node.target in ("clamp_min", torch.clamp_min):
        low, high = node.args[1] if len(node.args) > 1 else node.kwargs.get("min"), None
    else:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    return scalar(low) == 0.0 and (high is None or scalar(high) == math.inf)


_UPCAST_OK = (torch.float32, torch.float64)


def _cast(node: fx.Node, s_dim: int) -> Score:
    src = node.args[0]
    if dtype(node) not in _UPCAST_OK and dtype(node) != dtype(src):
        raise Reject(f"the score is cast to {dtype(node)} before selection; selection would be less precise "
                     "than the model's own", node)
    if shape(node) != shape(src):
        raise Reject("a cast changed the score's shape", node)
    sc = interpret(src, s_dim)
    return sc.with_node(node, wide=sc.wide or dtype(node) == torch.float64)


HANDLERS.update({
    "relu": _relu,
    "clamp": _relu,
    "maximum": _relu,
    "mul": _multiply,
    "div": lambda n, s: _multiply(n, s, divide=True),
    "neg": lambda n, s: scaled(interpret(n.args[0], s), n, -1.0),
    "add": _add,
    "sub": lambda n, s: _add(n, s, subtract=True),
    "masked_fill": _masked_fill,
    "where": _where,
    "float": _cast,
    "to": _cast,
})
