"""hyscale_compile: a torch.compile backend that selects the top-k keys of sparse-attention indexers
without writing the score table.

    model = torch.compile(model, backend="hyscale")
"""

from .explain import ExplainReport, explain
from .lowering.api import indexer_topk

__all__ = ["ExplainReport", "explain", "indexer_topk"]
