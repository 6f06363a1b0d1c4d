"""What recovery costs: HyTopK select with no, a few, and all rows flagged, one launch or one per pass.

A row is flagged (and rescored over its whole range by the radix-select recovery) when its
candidate buffer cannot be trusted. Rows whose queries are all zero score every key 0 after the
ReLU: all ties, the buffer overflows, the row is flagged. Cases at one shape (bf16, causal, queries
at the end of the context): ``none`` (random queries), ``light`` (32 zero rows: within the 64-row
recovery), ``heavy`` (every row zero: the fallback). Each case runs the recovery three ways: in one
cooperative launch (the default on CUDA: grid barriers between passes, ``RECOVER_PROGRAMS_PER_SM``
programs per SM), in one plain launch on half the SMs (``RECOVER_COOPERATIVE = False``), and one
launch per pass (``RECOVER_ONE_LAUNCH = False``), all three in ``runtime/launch_policy.py``; it
reports median ms, the rows recovered (runtime stats) and whether all three gave the same bits, and
any cooperative grid the driver refused (then the "cooperative" column timed the next grid tried).
The smoke run shrinks the candidate buffer so that its tiny rows overflow and are recovered.

    python benchmarks/tuning/recovery.py [--T 2048 --S 65536 --H 16 --k 2048] [--out results/recovery.json]
    TRITON_INTERPRET=1 python benchmarks/tuning/recovery.py --smoke     # tiny, on the CPU, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import hytopk, launch_policy, stats  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import training  # noqa: E402  (write_results)


def bench(fn, device: str) -> float:
    if device != "cuda":
        return float("nan")
    from triton.testing import do_bench

    return round(do_bench(fn, warmup=3, rep=50, return_mode="median"), 3)


MODES = {"cooperative": (True, True), "half_sms": (True, False), "per_pass": (False, False)}


def measure(cases: dict, kx, w, vis, k: int, D: int, device: str, tuning: hytopk.Tuning) -> list[dict]:
    """One row per case: each mode's ms and rows recovered, same bits across modes, refused grids."""
    _, T, H, _ = next(iter(cases.values())).shape
    S = kx.shape[1]
    rows = []
    launch_policy._one_launch_failed.clear()
    old = launch_policy.RECOVER_ONE_LAUNCH, launch_policy.RECOVER_COOPERATIVE
    try:
        for name, qc in cases.items():
            row = dict(T=T, S=S, H=H, D=D, k=k, case=name)
            outs = {}
            for mode, (one_launch, cooperative) in MODES.items():
                launch_policy.RECOVER_ONE_LAUNCH, launch_policy.RECOVER_COOPERATIVE = one_launch, cooperative

                def run(qc=qc):
                    return hytopk.select(qc, kx, w, k, D**-0.5, True, vis, float("-inf"), tuning=tuning)

                stats.reset()
                outs[mode] = run()
                row[f"{mode}_rows_recovered"] = stats.read().rows_recovered
                row[f"{mode}_ms"] = bench(run, device)
            first = outs["cooperative"]
            row["same_bits"] = all(torch.equal(a, b) for out in outs.values() for a, b in zip(out, first))
            row["cooperative_refused"] = sorted(g for _, g, _ in launch_policy._one_launch_failed)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        launch_policy.RECOVER_ONE_LAUNCH, launch_policy.RECOVER_COOPERATIVE = old
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--S", type=int, default=65536)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "recovery.json"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.T, args.S, args.H, args.k = 8, 300, 2, 16
        training.interpreter_shim()
    T, S, H, k, D = args.T, args.S, args.H, args.k, 128 if not args.smoke else 16
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g)
    kx = torch.randn(1, S, D, device=device, dtype=dtype, generator=g)
    w = torch.rand(1, T, H, device=device, generator=g)
    vis = Visibility(causal=True, offset=S - T)
    light = q.clone()
    light[:, torch.randperm(T, generator=torch.Generator().manual_seed(1))[: min(32, T)]] = 0
    cases = {"none": q, "light": light, "heavy": torch.zeros_like(q)}
    if args.smoke:  # the interpreter is slow, and its rows all overflow the tiny buffer anyway
        cases = {"none": q}
    # the smoke run's rows are short: a tiny buffer makes them overflow, so the recovery runs
    rows = measure(cases, kx, w, vis, k, D, device, hytopk.Tuning(capacity=24, table=False) if args.smoke
                   else hytopk.Tuning(table=False))
    if not args.smoke and device == "cuda":
        training.write_results(args.out, device, rows)


if __name__ == "__main__":
    main()
