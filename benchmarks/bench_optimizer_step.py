#!/usr/bin/env python
"""The graphed training step's update: gradient clipping, the step's learning rate and AdamW, as the multi-tensor
kernels do it (`hf_knowgpt.kernels.multi_tensor_adamw`, three launches) against what they replace (the clipping
and rate compiled by torch.compile with the step's inductor options, then torch's fused AdamW), on a CUDA GPU,
for the parameters of the handout recipe's model (and others given). Prints a table last.

    python benchmarks/bench_optimizer_step.py [--models handout,wide] [--replays 2000]

Each update is captured in a CUDA graph after warm-up calls, as the training step captures it, and replayed
`--replays` times between two CUDA events (device time per update; median of `--repeats` such timings). The
gradients are fixed random tensors (large enough that the clipping scales them); the optimizer is made as the trainer
makes it (`KnowGPTTrainer._make_optimizer`: the handout's groups, betas (0.9, 0.95), fused, capturable, one
learning-rate tensor). `moved` is the bytes the update must read and write at the least (parameter, gradient and two moments
read; parameter and moments written; fp32), and GB/s that divided by the time.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import graphed_ms  # noqa: E402

from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM  # noqa: E402
from hf_knowgpt.kernels.multi_tensor_adamw import MultiTensorAdamW  # noqa: E402
from hf_knowgpt.training.fast_path import GraphedStepper, clip_and_set_rate  # noqa: E402
from hf_knowgpt.training.optimization import handout_parameter_groups, share_device_learning_rate  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

# Model sizes: the handout recipe's (vocabulary as wiki.txt's), and a width where a step is compute-bound.
MODELS = {
    "handout": dict(vocab_size=257, n_layer=4, n_head=8, n_embd=256, block_size=128),
    "wide": dict(vocab_size=257, n_layer=4, n_head=16, n_embd=1024, block_size=128),
}
STEPS = 15000  # length of the learning-rate table (the handout recipe's 14950 steps)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="handout,wide", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--replays", type=int, default=2000, help="graph replays per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per way; the median is printed")
    return parser.parse_args()


def make_update(way: str, sizes: dict):
    """A fresh model's parameters with fixed gradients, `way`'s update of them, and what to call after each of its
    captures (None: nothing)."""
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(KnowGPTConfig(**sizes)).cuda()
    parameters = [p for p in model.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.AdamW(
        handout_parameter_groups(model, 0.1), lr=6e-3, betas=(0.9, 0.95), fused=True, capturable=True
    )
    learning_rate = share_device_learning_rate(optimizer, "cuda")
    rates = torch.linspace(6e-3, 6e-4, STEPS, device="cuda")
    counter = torch.zeros((), dtype=torch.long, device="cuda")
    if way == "multi-tensor":
        update = MultiTensorAdamW(optimizer, parameters, 1.0, rates, learning_rate)

        def step():
            update.step(counter)
            counter.add_(1)

        after_capture = update.tables_captured  # its table of the gradients' addresses, filled once captured
    else:
        options = GraphedStepper.inductor_options()
        clip = torch.compile(clip_and_set_rate, dynamic=False, options=options)

        def step():
            clip(parameters, 1.0, counter, rates, learning_rate)
            optimizer.step()
            counter.add_(1)

        after_capture = None
    return step, after_capture, sum(p.numel() for p in parameters), len(parameters)


def main():
    args = parse_args()
    from hf_knowgpt.kernels import use_training_matmul_settings

    use_training_matmul_settings()
    rows = []
    for name in args.models.split(","):
        baseline = None
        for way in ("torch", "multi-tensor"):
            step, after_capture, elements, tensors = make_update(way, MODELS[name])
            times = [graphed_ms(step, args.replays, after_capture) for _ in range(args.repeats)]
            milliseconds = statistics.median(times)
            baseline = baseline or milliseconds
            moved = elements * 4 * 7
            rows.append((name, elements, tensors, way, milliseconds, moved, baseline / milliseconds))
            print(f"  {name} {way}: {milliseconds * 1e3:.1f} µs ({', '.join(f'{t * 1e3:.1f}' for t in times)})")
    print(f"\n{describe_device()}, torch {torch.__version__}; device time per update, median of {args.repeats}")
    print("model   | parameters (tensors) | way          |     µs | moved MB |   GB/s | speed-up")
    for name, elements, tensors, way, milliseconds, moved, ratio in rows:
        print(
            f"{name:7} | {elements:>10,} ({tensors:>3}) | {way:12} | {milliseconds * 1e3:6.1f} | {moved / 1e6:8.1f} |"
            f" {moved / milliseconds / 1e6:6.0f} | {ratio:.2f}×"
        )


if __name__ == "__main__":
    main()
