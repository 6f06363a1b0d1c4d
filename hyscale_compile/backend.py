"""The ``hyscale`` torch.compile backend: rewrite indexer selection sites, then hand the graph to Inductor.

Registered through the ``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="hyscale")``
works without importing this package. A plain function on purpose: a decorated one would be registered
twice (once by the decorator, once by the entry point) and trip Dynamo's duplicate-name assertion.
"""

from __future__ import annotations

import contextlib
import os
import typing
from dataclasses import dataclass, fields
from typing import Any

import torch

from . import lowering  # noqa: F401  (registers torch.ops.hyscale.*)
from .passes import attention, report, selection

COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass
class HyscaleOptions:
    """Our keys of ``torch.compile(..., options=...)``; every other key must be an Inductor config key.

    debug_dir: write the graph before/after each pass there (and compile without Inductor's caches, so
               that every pass runs and is written).
    rewrite:   run the passes (False: compile the model as Inductor would).
    replay:    save selection indices and rescore them under recomputation (training).
    compiler:  what compiles the rewritten graph: "inductor" (default), "aot_eager" or "eager".
    mode:      Inductor's mode ("max-autotune", ...), for when other options are given too (torch.compile
               refuses ``mode=`` together with ``options=``).
    attention: run the attention pass after the selection pass (dense attention under a scattered top-k mask
               becomes hyscale.sparse_attention where that is estimated faster); "always": at every provable
               site, faster or not; False keeps the model's dense attention.
    recompute_latent: absorbed MLA attention recomputes its per-head latent output o' in the backward instead
               of keeping it from the forward: T x H x kv_lora_rank values less at the backward's peak (8.6 GB
               for a DeepSeek-V3.2 layer at T = 65536), for more attention time (benchmarks/NOTES-sparse-attention.md).
    """

    debug_dir: str | None = None
    rewrite: bool = True
    replay: bool = True
    compiler: str = "inductor"
    mode: str | None = None
    attention: bool | str = True
    recompute_latent: bool = False

    @classmethod
    def parse(cls, options: dict[str, Any] | None, mode: str | None = None
              ) -> tuple[HyscaleOptions, dict[str, Any]]:
        """Our options, checked, and the Inductor config patches the other keys are (also checked).

        Raises ValueError for a key that is neither ours nor Inductor's (a misspelling), or for a value
        outside our choices; TypeError for a value of the wrong type.
        """
        options = dict(options or {})
        ours = {f.name: options.pop(f.name) for f in fields(cls) if f.name in options}
        if mode is not None and ours.get("mode") is not None:
            raise ValueError(f"hyscale: mode given twice, as mode={mode!r} and options['mode']={ours['mode']!r}; "
                             "give it once")
        if mode is not None:
            ours["mode"] = mode
        for name, value in ours.items():
            _check_type(name, value)
        if isinstance(ours.get("debug_dir"), os.PathLike):
            ours["debug_dir"] = os.fspath(ours["debug_dir"])
        opts = cls(**ours)
        if isinstance(opts.attention, str) and opts.attention != "always":
            raise ValueError(f"hyscale: options['attention'] must be True, False or 'always', got {opts.attention!r}")
        if opts.compiler not in COMPILERS:
            raise ValueError(f"hyscale: options['compiler'] must be one of {', '.join(map(repr, COMPILERS))}, "
                             f"got {opts.compiler!r}")
        if opts.mode == "default":
            opts.mode = None
        if opts.mode is not None:
            modes = [m for m in torch._inductor.list_mode_options() if m != "default"]
            if opts.mode not in modes:
                raise ValueError(f"hyscale: unknown mode {opts.mode!r}; Inductor's modes are "
                                 f"{', '.join(map(repr, ['default', *modes]))}")
        return opts, _inductor_options(options)


_TYPES = {"debug_dir": (str, os.PathLike, type(None)), "rewrite": bool, "attention": (bool, str), "replay": bool,
          "compiler": str, "mode": (str, type(None)), "recompute_latent": bool}
_EXPECTED = {"debug_dir": "a path (str) or None", "rewrite": "True or False", "attention": "True, False or 'always'",
             "replay": "True or False", "compiler": "a str", "mode": "a str or None",
             "recompute_latent": "True or False"}


def _check_type(name: str, value: Any) -> None:
    if not isinstance(value, _TYPES[name]):
        raise TypeError(f"hyscale: options[{name!r}] must be {_EXPECTED[name]}, got {value!r} "
                        f"({type(value).__name__})")


