"""Variants of the two kernels a replayed backward runs, timed in one run: ``rescore`` and the sparse
backward (dq, dw, dkx through the k picks only).

This is the measurement behind the defaults ``rescore.RESCORE_*`` and ``sparse_backward.ROW_*`` /
``PROGRAMS_PER_SM``. For each variant: the median time of a call (triton's do_bench: host gaps
included when the host is slower than the kernels), the kernels' own time per call (profiler device
records, ``device_ms``) and a check: rescore must equal select's values bit for bit; a sparse
backward variant must match the first variant to fp32 rounding and repeat its own bits. Reference
rows: ``gather_floor``, a kernel that only gathers the rescore's keys and writes one float per pick
(what the rescore's memory traffic alone costs), at the rescore's own blocks and grid and at shapes
with more bytes in flight, the fastest being the estimate of the device's gather rate; and the sparse
backward with float atomics for dkx (the rule: deterministic by default unless it costs more than
1.3x the atomic one). Shapes are the training benchmark's (k=2048, D=128, bf16, causal, queries
at the end of the context).

    python benchmarks/tuning/tune_replay.py [--shapes 0,1,2] [--defaults-only] [--out results/tune_replay.json]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_replay.py --smoke    # tiny shapes on the CPU, prints only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import hytopk, rescore  # noqa: E402
from hyscale_compile.runtime import sparse_backward as sb  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import training  # noqa: E402  (write_results: the results file every benchmark here writes)

SHAPES = [(2048, 65536, 16), (4096, 131072, 16), (4096, 131072, 64)]  # (T, S, H)
D, K = 128, 2048
DEVICE = "cuda"

# Overrides of rescore's RESCORE_* settings, the default ({}) first; the second is the rescore before
# all heads went into one MMA (a loop over 16-head groups at H=64, weights loaded per block).
RESCORE_VARIANTS = [{}, dict(BJ=64, BLOCKS=16, MAX_BH=16, W_ONCE=False), dict(BJ=64, BLOCKS=16), dict(STAGES=2),
                    dict(BLOCKS=4), dict(BLOCKS=16), dict(W_ONCE=False), dict(WARPS=8)]
# Gather floor shapes (keys per load, loads per program, warps, stages): the rescore's own first.
GATHER_VARIANTS = [(rescore.RESCORE_BJ, rescore.RESCORE_BLOCKS, 4, rescore.RESCORE_STAGES), (64, 16, 8, 3),
                   (128, 8, 8, 3), (32, 32, 4, 4), (64, 32, 4, 4), (16, 64, 2, 4)]
# (row picks, stages, programs per SM; 0: one slice per row, no partial sums; deterministic dkx);
# None: the default rule (sparse_backward._row_shape). The first is the reference of the others.
BACKWARD_VARIANTS = [(None, None, None, True), (None, None, None, False), (32, 1, 0, True), (32, 3, 0, True),
                     (32, 3, 8, True), (64, 3, 8, True), (32, 2, 8, True), (32, 3, 16, True), (16, 3, 8, True)]


def bench(fn) -> float:
    if DEVICE != "cuda":
        return float("nan")
    return round(do_bench(fn, warmup=25, rep=150, return_mode="median"), 3)


def device_ms(fn, reps: int = 5) -> float:
    """Kernel time per call: the profiler's device records of ``reps`` calls (no host gaps)."""
    if DEVICE != "cuda":
        return float("nan")
    return round(training.kernel_ms(fn, reps=reps), 3)


@triton.jit
def _gather_floor_kernel(kx_ptr, idx_ptr, out_ptr, K, picks, D: tl.constexpr, BJ: tl.constexpr):
    # The rescore's loads and stores without its arithmetic: per program one row's `picks` keys, BJ at
    # a time, each gathered row summed to one float (so no load can be dropped) and stored per pick.
    r = tl.program_id(0).to(tl.int64)
    j_lo = tl.program_id(1).to(tl.int64) * picks
    j_hi = tl.minimum(j_lo + picks, K)
    ds = tl.arange(0, D)
    for j0 in range(j_lo, j_hi, BJ):
        j = j0 + tl.arange(0, BJ)
        ok = j < j_hi
        cols = tl.load(idx_ptr + r * K + j, mask=ok, other=0)
        kg = tl.load(kx_ptr + cols[:, None] * D + ds[None, :], mask=ok[:, None], other=0.0)
        tl.store(out_ptr + r * K + j, tl.sum(kg.to(tl.float32), axis=1), mask=ok)


