"""Training benchmark: one indexer + selection layer, forward + backward under activation checkpointing.

The layer is plain PyTorch (an unmodified indexer: einsum, relu, head-weighted sum, causal mask,
topk), so the hyscale backend only helps where its selection pass rewrites it. Modes:

    eager               the layer as written
    inductor            torch.compile(backend="inductor")
    hyscale_noreplay    torch.compile(backend="hyscale", options={"replay": False})
    hyscale             torch.compile(backend="hyscale")

Per row: ms per step, the share of the hyscale step spent in ``rescore`` (timed on its own at the
same shapes), the rescore against its gather floor (``rescore_floor_ms``: the time to read the same key
rows, benchmarks/floor.py; ``rescore_over_floor`` is the ratio of their kernel times on CUDA, where
``rescore_device_ms`` and ``rescore_floor_device_ms`` are recorded too), peak memory. A mode that runs out of
memory is recorded as "OOM at N GiB".

    python benchmarks/training.py                 # the issue's shapes on CUDA -> results/training.json
    python benchmarks/training.py --smoke         # tiny shapes, any device, prints only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a source checkout too
import hyscale_compile  # noqa: E402, F401  (registers backend="hyscale" where no entry point did)

SHAPES = [(2048, 65536, 16), (4096, 131072, 16), (4096, 131072, 64)]  # (T, S, H)
MODES = ["hyscale", "inductor", "hyscale_noreplay", "eager"]  # most telling first when time is short
MODE_KEYS = {"eager": "eager_ms", "inductor": "inductor_ms", "hyscale_noreplay": "hyscale_noreplay_ms",
             "hyscale": "hyscale_ms"}


def indexer_layer(q, kx, w, target, k: int):
    """Unmodified DSA indexer scoring in fp32 as HF models write it (16-bit inputs upcast first),
    loss read at the selected positions."""
    T, S = q.shape[1], kx.shape[1]
    scale = q.shape[-1] ** -0.5
    dots = torch.einsum("bthd,bsd->bths", q.float(), kx.float()) * scale
    score = (torch.relu(dots) * w.float()[..., None]).sum(2)
    pos_t = torch.arange(T, device=q.device).view(T, 1) + (S - T)  # queries are the last T keys
    future = torch.arange(S, device=q.device).view(1, S) > pos_t
    score = score.masked_fill(future, float("-inf"))
    values, idx = score.topk(k, dim=-1)
    return (torch.log_softmax(values, -1) * target).sum() / values.shape[1]


def step_fn(k: int):
    def step(q, kx, w, target):
        return checkpoint(indexer_layer, q, kx, w, target, k, use_reentrant=False)

    return step


def make_fn(mode: str, k: int):
    fn = step_fn(k)
    if mode == "eager":
        return fn
    if mode == "inductor":
        return torch.compile(fn, backend="inductor", dynamic=False)
    opts = {"replay": mode == "hyscale"}
    return torch.compile(fn, backend="hyscale", options=opts, dynamic=False)


def make_inputs(T: int, S: int, H: int, D: int, k: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, T, H, D, device=device, dtype=dtype, generator=g).requires_grad_()
    kx = torch.randn(1, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
    w = torch.rand(1, T, H, device=device, dtype=dtype, generator=g).requires_grad_()
    target = torch.softmax(torch.randn(1, T, k, device=device, generator=g), -1)
    return q, kx, w, target


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, inputs, iters: int, device: str) -> float:
    """ms per forward + backward step (after two warm-up steps, which include compilation)."""
    for _ in range(2):
        fn(*inputs).backward()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*inputs).backward()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def profiled_rescore_share(shape, D: int, k: int, device: str, dtype) -> float | None:
    """Share of one hyscale step's device time spent in the rescore kernel (profiler)."""
    if device != "cuda":
        return None
    torch._dynamo.reset()
    inputs = make_inputs(*shape, D, k, device, dtype)
    fn = make_fn("hyscale", k)
    time_steps(fn, inputs, 1, device)
    records = device_records(lambda: fn(*inputs).backward())
    total = sum(us for _, us in records)
    rescore = sum(us for name, us in records if "rescore_kernel" in name)
    return round(rescore / total, 4) if total else None


def device_records(run) -> list[tuple[str, float]]:
    """(name, microseconds) of every device record (kernels, memsets, copies) of one profiled call of
    ``run`` (no arguments), on CUDA.

    Device records only: summing every profiler row counted each kernel twice (as itself and as its
    launching op's self time), which halved the rescore share reported before.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def rescore_args(inputs, k: int) -> tuple:
    """The arguments of the ``hyscale.rescore`` call the replayed backward makes, at the inputs' selection."""
    q, kx, w, _ = inputs
    T, S = q.shape[1], kx.shape[1]
    with torch.no_grad():
        _, idx = hyscale_compile.indexer_topk(q, kx, k, weights=w.float(), scale=q.shape[-1] ** -0.5,
                                              query_offset=S - T)
    return (q.detach(), kx.detach(), w.detach().float(), idx, q.shape[-1] ** -0.5, True, True, S - T, None, None,
            None, None, None, float("-inf"))


