#!/usr/bin/env python
"""The MLP forward and backward at the training step's size (7680 packed tokens; the handout's width 256, and
`--widths` more), as the compiled step runs it: the plain layers (`layers_knowgpt.mlp` with GELU_IN_PRODUCTS off:
cuBLAS products, inductor's GELU passes), and GELU inside the products (`hf_knowgpt.kernels.gelu_products`) with
its tile settings as they are and with those of `--configs`. Each way is compiled by inductor for a symbolic
token count, as in the step, under bf16 autocast, captured in one CUDA graph and replayed; a table of µs per
forward + backward and the ratio to the plain layers is printed last.

    python benchmarks/diagnostics/gelu_products.py [--widths 256,1024]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from hf_knowgpt import layers_knowgpt  # noqa: E402
from hf_knowgpt.kernels import gelu_products, use_training_matmul_settings  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

# BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES
CONFIGS = "128,128,64,8,8,3;128,128,64,8,4,3;128,256,64,8,8,3;64,128,64,8,4,4;128,64,64,8,4,4;128,128,128,8,8,2"
SETTINGS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_WARPS", "NUM_STAGES")


def mlp_step(width: int, tokens: int, gelu_in_products: bool):
    """A compiled forward + backward of one MLP with fresh layers, and its inputs kept alive for replays."""
    torch.manual_seed(0)
    fc = torch.nn.Linear(width, 4 * width, device="cuda")
    proj = torch.nn.Linear(4 * width, width, device="cuda")
    activation = torch.nn.GELU()
    states = torch.randn(tokens, width, device="cuda", requires_grad=True)
    torch._dynamo.mark_dynamic(states, 0)
    grad = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    parameters = [states, fc.weight, fc.bias, proj.weight, proj.bias]

    def forward(states):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layers_knowgpt.mlp(states, fc, activation, proj)

    compiled = torch.compile(forward)
    layers_knowgpt.GELU_IN_PRODUCTS = gelu_in_products

    def step():
        return torch.autograd.grad(compiled(states), parameters, grad)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7680)
    parser.add_argument("--widths", default="256", help="comma-separated n_embd values")
    parser.add_argument("--configs", default=CONFIGS, help=f"';'-separated {','.join(SETTINGS)}")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    use_training_matmul_settings()
    as_they_are = tuple(getattr(gelu_products, name) for name in SETTINGS)
    configs = [tuple(int(value) for value in config.split(",")) for config in args.configs.split(";") if config]
    configs = [config for config in configs if config != as_they_are]  # the settings as they are run first
    rows = []
    for width in (int(width) for width in args.widths.split(",")):
        ways = [("plain layers (cuBLAS, inductor's GELU)", False, as_they_are)]
        ways += [(f"GELU in products, {', '.join(map(str, c))}", True, c) for c in [as_they_are, *configs]]
        baseline = None
        for name, fused, config in ways:
            for setting, value in zip(SETTINGS, config):
                setattr(gelu_products, setting, value)
            torch._dynamo.reset()
            try:
                microseconds = 1000 * graphed_ms(mlp_step(width, args.tokens, fused), args.replays)
            except Exception as failure:  # a tile that does not fit the device is reported, not fatal
                microseconds = float("nan")
                name += f" ({type(failure).__name__}: {str(failure)[:60]})"
            baseline = baseline or microseconds
            rows.append((width, name, microseconds, baseline / microseconds))
            print(rows[-1], flush=True)
    for setting, value in zip(SETTINGS, as_they_are):
        setattr(gelu_products, setting, value)
    print(f"\n{describe_device()}; MLP forward + backward, {args.tokens} tokens, bf16 autocast, compiled, one graph")
    print(f"{'width':>6}  {'way (BLOCK_M, N, K, GROUP_M, warps, stages)':<70}{'µs':>9}{'vs plain':>10}")
    for width, name, microseconds, ratio in rows:
        print(f"{width:>6}  {name:<70}{microseconds:>9.1f}{ratio:>9.2f}×")


if __name__ == "__main__":
    main()
