"""``hyscale_compile.explain``: which top-k sites of a model the backend rewrites, and why not the others.

    report = hyscale_compile.explain(model, *example_inputs)
    print(report)

From a shell, for a factory returning ``(model, example_inputs)``:

    python -m hyscale_compile.explain my_package.my_module:make_model [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..passes import report as _report


@dataclass
class ExplainReport:
    sites: list[_report.SiteReport]

    @property
    def rewritten(self) -> list[_report.SiteReport]:
        return [s for s in self.sites if s.decision == "rewritten"]

    @property
    def rejected(self) -> list[_report.SiteReport]:
        return [s for s in self.sites if s.decision != "rewritten"]

    def as_dict(self) -> dict[str, Any]:
        return {"sites": [s.as_dict() for s in self.sites], "rewritten": len(self.rewritten),
                "left_alone": len(self.rejected)}

    def __str__(self) -> str:
        return _report.format_table(self.sites)


def explain(model, *example_inputs, **example_kwargs) -> ExplainReport:
    """Trace ``model(*example_inputs, **example_kwargs)`` through the hyscale pass and report every top-k site.

    The model runs once (eagerly after the pass). Models compiled before or after keep their compiled code:
    explain does not reset Dynamo. Its trace starts from a top-level function of its own, with a backend of
    its own (and its own recompile region where torch has ``isolate_recompiles``), and the cache entries it
    makes are dropped afterwards: a code object only explain compiled is reset; on one the user's model
    compiled too (a frame after a graph break), explain's entries are invalidated and never match again.
    The sites do not count in ``counters["hyscale"]``.
    """
    from torch._dynamo.utils import counters

    from ..backend import hyscale

    target = model
    for attr in ("_orig_mod", "_torchdynamo_orig_callable"):  # a torch.compile'd module or function
        if getattr(model, attr, None) is not None:
            target = getattr(model, attr)
            break

    def backend(gm, inputs):  # a new callable per call: no cache entry of another compile can match it
        return hyscale(gm, inputs, options={"compiler": "eager"})

    kept = dict(counters["hyscale"])
    with _report.collect() as sites, _own_cache_entries():
        try:
            _compile(_fresh_caller(), backend)(target, example_inputs, example_kwargs)
        finally:
            counters["hyscale"].clear()
            counters["hyscale"].update(kept)
    for site in sites:
        site.source, site.reason = _report.scrub(site.source), _report.scrub(site.reason)
    return ExplainReport(list(sites))


def _call(target, args, kwargs):
    return target(*args, **kwargs)


def _fresh_caller():
    """``_call`` with a code object of its own, so that Dynamo's cache entries for the trace land on it."""
    code = _call.__code__.replace(co_name="hyscale_explain", co_filename=_report.EXPLAIN_FILE)
    return types.FunctionType(code, _call.__globals__, "hyscale_explain")


def _compile(fn, backend):
    kwargs = {}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        kwargs["isolate_recompiles"] = True
    return torch.compile(fn, backend=backend, **kwargs)


@contextlib.contextmanager
def _own_cache_entries() -> Iterator[None]:
    """Drop the cache entries Dynamo makes inside the block, and only those.

    A code object that had none before (explain's own caller, frames only explain ran) is reset. One that
    had some (the user's compiled forward, after a graph break in it) keeps them; the block's entries on it
    are invalidated: they never match again and hold no compiled code.
    """
    before = {id(code): (code, _entries(code)) for code in _seen_codes()}
    try:
        yield
    finally:
        for code in _seen_codes():
            _, old = before.get(id(code), (code, []))
            new = [e for e in _entries(code) if all(e is not o for o in old)]
            if not new:
                continue
            if not old:
                _reset_code(code)
            else:
                for entry in new:
                    _invalidate(entry)


def _seen_codes() -> list[types.CodeType]:
    from torch._dynamo import convert_frame

    tracker = getattr(convert_frame, "input_codes", None)
    codes = (ref() for ref in list(getattr(tracker, "seen", [])))
    return [c for c in codes if c is not None]


def _entries(code: types.CodeType) -> list[Any]:
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    return list(_debug_get_cache_entry_list(code))


def _reset_code(code: types.CodeType) -> None:
    try:
        from torch._C._dynamo.eval_frame import reset_code
    except ImportError:
        return
    reset_code(code)


def _invalidate(entry: Any) -> None:
    """Make a cache entry never match again, as Dynamo does when an object its guards read is freed."""
    try:
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        extra_state = entry.guard_manager.extra_state
        if extra_state is not None:
            extra_state.invalidate(entry, DeletedGuardManagerWrapper("compiled by hyscale_compile.explain"))
    except Exception as err:  # an older or newer torch without this internal: the entry stays, unmatched
        _report.log.debug("hyscale: explain could not drop a cache entry of its own: %s", err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyscale_compile.explain", description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="module:function returning (model, example_inputs)")
    parser.add_argument("--json", action="store_true", help="print the sites as JSON instead of text")
    args = parser.parse_args(argv)
    module_name, _, func_name = args.factory.partition(":")
    if not func_name:
        parser.error("factory must look like package.module:function")
    sys.path.insert(0, ".")
    model, inputs = getattr(importlib.import_module(module_name), func_name)()
    result = explain(model, *inputs)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result)
    return 0
