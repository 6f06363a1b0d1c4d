"""An unmodified DeepSeek-V3.2-style sparse-attention block, compiled with ``backend="hyscale"``.

Nothing here imports hyscale_compile to change the model: the backend finds the indexer's
score -> top-k, rewrites it, and the block runs without ever writing the [T, S] score table.
The script prints the per-site report and checks the compiled block against eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Indexer(nn.Module):
    """The DSA lightning indexer as model code writes it (see HF DeepSeek-V3.2)."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, topk: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)
        self.softmax_scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.scores(x, mask).topk(min(self.topk, x.shape[1]), dim=-1).indices

    def scores(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x)
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        scores = F.relu(scores)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        return index_scores + mask


class SparseAttentionBlock(nn.Module):
    def __init__(self, dim: int = 64, n_heads: int = 4, topk: int = 16) -> None:
        super().__init__()
        self.n_heads, self.hd = n_heads, dim // n_heads
        self.indexer = Indexer(dim, n_heads=4, head_dim=32, topk=topk)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        idx = self.indexer(x, mask)  # [b, t, k] selected key positions
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.hd).unbind(2)
        # sparse attention: a dense mask that lets each query see only its selected keys
        keep = torch.zeros(b, t, t, dtype=torch.bool, device=x.device).scatter(-1, idx, True)
        keep &= mask == 0
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=keep[:, None])
        return self.out(attn.transpose(1, 2).reshape(b, t, d))


def main() -> None:
    import hyscale_compile  # only for the report and the check; the backend itself needs no import
    from hyscale_compile.testing import assert_same_topk

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = SparseAttentionBlock().to(device)
    x = torch.randn(2, 48, 64, device=device)
    print(hyscale_compile.explain(block, x))
    compiled = torch.compile(block, backend="hyscale")
    with torch.no_grad():
        out = compiled(x)
        # The selection equals eager's up to ties (relu zeros tie often; torch.topk breaks ties
        # arbitrarily, hyscale by lowest position), judged on the eager scores themselves.
        mask = torch.full((48, 48), float("-inf"), device=device).triu(1)
        idx = torch.compile(block.indexer, backend="hyscale")(x, mask)
        ref_idx = block.indexer(x, mask)
        scores = block.indexer.scores(x, mask)
        assert_same_topk(scores.gather(-1, idx), idx, scores.gather(-1, ref_idx), ref_idx)
    print(f"compiled block output {tuple(out.shape)}; selected keys equal eager's up to ties: ok")


if __name__ == "__main__":
    main()
