#!/usr/bin/env python
"""Which arguments of the fused attention kernels torch.compile's analysis of user Triton kernels takes
for written, for (B, H, T, D), packed and rotary calls. Under torch.compile every argument in that list is
copied before the launch and its tensor rebound to the copy afterwards (benchmarks/RESULTS.md, "Kernels"),
so none of them may share memory with another argument. The launches are recorded, not run.

    python benchmarks/diagnostics/kernel_write_analysis.py

Without a GPU the kernels are lowered for an H100 target (sm_90), which needs no GPU.
"""

import sys
from pathlib import Path

import torch
from torch._higher_order_ops import triton_kernel_wrap

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_knowgpt.attention_knowgpt import rotary_angles  # noqa: E402
from hf_knowgpt.kernels import fused_attention  # noqa: E402


def taken_for_written(kernel, arguments) -> list[str]:
    # torch 2.13 reports reads and writes; 2.11 (the GPU machine's) only the names it takes for mutated.
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, arguments, {})
        return [dependency.name for dependency in accesses.read_writes.writes]
    return triton_kernel_wrap.identify_mutated_tensors(kernel, arguments, {})


class H100Target:
    """Triton's active driver reduced to what lowering a kernel asks of it."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        fused_attention.triton.runtime.driver.set_active(H100Target())
    batch, heads, length, head_dim = 2, 2, 20, 16
    print(f"torch {torch.__version__}, triton {fused_attention.triton.__version__}")
    for call in ("grid", "packed", "packed-rotary"):
        lengths = starts = cos = sin = None
        if call.startswith("packed"):
            lengths = torch.tensor([20, 15], dtype=torch.int32, device=device)
            starts = torch.tensor([0, 20], dtype=torch.int32, device=device)
            query, key, value = (
                torch.randn(35, heads, head_dim, dtype=torch.bfloat16, device=device) for _ in range(3)
            )
            if call == "packed-rotary":
                cos, sin = rotary_angles(torch.arange(length, device=device), head_dim, 10000.0)
        else:
            projected = torch.randn(batch, length, 3 * heads * head_dim, dtype=torch.bfloat16, device=device)
            query, key, value = (x.unflatten(-1, (heads, head_dim)).transpose(1, 2) for x in projected.chunk(3, -1))
        seed = torch.tensor([1], device=device)
        options = (length, 0.25, 0.1, 3, 16)
        with fused_attention.recorded_launches() as launches:
            out, out32, lse, _, _ = torch.ops.knowgpt.causal_attention_forward(
                query, key, value, seed, lengths, starts, cos, sin, None, *options
            )
            torch.ops.knowgpt.causal_attention_backward(
                out, query, key, value, out32, lse, seed, lengths, starts, cos, sin, None, *options
            )
        for kernel, arguments in launches:
            print(
                f"{call:<14}{kernel.fn.__name__:<18}taken for written: {', '.join(taken_for_written(kernel, arguments))}"
            )


if __name__ == "__main__":
    main()
