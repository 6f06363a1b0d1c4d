"""q and kx by tensor descriptor (TMA) against pointer loads, the filter's launch options, the sort's warps.

Three tables, each measured in one run on the device, every variant's bits checked against the first:

- ``paths``: scoring floor, filter and whole select per benchmark shape, with ``TileConfig.tma`` on and
  off (the select's values and indices must be bitwise equal);
- ``filter``: the filter alone on the descriptor path, per append (2: per entry, 3: slots reserved per
  thread), pipeline stages and register cap (``plan.filter_options`` picks from these); each variant's
  appended entries, sorted per row, must equal the first variant's;
- ``append``: the filter alone with either append at 168 registers, at shares of passing keys from
  0.7% to 5.5% and 16 to 64 heads (the evidence for ``plan.append_kind``'s rule);
- ``sort``: ``final_sort.sort_decode_kernel`` at 1..16 warps on composites with many tied values,
  against ``torch.sort``.

    python benchmarks/tuning/tune_descriptors.py [--parts paths,filter,append,sort] [--out FILE.json]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_descriptors.py --smoke    # tiny shapes on the CPU, prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import final_sort, hytopk, score_tile  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import floor  # noqa: E402  (the selection benchmark's floor)
import training  # noqa: E402  (write_results)

SHAPES = [(4096, 131072, 16, 2048), (4096, 131072, 64, 2048), (2048, 524288, 16, 2048),
          (8192, 131072, 32, 2048), (4096, 262144, 64, 512)]  # the selection benchmark's (T, S, H, k)
SMOKE_SHAPES = [(16, 300, 2, 8)]
FILTER_VARIANTS = {  # name: TileConfig changes (tma stays on)
    "a3_s2": dict(append=3), "a2_s2": dict(append=2), "a3_s3": dict(append=3, stages=3),
    "a2_s3": dict(append=2, stages=3), "a3_r168": dict(append=3, maxnreg=168), "a2_r168": dict(append=2, maxnreg=168),
}
# the append rule (plan.append_kind): shares of passing keys from 0.7% to 5.5%, at 16 to 64 heads
APPEND_SHAPES = [(2048, 524288, 16, 2048), (2048, 524288, 64, 2048), (4096, 262144, 16, 512),
                 (4096, 262144, 32, 512), (4096, 262144, 64, 512), (2048, 524288, 16, 1024),
                 (4096, 262144, 64, 1024), (1024, 1048576, 16, 2048), (1024, 1048576, 64, 2048),
                 (4096, 131072, 32, 2048)]
APPEND_VARIANTS = ("a2_r168", "a3_r168")  # the two appends as filter_launch runs them
SORT_SHAPES = [(4096, 2048), (8192, 2048), (2048, 2048), (4096, 512)]  # rows, k
SORT_WARPS = (1, 2, 4, 8, 16)


def bench(smoke: bool, fn, *args, **kwargs) -> float:
    """Median ms of fn(*args, **kwargs) (arguments bound now, not looked up when the timing loop runs)."""
    if smoke:
        fn(*args, **kwargs)
        return float("nan")
    return round(triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=5, rep=40, return_mode="median"), 4)


def floor_ms(pb: hytopk.Problem, plan: hytopk.Plan, smoke: bool) -> float:
    """The scoring floor at the filter's split, as the selection benchmark launches it."""
    sink = floor.sink(pb, plan.filter_split)
    return bench(smoke, floor.floor, pb, sink, plan.filter_split)


