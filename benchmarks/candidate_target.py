"""How many candidates per row HyTopK should aim for: time and recoveries for several targets, one shape.

Prediction under test (notes in NOTES-selection.md): the append of candidates costs ~4.4 ms of 13.6 ms at
(T=4096, S=131072, H=16, k=2048) with the default target 3k+1024; halving the candidates should save about
half of that plus part of the final top-k, while the sample-based threshold (M=4096 samples) still leaves
each row >= k candidates (so no recoveries).

    python benchmarks/candidate_target.py --out candidate_target.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from hyscale_compile.runtime import hytopk, stats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--S", type=int, default=131072)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--k", type=int, default=2048)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, a.T, a.H, 128, device="cuda", generator=g).bfloat16()
    kx = torch.randn(1, a.S, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, a.T, a.H, device="cuda", generator=g)
    args = (q, kx, w, a.k, 128**-0.5, True, True, a.S - a.T, None, None, None, None, None, float("-inf"), True)
    base = torch.ops.hyscale.select(*args)
    rows = []
    for target in (None, 2 * a.k + 1024, 3 * a.k // 2 + 512, a.k + 256):
        hytopk.knobs.target = target
        stats.reset()
        out = torch.ops.hyscale.select(*args)
        st = stats.read("cuda")
        ms = triton.testing.do_bench(lambda: torch.ops.hyscale.select(*args), warmup=25, rep=100,
                                     return_mode="median")
        rows.append({"target": target or 3 * a.k + 1024, "ms": ms, "same_as_default": bool(
            torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])), "stats": str(st)})
        print(rows[-1], flush=True)
    hytopk.knobs.target = None
    with open(a.out, "w") as f:
        json.dump({"shape": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
