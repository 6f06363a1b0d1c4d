"""Launch a compiled Triton kernel with less host work than ``kernel[grid](...)``: ``launch``.

On every call ``JITFunction.run`` reads its knobs (environment lookups), binds the arguments into a dict,
specializes each one, builds and hashes its cache key (the options' ``str`` included), checks the kernel's
globals and builds the launch metadata for its hooks, and only then calls the compiled kernel's launcher. A
decode step repeats all of it unchanged, and where its call is two or three launches (the table route), that
is most of its host work. ``launch`` keeps each kernel's compiled variants under the specialization Triton
itself computes for the runtime arguments (its native ``specialize_impl``, with the kernel's own flags: the
same variant Triton would pick) and the constexprs and options given, and calls the launcher directly.

The key holds what Triton's own key holds (the debug flag and instrumentation mode it adds to the options
included). Triton's own path is taken for the first call of a variant (it compiles or finds it and hands it
back), under the interpreter, while a hook watches (the kernel's pre-run hooks, a launch hook: a profiler's), and
for a kernel this module cannot lay out (annotated runtime parameters, or a constexpr parameter before a runtime
one: the launcher takes every argument in the signature's order). All the fast path skips is the check that the
kernel's globals did not change since it compiled (where Triton raises; it never recompiles).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

try:  # the parts of Triton the fast path needs: Triton 3.6's (its launcher's arguments are an internal interface)
    import triton
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    FAST = triton.__version__.split(".")[:2] == ["3", "6"]
except ImportError:  # pragma: no cover - another Triton: every launch takes Triton's path
    FAST = False


class _Layout:
    """What the fast path needs of a kernel's signature: its runtime parameters' count and specialization flags
    (as runs of consecutive parameters with the same flags), and its constexprs' names and defaults, in order
    (``ok`` False where the kernel does not fit the fast path); and the kernel's variants seen so far (key ->
    (compiled kernel, its constexpr values in order))."""

    def __init__(self, kernel) -> None:
        params = kernel.params
        n = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        runtime, consts = params[:n], params[n:]
        self.ok = all(not p.annotation_type for p in runtime) and all(p.is_constexpr for p in consts)
        self.n_args = n
        flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in runtime]
        self.runs = _runs(flags)
        self.plain = all(f == _DEFAULT_FLAGS for f in flags)
        self.consts = tuple((p.name, p.default) for p in consts)
        self.variants: dict[tuple, tuple] = {}


def _runs(flags: list[tuple]) -> tuple[tuple[int, int, tuple], ...]:
    """(start, stop, flags) of each run of consecutive parameters with the same flags."""
    runs: list[tuple[int, int, tuple]] = []
    for i, f in enumerate(flags):
        if runs and runs[-1][2] == f:
            runs[-1] = (runs[-1][0], i + 1, f)
        else:
            runs.append((i, i + 1, f))
    return tuple(runs)


def _layout(kernel) -> _Layout:
    """The kernel's layout, kept on the kernel (it and its variants go when the kernel goes)."""
    lay = kernel.__dict__.get("_hyscale_fast_launch")
    if lay is None:
        lay = kernel._hyscale_fast_launch = _Layout(kernel)
    return lay


@functools.cache
def _driver_ready() -> bool:
    """Whether Triton has a device driver to launch with (none on a CPU-only machine, where a launch is the
    interpreter's, or a stub's in a host-time benchmark): asked once, the answer does not change."""
    try:
        driver.active.get_current_device()
    except RuntimeError:
        return False
    return True


