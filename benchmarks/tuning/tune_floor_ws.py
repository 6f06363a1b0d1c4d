"""The scoring floor written for Triton's warp specialization, against our floor, in one run.

Our floor (``benchmarks/floor.py``, the filter's arithmetic alone) waits for each head's MMA before
that head's epilogue (a max and an FMA per element): on the H200 it keeps the tensor pipe ~66% busy
(NOTES-selection.md, v8).
Triton 3.6 can split a loop into a producer warpgroup (TMA loads) and two consumer warpgroups, the
structure that lets one consumer's epilogue run under the other's MMA. Its Hopper pass needs tensor
descriptors (on our pointer-load floor it asserts), so this program times a floor written with
descriptors, with and without ``warp_specialize`` (on the head loop or on the tile loop) and with
the head weights loaded by descriptor or by pointer. Every variant's row sums are compared with the
plain descriptor floor's (bitwise, and to 1e-5). Each variant runs in a subprocess with a timeout:
one that hangs (the warp-specialized build with descriptor weights did, once) is a result too.

This is an experiment that decided whether the score tile should move to descriptors; nothing in
the package uses this kernel. Outcome on the H200 (results/tune_floor_ws.json, 2026-11-30): no
warp-specialized variant gave a result within 45 s at either shape; q and kx by descriptor with the
weights by pointer ran 0.875x / 0.852x our pointer floor at H = 16 / 64 (with the weights by descriptor,
1.005x / 0.998x: a synchronous copy per head). The block kernel now reads q and kx that way
(``score_tile.tma_views``).

    python benchmarks/tuning/tune_floor_ws.py [--out results/tune_floor_ws.json] [--timeout 120]
    TRITON_INTERPRET=1 python benchmarks/tuning/tune_floor_ws.py --smoke    # tiny shapes on the CPU, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from hyscale_compile.runtime import hytopk, score_tile  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import floor  # noqa: E402  (the selection benchmark's floor)
import training  # noqa: E402  (write_results: the results file every benchmark here writes)

SHAPES = [(4096, 131072, 16), (4096, 131072, 64)]  # T, S, H; D = 128, bf16, every key visible
SMOKE_SHAPES = [(32, 256, 3)]
VARIANTS = {  # name: (warp specialization: "none" | "heads" | "tiles", weights: "desc" | "ptr", warps, stages)
    "desc": ("none", "desc", 4, 2),
    "desc_ptr_w": ("none", "ptr", 4, 2),
    "ws_heads_desc_w": ("heads", "desc", 4, 2),
    "ws_heads_ptr_w": ("heads", "ptr", 4, 2),
    "ws_heads_ptr_w_s3": ("heads", "ptr", 4, 3),
    "ws_tiles_ptr_w": ("tiles", "ptr", 4, 2),
}


@triton.jit
def floor_desc_kernel(q_ptr, kx_ptr, wt_ptr, out_ptr, T, S, SPLIT,
                      H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                      WS_HEADS: tl.constexpr, WS_TILES: tl.constexpr, W_DESC: tl.constexpr):
    """Row sums of sum_h wt[h, t] * relu(q[t, h] . kx[s]) over the tiles split, split + SPLIT, ...
    q [T, H * D], kx [S, D] (bf16), wt [H, T] (fp32, scale folded in): score_tile's arithmetic."""
    split = tl.program_id(0)
    row0 = tl.program_id(1) * BT
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[T, H * D], strides=[H * D, 1], block_shape=[BT, D])
    k_desc = tl.make_tensor_descriptor(kx_ptr, shape=[S, D], strides=[D, 1], block_shape=[BS, D])
    w_desc = tl.make_tensor_descriptor(wt_ptr, shape=[H, T], strides=[T, 1], block_shape=[1, BT])
    rows = row0 + tl.arange(0, BT)
    sink = tl.zeros((BT,), dtype=tl.float32)
    for tile in tl.range(split, tl.cdiv(S, BS), SPLIT, warp_specialize=WS_TILES):
        kt = k_desc.load([tile * BS, 0])
        acc = tl.zeros((BT, BS), dtype=tl.float32)
        for h in tl.range(H, warp_specialize=WS_HEADS):
            s = tl.dot(q_desc.load([row0, h * D]), kt.T, out_dtype=tl.float32)
            if W_DESC:
                w = tl.reshape(w_desc.load([h, row0]), [BT])
            else:
                w = tl.load(wt_ptr + h * T + rows, mask=rows < T, other=0.0)
            acc = tl.fma(tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL), w[:, None], acc)
        sink += tl.sum(acc, axis=1)
    tl.store(out_ptr + (tl.program_id(1) * SPLIT + split) * BT + tl.arange(0, BT), sink)


