"""Peer top-k kernels for the selection benchmarks: FlashInfer's radix top-k and CUB's DeviceBatchedTopK.

Both are built from FlashInfer 0.7.4's own headers (topk.cuh; the vendored CCCL 3.6) into one
C-ABI shared library (peer_topk.cu, built by build.sh) and called here through ctypes on torch
CUDA tensors, on the current stream, the way ``flashinfer.top_k`` calls them for a dense
[rows, cols] fp32 score table:

- ``Peers.flashinfer_topk``: ``flashinfer::sampling::TopKDispatch`` (FlashInfer's pick between
  FilteredTopK and the multi-CTA radix select), with its ``deterministic`` and ``tie_break``
  modes. Indices int32, as the kernel writes them (``flashinfer.top_k`` adds a ``.long()``).
- ``Peers.cub_topk``: ``cub::DeviceBatchedTopK::MaxPairs``, one segment a row (cols <= 2^21).
  Indices int64, written by the kernel (as ``flashinfer.top_k``'s CUB path does).

Both return ``(values, indices)`` like ``torch.topk``, unsorted unless ``sorted=True``. The default
mode of both is the exact, reproducible one: ties broken toward the lowest index
(``tie_break=1``), FlashInfer also ``deterministic=True``.

    python -m benchmarks.peers --check [--so PATH]   # correctness against torch.topk, timings
    python -m benchmarks.peers --build [--extract DIR] [--so PATH]

The third-party headers and the built library live in the untracked ``.peers/`` folder at the
repo root (``.peers/flashinfer``, ``.peers/peer_topk.so``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_EXTRACT = ROOT / ".peers" / "flashinfer"
DEFAULT_SO = ROOT / ".peers" / "peer_topk.so"

TIE_NONE, TIE_SMALL, TIE_LARGE = 0, 1, 2  # FlashInfer's TopKTieBreak values, shared by both peers

_CUDA_ERRORS = {  # the codes these entry points are likely to return
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    9: "cudaErrorInvalidConfiguration",
    35: "cudaErrorInsufficientDriver",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    209: "cudaErrorNoKernelImageForDevice",
    222: "cudaErrorUnsupportedPtxVersion",
    801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}

last_error: str | None = None  # why the last load() returned None


def build(src_dir: str | Path | None = None, out_path: str | Path | None = None) -> Path:
    """Compile the library with nvcc (through build.sh, the one copy of the command).

    ``src_dir`` is the FlashInfer extract (default ``.peers/flashinfer``; the wheel's
    ``flashinfer/data`` layout works too), ``out_path`` the library (default
    ``.peers/peer_topk.so``). About a minute on a few cores; needs no GPU.
    """
    out = Path(out_path) if out_path is not None else DEFAULT_SO
    src = Path(src_dir) if src_dir is not None else DEFAULT_EXTRACT
    subprocess.run(["bash", str(HERE / "build.sh"), str(src), str(out)], check=True)
    return out


def load(path: str | Path | None = None) -> Peers | None:
    """The library at ``path`` (default ``.peers/peer_topk.so``), or None (reason in ``last_error``)."""
    global last_error
    so = Path(path) if path is not None else DEFAULT_SO
    if not so.is_file():
        last_error = f"{so}: no such file (build it with benchmarks/peers/build.sh)"
        return None
    try:
        return Peers(ctypes.CDLL(str(so)))
    except (OSError, AttributeError) as exc:  # unloadable, or built from another version
        last_error = f"{so}: {exc}"
        return None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _on(device: torch.device):
    """Make ``device`` current for the library's CUDA runtime (it follows the thread's current
    context, which torch sets); a no-op when it already is, to keep the per-call host cost low."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_CUDA_ERRORS.get(rc, 'cudaError')} ({rc})")


