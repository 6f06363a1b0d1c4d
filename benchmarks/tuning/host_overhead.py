"""Is a hyscale training step bound by the host? Where does its host time go?

For the training benchmark's layer (forward + backward under checkpointing, hyscale backend) at one
shape: the wall time of a step, the time the host takes to enqueue it (no sync), the device's
kernel time (profiler kernel records), the host time inside each hyscale runtime entry (select,
rescore, sparse backward: Python, allocations and kernel launches), and any host<->device syncs
in the step (``torch.cuda.set_sync_debug_mode``). A step whose enqueue time is close to its wall
time and above its kernel time is host-bound: faster kernels will not make it faster.

    python benchmarks/tuning/host_overhead.py [--shape 0] [--out results/host_overhead.json] [--cprofile FILE]
    python benchmarks/tuning/host_overhead.py --smoke    # a tiny step on the CPU (wall and enqueue only), prints only

--cprofile writes the Python functions that take the host's time in those steps (cProfile, by own
time and by cumulative time), to see which calls inside an entry cost it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
import training  # noqa: E402  (the layer, inputs and shapes of the training benchmark)
from host_timers import host_timers  # noqa: E402

from hyscale_compile.runtime import hytopk  # noqa: E402
from hyscale_compile.runtime import sparse_backward as sb  # noqa: E402

# The runtime entries the ops call (on CUDA: dispatch hands out these modules).
ENTRIES = [(hytopk, "select", "select"), (hytopk, "rescore", "rescore"), (sb, "sparse_backward", "sparse_backward")]


def write_profile(path: str, fn, inputs, iters: int) -> None:
    """cProfile of `iters` steps (host side only: no sync inside), top functions two ways."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(iters):
        fn(*inputs).backward()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats(key).print_stats(60)
    Path(path).write_text(f"{iters} steps\n" + out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, default=0, help="index into the training benchmark's shapes")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cprofile", default=None, help="write a cProfile table of the steps' host time here")
    ap.add_argument("--smoke", action="store_true", help="a tiny step, any device, nothing written")
    args = ap.parse_args()
    T, S, H = training.SHAPES[args.shape]
    D, k, device, dtype = 128, 2048, "cuda", torch.bfloat16
    if args.smoke:
        (T, S, H), D, k, args.iters = (32, 128, 2), 16, 8, 2
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    inputs = training.make_inputs(T, S, H, D, k, device, dtype)
    fn = training.make_fn("hyscale", k)
    for _ in range(3):
        fn(*inputs).backward()
    sync()

    row = dict(T=T, S=S, H=H, D=D, k=k)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn(*inputs).backward()
    sync()
    row["wall_ms"] = (time.perf_counter() - t0) * 1e3 / args.iters

    enqueue = []
    for _ in range(args.iters):
        sync()
        t0 = time.perf_counter()
        fn(*inputs).backward()
        enqueue.append((time.perf_counter() - t0) * 1e3)
    sync()
    row["enqueue_ms"] = sorted(enqueue)[len(enqueue) // 2]
    if device == "cuda":
        row["kernel_ms"] = sum(us for _, us in training.device_records(lambda: fn(*inputs).backward())) / 1e3

    with host_timers(ENTRIES) as totals:
        for _ in range(args.iters):
            fn(*inputs).backward()
        sync()
    row["host_ms_in"] = {name: v * 1e3 / args.iters for name, v in totals.items()}

    if args.cprofile:
        write_profile(args.cprofile, fn, inputs, args.iters)

    if device != "cuda":  # the sync check needs a device
        print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*inputs).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync()
    syncs = [str(w.message).splitlines()[0][:160] for w in caught
             if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)]
    row["syncs"] = len(syncs)
    row["sync_messages"] = sorted(set(syncs))[:10]
    row = {key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}
    row["host_ms_in"] = {name: round(v, 3) for name, v in row["host_ms_in"].items()}
    print(json.dumps(row, indent=1), flush=True)
    if args.out:
        training.write_results(args.out, "cuda", [row])


if __name__ == "__main__":
    main()
