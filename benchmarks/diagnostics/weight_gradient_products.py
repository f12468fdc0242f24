#!/usr/bin/env python
"""The handout step's weight-gradient products (gradient rows transposed times input rows, over 7680 packed
tokens, bf16 operands), timed three ways: cuBLAS's bf16 product then a cast to the fp32 weight's dtype (autograd's
way under autocast), the bf16 product alone, and one product written in fp32 (`torch.mm(..., out_dtype=
torch.float32)`, `layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`). Each way runs `CALLS` times back to back in one CUDA
graph, replayed; with `--profile` the kernels each way launches are listed (cuBLAS's split-K products add a
reduce kernel). A table of µs per call is printed last, and after it a second: each shape's products of the model's
`LAYERS` layers taken together, written in fp32 one layer after another (as the step does) against one batched product
over the layers' operands held in one stack (`torch.bmm(..., out_dtype=torch.float32)`), and against that product with
the stack made first from the layers' separate tensors (`torch.stack`): what the layers' weight gradients would cost if
the backward pass left them to the end of the step and took them together.

    python benchmarks/diagnostics/weight_gradient_products.py [--profile]
    CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 python benchmarks/diagnostics/weight_gradient_products.py

(the second with no cuBLAS workspace: which products it picks where split-K's partial sums have nowhere to go).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402

TOKENS, CALLS, REPLAYS, LAYERS = 7680, 20, 50, 4
# (output features, input features) of the handout model's plain layers: the attention's input projection (three
# layers as one product), its output projection, the MLP's two layers
SHAPES = {
    "attention input": (768, 256),
    "attention output": (256, 256),
    "MLP first": (1024, 256),
    "MLP second": (256, 1024),
}

WAYS = {
    "bf16 product, then cast": lambda grad, states: (grad.t() @ states).float(),
    "bf16 product alone": lambda grad, states: grad.t() @ states,
    "written in fp32": lambda grad, states: torch.mm(grad.t(), states, out_dtype=torch.float32),
}


TOGETHER = {
    "one layer after another": lambda grads, states: [
        torch.mm(grad.t(), state, out_dtype=torch.float32) for grad, state in zip(grads, states)
    ],
    "one batched product": lambda grads, states: torch.bmm(grads.transpose(1, 2), states, out_dtype=torch.float32),
    "stacked, then batched": lambda grads, states: torch.bmm(
        torch.stack(list(grads)).transpose(1, 2), torch.stack(list(states)), out_dtype=torch.float32
    ),
}


def kernel_names(step) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    return sorted({event.name[:90] for event in profiler.events() if event.device_type.name == "CUDA"})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="list the kernels each way launches")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape_name, (out_features, in_features) in SHAPES.items():
        grad = torch.randn(TOKENS, out_features, device="cuda", dtype=torch.bfloat16)
        states = torch.randn(TOKENS, in_features, device="cuda", dtype=torch.bfloat16)
        exact = grad.double().t() @ states.double()
        for way, product in WAYS.items():
            error = (product(grad, states).double() - exact).abs().max().item() / exact.abs().max().item()
            microseconds = (
                1000 * graphed_ms(lambda p=product, g=grad, s=states: [p(g, s) for _ in range(CALLS)], REPLAYS) / CALLS
            )
            rows.append((shape_name, way, microseconds, error))
            if args.profile:
                print(f"{shape_name}, {way}: {', '.join(kernel_names(lambda p=product, g=grad, s=states: p(g, s)))}")
    together_rows = []
    for shape_name, (out_features, in_features) in SHAPES.items():
        grads = torch.randn(LAYERS, TOKENS, out_features, device="cuda", dtype=torch.bfloat16)
        states = torch.randn(LAYERS, TOKENS, in_features, device="cuda", dtype=torch.bfloat16)
        exact = grads.double().transpose(1, 2) @ states.double()
        for way, products in TOGETHER.items():
            result = torch.stack(list(products(grads, states)))
            error = (result.double() - exact).abs().max().item() / exact.abs().max().item()
            microseconds = (
                1000
                * graphed_ms(lambda p=products, g=grads, s=states: [p(g, s) for _ in range(CALLS)], REPLAYS)
                / CALLS
            )
            together_rows.append((shape_name, way, microseconds, error))
            if args.profile:
                names = kernel_names(lambda p=products, g=grads, s=states: p(g, s))
                print(f"{shape_name}, {LAYERS} layers, {way}: {', '.join(names)}")
    print(
        f"\n{torch.cuda.get_device_name()}, {TOKENS} tokens, µs per call ({CALLS} calls per graph, {REPLAYS} replays)"
    )
    print(f"{'layer':<18} {'way':<26} {'µs':>7} {'largest error / largest element':>32}")
    for shape_name, way, microseconds, error in rows:
        print(f"{shape_name:<18} {way:<26} {microseconds:7.2f} {error:32.2e}")
    print(f"\nthe {LAYERS} layers' products of each shape together, written in fp32: µs for all {LAYERS}")
    print(f"{'layer':<18} {'way':<26} {'µs':>7} {'largest error / largest element':>32}")
    totals = {}
    for shape_name, way, microseconds, error in together_rows:
        totals[way] = totals.get(way, 0.0) + microseconds
        print(f"{shape_name:<18} {way:<26} {microseconds:7.2f} {error:32.2e}")
    for way, microseconds in totals.items():
        print(f"{'every shape':<18} {way:<26} {microseconds:7.2f}")


if __name__ == "__main__":
    main()