def inputs(T: int, S: int, H: int, D: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same operands in every process: seeded, generated on the device."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dot takes fp32
    q = torch.randn(1, T, H, D, device=device).to(dtype)
    kx = torch.randn(1, S, D, device=device).to(dtype)
    w = torch.randn(1, T, H, device=device) / H**0.5
    return q, kx, w


def reference_sums(T: int, S: int, H: int, D: int) -> torch.Tensor:
    """Each row's sum over all keys of sum_h scale * w[t, h] * relu(q[t, h] . kx[s]), in float64."""
    q, kx, w = inputs(T, S, H, D, "cpu")
    s = torch.einsum("thd,sd->ths", q[0].double(), kx[0].double()).relu()
    return (s * (w[0].double() * D**-0.5)[:, :, None]).sum((1, 2))


def bench(fn, smoke: bool) -> float:
    if smoke:
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def run_one(name: str, shape: tuple[int, int, int], smoke: bool, sums_path: str) -> dict:
    """One variant at one shape, in this process: its time, and its row sums saved to sums_path."""
    ws, wload, warps, stages = VARIANTS[name]
    T, S, H = shape
    D, BT, BS = (32, 16, 32) if smoke else (128, 64, 128)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    q, kx, w = inputs(T, S, H, D, device)
    scale = D**-0.5
    wt = (w.reshape(T, H) * scale).t().contiguous()
    split = 8 if smoke else 32
    out = torch.empty(split * triton.cdiv(T, BT) * BT, device=device)

    def launch():
        floor_desc_kernel[(split, triton.cdiv(T, BT))](
            q.reshape(T, H * D), kx.reshape(S, D), wt, out, T, S, split, H=H, D=D, BT=BT, BS=BS,
            WS_HEADS=ws == "heads", WS_TILES=ws == "tiles", W_DESC=wload == "desc", num_warps=warps,
            num_stages=stages)

    launch()
    ms = bench(launch, smoke)
    torch.save(out.view(-1, split, BT).sum(1).flatten()[:T].cpu(), sums_path)  # [row blocks, SPLIT, BT]
    return dict(variant=name, ms=ms)


def ours(shape: tuple[int, int, int], smoke: bool) -> dict:
    """Our floor at the same shape, every key visible (benchmarks/floor.py, the default tile)."""
    T, S, H = shape
    D = 32 if smoke else 128
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kx, w = inputs(T, S, H, D, device)
    pb = hytopk.Problem(q, kx, w, D**-0.5, True, Visibility(), float("-inf"))
    split = hytopk.make_plan(pb, 2048).filter_split
    sink = floor.sink(pb, split)
    floor.floor(pb, sink, split)
    ms = bench(lambda: floor.floor(pb, sink, split), smoke)
    return dict(ours_ms=ms, tile=[score_tile.TILE.bt, score_tile.TILE.bs, score_tile.TILE.warps])


def flops(T: int, S: int, H: int, D: int) -> float:
    return 2.0 * T * S * H * D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune_floor_ws.json"))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for one variant (compile and timing)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing, print only")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run one variant
    ap.add_argument("--shape", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sums", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        training.interpreter_shim()
    if args.one is not None:
        print(json.dumps(run_one(args.one, shapes[args.shape], args.smoke, args.sums)), flush=True)
        return
    rows, firsts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n, shape in enumerate(shapes):
            T, S, H = shape
            row = dict(T=T, S=S, H=H, **ours(shape, args.smoke), variants={})
            ref = None
            for name in VARIANTS:
                path = os.path.join(tmp, f"{n}_{name}.pt")
                cmd = [sys.executable, __file__, "--one", name, "--shape", str(n), "--sums", path]
                try:
                    done = subprocess.run(cmd + (["--smoke"] if args.smoke else []), capture_output=True, text=True,
                                          timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    row["variants"][name] = dict(error=f"no result within {args.timeout:.0f} s (hang or compile)")
                    continue
                if done.returncode != 0:
                    row["variants"][name] = dict(error=done.stderr.strip().splitlines()[-1][:300])
                    continue
                res = json.loads(done.stdout.strip().splitlines()[-1])
                sums = torch.load(path)
                ref = sums if ref is None else ref
                res["sums_bitwise_equal_first"] = bool(torch.equal(sums, ref))
                res["sums_close_first"] = bool(torch.allclose(sums, ref, rtol=1e-5, atol=1e-5))
                if not args.smoke:
                    res["tflops"] = round(flops(T, S, H, 128) / res["ms"] / 1e9, 1)
                    res["over_ours"] = round(res["ms"] / row["ours_ms"], 3)
                row["variants"][name] = res
            print(json.dumps(row), flush=True)
            rows.append(row)
            firsts.append(ref)
    if args.smoke:
        bad = [(r["T"], v) for r in rows for v, res in r["variants"].items() if not res.get("sums_close_first")]
        assert not bad, f"variants failed or disagree on the CPU: {bad}"
        for (T, S, H), first in zip(shapes, firsts):  # and the first agrees with plain torch
            assert torch.allclose(first.double(), reference_sums(T, S, H, 32), rtol=1e-4, atol=1e-3), (T, S, H)
        return
    print("\n| T | S | H | ours ms | " + " | ".join(VARIANTS) + " |")
    print("|---" * (4 + len(VARIANTS)) + "|")
    for r in rows:
        cells = [f"{v['over_ours']}x" if "over_ours" in v else "failed" for v in r["variants"].values()]
        print(f"| {r['T']} | {r['S']} | {r['H']} | {r['ours_ms']:.3f} | " + " | ".join(cells) + " |")
    training.write_results(args.out, "cuda", rows)


if __name__ == "__main__":
    main()
