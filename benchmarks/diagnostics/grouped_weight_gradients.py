#!/usr/bin/env python
"""The handout step's sixteen weight-gradient products (four layers × the attention's input and output projections
and the MLP's two layers: gradient rows transposed times input rows over 7680 packed tokens, bf16 operands, fp32
results) in one launch of `knowgpt::transposed_products` (hf_knowgpt.kernels.grouped_products, what a compiled step
runs with `GraphedStepper.WEIGHT_GRADIENTS_TOGETHER`), in each of several kernel configurations, against cuBLAS's
sixteen products one after another as the step runs them otherwise (`torch.mm(..., out_dtype=torch.float32)`,
`layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`); and the same with the eight bias gradients of the wide layers (the
attention's input projection, the MLP's first layer) taken into the launch (`grouped_products.COLUMN_SUMS_TOGETHER`),
against those products and `column_sums`'s eight kernels (each with torch's sum of its partial sums, which a
compiled step fuses into another kernel instead). Each way runs in one CUDA graph, replayed; a table of µs per step,
TFLOP/s of the products and the largest error against fp64 is printed last.

    python benchmarks/diagnostics/grouped_weight_gradients.py
    python benchmarks/diagnostics/grouped_weight_gradients.py --configs 128x128x64-1-8-3,128x64x64-2-4-4

A configuration is BLOCK_MxBLOCK_NxBLOCK_K-SPLITS-NUM_WARPS-NUM_STAGES, the module's settings of those names; the
first is also timed with the column sums' loads of 64 and 256 tokens (`SUM_BLOCK_TOKENS`).
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from benchmarks.diagnostics.weight_gradient_products import LAYERS, SHAPES, TOKENS  # noqa: E402
from hf_knowgpt.kernels import column_sums, grouped_products  # noqa: E402

REPLAYS = 200
CONFIGS = ("128x128x64-1-8-3", "128x128x64-2-8-3", "128x128x64-3-8-3", "128x128x64-1-4-4", "128x64x64-1-4-4",
           "128x64x64-2-4-4", "64x128x64-2-4-4", "128x256x64-1-8-3", "64x64x64-2-4-4")  # fmt: skip


def settings(config: str) -> dict:
    """The module's kernel settings a configuration names."""
    blocks, splits, warps, stages = config.split("-")
    block_m, block_n, block_k = (int(size) for size in blocks.split("x"))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=int(splits), NUM_WARPS=int(warps),
                NUM_STAGES=int(stages))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, as the module's doc says")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    gradients, inputs = [], []
    for _ in range(LAYERS):
        for rows, cols in SHAPES.values():
            gradients.append(torch.randn(TOKENS, rows, generator=generator).to("cuda", torch.bfloat16))
            inputs.append(torch.randn(TOKENS, cols, generator=generator).to("cuda", torch.bfloat16))
    exact = torch.cat([(g.double().t() @ x.double()).flatten() for g, x in zip(gradients, inputs)])
    summed = [index for index, (rows, _) in enumerate(list(SHAPES.values()) * LAYERS) if rows > 256]  # the wide ones
    exact_with_sums = torch.cat([exact] + [gradients[index].double().sum(0) for index in summed])
    flops = 2 * TOKENS * sum(rows * cols for rows, cols in SHAPES.values()) * LAYERS

    def one_after_another():
        return [torch.mm(g.t(), x, out_dtype=torch.float32) for g, x in zip(gradients, inputs)]

    def one_after_another_and_sums():
        return one_after_another() + [column_sums.column_sums(gradients[index]) for index in summed]

    def flat(result) -> torch.Tensor:
        return torch.cat([product.flatten() for product in result]) if isinstance(result, list) else result

    def one_launch():
        return grouped_products.transposed_products(gradients, inputs)

    def one_launch_with_sums():
        return grouped_products.transposed_products(gradients, inputs, summed)

    configs = args.configs.split(",")
    ways = [("cuBLAS, one product after another", one_after_another, {}, exact)]
    ways += [(f"one launch, {config}", one_launch, settings(config), exact) for config in configs]
    ways += [(f"cuBLAS + {len(summed)} column_sums", one_after_another_and_sums, {}, exact_with_sums)]
    ways += [(f"one launch + sums, {c}", one_launch_with_sums, settings(c), exact_with_sums) for c in configs]
    for tokens in (64, 256):  # the sums' loads smaller and larger than the module's SUM_BLOCK_TOKENS
        each = dict(settings(configs[0]), SUM_BLOCK_TOKENS=tokens)
        ways.append((f"one launch + sums, {configs[0]}, {tokens} a load", one_launch_with_sums, each, exact_with_sums))
    table = []
    for name, products, module_settings, exact_result in ways:
        patched = mock.patch.multiple(grouped_products, **module_settings) if module_settings else nullcontext()
        with patched:
            try:
                difference = (flat(products()).double() - exact_result).abs().max()
                error = (difference / exact_result.abs().max()).item()
                microseconds = 1000 * graphed_ms(products, REPLAYS)
            except Exception as failure:  # a configuration that does not build (shared memory) is reported
                table.append((name, None, None, f"{type(failure).__name__}: {str(failure)[:80]}"))
                continue
        table.append((name, microseconds, flops / microseconds / 1e6, f"{error:.2e}"))
        print(table[-1], flush=True)
    print(
        f"\n{torch.cuda.get_device_name()}: the {LAYERS * len(SHAPES)} weight-gradient products of a step, {TOKENS} "
        f"tokens, µs per step from one CUDA graph replayed {REPLAYS} times"
    )
    width = max(len(name) for name, *_ in table) + 2
    print(f"{'way':<{width}} {'µs':>8} {'TFLOP/s':>8}  largest error / largest element")
    for name, microseconds, tflops, error in table:
        if microseconds is None:
            print(f"{name:<{width}} {'–':>8} {'–':>8}  {error}")
        else:
            print(f"{name:<{width}} {microseconds:8.1f} {tflops:8.0f}  {error}")


if __name__ == "__main__":
    main()
