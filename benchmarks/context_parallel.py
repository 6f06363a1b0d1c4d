"""Context-parallel indexer selection: equality with one GPU, time per rank, and whether overlap helps.

Multi-GPU (the run of issue 3):

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --out cp.json

Each rank holds T = L / world queries at global positions [rank*T, (rank+1)*T) and its chunk of
keys; ``cp_indexer_topk`` all-gathers the keys and selects with the rank's query offset. Measured,
per rank: the CP call without and with overlap, the key gather alone and the selection alone on
already-gathered keys (so the overlap's ceiling is visible), and the same for the load-balanced
zigzag layout (rank r holds chunks r and 2*world-1-r). Rank 0 then times one GPU doing the same
rows (each rank's rows in turn, and all rows in one call when memory allows). "derived" in the
JSON has the ratios: CP vs one GPU on the same rows, overlap gain, the gather's share, speedups.
Equality: on blocks of sampled rows, the CP result must equal a one-GPU call over the whole key
set with that block's offset (indices identical, values bitwise); a few rows are also checked
against the plain-PyTorch reference with the near-tie rule.

One GPU, one rank's work (as rank ``--rank`` of ``--world`` would see it, ``--layout`` contiguous
or zigzag):

    python benchmarks/context_parallel.py --single --out single.json

Defaults are the issue's sizes (L=262144, H=16, D=128, k=2048, bf16). Without CUDA it runs on CPU
with gloo (use tiny sizes: ``--L 256 --H 2 --D 16 --k 8``). The JSON is written after every phase,
so a failure late in the run keeps what was measured; errors are recorded in it, and the exit code
is 1 when any equality check failed or a phase raised. ``--smoke`` is one rank's work at those tiny
sizes in one process, printed and not written:

    python benchmarks/context_parallel.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hyscale_compile import indexer_topk  # noqa: E402
from hyscale_compile.distributed import (  # noqa: E402
    cp_indexer_topk,
    gather_keys,
    global_positions,
    merge_topk,
    rank_segments,
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="where to write the JSON results (required but with --smoke)")
    p.add_argument("--smoke", action="store_true", help="--single at tiny sizes, fp32, nothing written")
    p.add_argument("--single", action="store_true", help="one process: one rank's work on one device")
    p.add_argument("--rank", type=int, default=None, help="--single: which rank's rows (default: the last)")
    p.add_argument("--world", type=int, default=2, help="--single: how many ranks the sequence is split over")
    p.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous",
                   help="--single: which layout's rows the rank holds")
    p.add_argument("--layouts", default="contiguous,zigzag",
                   help="CP: layouts to measure (contiguous always; zigzag = load-balanced chunks)")
    p.add_argument("--L", type=int, default=262144, help="sequence length (keys; queries over all ranks)")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-rows", type=int, default=256, help="rows per sampled block for the equality check")
    p.add_argument("--ref-rows", type=int, default=4, help="rows checked against the plain-PyTorch reference")
    p.add_argument("--no-full-baseline", action="store_true", help="skip one call over all L rows on one GPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.single, args.L, args.H, args.D, args.k, args.dtype = True, 256, 2, 16, 8, "fp32"
        args.iters, args.warmup, args.check_rows, args.ref_rows = 1, 0, 8, 2
    elif args.out is None:
        p.error("--out is required (but with --smoke)")
    return args


# ---------------------------------------------------------------------------------------------
# results: always written, phase by phase


class Results:
    def __init__(self, path: str, enabled: bool) -> None:
        self.path, self.enabled = Path(path), enabled
        self.data: dict = {"errors": [], "checks_passed": True}

    def save(self) -> None:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str))
            tmp.replace(self.path)

    def phase(self, name: str, fn: Callable[[], object]) -> object:
        """Run one phase; record its result or its error, save, and never raise."""
        try:
            out = fn()
            self.data[name] = out
            return out
        except Exception as e:  # noqa: BLE001 (unattended run: keep going, report everything)
            self.data["errors"].append({"phase": name, "error": repr(e), "traceback": traceback.format_exc()})
            if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None
        finally:
            self.save()


# ---------------------------------------------------------------------------------------------
# setup


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_dist(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Long enough for rank 0 to time the one-GPU baseline while the others wait at a barrier,
    # short enough that a rank lost to an error does not hold the machine for long.
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=15))


def make_inputs(args: argparse.Namespace, device: torch.device):
    """Full q [1, L, H, D], kx [1, L, D], w [1, L, H]: the same bits on every rank (same seed, same device kind)."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    dtype = _DTYPES[args.dtype]
    q = torch.empty(1, args.L, args.H, args.D, dtype=dtype, device=device)
    for a in range(0, args.L, 16384):  # in chunks: no fp32 copy of all of q at once
        q[:, a:a + 16384] = torch.randn(q[:, a:a + 16384].shape, generator=g, device=device).to(dtype)
    kx = torch.randn(1, args.L, args.D, generator=g, device=device).to(dtype)
    w = torch.randn(1, args.L, args.H, generator=g, device=device) * args.H ** -0.5
    return q, kx, w


