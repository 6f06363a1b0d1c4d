"""The Gluon rescore experiment (rescore_gluon.py) against the Triton rescore and its gather floor, in one run.

First its values against ``rescore.rescore``'s, bit for bit, on inputs that break kernels: random picks with
positions outside [0, S), no weights and no ReLU at D = 64 and H = 48, a negative scale, NaN / inf / zero rows, all
keys equal, a bool mask with a finite fill, an additive bias, fp16, one query row (its picks split over the SMs),
two stages, and the training shape's own selection. Then kernel times (profiler device records, no host gaps) at
the training shapes (k = 2048, D = 128, bf16, causal, the selection's own picks): the gather floor
(``floor.rescore_floor_kernel``), the Triton rescore, and the Gluon kernel at 2, 3 and 4 stages, with the gathers
alone and the scoring alone (``rescore_gluon.WS_MODE``) to place the time.

    python benchmarks/tuning/tune_rescore_gluon.py [--out results/tune_rescore_gluon.json]   # an sm_90 GPU
    python benchmarks/tuning/tune_rescore_gluon.py --offline   # no GPU: sm_90a registers, spills, shared memory
    python benchmarks/tuning/tune_rescore_gluon.py --smoke     # the same as --offline, whatever TRITON_INTERPRET says

Gluon has no interpreter, so the smoke run (tests/test_benchmark_smokes.py) is the offline build, in a process of
its own without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

if "--smoke" in sys.argv:  # Gluon has no interpreter: the smoke run is the offline sm_90a build
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sys.exit(subprocess.run([sys.executable, os.path.abspath(__file__), "--offline"], env=env).returncode)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), HERE]
if "--offline" in sys.argv:  # the stand-in sm_90 driver must be active before any kernel is built
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    import compile_for_gpu  # noqa: E402

    compile_for_gpu.install()

import rescore_gluon as rg  # noqa: E402
import training  # noqa: E402  (make_inputs, rescore_args, rescore_floor_run, kernel_ms, write_results)

from hyscale_compile.runtime import rescore as rs  # noqa: E402
from hyscale_compile.runtime.problem import Problem  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

SHAPES = [(4096, 131072, 64), (4096, 131072, 16)]  # (T, S, H): the training benchmark's, H = 64 first
VARIANTS = [dict(WS_STAGES=3), dict(WS_STAGES=2), dict(WS_STAGES=4), dict(WS_STAGES=3, WS_MODE=1),
            dict(WS_STAGES=3, WS_MODE=2)]
DEFAULTS = dict(WS_STAGES=rg.WS_STAGES, WS_MODE=rg.WS_MODE)


def configure(**settings) -> None:
    for name, value in {**DEFAULTS, **settings}.items():
        setattr(rg, name, value)


def gluon_rescore(q, kx, w, idx, scale, relu, vis, fill, **settings):
    configure(**settings)
    try:
        pb = Problem(q, kx, w, scale, relu, vis, fill)
        out = torch.full(idx.shape, 12345.0, device=q.device)  # a value neither kernel writes
        rg.launch(pb, idx.to(torch.int64).contiguous(), out)
    finally:  # a failing check must not leave its settings to the next
        configure()
    return out


def check(name: str, *args, **settings) -> dict:
    """Bit-for-bit agreement of the Gluon kernel's values with rescore.rescore's on the same arguments."""
    try:
        ref = rs.rescore(*args)
        got = gluon_rescore(*args, **settings)
        differ = ref.view(torch.int32) != got.view(torch.int32)
        row = dict(check=name, values=ref.numel(), mismatches=int(differ.sum()))
    except Exception as e:  # noqa: BLE001  (a failing case is a row, not the end of the run)
        row = dict(check=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(row, flush=True)
    return row


def checks(dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(1)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    B, T, S, H, D, K = 2, 37, 1000, 64, 128, 300
    q, kx, w = rnd(B, T, H, D), rnd(B, S, D), torch.rand(B, T, H, device=dev, generator=g)
    idx = torch.randint(-3, S + 5, (B, T, K), device=dev, generator=g)
    causal = Visibility(causal=True, offset=S - T)
    ninf = float("-inf")
    qn, kn = q.clone(), kx.clone()
    qn[0, 3, 5, 7], qn[1, 0] = float("nan"), 0
    kn[:, 7], kn[:, 8] = float("inf"), 0
    mask = torch.rand(B, T, S, device=dev, generator=g) > 0.3
    bias = torch.randn(B, T, S, device=dev, generator=g)
    q1, idx1 = rnd(1, 1, 64, 128), torch.randint(0, S, (1, 1, 2048), device=dev, generator=g)
    return [
        check("random_causal", q, kx, w, idx, 0.088, True, causal, ninf),
        check("no_weights_no_relu_D64_H48", rnd(B, T, 48, 64), rnd(B, S, 64), None, idx, 0.125, False, Visibility(),
              -1.0),
        check("negative_scale", q, kx, w, idx, -0.5, True, causal, ninf),
        check("nan_inf_zero", qn, kn, w, idx.clamp(0, 20), 0.088, True, causal, ninf),
        check("all_keys_equal", q, torch.ones_like(kx), w, idx, 0.088, True, Visibility(), ninf),
        check("bool_mask_fill", q, kx, w, idx, 0.088, True, Visibility(mask=mask), -2.0),
        check("additive_bias", q, kx, w, idx, 0.088, True, Visibility(bias=bias), ninf),
        check("fp16", q.half(), kx.half(), w, idx, 0.088, True, causal, ninf),
        check("one_row_split", q1, kx[:1], w[:1, :1], idx1, 0.088, True, Visibility(causal=True, offset=S - 1), ninf),
        check("two_stages", q, kx, w, idx, 0.088, True, causal, ninf, WS_STAGES=2),
    ]


def times(dev: str, T: int, S: int, H: int, out_rows: list[dict]) -> dict:
    inputs = training.make_inputs(T, S, H, 128, 2048, dev, torch.bfloat16)
    args = training.rescore_args(inputs, 2048)
    q, kx, w, idx, scale, relu, causal, offset = args[:8]
    vis = Visibility(causal=causal, offset=offset)
    ninf = float("-inf")
    if H == SHAPES[0][2]:
        out_rows.append(check(f"training_T{T}_S{S}_H{H}", q, kx, w, idx, scale, relu, vis, ninf))
    row = dict(T=T, S=S, H=H, k=2048, D=128)
    row["floor_ms"] = round(training.kernel_ms(training.rescore_floor_run(args), "rescore_floor_kernel"), 4)
    row["triton_ms"] = round(training.kernel_ms(lambda: rs.rescore(q, kx, w, idx, scale, relu, vis, ninf),
                                                "rescore_kernel"), 4)
    idx64 = idx.to(torch.int64).contiguous()
    out = torch.empty(idx.shape, device=dev)
    pb = Problem(q, kx, w, scale, relu, vis, ninf)
    for v in VARIANTS:
        label = "gluon_ms_" + "_".join(f"{k[3:].lower()}{val}" for k, val in v.items())
        configure(**v)
        row[label] = round(training.kernel_ms(lambda: rg.launch(pb, idx64, out), "rescore_ws_kernel"), 4)
        configure()
    row["gluon_over_floor"] = round(row["gluon_ms_stages3"] / row["floor_ms"], 3)
    row["triton_over_floor"] = round(row["triton_ms"] / row["floor_ms"], 3)
    print(row, flush=True)
    return row


def offline() -> None:
    """Compiles the kernel for sm_90a at H = 64 and 16 through the stand-in driver; prints ptxas' resources."""
    for H in (64, 16):
        B, T, S, D, K = 1, 8, 4096, 128, 256
        q, kx, w = torch.randn(B, T, H, D).bfloat16(), torch.randn(B, S, D).bfloat16(), torch.rand(B, T, H)
        idx = torch.randint(0, S, (B, T, K))
        pb = Problem(q, kx, w, 0.088, True, Visibility(causal=True, offset=S - T), float("-inf"))
        rg.launch(pb, idx, torch.empty(B, T, K), sms=132)
        name, shared, regs, stack = compile_for_gpu.resources[-1]
        print(f"H={H}: {name} shared {shared} B, registers {regs}, stack {stack} B")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "tune_rescore_gluon.json"))
    ap.add_argument("--offline", action="store_true", help="compile for sm_90a only (no GPU)")
    args = ap.parse_args()
    if args.offline:
        offline()
        return
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), "needs an sm_90 GPU"
    started = time.time()
    found = checks("cuda")
    rows = [times("cuda", T, S, H, found) for T, S, H in SHAPES]
    training.write_results(args.out, "cuda", rows, checks=found, seconds=round(time.time() - started))


if __name__ == "__main__":
    main()
