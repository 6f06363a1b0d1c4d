"""Tile shapes and append variants of the HyTopK kernels, timed stage by stage in one run.

This is the measurement behind ``TileConfig``'s defaults: for each tile config, the scoring floor,
the filter's compare alone, the filter with each append variant, sampling (and, for the first config,
with fewer sampling programs), the threshold, the final select (and its variants), the whole select,
and whether the result is bit-identical to the first config's. It also times the per-row rescore
kernel against the whole-tile one and checks they agree bit for bit.

    python benchmarks/tune_selection.py [--out results/tune_selection.json] [--shapes 0,1]
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyscale_compile.runtime import final_select, hytopk, score_tile  # noqa: E402
from hyscale_compile.runtime.filter_kernels import MODE_COUNT, MODE_FLOOR  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import selection  # noqa: E402  (block_launch: the selection benchmark's own floor launch)

SHAPES = [(4096, 131072, 16, 2048), (4096, 131072, 64, 2048)]
D = 128
CONFIGS = [  # bt, bs, warps, stages, maxnreg
    (64, 128, 4, 2, None),
    (64, 128, 4, 3, None),
    (64, 128, 4, 2, 168),
    (64, 256, 8, 2, None),
]


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def useful_flops(T: int, S: int, H: int) -> float:
    return 2.0 * (T * (S - T) + T * (T + 1) / 2) * H * D


def same(a, b) -> bool:
    return bool(torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)))


def run_config(q, kx, w, k, vis, cfg, ref) -> dict:
    bt, bs, warps, stages, maxnreg = cfg
    score_tile.TILE = score_tile.TileConfig(bt=bt, bs=bs, warps=warps, stages=stages, maxnreg=maxnreg)
    scale = D**-0.5
    T, S, H = q.shape[1], kx.shape[1], q.shape[2]
    pb = hytopk._Problem(q, kx, w, scale, True, vis, float("-inf"))
    split = hytopk.filter_split(pb)
    sink = torch.empty(pb.n_tblk * split * bt, device="cuda")
    row = dict(bt=bt, bs=bs, warps=warps, stages=stages, maxnreg=maxnreg)

    row["floor_ms"] = bench(lambda: selection.block_launch(pb, MODE_FLOOR, sink, split))
    row["floor_tflops"] = useful_flops(T, S, H) / row["floor_ms"] / 1e9
    buf, samp, msamp = hytopk.sample(pb, k)
    row["sample_ms"] = bench(lambda: hytopk.sample(pb, k))
    if cfg == CONFIGS[0]:  # fewer sampling programs, each over several tiles (q loaded once per program)
        for split in (16, 8, 4):
            with hytopk.override(sample_split=split):
                row[f"sample_split{split}_ms"] = bench(lambda: hytopk.sample(pb, k))
    row["threshold_ms"] = bench(lambda: hytopk.threshold(pb, k, buf, samp, msamp))
    thr = hytopk.threshold(pb, k, buf, samp, msamp)
    _, cap, _ = hytopk.sizes(k, S)
    row["compare_only_ms"] = bench(lambda: hytopk.filter_rows(pb, thr, buf, cap, MODE_COUNT, sink))
    for append in (3, 2, 0) if cfg == CONFIGS[0] else (None,):  # None: the default rule
        pb.tile = dataclasses.replace(pb.tile, append=append)
        name = f"filter_append{'_default' if append is None else append}_ms"
        try:
            row[name] = bench(lambda: hytopk.filter_rows(pb, thr, buf, cap))
        except Exception as e:  # a variant that fails to compile is a result too
            row[name] = f"failed: {str(e)[:200]}"
    pb.tile = dataclasses.replace(pb.tile, append=score_tile.TILE.append)
    full, used = hytopk.candidates(pb, k)
    rl = hytopk.row_lists(k, S, full.shape[1], vis)  # as select runs it
    row["final_torch_ms"] = bench(lambda: final_select.select_rows_reference(full, k, used))
    row["final_kernel_ms"] = bench(lambda: final_select.select_rows(full, k, used, row_lists=rl))
    # the final select's variants: scratch lists per program, in-kernel sort at 8 warps, unsorted,
    # or composites + torch.sort + decode
    row["final_kernel_program_lists_ms"] = bench(lambda: final_select.select_rows(full, k, used))
    row["final_kernel_8warps_ms"] = bench(lambda: final_select.select_sorted(full, k, used=used, warps=8,
                                                                             row_lists=rl))
    row["final_unsorted_ms"] = bench(lambda: final_select.select_sorted(full, k, used=used, sort=False, row_lists=rl))
    comp, fast = final_select.select_composites(full, k, used=used, row_lists=rl)
    row["final_fast_path_rows"] = int(fast.sum())
    row["final_select_kernel_ms"] = bench(lambda: final_select.select_composites(full, k, used=used, row_lists=rl))
    row["final_sort_ms"] = bench(lambda: torch.sort(comp, dim=1, descending=True))
    srt = torch.sort(comp, dim=1, descending=True).values
    row["final_decode_ms"] = bench(lambda: final_select.decode(srt))
    ref_sel = final_select.select_rows_reference(full, k, used)
    row["final_kernel_same"] = same(final_select.select_rows(full, k, used, row_lists=rl), ref_sel)
    row["final_kernel_program_lists_same"] = same(final_select.select_rows(full, k, used), ref_sel)
    row["final_kernel_8warps_same"] = same(final_select.select_sorted(full, k, used=used, warps=8, row_lists=rl)[:2],
                                           ref_sel)
    row["final_unsorted_same"] = same(final_select.decode(srt), ref_sel)

    def sel():
        return hytopk.select(q, kx, w, k, scale, True, vis, float("-inf"))

    out = sel()
    row["select_ms"] = bench(sel)
    row["select_over_floor"] = row["select_ms"] / row["floor_ms"]
    row["same_as_first_config"] = None if ref is None else same(out, ref)
    for key, v in row.items():
        if isinstance(v, float):
            row[key] = round(v, 3)
    print(json.dumps(row), flush=True)
    return row, out


def rescore_check(q, kx, w, k, vis, sel) -> dict:
    v, i = sel
    scale = D**-0.5
    fast = hytopk.rescore(q, kx, w, i, scale, True, vis, float("-inf"))
    with hytopk.override(rescore_tile=True):
        slow = hytopk.rescore(q, kx, w, i, scale, True, vis, float("-inf"))
        tile_ms = bench(lambda: hytopk.rescore(q, kx, w, i, scale, True, vis, float("-inf")))
    row = dict(rescore_row_ms=round(bench(lambda: hytopk.rescore(q, kx, w, i, scale, True, vis, float("-inf"))), 3),
               rescore_tile_ms=round(tile_ms, 3),
               row_equals_select=bool(torch.equal(fast.view(torch.int32), v.view(torch.int32))),
               tile_equals_select=bool(torch.equal(slow.view(torch.int32), v.view(torch.int32))),
               row_mismatches=int((fast.view(torch.int32) != v.view(torch.int32)).sum()))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_selection.json"))
    ap.add_argument("--shapes", default="0,1")
    ap.add_argument("--configs", default="all", help="'all' or indices into CONFIGS")
    args = ap.parse_args()
    configs = CONFIGS if args.configs == "all" else [CONFIGS[int(c)] for c in args.configs.split(",")]
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat(), shapes=[])
    default = score_tile.TILE
    for n in (int(s) for s in args.shapes.split(",")):
        T, S, H, k = SHAPES[n]
        torch.manual_seed(0)
        q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
        kx = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1, T, H, device="cuda", dtype=torch.float32) / math.sqrt(H)
        vis = Visibility(causal=True, offset=S - T)
        entry = dict(T=T, S=S, H=H, D=D, k=k, configs=[])
        res["shapes"].append(entry)
        ref = None
        for cfg in configs:
            try:
                row, out = run_config(q, kx, w, k, vis, cfg, ref)
            except Exception as e:
                row, out = dict(config=cfg, error=str(e)[:300]), None
                print(json.dumps(row), flush=True)
            entry["configs"].append(row)
            ref = ref if ref is not None else out
            write(res, args.out)
        score_tile.TILE = default
        if ref is not None:
            entry["rescore"] = rescore_check(q, kx, w, k, vis, ref)
        write(res, args.out)
    score_tile.TILE = default


def write(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
