"""Indexer top-k selection on one GPU: scoring floor, table + torch.topk, eager, torch.compile, HyTopK.

k=2048 (and one k=512 shape), D=128, bf16, causal with the queries at the end of the context.
Every time is a median of CUDA-event timings; the floor and HyTopK are timed in turn over three rounds,
so that clock drift moves both alike. Writes results/selection.json and results/selection.md (or the
paths given). A baseline that runs out of memory is recorded as null with a note. The floor, the
table and the filter's compare alone are this benchmark's own kernels (floor.py).

    python benchmarks/selection.py [--out DIR] [--shapes 0,1]
    python benchmarks/selection.py --smoke     # a tiny shape on the CPU (Triton interpreter), prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import floor  # noqa: E402  (this benchmark's kernels: the floor, the table, the compare alone)
import training  # noqa: E402  (interpreter_shim)

from hyscale_compile.runtime import hytopk, score_tile, stats  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

SHAPES = [  # T, S, H, k
    (4096, 131072, 64, 2048),
    (4096, 131072, 16, 2048),
    (2048, 524288, 16, 2048),
    (8192, 131072, 32, 2048),
    (4096, 262144, 64, 512),
]
SMOKE_SHAPES = [(8, 300, 2, 8)]  # T, S, H, k: every context fits the buffer (no sampling), the interpreter is slow
D = 128
EAGER_BUDGET = 24 << 30  # bytes of fp32 intermediates per query chunk in the eager indexer
DEVICE = "cuda"  # the smoke run sets "cpu" where there is no GPU: kernels in the interpreter, nothing timed


def median(xs: list) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(xs)[len(xs) // 2]


def median_ms(fn, reps: int = 5) -> float:
    fn()
    if DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return median(times)


def bench(fn) -> float:
    if DEVICE != "cuda":
        fn()
        return float("nan")
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def interleaved(fns: dict, rounds: int = 3) -> dict:
    """Each fn's times (ms) over ``rounds`` rounds that take the fns in turn (A B A B ...). The GPU's
    clock drifts over a run (the same code has timed 2-3% apart minutes later): measured in turn,
    the drift moves every fn alike, so their ratios move less than the times."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(round(bench(fn), 3))
    return times


def matmul_tflops() -> float:
    if DEVICE != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e9


def useful_flops(T: int, S: int, H: int) -> float:
    """Multiply-adds of the visible pairs only (row t sees S - T + t + 1 keys)."""
    pairs = T * (S - T) + T * (T + 1) / 2
    return 2.0 * pairs * H * D


def eager_indexer(q, kx, w, k, scale, offset):
    """The indexer as model code writes it: upcast, einsum, relu, head-weighted sum, mask, topk."""
    return _by_chunks(_eager_chunk, q, kx, w, k, scale, offset)


def _by_chunks(fn, q, kx, w, k, scale, offset):
    """Run ``fn`` over query chunks that fit the memory budget and concatenate the results."""
    B, T, H, _ = q.shape
    chunk = _chunk(B, T, H, kx.shape[1])
    vals, idxs = [], []
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        v, i = fn(q[:, t0:t1], kx, w[:, t0:t1], k, scale, offset + t0)
        vals.append(v)
        idxs.append(i)
    return torch.cat(vals, 1), torch.cat(idxs, 1)


def _chunk(B: int, T: int, H: int, S: int) -> int:
    """Query rows per chunk: a power of two (equal chunks, one compiled shape) within the budget."""
    rows = max(1, EAGER_BUDGET // (3 * B * H * S * 4))
    return min(T, 1 << (rows.bit_length() - 1))


def _eager_chunk(q, kx, w, k, scale, offset):
    s = torch.einsum("bthd,bsd->bths", q.float(), kx.float()) * scale
    s = (torch.relu(s) * w.float()[..., None]).sum(2)
    t = torch.arange(q.shape[1], device=q.device)[:, None] + offset
    pos = torch.arange(kx.shape[1], device=q.device)[None, :]
    s = s.masked_fill(pos > t, float("-inf"))
    return torch.topk(s, k, dim=-1)


_compiled_chunk = None


def compiled_indexer(q, kx, w, k, scale, offset):
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_eager_chunk)
    return _by_chunks(_compiled_chunk, q, kx, w, k, scale, offset)