def gather_floor_rows(kx, idx) -> list[dict]:
    """The gather floor at the rescore's own shape (the first variant), then shapes with more bytes in
    flight (GATHER_VARIANTS): the fastest is the best estimate of this device's gather rate. Each also
    with "sequential" positions (pick j of row t reads key (t * K + j) mod S): the same bytes from the
    same L2-resident keys in order, the estimate of the best rate any gather of these rows reaches."""
    T, S = idx.shape[1], kx.shape[1]
    out = torch.empty(T, K, dtype=torch.float32, device=kx.device)
    patterns = dict(picks=idx.reshape(T, K).contiguous(),
                    sequential=torch.arange(T * K, device=kx.device).remainder(S).reshape(T, K))
    rows = []
    for (bj, blocks, warps, stages), pattern in itertools.product(GATHER_VARIANTS, patterns):
        flat = patterns[pattern]
        picks = bj * blocks

        def run(bj=bj, picks=picks, warps=warps, stages=stages, flat=flat):
            _gather_floor_kernel[(T, triton.cdiv(K, picks))](kx, flat, out, K, picks, D=D, BJ=bj, num_warps=warps,
                                                              num_stages=stages)

        row = dict(kernel="gather_floor", pattern=pattern, bj=bj, blocks=blocks, warps=warps, stages=stages)
        try:
            run()
            row.update(ms=bench(run), device_ms=device_ms(run), bytes_gathered=T * K * D * kx.element_size())
        except Exception as e:  # a reference row that fails must not lose the rows measured after it
            row["failed"] = str(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


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
    names = ("BJ", "BLOCKS", "STAGES", "MAX_BH", "WARPS", "W_ONCE")  # RESCORE_BJ: at most, see rescore_shape
    for over in RESCORE_VARIANTS:
        with training.overridden(rescore, over, "RESCORE_"):

            def run():
                return hytopk.rescore(q, kx, w, idx, scale, True, vis, float("-inf"))

            row = dict(kernel="rescore", **{n.lower(): getattr(rescore, "RESCORE_" + n) for n in names},
                       heads_per_mma=rescore.rescore_heads_per_mma(q.shape[2]))
            try:
                out = run()
                row.update(ms=bench(run), device_ms=device_ms(run),
                           mismatches=int((out.view(torch.int32) != values.view(torch.int32)).sum()))
            except Exception as e:  # a variant that fails to compile is a result too
                row["failed"] = str(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows + gather_floor_rows(kx, idx)


def backward_rows(q, kx, w, vis) -> list[dict]:
    T, S = q.shape[1], kx.shape[1]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    idx = torch.randint(0, S - T, (1, T, K), device=DEVICE, generator=g)
    gv = torch.randn(1, T, K, device=DEVICE, generator=g)
    rows, first = [], None
    old = (sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM, sb.PREFER_DETERMINISTIC)
    sb.PREFER_DETERMINISTIC = False  # deterministic=False really means float atomics
    try:
        for picks, stages, per_sm, det in BACKWARD_VARIANTS:
            sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM = picks, stages, per_sm

            def run(det=det):
                return sb.sparse_backward(gv, q, kx, w, idx, D**-0.5, True, vis, deterministic=det)

            row = dict(kernel="sparse_backward", row_picks=picks, stages=stages, programs_per_sm=per_sm,
                       dkx="deterministic" if det else "atomic")
            try:
                out = run()
                again = run()
                row.update(ms=bench(run), device_ms=device_ms(run),
                           repeatable=all(torch.equal(a, b) for a, b in zip(out, again)))
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
        sb.ROW_PICKS, sb.ROW_STAGES, sb.PROGRAMS_PER_SM, sb.PREFER_DETERMINISTIC = old
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_replay.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, prints only")
    ap.add_argument("--defaults-only", action="store_true",
                    help="the default rescore and backward (and the atomic one) only, no other variants")
    args = ap.parse_args()
    if args.defaults_only:
        global RESCORE_VARIANTS, BACKWARD_VARIANTS, GATHER_VARIANTS
        RESCORE_VARIANTS = RESCORE_VARIANTS[:1]
        BACKWARD_VARIANTS = BACKWARD_VARIANTS[:2]
        GATHER_VARIANTS = GATHER_VARIANTS[:1]
    if args.smoke:
        global SHAPES, D, K, DEVICE
        SHAPES, D, K = [(20, 90, 16), (20, 90, 19)], 32, 24
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        args.shapes = "0,1"
        training.interpreter_shim()
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