def _watched(kernel) -> bool:
    """Whether something watches this kernel's launches: its pre-run hooks, or a launch hook (a chain with hooks in
    it, or a hook set directly; a profiler's)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return bool(kernel.pre_run_hooks) or any(getattr(h, "calls", h) for h in hooks)


def specialization(lay: _Layout, backend, args: tuple) -> tuple:
    """What Triton's binder computes for the runtime arguments ``args`` (its specialization list, less the
    constexprs): each argument's type and attributes (a tensor's alignment, an int's divisibility by 16, the int 1
    as a constant), by the same native function with the same flags. A run of parameters with the default flags
    takes one call over the tuple of its arguments (the function's own recursion into a tuple, which applies the
    default flags to each: the same answers, as (types, attributes), in one call instead of one a parameter); a
    parameter with flags of its own, one call. A kernel whose parameters all take the default flags is one call."""
    if lay.plain:
        return native_specialize_impl(backend, args, False, True, True)
    spec = []
    for a, b, flags in lay.runs:
        if flags == _DEFAULT_FLAGS:
            spec.append(native_specialize_impl(backend, args[a:b], False, True, True))
        else:
            spec.extend([native_specialize_impl(backend, x, *flags) for x in args[a:b]])
    return tuple(spec)


_DEFAULT_FLAGS = (False, True, True)  # (is_const, specialize the value, specialize the alignment)


def launch(kernel, grid: tuple, args: tuple, kw: Mapping) -> None:
    """``kernel[grid](*args, **kw)``: ``args`` the runtime arguments in order, ``kw`` the constexprs (by name) and
    the launch options (num_warps, num_stages, maxnreg, ...). Same result; on the fast path, less host work."""
    found = _fast_key(kernel, grid, args, kw)
    try:
        got = found[0].variants.get(found[1])
    except TypeError:  # no key (None), or an option that is not hashable (Triton keys on its str): Triton's path
        kernel[grid](*args, **kw)
        return
    if got is None:  # Triton's path: compiles or finds the variant, launches it, and hands it back
        _keep(found, kernel[grid](*args, **kw), kw)
        return
    compiled, consts = got
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, driver.active.get_current_stream(found[2]), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *consts)


def compiled(kernel, grid: tuple, args: tuple, kw: Mapping):
    """The compiled kernel that ``launch(kernel, grid, args, kw)`` runs, compiled where it is not yet and nothing
    launched (for a caller that reads its code first). Kept for ``launch`` as a variant it launches: one binder pass
    for both, where Triton's ``warmup`` then launch would be two a call."""
    found = _fast_key(kernel, grid, args, kw)
    got = _TRITONS if found is None else _variant(*found)
    if got is not _TRITONS and got is not None:
        return got[0]
    done = kernel.warmup(*args, grid=grid, **kw)
    done = done.result() if hasattr(done, "result") else done
    if got is None:
        _keep(found, done, kw)
    return done


def _fast_key(kernel, grid, args: tuple, kw: Mapping) -> tuple | None:
    """(layout, key, device) of a launch the fast path may take, or None where it takes Triton's path."""
    # (under the interpreter ``triton.jit`` made an InterpretedFunction, not a JITFunction)
    if not FAST or type(kernel) is not JITFunction or callable(grid) or not _driver_ready() or _watched(kernel):
        return None
    lay = _layout(kernel)
    if not lay.ok or len(args) != lay.n_args:
        return None
    device = driver.active.get_current_device()
    # what Triton's run adds to the options, and its key, besides the arguments: the debug flags
    debug = kw.get("debug", kernel.debug) or knobs.runtime.debug
    key = (device, specialization(lay, kernel.device_caches[device][3], args), tuple(kw.items()), bool(debug),
           knobs.compilation.instrumentation_mode)
    return lay, key, device


_TRITONS = object()  # _variant's answer for a key it cannot look up: Triton's path


def _variant(lay: _Layout, key: tuple, device) -> tuple | None:
    """The kept (compiled kernel, constexprs) of ``key``, None where none is kept yet, or _TRITONS where the key
    cannot be one (an option that is not hashable: Triton keys on its str)."""
    try:
        return lay.variants.get(key)
    except TypeError:
        return _TRITONS


def _keep(found: tuple, compiled, kw: Mapping) -> None:
    """Keep the variant Triton's path handed back under ``found``'s key, with its constexprs' values (not where one
    is missing)."""
    lay, key, _ = found
    consts = _constexprs(lay, kw)
    if compiled is not None and consts is not None:
        lay.variants[key] = (compiled, consts)


def _constexprs(lay: _Layout, kw: Mapping) -> tuple | None:
    """The constexprs' values in the signature's order (given, or their defaults), or None where one is missing."""
    values = []
    for name, default in lay.consts:
        value = kw.get(name, default)
        if value is inspect.Parameter.empty:
            return None
        values.append(value)
    return tuple(values)
