"""Sparse attention over k = 2048 selected keys against dense attention under the index mask, one GPU.

For each layout and context, T = S (training / prefill, causal, one batch), bf16:

    mla   the DeepSeek-V3.2 layer in latent form: H = 128, one kv group, Dqk = 512 + 64, v = k[..., :512]
          (--mla-entry latent: hyscale_compile.sparse_attention_latent, kv taken once, dv folded into dk in the
          backward; view: sparse_attention with v = k[..., :512], dk and dv apart, as before the latent op)
    mha   the same layer as HF expands it (kv_b_proj): H = 128, Dqk = 192, Dv = 128 (--heads to change)
    gqa   H = 32, 8 kv groups, D = 128

Rows: ``sparse`` (torch.ops.hyscale.sparse_attention, forward and forward + backward), ``dense_masked``
(SDPA under the boolean mask index AND causal, what HF runs), ``dense_causal`` (SDPA is_causal without
the index mask: the dense floor, flash-attention where the head dim allows). A baseline that fails
(out of memory, no kernel for the head dim) is recorded as null with its error. ``err`` is the largest
difference of sparse and dense_masked outputs over the largest dense output. Picks: the top k of
random scores over each row's visible keys (``--picks local``: sinks and the recent keys favoured).

    python benchmarks/sparse_attention.py [--layouts mla,gqa,mha] [--contexts 8192,16384,32768,65536]
                                          [--mla-entry latent|view]
    TRITON_INTERPRET=1 python benchmarks/sparse_attention.py --smoke    # tiny shapes on the CPU, prints only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hyscale_compile  # noqa: E402
from hyscale_compile.runtime import dispatch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import training  # noqa: E402  (write_results, interpreter_shim)

LAYOUTS = {"mla": (128, 1, 576, 512), "mha": (128, 128, 192, 128), "gqa": (32, 8, 128, 128)}  # H, G, Dqk, Dv
SMOKE_LAYOUTS = {"mla": (4, 1, 24, 16), "mha": (2, 2, 24, 16), "gqa": (4, 2, 16, 16)}
K = 2048


def picks(T: int, S: int, k: int, local: bool, device, seed: int = 0) -> torch.Tensor:
    """[1, T, k] int32: the top k of random scores over keys s <= t + S - T, 1024 rows at a time (rows with
    fewer visible keys get masked positions after them, as a top-k over masked scores gives)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(1, T, k, dtype=torch.int32, device=device)
    pos = torch.arange(S, device=device)
    for t0 in range(0, T, 1024):
        t = torch.arange(t0, min(T, t0 + 1024), device=device)[:, None] + (S - T)
        score = torch.rand(len(t), S, device=device, generator=g)
        if local:  # sinks and the most recent k/2 keys first, as trained indexers tend to pick
            score = score + ((pos < 64) | (t - pos < k // 2)).float()
        score = score.masked_fill(pos > t, -1.0)
        out[0, t0:t0 + len(t)] = score.topk(k, dim=-1).indices.int()
    return out


def timed(fn, device) -> float | None:
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return round((time.perf_counter() - start) * 1e3, 3)
    from triton.testing import do_bench

    return round(do_bench(fn, warmup=5, rep=200, return_mode="median"), 3)


def attempt(fn, device) -> tuple[float | None, str | None]:
    """(ms, None), or (None, the error) where the baseline cannot run."""
    try:
        return timed(fn, device), None
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if device == "cuda":
            torch.cuda.empty_cache()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def fwd_bwd(run, inputs, grad):
    """A callable running run(*inputs) and its backward against ``grad``."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def step():
        out = run(*leaves)
        torch.autograd.grad(out, leaves, grad)

    return step


def dense_masked(row: dict, dense, inputs: tuple, idx, out, grad, device) -> None:
    """The dense_masked entries of ``row``: SDPA under (index mask AND causal), and the sparse output's error."""
    T, S = idx.shape[1], inputs[1].shape[1]
    try:
        mask = torch.zeros(1, 1, T, S, dtype=torch.bool, device=device)
        mask[0, 0].scatter_(-1, idx[0].long(), True)
        mask &= torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)
    except torch.OutOfMemoryError as e:
        row["dense_masked_error"] = f"OutOfMemoryError building the mask: {str(e).splitlines()[0][:120]}"
        return
    row["dense_masked_fwd_ms"], row["dense_masked_error"] = attempt(lambda: dense(*inputs, mask), device)
    if row["dense_masked_fwd_ms"] is None:
        return
    want = dense(*inputs, mask).float()
    row["err"] = round(((out.float() - want).abs().max() / want.abs().max()).item(), 5)
    del want
    row["dense_masked_fwd_bwd_ms"], _ = attempt(fwd_bwd(lambda *a: dense(*a, mask), inputs, grad), device)


def one(layout: str, dims: tuple, S: int, k: int, local: bool, device: str, dtype, mla_entry: str = "latent") -> dict:
    H, G, Dqk, Dv = dims
    T = S
    g = torch.Generator(device=device).manual_seed(S)
    q = torch.randn(1, T, H, Dqk, device=device, generator=g).to(dtype)
    k_ = torch.randn(1, S, G, Dqk, device=device, generator=g).to(dtype)
    v = k_[..., :Dv] if layout == "mla" else torch.randn(1, S, G, Dv, device=device, generator=g).to(dtype)
    idx = picks(T, S, k, local, device)
    grad = torch.randn(1, T, H, Dv, device=device, generator=g).to(dtype)
    scale = Dqk ** -0.5

    latent = layout == "mla" and mla_entry == "latent"

    def sparse(q, k_, v=None):
        if latent:  # kv once: the backward returns kv's whole gradient
            return hyscale_compile.sparse_attention_latent(q, k_, idx, value_dim=Dv, scale=scale, query_offset=S - T)
        return hyscale_compile.sparse_attention(q, k_, v, idx, scale=scale, query_offset=S - T)

    row = dict(layout=layout, H=H, G=G, Dqk=Dqk, Dv=Dv, T=T, S=S, k=k, picks="local" if local else "random")
    if layout == "mla":
        row["entry"] = mla_entry
    operands = (q, k_) if latent else (q, k_, v)
    row["sparse_fwd_ms"] = timed(lambda: sparse(*operands), device)
    row["sparse_fwd_bwd_ms"] = timed(fwd_bwd(sparse, operands, grad), device)
    out = sparse(*operands)

    def heads(t):  # [B, S, G, D] -> [B, H, S, D]
        return t.transpose(1, 2).repeat_interleave(H // G, dim=1)

    def dense(q, k_, v, mask=None):
        causal = mask is None
        return F.scaled_dot_product_attention(q.transpose(1, 2), heads(k_), heads(v), attn_mask=mask,
                                              is_causal=causal, scale=scale).transpose(1, 2)

    dense_masked(row, dense, (q, k_, v), idx, out, grad, device)
    row["dense_causal_fwd_ms"], row["dense_causal_error"] = attempt(lambda: dense(q, k_, v), device)
    if row["dense_causal_fwd_ms"] is not None:
        row["dense_causal_fwd_bwd_ms"], _ = attempt(fwd_bwd(dense, (q, k_, v), grad), device)
    for base in ("dense_masked", "dense_causal"):
        for part in ("fwd", "fwd_bwd"):
            a, b = row.get(f"{base}_{part}_ms"), row[f"sparse_{part}_ms"]
            row[f"x_{base}_{part}"] = round(a / b, 2) if a and b else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print only")
    parser.add_argument("--layouts", default="mla,gqa,mha")
    parser.add_argument("--contexts", default="8192,16384,32768,65536")
    parser.add_argument("--heads", type=int, default=None, help="query heads of the mha layout (HF: 128 / TP)")
    parser.add_argument("--picks", choices=["random", "local"], default="random")
    parser.add_argument("--mla-entry", choices=["latent", "view"], default="latent",
                        help="mla: sparse_attention_latent (kv once, dv folded into dk) or sparse_attention with "
                             "v = k[..., :512] (dk and dv apart)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sparse_attention.json"))
    args = parser.parse_args()
    training.interpreter_shim()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layouts = SMOKE_LAYOUTS if args.smoke else dict(LAYOUTS)
    if args.heads and not args.smoke:
        layouts["mha"] = (args.heads, args.heads) + LAYOUTS["mha"][2:]
    contexts = [32] if args.smoke else [int(c) for c in args.contexts.split(",")]
    k = 8 if args.smoke else K
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = []
    with dispatch.force_backend("triton"):
        for layout in args.layouts.split(","):
            for S in contexts:
                row = one(layout, layouts[layout], S, k, args.picks == "local", device, dtype, args.mla_entry)
                rows.append(row)
                print({key: val for key, val in row.items() if not key.endswith("_error") or val}, flush=True)
    print(f"\n{'layout':6} {'S':>6} {'sparse fwd':>10} {'fwd+bwd':>9} {'x masked fwd':>12} {'fwd+bwd':>8} "
          f"{'x causal fwd':>12} {'fwd+bwd':>8}")
    for r in rows:
        cells = [r["sparse_fwd_ms"], r["sparse_fwd_bwd_ms"], r["x_dense_masked_fwd"], r["x_dense_masked_fwd_bwd"],
                 r["x_dense_causal_fwd"], r["x_dense_causal_fwd_bwd"]]
        print(f"{r['layout']:6} {r['S']:>6} " + " ".join(f"{'-' if c is None else c:>10}" for c in cells))
    if not args.smoke:
        training.write_results(args.out, device, rows)


if __name__ == "__main__":
    main()
