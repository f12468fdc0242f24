#!/usr/bin/env python
"""Does `--fused_layers` reach the kernel in the graphed training step? Counts the calls that run the fused
residual + LayerNorm kernel (not its PyTorch fallback) while `scripts/train.py` runs with the given flags, and
prints them after the run's own output:

    python benchmarks/diagnostics/fused_layers_active.py --recipe handout --attention_type vanilla \\
        --data_dir .data --mixed_precision bf16 --fused_layers --pretrain_max_epochs 200 --output_dir /tmp/f
"""

import sys

from hf_knowgpt.commands import cli, train
from hf_knowgpt.kernels import fused_layers

calls = {"kernel": 0, "fallback": 0}
kernel_apply, fallback = fused_layers._ResidualLayerNorm.apply, fused_layers.residual_layer_norm_reference


def counted_kernel(*args):
    calls["kernel"] += 1
    return kernel_apply(*args)


def counted_fallback(*args):
    calls["fallback"] += 1
    return fallback(*args)


fused_layers._ResidualLayerNorm.apply = counted_kernel
fused_layers.residual_layer_norm_reference = counted_fallback
if __name__ == "__main__":
    sys.argv = ["train.py", *sys.argv[1:]]
    try:
        cli.main_guard(train.main)
    finally:
        print(f"fused residual + LayerNorm calls traced: {calls}", flush=True)
