"""Train a small DeepSeek-V3.2-style sparse-attention (DSA) model with ``torch.compile(backend="hyscale")``.

The model is plain PyTorch, written as users write it: the indexer scores every visible key
(``sum_h w * relu(q_h . k)``) from detached inputs and keeps the top k; attention reads only the
selected keys; the indexer is trained with the DSA KL loss, read at the selected positions through
``gather``; each layer runs under ``torch.utils.checkpoint``. The backend rewrites the indexer into
``hyscale.select`` (when the selection pass proves it legal) and, under checkpointing, the backward
rescores the saved selection instead of selecting again.

    python examples/train_dsa.py [--steps 8] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a source checkout too
import hyscale_compile  # noqa: E402, F401  (registers backend="hyscale" where no entry point did)


class Indexer(nn.Module):
    """Lightning indexer: top-k key positions per query, and their scores (for the KL loss)."""

    def __init__(self, dim: int, heads: int, head_dim: int, topk: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, heads, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        x = x.detach()  # DSA trains the indexer only through its own loss
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k = self.wk(x)
        w = self.weights_proj(x) * self.heads**-0.5
        score = torch.einsum("bthd,bsd->bths", q, k) * self.head_dim**-0.5
        score = (torch.relu(score) * w[..., None]).sum(2)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        score = score.masked_fill(future, float("-inf"))
        idx = score.topk(self.topk, dim=-1).indices
        return idx, score.gather(-1, idx)


class DSALayer(nn.Module):
    def __init__(self, dim: int, heads: int, topk: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.indexer = Indexer(dim, heads=4, head_dim=32, topk=topk)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        h = self.norm1(x)
        idx, index_score = self.indexer(h)  # [b, t, k] positions and their indexer scores
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, self.hd).unbind(2)
        # Sparse attention: gather the selected keys and values only.
        flat = (idx + torch.arange(b, device=x.device).view(b, 1, 1) * t).reshape(-1)
        sel_k = k.reshape(b * t, self.heads, self.hd)[flat].view(b, t, -1, self.heads, self.hd)
        sel_v = v.reshape(b * t, self.heads, self.hd)[flat].view(b, t, -1, self.heads, self.hd)
        valid = torch.isfinite(index_score)  # picks past the causal edge (short rows) are masked
        logits = torch.einsum("bthd,btkhd->bthk", q, sel_k) / math.sqrt(self.hd)
        logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        attn = torch.softmax(logits, -1)
        x = x + self.out(torch.einsum("bthk,btkhd->bthd", attn, sel_v).reshape(b, t, d))
        x = x + self.mlp(self.norm2(x))
        # DSA indexer loss: KL(attention, summed over heads || indexer distribution) at the selected keys.
        target = attn.detach().sum(2)
        target = target / target.sum(-1, keepdim=True)
        log_p = torch.log_softmax(index_score, -1).masked_fill(~valid, 0.0)
        kl = (target * (target.clamp_min(1e-9).log() - log_p)).sum(-1).mean()
        return x, kl


class DSAModel(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, topk: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DSALayer(dim, heads, topk) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        index_loss = x.new_zeros(())
        for layer in self.layers:
            x, kl = checkpoint(layer, x, use_reentrant=False)
            index_loss = index_loss + kl
        lm = F.cross_entropy(self.head(x).flatten(0, 1), tokens[:, 1:].flatten())
        return lm + 0.1 * index_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--backend", default="hyscale")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = DSAModel().to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, args.seq + 1), device=args.device)  # one batch, learned by heart
    step_fn = torch.compile(model, backend=args.backend)
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = step_fn(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.2f} s)")
    from torch._dynamo.utils import counters

    print("hyscale counters:", dict(counters["hyscale"]))
    print(f"loss went {'down' if losses[-1] < losses[0] else 'UP'}: {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
