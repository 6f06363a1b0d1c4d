"""Variants of the two kernels a replayed backward runs, timed in one run: ``rescore`` and the sparse
backward (dq, dw, dkx through the k picks only).

This is the measurement behind the defaults ``hytopk.RESCORE_*`` and ``sparse_backward.ROW_*`` /
``PROGRAMS_PER_SM``. For each variant: the median device time (triton's do_bench) and a check:
rescore must equal select's values bit for bit; a sparse backward variant must match the first
variant to fp32 rounding and repeat its own bits. Shapes are the training benchmark's (k=2048,
D=128, bf16, causal, queries at the end of the context).

    python benchmarks/tune_replay.py [--shapes 0,1,2] [--out results/tune_replay.json]
    TRITON_INTERPRET=1 python benchmarks/tune_replay.py --smoke    # tiny shapes on the CPU, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hyscale_compile.runtime import hytopk  # noqa: E402
from hyscale_compile.runtime import sparse_backward as sb  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import training  # noqa: E402  (write_results: the results file every benchmark here writes)

SHAPES = [(2048, 65536, 16), (4096, 131072, 16), (4096, 131072, 64)]  # (T, S, H)
D, K = 128, 2048
DEVICE = "cuda"

# (blocks per program, stages): (1, 1) is one 64-key block per program, as before pipelining
RESCORE_VARIANTS = [(1, 1), (8, 1), (8, 2), (8, 3), (16, 3), (4, 3), (8, 4)]
# (row picks, stages, programs per SM; 0: one slice per row, no partial sums)
BACKWARD_VARIANTS = [(32, 1, 0), (32, 3, 0), (32, 3, 8), (64, 3, 8), (32, 2, 8), (32, 3, 16), (16, 3, 8)]


def bench(fn) -> float:
    if DEVICE != "cuda":
        return float("nan")
    return round(do_bench(fn, warmup=25, rep=150, return_mode="median"), 3)


def inputs(T: int, S: int, H: int):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, T, H, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    kx = torch.randn(1, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = torch.rand(1, T, H, device=DEVICE, generator=g)
    return q, kx, w


def rescore_rows(q, kx, w, vis) -> list[dict]:
    scale = D**-0.5
    values, idx = hytopk.select(q, kx, w, K, scale, True, vis, float("-inf"))
    rows = []
    old = (hytopk.RESCORE_BLOCKS, hytopk.RESCORE_STAGES)
    try:
        for blocks, stages in RESCORE_VARIANTS:
            hytopk.RESCORE_BLOCKS, hytopk.RESCORE_STAGES = blocks, stages

            def run():
                return hytopk.rescore(q, kx, w, idx, scale, True, vis, float("-inf"))

            row = dict(kernel="rescore", blocks=blocks, stages=stages)
            try:
                out = run()
                row.update(ms=bench(run), mismatches=int((out.view(torch.int32) != values.view(torch.int32)).sum()))
            except Exception as e:  # a variant that fails to compile is a result too
                row["failed"] = str(e)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        hytopk.RESCORE_BLOCKS, hytopk.RESCORE_STAGES = old
    return rows


def backward_rows(q, kx, w, vis) -> list[dict]:
    T, S = q.shape[1], kx.shape[1]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    idx = torch.randint(0, S - T, (1, T, K), device=DEVICE, generator=g)
    gv = torch.randn(1, T, K, device=DEVICE, generator=g)
    rows, first = [], None
    old = (sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM)
    try:
        for picks, stages, per_sm in BACKWARD_VARIANTS:
            sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM = picks, stages, per_sm

            def run():
                return sb.sparse_backward(gv, q, kx, w, idx, D**-0.5, True, vis, deterministic=True)

            row = dict(kernel="sparse_backward", row_picks=picks, stages=stages, programs_per_sm=per_sm)
            try:
                out = run()
                again = run()
                row.update(ms=bench(run), repeatable=all(torch.equal(a, b) for a, b in zip(out, again)))
            except Exception as e:
                row["failed"] = str(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            if first is None:
                first = out
            row["max_rel_diff_vs_first"] = max(
                float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip(out, first))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM = old
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_replay.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, prints only")
    args = ap.parse_args()
    if args.smoke:
        global SHAPES, D, K, DEVICE
        SHAPES, D, K = [(20, 90, 16), (20, 90, 19)], 32, 24
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        args.shapes = "0,1"
        if DEVICE == "cpu":  # the interpreter needs the tests' shim for runtime loop bounds
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
            import triton_interpret  # noqa: F401
    rows = []
    for i in map(int, args.shapes.split(",")):
        T, S, H = SHAPES[i]
        q, kx, w = inputs(T, S, H)
        vis = Visibility(causal=True, offset=S - T)
        for row in rescore_rows(q, kx, w, vis) + backward_rows(q, kx, w, vis):
            rows.append(dict(T=T, S=S, H=H, D=D, k=K, **row))
        del q, kx, w
    if args.smoke:
        return
    training.write_results(args.out, "cuda", rows)


if __name__ == "__main__":
    main()
