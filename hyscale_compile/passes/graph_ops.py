"""One name per operation, whatever spelling the Dynamo graph used (function, method, operator).

Dynamo graphs keep the user's spelling: ``torch.relu(x)``, ``F.relu(x)`` and ``x.relu()`` are three
different targets. The passes ask ``op_name(node)`` and read arguments with ``arg(node, i, name)``.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

_FUNCTIONS: dict[Any, str] = {
    torch.einsum: "einsum",
    torch.functional.einsum: "einsum",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.bmm: "matmul",
    torch.relu: "relu",
    torch.clamp: "clamp",
    torch.clamp_min: "clamp",
    torch.clip: "clamp",
    torch.maximum: "maximum",
    F.relu: "relu",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.add: "add",
    torch.add: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    operator.neg: "neg",
    torch.neg: "neg",
    torch.sum: "sum",
    torch.mean: "mean",
    torch.masked_fill: "masked_fill",
    torch.where: "where",
    torch.topk: "topk",
    torch.sort: "sort",
    torch.argsort: "argsort",
    torch.gather: "gather",
    torch.take_along_dim: "take_along_dim",
    torch.detach: "detach",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.unsqueeze: "unsqueeze",
    torch.squeeze: "squeeze",
    torch.reshape: "reshape",
    torch.flatten: "reshape",
    torch.unflatten: "reshape",
    operator.getitem: "getitem",
    operator.invert: "invert",
    torch.logical_not: "invert",
    torch.bitwise_not: "invert",
    operator.and_: "and",
    torch.logical_and: "and",
    torch.bitwise_and: "and",
    operator.or_: "or",
    torch.logical_or: "or",
    operator.le: "le",
    operator.lt: "lt",
    operator.ge: "ge",
    operator.gt: "gt",
    torch.le: "le",
    torch.lt: "lt",
    torch.ge: "ge",
    torch.gt: "gt",
    operator.eq: "eq",
    operator.ne: "ne",
    torch.eq: "eq",
    torch.ne: "ne",
    torch.arange: "arange",
    torch.full: "full",
    torch.ones: "ones",
    torch.zeros: "zeros",
    torch.full_like: "full_like",
    torch.ones_like: "ones_like",
    torch.zeros_like: "zeros_like",
    torch.empty_like: "empty_like",
    torch.scatter: "scatter",
    torch.tensor: "tensor",
    torch.triu: "triu",
    torch.tril: "tril",
    # the attention pass's vocabulary
    torch.softmax: "softmax",
    F.softmax: "softmax",
    F.dropout: "dropout",
    torch.dropout: "dropout",  # (input, p, train): the same positions as F.dropout's
    F.scaled_dot_product_attention: "sdpa",
    F.linear: "linear",
    torch.cat: "cat",
    torch.concat: "cat",
    torch.split: "split",
    torch.functional.split: "split",
    torch.bitwise_or: "or",
    torch.empty: "empty",
}

_METHODS: dict[str, str] = {
    "matmul": "matmul", "bmm": "matmul", "relu": "relu", "clamp": "clamp", "clamp_min": "clamp", "clip": "clamp",
    "maximum": "maximum",
    "mul": "mul", "div": "div", "add": "add", "sub": "sub", "neg": "neg", "sum": "sum", "mean": "mean",
    "masked_fill": "masked_fill", "topk": "topk", "sort": "sort", "argsort": "argsort", "gather": "gather",
    "take_along_dim": "take_along_dim", "transpose": "transpose", "permute": "permute", "unsqueeze": "unsqueeze",
    "squeeze": "squeeze", "expand": "expand", "view": "reshape", "reshape": "reshape",
    "flatten": "reshape", "unflatten": "reshape", "float": "float", "to": "to",
    "type": "to", "long": "to", "int": "to", "half": "to", "bfloat16": "to", "double": "to", "bool": "to",
    "type_as": "to",
    "contiguous": "identity", "clone": "identity", "detach": "detach",
    "logical_not": "invert", "bitwise_not": "invert", "__invert__": "invert", "scatter": "scatter",
    "scatter_": "scatter", "scatter_add": "scatter", "scatter_add_": "scatter", "logical_and": "and",
    "bitwise_and": "and", "__and__": "and", "logical_or": "or", "le": "le", "lt": "lt", "ge": "ge", "gt": "gt",
    "eq": "eq", "ne": "ne",
    "triu": "triu", "tril": "tril", "new_full": "new_full", "new_ones": "new_ones", "new_zeros": "new_zeros",
    "new_empty": "new_empty", "softmax": "softmax", "split": "split", "copy_": "copy_", "__or__": "or",
    "bitwise_or": "or",
}

# Arguments by position and name, per canonical op (enough for the forms the passes accept).
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "sum": ("input", "dim", "keepdim"),
    "mean": ("input", "dim", "keepdim"),
    "argsort": ("input", "dim", "descending"),
    "topk": ("input", "k", "dim", "largest", "sorted"),
    "sort": ("input", "dim", "descending"),
    "masked_fill": ("input", "mask", "value"),
    "where": ("condition", "input", "other"),
    "gather": ("input", "dim", "index"),
    "take_along_dim": ("input", "indices", "dim"),
    "transpose": ("input", "dim0", "dim1"),
    "unsqueeze": ("input", "dim"),
    "squeeze": ("input", "dim"),
    "mul": ("input", "other"),
    "div": ("input", "other"),
    "add": ("input", "other", "alpha"),
    "sub": ("input", "other", "alpha"),
    "triu": ("input", "diagonal"),
    "tril": ("input", "diagonal"),
    "full": ("size", "fill_value"),
    "full_like": ("input", "fill_value"),
    "new_full": ("input", "size", "fill_value"),
}


def op_name(node: Any) -> str | None:
    """Canonical name of what ``node`` computes, or None for placeholders, attributes and unknown calls."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        name = _METHODS.get(node.target)
    else:
        return None
    if name == "reshape" and _bitcast(node):
        return None  # x.view(dtype) reinterprets the bits: no reshape
    return name


