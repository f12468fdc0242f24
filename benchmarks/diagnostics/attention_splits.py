#!/usr/bin/env python
"""The fused attention kernel's fp32 emulation (`fused_attention.DEFAULT_SPLITS`: bf16 parts per fp32
operand, 3 by default) against fewer parts: the whole `scripts/train.py` command, one process per run, splits
alternating within each seed so that the machine's drift hits both; a table of dev accuracy, pretraining
steps and the whole process printed last.

    python benchmarks/diagnostics/attention_splits.py --splits 3,1 --seeds 0,1,2 --output OUT.json -- \\
        --recipe handout --attention_type vanilla --data_dir .data --mixed_precision bf16 --torch_compile

Each run is `scripts/train.py` with the flags after `--`, its own `--seed` and `--output_dir`, the kernel's
default parts set before the command starts (`--run_one`).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(splits: int, train_args: list[str]) -> None:
    from hf_knowgpt.commands import cli, train
    from hf_knowgpt.kernels import fused_attention

    fused_attention.DEFAULT_SPLITS = splits
    sys.argv = ["train.py", *train_args]
    cli.run_script(train.main)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", default="3,1", help="parts per fp32 operand to compare, in order")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--output", default=None, help="write the runs as JSON here")
    parser.add_argument("--run_one", type=int, default=None, help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args()
    train_args = [a for a in train_args if a != "--"]
    if args.run_one is not None:
        return run_one(args.run_one, train_args)
    work = Path(tempfile.mkdtemp(prefix="knowgpt-splits-"))
    runs = []
    for seed in args.seeds.split(","):
        for splits in args.splits.split(","):
            output_dir = work / f"splits{splits}-seed{seed}"
            command = [sys.executable, __file__, "--run_one", splits, *train_args, "--seed", seed]
            command += ["--output_dir", str(output_dir)]
            started = time.perf_counter()
            subprocess.run(command, check=True)
            seconds = time.perf_counter() - started
            summary = json.loads((output_dir / "results.json").read_text())
            pretrain = summary["stages"]["pretrain"]
            runs.append(
                {
                    "splits": int(splits),
                    "seed": int(seed),
                    "process_s": seconds,
                    "pretrain_steps_s": pretrain["train_seconds"] - pretrain["warmup_seconds"],
                    "final_loss": pretrain["final_loss"],
                    "dev_accuracy": summary["dev"]["accuracy"],
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(runs, indent=2))
    print(f"\n{'splits':>6}{'seed':>6}{'dev %':>8}{'final loss':>12}{'pretraining steps s':>22}{'process s':>12}")
    for run in runs:
        print(
            f"{run['splits']:>6}{run['seed']:>6}{100 * run['dev_accuracy']:>8.1f}{run['final_loss']:>12.3f}"
            f"{run['pretrain_steps_s']:>22.1f}{run['process_s']:>12.1f}"
        )


if __name__ == "__main__":
    main()
