#!/usr/bin/env python
"""Two reductions of an uncompiled training step's backward pass, each timed against its alternative as a
CUDA graph replayed 200 times (device time per call), at the handout step's size (7680 packed tokens):

1. an embedding's weight gradient: PyTorch's (sort of the ids, segmented sums) against KnowGPTEmbedding's
   one matrix product of one-hot rows (fp32 gradient, TF32 on as in training), vocabulary 256 and 128;
2. a linear layer's bias gradient from a bf16 output gradient: `grad.sum(0)` (what autograd runs) against a
   matrix product `ones · grad`, for widths 256, 768 and 1024.

    python benchmarks/diagnostics/backward_reductions.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from hf_knowgpt.kernels import use_training_matmul_settings  # noqa: E402
from hf_knowgpt.layers_knowgpt import _RowsWithMatrixProductGradient  # noqa: E402

TOKENS, WIDTH, REPLAYS = 7680, 256, 200


def main():
    use_training_matmul_settings()  # the products as training runs them
    rows = []
    for vocabulary in (256, 128):
        weight = torch.randn(vocabulary, WIDTH, device="cuda", requires_grad=True)
        ids = torch.randint(0, vocabulary, (TOKENS,), device="cuda")
        grad = torch.randn(TOKENS, WIDTH, device="cuda")
        for name, lookup in (
            ("nn.Embedding (sort, segmented sums)", lambda w, i: F.embedding(i, w)),
            ("one-hot rows · gradient", _RowsWithMatrixProductGradient.apply),
        ):

            def step(lookup=lookup, weight=weight, ids=ids, grad=grad):
                return torch.autograd.grad(lookup(weight, ids), weight, grad)

            rows.append((f"embedding gradient, {vocabulary} rows, {name}", graphed_ms(step, REPLAYS)))
    for width in (256, 768, 1024):
        grad = torch.randn(TOKENS, width, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(1, TOKENS, device="cuda", dtype=torch.bfloat16)
        rows.append(
            (
                f"bias gradient, width {width}, grad.sum(0)",
                graphed_ms(lambda g=grad: g.sum(0, dtype=torch.float32), REPLAYS),
            )
        )
        rows.append(
            (
                f"bias gradient, width {width}, ones · grad",
                graphed_ms(lambda g=grad, o=ones: torch.mm(o, g).float(), REPLAYS),
            )
        )
    print(f"\n{torch.cuda.get_device_name()}; {TOKENS} tokens{'':<20}{'ms per call':>12}")
    for name, value in rows:
        print(f"{name:<64}{value:>12.4f}")


if __name__ == "__main__":
    main()