def _bitcast(node: fx.Node) -> bool:
    """``x.view(torch.int32)``: a view given a dtype, not a shape."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def named_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call with a signature in the table above."""
    sig = _SIGNATURES[op_name(node)]
    return arg(node, sig.index(name), name, default)


def value(node: Any) -> Any:
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...), or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def grad_enabled_at(node: fx.Node) -> bool:
    """Whether grad mode is on where ``node`` runs. Dynamo records ``torch.no_grad()`` / ``set_grad_enabled``
    regions as ``_set_grad_enabled`` calls in the graph, in program order, from the mode it traced under (which
    it guards on, and which the backend runs in). The example values do not always follow them: a view taken
    under no_grad of a tensor that requires grad is recorded as requiring grad, where eager gives one that does
    not. Computed for the whole graph at once and kept in each node's meta; a node a pass inserted later counts
    as the mode around it."""
    mode = node.meta.get(_GRAD_MODE)
    if mode is not None:
        return mode
    mode = torch.is_grad_enabled()
    for n in node.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") in _GRAD_MODE_SETTERS and n.args:
            mode = bool(n.args[0])
        n.meta[_GRAD_MODE] = mode
    return node.meta.get(_GRAD_MODE, torch.is_grad_enabled())


_GRAD_MODE = "hyscale_grad_mode"
_GRAD_MODE_SETTERS = ("_set_grad_enabled", "set_grad_enabled")  # torch._C's, as Dynamo records it; torch's


def requires_grad(node) -> bool:
    """Whether eager's tensor at ``node`` requires grad: its example value says so and it is not made in a
    no_grad region (graph inputs keep their flag whatever the mode)."""
    v = value(node)
    if not (isinstance(v, torch.Tensor) and v.requires_grad):
        return False
    return node.op != "call_function" and node.op != "call_method" or grad_enabled_at(node)


def infer_value(node: Any, depth: int = 0) -> Any:
    """The example value of a node, also of one a pass inserted without recording it (the selection's outputs
    and the views that put them in the model's layout): computed from its inputs' values on the graph's fake
    tensors, or None where that is not possible. Nothing is recorded on the node."""
    v = value(node)
    if v is not None or not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or \
            depth > 16:
        return v
    missing = []

    def val(a):
        out = infer_value(a, depth + 1)
        if out is None:
            missing.append(a)
        return out

    args, kwargs = fx.node.map_arg(node.args, val), fx.node.map_arg(node.kwargs, val)
    if missing:
        return None
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    modes = {id(x.fake_mode): x.fake_mode for x in tree_leaves((args, kwargs)) if isinstance(x, FakeTensor)}
    if len(modes) != 1:  # no fake tensor (or several modes): nothing to run the op on
        return None
    (mode,) = modes.values()
    try:
        with mode:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            return getattr(args[0], node.target)(*args[1:], **kwargs)
    except Exception:  # an op the fake tensors cannot run: the value stays unknown
        return None


