"""fast_launch: the variant it launches is the one Triton's own path would pick, and every case it cannot vouch for
takes Triton's path.

No device here: the specialization is compared with Triton's own binder (it runs on CPU tensors), and the launch
mechanics with a recording stand-in for the compiled kernel and the driver.
"""

import inspect

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from hyscale_compile.runtime import fast_launch
from hyscale_compile.runtime.rescore import rescore_kernel
from hyscale_compile.runtime.table_path import table_kernel
from hyscale_compile.runtime.table_rank import rank_kernel, split_finish_kernel, split_pass_kernel

pytestmark = pytest.mark.skipif(not fast_launch.FAST, reason="the fast path is for Triton 3.6")


def _toy(x_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):
    pass


def _kernel(fn=_toy) -> JITFunction:
    return JITFunction(fn)


def _binder_spec(kernel, args, consts):
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    _, spec, _ = binder(*args, **consts)
    return tuple(spec[:len(args)])


def _values(rng):
    """Runtime arguments of every class Triton specializes apart: ints (1, multiples of 16, others, past int32,
    negative), floats, bools, None, tensors aligned or not, of several dtypes."""
    ints = [0, 1, 2, 15, 16, 17, 48, -16, -1, 2**31 - 16, 2**31, 2**40 + 3]
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.bfloat16)[1:],
               torch.zeros(3, dtype=torch.uint8)]
    others = [0.5, -0.0, float("inf"), True, False, None]
    pool = ints + tensors + others
    return [pool[i] for i in rng.integers(0, len(pool), size=4)]


@pytest.mark.parametrize("kernel", [table_kernel, rank_kernel, split_pass_kernel, rescore_kernel],
                         ids=lambda k: k.__name__)
def test_layouts_of_our_kernels_fit_the_fast_path(kernel):
    kernel = _jit(kernel)
    lay = fast_launch._Layout(kernel)
    assert lay.ok and lay.plain == (not kernel.do_not_specialize)
    assert lay.n_args == sum(not p.is_constexpr for p in kernel.params)


def _jit(kernel) -> JITFunction:
    """The kernel as a JITFunction (the interpreter's InterpretedFunction keeps its function and arguments)."""
    return kernel if type(kernel) is JITFunction else JITFunction(kernel.fn, **kernel.kwargs)


def test_table_rankers_row_sizes_are_not_specialized():
    """A decode step's row grows by a key a step: the rankers' row length and the sizes that follow from it must
    not be specialized (divisibility by 16, the value 1), or a decode compiles a variant at unforeseeable steps.
    The specialization of every size a row of 2049 to 140000 keys gives is one and the same."""
    from hyscale_compile.runtime.final_pivots import pivot_ranks

    for kernel in (rank_kernel, split_pass_kernel, split_finish_kernel):
        k = _jit(kernel)
        lay = fast_launch._Layout(k)
        names = [p.name for p in k.params[:lay.n_args]]
        seen = set()
        for W in (2049, 2050, 4096, 32768, 32769, 65536, 131071, 140000):
            i_hi, i_lo, cap = pivot_ranks(2048, W, 512)
            sizes = dict(W=W, cap=cap, i_hi=i_hi, i_lo=i_lo, seg=4096 * (W % 3 + 1), k=2048)
            args = tuple(sizes.get(n, torch.zeros(4, dtype=torch.int64)) for n in names)
            seen.add(fast_launch.specialization(lay, BaseBackend, args))
        assert len(seen) == 1, kernel


def test_table_kernels_first_is_not_specialized():
    """The table kernel's ``first`` (the causal offset + 1) moves every decode step: one specialization for every
    value, 1 and multiples of 16 included, and a different one where it is specialized (the test can fail)."""
    k = _jit(table_kernel)
    lay = fast_launch._Layout(k)
    names = [p.name for p in k.params[:lay.n_args]]
    t = torch.zeros(4, dtype=torch.int64)
    args = lambda first: tuple(first if n == "first" else 3 if n in ("T", "H") else t for n in names)  # noqa: E731
    assert len({fast_launch.specialization(lay, BaseBackend, args(f)) for f in (1, 2, 16, 17, 32, 4097)}) == 1
    plain = fast_launch._Layout(JITFunction(k.fn))
    assert len({fast_launch.specialization(plain, BaseBackend, args(f)) for f in (1, 2, 16)}) == 3


