"""Small attention modules that scatter top-k indices into a mask, one spelling each (for the attention pass).

``make(form, **kw)`` returns ``(module, args)``; ``module(*args)`` runs q [B, H, T, D], k / v [B, G, S, D] and an
index score [B, T, S] (its top-k are the picks) through the spelling ``form``. The score is an input, so the
selection pass leaves the top-k as it is and the picks are eager's exactly. ``REWRITE`` lists the forms the pass
rewrites, ``REJECT`` those it must leave alone with the reason's key phrase.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, H, T, S, D = 2, 4, 6, 10, 8


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:  # HF's repeat_kv
    b, g, s, d = x.shape
    if n == 1:
        return x
    return x[:, :, None, :, :].expand(b, g, n, s, d).reshape(b, g * n, s, d)


class IndexedAttention(nn.Module):
    def __init__(self, form: str, k: int = 4, dropout: float = 0.0):
        super().__init__()
        self.form, self.k, self.dropout = form, k, dropout

    def forward(self, q, k, v, score, pad=None, idx=None):
        form = self.form
        Bq, Hq, Tq, Dq = q.shape
        Sk = k.shape[2]
        if idx is None:
            idx = score.topk(self.k, dim=-1).indices
        causal = torch.arange(Sk)[None, :] <= torch.arange(Tq)[:, None] + (Sk - Tq)  # [T, S]
        allowed = causal[None, None] if pad is None else causal[None, None] & pad[:, None, None, :]
        scale = Dq ** -0.5
        if form == "sdpa_bool":  # HF DeepSeek-V3.2 / GLM-MoE-DSA with SDPA
            index_mask = idx.new_ones((Bq, Tq, Sk), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & ~index_mask, scale=scale)
        if form == "sdpa_selected":  # picks marked True, and-ed the other way round
            chosen = torch.zeros(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None] & allowed)
        if form == "sdpa_additive":  # 0 at the picks, -inf elsewhere, plus an additive causal mask
            bias = torch.full((Bq, Tq, Sk), float("-inf")).scatter(-1, idx, 0.0)
            mask = torch.where(allowed, 0.0, float("-inf")) + bias[:, None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if form == "sdpa_gqa":
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & ~index_mask[:, None], enable_gqa=True)
        if form == "sdpa_dropout":
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & ~index_mask[:, None],
                                                  dropout_p=self.dropout)
        if form == "wrong_polarity":  # keeps the keys that were *not* picked
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & index_mask[:, None])
        if form == "mask_read_elsewhere":
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & ~index_mask[:, None])
            return out, index_mask.sum()
        if form == "per_head_mask":
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            heads = torch.arange(Hq)[None, :, None, None] % 2 == 0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed & heads & ~index_mask[:, None])
        if form == "learned_bias":
            index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, False)
            mask = torch.where(allowed, 0.0, torch.finfo(q.dtype).min).masked_fill(index_mask[:, None],
                                                                                    torch.finfo(q.dtype).min)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask + score[:, None])
        # eager attention: scores = q k^T * scale + mask -> softmax -> dropout -> @ v
        n_rep = Hq // k.shape[1]
        kh, vh = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        w = torch.matmul(q, kh.transpose(2, 3)) * scale
        if form in ("eager", "eager_weights", "eager_dropout"):  # HF eager_attention_forward (finfo.min fills)
            index_mask = idx.new_ones((Bq, Tq, Sk), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
            mask = torch.where(allowed, torch.zeros(()), torch.finfo(q.dtype).min)
            w = w + mask.masked_fill(index_mask, torch.finfo(q.dtype).min)
        elif form == "eager_replace":  # the scores themselves filled where hidden
            chosen = torch.zeros(Bq, Tq, Sk, dtype=torch.bool).scatter(-1, idx, True)
            w = w.masked_fill(~(allowed & chosen[:, None]), torch.finfo(q.dtype).min)
        elif form in ("deepseek_reference", "deepseek_reference_no_causal"):  # DeepSeek's inference code
            index_mask = torch.full((Bq, Tq, Sk), float("-inf")).scatter_(-1, idx, 0)
            if form == "deepseek_reference":
                index_mask += torch.full((Tq, Sk), float("-inf")).triu_(Sk - Tq + 1)
            w += index_mask.unsqueeze(1)
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        p = F.dropout(p, p=self.dropout, training=self.training)
        out = torch.matmul(p, vh)
        return (out, p) if form == "eager_weights" else out


class MlaAttention(nn.Module):
    """MLA as HF writes it (per-head K and V from a latent through ``kv_b``, a shared rope key), with SDPA or eager
    attention under a scattered index mask. The latent c [B, S, Dc] and rope key r [B, 1, S, Dr] are inputs."""

    def __init__(self, attn: str = "sdpa", bias: bool = False, heads: int = H, dc: int = 16, dr: int = 8,
                 dn: int = 16, dv: int = 12, k: int = 4, keys: str = "cat", cache: str | None = None):
        super().__init__()
        self.attn, self.heads, self.dn, self.dv, self.k = attn, heads, dn, dv, k
        self.keys, self.cache = keys, cache
        self.kv_b = nn.Linear(dc, heads * (dn + dv), bias=bias)
        self.scale = (dn + dr) ** -0.5

    def forward(self, q, c, r, score):
        Bq, Sk = c.shape[0], c.shape[1]
        Tq = q.shape[2]
        kv = self.kv_b(c).view(Bq, Sk, self.heads, self.dn + self.dv).transpose(1, 2)
        if self.keys == "written_through_alias":  # the per-head values changed after the projection, via a view
            kv[..., -1:].mul_(2)
        k_nope, v = torch.split(kv, [self.dn, self.dv], dim=-1)
        r_heads = r.expand(-1, self.heads, -1, -1)
        if self.keys == "buffer":  # HF's expand_kv: a new buffer written in two parts
            k = k_nope.new_empty((*k_nope.shape[:-1], self.dn + r.shape[-1]))
            k[..., :self.dn].copy_(k_nope)
            k[..., self.dn:].copy_(r_heads)
        else:
            k = torch.cat((k_nope, r_heads), dim=-1)
        kept = ()
        if self.cache == "first":  # HF's DynamicLayer.update on an empty cache (transformers <= 5.17)
            k = torch.cat([torch.tensor([], dtype=k.dtype, device=k.device), k], dim=-2)
            v = torch.cat([torch.tensor([], dtype=v.dtype, device=v.device), v], dim=-2)
            kept = (k, v)
        elif self.cache == "first_fp32":  # an empty cache of another dtype: the cat promotes, it is no copy
            k = torch.cat([torch.tensor([], dtype=torch.float64, device=k.device), k], dim=-2).to(k.dtype)
            v = torch.cat([torch.tensor([], dtype=torch.float64, device=v.device), v], dim=-2).to(v.dtype)
        elif self.cache == "past":  # a cache holding earlier keys: they have no latent in the graph
            k = torch.cat([k[:, :, :3], k[:, :, 3:]], dim=-2)
            v = torch.cat([v[:, :, :3], v[:, :, 3:]], dim=-2)
        idx = score.topk(self.k, dim=-1).indices
        dev = c.device
        causal = torch.arange(Sk, device=dev)[None, :] <= torch.arange(Tq, device=dev)[:, None] + (Sk - Tq)
        index_mask = torch.ones(Bq, Tq, Sk, dtype=torch.bool, device=dev).scatter(-1, idx, False).unsqueeze(1)
        if self.attn == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~index_mask, scale=self.scale)
        else:
            mask = torch.where(causal, 0.0, torch.finfo(q.dtype).min).masked_fill(index_mask,
                                                                                  torch.finfo(q.dtype).min)
            w = torch.matmul(q, k.transpose(2, 3)) * self.scale + mask
            out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return (out, *kept) if kept else out


def make_mla(attn: str = "sdpa", *, bias: bool = False, seed: int = 0, requires_grad: bool = False, keys: str = "cat",
             cache: str | None = None):
    """(module, args) of ``MlaAttention``: q [B, H, T, 24], c [B, S, 16], r [B, 1, S, 8], score [B, T, S].

    keys: how the per-head keys are built ("cat", "buffer" as HF's expand_kv, "written_through_alias": then
    changed through a view of the projection); cache: None, "first" (HF's dynamic cache on its first update:
    the keys and values also returned), "first_fp32" (an empty cache of another dtype), "past" (earlier keys)."""
    torch.manual_seed(seed)
    module = MlaAttention(attn, bias=bias, keys=keys, cache=cache)
    g = torch.Generator().manual_seed(seed)
    q, c, r = torch.randn(B, H, T, 24, generator=g), torch.randn(B, S, 16, generator=g), torch.randn(B, 1, S, 8,
                                                                                                       generator=g)
    if requires_grad:
        q, c, r = (t.requires_grad_() for t in (q, c, r))
    return module, (q, c, r, torch.randn(B, T, S, generator=g))


REWRITE = {
    "sdpa_bool": dict(kind="sdpa", empty="zero"),
    "sdpa_selected": dict(kind="sdpa", empty="zero"),
    "sdpa_additive": dict(kind="sdpa", empty="zero"),
    "sdpa_gqa": dict(kind="sdpa", empty="zero", groups=2),
    "eager": dict(kind="eager", empty="mean", groups=2),
    "eager_replace": dict(kind="eager", empty="mean"),
    "deepseek_reference_no_causal": dict(kind="eager", empty="zero"),
}

REJECT = {
    "wrong_polarity": "does not keep exactly the picked keys",
    "mask_read_elsewhere": "index mask (index_mask) is read by sum",
    "per_head_mask": "differs between heads",
    "learned_bias": "a float tensor the pass cannot read",
    "eager_weights": "attention weights are read by",
    "deepseek_reference": "gives NaN",
    "arbitrary_indices": "not a top-k's",
    "sdpa_dropout": "dropout_p=0.1",
    "eager_dropout": "dropout with p=0.1 in training mode",
    "k_ge_s": "nothing to gain",
}


def make(form: str, *, seed: int = 0, groups: int | None = None, padding: bool = False, dtype=torch.float32,
         requires_grad: bool = False):
    """(module, args) for ``form`` (a REWRITE or REJECT key)."""
    g = torch.Generator().manual_seed(seed)
    spec = REWRITE.get(form, {})
    G = groups or spec.get("groups", H)
    k = 4
    module_form = form
    if form == "arbitrary_indices":
        module_form = "sdpa_bool"
    if form == "k_ge_s":
        module_form, k = "sdpa_bool", S
    dropout = 0.1 if form in ("sdpa_dropout", "eager_dropout") else 0.0
    module = IndexedAttention(module_form, k=k, dropout=dropout)
    if dropout:
        module.train()
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    kk = torch.randn(B, G, S, D, generator=g).to(dtype)
    v = torch.randn(B, G, S, D, generator=g).to(dtype)
    score = torch.randn(B, T, S, generator=g)
    if requires_grad:
        q, kk, v = (t.requires_grad_() for t in (q, kk, v))
    args = [q, kk, v, score]
    if padding:
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[1, :7] = False  # batch 1: the first queries see no key at all
        args.append(pad)
    if form == "arbitrary_indices":
        if not padding:
            args.append(None)
        args.append(torch.randint(0, S, (B, T, k), generator=g))
    return module, tuple(args)
