"""Selection on the scores real indexers produce, and on decode steps: HyTopK against table + top-k.

Uniform random q and keys are the easy case. The families below are what indexers produce in practice; each
row of results/families.json is one family at one shape, timed in the same run as its baselines:

    random              q, kx ~ N(0, 1), head weights ~ N(0, 1) / sqrt(H)
    all_equal           every visible key scores the same: the weight projection starts at zero
    relu_zero_majority  ReLU zeroes every head for most keys; fewer than k keys score above 0 (the k-th is 0)
    dup_keys            64 distinct keys repeated: exact ties everywhere
    sink_recency        an attention sink (the first keys) and keys more aligned with q the more recent
    heavy_tail          key norms log-normal: a few keys dominate
    per_head            one head, no weights (H = 1)

Shapes: the prefill shapes (T = 4096, S = 131072, H in {16, 64}) for every family; decode and small T
(T in {1, 4, 16, 64, 256} x S in {32768, 131072, 1048576} x H in {16, 64}) for random; a batch of 8
sequences of different lengths (a per-sequence query offset); the tie-heavy families at two decode shapes
(T = 1 x S = 32768, T = 16 x S = 131072, H = 16). k = 2048, D = 128, bf16, causal.

Columns: hyscale_table_route (whether the plan takes the table route, ``plan.Plan.table``: the call writes its
composite table and runs torch.topk, as small calls do, instead of the pipeline), hyscale_ms
(``hyscale_compile.indexer_topk``: the operator as a compiled model calls it, host work included),
hyscale_graph_ms (the same call replayed from a CUDA graph: what a decode engine runs; a captured call has its
own route rule, hyscale_graph_table_route), hyscale_pipeline_ms / hyscale_pipeline_graph_ms, hyscale_table_ms /
hyscale_table_graph_ms (the table ranked by torch.topk), hyscale_table_row_ms / _graph_ms and hyscale_table_split_ms
/ _graph_ms (by table_rank.py, one program a row or the pass split) (at T <= 256: each route and ranker forced,
eager and replayed, so that the rules are checked where they decide; hyscale_ranker is the plan's ranker on the
table route; routes_equal whether all four gave the same bits),
hyscale_unsorted_ms (sorted=False, what an order-free site runs), table_topk_ms (our fused score kernel
writing the fp32 table, then torch.topk; at T <= 256, where the calls are host-bound, timed interleaved with
hyscale_ms, and table_topk_graph_ms the same replayed from a CUDA graph, hyscale_graph_ms's baseline),
peer_topk_ms / peer (the table, then the fastest of FlashInfer's radix top-k and CUB's DeviceBatchedTopK,
benchmarks/peers), rows_recovered / fallbacks (the kernels' statistics for one call; none on the table route, which
runs no check).

    python benchmarks/families.py                 # CUDA -> results/families.json
    python benchmarks/families.py --rows decode   # only the decode / small-T rows -> results/families_decode.json
    python benchmarks/families.py --smoke         # tiny shapes, any device, prints only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import hyscale_compile  # noqa: E402
from hyscale_compile.runtime import hytopk, plan, stats  # noqa: E402
from hyscale_compile.runtime.reference import Visibility  # noqa: E402

FAMILIES = ("random", "all_equal", "relu_zero_majority", "dup_keys", "sink_recency", "heavy_tail", "per_head")
PREFILL = [(4096, 131072, 16), (4096, 131072, 64)]
DECODE_T, DECODE_S, DECODE_H = (1, 4, 16, 64, 256), (32768, 131072, 1048576), (16, 64)
DECODE_FAMILIES = ("all_equal", "relu_zero_majority", "dup_keys")
K, D = 2048, 128


def family_inputs(family: str, B: int, T: int, S: int, H: int, device: str, seed: int = 0):
    """(q [B, T, H, D] bf16, kx [B, S, D] bf16, weights [B, T, H] fp32 or None) of one family."""
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    if family == "per_head":
        H = 1
    q, kx, w = randn(B, T, H, D), randn(B, S, D), randn(B, T, H) / math.sqrt(H)
    if family == "all_equal":
        w = torch.zeros_like(w)
    elif family == "relu_zero_majority":
        q, kx = q.abs(), -kx.abs()  # every dot negative: ReLU zeroes every head ...
        pos = torch.randperm(S, device=device, generator=g)[: K // 2]
        kx[:, pos] = kx[:, pos].abs()  # ... but for k / 2 keys, which score above 0 in every row
        w = w.abs()
    elif family == "dup_keys":
        kx = kx[:, torch.randint(0, 64, (S,), device=device, generator=g)]
    elif family == "sink_recency":
        u = torch.nn.functional.normalize(randn(D), dim=0)
        q = q + 2.0 * u
        pos = torch.arange(S, device=device, dtype=torch.float32) / S
        kx = kx + (2.0 * pos**4)[None, :, None] * u
        kx[:, :4] += 3.0 * u  # the sink
    elif family == "heavy_tail":
        kx = kx * torch.exp(randn(B, S, 1))
    return q.bfloat16(), kx.bfloat16(), (None if family == "per_head" else w)


def median_ms(fn, reps: int = 21, warmup: int = 3) -> float:
    if not torch.cuda.is_available():
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return paired_ms((fn,), reps, warmup)[0]


def event_ms(fn) -> float:
    """One call, ms between events recorded around it (its host work included where it bounds the call)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def paired_ms(fns, reps: int = 60, warmup: int = 3) -> list[float]:
    """Median ms (event_ms) of each of ``fns`` on CUDA, timed in turn within each repetition: where the host's
    speed drifts during a run (this device's host moves 30-50% between runs), each call sees the same."""
    if not torch.cuda.is_available():
        return [median_ms(fn) for fn in fns]
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, got in zip(fns, times):
            got.append(event_ms(fn))
    return [sorted(got)[len(got) // 2] for got in times]


def graph_ms(fn) -> float | None:
    """The call replayed from a CUDA graph (None without CUDA, or when capture fails: recorded as such)."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def table_topk(q, kx, w, scale, vis, k: int):
    """Our fused score kernel writing the fp32 table, then torch.topk: the plain path hyscale replaces; and
    whether hyscale's plan takes its table route here."""
    import floor

    pb = hytopk.Problem(q, kx, w, scale, True, vis, float("-inf"))
    split = plan.filter_split(pb, plan.device_programs(pb.device))  # the filter's grid (on either route)
    table = torch.empty(pb.rows, pb.S, device=q.device, dtype=torch.float32)

    def run():
        floor.table(pb, table, split)
        return table

    return run, hytopk.make_plan(pb, k).table


def run_row(family: str, B: int, T: int, S: int, H: int, device: str, peers, offsets=None) -> dict:
    q, kx, w = family_inputs(family, B, T, S, H, device)
    H = q.shape[2]
    scale = D**-0.5
    offset = S - T if offsets is None else offsets
    vis = Visibility(causal=True, offset=S - T) if offsets is None else Visibility(causal=True, offsets=offsets)
    k = min(K, S)
    row = dict(family=family, B=B, T=T, S=S, H=H, k=k)
    tab, row["hyscale_table_route"] = table_topk(q, kx, w, scale, vis, k)

    def hy(sorted_=True):
        return hyscale_compile.indexer_topk(q, kx, k, weights=w, scale=scale, query_offset=offset, sorted=sorted_)

    stats.reset()
    hy()
    st = stats.read()
    if not row["hyscale_table_route"]:  # the table route runs no check, so it adds no statistics
        row["rows_recovered"], row["fallbacks"] = st.rows_recovered, st.fallbacks
    plain = lambda: torch.topk(tab().view(B, T, S), k, dim=-1)  # noqa: E731
    if T <= 256:  # host-bound sizes: the two calls interleaved, so that the host's drift falls on both alike
        row["hyscale_ms"], row["table_topk_ms"] = (round(ms, 4) for ms in paired_ms((hy, plain)))
        row["hyscale_graph_ms"] = _rounded(_guard(lambda: graph_ms(hy), row, "graph"))
        row["table_topk_graph_ms"] = _rounded(_guard(lambda: graph_ms(plain), row, "plain graph"))
    else:
        row["hyscale_ms"] = round(median_ms(hy), 4)
        row["table_topk_ms"] = round(median_ms(plain), 4)
    if T >= 4096:
        row["hyscale_unsorted_ms"] = round(median_ms(lambda: hy(False)), 4)
    if T <= 256:  # each route forced, eager and replayed: the measurements behind the route rules
        row["hyscale_graph_table_route"] = plan.table_route(B * T, S, captured=True)
        row["hyscale_ranker"] = plan.table_ranker(k, B * T, S)
        rules = plan.TABLE_MAX_BYTES, plan.RANK_MAX_KEYS, plan.RANK_SPLIT_MAX_ROWS, plan.RANK_SPLIT
        got = {}
        big = 1 << 62
        for route, forced in (("pipeline", (0, 0, 0, False)), ("table", (big, 0, big, False)),
                              ("table_row", (big, big, 0, False)), ("table_split", (big, 0, big, True))):
            plan.TABLE_MAX_BYTES, plan.RANK_MAX_KEYS, plan.RANK_SPLIT_MAX_ROWS, plan.RANK_SPLIT = forced
            try:
                got[route] = hy()
                row[f"hyscale_{route}_ms"] = round(median_ms(hy), 4)
                row[f"hyscale_{route}_graph_ms"] = _rounded(_guard(lambda: graph_ms(hy), row, f"{route} graph"))
            finally:
                plan.TABLE_MAX_BYTES, plan.RANK_MAX_KEYS, plan.RANK_SPLIT_MAX_ROWS, plan.RANK_SPLIT = rules
        row["routes_equal"] = all(_same(got["pipeline"], got[r]) for r in ("table", "table_row", "table_split"))
    if peers is not None and T >= 4096:
        best = None
        for name, fn in (("flashinfer", peers.flashinfer_topk), ("cub", peers.cub_topk)):
            ms = _guard(lambda fn=fn: median_ms(lambda: fn(tab(), k)), row, name)
            if ms is not None and (best is None or ms < best[1]):
                best = (name, ms)
        if best is not None:
            row["peer"], row["peer_topk_ms"] = best[0], round(best[1], 4)
    row["hyscale_over_table"] = round(row["hyscale_ms"] / row["table_topk_ms"], 3)
    return row


def _same(a, b) -> bool:
    """Whether two selections are the same bits (values and positions)."""
    return torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)) and torch.equal(a[1], b[1])


