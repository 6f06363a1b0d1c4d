"""The host work of one selection call at decode shapes, on the CPU: launches per call and our own microseconds.

A decode step's selection is small on the device and large on the host: the pipeline's launches and the Python
around them (checks, ``Problem``, ``make_plan``, each stage's allocations) are most of an eager call. This counts
and times that host work without a device, for both routes of ``plan.Plan.table`` (forced through
``plan.TABLE_MAX_BYTES``) and the route the plan takes by default:

    launches        Triton launches per call, as CUDA makes them: the recovery is one launch there
                    (``launch_policy``), 17 here (one a pass), and is counted once (``launches_here`` has 17)
    torch_ops       top-level aten ops per call (torch.profiler): allocations, fills, views, topk
    host_us         microseconds per call of ``hyscale_compile.indexer_topk`` with every Triton launch stubbed
                    (``JITFunction.run`` records the kernel's name and returns): the operator's dispatch, our
                    Python and the torch ops, on CPU tensors; the fastest of the repeats
    parts_us        the same split by entry (op checks, Problem, make_plan, the pipeline's stages or the table
                    route, the final stage); timed with wrappers around them, in runs of their own (each part's
                    fastest run; "final" is hytopk_select less the others)
    recover_us      the pipeline's recovery stage: its 17 stub launches here, one on CUDA

What this does not show: the launches' own host cost (Triton's launcher, the driver: tens of microseconds each
on CUDA, stubbed here), the CUDA caching allocator (CPU allocations here, kept in the process between calls as
that allocator keeps its blocks: ``keep_freed_memory``), and the device time. On the table route torch.topk is
replaced by an empty result of its shape while timing: on CPU tensors it would time the CPU's sort of the table,
not host work; on CUDA it is one op.

With ``--cuda`` (on the device) nothing is stubbed: the same calls run for real, and each row gives the host
time as the device's process spends it (the launches, the driver and the caching allocator included):

    host_us         microseconds to issue one call (``calls`` calls issued back to back, no synchronization
                    inside; the fastest of the repeats): an eager call is host-bound where this passes its
                    device time
    parts_us        the same split by entry, as above
    top_ops         the aten ops and launches of one call by their host (self CPU) microseconds (profiler)

    python benchmarks/decode_host.py            # -> results/decode_host.json
    python benchmarks/decode_host.py --cuda     # on the device -> results/decode_host_cuda.json
    python benchmarks/decode_host.py --smoke    # tiny shapes, prints only
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # the compiled path's host code (launches stubbed), not the interpreter

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from host_timers import host_timers  # noqa: E402

import hyscale_compile  # noqa: E402
from hyscale_compile.lowering import ops  # noqa: E402
from hyscale_compile.runtime import dispatch, hytopk, plan, table_path  # noqa: E402

DECODE_T, DECODE_S, H, D, K = (1, 16, 64), (32768, 131072), 64, 128, 2048
ROUTES = {"pipeline": 0, "table": 1 << 62}  # plan.TABLE_MAX_BYTES forcing each route
_launches: list[str] = []


def _stub_run(self, *args, grid, warmup, **kwargs):
    _launches.append(self.fn.__name__)


@contextlib.contextmanager
def stubbed(table_max: int | None):
    """Triton launches recorded, not run; torch.topk an empty result; the route forced (None: the plan's)."""
    run, topk, old_max = JITFunction.run, torch.topk, plan.TABLE_MAX_BYTES
    JITFunction.run = _stub_run

    def empty_topk(x, k, dim=-1, largest=True, sorted=True):
        shape = (*x.shape[:-1], k)
        return torch.return_types.topk((torch.empty(shape, dtype=x.dtype), torch.empty(shape, dtype=torch.int64)))

    torch.topk = empty_topk
    if table_max is not None:
        plan.TABLE_MAX_BYTES = table_max
    try:
        with dispatch.force_backend("triton"):
            yield
    finally:
        JITFunction.run, torch.topk, plan.TABLE_MAX_BYTES = run, topk, old_max


def keep_freed_memory() -> None:
    """glibc only: keep freed memory in the process (no heap trim; the heap, not fresh mappings, up to 32 MiB),
    as CUDA's caching allocator keeps its blocks. Otherwise each call's CPU buffers come back as fresh pages,
    and their page faults (slow and erratic on a VM: up to 10x run to run) are timed as host work."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its largest)


def per_call_us(fn, calls: int, repeats: int) -> float:
    """Microseconds per call: the fastest of ``repeats`` runs of ``calls`` calls (other work on the machine
    only adds time, and on a shared CPU it adds a lot)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def top_level_ops(fn) -> dict[str, int]:
    """aten ops one call makes, not counting those an op makes inside itself."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if e.name.startswith("aten::") and parent is None:
            counts[e.name[6:]] = counts.get(e.name[6:], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# The entries a call goes through, timed in runs of their own (the wrappers cost a little).
PARTS = [(ops, "check_inputs_once", "op_checks"), (hytopk, "Problem", "problem"), (hytopk, "make_plan", "plan"),
         (hytopk, "table_plan", "plan"),
         (hytopk, "candidates", "pipeline_stages"), (table_path, "select", "table_route"),
         (hytopk, "recover", "recover"), (hytopk, "select", "hytopk_select")]


def decode_call(T: int, S: int, heads: int, dim: int, k: int, device: str = "cpu"):
    """One decode-shaped ``indexer_topk`` call (no arguments) on fixed random inputs of ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, heads, dim, generator=g, device=device).bfloat16()
    kx = torch.randn(1, S, dim, generator=g, device=device).bfloat16()
    w = torch.randn(1, T, heads, generator=g, device=device)

    def call():
        return hyscale_compile.indexer_topk(q, kx, k, weights=w, scale=dim**-0.5, query_offset=S - T, sorted=True)

    return call


