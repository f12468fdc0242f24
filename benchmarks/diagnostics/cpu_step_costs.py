#!/usr/bin/env python
"""Costs inside a CPU training step of the quickstart's model (2 layers × 128, rope), side by side in one
process, medians printed last:

    python benchmarks/diagnostics/cpu_step_costs.py [--rounds 10]

1. a dropout mask for a (2560, 128) activation: `nn.Dropout` (PyTorch's Bernoulli draws) against
   `KnowGPTDropout` (16-bit uniforms cut from 64-bit draws);
2. one AdamW step over the model's parameters: for-loop, `foreach`, fused;
3. whole training steps (16 rows of 150 characters, forward, backward, AdamW), the model's dropouts
   switched between the two kinds every 15 steps, alternating so that the machine's drift hits both;
4. the same steps in fp32 against bf16 autocast (the model's own dropouts), alternating the same way;
5. the same steps with rope's rotation as the model does it eagerly (one complex product) against the
   real arithmetic (four products, two sums and a stack, what it compiles to), alternating the same way;
6. the same steps through `torch.compile` (inductor's C++ kernels) against eager, alternating the same way,
   after the first compiled step, whose time (the compilation) is printed too;
7. packed steps under bf16 autocast, 16 rows of the lengths of a quickstart batch (longest first, as the
   trainer orders them), attention in one grid against group by group of rows (`attention_by_length`) in
   2 to 5 groups (`LENGTH_GROUPS`), alternating the same way.
"""

import argparse
import statistics
import time

import torch
from torch import nn

from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM, attention_knowgpt
from hf_knowgpt.layers_knowgpt import KnowGPTDropout
from hf_knowgpt.training.optimization import handout_parameter_groups


def milliseconds(function, repeats: int, rounds: int) -> float:
    """Median over `rounds` of the mean time of `repeats` calls, after a warm-up."""
    for _ in range(3):
        function()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            function()
        times.append((time.perf_counter() - started) / repeats * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []

    activation = torch.randn(2560, 128)
    for name, dropout in (("nn.Dropout(0.1)", nn.Dropout(0.1)), ("KnowGPTDropout(0.1)", KnowGPTDropout(0.1))):
        cost = milliseconds(lambda dropout=dropout: dropout(activation), 50, args.rounds)
        rows.append((f"dropout of a (2560, 128) activation, {name}", cost))

    config = KnowGPTConfig(vocab_size=100, n_layer=2, n_head=4, n_embd=128, block_size=160, attention_type="rope",
                           embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.0)  # fmt: skip
    model = KnowGPTForCausalLM(config).train()
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    for name, options in (
        ("for-loop", dict(foreach=False)),
        ("foreach", dict(foreach=True)),
        ("fused", dict(fused=True)),
    ):
        optimizer = torch.optim.AdamW(handout_parameter_groups(model, 0.1), lr=1e-3, **options)
        rows.append((f"AdamW step, {name}", milliseconds(optimizer.step, 50, args.rounds)))

    optimizer = torch.optim.AdamW(handout_parameter_groups(model, 0.1), lr=1e-3, fused=True)
    ids = torch.randint(0, 100, (16, 150))

    def step(autocast: bool = False, forward=model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step_times = {nn.Dropout: [], KnowGPTDropout: []}
    for _ in range(args.rounds):
        for kind in step_times:
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.__class__ = kind
            step_times[kind].append(milliseconds(step, 15, 1))
    for kind, times in step_times.items():
        rows.append((f"training step, model dropouts {kind.__name__}", statistics.median(times)))
    precision_times = {False: [], True: []}
    for _ in range(args.rounds):
        for autocast in precision_times:
            precision_times[autocast].append(milliseconds(lambda autocast=autocast: step(autocast), 15, 1))
    for autocast, times in precision_times.items():
        rows.append((f"training step, {'bf16 autocast' if autocast else 'fp32'}", statistics.median(times)))

    rotations = {
        "complex product": attention_knowgpt.apply_rotary,
        "real arithmetic": attention_knowgpt.rotary_by_real_arithmetic,
    }
    rotary_times = {name: [] for name in rotations}
    for _ in range(args.rounds):
        for name, rotation in rotations.items():
            attention_knowgpt.apply_rotary = rotation
            rotary_times[name].append(milliseconds(step, 15, 1))
    attention_knowgpt.apply_rotary = rotations["complex product"]
    for name, times in rotary_times.items():
        rows.append((f"training step, rope rotation by {name}", statistics.median(times)))

    compiled = torch.compile(model, dynamic=False)
    started = time.perf_counter()
    step(forward=compiled)
    rows.append(("first compiled training step (compilation included)", (time.perf_counter() - started) * 1e3))
    compile_times = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, forward in (("eager", model), ("compiled", compiled)):
            compile_times[name].append(milliseconds(lambda forward=forward: step(forward=forward), 15, 1))
    for name, times in compile_times.items():
        rows.append((f"training step, {name}", statistics.median(times)))

    # lengths of a quickstart batch: 89 tokens on average, the longest 125 (its first 60 batches: median 81)
    lengths = torch.tensor([125, 119, 113, 109, 104, 96, 88, 82, 80, 76, 72, 70, 69, 67, 67, 66])
    token_index = torch.cat([row * 125 + torch.arange(int(n)) for row, n in enumerate(lengths)])
    packed_ids = torch.randint(0, 100, (16, 125))

    def packed_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=packed_ids, labels=packed_ids, token_index=token_index, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    arms = {"in one grid": None, **{f"in {groups} groups of rows": groups for groups in (2, 3, 4, 5)}}
    grouping_times, default_groups = {name: [] for name in arms}, attention_knowgpt.LENGTH_GROUPS
    for _ in range(args.rounds):
        for name, groups in arms.items():
            model.transformer.attention_by_length = groups is not None
            attention_knowgpt.LENGTH_GROUPS = groups or default_groups
            grouping_times[name].append(milliseconds(packed_step, 15, 1))
    model.transformer.attention_by_length, attention_knowgpt.LENGTH_GROUPS = False, default_groups
    for name, times in grouping_times.items():
        rows.append((f"packed bf16 training step, attention {name}", statistics.median(times)))

    print(f"\n{'CPU, ' + str(torch.get_num_threads()) + ' threads':<64}{'ms (median)':>12}")
    for name, value in rows:
        print(f"{name:<64}{value:>12.2f}")


if __name__ == "__main__":
    main()
