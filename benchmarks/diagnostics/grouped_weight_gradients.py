#!/usr/bin/env python
"""The handout step's sixteen weight-gradient products (four layers × the attention's input and output projections
and the MLP's two layers: gradient rows transposed times input rows over 7680 packed tokens, bf16 operands, fp32
results) in one Triton launch, against cuBLAS's sixteen products one after another as the step runs them
(`torch.mm(..., out_dtype=torch.float32)`, `layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`). A table of µs per step's
sixteen products, each way from one CUDA graph replayed, and their largest error against fp64, is printed last.

Why: the products are about 0.17 ms of the 1.37 ms step (benchmarks/RESULTS.md), at 120–340 TFLOP/s, because each
has few output tiles (256 × 256 has four of 128 × 128 for 132 multiprocessors) and so splits its 7680 tokens into
parts and adds them in a reduce kernel of its own. Taken together the sixteen have 192 tiles of 128 × 128. The
backward pass would have to leave them to its end (their inputs kept until then) for one launch to take them all;
this measures whether that would pay before anything is built for it.

How: each program computes one tile of one product over one part of the tokens, reaching its operands through a
table of their addresses (no copy into one stack) and writing into one flat fp32 buffer of all sixteen results;
with the tokens in `splits` parts, the parts' partial tiles go to a buffer of their own and one sum over them
follows (deterministic: no atomics).

    python benchmarks/diagnostics/grouped_weight_gradients.py
    python benchmarks/diagnostics/grouped_weight_gradients.py --configs 128x128x64-1-8-3,128x64x64-2-4-4
    TRITON_INTERPRET=1 python benchmarks/diagnostics/grouped_weight_gradients.py --check   # CPU, small shapes

A configuration is BLOCK_MxBLOCK_NxBLOCK_K-splits-warps-stages.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_knowgpt.kernels.fused_attention import triton  # noqa: E402  (None where Triton is not installed)

if triton is not None:
    import triton.language as tl

    OPERAND_TYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

TOKENS, LAYERS, REPLAYS = 7680, 4, 200
# (output features, input features) of the handout model's plain layers, as weight_gradient_products.py names them
SHAPES = {"attention input": (768, 256), "attention output": (256, 256), "MLP first": (1024, 256),
          "MLP second": (256, 1024)}  # fmt: skip
CONFIGS = ("128x128x64-1-8-3", "128x128x64-2-8-3", "128x128x64-3-8-3", "128x128x64-1-4-4", "128x64x64-1-4-4",
           "128x64x64-2-4-4", "64x128x64-2-4-4", "128x256x64-1-8-3", "64x64x64-2-4-4")  # fmt: skip


if triton is not None:

    @triton.jit
    def _grouped_transposed_products(
        TILES, GRADIENT_ADDRESSES, INPUT_ADDRESSES, OUTPUT_OFFSETS, OUT_FEATURES, IN_FEATURES, OUT,
        tokens, split_tokens, split_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
        EVEN: tl.constexpr, OPERAND: tl.constexpr,
    ):  # fmt: skip
        """Program p: tile p // SPLITS (its product, first row and first column from TILES), tokens part
        p % SPLITS: OUT[part · split_stride + offset + rows × columns] = gradientᵀ · input over the part's tokens.
        EVEN: every part a whole number of BLOCK_K tokens and every product whole tiles, so no load needs a mask.
        OPERAND: the operands' type (bf16; fp32 in the interpreter's check, whose memory holds no bf16)."""
        program = tl.program_id(0)
        tile, part = program // SPLITS, program % SPLITS
        product = tl.load(TILES + 3 * tile)
        first_row = tl.multiple_of(tl.load(TILES + 3 * tile + 1), 16)
        first_col = tl.multiple_of(tl.load(TILES + 3 * tile + 2), 16)
        out_features = tl.multiple_of(tl.load(OUT_FEATURES + product), 16)
        in_features = tl.multiple_of(tl.load(IN_FEATURES + product), 16)
        gradient = tl.multiple_of(tl.load(GRADIENT_ADDRESSES + product).to(tl.pointer_type(OPERAND)), 16)
        states = tl.multiple_of(tl.load(INPUT_ADDRESSES + product).to(tl.pointer_type(OPERAND)), 16)
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = first_col + tl.arange(0, BLOCK_N)
        begin = part * split_tokens
        end = tl.minimum(begin + split_tokens, tokens)
        accumulated = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(begin, end, BLOCK_K):
            ks = (start + tl.arange(0, BLOCK_K)).to(tl.int64)
            if EVEN:
                a = tl.load(gradient + ks[:, None] * out_features + rows[None, :])
                b = tl.load(states + ks[:, None] * in_features + cols[None, :])
            else:
                a = tl.load(
                    gradient + ks[:, None] * out_features + rows[None, :],
                    mask=(ks[:, None] < end) & (rows[None, :] < out_features),
                    other=0.0,
                )
                b = tl.load(
                    states + ks[:, None] * in_features + cols[None, :],
                    mask=(ks[:, None] < end) & (cols[None, :] < in_features),
                    other=0.0,
                )
            accumulated = tl.dot(tl.trans(a), b, accumulated)
        offset = tl.load(OUTPUT_OFFSETS + product) + part.to(tl.int64) * split_stride
        inside = (rows[:, None] < out_features) & (cols[None, :] < in_features)
        tl.store(OUT + offset + rows[:, None] * in_features + cols[None, :], accumulated, mask=inside)


def _parse(config: str) -> dict:
    blocks, splits, warps, stages = config.split("-")
    block_m, block_n, block_k = (int(size) for size in blocks.split("x"))
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, splits=int(splits), num_warps=int(warps),
                num_stages=int(stages))  # fmt: skip


class GroupedTransposedProducts:
    """`gradients[i]ᵀ · inputs[i]` for every i in one launch (plus one sum where the tokens are split), the operands
    found through tables made once for these tensors: a captured graph replays the launch on the same addresses."""

    def __init__(self, gradients, inputs, block_m=128, block_n=128, block_k=64, splits=1, num_warps=8, num_stages=3):
        device = gradients[0].device
        tokens = gradients[0].shape[0]
        if any(g.shape[0] != tokens or x.shape[0] != tokens for g, x in zip(gradients, inputs)):
            raise ValueError("every product's operands need the same number of rows (tokens)")
        dtype = gradients[0].dtype
        if dtype not in OPERAND_TYPES or any(g.dtype != dtype or x.dtype != dtype for g, x in zip(gradients, inputs)):
            raise ValueError(f"the operands must share one of the types {list(OPERAND_TYPES)}")
        if any(not (g.is_contiguous() and x.is_contiguous()) for g, x in zip(gradients, inputs)):
            raise ValueError("the operands must be contiguous")
        # the kernel tells the compiler so, for 16-byte loads
        if any(t.data_ptr() % 16 or t.shape[1] % 16 for t in (*gradients, *inputs)):
            raise ValueError("the operands' addresses and widths must be multiples of 16")
        self.shapes = [(g.shape[1], x.shape[1]) for g, x in zip(gradients, inputs)]
        tiles, offsets, offset = [], [], 0
        for product, (rows, cols) in enumerate(self.shapes):
            offsets.append(offset)
            offset += rows * cols
            tiles += [(product, r, c) for r in range(0, rows, block_m) for c in range(0, cols, block_n)]
        self.total = offset
        self.splits = splits
        # parts of whole BLOCK_K steps, so that only the last may be short
        self.split_tokens = triton.cdiv(triton.cdiv(tokens, splits), block_k) * block_k
        even = tokens % self.split_tokens == 0 and tokens % block_k == 0
        even = even and all(rows % block_m == 0 and cols % block_n == 0 for rows, cols in self.shapes)

        def table(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        self.arguments = (
            table(tiles, torch.int32).flatten(), table([g.data_ptr() for g in gradients], torch.int64),
            table([x.data_ptr() for x in inputs], torch.int64), table(offsets, torch.int64),
            table([rows for rows, _ in self.shapes], torch.int32), table([cols for _, cols in self.shapes], torch.int32),
        )  # fmt: skip
        self.operands = (gradients, inputs)  # kept alive while their addresses are in the tables
        self.parts = torch.empty(splits * self.total, dtype=torch.float32, device=device) if splits > 1 else None
        self.out = torch.empty(self.total, dtype=torch.float32, device=device)
        self.grid = (len(tiles) * splits,)
        self.tokens = tokens
        self.options = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, EVEN=even,
                            OPERAND=OPERAND_TYPES[dtype], num_warps=num_warps, num_stages=num_stages)  # fmt: skip

    def __call__(self) -> list[torch.Tensor]:
        target = self.out if self.parts is None else self.parts
        _grouped_transposed_products[self.grid](
            *self.arguments, target, self.tokens, self.split_tokens, self.total, **self.options
        )
        if self.parts is not None:
            torch.sum(self.parts.view(self.splits, self.total), 0, out=self.out)
        results, offset = [], 0
        for rows, cols in self.shapes:
            results.append(self.out[offset : offset + rows * cols].view(rows, cols))
            offset += rows * cols
        return results


def operands(tokens, shapes, layers, device, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    gradients, inputs = [], []
    for _ in range(layers):
        for rows, cols in shapes:
            gradients.append(torch.randn(tokens, rows, generator=generator).to(device, dtype))
            inputs.append(torch.randn(tokens, cols, generator=generator).to(device, dtype))
    return gradients, inputs


def largest_error(results, gradients, inputs) -> float:
    """The largest error of any product over its largest element, against fp64."""
    worst = 0.0
    for result, gradient, states in zip(results, gradients, inputs):
        exact = gradient.double().t() @ states.double()
        worst = max(worst, ((result.double() - exact).abs().max() / exact.abs().max()).item())
    return worst


def check():
    """Small shapes, odd sizes and several splits under Triton's interpreter (or on a GPU): the kernel's products
    against fp64."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cuda" if torch.cuda.is_available() and not interpreted else "cpu"
    dtype = torch.float32 if interpreted else torch.bfloat16  # the products exact in fp32 either way
    shapes = [(32, 16), (16, 48), (48, 32)]
    for tokens, config in ((64, "16x16x16-1-4-1"), (80, "16x16x16-2-4-1"), (70, "32x16x16-3-4-1")):
        gradients, inputs = operands(tokens, shapes, 2, device, dtype)
        error = largest_error(GroupedTransposedProducts(gradients, inputs, **_parse(config))(), gradients, inputs)
        print(f"{tokens} tokens, {config}: largest error / largest element {error:.2e}")
        assert error < 1e-5, error


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, as the module's doc says")
    parser.add_argument("--check", action="store_true", help="check the kernel at small shapes and stop")
    args = parser.parse_args()
    if args.check:
        return check()
    from benchmarks.bench_attention import graphed_ms

    gradients, inputs = operands(TOKENS, list(SHAPES.values()), LAYERS, "cuda")
    flops = 2 * TOKENS * sum(rows * cols for rows, cols in SHAPES.values()) * LAYERS

    def one_after_another():
        return [torch.mm(g.t(), x, out_dtype=torch.float32) for g, x in zip(gradients, inputs)]

    rows = [("cuBLAS, one product after another", one_after_another)]
    for config in args.configs.split(","):
        rows.append((f"one launch, {config}", GroupedTransposedProducts(gradients, inputs, **_parse(config))))
    table = []
    for name, products in rows:
        try:
            error = largest_error(products(), gradients, inputs)
            microseconds = 1000 * graphed_ms(products, REPLAYS)
        except Exception as failure:  # a configuration that does not build (shared memory) is reported, not fatal
            table.append((name, None, None, f"{type(failure).__name__}: {str(failure)[:80]}"))
            continue
        table.append((name, microseconds, flops / microseconds / 1e6, f"{error:.2e}"))
        print(table[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, Triton {triton.__version__}: the {LAYERS * len(SHAPES)} weight-gradient "
          f"products of a step, {TOKENS} tokens, µs per step from one CUDA graph replayed {REPLAYS} times")  # fmt: skip
    print(f"{'way':<40} {'µs':>8} {'TFLOP/s':>8}  largest error / largest element")
    for name, microseconds, tflops, error in table:
        if microseconds is None:
            print(f"{name:<40} {'–':>8} {'–':>8}  {error}")
        else:
            print(f"{name:<40} {microseconds:8.1f} {tflops:8.0f}  {error}")


if __name__ == "__main__":
    main()
