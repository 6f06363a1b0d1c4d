"""Context parallelism and FSDP2 with the hyscale backend.

    torchrun --nproc-per-node 2 examples/context_parallel.py            # CPU (gloo) or GPUs (NCCL)

Each rank holds the T = L / world tokens at global positions [rank*T, (rank+1)*T).

1. Selection by hand: issue the key all-gather early (``start_key_gather``), do other work, then
   ``cp_indexer_topk`` selects with the rank's global query offset. The rows equal the
   single-process result (checked here on every rank).
2. Training: a model sharded with FSDP2 (``fully_shard``) and compiled with ``backend="hyscale"``.
   Its indexer is plain PyTorch: keys gathered with ``gather_sequence`` inside the graph, a causal
   mask built from global positions. The backend's selection pass reads that mask as causal with
   offset rank*T and rewrites the site, so the [T, L] score table is never written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hyscale_compile import indexer_topk  # noqa: E402
from hyscale_compile.distributed import (  # noqa: E402
    cp_indexer_topk,
    gather_sequence,
    global_positions,
    start_key_gather,
)


class SparseAttentionBlock(nn.Module):
    """Indexer top-k (plain PyTorch, global-position causal mask) + attention over the picked keys."""

    def __init__(self, dim: int, heads: int, head_dim: int, k: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.k = heads, head_dim, k
        self.norm = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, heads * head_dim)
        self.wk = nn.Linear(dim, head_dim)
        self.ww = nn.Linear(dim, heads)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm(x)
        kx = gather_sequence(self.wk(h))  # every rank's indexer keys, in global order
        v = gather_sequence(self.wv(h))
        L = kx.shape[1]
        q = self.wq(h).view(B, T, self.heads, self.head_dim)
        w = self.ww(h)
        score = torch.relu(torch.einsum("bthd,bsd->bths", q, kx) * self.head_dim ** -0.5)
        score = (score * w[..., None]).sum(2)
        # Global positions: query t of this rank sits at rank*T + t.
        visible = torch.arange(L, device=x.device)[None] <= (torch.arange(T, device=x.device) + rank * T)[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        idx = score.topk(self.k, dim=-1).indices
        picked = v.gather(1, idx.reshape(B, -1, 1).expand(B, T * self.k, v.shape[-1])).view(B, T, self.k, -1)
        attn = torch.softmax(score.gather(-1, idx), dim=-1)
        return x + self.wo((attn[..., None] * picked).sum(2))


class TinyModel(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, head_dim: int, k: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SparseAttentionBlock(dim, heads, head_dim, k) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, rank: int) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rank)
        # Logits [B*T, vocab], flattened before the projection: the matmul's own output. A [B, T, vocab]
        # result would be a view of it (compiled graphs return views of intermediates as views), and FSDP2
        # warns about a view output, since an in-place op on it would skip FSDP's pre-backward hook.
        return self.head(x.flatten(0, 1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512, help="global sequence length L")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compiler", default="inductor", help="what compiles after the passes: inductor, aot_eager")
    p.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous",
                   help="selection by hand: contiguous chunks or load-balanced zigzag chunks")
    return p.parse_args()


def setup() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def selection_by_hand(rank: int, world: int, device: torch.device, L: int, k: int, layout: str) -> None:
    """CP selection with the helper, checked against one process doing all rows."""
    H, D = 4, 32
    g = torch.Generator(device=device).manual_seed(0)  # same full tensors on every rank
    q = torch.randn(1, L, H, D, generator=g, device=device)
    kx = torch.randn(1, L, D, generator=g, device=device)
    w = torch.randn(1, L, H, generator=g, device=device)
    T = L // world
    rows = global_positions(T, layout=layout, device=device)  # this rank's tokens (queries and keys)
    kx_local = kx[:, rows].contiguous()
    keys = start_key_gather(kx_local)  # in flight while the rank does other work
    q_local, w_local = q[:, rows].contiguous(), w[:, rows].contiguous()
    values, indices = cp_indexer_topk(q_local, kx_local, k, weights=w_local, scale=D ** -0.5, keys=keys,
                                      layout=layout)
    ref_values, ref_indices = indexer_topk(q, kx, k, weights=w, scale=D ** -0.5, query_offset=0)
    same = torch.equal(indices, ref_indices[:, rows]) and torch.equal(
        values.view(torch.int32), ref_values[:, rows].contiguous().view(torch.int32))
    print(f"[rank {rank}] CP selection ({layout}) of {T} rows equals one process: {same}", flush=True)


def train(rank: int, world: int, device: torch.device, L: int, k: int, steps: int, compiler: str) -> None:
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    vocab, T = 128, L // world
    model = TinyModel(vocab, dim=64, layers=2, heads=4, head_dim=32, k=k).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="hyscale", options={"compiler": compiler})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator(device=device).manual_seed(1)
    # A learnable task: predict the token seen at the previous position.
    tokens = torch.randint(0, vocab, (2, L + 1), generator=g, device=device)
    inputs, targets = tokens[:, 1:][:, rank * T:(rank + 1) * T], tokens[:, :-1][:, rank * T:(rank + 1) * T]
    for step in range(steps):
        logits = compiled(inputs, rank)
        loss = nn.functional.cross_entropy(logits.float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"hyscale counters: {dict(counters['hyscale'])}", flush=True)


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    try:
        if args.seq % world:
            raise SystemExit(f"--seq {args.seq} must be a multiple of the world size {world}")
        selection_by_hand(rank, world, device, args.seq, args.k, args.layout)
        train(rank, world, device, args.seq, args.k, args.steps, args.compiler)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
