"""Review round 18: the arguments of every op the passes read under a canonical name (the class round 17 found:
an op read without all of its arguments), and the dtype of the constants and intermediates they read.

Found and fixed:

* (attention_sites.constant_fill, read by parse_logits) the attention logits' scale given as a 0-d
  ``torch.tensor(c, dtype=...)`` was read as the Python number c, whatever the dtype: ``q @ k^T *
  torch.tensor(2.5, dtype=torch.int64)`` (eager: * 2), ``/ torch.tensor(2.9, dtype=torch.int32)`` (eager: / 2),
  ``/ torch.tensor(3.11, dtype=torch.bfloat16)`` (eager: / 3.109375). The eager attention was rewritten with the
  wrong softmax scale: outputs up to 0.35 apart. Round 17 had fixed ``expr.scalar`` (the selection) and the mask
  evaluation, not this path. Constant tensors are now read as they hold the number (``graph_ops.held``), a 0-d
  ``torch.tensor`` written in place or made to require grad is no constant.
* (expr_terms._fill) ``torch.where(visible, score, c)`` with |c| past the score dtype's largest value was taken as
  the infinite fill. In bfloat16 a c within half an ulp of the largest value rounds to a finite fill (``-3.39e38``
  is -3.3895e38 in eager, the op's masked picks were -inf); in float32 eager's ``where`` raises ("value cannot be
  converted to type float without overflow") for any |c| past it (``-1e39``, and ``-3.4028235e38``, FLT_MAX as
  commonly written), where the rewritten site ran. Such a fill is now what torch makes of it, asked of the same op
  on the same kind of operand (its value, or the site left alone where eager raises).
* (graph_ops.op_name) ``score.view(torch.int32)`` (a bitcast) was read as a reshape, its dtype argument not at
  all, and taken as the score itself: the op ranked the floats, eager the int32 bit patterns (other values and
  indices). A view given a dtype is now no op any pass reads (the selection, positions and masks alike; an
  attention mask bitcast to uint8 and compared is left alone, with eager's values).
* (sites._is_gather_at) ``score.gather(-1, idx, sparse_grad=True)`` was read as a gather at the picks: eager's
  backward raises ("expand is unsupported for Sparse tensors"), the rewritten site returned gradients. A gather
  with sparse_grad=True is no gather at the picks now.

Checked and right (each a test below): factors and scales in float64 (weights, a [1] buffer, a divisor) and a
mean in float64 (left alone); squeeze with a tuple of dims; a top-k over a transposed score along dim=1; a sort with
stable=False; positions built from a float16 arange past 2048 (passed as a tensor, exact); int32 aranges; a
clamp / maximum ReLU with 0-d typed tensor bounds; a masked_fill / where fill given as a 0-d float64 tensor; SDPA with scale= and enable_gqa=; torch.softmax with float32
by position; dropout(p=0) in training. Arguments read right besides (code read, no test): topk's k / dim /
largest / sorted by position and keyword; sort / argsort descending by position; sum / mean dim, keepdim, dtype;
add / sub alpha; div rounding_mode; transpose / permute / unsqueeze dims; einsum with a list of operands (the
sublist format is refused); scatter's reduce (keyword-only in torch) and scatter_add; arange's start / step /
dtype; triu / tril diagonal; full / new_full fill_value positions; SDPA dropout_p / is_causal; F.dropout's
training and inplace. Tiny sizes: seconds on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled
from test_red_team_round14 import DI, NEG, B, D, H, S, T, _causal, _inputs, _picked, _picks, _score

from hyscale_compile.passes import report

K = 4
MIN = torch.finfo(torch.float32).min
ALL = (0, 1, 2, 3, 4, 5)


def _rewritten(fn, args) -> dict[str, bool]:
    """Whether each kind of site ("selection", "attention") of ``fn`` was rewritten."""
    torch._dynamo.reset()
    with report.collect() as reports:
        torch.compile(fn, backend="hyscale")(*args)
    return {kind: any(r.kind == kind and r.decision == "rewritten" for r in reports)
            for kind in ("selection", "attention")}


def _same_as_eager(fn, args, grad=(0, 1, 2), kind="selection") -> bool:
    """Whatever the passes decide, the compiled model computes what eager does (ties by position where the
    selection is rewritten); returns whether the site of ``kind`` was rewritten."""
    done = _rewritten(fn, args)
    check_compiled(fn, args, grad=grad, ties=done["selection"])
    return done[kind]


def _qkw(seed=3):
    qi, ki, w = _inputs(seed)[:3]
    return qi, ki, w.abs() * 0.05


def _masked(s):
    return s.masked_fill(~_causal(), NEG)


# ---------------------------------------------------------------------------------------------
# Found in review: the attention logits' scale as a typed 0-d tensor


def _keep(qi, ki, w):
    return _picked(_picks(qi, ki, w))[:, None]  # the picks only: every row has K visible keys


def _eager_attention(scaled):
    def model(qi, ki, w, q, k, v):
        return scaled(q @ k.transpose(-1, -2)).masked_fill(~_keep(qi, ki, w), MIN).softmax(-1) @ v

    return model


TYPED_SCALES = {
    "times_int64_tensor": lambda a: a * torch.tensor(2.5, dtype=torch.int64),
    "divided_by_int32_tensor": lambda a: a / torch.tensor(2.9, dtype=torch.int32),
    "divided_by_bf16_tensor": lambda a: a / torch.tensor(D ** 0.5 * 1.1, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(TYPED_SCALES))
def test_found_attention_scale_as_typed_tensor(name):
    _same_as_eager(_eager_attention(TYPED_SCALES[name]), _inputs(3), grad=ALL, kind="attention")


def test_attention_scale_as_float32_tensor_is_right():
    """The control: a 0-d float32 tensor holds the scale (to float32) as eager multiplies by it."""
    model = _eager_attention(lambda a: a * torch.tensor(D ** -0.5))
    assert _same_as_eager(model, _inputs(3), grad=ALL, kind="attention")


# ---------------------------------------------------------------------------------------------
# Found in review: a where() fill past the score dtype's largest value


def _where_fill(c, k=7):
    def model(qi, ki, w):
        return torch.where(_causal(), _score(qi, ki, w), c).topk(k)

    return model


def test_found_where_fill_within_half_an_ulp_of_bf16_max():
    args = tuple(x.bfloat16() for x in _qkw())
    model = _where_fill(-3.39e38)  # bfloat16 holds -3.3895e38; k=7 picks masked keys in the first rows
    want = model(*args).values
    assert torch.isfinite(want.min())
    got = torch.compile(model, backend="hyscale")(*args).values
    assert got.min() == want.min(), (got.min(), want.min())


@pytest.mark.parametrize("c", [-1e39, -3.4028235e38])
def test_found_where_fill_overflowing_float32(c):
    model = _where_fill(c)
    with pytest.raises(RuntimeError, match="overflow"):
        model(*_qkw())
    with pytest.raises(RuntimeError, match="overflow"):
        torch.compile(model, backend="hyscale")(*_qkw())


# ---------------------------------------------------------------------------------------------
# Found in review: a bitcast view and a sparse-gradient gather read as their plain forms


def _bitcast_view(qi, ki, w):
    return _masked(_score(qi, ki, w)).view(torch.int32).topk(K)


def test_found_score_bitcast_to_int32():
    args = _qkw()
    want = _bitcast_view(*args).values  # the values: ties cannot reorder them
    got = torch.compile(_bitcast_view, backend="hyscale")(*args).values
    assert torch.equal(got, want)


def _gather_sparse_grad(qi, ki, w):
    s = _masked(_score(qi, ki, w))
    return s.gather(-1, s.topk(K).indices, sparse_grad=True)


def test_found_gather_with_sparse_grad():
    for fn in (_gather_sparse_grad, torch.compile(_gather_sparse_grad, backend="hyscale")):
        xs = [x.clone().requires_grad_() for x in _qkw()]
        with pytest.raises(RuntimeError, match="Sparse"):
            fn(*xs).sum().backward()


# ---------------------------------------------------------------------------------------------
# Checked and right


def _head_terms(qi, ki, w):
    return torch.einsum("bthd,bsd->bths", qi, ki).relu() * w[..., None]


def _sort_unstable(qi, ki, w):
    v, i = torch.sort(_masked(_score(qi, ki, w)), dim=-1, descending=True, stable=False)
    return v[..., :K], i[..., :K]


def _int32_positions(qi, ki, w):
    m = torch.arange(S, dtype=torch.int32)[None] <= torch.arange(T, dtype=torch.int32)[:, None] + (S - T)
    return _score(qi, ki, w).masked_fill(~m, NEG).topk(K)


SELECTIONS = {  # name: (model, rewritten)
    "weights_float64": (lambda qi, ki, w: _masked(
        (torch.einsum("bthd,bsd->bths", qi, ki).relu() * w.double()[..., None]).sum(2)).topk(K), False),
    "scale_float64_buffer": (lambda qi, ki, w: _masked(
        _score(qi, ki, w) * torch.full((1,), 0.37, dtype=torch.float64)).topk(K), False),
    "divisor_float64_tensor": (lambda qi, ki, w: _masked(
        _score(qi, ki, w) / torch.full((1, 1, 1), 3.0, dtype=torch.float64)).topk(K), False),
    "mean_in_float64": (lambda qi, ki, w: _masked(_head_terms(qi, ki, w).mean(2, dtype=torch.float64)).topk(K),
                        False),
    "squeeze_tuple": (lambda qi, ki, w: _masked(_score(qi, ki, w)).unsqueeze(1).squeeze((1,)).topk(K), True),
    "topk_transposed_dim1": (lambda qi, ki, w: torch.topk(_masked(_score(qi, ki, w)).transpose(1, 2), K, dim=1),
                             True),
    "sort_stable_false": (_sort_unstable, True),
    "int32_positions": (_int32_positions, True),
    "clamp_typed_bounds": (lambda qi, ki, w: _masked((torch.einsum("bthd,bsd->bths", qi, ki).clamp(
        torch.tensor(0, dtype=torch.int64), torch.tensor(1e39)) * w[..., None]).sum(2)).topk(K), True),
    "maximum_float64_zero": (lambda qi, ki, w: _masked((torch.maximum(torch.einsum(
        "bthd,bsd->bths", qi, ki), torch.tensor(0.0, dtype=torch.float64)) * w[..., None]).sum(2)).topk(K), True),
    "fill_float64_tensor": (lambda qi, ki, w: _score(qi, ki, w).masked_fill(
        ~_causal(), torch.tensor(-0.1, dtype=torch.float64)).topk(7), True),
    "where_fill_float64_tensor": (lambda qi, ki, w: torch.where(
        _causal(), _score(qi, ki, w), torch.tensor(-1e30, dtype=torch.float64)).topk(7), True),
}


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_selection_arguments_read_right(name):
    model, rewritten = SELECTIONS[name]
    grad = () if name in ("clamp_typed_bounds", "maximum_float64_zero") else (0, 1, 2)  # clamp's grad at 0
    assert _same_as_eager(model, _qkw(), grad=grad) == rewritten


def test_float16_positions_past_2048():
    """float16 positions round past 2048: the mask is passed as the model's tensor, not read as a causal rule."""
    s2, t2 = 2100, 3

    def model(qi, ki, w):
        m = torch.arange(s2, dtype=torch.float16)[None] <= torch.arange(t2, dtype=torch.float16)[:, None] + (s2 - 60)
        return _score(qi, ki, w).masked_fill(~m, NEG).topk(K)

    qi, ki, w = _inputs(4, t=t2, s=s2)[:3]
    assert _same_as_eager(model, (qi, ki, w.abs() * 0.05))