def record_values(nodes) -> None:
    """Record the example value of each node a pass inserted (in graph order), as Dynamo records its own: a later
    site of the same graph reads its operands' shapes, dtypes and requires_grad from them (a second attention whose
    q is the first one's rewritten output). Computed on the graph's fake tensors in the grad mode where the node
    runs; a node whose value cannot be computed is left without one."""
    for n in nodes:
        if value(n) is not None:
            continue
        with torch.set_grad_enabled(grad_enabled_at(n)):
            v = infer_value(n)
        if v is not None:
            n.meta["example_value"] = v


def shape(node: Any) -> tuple | None:
    v = value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_tensor(node: Any) -> bool:
    return isinstance(value(node), torch.Tensor)


def source_line(node: fx.Node) -> str:
    """The user's file:line that produced ``node`` (last frame of Dynamo's stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return "<unknown>"
    last = lines[-1]  # 'File "x.py", line 12, in forward'
    try:
        file_part, line_part, func_part = (p.strip() for p in last.split(",", 2))
        return f"{file_part[6:-1]}:{line_part.split()[1]} ({func_part[3:]})"
    except (ValueError, IndexError):
        return last


def is_one(size: Any) -> bool:
    """True when a dimension is statically known to be 1 (symbolic sizes are assumed not to be)."""
    if isinstance(size, int):
        return size == 1
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(size == 1))


def same_size(a: Any, b: Any) -> bool:
    """Two dimension sizes known to be equal (symbolic sizes: only when provably so)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return a is b or bool(statically_known_true(a == b))


_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.ilshift, operator.irshift, operator.imatmul)  # and_, or_, not_ ... are not in-place
_INPLACE_DUNDERS = {f"__{getattr(f, '__name__', '').strip('_')}__" for f in _INPLACE_OPERATORS} | {"__setitem__"}


def mutates(n: fx.Node) -> bool:
    """Conservatively: could this call write into an existing tensor? (``x.mul_``, ``x *= 2``, ``x.__imul__``,
    ``x[i] = v``, ``torch._foreach_mul_``, ``out=``, ``inplace=True``, a module call, a mutable op overload.)"""
    if n.op not in ("call_function", "call_method", "call_module"):
        return False
    if n.op == "call_module" or n.kwargs.get("out") is not None or n.kwargs.get("inplace"):
        return True
    if _written_by_flag(n):
        return True
    if n.op == "call_function" and n.target in _INPLACE_OPERATORS:
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return False
    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
        return _region_writes(n) != []
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if not isinstance(name, str):
        return False
    if name.startswith("__") and name.endswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_") and name != "requires_grad_"  # x.mul_, torch.relu_, torch._foreach_mul_


# Functions that write by a flag, which may come by position: ``nn.LeakyReLU``, ``nn.Hardtanh``, ``nn.ELU``,
# ``nn.Dropout`` ... call ``F.leaky_relu(x, slope, self.inplace)``, and Dynamo keeps the call as written. Batch and
# instance norm write their running statistics (the flag: training, use_input_stats; its default).
_RUNNING_STATS = {F.batch_norm: ("training", False), F.instance_norm: ("use_input_stats", True)}


def _written_by_flag(n: fx.Node) -> list[fx.Node]:
    """The tensors a function call writes because of a flag set by position or keyword (``F.relu(x, True)``,
    ``F.batch_norm(x, mean, var, training=True)``); [] if none. A flag that is not a constant counts as set."""
    if n.op != "call_function":
        return []
    sig = _signature(n.target)
    stats = _RUNNING_STATS.get(n.target)
    if sig is None or stats is None and "inplace" not in sig.parameters:
        return []
    try:
        bound = sig.bind(*n.args, **n.kwargs).arguments
    except TypeError:
        return []
    flag, default = stats or ("inplace", False)
    if bound.get(flag, default) in (False, 0, None):
        return []
    written = [bound.get("running_mean"), bound.get("running_var")] if stats else [next(iter(bound.values()))]
    return [x for x in written if isinstance(x, fx.Node)]


@functools.cache
def _signature(target) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without one
        return None


# Ops whose result may share storage with their first argument: a write into one is a write into the other.
_ALIASING = {"transpose", "permute", "unsqueeze", "squeeze", "reshape", "getitem", "expand", "detach", "identity",
             "float", "to"}


