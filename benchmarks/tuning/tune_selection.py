"""Tile shapes and append variants of the HyTopK kernels, timed stage by stage in one run.

This is the measurement behind ``TileConfig``'s defaults: for each tile config, the scoring floor,
the filter's compare alone, the filter with each append variant, sampling (and, for the first config,
with fewer sampling programs), the threshold, the final select (and its variants), the whole select,
and whether the result is bit-identical to the first config's. (It also timed the per-row rescore
against a kernel that scores whole filter tiles, up to results at 6eacd18; that kernel is now the
tests' cross-check, tests/kernels/rescore_tile.py, and the rescore's tuning is tune_replay.py.)

    python benchmarks/tuning/tune_selection.py [--out results/tune_selection.json] [--shapes 0,1]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_selection.py --smoke    # a tiny shape on the CPU, prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import final_select, final_sort, hytopk, score_tile  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import floor  # noqa: E402  (the selection benchmark's floor and compare-only kernels)
import training  # noqa: E402  (interpreter_shim)

SHAPES = [(4096, 131072, 16, 2048), (4096, 131072, 64, 2048)]
SMOKE_SHAPES = [(8, 300, 2, 8)]
D = 128
CONFIGS = [  # bt, bs, warps, stages, maxnreg
    (64, 128, 4, 2, None),
    (64, 128, 4, 3, None),
    (64, 128, 4, 2, 168),
    (64, 256, 8, 2, None),
]
SMOKE = False  # tiny shapes in the interpreter: nothing timed, the final select with a small pivot sample
SMALL_FINAL = dict(sample=32, chunk=256, list_chunk=256, warps=1)  # the interpreter sorts slowly; 8 warps fit
DEVICE = "cuda"


def bench(fn) -> float:
    if SMOKE:
        fn()
        return float("nan")
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def useful_flops(T: int, S: int, H: int) -> float:
    return 2.0 * (T * (S - T) + T * (T + 1) / 2) * H * D


def same(a, b) -> bool:
    return bool(torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)))


def final(full, k: int, used, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """final_select.select_sorted (select_rows with options) on the candidate buffers: values, positions."""
    return final_select.select_sorted(full, k, used=used, **({**SMALL_FINAL, **kw} if SMOKE else kw))[:2]


def final_composites(full, k: int, used, **kw):
    return final_select.select_composites(full, k, used=used, **({**SMALL_FINAL, **kw} if SMOKE else kw))


def run_config(q, kx, w, k, vis, cfg, ref) -> dict:
    bt, bs, warps, stages, maxnreg = cfg
    tuning = hytopk.Tuning(tile=score_tile.TileConfig(bt=bt, bs=bs, warps=warps, stages=stages, maxnreg=maxnreg),
                           table=False)  # the pipeline's stages, at any size
    scale = D**-0.5
    T, S, H = q.shape[1], kx.shape[1], q.shape[2]

    def problem(tile: score_tile.TileConfig = tuning.tile) -> tuple[hytopk.Problem, hytopk.Plan]:
        pb = hytopk.Problem(q, kx, w, scale, True, vis, float("-inf"), tile)
        return pb, hytopk.make_plan(pb, k, dataclasses.replace(tuning, tile=tile))

    pb, plan = problem()
    split = plan.filter_split
    sink = floor.sink(pb, split)
    row = dict(bt=bt, bs=bs, warps=warps, stages=stages, maxnreg=maxnreg)

    row["floor_ms"] = bench(lambda: floor.floor(pb, sink, split))
    row["floor_tflops"] = useful_flops(T, S, H) / row["floor_ms"] / 1e9
    buf, samp, msamp = hytopk.sample(pb, plan)
    row["sample_ms"] = bench(lambda: hytopk.sample(pb, plan))
    if cfg == CONFIGS[0]:  # fewer sampling programs, each over several tiles (q loaded once per program)
        for n in (16, 8, 4):
            fewer = hytopk.make_plan(pb, k, dataclasses.replace(tuning, sample_split=n))
            row[f"sample_split{n}_ms"] = bench(lambda fewer=fewer: hytopk.sample(pb, fewer))
    row["threshold_ms"] = bench(lambda: hytopk.threshold(pb, plan, buf, samp, msamp))
    thr = hytopk.threshold(pb, plan, buf, samp, msamp).filter_key
    row["compare_only_ms"] = bench(lambda: floor.count(pb, plan, thr, sink))
    for append in (3, 2, 0) if cfg == CONFIGS[0] else (None,):  # None: the default rule
        pa, pla = problem(dataclasses.replace(tuning.tile, append=append))
        name = f"filter_append{'_default' if append is None else append}_ms"
        try:
            row[name] = bench(lambda pa=pa, pla=pla: hytopk.filter_rows(pa, pla, thr, buf))
        except Exception as e:  # a variant that fails to compile is a result too
            row[name] = f"failed: {str(e)[:200]}"
    full, used = hytopk.candidates(pb, plan)
    rl = plan.row_lists  # as select runs it
    row["final_torch_ms"] = bench(lambda: final_select.select_rows_reference(full, k, used))
    row["final_kernel_ms"] = bench(lambda: final(full, k, used, row_lists=rl))
    # the final select's variants: scratch lists per program, in-kernel sort at 8 warps, unsorted,
    # or composites + torch.sort + decode
    row["final_kernel_program_lists_ms"] = bench(lambda: final(full, k, used))
    row["final_kernel_8warps_ms"] = bench(lambda: final(full, k, used, warps=8, row_lists=rl))
    row["final_unsorted_ms"] = bench(lambda: final(full, k, used, sort=False, row_lists=rl))
    comp, fast = final_composites(full, k, used, row_lists=rl)
    row["final_fast_path_rows"] = int(fast.sum())
    row["final_select_kernel_ms"] = bench(lambda: final_composites(full, k, used, row_lists=rl))
    row["final_sort_ms"] = bench(lambda: torch.sort(comp, dim=1, descending=True))
    srt = torch.sort(comp, dim=1, descending=True).values
    row["final_decode_ms"] = bench(lambda: final_sort.decode(srt))
    ref_sel = final_select.select_rows_reference(full, k, used)
    row["final_kernel_same"] = same(final(full, k, used, row_lists=rl), ref_sel)
    row["final_kernel_program_lists_same"] = same(final(full, k, used), ref_sel)
    row["final_kernel_8warps_same"] = same(final(full, k, used, warps=8, row_lists=rl), ref_sel)
    row["final_unsorted_same"] = same(final_sort.decode(srt), ref_sel)

    def sel():
        return hytopk.select(q, kx, w, k, scale, True, vis, float("-inf"), tuning=tuning)

    out = sel()
    row["select_ms"] = bench(sel)
    row["select_over_floor"] = row["select_ms"] / row["floor_ms"]
    row["same_as_first_config"] = None if ref is None else same(out, ref)
    for key, v in row.items():
        if isinstance(v, float):
            row[key] = round(v, 3)
    print(json.dumps(row), flush=True)
    return row, out


def main() -> None:
    global SMOKE, DEVICE, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_selection.json"))
    ap.add_argument("--shapes", default="0,1")
    ap.add_argument("--configs", default="all", help="'all' or indices into CONFIGS")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, the first config, nothing timed or written")
    args = ap.parse_args()
    shapes, configs = [SHAPES[int(s)] for s in args.shapes.split(",")], CONFIGS
    if args.configs != "all":
        configs = [CONFIGS[int(c)] for c in args.configs.split(",")]
    if args.smoke:
        SMOKE, D = True, 16
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        shapes, configs = SMOKE_SHAPES, CONFIGS[:1]
        training.interpreter_shim()
    res = dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__, date=datetime.date.today().isoformat(), shapes=[])
    for T, S, H, k in shapes:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
        q = torch.randn(1, T, H, D, device=DEVICE, dtype=dtype)
        kx = torch.randn(1, S, D, device=DEVICE, dtype=dtype)
        w = torch.randn(1, T, H, device=DEVICE, dtype=torch.float32) / math.sqrt(H)
        vis = Visibility(causal=True, offset=S - T)
        entry = dict(T=T, S=S, H=H, D=D, k=k, configs=[])
        res["shapes"].append(entry)
        ref = None
        for cfg in configs:
            try:
                row, out = run_config(q, kx, w, k, vis, cfg, ref)
            except Exception as e:
                if SMOKE:
                    raise
                row, out = dict(config=cfg, error=str(e)[:300]), None
                print(json.dumps(row), flush=True)
            entry["configs"].append(row)
            ref = ref if ref is not None else out
            write(res, args.out)


def write(res: dict, path: str) -> None:
    if SMOKE:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
