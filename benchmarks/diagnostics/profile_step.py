#!/usr/bin/env python
"""Where a training step's device time goes: `scripts/train.py` with the given flags, its optimizer steps 20–40
under `torch.profiler` (CUDA kernels on a GPU), the kernels' table sorted by device time printed after the
run's own output. Use `--training_path eager` on a GPU: inside a replayed CUDA graph the profiler sees one
launch, not its kernels; the eager step runs the same kernels, launched one by one.

    python benchmarks/diagnostics/profile_step.py --recipe handout --attention_type vanilla --data_dir .data \\
        --mixed_precision bf16 --training_path eager --pretrain_max_epochs 3 --no_do_finetune --output_dir /tmp/p
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hf_knowgpt.commands import cli, train
from hf_knowgpt.training import trainer

FIRST, LAST = 20, 40
optimizer_step = trainer.KnowGPTTrainer.optimizer_step
state = {"steps": 0, "profiler": None}


def profiled_step(self, *args, **kwargs):
    state["steps"] += 1
    if state["steps"] == FIRST:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        state["profiler"] = profile(activities=activities)
        state["profiler"].__enter__()
    loss = optimizer_step(self, *args, **kwargs)
    if state["steps"] == LAST:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        state["profiler"].__exit__(None, None, None)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        table = state["profiler"].key_averages().table(sort_by=f"self_{device}_time_total", row_limit=30)
        print(f"\nsteps {FIRST}–{LAST} ({LAST - FIRST + 1} steps):\n{table}", flush=True)
    return loss


trainer.KnowGPTTrainer.optimizer_step = profiled_step
if __name__ == "__main__":
    sys.argv = ["train.py", *sys.argv[1:]]
    cli.main_guard(train.main)
