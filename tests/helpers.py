"""Capture what the selection pass did to a model's Dynamo graph."""

from __future__ import annotations

import torch
from torch import fx

from hyscale_compile.passes import selection


def captured(model, *args) -> tuple[list[str], list[str], list]:
    """(graph code before, after, reports) for each Dynamo graph of ``model(*args)``, run eagerly."""
    before, after, reports = [], [], []

    def backend(gm: fx.GraphModule, example_inputs):
        before.append(gm.code)
        reports.extend(selection.run(gm))
        after.append(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*args)
    return before, after, reports