def operands(T: int, S: int, H: int, smoke: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    D = 16 if smoke else 128
    torch.manual_seed(0)
    q = torch.randn(1, T, H, D, device=device).to(torch.bfloat16)
    kx = torch.randn(1, S, D, device=device).to(torch.bfloat16)
    w = torch.randn(1, T, H, device=device) / math.sqrt(H)
    return q, kx, w, D**-0.5, Visibility(causal=True, offset=S - T)


def tile(**changes) -> score_tile.TileConfig:
    return dataclasses.replace(score_tile.TILE, **changes)


def paths(shape: tuple[int, int, int, int], smoke: bool) -> dict:
    T, S, H, k = shape
    q, kx, w, scale, vis = operands(T, S, H, smoke)
    row, picks = dict(T=T, S=S, H=H, k=k), {}
    for tma in (True, False):
        tuning = hytopk.Tuning(tile=tile(tma=tma), table=False)  # the pipeline's filter, at any size
        tag = "tma" if tma else "ptr"
        pb = hytopk.Problem(q, kx, w, scale, True, vis, float("-inf"), tuning.tile)
        plan = hytopk.make_plan(pb, k, tuning)
        row[f"{tag}_active"] = bool(pb.descriptors)
        row[f"{tag}_floor_ms"] = floor_ms(pb, plan, smoke)
        buf, thr = hytopk.sample_threshold(pb, plan)
        row[f"{tag}_filter_ms"] = bench(smoke, hytopk.filter_rows, pb, plan, thr.filter_key, buf)
        picks[tma] = hytopk.select(q, kx, w, k, scale, True, vis, float("-inf"), tuning=tuning)
        row[f"{tag}_select_ms"] = bench(smoke, hytopk.select, q, kx, w, k, scale, True, vis, float("-inf"),
                                        tuning=tuning)
    (v, i), (pv, pi) = picks[True], picks[False]
    row["same"] = bool(torch.equal(i, pi) and torch.equal(v.view(torch.int32), pv.view(torch.int32)))
    return row


def appended(buf: torch.Tensor, cnt: torch.Tensor, cap: int) -> torch.Tensor:
    """Each row's appended entries in ascending order (the atomics' order is not reproducible). A row
    that overflowed counts as empty: the check stage recovers it whole, and which of its entries were
    written differs by append (the reserved one writes none of a thread's that would pass cap)."""
    slots = torch.arange(cap, device=buf.device)[None, :]
    unused = (slots >= cnt[:, None].clamp(max=cap)) | (cnt[:, None] > cap)
    return torch.sort(buf[:, :cap].masked_fill(unused, -1), dim=1).values


def filters(shape: tuple[int, int, int, int], smoke: bool, variants=tuple(FILTER_VARIANTS)) -> dict:
    T, S, H, k = shape
    q, kx, w, scale, vis = operands(T, S, H, smoke)
    pb = hytopk.Problem(q, kx, w, scale, True, vis, float("-inf"))
    plan = hytopk.make_plan(pb, k)
    row = dict(T=T, S=S, H=H, k=k, floor_ms=floor_ms(pb, plan, smoke))
    buf, thr = hytopk.sample_threshold(pb, plan)
    cap = plan.capacity
    row["default_append"] = plan.append
    row["default_options"] = plan.filter_options
    first = None
    for name in variants:
        pv = hytopk.Problem(q, kx, w, scale, True, vis, float("-inf"), tile(**FILTER_VARIANTS[name]))
        pl = hytopk.make_plan(pv, k)
        mine = buf.clone()
        got = appended(mine, hytopk.filter_rows(pv, pl, thr.filter_key, mine), cap)
        first = got if first is None else first
        row[f"{name}_same"] = bool(torch.equal(got, first))
        row[f"{name}_ms"] = bench(smoke, hytopk.filter_rows, pv, pl, thr.filter_key, mine)
    return row


def sorts(shape: tuple[int, int], smoke: bool) -> dict:
    R, k = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    key = torch.randint(-2**20, 2**20, (R, k), device=device, dtype=torch.int64)  # many tied values
    pos = torch.randint(0, 2**31 - 1, (R, k), device=device)
    comp = (key << 32) | ((~pos.to(torch.int32)).to(torch.int64) & 0xFFFFFFFF)
    want_v, want_i = final_sort.decode(torch.sort(comp, dim=1, descending=True).values)
    kp = final_sort.sort_width(k)
    row = dict(R=R, k=k, default_warps=final_sort.sort_warps(kp))
    for warps in SORT_WARPS:
        idx, val = comp.clone(), torch.empty(R, k, device=device)
        sort_once(comp, idx, val, kp, warps)
        row[f"w{warps}_same"] = bool(torch.equal(idx, want_i) and torch.equal(val.view(torch.int32),
                                                                             want_v.view(torch.int32)))
        copy_ms = bench(smoke, idx.copy_, comp)
        row[f"w{warps}_ms"] = round(bench(smoke, sort_once, comp, idx, val, kp, warps) - copy_ms, 4)
    return row


def sort_once(comp: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, kp: int, warps: int) -> None:
    """The composites copied into the positions' memory, then sorted and decoded there (as select does)."""
    idx.copy_(comp)
    final_sort.sort_decode_kernel[(idx.shape[0],)](idx, val, idx.shape[1], KP=kp, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_descriptors.json"))
    ap.add_argument("--parts", default="paths,filter,append,sort")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing, print only")
    args = ap.parse_args()
    if args.smoke:
        training.interpreter_shim()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    parts = args.parts.split(",")
    rows = []
    appends = SMOKE_SHAPES if args.smoke else APPEND_SHAPES
    for part, fn, items in [("paths", paths, shapes), ("filter", filters, shapes),
                            ("append", lambda s, sm: filters(s, sm, APPEND_VARIANTS), appends),
                            ("sort", sorts, [(4, 64)] if args.smoke else SORT_SHAPES)]:
        if part not in parts:
            continue
        for item in items:
            row = dict(part=part, **fn(item, args.smoke))
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    bad = [r for r in rows if any(k.endswith("same") and v is False for k, v in r.items())]
    assert not bad, f"variants disagree: {bad}"
    if not args.smoke:
        training.write_results(args.out, "cuda", rows)


if __name__ == "__main__":
    main()
