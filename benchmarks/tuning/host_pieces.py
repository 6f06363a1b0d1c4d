"""What a decode step's selection costs the host, piece by piece, against the plain path's pieces (CUDA only).

For decode shapes, each piece's host microseconds per call (``calls`` calls issued back to back with no
synchronization inside: the time to enqueue them; the fastest and the median of ``repeats`` runs), its eager
time (events around one call: host work and the device's tail) and its device time (a CUDA graph's replay), and
for the whole calls the kernels the profiler sees. The pieces: one Triton launch of a trivial kernel, an
allocation, the plain path (our fused score kernel writing the fp32 table, then torch.topk) and its parts,
torch.topk over fp32 and over the int64 composites, the operator (``indexer_topk``, ``hytopk.select``) and its
parts (``Problem``, the composite table's launch, the table ranker's launches and ``final_sort.values``). It is
the arithmetic behind the table rankers (runtime/table_rank.py): where a call is host-bound, its host work is
all it costs.

    python benchmarks/tuning/host_pieces.py          # -> tuning/results/host_pieces.json
    python benchmarks/tuning/host_pieces.py --smoke  # a tiny shape, any device (the interpreter on CPU), prints only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))
import families  # noqa: E402
import floor  # noqa: E402
from training import write_results  # noqa: E402

import hyscale_compile  # noqa: E402
from hyscale_compile.runtime import hytopk, plan, table_path, table_rank  # noqa: E402
from hyscale_compile.runtime.final_sort import values  # noqa: E402
from hyscale_compile.runtime.problem import Problem  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

SHAPES = [(1, 32768, 16), (1, 32768, 64), (16, 32768, 64), (1, 131072, 16), (16, 131072, 16), (64, 32768, 64)]
K, D = 2048, 128


@triton.jit
def _nop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n, other=0.0), mask=i < n)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(fastest, median) host microseconds per call over ``repeats`` runs of ``calls`` unsynchronized calls."""
    for _ in range(3):
        fn()
    _sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        _sync()
    runs.sort()
    return round(runs[0], 1), round(runs[len(runs) // 2], 1)


def event_us(fn) -> float:
    """Median microseconds between events around one call (families.median_ms)."""
    return round(families.median_ms(fn) * 1e3, 1)


def graph_us(fn) -> float | None:
    """Median microseconds of the call replayed from a CUDA graph (families.graph_ms), None where it fails to
    capture."""
    try:
        return round(families.graph_ms(fn) * 1e3, 1)
    except RuntimeError:
        return None


def kernels(fn) -> int:
    """Kernels (and memsets) one call runs on the device, as the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def pieces(T: int, S: int, H: int, k: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, H, D, device=device, generator=g).bfloat16()
    kx = torch.randn(1, S, D, device=device, generator=g).bfloat16()
    w = torch.randn(1, T, H, device=device, generator=g)
    scale, vis = D**-0.5, Visibility(causal=True, offset=S - T)
    pb = Problem(q, kx, w, scale, True, vis, float("-inf"))
    split = plan.filter_split(pb, plan.device_programs(pb.device))
    table = torch.empty(pb.rows, S, device=device)
    comp = table_path.composites(pb)
    top = torch.topk(comp, k, dim=-1)
    fp32 = torch.randn(T, S, device=device, generator=g)

    def plain():
        floor.table(pb, table, split)
        return torch.topk(table.view(1, T, S), k, dim=-1)

    ranker = plan.table_ranker(k, T, S, plan.Tuning(ranker="row") if device == "cpu" else plan.DEFAULT)
    return {
        "plain (score table launch + torch.topk fp32)": plain,
        "score table launch": lambda: floor.table(pb, table, split),
        "torch.topk fp32": lambda: torch.topk(fp32, k, dim=-1),
        "torch.topk int64 composites": lambda: torch.topk(comp.view(T, S), k, dim=-1),
        "indexer_topk": lambda: hyscale_compile.indexer_topk(q, kx, k, weights=w, scale=scale, query_offset=S - T),
        "hytopk.select": lambda: hytopk.select(q, kx, w, k, scale, True, vis, float("-inf")),
        "Problem()": lambda: Problem(q, kx, w, scale, True, vis, float("-inf")),
        "composite table launch": lambda: table_path.composites(pb),
        f"table ranker ({ranker})": lambda: table_rank.rank(
            comp, k, split=table_rank.split_keys(T, S, plan.multiprocessors(pb.device)) if ranker == "split" else None),
        "final_sort.values": lambda: values(top.values),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, any device, prints only")
    ap.add_argument("--out", default=str(HERE / "results" / "host_pieces.json"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    assert cuda or args.smoke, "host_pieces.py measures CUDA calls (--smoke runs anywhere)"
    if args.smoke:
        from training import interpreter_shim

        interpreter_shim()
    device = "cuda" if cuda else "cpu"
    calls, repeats = (1, 1) if args.smoke else (args.calls, args.repeats)
    x = torch.zeros(1024, device=device)
    rows = [dict(piece="one Triton launch (3 arguments)",
                 host_us=host_us(lambda: _nop_kernel[(1,)](x, 1024, BLOCK=1024), calls, repeats)),
            dict(piece="torch.empty", host_us=host_us(lambda: torch.empty(2048, device=device), calls, repeats))]
    for T, S, H in [(2, 256, 2)] if args.smoke else SHAPES:
        k = 16 if args.smoke else K
        for name, fn in pieces(T, S, H, k, device).items():
            row = dict(T=T, S=S, H=H, k=k, piece=name, host_us=host_us(fn, calls, repeats))
            if cuda:
                row.update(event_us=event_us(fn), graph_us=graph_us(fn))
                if name in ("plain (score table launch + torch.topk fp32)", "torch.topk fp32",
                            "torch.topk int64 composites", "indexer_topk"):
                    row["kernels"] = kernels(fn)
            rows.append(row)
            print(row, flush=True)
    if not args.smoke:
        write_results(args.out, device, rows, calls=calls, repeats=repeats)


if __name__ == "__main__":
    main()
