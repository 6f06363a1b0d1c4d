"""The latent sparse attention backward by kernel: variants of ``sparse_attention.backward``'s knobs, in one run.

Written when, at the 64K DeepSeek-V3.2 layer, the backward's contribution kernel (878 ms) and segment kernel (486
ms) were most of the step (NOTES-sparse-attention.md, third device run): the segment kernel read its contributions
at ~0.64 TB/s (its programs then held SEGMENT_KEYS sorted picks; now SEGMENT_KEYS keys, with SEGMENT_ROWS rows in
flight), the contribution kernel ran at ~85 TFLOP/s (PICKS, STAGES, WARPS, CHUNK never swept). For each variant
(overrides of the module's knobs, the default first) and shape: each kernel's device time per backward (profiler
device records: ``contrib_ms``, ``segment_ms``, ``dq_ms``, ``other_ms``, ``total_ms``), and whether dq and dkv have
the default variant's bits (``same_bits``: the knobs change tiles and launches, not what is summed in which order,
so a variant that changes the bits is not a candidate). A variant that fails to compile or launch (shared memory,
registers) records its error. Rows are written after every variant.

    python benchmarks/tuning/tune_sparse_backward.py [--contexts 16384] [--variants 0,1,2] [--out ...]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_sparse_backward.py --smoke   # tiny shapes, 2 variants, CPU
    python benchmarks/tuning/tune_sparse_backward.py --offline   # no GPU: sm_90a registers / spills / shared

``--offline`` compiles every variant's kernels at the layer's sizes for sm_90a through the tests' stand-in
driver (tests/kernels/compile_for_gpu.py, nothing launched) and prints each kernel's registers, stack (spill)
bytes and shared memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import training  # noqa: E402  (device_records, write_results, interpreter_shim)
from sparse_attention import picks  # noqa: E402  (the benchmark's random / local picks)

from hyscale_compile.runtime import sparse_attention as sa  # noqa: E402
from hyscale_compile.runtime.sparse_attention import Picks, backward, forward  # noqa: E402

H, DQK, DV, K = 128, 576, 512, 2048  # the MLA latent layer
# What each tries (the defaults came from earlier sweeps: SEGMENT_KEYS 16 -> 2, the contribution kernel's chunk
# loops pipelined 4 deep, the dq kernel's pick loop 2 deep): SEGMENT_KEYS, SEGMENT_COLS (the columns a segment
# program sums); CONTRIB_STAGES (1: not pipelined; the loops unrolled, as before, were 5% faster than 1);
# DQ_STAGES; CONTRIB_PICKS (64: the default before 128 picks a block halved the re-reads of q and dout,
# 487 -> 396 ms at 64K with dq / dkv as close to an fp64 reference; a few spilled registers, other dkv bits);
# CHUNK, WARPS, PROGRAMS_PER_SM (slices of a row's picks: changes dq's bits). Left out
# as they do not compile or fit: STAGES=2 or 3 with the chunk loops unrolled (0.9-1.3 MB of shared memory),
# PICKS=128 (the dq kernel's 311 KB).
VARIANTS = [
    {},
    dict(SEGMENT_KEYS=1), dict(SEGMENT_KEYS=4), dict(SEGMENT_KEYS=16), dict(SEGMENT_COLS=512),
    dict(CONTRIB_STAGES=1), dict(CONTRIB_STAGES=2), dict(CONTRIB_STAGES=3), dict(DQ_STAGES=1), dict(DQ_STAGES=3),
    dict(CONTRIB_PICKS=64), dict(CONTRIB_PICKS=64, CONTRIB_STAGES=2), dict(CHUNK=32), dict(WARPS=16),
    dict(PROGRAMS_PER_SM=8), dict(PROGRAMS_PER_SM=2),
]
KERNELS = {"contrib_ms": "_contrib_kernel", "segment_ms": "_segment_kernel", "dq_ms": "_dq_kernel"}


def problem(T: int, S: int, local: bool, device: str, heads: int = H, dqk: int = DQK, dv: int = DV, k: int = K,
            dt: torch.dtype = torch.bfloat16, head_major: bool = False):
    """(the backward's arguments after one forward): q [1, T, H, Dqk], kv [1, S, 1, Dqk] (v its first Dv), picks;
    head_major: dout [1, T, H, Dv] laid out [1, H, T, Dv], as autograd gives it in the rewritten model."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, heads, dqk, device=device, generator=g).to(dt)
    kv = torch.randn(1, S, 1, dqk, device=device, generator=g).to(dt)
    dout = torch.randn(1, T, heads, dv, device=device, generator=g).to(dt)
    if head_major:
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    idx = picks(T, S, k, local, device)
    pk = Picks(causal=True, offset=S - T)
    scale = dqk ** -0.5
    out, lse = forward.forward(q, kv, kv[..., :dv], idx, scale, pk, "zero")
    delta = sa.row_delta(dout, out, None)
    return dout, delta, q, kv, dv, lse, idx, scale, pk, "zero"


def split_ms(run, device: str) -> dict:
    """Device ms per backward by kernel (one warm call, then 3 profiled)."""
    if device != "cuda":
        return {}
    run()
    torch.cuda.synchronize()
    reps = 3
    records = training.device_records(lambda: [run() for _ in range(reps)])
    got = {key: 0.0 for key in (*KERNELS, "other_ms")}
    for name, us in records:
        key = next((k for k, kernel in KERNELS.items() if kernel in name), "other_ms")
        got[key] += us / 1e3 / reps
    got["total_ms"] = sum(got.values())
    return {k: round(v, 3) for k, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: TRITON_INTERPRET=1), prints only")
    parser.add_argument("--contexts", default="16384")
    parser.add_argument("--picks", choices=["random", "local"], default="random")
    parser.add_argument("--variants", default=None, help="indices into VARIANTS (default: all)")
    parser.add_argument("--dout", choices=["row-major", "head-major"], default="row-major",
                        help="dout's layout (head-major: the rewritten model's)")
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a without a GPU, print resources")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this long")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "tuning", "results",
                                                      "tune_sparse_backward.json"))
    args = parser.parse_args()
    if args.offline:  # the stand-in sm_90 driver, active before any kernel is built
        assert os.environ.get("TRITON_INTERPRET", "0") != "1", "--offline compiles for the GPU: unset TRITON_INTERPRET"
        sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
        import compile_for_gpu

        compile_for_gpu.install()
    else:
        training.interpreter_shim()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    every = [0, 1] if args.smoke else list(range(len(VARIANTS)))  # a smoke run shows the script runs: two will do
    chosen = [int(i) for i in args.variants.split(",")] if args.variants else every
    start, rows = time.perf_counter(), []
    contexts = [24] if args.smoke else [4096] if args.offline else [int(x) for x in args.contexts.split(",")]
    for S in contexts:
        small = dict(heads=4, dqk=24, dv=16, k=8, dt=torch.float32) if args.smoke else {}
        bargs = problem(S, S, args.picks == "local", device, **small, head_major=args.dout == "head-major")
        base = None
        for i in chosen:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: variant {i} not run")
                continue
            row = dict(T=S, S=S, H=small.get("heads", H), k=small.get("k", K), picks=args.picks, dout=args.dout,
                       variant=i, over=VARIANTS[i])
            try:
                seen = len(compile_for_gpu.resources) if args.offline else 0
                with training.overridden(backward, VARIANTS[i]):
                    got = backward.backward_latent(*bargs)
                    row.update(split_ms(lambda bargs=bargs: backward.backward_latent(*bargs), device))
                if args.offline:  # (name, shared bytes, registers, stack bytes) of what this variant compiled
                    row["resources"] = compile_for_gpu.resources[seen:]
                else:
                    base = got if base is None else base
                    row["same_bits"] = all(torch.equal(a, b) for a, b in zip(got, base))
            except Exception as e:  # noqa: BLE001  (a variant that does not compile or launch is a result)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(row, flush=True)
            rows.append(row)
            if not (args.smoke or args.offline):
                training.write_results(args.out, device, rows)


if __name__ == "__main__":
    main()