def test_specialization_is_the_binders(seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    k = _kernel()
    lay = fast_launch._Layout(k)
    assert (lay.n_args, [n for n, _ in lay.consts]) == (4, ["BLOCK", "MODE"])
    for _ in range(300):
        args = tuple(_values(rng))
        types, attrs = fast_launch.specialization(lay, BaseBackend, args)  # one call over the tuple
        assert list(zip(types, attrs)) == list(_binder_spec(k, args, dict(BLOCK=4)))


def _flat(spec: tuple) -> list:
    """specialization's answer as one (type, attribute) pair per argument: a run of default-flag parameters
    answers (types, attributes), a parameter with flags of its own (type, attribute)."""
    out = []
    for got in spec:
        out.extend(zip(*got) if isinstance(got[0], tuple) else [got])
    return out


@pytest.mark.parametrize("flags", [dict(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr"]),
                                   dict(do_not_specialize=["n", "flag"]), dict(do_not_specialize=["x_ptr", "scale"]),
                                   dict(do_not_specialize_on_alignment=["x_ptr"])])
def test_specialization_follows_the_kernels_flags(flags, seed=1):
    """Runs of parameters with the same flags, each specialized in one call: Triton's binder's answers, for the
    flags at the start, in the middle and at the end of the signature."""
    import numpy as np

    rng = np.random.default_rng(seed)
    k = JITFunction(_toy, **flags)
    lay = fast_launch._Layout(k)
    assert not lay.plain
    fixed = [(torch.zeros(8)[1:], 16, 0.5, True), (torch.zeros(8), 1, 0.5, False), (torch.zeros(8), 17, 1.0, 1)]
    for args in fixed + [tuple(_values(rng)) for _ in range(100)]:
        assert _flat(fast_launch.specialization(lay, BaseBackend, args)) == list(_binder_spec(k, args, dict(BLOCK=4)))


def test_layouts_that_do_not_fit():
    def interleaved(x_ptr, BLOCK: tl.constexpr, n):
        pass

    def annotated(x_ptr, n: tl.int64, BLOCK: tl.constexpr):
        pass

    assert not fast_launch._Layout(JITFunction(interleaved)).ok
    assert not fast_launch._Layout(JITFunction(annotated)).ok


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _Driver:
    class active:  # noqa: N801 - triton.runtime.driver's shape
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 77


@pytest.fixture
def stand_in(monkeypatch):
    """A kernel whose Triton path is recorded and returns a recording compiled kernel; the driver a stand-in."""
    monkeypatch.setattr(fast_launch, "driver", _Driver)
    monkeypatch.setattr(fast_launch, "_driver_ready", lambda: True)
    k = _kernel()
    k.device_caches[0] = ({}, {}, None, BaseBackend, None)
    slow = []

    def run(*args, grid, warmup, **kw):
        slow.append((grid, args, dict(kw, warmup=warmup)))
        return compiled

    compiled = _Compiled()
    monkeypatch.setattr(k, "run", run)
    return k, slow, compiled


def test_first_call_takes_tritons_path_then_the_launcher(stand_in):
    k, slow, compiled = stand_in
    x = torch.zeros(64)
    fast_launch.launch(k, (3, 2), (x, 32, 0.5, True), dict(BLOCK=16, num_warps=4))
    assert len(slow) == 1 and not compiled.calls
    fast_launch.launch(k, (5,), (x, 48, 0.25, False), dict(BLOCK=16, num_warps=4))  # same variant: 48 % 16 == 0
    assert len(slow) == 1
    assert compiled.calls == [(5, 1, 1, 77, "fn", "meta", None, None, None, x, 48, 0.25, False, 16, 3)]


@pytest.mark.parametrize("change", ["int_divisibility", "int_one", "unaligned", "dtype", "constexpr", "option"])
def test_another_variant_takes_tritons_path(stand_in, change):
    k, slow, compiled = stand_in
    x = torch.zeros(64)
    args, kw = [x, 32, 0.5, True], dict(BLOCK=16, num_warps=4)
    fast_launch.launch(k, (1,), tuple(args), kw)
    if change == "int_divisibility":
        args[1] = 33
    elif change == "int_one":
        args[1] = 1
    elif change == "unaligned":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.to(torch.int32)
    elif change == "constexpr":
        kw = dict(kw, BLOCK=32)
    else:
        kw = dict(kw, num_warps=8)
    fast_launch.launch(k, (1,), tuple(args), kw)
    assert len(slow) == 2 and not compiled.calls


def test_hooks_the_interpreter_and_odd_calls_take_tritons_path(stand_in, monkeypatch):
    from triton import knobs

    k, slow, compiled = stand_in
    x = torch.zeros(64)
    call = ((1,), (x, 32, 0.5, True), dict(BLOCK=16))
    fast_launch.launch(k, *call)
    hook = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hook, "calls", [lambda meta: None])
    fast_launch.launch(k, *call)  # a profiler's hook must see the launch
    monkeypatch.setattr(hook, "calls", [])
    fast_launch.launch(k, lambda meta: (1,), *call[1:])  # a grid function
    fast_launch.launch(k, (1,), (x, 32, 0.5), dict(BLOCK=16, flag=True))  # a runtime argument by name
    interpreted = InterpretedFunction(_toy)  # what triton.jit makes under the interpreter
    monkeypatch.setattr(interpreted, "run", lambda *a, grid, warmup, **kw: slow.append(grid))
    fast_launch.launch(interpreted, *call)
    assert len(slow) == 5 and not compiled.calls
    fast_launch.launch(k, *call)
    assert len(compiled.calls) == 1


@pytest.mark.parametrize("change", ["knob_debug", "kernel_debug", "instrumentation", "pre_run_hook"])
def test_debug_flags_and_pre_run_hooks(stand_in, monkeypatch, change):
    """What Triton's run adds to its key (the debug flag, from the call, the kernel or the knob; the
    instrumentation mode) is in ours: a stored variant is not launched once they change. A kernel with a pre-run
    hook always takes Triton's path (it calls the hook)."""
    from triton import knobs

    k, slow, compiled = stand_in
    call = ((1,), (torch.zeros(64), 32, 0.5, True), dict(BLOCK=16))
    fast_launch.launch(k, *call)
    if change == "knob_debug":
        monkeypatch.setattr(knobs.runtime, "debug", True)
    elif change == "kernel_debug":
        monkeypatch.setattr(k, "debug", True)
    elif change == "instrumentation":
        monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    else:
        k.add_pre_run_hook(lambda *a, **kw: None)
    fast_launch.launch(k, *call)
    fast_launch.launch(k, *call)
    assert len(slow) == (3 if change == "pre_run_hook" else 2) and len(compiled.calls) == (change != "pre_run_hook")


def test_an_unhashable_option_takes_tritons_path(stand_in):
    k, slow, compiled = stand_in
    for _ in range(2):
        fast_launch.launch(k, (1,), (torch.zeros(64), 32, 0.5, True), dict(BLOCK=16, extern_libs={"lib": "path"}))
    assert len(slow) == 2 and not compiled.calls


def test_a_missing_constexpr_is_tritons_error(stand_in):
    k, slow, compiled = stand_in
    x = torch.zeros(64)
    for _ in range(2):  # no variant is kept without its constexprs: Triton's path names the missing one each time
        fast_launch.launch(k, (1,), (x, 32, 0.5, True), {})
    assert len(slow) == 2 and not compiled.calls


def test_defaults_fill_constexprs_not_given(stand_in):
    k, _, compiled = stand_in
    assert inspect.signature(_toy).parameters["MODE"].default == 3
    x = torch.zeros(64)
    for _ in range(2):
        fast_launch.launch(k, (1,), (x, 32, 0.5, True), dict(BLOCK=16, MODE=5))
    assert compiled.calls[-1][-2:] == (16, 5)


def test_compiled_keeps_the_variant_that_launch_then_runs(stand_in):
    """``compiled`` hands back the variant without launching it (Triton's warmup, once), and ``launch`` then runs it
    by the launcher: one binder pass for a caller that reads the kernel's code before launching it."""
    k, slow, compiled = stand_in
    call = ((1,), (torch.zeros(64), 32, 0.5, True), dict(BLOCK=16, num_warps=4))
    assert fast_launch.compiled(k, *call) is compiled
    assert [s[2]["warmup"] for s in slow] == [True] and not compiled.calls
    assert fast_launch.compiled(k, *call) is compiled
    fast_launch.launch(k, *call)
    assert len(slow) == 1 and len(compiled.calls) == 1


def test_compiled_where_launch_takes_tritons_path(stand_in):
    """Where ``launch`` would take Triton's path (here a pre-run hook watches the kernel), ``compiled`` asks
    Triton's warmup every time and keeps nothing."""
    k, slow, compiled = stand_in
    k.add_pre_run_hook(lambda *a, **kw: None)
    call = ((1,), (torch.zeros(64), 32, 0.5, True), dict(BLOCK=16))
    for _ in range(2):
        assert fast_launch.compiled(k, *call) is compiled
    fast_launch.launch(k, *call)
    assert [s[2]["warmup"] for s in slow] == [True, True, False] and not compiled.calls
    assert not fast_launch._layout(k).variants