def _wall_ms(run, iters: int, device: str) -> float:
    run()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    return round((time.perf_counter() - t0) * 1e3 / iters, 3)


def rescore_ms(inputs, k: int, iters: int, device: str, args: tuple | None = None) -> float:
    """Time of the rescore the replayed backward runs, at the same shapes (wall time per call: the op's
    host set-up included)."""
    args = args or rescore_args(inputs, k)
    with torch.no_grad():
        return _wall_ms(lambda: torch.ops.hyscale.rescore(*args), iters, device)


def rescore_floor_run(args: tuple):
    """The rescore's gather floor (benchmarks/floor.py) at the rescore's arguments: a launch of no
    arguments, the operands prepared once."""
    from hyscale_compile.runtime.reference import Visibility

    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.append(str(Path(__file__).resolve().parent))  # floor.py, beside this file
    import floor

    interpreter_shim()  # on a CPU (a --smoke run): runtime loop bounds in the interpreter
    q, kx, w, idx, scale, relu, causal, offset = args[:8]
    return floor.rescore_floor(q, kx, w, idx, scale, relu, Visibility(causal=causal, offset=offset), args[-1])[0]


def rescore_floor_ms(inputs, k: int, iters: int, device: str, args: tuple | None = None) -> float:
    """Time of the rescore's gather floor at the same inputs as ``rescore_ms``: the rescore's grid, index
    loads and key-row gathers without its arithmetic (wall time per call, one bare launch)."""
    run = rescore_floor_run(args or rescore_args(inputs, k))
    return _wall_ms(run, iters, device)


def kernel_ms(fn, name: str | None = None, reps: int = 10) -> float:
    """Device time per call of ``fn`` (no arguments), CUDA: its device records over ``reps`` calls after one,
    summed (those whose name holds ``name``, or all), in ms. No host gaps, unlike a wall or event time."""
    fn()
    torch.cuda.synchronize()

    def calls():
        for _ in range(reps):
            fn()

    return sum(us for n, us in device_records(calls) if name is None or name in n) / reps / 1e3


def rescore_device_ms(args: tuple, reps: int = 10) -> dict:
    """Kernel time per call (profiler device records) of the rescore and of its gather floor, and their
    ratio, the issue's measure: the wall times above include the rescore op's host set-up."""
    floor_run = rescore_floor_run(args)
    out = {}
    for key, name, run in (("rescore_device_ms", "rescore_kernel", lambda: torch.ops.hyscale.rescore(*args)),
                           ("rescore_floor_device_ms", "rescore_floor_kernel", floor_run)):
        out[key] = round(kernel_ms(run, name, reps), 4)
    out["rescore_over_floor"] = round(out["rescore_device_ms"] / out["rescore_floor_device_ms"], 3)
    return out


def sparse_backward_ms(inputs, k: int, device: str) -> dict:
    """Deterministic vs atomic dkx in the sparse backward kernel (decides PREFER_DETERMINISTIC): median
    device time from triton's do_bench (the step times above are wall times, host included)."""
    from triton.testing import do_bench

    from hyscale_compile.runtime import reference
    from hyscale_compile.runtime import sparse_backward as sb

    q, kx, w, _ = inputs
    T, S = q.shape[1], kx.shape[1]
    idx = torch.randint(0, S - T, (1, T, k), device=device)
    g = torch.randn(1, T, k, device=device)
    vis = reference.Visibility(causal=True, offset=S - T)

    def run(det: bool = True):
        return sb.sparse_backward(g, q.detach(), kx.detach(), w.detach().float(), idx, 0.1, True, vis,
                                  deterministic=det)

    def ms(fn) -> float:
        return round(do_bench(fn, return_mode="median"), 3)

    out = {}
    old = sb.PREFER_DETERMINISTIC
    try:
        sb.PREFER_DETERMINISTIC = False
        for det in (True, False):
            out["deterministic_ms" if det else "atomic_ms"] = ms(lambda det=det: run(det))
        for picks in (16, 64):  # picks per step of the row kernel (the default rule takes 32 here)
            sb.ROW_PICKS = picks
            out[f"deterministic_rowpicks{picks}_ms"] = ms(run)
    finally:
        sb.PREFER_DETERMINISTIC = old
        sb.ROW_PICKS = None
    return out


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower()