def _inductor_options(rest: dict[str, Any]) -> dict[str, Any]:
    """The keys that are not ours, as Inductor config patches, checked as torch.compile checks its options."""
    from torch._inductor import config

    current = config.get_config_copy()
    patches = {}
    for key, value in rest.items():
        name = key.replace("-", "_")
        if name not in current:
            ours = ", ".join(f.name for f in fields(HyscaleOptions))
            raise ValueError(f"hyscale: unknown option {key!r}. hyscale's options are: {ours}; any other key must "
                             f"be an Inductor config key (torch._inductor.config), and {key!r} is not one")
        expected = _config_type(config, name)
        if expected is not None and not isinstance(value, expected):
            raise TypeError(f"hyscale: Inductor option {key!r} must be {expected.__name__}, got {value!r} "
                            f"({type(value).__name__})")
        patches[name] = value
    return patches


def _config_type(config, name: str) -> type | None:
    """The declared type of an Inductor config key when it is a plain class (generic types are not checked)."""
    get_type = getattr(config, "get_type", None)
    try:
        t = get_type(name) if get_type is not None else None
    except Exception:
        return None
    return t if isinstance(t, type) and typing.get_origin(t) is None else None


def _inductor_patches(rest: dict[str, Any], opts: HyscaleOptions) -> dict[str, Any]:
    patches: dict[str, Any] = {}
    if opts.mode:
        patches.update(torch._inductor.list_mode_options(opts.mode))
    patches.update(rest)
    if opts.debug_dir:
        patches["force_disable_caches"] = True  # a graph served from a cache runs no pass, so none is dumped
    if opts.replay:
        from .passes import replay

        patches.update(replay.inductor_config_patches(patches, debug_dir=opts.debug_dir))
    if opts.debug_dir:
        from .passes import debug

        patches.update(debug.inductor_config_patches(patches, opts.debug_dir))
    return patches


def _aot_eager(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: HyscaleOptions):
    """AOTAutograd without Inductor (for debugging); replay runs in the partition step, as Inductor's hook would."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_compiler
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from .passes import debug

    def _noop(g, _):
        return g

    def _partition(joint, inputs, **kwargs):
        if opts.replay:
            from .passes import replay

            replay.run(joint.graph, debug_dir=opts.debug_dir)
            joint.recompile()
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        if opts.debug_dir:
            debug.dump_partitioned(fw.graph, opts.debug_dir)
            debug.dump_partitioned(bw.graph, opts.debug_dir)
        return fw, bw

    return aot_autograd(fw_compiler=make_boxed_compiler(_noop), partition_fn=_partition)(gm, example_inputs)


def hyscale(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
            mode: str | None = None):
    """Dynamo backend entry point."""
    opts, rest = HyscaleOptions.parse(options, mode)
    if opts.rewrite:
        reports = selection.run(gm, debug_dir=opts.debug_dir)
        if opts.attention:
            sites = attention.run(gm, debug_dir=opts.debug_dir, always=True if opts.attention == "always" else None,
                                  keep_latent=not opts.recompute_latent)
            attention.amend_selection_reports(reports, sites)
            reports += sites
        else:
            report.log.debug("hyscale: options['attention'] is False: the attention pass does not run")
        selection.forget_reports(gm)
        report.publish(gm, reports)
    else:
        report.log.debug("hyscale: options['rewrite'] is False: the selection and attention passes do not run")
    if opts.compiler == "eager":
        return gm.forward
    if opts.compiler == "aot_eager":
        return _aot_eager(gm, example_inputs, opts)
    from torch._inductor.compile_fx import compile_fx

    with _fresh_joint_pass(gm, opts):
        return compile_fx(gm, example_inputs, config_patches=_inductor_patches(rest, opts))


def _fresh_joint_pass(gm: torch.fx.GraphModule, opts: HyscaleOptions):
    """Skip AOTAutograd's cache for a graph whose replay counters the joint pass must compute.

    A hit in that cache skips the joint graph, so the replay pass would not run and ``replay_applied``
    would read 0 on a warm start. Only checkpointed training graphs with a selection are concerned;
    their fw/bw kernels still come from Inductor's FX graph cache (the costly part of a compile).
    """
    from .passes import replay

    if not (opts.replay and torch.is_grad_enabled() and replay.counts_in_joint_graph(gm)):
        return contextlib.nullcontext()
    functorch_config = torch._functorch.config
    if not hasattr(functorch_config, "enable_autograd_cache"):
        return contextlib.nullcontext()
    report.log.debug("hyscale: not using AOTAutograd's cache for a checkpointed graph with a selection, so "
                     "that the replay pass runs and is counted (compiled kernels still come from Inductor's cache)")
    return functorch_config.patch(enable_autograd_cache=False)


def register_if_missing() -> None:
    """Make ``backend="hyscale"`` resolve from a source checkout too (an install registers the entry point).

    Registering by hand only when the name is unknown keeps Dynamo's duplicate-name check happy.
    """
    if "hyscale" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(hyscale, name="hyscale")
