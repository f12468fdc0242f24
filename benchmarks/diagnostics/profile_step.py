#!/usr/bin/env python
"""Where a training step's device time goes: `scripts/train.py` with the given flags, its optimizer steps 20–40
under `torch.profiler` (CUDA kernels on a GPU), the kernels' table sorted by device time printed after the
run's own output. Inside a replayed CUDA graph the profiler sees one launch, not its kernels, so on the
graphed path (`--training_path auto` on a GPU, compiled or not) the profiled steps run the captured step's
body directly: the same kernels, compiled ones included, launched one by one.

    python benchmarks/diagnostics/profile_step.py --recipe handout --attention_type vanilla --data_dir .data \\
        --mixed_precision bf16 --torch_compile --pretrain_max_epochs 3 --no_do_finetune --output_dir /tmp/p
"""

import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hf_knowgpt.commands import cli, train
from hf_knowgpt.training import fast_path, trainer

FIRST, LAST = 20, 40
# CUDA kernels by what they do, first match wins (names as cuBLAS, inductor and hf_knowgpt.kernels give them)
KERNEL_KINDS = (
    (
        "attention (hf_knowgpt fused kernel)",
        r"_forward_kernel|_correction_kernel|_backward_kernel|attention|flash|fmha",
    ),
    ("matrix products (cuBLAS)", r"nvjet|cutlass|gemm|splitK|cublas"),
    ("optimizer and clipping (fused AdamW, foreach norms)", r"adam|multi_tensor|foreach"),
    ("inductor's fused kernels", r"^triton_"),
    ("memory copies and fills", r"Memcpy|Memset|copy|fill"),
)
optimizer_step = trainer.KnowGPTTrainer.optimizer_step
graphed_run = fast_path.GraphedStepper.run
state = {"steps": 0, "profiler": None}


def start():
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    state["profiler"] = profile(activities=activities)
    state["profiler"].__enter__()


def stop():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    state["profiler"].__exit__(None, None, None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    averages = state["profiler"].key_averages()
    table = averages.table(sort_by=f"self_{device}_time_total", row_limit=40)
    steps = LAST - FIRST + 1
    print(f"\nsteps {FIRST}–{LAST} ({steps} steps):\n{table}", flush=True)
    if device == "cuda":
        kernels = [
            event
            for event in state["profiler"].events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False)  # ranges such as Optimizer.step, not kernels
        ]
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"device kernels per step: {len(kernels) / steps:.0f}, their time per step: {busy / steps:.3f} ms")
        shares, others = {}, {}  # kind / name of an "other" kernel -> (count, milliseconds)

        def add(table, key, milliseconds):
            count, total = table.get(key, (0, 0.0))
            table[key] = (count + 1, total + milliseconds)

        for kernel in kernels:
            kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, kernel.name, re.I)), "other")
            add(shares, kind, kernel.device_time / 1e3)
            if kind == "other":
                add(others, kernel.name, kernel.device_time / 1e3)
        for kind, (count, milliseconds) in sorted(shares.items(), key=lambda item: -item[1][1]):
            print(
                f"  {kind:<52}{count / steps:>6.0f} kernels{milliseconds / steps:>9.3f} ms{milliseconds / busy:>7.0%}"
            )
        print("the 'other' kernels:")
        for name, (count, milliseconds) in sorted(others.items(), key=lambda item: -item[1][1])[:20]:
            print(f"  {name[:100]:<100}{count / steps:>6.1f} per step{milliseconds / steps:>9.4f} ms")


def profiled_step(self, *args, **kwargs):
    state["steps"] += 1
    if state["steps"] == FIRST:
        start()
    loss = optimizer_step(self, *args, **kwargs)
    if state["steps"] == LAST:
        stop()
    return loss


def profiled_graphed_run(self, first_step, count, should_stop):
    """Steps FIRST–LAST run the captured body outside its graph (fresh gradients, as the capture had)."""
    if first_step + count <= FIRST or first_step > LAST:
        return graphed_run(self, first_step, count, should_stop)
    for global_step in range(first_step, first_step + count):
        if not FIRST <= global_step + 1 <= LAST:
            graphed_run(self, global_step, 1, should_stop)
            continue
        capacity = self._prepare_packed(global_step) if self.packed else None
        if capacity not in self.graphs:
            self.capture(global_step, capacity)
        if global_step + 1 == FIRST:
            start()
        self.optimizer.zero_grad(set_to_none=True)
        self._body(capacity)
        if global_step + 1 == LAST:
            stop()
    return count


trainer.KnowGPTTrainer.optimizer_step = profiled_step
fast_path.GraphedStepper.run = profiled_graphed_run
if __name__ == "__main__":
    sys.argv = ["train.py", *sys.argv[1:]]
    cli.main_guard(train.main)
