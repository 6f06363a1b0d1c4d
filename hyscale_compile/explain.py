"""``hyscale_compile.explain``: which top-k sites of a model the backend rewrites, and why not the others.

    report = hyscale_compile.explain(model, *example_inputs)
    print(report)

From a shell, for a factory returning ``(model, example_inputs)``:

    python -m hyscale_compile.explain my_package.my_module:make_model
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

import torch

from .passes import report as _report


@dataclass
class ExplainReport:
    sites: list[_report.SiteReport]

    @property
    def rewritten(self) -> list[_report.SiteReport]:
        return [s for s in self.sites if s.decision == "rewritten"]

    @property
    def rejected(self) -> list[_report.SiteReport]:
        return [s for s in self.sites if s.decision != "rewritten"]

    def __str__(self) -> str:
        return _report.format_table(self.sites)


def explain(model, *example_inputs, **example_kwargs) -> ExplainReport:
    """Trace ``model(*example_inputs)`` through the hyscale pass and report every top-k site.

    The model runs once (eagerly after the pass). Like ``torch._dynamo.explain`` this resets Dynamo's
    caches before and after, so later compiles start fresh.
    """
    target = getattr(model, "_orig_mod", model)
    torch._dynamo.reset()
    try:
        with _report.collect() as sites:
            torch.compile(target, backend="hyscale", options={"compiler": "eager"})(*example_inputs, **example_kwargs)
    finally:
        torch._dynamo.reset()
    return ExplainReport(list(sites))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyscale_compile.explain", description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="module:function returning (model, example_inputs)")
    args = parser.parse_args(argv)
    module_name, _, func_name = args.factory.partition(":")
    if not func_name:
        parser.error("factory must look like package.module:function")
    sys.path.insert(0, ".")
    model, inputs = getattr(importlib.import_module(module_name), func_name)()
    print(explain(model, *inputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
