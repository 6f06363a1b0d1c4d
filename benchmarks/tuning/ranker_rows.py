"""Which table ranker for a few dozen rows of long contexts: one program a row or the split pass (CUDA).

``plan.table_ranker`` gives rows of more than ``RANK_MAX_KEYS`` keys the split pass below ``RANK_SPLIT_MAX_ROWS``
rows (one program a row from there: the rows alone fill the SMs). This times both rankers forced at 16 to 96 rows
of 131072 and 262144 keys, eager (``families.paired_ms``: the two rankers and the plain path, the fused score
table + ``torch.topk``, timed in turn within each repetition) and replayed from a CUDA graph, and checks that both
give the same bits.

    python benchmarks/tuning/ranker_rows.py          # -> tuning/results/ranker_rows.json
    python benchmarks/tuning/ranker_rows.py --smoke  # a tiny shape, any device (the interpreter on CPU), prints only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))
import families  # noqa: E402
from training import write_results  # noqa: E402

import hyscale_compile  # noqa: E402
from hyscale_compile.runtime import plan  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

SHAPES = [(64, 131072, 64), (64, 131072, 16), (32, 131072, 16), (32, 131072, 64), (96, 131072, 16),
          (64, 262144, 16), (48, 262144, 64), (16, 131072, 16)]
K, D = 2048, 128


def forced(call, split: bool):
    """``call`` with the ranker rule forced to the split pass (``split``) or to one program a row."""
    def run():
        old = plan.RANK_SPLIT_MAX_ROWS
        plan.RANK_SPLIT_MAX_ROWS = 1 << 30 if split else 1
        try:
            return call()
        finally:
            plan.RANK_SPLIT_MAX_ROWS = old
    return run


def measure(T: int, S: int, H: int, k: int, device: str) -> dict:
    q, kx, w = families.family_inputs("random", 1, T, S, H, device)
    scale = D**-0.5
    vis = Visibility(causal=True, offset=S - T)
    table, _ = families.table_topk(q, kx, w, scale, vis, k)

    def call():
        return hyscale_compile.indexer_topk(q, kx, k, weights=w, scale=scale, query_offset=S - T)

    def plain():
        return torch.topk(table().view(1, T, S), k, dim=-1)

    row, split = forced(call, False), forced(call, True)
    a, b = row(), split()
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    eager = families.paired_ms((row, split, plain), reps=60)
    graphs = [families.graph_ms(fn) for fn in (row, split, plain)]
    out = dict(T=T, S=S, H=H, k=k, same_bits=same, ranker=plan.table_ranker(k, T, S))
    for name, ms, graph in zip(("row", "split", "plain"), eager, graphs):
        out[f"{name}_ms"] = round(ms, 4)
        out[f"{name}_graph_ms"] = None if graph is None else round(graph, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, any device, prints only")
    ap.add_argument("--out", default=str(HERE / "results" / "ranker_rows.json"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert device == "cuda" or args.smoke, "ranker_rows.py measures CUDA calls (--smoke runs anywhere)"
    if args.smoke:
        from training import interpreter_shim

        interpreter_shim()
    shapes, k = ([(4, 512, 2)], 16) if args.smoke else (SHAPES, K)
    rows = []
    for T, S, H in shapes:
        rows.append(measure(T, S, H, k, device))
        print(json.dumps(rows[-1]), flush=True)
    if not args.smoke:
        write_results(args.out, device, rows)


if __name__ == "__main__":
    main()
