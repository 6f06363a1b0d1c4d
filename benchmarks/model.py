"""Model benchmark: one DeepSeek-V3.2 decoder layer (HF transformers, unmodified) at real attention sizes.

The layer is ``DeepseekV32ForCausalLM`` with one decoder layer: hidden 7168, MLA with 128 heads (q_lora 1536,
kv_lora 512, qk_nope 128, qk_rope 64, v 128), the DSA indexer (64 heads of 128, k = 2048), the dense MLP of
DeepSeek's first layers (18432), a small vocabulary; bf16, batch 1, SDPA attention, forward + backward of HF's
own loss. Modes:

    eager            the model as HF runs it: indexer score table [T, 64, S] in fp32, dense attention under the
                     scattered index mask
    inductor         torch.compile(backend="inductor")
    hyscale_select   torch.compile(backend="hyscale", options={"attention": False}): the selection without the
                     score table, dense attention under the index mask
    hyscale          torch.compile(backend="hyscale"): the selection, and sparse attention over the k picks in
                     the absorbed MLA layout (the per-head K and V are never built) where the pass estimates it
                     faster than the model's dense attention (else as hyscale_select)
    hyscale_sparse   options={"attention": "always"}: sparse attention at every provable site, faster or not
    hyscale_recompute  options={"recompute_latent": True}: as hyscale, the absorbed op recomputing its per-head
                     latent output in the backward instead of keeping it (less memory, more attention time)

Per row: T, H, k, the inputs, ms per step of each mode, peak bytes of each mode, the loss (equal across modes up
to bf16 rounding), the hyscale counters and each attention site's decision and layout. A mode that runs out of
memory is recorded as "OOM at N GiB". Inputs (``--inputs``):

    training   what a training step passes: ``use_cache=False`` and a 2-D attention mask (all ones: HF's data
               collators always pass one), so the model's mask is causal & padding
    cache      ``use_cache=True`` and no attention mask (the rows before this option): without a cache and a 2-D
               mask HF builds a data-dependent packed-sequence mask of T x S. The cache stores the per-head keys
               and values (up to transformers 5.17): they are built and kept through the step in every mode,
               though in the latent layout nothing else reads them.

    python benchmarks/model.py                       # H200: T = 16384, 32768, 65536; H = 128 and 16
    python benchmarks/model.py --contexts 16384 --heads 128 --modes hyscale,hyscale_select
    python benchmarks/model.py --contexts 65536 --heads 128 --modes hyscale_sparse --profile  # where a step goes
    python benchmarks/model.py --inputs cache        # the cached rows of earlier commits
    python benchmarks/model.py --smoke               # tiny config, any device, prints only

``--model glm_shared`` runs ``GlmMoeDsaForCausalLM`` instead, with the same layer sizes and two decoder layers: a
full one (its own indexer) and a shared one (it reuses the first layer's indices), each checkpointed by HF's
gradient checkpointing, as GLM-5 trains: the shared layer's attention is in another checkpoint region than the
top-k it reads (-> results/model_glm.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a source checkout too
import hyscale_compile  # noqa: E402, F401  (registers backend="hyscale" where no entry point did)
from hyscale_compile.passes import report  # noqa: E402

CONTEXTS = [16384, 32768, 65536]
HEADS = [128, 16]
MODES = ["hyscale", "hyscale_recompute", "hyscale_sparse", "hyscale_select", "inductor", "eager"]  # most telling first
MODE_KEYS = {"eager": "eager_ms", "inductor": "inductor_ms", "hyscale_select": "hyscale_select_only_ms",
             "hyscale": "hyscale_ms", "hyscale_sparse": "hyscale_sparse_ms",
             "hyscale_recompute": "hyscale_recompute_ms"}

LAYER = dict(hidden_size=7168, intermediate_size=18432, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
             qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
             vocab_size=1024)
SMOKE = dict(hidden_size=64, intermediate_size=96, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=8, vocab_size=128)


INPUTS = ("training", "cache")


MODELS = ("deepseek_v32", "glm_shared")


def build(heads: int, T: int, smoke: bool, device: str, dtype: torch.dtype, inputs: str = "training",
          model_name: str = "deepseek_v32"):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    sizes = SMOKE if smoke else LAYER
    common = dict(num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max(T, 4096),
                  attn_implementation="sdpa", attention_dropout=0.0)
    if model_name == "glm_shared":
        config = GlmMoeDsaConfig(**sizes, **common, num_hidden_layers=2, first_k_dense_replace=2,
                                 index_topk_pattern="FS")
        model_cls = GlmMoeDsaForCausalLM
    else:
        config = DeepseekV32Config(**sizes, **common, num_hidden_layers=1, first_k_dense_replace=1)
        model_cls = DeepseekV32ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config)
    model = model.to(dtype).train()
    if model_name == "glm_shared":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=g).to(device)
    if inputs == "cache":
        return model, dict(input_ids=ids, labels=ids, use_cache=True)
    return model, dict(input_ids=ids, labels=ids, use_cache=False, attention_mask=torch.ones_like(ids))


def make_fn(mode: str, model, smoke: bool):
    if mode == "eager":
        return model
    if mode == "inductor":  # the smoke run checks the harness, not Inductor's CPU code generation
        return torch.compile(model, backend="aot_eager" if smoke else "inductor")
    options = {"attention": {"hyscale": True, "hyscale_sparse": "always", "hyscale_recompute": True}.get(mode, False)}
    if mode == "hyscale_recompute":
        options["recompute_latent"] = True
    if smoke:
        options["compiler"] = "aot_eager"
    return torch.compile(model, backend="hyscale", options=options)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, inputs, iters: int, device: str) -> tuple[float, float]:
    """(ms per forward + backward step after one warm-up step, which includes compilation; the last loss)."""
    fn(**inputs).loss.backward()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        loss = fn(**inputs).loss
        loss.backward()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters, loss.detach().item()


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower()


def top_kernels(fn, inputs, device: str, n: int = 12) -> list[tuple[str, float]] | None:
    """The n device records (kernels, copies) of one more step with the most device time, ms (CUDA only)."""
    if device != "cuda":
        return None
    from training import device_records

    totals: dict[str, float] = {}
    for name, us in device_records(lambda: fn(**inputs).loss.backward()):
        totals[name[:80]] = totals.get(name[:80], 0.0) + us / 1e3
    return [(name, round(ms, 2)) for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:n]]


def run_mode(mode: str, heads: int, T: int, iters: int, smoke: bool, device: str, dtype,
             profile: bool = False, inputs_kind: str = "training", model_name: str = "deepseek_v32") -> dict:
    """{"ms": ms per step or "OOM at N GiB" / "error: ...", "peak": bytes or None, "loss", "counters"}."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = fn = inputs = None
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        model, inputs = build(heads, T, smoke, device, dtype, inputs_kind, model_name)
        fn = make_fn(mode, model, smoke)
        with report.collect() as sites:
            ms, loss = time_steps(fn, inputs, iters, device)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        got = {"ms": round(ms, 3), "peak": peak, "loss": loss, "counters": dict(counters["hyscale"]),
               "attention": [f"{r.decision}: {r.layout or r.reason[:200]}" for r in sites if r.kind == "attention"]}
        if profile:
            got["top_kernels"] = top_kernels(fn, inputs, device)
        return got
    except Exception as e:  # noqa: BLE001  (an OOM anywhere, compile included, is a result; so is a failure)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        ms = f"OOM at {peak / 2**30:.1f} GiB" if _is_oom(e) else \
            f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return {"ms": ms, "peak": peak or None, "loss": None, "counters": dict(counters["hyscale"])}
    finally:
        del model, fn, inputs
        torch._dynamo.reset()