def measure(T: int, S: int, heads: int, dim: int, k: int, route: str | None, calls: int, repeats: int) -> dict:
    call = decode_call(T, S, heads, dim, k)
    row = dict(T=T, S=S, H=heads, D=dim, k=k, route=route or "default")
    with stubbed(ROUTES.get(route)):
        row["table"] = plan.table_route(T, S, captured=False)
        call()
        _launches.clear()
        call()
        here = list(_launches)
        row["launches_here"] = len(here)
        row["launches"] = len(here) - max(0, here.count("recover_kernel") - 1)
        row["kernels"] = sorted(set(here), key=here.index)
        row["torch_ops"] = sum(top_level_ops(call).values())
        row["host_us"] = round(per_call_us(call, calls, repeats), 1)
        parts: dict[str, float] = {}
        for _ in range(repeats):  # each part's fastest run
            with host_timers(PARTS) as totals:
                for _ in range(calls):
                    call()
            for name, v in totals.items():
                parts[name] = min(parts.get(name, float("inf")), round(v / calls * 1e6, 1))
    stages = parts.get("pipeline_stages", 0.0) + parts.get("table_route", 0.0)
    parts["final"] = round(parts["hytopk_select"] - parts["problem"] - parts["plan"] - stages, 1)
    row["recover_us"] = parts.pop("recover", 0.0)
    row["parts_us"] = parts
    return row


def measure_cuda(T: int, S: int, heads: int, dim: int, k: int, route: str | None, calls: int,
                 repeats: int) -> dict:
    """The host time of real calls on CUDA (module docstring, ``--cuda``)."""
    call = decode_call(T, S, heads, dim, k, "cuda")
    row = dict(T=T, S=S, H=heads, D=dim, k=k, route=route or "default")
    old_max = plan.TABLE_MAX_BYTES
    if route is not None:
        plan.TABLE_MAX_BYTES = ROUTES[route]
    try:
        row["table"] = plan.table_route(T, S, captured=False)
        for _ in range(3):
            call()
        torch.cuda.synchronize()

        def issue() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            dt = time.perf_counter() - t0
            torch.cuda.synchronize()
            return dt / calls * 1e6

        row["host_us"] = round(min(issue() for _ in range(repeats)), 1)
        parts: dict[str, float] = {}
        for _ in range(repeats):
            with host_timers(PARTS) as totals:
                issue()
            for name, v in totals.items():
                parts[name] = min(parts.get(name, float("inf")), round(v / calls * 1e6, 1))
        row["parts_us"] = parts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        ops = {}
        for e in prof.key_averages():
            if e.key.startswith(("aten::", "cuda", "triton", "hyscale")) or "kernel" in e.key:
                ops[e.key] = round(e.self_cpu_time_total / calls, 1)
        row["top_ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:16])
    finally:
        plan.TABLE_MAX_BYTES = old_max
    return row


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few calls, prints only")
    ap.add_argument("--cuda", action="store_true", help="real calls on the device, nothing stubbed")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=None, help="default results/decode_host.json (--cuda: decode_host_cuda.json)")
    args = ap.parse_args()
    if args.cuda:
        return main_cuda(args)
    keep_freed_memory()
    shapes = [(T, S, H, D, K) for S in DECODE_S for T in DECODE_T]
    if args.smoke:
        shapes, args.calls, args.repeats = [(1, 512, 2, 16, 16), (4, 512, 2, 16, 16)], 3, 1
    rows = []
    for shape in shapes:
        for route in ("pipeline", "table", None):
            rows.append(measure(*shape, route, args.calls, args.repeats))
    print(f"{'T':>3} {'S':>7} {'H':>3} {'route':>8} {'table':>5} {'launches':>8} {'ops':>4} {'host_us':>8} "
          f"{'recover':>7}  parts_us")
    for r in rows:
        print(f"{r['T']:>3} {r['S']:>7} {r['H']:>3} {r['route']:>8} {str(r['table']):>5} {r['launches']:>8} "
              f"{r['torch_ops']:>4} {r['host_us']:>8} {r['recover_us']:>7}  "
              f"{r['parts_us']}")
    if not args.smoke:
        from training import write_results

        out = args.out or str(HERE / "results" / "decode_host.json")
        write_results(out, "cpu", rows, cpu=cpu_model(), calls=args.calls, repeats=args.repeats,
                      what="host work per indexer_topk call with Triton launches stubbed (module docstring)")


def main_cuda(args) -> None:
    calls, repeats = min(args.calls, 20), min(args.repeats, 7)
    rows = []
    for T, S, H_, D_, k in [(T, S, H, D, K) for S in DECODE_S for T in DECODE_T]:
        for route in ("pipeline", "table"):
            rows.append(measure_cuda(T, S, H_, D_, k, route, calls, repeats))
            print(json.dumps(rows[-1]), flush=True)
    from training import write_results

    write_results(args.out or str(HERE / "results" / "decode_host_cuda.json"), "cuda", rows, calls=calls,
                  repeats=repeats, what="host work per real indexer_topk call on the device (--cuda)")


if __name__ == "__main__":
    main()
