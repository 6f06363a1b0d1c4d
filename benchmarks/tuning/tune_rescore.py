"""The rescore against its own gather floor: variants of ``rescore.RESCORE_*`` at the training shapes, in one run.

The issue's bar: the rescore at most 1.5x its gather floor (the time to read the same key rows,
``floor.rescore_floor_kernel``) at every training shape. For each variant (overrides of the RESCORE_*
settings, the default first) and shape: the kernel's own time per call (profiler device records, no
host gaps: ``device_ms``), its ratio to the floor timed in the same run at the default launch
(``over_floor``), mismatches against select's values and against the default variant's output (bit
for bit; any variant with a mismatch is not a candidate), and on CUDA the compiled kernel's registers
and spills. Floors at two other launches are reference rows. Shapes are the training benchmark's (k =
2048, D = 128, bf16, causal, queries at the end of the context), H = 64 first. Rows are written after
every shape, so a run cut short keeps what it measured.

    python benchmarks/tuning/tune_rescore.py [--shapes 0,1,2] [--variants 0,3,9] [--out results/tune_rescore.json]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_rescore.py --smoke      # tiny shapes on the CPU, prints only
    python benchmarks/tuning/tune_rescore.py --offline    # no GPU: sm_90a registers / spills / shared memory

``--offline`` compiles every variant at H = 16 and 64 for sm_90a through the tests' stand-in driver
(tests/kernels/compile_for_gpu.py) and prints registers, spill bytes and shared memory from ptxas: a
variant that spills there was left out of VARIANTS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
if "--offline" in sys.argv:  # the stand-in sm_90 driver must be active before any kernel is built
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "--offline compiles for the GPU: unset TRITON_INTERPRET"
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    import compile_for_gpu

    compile_for_gpu.install()

import floor  # noqa: E402  (the rescore's gather floor)
import training  # noqa: E402  (write_results, device_records, interpreter_shim)

from hyscale_compile.runtime import hytopk, rescore  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

SHAPES = [(4096, 131072, 64), (2048, 65536, 16), (4096, 131072, 16)]  # (T, S, H): the bar's worst first
D, K = 128, 2048
DEVICE = "cuda"
DEADLINE = float("inf")  # perf_counter time after which no further variant is started (--budget-s)
# --smoke under the interpreter: the dots and head sums are numpy's, whose summation order follows the array
# shapes and the CPU's SIMD width, so the bit-for-bit checks hold only where the arithmetic is exact
EXACT = False
NAMES = ("BJ", "STAGE_BYTES", "MAX_BH", "GROUPS", "BLOCKS", "STAGES", "WARPS", "W_ONCE", "MAXNREG", "QUAD")

# Overrides of the RESCORE_* settings, the default ({}) first. Every one compiled offline for sm_90a
# without spills at H = 16 and 64 (--offline). What each tries (NOTES-selection.md, "rescore floor"):
#   stages / blocks: keys in flight per program; W_ONCE=False: 64 fewer registers at H = 64 (the weights
#   loaded per block from L1); BJ=64: half the shared memory per program (50 KB at H = 64, 4 programs per
#   SM instead of 2); MAX_BH + GROUPS: the heads as unrolled 32- or 16-head MMAs, a smaller convert per
#   MMA; WARPS=8: two warpgroups per block; BJ=256: fewer, larger blocks; STAGES=1: no cp.async; QUAD=False:
#   each key's heads regrouped through shared memory, not by quad_transpose's warp shuffles (the default since v24).
VARIANTS = [
    {},
    dict(STAGES=2), dict(STAGES=4), dict(BLOCKS=4), dict(BLOCKS=16),
    dict(W_ONCE=False), dict(W_ONCE=False, STAGES=4), dict(W_ONCE=False, BLOCKS=16),
    dict(WARPS=8), dict(WARPS=8, W_ONCE=False), dict(WARPS=8, STAGES=2),
    dict(BJ=64, BLOCKS=16), dict(BJ=64, BLOCKS=16, W_ONCE=False), dict(BJ=64, BLOCKS=32, W_ONCE=False),
    dict(BJ=64, BLOCKS=16, W_ONCE=False, STAGES=4), dict(BJ=64, BLOCKS=16, W_ONCE=False, STAGES=2),
    dict(BJ=64, BLOCKS=8, W_ONCE=False),
    dict(BJ=64, BLOCKS=16, MAX_BH=32, GROUPS=2), dict(BJ=64, BLOCKS=16, MAX_BH=32, GROUPS=2, W_ONCE=False),
    dict(BJ=64, BLOCKS=32, MAX_BH=32, GROUPS=2, W_ONCE=False, STAGES=4),
    dict(BJ=64, BLOCKS=16, MAX_BH=16, GROUPS=4, W_ONCE=False),
    dict(MAX_BH=32, GROUPS=2), dict(MAX_BH=32, GROUPS=2, W_ONCE=False),
    dict(BJ=256, STAGE_BYTES=65536, WARPS=8, BLOCKS=4, STAGES=2),
    dict(BJ=256, STAGE_BYTES=65536, WARPS=8, BLOCKS=4, STAGES=2, W_ONCE=False),
    dict(STAGES=1, W_ONCE=False),
    dict(QUAD=False), dict(QUAD=False, STAGES=4), dict(BLOCKS=8), dict(MAX_BH=32, GROUPS=2, QUAD=False),
]
# Floors at other launches, reference rows (the first floor row is always the default launch's).
FLOOR_VARIANTS = [dict(BJ=64, BLOCKS=16), dict(WARPS=8)]


def device_ms(fn, name: str, reps: int = 10) -> float:
    """Kernel ``name``'s time per call: the profiler's device records of ``reps`` calls (no host gaps)."""
    if DEVICE != "cuda":
        return float("nan")
    return round(training.kernel_ms(fn, name, reps), 4)


def _compiled(call):
    """call() with rescore_kernel's in-memory kernels dropped first (Triton's disk cache makes that cheap):
    (its result, the compiled kernel it launched, or None under the interpreter)."""
    caches = getattr(rescore.rescore_kernel, "device_caches", None)
    if caches is None:
        return call(), None
    caches.clear()
    out = call()
    kernels = list(caches[torch.cuda.current_device() if DEVICE == "cuda" else 0][0].values())
    return out, kernels[0] if kernels else None


def effective(H: int) -> tuple:
    """What the current RESCORE_* settings launch at H heads (bf16, D = 128): equal tuples, equal launches."""
    bj, bh = rescore.rescore_shape(H, D, 2, "ieee")
    return (bj, bh, rescore.unrolled_groups(H, bh), rescore.RESCORE_BLOCKS, rescore.RESCORE_STAGES,
            rescore.RESCORE_WARPS, rescore.RESCORE_W_ONCE, rescore.RESCORE_MAXNREG, rescore.RESCORE_QUAD)


def inputs(T: int, S: int, H: int):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    if EXACT:  # eighths and quarters: every product and sum exact, so any summation order gives the same bits
        q = torch.randint(-4, 5, (1, T, H, D), device=DEVICE, generator=g).to(torch.bfloat16) / 8
        kx = torch.randint(-4, 5, (1, S, D), device=DEVICE, generator=g).to(torch.bfloat16) / 8
        return q, kx, torch.randint(0, 5, (1, T, H), device=DEVICE, generator=g).float() / 4
    q = torch.randn(1, T, H, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    kx = torch.randn(1, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    w = torch.rand(1, T, H, device=DEVICE, generator=g)
    return q, kx, w


def shape_rows(T: int, S: int, H: int, variants: list[int]) -> list[dict]:
    q, kx, w = inputs(T, S, H)
    vis = Visibility(causal=True, offset=S - T)
    scale = D**-0.5
    values, idx = hytopk.select(q, kx, w, K, scale, True, vis, float("-inf"))
    args = (q, kx, w, idx, scale, True, vis, float("-inf"))
    rows = []
    floor_ms = None
    for i, over in enumerate([{}] + FLOOR_VARIANTS):
        with training.overridden(rescore, over, "RESCORE_"):
            run, sink = floor.rescore_floor(*args)
            row = dict(kernel="rescore_floor", **{n.lower(): getattr(rescore, "RESCORE_" + n) for n in NAMES})
            try:
                run()  # the floor reads every picked key row once: its sinks add up to their sum
                want = kx[0, idx.reshape(-1)].float().sum()
                row["sum_ok"] = bool(torch.isclose(sink.sum().double(), want.double(), rtol=1e-3, atol=1e-2))
                row["device_ms"] = device_ms(run, "rescore_floor_kernel")
                row["gb_per_s"] = round(T * K * D * 2 / row["device_ms"] / 1e6, 1) if DEVICE == "cuda" else None
            except Exception as e:  # a reference row that fails must not lose the rows after it
                row["failed"] = str(e)[:300]
        if i == 0:
            floor_ms = row.get("device_ms")
        print(json.dumps(row), flush=True)
        rows.append(row)
    first = None
    launched = {}  # what a variant launches at this H -> the first variant that launched it
    for v in variants:
        over = VARIANTS[v]
        with training.overridden(rescore, over, "RESCORE_"):
            row = dict(kernel="rescore", variant=v, over=over,
                       **{n.lower(): getattr(rescore, "RESCORE_" + n) for n in NAMES})
            key = effective(H)
            if time.perf_counter() > DEADLINE:
                row["skipped"] = "budget"
                rows.append(row)
                continue
            if key in launched:  # e.g. head groups at H = 16: the same kernel and launch as an earlier variant
                row["same_as"] = launched[key]
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            launched[key] = v
            try:
                def run():
                    return rescore.rescore(*args)

                out, kern = _compiled(run)
                if kern is not None and DEVICE == "cuda":
                    row.update(regs=kern.n_regs, spills=kern.n_spills, shared=kern.metadata.shared)
                if first is None:
                    first = out
                row["mismatches_select"] = int((out.view(torch.int32) != values.view(torch.int32)).sum())
                row["mismatches_default"] = int((out.view(torch.int32) != first.view(torch.int32)).sum())
                row["device_ms"] = device_ms(run, "rescore_kernel")
                if floor_ms:
                    row["over_floor"] = round(row["device_ms"] / floor_ms, 3)
            except Exception as e:  # a variant that fails to compile or run is a result too
                row["failed"] = str(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return [dict(T=T, S=S, H=H, D=D, k=K, **r) for r in rows]


def table(rows: list[dict]) -> str:
    """device ms and ratio to the floor, a variant a line, a shape a column; '!' marks a mismatch."""
    shapes = sorted({(r["T"], r["S"], r["H"]) for r in rows}, key=lambda s: SHAPES.index(s) if s in SHAPES else 0)
    head = "variant".ljust(62) + "".join(f"{f'{T}/{S}/{H}':>22}" for T, S, H in shapes)
    lines = [head]
    for r0 in [r for r in rows if r["kernel"] == "rescore_floor"][: len(FLOOR_VARIANTS) + 1]:
        label = "floor " + json.dumps({k: r0[k] for k in ("bj", "blocks", "warps", "stages")})
        cells = []
        for s in shapes:
            m = [r for r in rows if r["kernel"] == "rescore_floor" and (r["T"], r["S"], r["H"]) == s
                 and all(r[k] == r0[k] for k in ("bj", "blocks", "warps", "stages", "max_bh"))]
            cells.append(f"{m[0].get('device_ms', 'failed')!s:>22}" if m else " " * 22)
        lines.append(label[:62].ljust(62) + "".join(cells))
    for v in sorted({r["variant"] for r in rows if r["kernel"] == "rescore"}):
        cells = []
        for s in shapes:
            m = [r for r in rows if r["kernel"] == "rescore" and r["variant"] == v and (r["T"], r["S"], r["H"]) == s]
            if not m:
                cells.append(" " * 22)
            elif "skipped" in m[0]:
                cells.append(f"{'skipped':>22}")
            elif "same_as" in m[0]:
                cells.append(f"{'= ' + str(m[0]['same_as']):>22}")
            elif "failed" in m[0]:
                cells.append(f"{'failed':>22}")
            else:
                r = m[0]
                bad = "!" if r["mismatches_select"] or r["mismatches_default"] else ""
                cell = f"{r['device_ms']} ({r.get('over_floor', '-')}x){bad}"
                cells.append(f"{cell:>22}")
        lines.append(f"{v:>2} {json.dumps(VARIANTS[v])}"[:62].ljust(62) + "".join(cells))
    return "\n".join(lines)


def offline(variants: list[int]) -> None:
    """Each variant compiled for sm_90a at H = 16 and 64 (nothing launched): registers, spills, shared memory."""
    from triton.backends.nvidia import compiler as nvc

    ptxas = os.path.join(os.path.dirname(nvc.__file__), "bin", "ptxas")
    for H in (64, 16):
        q, kx, w = torch.randn(1, 4, H, D).bfloat16(), torch.randn(1, 1024, D).bfloat16(), torch.rand(1, 4, H)
        idx = torch.randint(0, 1000, (1, 4, K))
        for v in variants:
            with training.overridden(rescore, VARIANTS[v], "RESCORE_"):
                _, kern = _compiled(lambda q=q, kx=kx, w=w, idx=idx: rescore.rescore(
                    q, kx, w, idx, D**-0.5, True, Visibility(causal=True, offset=1020), float("-inf")))
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(kern.asm["ptx"])
                cap = ["--maxrregcount", str(rescore.RESCORE_MAXNREG)] if rescore.RESCORE_MAXNREG else []
                err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull, *cap],
                                     capture_output=True, text=True).stderr
                os.unlink(f.name)
                regs = re.findall(r"Used (\d+) registers", err)
                spills = re.findall(r"(\d+) bytes spill stores", err)
                print(f"H={H} {v:>2} {json.dumps(VARIANTS[v])}: registers {regs[0] if regs else '?'}, spill stores "
                      f"{spills[0] if spills else '?'} B, shared {kern.metadata.shared} B", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--variants", default=None, help="indices into VARIANTS (default all; 0 is always run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_rescore.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, prints only")
    ap.add_argument("--budget-s", type=float, default=140.0, help="start no variant after this many seconds")
    ap.add_argument("--offline", action="store_true", help="compile for sm_90a without a GPU: registers, spills")
    args = ap.parse_args()
    variants = sorted({0, *map(int, args.variants.split(","))}) if args.variants else list(range(len(VARIANTS)))
    if args.offline:
        global DEVICE, K
        DEVICE, K = "cpu", 256
        offline(variants)
        return
    if args.smoke:
        global SHAPES, D, EXACT
        SHAPES, D, K = [(3, 120, 40), (3, 120, 19)], 16, 100
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        EXACT = DEVICE == "cpu"
        args.shapes = "0,1"
        if not args.variants:  # the interpreter runs each variant: a few that take every path
            variants = [0, 5, 11, 18, 20, 23]
        training.interpreter_shim()
    rows = []
    t0 = time.perf_counter()
    global DEADLINE
    DEADLINE = t0 + args.budget_s
    for i in map(int, args.shapes.split(",")):
        rows += shape_rows(*SHAPES[i], variants)
        if not args.smoke:
            training.write_results(args.out, "cuda", rows)
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    print(table(rows))
    print(f"{time.perf_counter() - t0:.1f} s")
    if args.smoke:
        bad = [r for r in rows if "failed" in r or not r.get("sum_ok", True) or r.get("mismatches_select")
               or r.get("mismatches_default")]
        assert not bad, bad


if __name__ == "__main__":
    main()
