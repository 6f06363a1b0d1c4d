"""The ``hyscale`` torch.compile backend: rewrite indexer selection sites, then hand the graph to Inductor.

Registered through the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="hyscale")``
works without importing this package. A plain function on purpose: a decorated one would be registered
twice (once by the decorator, once by the entry point) and trip Dynamo's duplicate-name assertion.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from . import lowering  # noqa: F401  (registers torch.ops.hyscale.*)
from .passes import report, selection


@dataclass
class HyscaleOptions:
    """Our keys of ``torch.compile(..., options=...)``; every other key goes to Inductor's config.

    debug_dir: write the graph before/after each pass there.
    rewrite:   run the selection pass (False: compile the model as Inductor would).
    replay:    save selection indices and rescore them under recomputation (training).
    compiler:  what compiles the rewritten graph: "inductor" (default), "aot_eager" or "eager".
    """

    debug_dir: str | None = None
    rewrite: bool = True
    replay: bool = True
    compiler: str = "inductor"

    @classmethod
    def split(cls, options: dict[str, Any] | None) -> tuple[HyscaleOptions, dict[str, Any]]:
        options = dict(options or {})
        ours = {f.name: options.pop(f.name) for f in fields(cls) if f.name in options}
        return cls(**ours), options


def _inductor_patches(mode: str | None, rest: dict[str, Any], opts: HyscaleOptions) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(rest)
    if opts.replay:
        from .passes import replay

        patches.update(replay.inductor_config_patches(patches))
    return patches


def _aot_eager(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: HyscaleOptions):
    """AOTAutograd without Inductor (for debugging); replay runs in the partition step, as Inductor's hook would."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def _noop(g, _):
        return g

    def _partition(joint, inputs, **kwargs):
        if opts.replay:
            from .passes import replay

            replay.apply(joint.graph)
            joint.recompile()
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    return aot_autograd(fw_compiler=make_boxed_compiler(_noop), partition_fn=_partition)(gm, example_inputs)


def hyscale(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
            mode: str | None = None):
    """Dynamo backend entry point."""
    opts, rest = HyscaleOptions.split(options)
    if opts.rewrite:
        report.publish(gm, selection.run(gm, debug_dir=opts.debug_dir))
    else:
        report.log.debug("hyscale: options['rewrite'] is False: the selection pass does not run")
    if opts.compiler == "eager":
        return gm.forward
    if opts.compiler == "aot_eager":
        return _aot_eager(gm, example_inputs, opts)
    if opts.compiler != "inductor":
        raise ValueError(f"hyscale: options['compiler'] must be 'inductor', 'aot_eager' or 'eager', "
                         f"got {opts.compiler!r}")
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=_inductor_patches(mode, rest, opts))


def register_if_missing() -> None:
    """Make ``backend="hyscale"`` resolve from a source checkout too (an install registers the entry point).

    Registering by hand only when the name is unknown keeps Dynamo's duplicate-name check happy.
    """
    if "hyscale" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(hyscale, name="hyscale")