def guarded(fn, notes: list, name: str):
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        notes.append(f"{name}: out of memory ({str(e).splitlines()[0][:120]})")
        empty_cache()
        return None


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def inputs(T: int, S: int, H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q and kx (fp32 on the CPU: the interpreter's dot takes no bf16), fp32 weights."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q = torch.randn(1, T, H, D, device=DEVICE, dtype=dtype)
    kx = torch.randn(1, S, D, device=DEVICE, dtype=dtype)
    w = torch.randn(1, T, H, device=DEVICE, dtype=torch.float32) / math.sqrt(H)
    return q, kx, w


def run_shape(T: int, S: int, H: int, k: int, mm: float, eager: bool, compiled: bool, stages: bool,
              rounds: int = 3) -> dict:
    q, kx, w = inputs(T, S, H)
    scale = D**-0.5
    vis = Visibility(causal=True, offset=S - T)
    fill = float("-inf")
    notes: list[str] = []
    pb = hytopk.Problem(q, kx, w, scale, True, vis, fill)
    plan = hytopk.make_plan(pb, k)
    split = plan.filter_split
    sink = floor.sink(pb, split)
    # the floor alone, before anything else of this shape runs (how the table timed it up to 6885655); it
    # comes out faster than the same floor timed in turn with HyTopK, whose rounds grow slower as the run
    # goes on while HyTopK's stay flat (NOTES-selection.md, v13): both ratios are in the results
    floor_first_ms = bench(lambda: floor.floor(pb, sink, split))

    def table_topk():
        table = torch.empty(T, S, device=DEVICE, dtype=torch.float32)
        floor.table(pb, table, split)
        return torch.topk(table, k, dim=-1)

    table_ms = guarded(lambda: bench(table_topk), notes, "table_topk")
    empty_cache()

    def hy():
        return hytopk.select(q, kx, w, k, scale, True, vis, fill)

    hy()
    synchronize()
    # the floor and HyTopK (the ratio the issue bars) in turn; unsorted is what an order-free site (the
    # indices only mark a mask, as in HF DeepSeek-V3.2) runs: no final sort
    t = interleaved({"floor": lambda: floor.floor(pb, sink, split), "hytopk": hy,
                     "unsorted": lambda: hytopk.select(q, kx, w, k, scale, True, vis, fill, sorted=False)}, rounds)
    floor_ms, hy_ms, unsorted_ms = median(t["floor"]), median(t["hytopk"]), median(t["unsorted"])
    cand_ms = bench(lambda: candidates(q, kx, w, k, scale, vis, fill))
    synchronize()
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats.reset()
    out = hy()
    synchronize()
    peak = torch.cuda.max_memory_allocated() - base if DEVICE == "cuda" else 0
    st = stats.read()
    del out
    buffer_bytes = T * plan.width * 8
    output_bytes = T * k * 12
    eager_ms = compile_ms = None
    off = S - T
    if eager:
        eager_ms = guarded(lambda: median_ms(lambda: eager_indexer(q, kx, w, k, scale, off), 3), notes, "eager")
        empty_cache()
    else:
        notes.append("eager: not run (device-time budget)")
    if compiled:
        compile_ms = guarded(lambda: median_ms(lambda: compiled_indexer(q, kx, w, k, scale, off), 3), notes,
                             "compile")
        empty_cache()
    else:
        notes.append("compile: not run (device-time budget)")  # main() may run it at the end instead
    stage = stage_times(hytopk.Problem(q, kx, w, scale, True, vis, fill), plan) if stages else {}
    fl = useful_flops(T, S, H)
    row = dict(T=T, S=S, H=H, D=D, k=k, matmul_tflops=round(mm, 1), floor_tflops=round(fl / floor_ms / 1e9, 1),
               floor_ms=round(floor_ms, 3), table_topk_ms=None if table_ms is None else round(table_ms, 3),
               eager_ms=None if eager_ms is None else round(eager_ms, 2),
               compile_ms=None if compile_ms is None else round(compile_ms, 2), hytopk_ms=round(hy_ms, 3),
               hytopk_peak_extra_bytes=int(peak), rows_recovered=st.rows_recovered, fallbacks=st.fallbacks,
               hytopk_candidates_ms=round(cand_ms, 3), hytopk_over_floor=round(hy_ms / floor_ms, 3),
               hytopk_unsorted_ms=round(unsorted_ms, 3),
               mean_candidates=round(st.mean_candidates, 1), candidate_buffer_bytes=buffer_bytes,
               output_bytes=output_bytes, stages=stage, rounds_ms=t, floor_first_ms=round(floor_first_ms, 3),
               hytopk_over_floor_first=round(hy_ms / floor_first_ms, 3), notes=notes)
    print(json.dumps(row), flush=True)
    return row


def candidates(q, kx, w, k: int, scale: float, vis: Visibility, fill: float):
    """Every stage but the final select, with the host work of a call (its problem and plan)."""
    pb = hytopk.Problem(q, kx, w, scale, True, vis, fill)
    return hytopk.candidates(pb, hytopk.make_plan(pb, k))


def stage_times(pb, plan) -> dict:
    """HyTopK stage by stage: sampling, threshold, the filter's compare alone (no append), the filter,
    and the final select over the candidate buffers."""
    buf, samp, msamp = hytopk.sample(pb, plan)
    thr = hytopk.threshold(pb, plan, buf, samp, msamp).filter_key
    sink = floor.sink(pb, plan.filter_split)
    out = dict(sample_ms=round(bench(lambda: hytopk.sample(pb, plan)), 3),
               threshold_ms=round(bench(lambda: hytopk.threshold(pb, plan, buf, samp, msamp)), 3),
               compare_only_ms=round(bench(lambda: floor.count(pb, plan, thr, sink)), 3),
               filter_ms=round(bench(lambda: hytopk.filter_rows(pb, plan, thr, buf)), 3))
    full, used = hytopk.candidates(pb, plan)
    out["final_select_ms"] = round(bench(lambda: hytopk.select_rows(full, plan.k, used, row_lists=plan.row_lists)),
                                   3)
    return out


def floor_sweep(T: int, S: int, H: int, configs) -> list:
    """Floor time of other tile shapes at one size (the filter would share the chosen one)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q = torch.randn(1, T, H, D, device=DEVICE, dtype=dtype)
    kx = torch.randn(1, S, D, device=DEVICE, dtype=dtype)
    w = torch.randn(1, T, H, device=DEVICE, dtype=torch.float32)
    vis = Visibility(causal=True, offset=S - T)
    out = []
    for bt, bs, warps, stages in configs:
        tile = score_tile.TileConfig(bt=bt, bs=bs, warps=warps, stages=stages)
        pb = hytopk.Problem(q, kx, w, D**-0.5, True, vis, float("-inf"), tile)
        split = hytopk.make_plan(pb, 2048 if DEVICE == "cuda" else 8).filter_split
        sink = floor.sink(pb, split)
        ms = bench(lambda pb=pb, sink=sink, split=split: floor.floor(pb, sink, split))
        out.append(dict(T=T, S=S, H=H, bt=bt, bs=bs, warps=warps, stages=stages, floor_ms=round(ms, 3),
                        floor_tflops=round(useful_flops(T, S, H) / ms / 1e9, 1)))
        print(json.dumps(out[-1]), flush=True)
    return out


def markdown(res: dict) -> str:
    cols = ["T", "S", "H", "k", "matmul_tflops", "floor_tflops", "floor_ms", "table_topk_ms", "eager_ms", "compile_ms",
            "hytopk_ms", "hytopk_over_floor", "floor_first_ms", "hytopk_over_floor_first", "hytopk_peak_extra_bytes",
            "candidate_buffer_bytes", "rows_recovered", "fallbacks"]
    lines = [f"# Selection benchmark ({res['device']}, torch {res['torch']}, triton {res['triton']}, {res['date']}, "
             f"commit {res['commit']})", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res["rows"]:
        lines.append("| " + " | ".join("—" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    notes = [f"- {r['T']}x{r['S']}x{r['H']}: {n}" for r in res["rows"] for n in r["notes"]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--no-slow", action="store_true", help="skip the eager and torch.compile baselines")
    ap.add_argument("--compile-shapes", default="all", help="'all' or indices of shapes that run torch.compile")
    ap.add_argument("--stage-shapes", default="0,1", help="indices of shapes timed stage by stage")
    ap.add_argument("--sweep", default="128x128x8x3,64x256x8x3", help="floor tile configs bt x bs x warps x stages")
    ap.add_argument("--shapes", default="all", help="'all' or comma-separated indices into SHAPES")
    ap.add_argument("--commit", default=None, help="commit to record when the checkout has no git")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, any device, nothing timed or written")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    mm = matmul_tflops()
    print(f"bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    comp = set(range(len(shapes))) if args.compile_shapes == "all" else {int(i) for i in args.compile_shapes.split(",")}
    stg = {int(i) for i in args.stage_shapes.split(",") if i}
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat(), commit=args.commit or git_commit(), rows=[],
               floor_sweep=[], tile=dataclasses.asdict(score_tile.TILE))
    # results are written after every step, so a run cut short still leaves what it measured
    for n, (T, S, H, k) in enumerate(shapes):
        res["rows"].append(run_shape(T, S, H, k, mm, not args.no_slow, False, n in stg))
        write(res, args.out)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.sweep.split(",") if c]
    res["floor_sweep"] = floor_sweep(4096, 131072, 16, configs) if configs else []
    write(res, args.out)
    for n, (T, S, H, k) in enumerate(shapes):  # torch.compile last: its compile time dominates the run
        if args.no_slow or n not in comp:
            continue
        row = res["rows"][n]
        row["notes"] = [x for x in row["notes"] if not x.startswith("compile")]
        row["compile_ms"] = compile_baseline(T, S, H, k, row["notes"])
        write(res, args.out)
    print(markdown(res))


def smoke() -> None:
    """Every step of a run at a tiny shape (on the CPU the kernels run in the Triton interpreter):
    the floor, the table, HyTopK sorted and unsorted, the stages, eager, a floor sweep."""
    global D, DEVICE
    D, DEVICE = 16, "cuda" if torch.cuda.is_available() else "cpu"
    training.interpreter_shim()
    for T, S, H, k in SMOKE_SHAPES:
        run_shape(T, S, H, k, float("nan"), eager=True, compiled=False, stages=True, rounds=1)
    floor_sweep(8, 300, 2, [(16, 32, 4, 2)])


def compile_baseline(T: int, S: int, H: int, k: int, notes: list) -> float | None:
    torch.manual_seed(0)
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    kx = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, T, H, device="cuda", dtype=torch.float32) / math.sqrt(H)
    ms = guarded(lambda: median_ms(lambda: compiled_indexer(q, kx, w, k, D**-0.5, S - T), 3), notes, "compile")
    torch.cuda.empty_cache()
    return None if ms is None else round(ms, 2)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        return None
    return out or None


def write(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "selection.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "selection.md"), "w") as f:
        f.write(markdown(res))


if __name__ == "__main__":
    main()
