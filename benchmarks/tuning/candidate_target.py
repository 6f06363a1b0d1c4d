"""How many candidates per row HyTopK should aim for: time and recoveries for several targets, one shape.

Prediction under test (notes in NOTES-selection.md): the append of candidates costs ~4.4 ms of 13.6 ms at
(T=4096, S=131072, H=16, k=2048) with the default target 3k+1024; halving the candidates should save about
half of that plus part of the final top-k, while the sample-based threshold (M=4096 samples) still leaves
each row >= k candidates (so no recoveries). The measurement (results/candidate_target.json) falsified
it, so the target rule (``plan.sizes``) stayed.

    python benchmarks/tuning/candidate_target.py --out results/candidate_target.json
    python benchmarks/tuning/candidate_target.py --smoke    # a tiny shape on the CPU, prints only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import hytopk, stats  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import training  # noqa: E402  (interpreter_shim)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--S", type=int, default=131072)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, any device, nothing timed or written")
    a = p.parse_args()
    device, D = "cuda", 128
    if a.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        a.T, a.S, a.H, a.k, D = 4, 200, 2, 8, 16
        training.interpreter_shim()
    elif a.out is None:
        p.error("--out is required (but with --smoke)")
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, a.T, a.H, D, device=device, generator=g).to(dtype)
    kx = torch.randn(1, a.S, D, device=device, generator=g).to(dtype)
    w = torch.randn(1, a.T, a.H, device=device, generator=g)
    vis = Visibility(causal=True, offset=a.S - a.T)

    def select(target=None):
        tuning = hytopk.Tuning(target=target, table=False)  # the pipeline's target, at any size
        return hytopk.select(q, kx, w, a.k, D**-0.5, True, vis, float("-inf"), tuning=tuning)

    base = select()
    rows = []
    # the smoke run's targets are tiny: too few candidates, so the recovery runs too
    for target in (None, 2 * a.k + 1024, 3 * a.k // 2 + 512, a.k + 256) if not a.smoke else (None, 4):
        stats.reset()
        out = select(target)
        st = stats.read(device)
        ms = float("nan") if a.smoke else triton.testing.do_bench(lambda t=target: select(t), warmup=25, rep=100,
                                                                   return_mode="median")
        rows.append({"target": target or 3 * a.k + 1024, "ms": ms, "same_as_default": bool(
            torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])), "stats": str(st)})
        print(rows[-1], flush=True)
    if a.smoke:
        assert all(r["same_as_default"] for r in rows), rows
        return
    training.write_results(a.out, device, rows, shape={key: getattr(a, key) for key in ("T", "S", "H", "k")})

if __name__ == "__main__":
    main()