def _sdpa(**kw):
    def model(qi, ki, w, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_keep(qi, ki, w), **kw)

    return model


def _gqa(qi, ki, w, q, k, v):
    return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=_keep(qi, ki, w), enable_gqa=True)


ATTENTIONS = {
    "mask_bitcast_to_uint8": lambda qi, ki, w, q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=_keep(qi, ki, w).view(torch.uint8) == 1),
    "sdpa_scale_keyword": _sdpa(scale=0.3),
    "sdpa_enable_gqa": _gqa,
    "softmax_float32_by_position": lambda qi, ki, w, q, k, v: torch.softmax(
        (q @ k.transpose(-1, -2) * 0.3).masked_fill(~_keep(qi, ki, w), MIN), -1, torch.float32) @ v,
    "dropout_p0_training": lambda qi, ki, w, q, k, v: F.dropout(
        (q @ k.transpose(-1, -2) * 0.3).masked_fill(~_keep(qi, ki, w), MIN).softmax(-1), 0.0, True) @ v,
}


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_attention_arguments_read_right(name):
    """Each rewritten and the same as eager; a view of the mask as another dtype is a bitcast, which no pass reads
    (``graph_ops.op_name``): left alone, still eager's values."""
    rewritten = _same_as_eager(ATTENTIONS[name], _inputs(3), grad=ALL, kind="attention")
    assert rewritten == (name != "mask_bitcast_to_uint8")


assert (B, H, DI) == (2, 2, 8)  # the sizes the cases above are written for
