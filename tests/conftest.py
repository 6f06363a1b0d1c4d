import os
import sys

# An internal error in a pass must fail the test instead of silently leaving a site alone.
os.environ.setdefault("HYSCALE_STRICT", "1")
# The attention pass's models here are tiny, where the sparse op never pays: check the rewrite at every provable
# site (tests/test_attention_cost.py checks the default, estimated decision).
os.environ.setdefault("HYSCALE_ATTENTION", "always")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU every Triton kernel runs in the interpreter; this must happen before any test module
    # imports a kernel (the mode is fixed when a kernel is decorated).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "kernels"))
    import triton_interpret  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