def run_mode(mode: str, shape, D: int, k: int, iters: int, device: str, dtype) -> tuple[object, int | None]:
    """(ms per step or 'OOM at N GiB', peak bytes or None)."""
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    T, S, H = shape
    try:
        inputs = make_inputs(T, S, H, D, k, device, dtype)
        ms = time_steps(make_fn(mode, k), inputs, iters, device)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        return round(ms, 3), peak
    except Exception as e:  # noqa: BLE001  (an OOM anywhere, compile included, is a result; so is a failure)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        if _is_oom(e):
            return f"OOM at {peak / 2**30:.1f} GiB", peak
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", None


def profile_step(shape, D: int, k: int, device: str, dtype) -> None:
    """Where a hyscale step's device time goes: the top operators of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(*shape, D, k, device, dtype)
    fn = make_fn("hyscale", k)
    time_steps(fn, inputs, 1, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn(*inputs).backward()
        _sync(device)
    key = "device_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def _guard(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (a side measurement must not lose the row)
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, print only")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help="step modes to time (\"\": the rescore rows alone)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of the issue's shapes")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining rows after this long")
    parser.add_argument("--profile", action="store_true", help="profile one hyscale step of the first shape")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "training.json"))
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    D, k = (16, 8) if args.smoke else (128, 2048)
    shapes = [(32, 128, 2)] if args.smoke else SHAPES[: args.shapes]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    modes = [m for m in args.modes.split(",") if m]  # "" : the rescore rows alone
    if args.profile:
        profile_step(shapes[0], D, k, device, dtype)
        return
    start = time.perf_counter()
    rows = []
    for shape in shapes:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent: skipping {shape}")
            continue
        T, S, H = shape
        row = {"T": T, "S": S, "H": H, "D": D, "k": k, **{key: None for key in MODE_KEYS.values()}}  # None: not run
        peaks = {}
        for mode in modes:
            row[MODE_KEYS[mode]], peaks[mode] = run_mode(mode, shape, D, k, args.iters, device, dtype)
            print(f"T={T} S={S} H={H} {mode}: {row[MODE_KEYS[mode]]} ms, peak {peaks[mode]}", flush=True)
        inputs = make_inputs(T, S, H, D, k, device, dtype)
        hy = row.get("hyscale_ms")
        rargs = _guard(rescore_args, inputs, k)
        rargs = rargs if isinstance(rargs, tuple) else None
        row["rescore_ms"] = _guard(rescore_ms, inputs, k, args.iters, device, rargs)
        row["rescore_floor_ms"] = _guard(rescore_floor_ms, inputs, k, args.iters, device, rargs)
        if device == "cuda" and rargs:
            found = _guard(rescore_device_ms, rargs)
            row.update(found if isinstance(found, dict) else {"rescore_over_floor": found})
        rs = row["rescore_ms"]
        # The profiled share is the truth; the standalone rescore time over the step is the fallback.
        share = _guard(profiled_rescore_share, shape, D, k, device, dtype) if isinstance(hy, float) else None
        if not isinstance(share, float):
            share = round(rs / hy, 4) if isinstance(hy, float) and isinstance(rs, float) else None
        row["rescore_share"] = share
        row["inductor_peak_bytes"] = peaks.get("inductor")
        row["hyscale_peak_bytes"] = peaks.get("hyscale")
        if device == "cuda" and not rows:
            row["sparse_backward"] = _guard(sparse_backward_ms, inputs, k, device)
        inputs = None  # free the GPU before the next shape
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not args.smoke:
            write_results(args.out, device, rows)


def overridden(module, over: dict, prefix: str = ""):
    """A with-block in which ``module``'s attributes ``prefix + name`` hold ``over``'s values, restored after (the
    tuning scripts' variants of a runtime module's knobs)."""
    if not over:  # patch.multiple wants at least one
        return contextlib.nullcontext()
    return mock.patch.multiple(module, **{prefix + n: v for n, v in over.items()})


def interpreter_shim() -> None:
    """Without CUDA (a --smoke run under TRITON_INTERPRET), load the tests' interpreter shim: runtime
    loop bounds in the kernels need it."""
    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "kernels"))
        import triton_interpret  # noqa: F401


def write_results(path: str, device: str, rows: list[dict], **extra) -> None:
    """results/*.json as every benchmark here writes it: device, versions, date, commit, rows (and extra)."""
    import triton

    # A copy of the tree without .git (a remote device) names its commit through the environment.
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = os.environ.get("HYSCALE_COMMIT") or subprocess.run(
        git, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "date": datetime.date.today().isoformat(), "commit": commit, **extra,
           "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(results_json(doc))


def results_json(doc: dict) -> str:
    """A results document as JSON with every row of a list of rows on a line of its own: the table
    reads, and diffs, row by row."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
            rows = ",\n".join("    " + json.dumps(row) for row in value)
            lines.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    main()
