"""hyscale_compile: a torch.compile backend that selects the top-k keys of sparse-attention indexers
without writing the score table.

    model = torch.compile(model, backend="hyscale")
"""

from .backend import register_if_missing
from .explain import ExplainReport, explain
from .lowering.api import indexer_topk
from .lowering.attention_api import sparse_attention as sparse_attention
from .lowering.attention_api import sparse_attention_latent as sparse_attention_latent


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyscale_compile")
    except PackageNotFoundError:  # a source checkout on sys.path, not installed
        return "0+unknown"


__version__ = _version()

register_if_missing()

__all__ = ["ExplainReport", "__version__", "explain", "indexer_topk"]
