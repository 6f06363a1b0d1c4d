"""Compile every Triton kernel our entry points launch for a Hopper GPU, on a machine without one.

Run as a script (``python tests/kernels/compile_for_gpu.py``), never under TRITON_INTERPRET. A stand-in
driver reports an sm_90 target, so each ``kernel[grid](...)`` compiles for real (Triton's NVIDIA backend,
ptxas included) with the constexprs and launch options the host code picks, is checked against the H200's
shared-memory limit as a real load would be, and is then not launched. The tensors are CPU tensors and the
outputs garbage: what is checked is that every variant compiles and fits, which the interpreter runs of the
CPU suite cannot show (inline PTX, bf16 tensor-core dots, tf32x3, register-heavy tiles).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile for the GPU: run without TRITON_INTERPRET"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import compiler  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

H200_SHARED_BYTES = 232448  # per block, opt-in (sm_90)
compiled: list[str] = []
resources: list[tuple[str, int, int | None, int | None]] = []  # (kernel, shared bytes, registers, stack bytes)


def _usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers a thread, stack bytes a thread: where ptxas spills) from cuobjdump's resource usage."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return None, None
    reg, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return (int(reg.group(1)) if reg else None), (int(stack.group(1)) if stack else None)


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": H200_SHARED_BYTES, "multiprocessor_count": 132}

    def load_binary(self, name, kernel, shared, device):
        compiled.append(name)
        resources.append((name, shared, *_usage(kernel)))
        return "module", None, 0, 0, 1024


class _Driver:
    """Just enough of a CUDA driver for Triton to compile and 'load' kernels: nothing is launched."""

    utils = _Utils()

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None


def install() -> None:
    driver.set_active(_Driver())
    compiler.max_shared_mem.cache_clear()


PARTS = ("selection", "backward", "attention", "rescore")


def run_entry_points(parts=PARTS) -> None:
    """The launches a training step makes, at small shapes that keep every code path (and variant) alive."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import hyscale_compile
    from hyscale_compile.runtime import dispatch, plan

    g = torch.Generator().manual_seed(0)
    B, T, S, H, D, k = 1, 64, 8192, 16, 128, 64  # S past the candidate capacity: sampling runs
    table_max, plan.TABLE_MAX_BYTES = plan.TABLE_MAX_BYTES, 0  # these sizes would take the table route
    with dispatch.force_backend("triton"):
        # fp32 operands only with the selection's variants: the training path's are bf16 (and fp16 below)
        for dtype in (torch.bfloat16, torch.float32) if "selection" in parts else (torch.bfloat16,):
            q = torch.randn(B, T, H, D, generator=g).to(dtype).requires_grad_()
            kx = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
            w = torch.randn(B, T, H, generator=g).requires_grad_()
            v, i = hyscale_compile.indexer_topk(q, kx, k, weights=w, query_offset=S - T)
            if "backward" in parts:
                for low in (False, True):
                    v, i = hyscale_compile.indexer_topk(q, kx, k, weights=w, query_offset=S - T,
                                                        low_precision_grad=low)
                    v.float().sum().backward()
            if "selection" in parts:
                hyscale_compile.indexer_topk(q, kx, k, weights=w, sorted=False)
                mask = torch.rand(B, T, S, generator=g) > 0.1
                bias = torch.randn(T, S, generator=g)
                hyscale_compile.indexer_topk(q, kx, k, weights=w, mask=mask, fill=-1.0)
                hyscale_compile.indexer_topk(q, kx, k, weights=w, mask=bias)
                starts = torch.randint(0, S // 2, (B, T), generator=g)
                hyscale_compile.indexer_topk(q, kx, k, weights=w, starts=starts, ends=starts + S // 2)
                torch.ops.hyscale.rescore(q, kx, w, i.detach(), 1.0, True, True, S - T, None, None, None, None,
                                          None, float("-inf"), causal_additive=True)
        if "backward" in parts:  # fp16 operands take the widened tf32x3 path
            q, kx, w = (torch.randn(*s, generator=g) for s in ((B, T, H, D), (B, S, D), (B, T, H)))
            q, kx, w = q.half().requires_grad_(), kx.half().requires_grad_(), w.requires_grad_()
            hyscale_compile.indexer_topk(q, kx, k, weights=w, query_offset=S - T)[0].float().sum().backward()
        plan.TABLE_MAX_BYTES = table_max  # the table route: its kernel with each operand dtype, mask and bias
        if "selection" in parts or "backward" in parts:
            for dtype in (torch.bfloat16, torch.float32) if "selection" in parts else (torch.bfloat16,):
                q, kx = torch.randn(B, 1, H, D, generator=g).to(dtype), torch.randn(B, S, D, generator=g).to(dtype)
                w = torch.randn(B, 1, H, generator=g)
                hyscale_compile.indexer_topk(q, kx, k, weights=w, query_offset=S - 1)
                if "selection" in parts:
                    hyscale_compile.indexer_topk(q, kx, k, weights=w, sorted=False,
                                                 mask=torch.rand(B, 1, S, generator=g) > 0.1, fill=-1.0)
                    hyscale_compile.indexer_topk(q, kx, k, mask=torch.randn(1, S, generator=g))
            from hyscale_compile.runtime import table_rank  # the split ranker too (these rows take the row one)

            table_rank.rank(torch.zeros(B, S, dtype=torch.int64), k, split=table_rank.RANK_CHUNK)
        if "rescore" in parts:  # the quad transpose's PTX, and whether the compiled layout passes its check
            from hyscale_compile.runtime import hytopk
            from hyscale_compile.runtime import rescore as rs
            from hyscale_compile.runtime.reference import Visibility

            for H_ in (64, 32):
                q = torch.randn(B, T, H_, D, generator=g).bfloat16()
                kx = torch.randn(B, S, D, generator=g).bfloat16()
                w = torch.randn(B, T, H_, generator=g)
                rs._SHUFFLES_HOLD.clear()
                hytopk.rescore(q, kx, w, torch.randint(0, S, (B, T, 300), generator=g), 0.1, True,
                               Visibility(causal=True, offset=S - T), float("-inf"))
                print(f"rescore shuffles hold at H={H_}: {sorted(set(rs._SHUFFLES_HOLD.values()))}")
        if "attention" in parts:  # MLA latent (v = k[..., :512]), GQA and MHA layouts, forward and backward
            for (H_, G, Dqk, Dv, alias) in ((128, 1, 576, 512, True), (32, 8, 128, 128, False),
                                            (16, 16, 192, 128, False)):
                q = torch.randn(B, 8, H_, Dqk, generator=g).bfloat16().requires_grad_()
                kv = torch.randn(B, 256, G, Dqk, generator=g).bfloat16().requires_grad_()
                v = kv[..., :Dv] if alias else torch.randn(B, 256, G, Dv, generator=g).bfloat16().requires_grad_()
                picks = torch.randint(0, 256, (B, 8, 64), generator=g)
                out = hyscale_compile.sparse_attention(q, kv, v, picks, query_offset=248)
                out.float().sum().backward()
                if alias:  # the latent entry: dv folded into dk's contribution
                    out = hyscale_compile.sparse_attention_latent(q, kv, picks, value_dim=Dv, query_offset=248)
                    out.float().sum().backward()
                    _latent_backward_recomputing_the_output(q.detach(), kv.detach(), picks, Dv)


def _latent_backward_recomputing_the_output(q, kv, picks, Dv: int) -> None:
    """The absorbed MLA op's backward without its kept output (options["recompute_latent"]): the contribution
    kernel storing p and the recomputing dq kernel's column blocks."""
    from hyscale_compile.runtime.sparse_attention import Picks, backward, forward

    rule = Picks(causal=True, offset=248)
    out, lse = forward.forward(q, kv, kv[..., :Dv], picks, 0.1, rule, "zero")
    delta = torch.zeros(lse.shape, dtype=torch.float32)
    backward.backward_latent(torch.randn_like(out), delta, q, kv, Dv, lse, picks, 0.1, rule, "zero",
                             out=torch.empty_like(out), dlse=delta)


if __name__ == "__main__":
    install()
    run_entry_points(tuple(sys.argv[1:]) or PARTS)
    print(f"compiled {len(compiled)} kernel variants for sm_90:", ", ".join(sorted(set(compiled))))
    print("variants in launch order: kernel, shared bytes, registers a thread, stack bytes a thread (spills)")
    for name, shared, regs, stack in resources:
        print(f"  {name:24} shared {shared:>7} regs {regs} stack {stack}")
