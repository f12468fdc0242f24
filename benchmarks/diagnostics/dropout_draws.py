#!/usr/bin/env python
"""What inductor's dropout draws cost in the handout step's residual kernels: a residual sum with its dropout and
the LayerNorm after it (7680 packed tokens × 256, the residual in fp32, the branch in bf16, the normalized rows cast
to bf16), compiled by inductor as the training step is, with the branch dropped out at p = 0.1 (inductor draws one
Philox evaluation per element), the same with inductor's `fallback_random` (ATen's dropout kernel, four uniforms
per evaluation, in a launch of its own), by the model's dropout with its mask drawn by the package's kernel (eight
16-bit uniforms per evaluation, `layers_knowgpt.DROPOUT_MASK_KERNEL`), at p = 0 (nothing drawn), and with the mask handed in as bytes (the draws' floor:
reading a mask instead of drawing it). Each way runs forward only and forward + backward, in one CUDA graph,
replayed; a table of µs is printed last.

    python benchmarks/diagnostics/dropout_draws.py
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from hf_knowgpt import layers_knowgpt  # noqa: E402
from hf_knowgpt.kernels.fused_layers import residual_layer_norm_reference  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

TOKENS, WIDTH, DROPOUT_P, EPS = 7680, 256, 0.1, 1e-5


def residual_layer_norm(dropout_p):
    """The residual sum with its branch dropped out, and the LayerNorm after it, as the model writes them (the
    package's plain composition, `fused_layers.residual_layer_norm_reference`), the normalized rows in bf16."""
    return functools.partial(
        residual_layer_norm_reference, eps=EPS, dropout_p=dropout_p, training=True, normalized_dtype=torch.bfloat16
    )


def residual_layer_norm_with_mask(residual, branch, weight, bias, keep):
    """The same with the dropout mask given: what a mask drawn elsewhere would leave to this kernel."""
    return residual_layer_norm(0.0)(residual, branch * keep * (1.0 / (1.0 - DROPOUT_P)), weight, bias)


def residual_layer_norm_with_kernel_mask():
    """The same with the branch dropped out by the model's `KnowGPTDropout`, whose mask the package's kernel draws
    in a compiled step where DROPOUT_MASK_KERNEL is on."""
    dropout = layers_knowgpt.KnowGPTDropout(DROPOUT_P)

    def function(residual, branch, weight, bias):
        return residual_layer_norm(0.0)(residual, dropout(branch), weight, bias)

    return function


def forward_and_both_us(compiled, inputs, grads, replays) -> tuple[float, float]:
    """µs per forward alone and per forward + backward of `compiled` on `inputs`, each in one graph, replayed."""

    def forward():
        compiled(*inputs)

    def forward_backward():
        torch.autograd.backward(compiled(*inputs), grads)

    return graphed_ms(forward, replays) * 1e3, graphed_ms(forward_backward, replays) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replays", type=int, default=500)
    args = parser.parse_args()
    from torch._inductor.codegen.triton import TritonOverrides

    print(describe_device(torch.device("cuda")), "torch", torch.__version__)
    print(
        "inductor draws four uniforms per Philox evaluation in 1-D kernels:",
        hasattr(TritonOverrides, "_can_use_4x_random"),
    )
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    residual = torch.randn(TOKENS, WIDTH, device=device, generator=generator, requires_grad=True)
    branch = torch.randn(TOKENS, WIDTH, device=device, generator=generator).bfloat16().requires_grad_()
    weight = torch.ones(WIDTH, device=device, requires_grad=True)
    bias = torch.zeros(WIDTH, device=device, requires_grad=True)
    keep = torch.rand(TOKENS, WIDTH, device=device, generator=generator) >= DROPOUT_P
    grad = torch.randn(TOKENS, WIDTH, device=device, generator=generator)
    grads = (grad, grad.bfloat16())
    ways = {
        "dropout drawn by inductor (p = 0.1)": (residual_layer_norm(DROPOUT_P), (), {}),
        "dropout by ATen (fallback_random)": (residual_layer_norm(DROPOUT_P), (), {"fallback_random": True}),
        "mask by the package's kernel": (residual_layer_norm_with_kernel_mask(), (), {}),
        "no dropout (p = 0)": (residual_layer_norm(0.0), (), {}),
        "mask handed in as bytes": (residual_layer_norm_with_mask, (keep,), {}),
    }
    rows = []
    for name, (function, extra, options) in ways.items():
        torch._dynamo.reset()  # each way compiled with its own options
        layers_knowgpt.DROPOUT_MASK_KERNEL = "package's kernel" in name
        compiled = torch.compile(function, fullgraph=True, dynamic=False, options=options)
        rows.append(
            (name, *forward_and_both_us(compiled, (residual, branch, weight, bias, *extra), grads, args.replays))
        )
        for tensor in (residual, branch, weight, bias):
            tensor.grad = None
    print(f"\n{'way':<40}{'forward µs':>12}{'forward + backward µs':>24}")
    for name, forward_us, both_us in rows:
        print(f"{name:<40}{forward_us:>12.1f}{both_us:>24.1f}")


if __name__ == "__main__":
    main()