def written_by(n: fx.Node) -> list[fx.Node] | None:
    """The tensors a call that ``mutates`` writes in place: ``out=``, the first argument (``x.mul_``, ``x[i] = v``,
    ``x += 1``, ``relu(x, inplace=True)``), every tensor of a first-argument list (``torch._foreach_mul_([x, y],
    c)``), every tensor argument of a mutable op overload; None when it could write anything (a module call)."""
    if n.op == "call_module":
        return None
    out = n.kwargs.get("out")
    if out is not None:
        return [x for x in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(x, fx.Node)]
    flagged = _written_by_flag(n)
    if flagged:
        return flagged
    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
        return _region_writes(n)
    if isinstance(n.target, torch._ops.OpOverload):
        return list(n.all_input_nodes)
    first = n.args[0] if n.args else next(iter(n.kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        return [x for x in first if isinstance(x, fx.Node)]
    return [first] if isinstance(first, fx.Node) else None


def _region_writes(n: fx.Node) -> list[fx.Node]:
    """The operands a higher-order op's call (a checkpointed region, ``wrap``, ``invoke_subgraph`` ...) may write
    in place: Dynamo keeps a write of a region's input inside its body (``i[..., 0] = j`` on an operand of
    ``checkpoint(fn, i, ...)``), so the call writes the caller's tensor. [] where no body writes any of its inputs
    (or a tensor of the graph that could be one, ``Aliases``); every operand where one may, or where a body is
    not found."""
    bodies = {x: attr_of(x) for x in n.all_input_nodes if x.op == "get_attr"}
    bodies = {x: b for x, b in bodies.items() if isinstance(b, fx.GraphModule)}
    operands = [x for x in n.all_input_nodes if x not in bodies]
    if not bodies:
        return operands
    for body in bodies.values():
        inputs = [p for p in body.graph.nodes if p.op in ("placeholder", "get_attr")]
        if first_write(body.graph, inputs) is not None:
            return operands
    return []


def first_write(graph: fx.Graph, tensors: list[fx.Node]) -> fx.Node | None:
    """The first call of ``graph`` that may write in place one of ``tensors`` or a tensor sharing its memory
    (``Aliases``), or None."""
    aliases = Aliases(graph)
    for n in graph.nodes:
        if mutates(n):
            targets = written_by(n)
            if targets is None or any(aliases.may_alias(t, x) for t in targets for x in tensors):
                return n
    return None


def attr_of(getter: fx.Node):
    """What a ``get_attr`` node reads from its graph's module (a subgraph module, a buffer), or None."""
    mod = getter.graph.owning_module
    for part in str(getter.target).split("."):
        mod = getattr(mod, part, None)
    return mod


def written_in_place(node: fx.Node) -> bool:
    """Is ``node``'s tensor (or a view of it) written in place anywhere in the graph? Then reading its value
    from its producer (an ``arange``, a ``triu`` of ``ones``, a constant) would miss the write."""
    todo, seen = [node], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        for u in x.users:
            if mutates(u):
                targets = written_by(u)
                if targets is None or x in targets:
                    return True
            if op_name(u) in _ALIASING and u.args[:1] == (x,):
                todo.append(u)
    return False


def view_base(node):
    """The tensor ``node`` may share memory with, through the views and casts (that can return their input) the
    passes know by name."""
    while isinstance(node, fx.Node) and op_name(node) in _ALIASING and node.args and isinstance(node.args[0], fx.Node):
        if op_name(node) == "getitem" and not _basic_index(node.args[1]):
            break
        node = node.args[0]
    return node


def _basic_index(idx) -> bool:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in idx)


def _storage(node):
    """The storage of a node's example value (views share their base's: Dynamo computes them on fake tensors), or
    None where the graph recorded no tensor."""
    v = value(node) if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(v.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class Aliases:
    """Which tensors of a graph may share memory: those whose example values share a storage (any view, by any
    spelling, and casts or ``contiguous()`` that return their input), and any two that live in the graph's
    inputs or attributes (the caller may pass views of one tensor). Nodes a pass inserted have no example value:
    they are compared by the views the passes know by name."""

    def __init__(self, graph: fx.Graph):
        self._inputs = {s for n in graph.nodes if n.op in ("placeholder", "get_attr")
                        for s in (_storage(n),) if s is not None}

    def _from_input(self, node) -> bool:
        s = _storage(node)
        if s is not None:
            return s in self._inputs
        base = view_base(node)
        return isinstance(base, fx.Node) and base.op in ("placeholder", "get_attr")

    def may_alias(self, a, b) -> bool:
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return False
        if a is b:
            return True
        sa, sb = _storage(a), _storage(b)
        if sa is not None and sb is not None and sa == sb:
            return True
        if (sa is None or sb is None) and view_base(a) is view_base(b):
            return True
        return self._from_input(a) and self._from_input(b)


def writes_after(node: fx.Node, caller: bool = False) -> list[fx.Node] | None:
    """The tensors that calls after ``node`` in its graph may write in place (through ``written_by``); None when
    one of them could write anything (a module call). ``caller``: also the graph's inputs and outputs, which the
    caller may write after the call (before its backward)."""
    found, after = [], False
    for n in node.graph.nodes:
        if n is node:
            after = True
        elif caller and (n.op == "placeholder" or n.op == "output"):
            found.extend(n.all_input_nodes if n.op == "output" else [n])
        elif after and mutates(n):
            targets = written_by(n)
            if targets is None:
                return None
            found.extend(targets)
    return found


def writes_before_backward(node: fx.Node, backward: bool) -> tuple[list[fx.Node] | None, list[fx.Node] | None]:
    """(``writes_after(node)``, ``writes_after(node, caller=True)``): what ``own_copies`` guards an op at ``node``
    against; nothing where no backward is built (an op keeps its inputs only for one)."""
    return (writes_after(node), writes_after(node, caller=True)) if backward else ([], [])


def own_copies(graph: fx.Graph, op: fx.Node, positions: tuple[int, ...], written: list[fx.Node] | None) -> None:
    """Give the op call ``op`` a copy of each tensor argument at ``positions`` (args, then kwargs by name) that may
    share memory with a tensor in ``written`` (``writes_after``; None: any tensor).

    An op whose autograd formula keeps its inputs for the backward keeps them by reference, as autograd does: a later
    in-place write of one (the model's ``idx.add_(1)`` for its next layer, a mask or offset it updates) makes the
    backward fail ("modified by an inplace operation") where the model's own computation, which kept no such
    tensor, runs. A copy made where the op reads it is what the op must keep: ``hyscale.saved_copy``, which the
    min-cut partitioner does not recompute in the backward from the written input, as it would a clone
    (lowering/saved_copy.py)."""
    if written is not None and not written:  # nothing is written later: nothing to copy
        return
    aliases = Aliases(graph)
    for pos in positions:
        a = op.args[pos] if isinstance(pos, int) else op.kwargs.get(pos)
        if not isinstance(a, fx.Node) or not (written is None or any(
                aliases.may_alias(t, x) for t in written for x in (a, view_base(a)))):
            continue
        with graph.inserting_before(op):
            copy = graph.call_function(torch.ops.hyscale.saved_copy.default, (a,))
        if isinstance(pos, int):
            op.args = (*op.args[:pos], copy, *op.args[pos + 1:])
        else:
            op.kwargs = {**op.kwargs, pos: copy}


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# Ops that read only a tensor's shape, dtype or device: the score may be their input without being written.
METADATA_READERS = ("full_like", "zeros_like", "ones_like", "empty_like", "new_full", "new_ones", "new_zeros",
                    "new_empty")


def reads_metadata_only(node: fx.Node, of: fx.Node) -> bool:
    """``node`` reads only the shape, dtype and device of ``of`` (its first argument, and nowhere else)."""
    if op_name(node) not in METADATA_READERS or not node.args or node.args[0] is not of:
        return False
    return of not in node.args[1:] and of not in node.kwargs.values()


def depends_on(node, nodes: set[fx.Node]) -> bool:
    """Does ``node``'s value depend on one of ``nodes``? (A ``full_like(score, ...)`` reads its shape only.)"""
    if not isinstance(node, fx.Node):
        return False
    todo, seen = [node], set()
    while todo:
        x = todo.pop()
        if x in nodes:
            return True
        if x not in seen:
            seen.add(x)
            shape_only = x.args[0] if x.args and reads_metadata_only(x, x.args[0]) else None
            todo.extend(a for a in x.all_input_nodes if a is not shape_only)
    return False


def held(number, dt: torch.dtype | None):
    """The value a constant tensor of dtype ``dt`` filled with ``number`` holds, as torch builds it
    (``torch.tensor(2.5, dtype=torch.int64)`` holds 2, ``torch.tensor(1e39)`` inf; None where torch builds none)."""
    if not isinstance(number, numbers.Real):
        return None
    try:
        return torch.tensor(number, dtype=dt).item()
    except (TypeError, RuntimeError, OverflowError):
        return None