class Peers:
    """The loaded library; each method takes an fp32 CUDA [rows, cols] tensor and runs on its
    device's current stream."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, i32, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_size_t
        lib.peer_flashinfer_topk_workspace_bytes.argtypes = []
        lib.peer_flashinfer_topk_workspace_bytes.restype = sz
        lib.peer_flashinfer_topk.argtypes = [p, i64, i64, i64, p, p, p, sz, i32, i32, i32, p]
        lib.peer_flashinfer_topk.restype = i32
        lib.peer_cub_topk_workspace_bytes.argtypes = [i64, i64, i64, i32, ctypes.POINTER(sz)]
        lib.peer_cub_topk_workspace_bytes.restype = i32
        lib.peer_cub_topk.argtypes = [p, i64, i64, i64, i64, p, p, p, sz, i32, p]
        lib.peer_cub_topk.restype = i32
        self.lib = lib
        self._fi_bytes = lib.peer_flashinfer_topk_workspace_bytes()
        self._fi_ws: dict = {}  # (device, stream) -> zeroed row-state buffer
        self._cub_ws: dict = {}  # (device, stream) -> scratch, grown on demand
        self._cub_bytes: dict = {}  # (device, rows, cols, k, tie_break) -> bytes (a host query)

    # ------------------------------------------------------------------ FlashInfer
    def flashinfer_topk(
        self,
        scores: torch.Tensor,
        k: int,
        *,
        deterministic: bool = True,
        tie_break: int = TIE_SMALL,
        sorted: bool = False,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's top-k of each row: (values fp32, indices int32), each [rows, k].

        This is flashinfer.top_k's native path (``radix_topk``), whatever shape: see
        ``flashinfer_top_k`` for its backend choice. ``scores`` must be contiguous. ``tie_break``
        (0 none, 1 lowest index, 2 highest) forces FlashInfer's FilteredTopK, so k <= 2048 then.
        ``sorted``: descending by value; as in flashinfer.top_k, deterministic calls with
        k <= 2048 sort on the device (FlashInfer's stable block sort), others with torch.sort.
        ``out``: preallocated (values, indices) to write into.
        """
        rows, cols = _check_scores(scores, k)
        if not scores.is_contiguous():
            raise ValueError("flashinfer_topk needs contiguous scores")
        vals, idx = _outputs(scores, k, torch.int32, out)
        dev = scores.device
        stream = _stream(dev)
        if torch.cuda.is_current_stream_capturing():
            # As flashinfer.top_k: a graph gets its own buffer, which its captured memset re-zeroes
            # on every replay (replays of two graphs may overlap).
            ws = torch.zeros(self._fi_bytes, dtype=torch.uint8, device=dev)
        else:
            # Each launch leaves the buffer zeroed again, so one per stream serves every launch.
            ws = self._fi_ws.get((dev, stream))
            if ws is None:
                ws = self._fi_ws[(dev, stream)] = torch.zeros(self._fi_bytes, dtype=torch.uint8, device=dev)
        on_device_sort = sorted and deterministic and k <= 2048  # flashinfer.top_k's choice
        with _on(dev):
            rc = self.lib.peer_flashinfer_topk(
                scores.data_ptr(), rows, cols, k, idx.data_ptr(), vals.data_ptr(), ws.data_ptr(),
                ws.numel(), int(deterministic), int(tie_break), int(on_device_sort), stream,
            )  # fmt: skip
        _check_rc(rc, "peer_flashinfer_topk")
        if sorted and not on_device_sort:
            return _sort(vals, idx, stable=deterministic)
        return vals, idx

    def flashinfer_top_k(
        self,
        scores: torch.Tensor,
        k: int,
        *,
        sorted: bool = False,
        deterministic: bool = False,
        tie_break: int = TIE_NONE,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``flashinfer.top_k`` itself on an SM90 GPU for fp32 scores: (values, indices int64).

        Its backend choice (flashinfer/topk.py, can_use_cub_topk and is_cub_topk_beneficial; no
        clusters backend below SM100): CUB when neither sorted nor deterministic is asked and it
        is expected to win (eager: rows < 128, cols <= 8192, or k >= 4096 with cols >= 65536;
        under graph capture: rows < 128, cols <= 8192, or cols >= 32768); else the native kernels,
        whose int32 indices it widens. So with the defaults, [1, 131072] runs CUB and
        [4096, 131072] k=2048 the native radix.
        """
        rows, cols = _check_scores(scores, k)
        use_cub = not (sorted or deterministic) and cols <= (1 << 21)
        if use_cub:
            if torch.cuda.is_current_stream_capturing():
                use_cub = rows < 128 or cols <= 8192 or cols >= 32768
            else:
                use_cub = rows < 128 or cols <= 8192 or (k >= 4096 and cols >= 65536)
        if use_cub:
            return self.cub_topk(scores, k, tie_break=tie_break, sorted=sorted)
        vals, idx = self.flashinfer_topk(scores, k, deterministic=deterministic, tie_break=tie_break, sorted=sorted)
        return vals, idx.long()

    # ------------------------------------------------------------------ CUB
    def cub_workspace_bytes(self, rows: int, cols: int, k: int, tie_break: int = TIE_SMALL, device=None) -> int:
        """Scratch bytes cub_topk needs for this shape (a host-side query, cached)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        key = (dev, rows, cols, k, tie_break)
        if key not in self._cub_bytes:
            n = ctypes.c_size_t(0)
            with _on(dev):
                _check_rc(
                    self.lib.peer_cub_topk_workspace_bytes(rows, cols, k, tie_break, ctypes.byref(n)),
                    "peer_cub_topk_workspace_bytes",
                )
            self._cub_bytes[key] = n.value
        return self._cub_bytes[key]

    def cub_topk(
        self,
        scores: torch.Tensor,
        k: int,
        *,
        tie_break: int = TIE_SMALL,
        sorted: bool = False,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CUB DeviceBatchedTopK of each row: (values fp32, indices int64), each [rows, k].

        cols <= 2^21; rows need only be contiguous each (a row stride >= cols is fine).
        ``tie_break`` 1: deterministic across GPUs, ties to the lowest index; 2: to the highest;
        0: no guarantee (FlashInfer's default for CUB). CUB writes unsorted; ``sorted`` sorts
        with torch.sort afterwards, as flashinfer.top_k does.
        """
        rows, cols = _check_scores(scores, k)
        if scores.stride(1) != 1 or (rows > 1 and scores.stride(0) < cols):
            raise ValueError("cub_topk needs each row contiguous and rows not overlapping")
        vals, idx = _outputs(scores, k, torch.int64, out)
        dev = scores.device
        stream = _stream(dev)
        need = self.cub_workspace_bytes(rows, cols, k, tie_break, dev)
        if torch.cuda.is_current_stream_capturing():
            ws = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
        else:
            ws = self._cub_ws.get((dev, stream))
            if ws is None or ws.numel() < need:
                ws = self._cub_ws[(dev, stream)] = torch.empty(max(need, 1), dtype=torch.uint8, device=dev)
        with _on(dev):
            rc = self.lib.peer_cub_topk(
                scores.data_ptr(), scores.stride(0) if rows > 1 else cols, rows, cols, k,
                idx.data_ptr(), vals.data_ptr(), ws.data_ptr(), ws.numel(), int(tie_break), stream,
            )  # fmt: skip
        _check_rc(rc, "peer_cub_topk")
        if sorted:
            return _sort(vals, idx, stable=tie_break != TIE_NONE)
        return vals, idx


def _check_scores(scores: torch.Tensor, k: int) -> tuple[int, int]:
    if not scores.is_cuda or scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D float32 CUDA tensor, got {scores.dtype} {tuple(scores.shape)}")
    rows, cols = scores.shape
    if not 0 < k <= cols:
        raise ValueError(f"need 0 < k <= cols, got k={k}, cols={cols}")
    return rows, cols


def _outputs(scores, k, index_dtype, out):
    rows = scores.shape[0]
    if out is None:
        return (
            torch.empty(rows, k, dtype=torch.float32, device=scores.device),
            torch.empty(rows, k, dtype=index_dtype, device=scores.device),
        )
    vals, idx = out
    if vals.shape != (rows, k) or idx.shape != (rows, k) or idx.dtype != index_dtype or vals.dtype != torch.float32:
        raise ValueError(f"out must be float32 and {index_dtype} tensors of shape {(rows, k)}")
    if not (vals.is_contiguous() and idx.is_contiguous()):
        raise ValueError("out tensors must be contiguous")
    return vals, idx


def _sort(vals, idx, stable):
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=stable)
    return vals, torch.gather(idx, -1, order)


# ---------------------------------------------------------------------- --check


def _test_rows(kind: str, rows: int, cols: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=gen, device="cuda")
    if kind == "ties":  # few distinct values: the k-th value is tied many times
        x = torch.randint(0, 32, (rows, cols), generator=gen, device="cuda").float()
    elif kind == "causal":  # -inf past a per-row limit, some limits below k (ties at -inf)
        limit = torch.randint(1, cols + 1, (rows, 1), generator=gen, device="cuda")
        limit[: rows // 2] = torch.randint(1, k, (rows // 2, 1), generator=gen, device="cuda")
        x = x.masked_fill(torch.arange(cols, device="cuda") >= limit, float("-inf"))
    return x


def _verify(x: torch.Tensor, k: int, vals: torch.Tensor, idx: torch.Tensor, lowest: bool) -> str | None:
    """None if (vals, idx) is a top-k of x (ties at the k-th value broken any way, or toward the
    lowest index when ``lowest``); else what is wrong."""
    ref_vals, ref_idx = torch.sort(x, dim=-1, descending=True, stable=True)  # ties: lowest index first
    ref_vals, ref_idx = ref_vals[:, :k], ref_idx[:, :k]
    idx64 = idx.long()
    if not torch.equal(torch.sort(vals, dim=-1, descending=True).values, ref_vals):
        return "values differ from torch's as multisets"
    if not torch.equal(x.gather(-1, idx64), vals):
        return "values are not the scores at the returned indices"
    s = torch.sort(idx64, dim=-1).values
    if (s[:, 1:] == s[:, :-1]).any():
        return "an index is returned twice in a row"
    if lowest and not torch.equal(s, torch.sort(ref_idx, dim=-1).values):
        return "index set differs from the lowest-index tie-break"
    if not torch.equal(torch.sort(torch.topk(x, k, dim=-1).values, dim=-1).values, torch.sort(vals, dim=-1).values):
        return "values differ from torch.topk's"
    return None


def check(peers: Peers) -> bool:
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    configs = {  # name -> (call, lowest-index ties, deterministic)
        "flashinfer det tie=low": (lambda x, k: peers.flashinfer_topk(x, k), True, True),
        "flashinfer det": (lambda x, k: peers.flashinfer_topk(x, k, tie_break=TIE_NONE), False, True),
        "flashinfer default": (
            lambda x, k: peers.flashinfer_topk(x, k, deterministic=False, tie_break=TIE_NONE),
            False,
            False,
        ),
        "flashinfer.top_k default": (lambda x, k: peers.flashinfer_top_k(x, k), False, False),
        "cub tie=low": (lambda x, k: peers.cub_topk(x, k), True, True),
        "cub default": (lambda x, k: peers.cub_topk(x, k, tie_break=TIE_NONE), False, False),
    }
    shapes = [(64, 131072, 2048), (2, 131072, 2048), (8, 8192, 2048), (5, 4000, 300), (3, 600_000, 2048)]
    for kind in ("randn", "ties", "causal"):
        for rows, cols, k in shapes:
            x = _test_rows(kind, rows, cols, k, gen)
            for name, (call, lowest, det) in configs.items():
                try:
                    vals, idx = call(x, k)
                    err = _verify(x, k, vals, idx, lowest)
                    if err is None and det:
                        v2, i2 = call(x, k)
                        if not (torch.equal(v2, vals) and torch.equal(i2, idx)):
                            err = "two runs differ"
                    if err is None and kind == "randn" and name.endswith("tie=low"):
                        sv, si = (
                            peers.flashinfer_topk(x, k, sorted=True)
                            if name.startswith("flashinfer")
                            else peers.cub_topk(x, k, sorted=True)
                        )
                        if not torch.equal(sv, torch.topk(x, k, dim=-1).values) or _verify(x, k, sv, si, lowest):
                            err = "sorted=True output is not sorted"
                except Exception as exc:  # report and go on: one peer failing must not hide the other
                    err = f"{type(exc).__name__}: {exc}"
                ok &= err is None
                print(f"{'ok  ' if err is None else 'FAIL'} {kind:6} [{rows}, {cols}] k={k} {name}: {err or ''}")
            del x
    torch.cuda.synchronize()

    print("\nmedian ms (triton do_bench), fp32 scores, unsorted outputs")
    for rows, cols, k in ((4096, 131072, 2048), (1, 131072, 2048)):
        ok &= _time(rows, cols, k, configs)
    return ok


def _time(rows: int, cols: int, k: int, configs: dict) -> bool:
    from triton.testing import do_bench

    x = torch.randn(rows, cols, device="cuda")
    fns = {"torch.topk": lambda: torch.topk(x, k, dim=-1)}
    fns.update({name: (lambda call=call: call(x, k)) for name, (call, _, _) in configs.items()})
    ok = True
    for name, fn in fns.items():
        try:
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"  [{rows}, {cols}] k={k}  {name:24} {ms:9.4f}")
        except Exception as exc:
            ok = False
            print(f"  [{rows}, {cols}] k={k}  {name:24} FAIL {type(exc).__name__}: {exc}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with torch.topk and time both peers")
    ap.add_argument("--build", action="store_true", help="compile the library first (nvcc, no GPU needed)")
    ap.add_argument("--extract", default=None, help=f"FlashInfer extract for --build (default {DEFAULT_EXTRACT})")
    ap.add_argument("--so", default=None, help=f"library path (default {DEFAULT_SO})")
    args = ap.parse_args(argv)
    if args.build:
        build(args.extract, args.so)
    if not args.check:
        return 0
    if not torch.cuda.is_available():
        print("no CUDA")
        return 0
    peers = load(args.so)
    if peers is None:
        print(f"cannot load the peers: {last_error}")
        return 1
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, library {args.so or DEFAULT_SO}\n")
    return 0 if check(peers) else 1


if __name__ == "__main__":
    sys.exit(main())