def _guard(fn, row: dict, what: str):
    try:
        return fn()
    except Exception as e:  # a baseline that fails is a result, not a crash of the run
        row.setdefault("notes", []).append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
        return None


def _rounded(x):
    return None if x is None else round(x, 4)


def shapes(smoke: bool, rows: str = "all"):
    if smoke:
        yield from (("random", 1, 8, 512, 2), ("all_equal", 1, 8, 512, 2), ("relu_zero_majority", 1, 8, 512, 2),
                    ("per_head", 1, 1, 512, 2))
        return
    if rows in ("all", "prefill"):
        for T, S, H in PREFILL:
            for family in FAMILIES:
                yield family, 1, T, S, H
    if rows in ("all", "decode"):
        for S in DECODE_S:
            for T in DECODE_T:
                for H in DECODE_H:
                    yield "random", 1, T, S, H
        for family in DECODE_FAMILIES:  # tie-heavy rows where the table route ranks them
            for T, S in ((1, 32768), (16, 131072)):
                yield family, 1, T, S, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, prints only")
    parser.add_argument("--rows", choices=("all", "prefill", "decode"), default="all",
                        help="which rows: the prefill families, the decode / small-T ones (with the batch of "
                             "sequences), or all")
    parser.add_argument("--out", default=None, help="default results/families.json, or with --rows prefill / "
                                                    "decode results/families_prefill.json / families_decode.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        from training import interpreter_shim

        interpreter_shim()
    global K
    if args.smoke:
        K = 16
    peers = None
    if device == "cuda":
        import peers as peer_lib

        peers = peer_lib.load()
    rows = []
    for family, B, T, S, H in shapes(args.smoke, args.rows):
        rows.append(run_row(family, B, T, S, H, device, peers))
        print(json.dumps(rows[-1]), flush=True)
    if not args.smoke and args.rows in ("all", "decode"):  # a batch of 8 sequences of different lengths, one
        # query each (a decode step)
        lens = torch.tensor([131072, 4096, 65536, 1024, 100000, 32768, 131071, 2048], device=device)
        rows.append(run_row("random", 8, 1, 131072, 64, device, peers, offsets=lens - 1))
        rows[-1]["lengths"] = lens.tolist()
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'family':>20} {'T':>5} {'S':>8} {'H':>3} {'route':>8}  {'hyscale':>9} {'graph':>8} {'table+topk':>10} "
          f"{'peer':>8}  recovered")
    for r in rows:
        graph, peer = str(r.get("hyscale_graph_ms", "-")), str(r.get("peer_topk_ms", "-"))
        route = "table" if r["hyscale_table_route"] else "pipeline"
        print(f"{r['family']:>20} {r['T']:>5} {r['S']:>8} {r['H']:>3} {route:>8}  {r['hyscale_ms']:>9} {graph:>8} "
              f"{r['table_topk_ms']:>10} {peer:>8}  {r.get('rows_recovered', '-')}")
    if not args.smoke:
        from training import write_results

        name = "families.json" if args.rows == "all" else f"families_{args.rows}.json"
        write_results(args.out or str(HERE / "results" / name), device, rows)


if __name__ == "__main__":
    main()