def write_results(path: str, device: str, rows: list[dict], model_name: str = "deepseek_v32") -> None:
    """results/*.json as every benchmark here writes it: device, versions, date, commit, rows."""
    import transformers

    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = os.environ.get("HYSCALE_COMMIT") or subprocess.run(
        git, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "date": datetime.date.today().isoformat(), "commit": commit,
           "model": model_name, "layer": LAYER, "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny config, print only")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--heads", default=",".join(map(str, HEADS)))
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining rows after this long")
    parser.add_argument("--profile", action="store_true", help="also the kernels of one more step with the most "
                                                                 "device time, per mode (row key MODE_top_kernels)")
    parser.add_argument("--inputs", choices=INPUTS, default="training", help="the step's inputs (module docstring)")
    parser.add_argument("--model", choices=MODELS, default="deepseek_v32", help="module docstring")
    parser.add_argument("--out", default=None, help="default results/model.json (model_glm.json for glm_shared)")
    args = parser.parse_args()
    out = args.out or str(Path(__file__).parent / "results" / ("model_glm.json" if args.model == "glm_shared"
                                                               else "model.json"))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    contexts = [32] if args.smoke else [int(x) for x in args.contexts.split(",")]
    heads = [4] if args.smoke else [int(x) for x in args.heads.split(",")]
    k = (SMOKE if args.smoke else LAYER)["index_topk"]
    # the smoke run checks the harness: the recompute mode is the hyscale mode with one option (tests cover it)
    modes = [m for m in args.modes.split(",") if not (args.smoke and m == "hyscale_recompute")]
    start = time.perf_counter()
    rows = []
    for H in heads:
        for T in contexts:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: skipping T={T} H={H}")
                continue
            # None: not run
            row = {"T": T, "H": H, "k": k, "inputs": args.inputs, **{key: None for key in MODE_KEYS.values()}}
            for mode in modes:
                got = run_mode(mode, H, T, args.iters, args.smoke, device, dtype, args.profile, args.inputs,
                               args.model)
                row[MODE_KEYS[mode]] = got["ms"]
                row[f"{mode}_peak_bytes"] = got["peak"]
                row[f"{mode}_loss"] = got["loss"]
                if mode.startswith("hyscale"):
                    row[f"{mode}_counters"] = got["counters"]
                    row[f"{mode}_attention"] = got.get("attention")  # each attention site: decision and layout
                if "top_kernels" in got:
                    row[f"{mode}_top_kernels"] = got["top_kernels"]
                print(f"T={T} H={H} {mode}: {got['ms']} ms, peak {got['peak']}, loss {got['loss']}", flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not args.smoke:
                write_results(out, device, rows, args.model)


if __name__ == "__main__":
    main()