def _env(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


# ---------------------------------------------------------------------------------------------
# timing and checks


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int,
          barrier: bool = False) -> dict:
    """Wall time of fn (device synchronised; ranks aligned by a barrier when ``barrier``).

    With ``barrier`` an error in fn does not stop the loop: every rank must make the same calls
    (and so the same collectives), or the others would wait forever.
    """
    errors: list[str] = []

    def call() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            if not barrier:
                raise
            errors.append(repr(e))

    for _ in range(warmup):
        call()
    _sync(device)
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if errors:
        return {"error": errors[0], "errors": len(errors)}
    return {"median_s": sorted(times)[len(times) // 2], "min_s": min(times), "all_s": times}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def check_blocks(values: torch.Tensor, indices: torch.Tensor, q: torch.Tensor, kx: torch.Tensor, w: torch.Tensor,
                 segments: list[tuple[int, int, int]], args: argparse.Namespace, scale: float) -> dict:
    """Compare rows of a rank's result with one-device calls over the whole key set, block by block.

    ``segments``: the rank's rows as (local start, global start, length) runs. Blocks per run: its
    first rows, its last rows and a random block in between.
    """
    g = torch.Generator().manual_seed(args.seed + 1)
    blocks = []
    for local, first, length in segments:
        n = min(args.check_rows, length)
        for s in sorted({0, length - n, int(torch.randint(0, length - n + 1, (1,), generator=g))}):
            a, ls = first + s, local + s
            ref_v, ref_i = indexer_topk(q[:, a:a + n], kx, args.k, weights=w[:, a:a + n], scale=scale,
                                        query_offset=a)
            got_v, got_i = values[:, ls:ls + n], indices[:, ls:ls + n]
            blocks.append({"global_rows": [a, a + n], "indices_equal": torch.equal(got_i, ref_i),
                           "values_bitwise": _bits_equal(got_v, ref_v),
                           "rows_with_index_mismatch": int((got_i != ref_i).any(-1).sum())})
    return {"blocks": blocks, "all_equal": all(b["indices_equal"] and b["values_bitwise"] for b in blocks)}


def check_reference(values: torch.Tensor, indices: torch.Tensor, q: torch.Tensor, kx: torch.Tensor, w: torch.Tensor,
                    segments: list[tuple[int, int, int]], args: argparse.Namespace, scale: float) -> dict:
    """A few rows against the plain-PyTorch reference (fp32 einsum), near-tie rule: catches kernel bugs."""
    from hyscale_compile.runtime.dispatch import force_backend
    from hyscale_compile.testing import assert_same_topk

    local, first, length = max(segments, key=lambda seg: seg[1])  # the last rows see the most keys
    n = min(args.ref_rows, length)
    a, ls = first + length - n, local + length - n
    with force_backend("reference"):
        ref_v, ref_i = indexer_topk(q[:, a:a + n], kx, args.k, weights=w[:, a:a + n], scale=scale, query_offset=a)
    try:
        assert_same_topk(values[:, ls:ls + n], indices[:, ls:ls + n], ref_v, ref_i, rtol=1e-4, atol=1e-4)
        return {"global_rows": [a, a + n], "ok": True}
    except AssertionError as e:
        return {"global_rows": [a, a + n], "ok": False, "message": str(e)[:2000]}


# ---------------------------------------------------------------------------------------------
# the two modes


def _rank_rows(q, kx, w, rank: int, T: int):
    rows = slice(rank * T, (rank + 1) * T)
    return q[:, rows].contiguous(), kx[:, rows].contiguous(), w[:, rows].contiguous()


def _one_device_segments(q, kx, w, segments: list[tuple[int, int, int]], k: int, scale: float):
    """What a rank computes, done on one device: per run of rows, the keys up to its end, its offset."""
    values, indices = [], []
    for _, first, n in segments:
        end = min(kx.shape[1], max(first + n, k))
        v, i = indexer_topk(q[:, first:first + n], kx[:, :end], k, weights=w[:, first:first + n], scale=scale,
                            query_offset=first)
        values.append(v)
        indices.append(i)
    if len(values) == 1:
        return values[0], indices[0]
    return torch.cat(values, dim=1), torch.cat(indices, dim=1)


def _one_device_rank_work(q, kx, w, rank: int, T: int, k: int, scale: float, world: int = 1,
                          layout: str = "contiguous"):
    return _one_device_segments(q, kx, w, rank_segments(rank, world, T, layout), k, scale)


def _overlap_parts(q_l, kx_l, w_l, kx, rank: int, T: int, k: int, scale: float):
    """The overlapped path's work without communication: diagonal block, lower ranks' block, merge.

    Timed separately it shows what the overlap costs in extra work (two launches and a merge).
    """
    own_v, own_i = indexer_topk(q_l, kx_l, k, weights=w_l, scale=scale, query_offset=0)
    if rank == 0:
        return own_v, own_i
    low = kx[:, :rank * T]
    low_v, low_i = indexer_topk(q_l, low, min(k, low.shape[1]), weights=w_l, scale=scale, query_offset=rank * T)
    return merge_topk(low_v, low_i, own_v, own_i + rank * T, k, ordered=True)


def run_cp(args: argparse.Namespace, res: Results, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    T = args.L // world
    if T * world != args.L:
        raise SystemExit(f"--L {args.L} must be a multiple of the world size {world}")
    scale = args.D ** -0.5
    q, kx, w = make_inputs(args, device)
    q_l, kx_l, w_l = _rank_rows(q, kx, w, rank, T)
    segs = rank_segments(rank, world, T)
    mine: dict = {"rank": rank, "first_row": rank * T}

    def cp(overlap: bool):
        return lambda: cp_indexer_topk(q_l, kx_l, args.k, weights=w_l, scale=scale, overlap=overlap)

    # Collective phases: every rank runs them in the same order (a failing one is recorded, not skipped).
    out_plain = _phase(res, mine, "cp_result_no_overlap", lambda: cp(False)())
    mine["time_cp_no_overlap"] = _try(lambda: timed(cp(False), device, args.iters, args.warmup, barrier=True))
    mine["time_cp_overlap"] = _try(lambda: timed(cp(True), device, args.iters, args.warmup, barrier=True))
    mine["time_key_gather"] = _try(lambda: timed(lambda: gather_keys(kx_l), device, args.iters, args.warmup,
                                                 barrier=True))
    out_overlap = _phase(res, mine, "cp_result_overlap", lambda: cp(True)())
    # Local phases: no communication.
    mine["time_select_only"] = _try(lambda: timed(lambda: _one_device_rank_work(q, kx, w, rank, T, args.k, scale),
                                                  device, args.iters, args.warmup))
    mine["time_overlap_parts_no_comm"] = _try(lambda: timed(
        lambda: _overlap_parts(q_l, kx_l, w_l, kx, rank, T, args.k, scale), device, args.iters, args.warmup))
    if out_plain is not None:
        mine["check_no_overlap"] = _try(lambda: check_blocks(*out_plain, q, kx, w, segs, args, scale))
        mine["check_reference"] = _try(lambda: check_reference(*out_plain, q, kx, w, segs, args, scale))
    if out_overlap is not None:
        mine["check_overlap"] = _try(lambda: check_blocks(*out_overlap, q, kx, w, segs, args, scale))
    if out_plain is not None and out_overlap is not None:
        mine["overlap_equals_no_overlap"] = (torch.equal(out_plain[1], out_overlap[1])
                                             and _bits_equal(out_plain[0], out_overlap[0]))
    out_plain = out_overlap = None  # free them before the one-GPU baseline
    if "zigzag" in args.layouts.split(","):
        _run_zigzag(args, q, kx, w, rank, world, T, scale, device, mine, res)
    if device.type == "cuda":
        mine["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    res.data["per_rank"] = per_rank
    res.save()
    if rank == 0:
        res.data["one_gpu"] = _one_device_baseline(args, q, kx, w, world, T, scale, device)
        res.data["derived"] = _try(lambda: _derived(res.data))
        res.save()
    dist.barrier()


def _run_zigzag(args, q, kx, w, rank: int, world: int, T: int, scale: float, device: torch.device, mine: dict,
                res: Results) -> None:
    """The load-balanced layout: rank r holds chunks r and 2*world-1-r (queries and keys)."""
    pos = global_positions(T, layout="zigzag", device=device)
    q_z, kx_z, w_z = q[:, pos].contiguous(), kx[:, pos].contiguous(), w[:, pos].contiguous()
    segs = rank_segments(rank, world, T, "zigzag")
    mine["zigzag_segments"] = segs

    def cp():
        return cp_indexer_topk(q_z, kx_z, args.k, weights=w_z, scale=scale, layout="zigzag")

    out = _phase(res, mine, "cp_result_zigzag", cp)
    mine["time_cp_zigzag"] = _try(lambda: timed(cp, device, args.iters, args.warmup, barrier=True))
    mine["time_select_only_zigzag"] = _try(lambda: timed(
        lambda: _one_device_segments(q, kx, w, segs, args.k, scale), device, args.iters, args.warmup))
    if out is not None:
        mine["check_zigzag"] = _try(lambda: check_blocks(*out, q, kx, w, segs, args, scale))


def _med(x) -> float | None:
    return x.get("median_s") if isinstance(x, dict) else None


def _derived(data: dict) -> dict:
    """Ratios that answer the issue's questions (None where a timing is missing).

    cp_over_one_gpu_same_rows: a rank's CP call against one GPU doing that rank's rows (CP overhead).
    overlap_gain_s: no-overlap minus overlap time (positive = overlap helps).
    gather_share: the key gather's share of the no-overlap call (the most any overlap can hide).
    speedup_vs_one_gpu_all_rows: one GPU doing every rank's rows against the slowest rank.
    """
    out: dict = {}
    one = data.get("one_gpu", {})
    slowest = None
    for r in data.get("per_rank") or []:
        rk = r["rank"]
        plain, ov = _med(r.get("time_cp_no_overlap")), _med(r.get("time_cp_overlap"))
        gather, same = _med(r.get("time_key_gather")), _med(one.get(f"rank{rk}_rows"))
        out[f"rank{rk}"] = {
            "cp_over_one_gpu_same_rows": plain / same if plain and same else None,
            "overlap_gain_s": plain - ov if plain and ov else None,
            "gather_share": gather / plain if gather and plain else None,
        }
        if plain:
            slowest = max(slowest or 0.0, plain)
    chunks = one.get("all_rows_in_rank_chunks_s")
    single = _med(one.get("all_rows_one_call"))
    out["speedup_vs_one_gpu_all_rows_in_chunks"] = chunks / slowest if chunks and slowest else None
    out["speedup_vs_one_gpu_all_rows_one_call"] = single / slowest if single and slowest else None
    zig = [_med(r.get("time_cp_zigzag")) for r in data.get("per_rank") or []]
    if zig and all(zig):
        out["zigzag_slowest_rank_s"] = max(zig)
        out["zigzag_imbalance_max_over_min"] = max(zig) / min(zig)
        out["zigzag_speedup_vs_one_gpu_all_rows_in_chunks"] = chunks / max(zig) if chunks else None
        out["zigzag_speedup_vs_one_gpu_all_rows_one_call"] = single / max(zig) if single else None
    plain = [_med(r.get("time_cp_no_overlap")) for r in data.get("per_rank") or []]
    if plain and all(plain):
        out["contiguous_imbalance_max_over_min"] = max(plain) / min(plain)
    return out


def _one_device_baseline(args, q, kx, w, world: int, T: int, scale: float, device: torch.device) -> dict:
    """One device doing the same rows: each rank's rows in turn, and all rows in one call."""
    out: dict = {}
    for r in range(world):
        out[f"rank{r}_rows"] = _try(lambda r=r: timed(lambda: _one_device_rank_work(q, kx, w, r, T, args.k, scale),
                                                      device, args.iters, args.warmup))
    per = [out[f"rank{r}_rows"] for r in range(world)]
    if all(p and "median_s" in p for p in per):
        out["all_rows_in_rank_chunks_s"] = sum(p["median_s"] for p in per)
    if "zigzag" in args.layouts.split(","):
        for r in range(world):
            out[f"rank{r}_rows_zigzag"] = _try(lambda r=r: timed(
                lambda: _one_device_rank_work(q, kx, w, r, T, args.k, scale, world, "zigzag"),
                device, args.iters, args.warmup))
    if not args.no_full_baseline:
        out["all_rows_one_call"] = _try(lambda: timed(
            lambda: indexer_topk(q, kx, args.k, weights=w, scale=scale, query_offset=0),
            device, max(1, args.iters // 2), 1))
    return out


def run_single(args: argparse.Namespace, res: Results, device: torch.device) -> None:
    rank = args.world - 1 if args.rank is None else args.rank
    T = args.L // args.world
    scale = args.D ** -0.5
    q, kx, w = make_inputs(args, device)
    segs = rank_segments(rank, args.world, T, args.layout)
    mine: dict = {"rank": rank, "world": args.world, "layout": args.layout, "segments": segs}

    def work():
        return _one_device_segments(q, kx, w, segs, args.k, scale)

    out = _phase(res, mine, "result", work)
    mine["time_select"] = _try(lambda: timed(work, device, args.iters, args.warmup))
    parts = None
    if args.layout == "contiguous":  # the split-overlap path exists for this layout only
        q_l, kx_l, w_l = _rank_rows(q, kx, w, rank, T)

        def split():
            return _overlap_parts(q_l, kx_l, w_l, kx, rank, T, args.k, scale)

        mine["time_overlap_parts_no_comm"] = _try(lambda: timed(split, device, args.iters, args.warmup))
        parts = _phase(res, mine, "overlap_parts_result", split)
    if out is not None:
        mine["check"] = _try(lambda: check_blocks(*out, q, kx, w, segs, args, scale))
        mine["check_reference"] = _try(lambda: check_reference(*out, q, kx, w, segs, args, scale))
        if parts is not None:
            mine["overlap_parts_equal"] = torch.equal(out[1], parts[1]) and _bits_equal(out[0], parts[0])
    if device.type == "cuda":
        mine["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    res.data["single"] = mine
    res.save()


def _try(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": repr(e), "traceback": traceback.format_exc()}


def _phase(res: Results, mine: dict, name: str, fn: Callable[[], object]):
    """Run fn; on error record it under ``name`` and return None."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        mine[name] = {"error": repr(e), "traceback": traceback.format_exc()}
        return None


def _all_checks_passed(data: dict) -> bool:
    """False if any equality check failed or any recorded phase raised."""
    ok = not data["errors"]

    def walk(x) -> None:
        nonlocal ok
        if isinstance(x, dict):
            if "error" in x or x.get("all_equal") is False or x.get("ok") is False:
                ok = False
            for key, v in x.items():
                if key in ("overlap_equals_no_overlap", "overlap_parts_equal") and v is False:
                    ok = False
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk({k: v for k, v in data.items() if k != "errors"})
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _device()
    distributed = not args.single
    if distributed:
        _init_dist(device)
    rank = dist.get_rank() if distributed else 0
    res = Results(args.out or "", enabled=rank == 0 and not args.smoke)
    res.data.update({"mode": "single" if args.single else "cp", "args": vars(args), "env": _env(device),
                     "world": dist.get_world_size() if distributed else 1})
    res.save()
    try:
        res.phase("run", lambda: (run_single if args.single else run_cp)(args, res, device))
    finally:
        res.data["checks_passed"] = _all_checks_passed(res.data)
        res.save()
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(_summary(res.data), indent=2))
    return 0 if res.data["checks_passed"] else 1


def _summary(data: dict) -> dict:
    """The headline numbers (the JSON holds everything)."""
    med = _med

    s: dict = {"mode": data.get("mode"), "checks_passed": data.get("checks_passed"), "errors": len(data["errors"])}
    for r in data.get("per_rank") or []:
        s[f"rank{r['rank']}"] = {k: med(r.get(k)) for k in ("time_cp_no_overlap", "time_cp_overlap",
                                                             "time_key_gather", "time_select_only",
                                                             "time_overlap_parts_no_comm", "time_cp_zigzag",
                                                             "time_select_only_zigzag")}
    if "one_gpu" in data:
        s["one_gpu"] = {k: (med(v) if isinstance(v, dict) else v) for k, v in data["one_gpu"].items()}
    if "single" in data:
        s["single"] = {k: med(data["single"].get(k)) for k in ("time_select", "time_overlap_parts_no_comm")}
    if "derived" in data:
        s["derived"] = data["derived"]
    return s


if __name__ == "__main__":
    sys.exit(main())
