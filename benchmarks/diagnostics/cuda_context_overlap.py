#!/usr/bin/env python
"""What creating the CUDA context on a thread of its own (`hf_knowgpt.utils.cuda_context`) saves a user: the
README's commands as whole processes, with the thread (`KNOWGPT_EARLY_CUDA=1`) and without it (`=0`, as they
run by default), alternating round after round on one GPU; a table printed last.

    python benchmarks/diagnostics/cuda_context_overlap.py --data_dir .data --rounds 3 --output OUT.json

First one `scripts/train.py --recipe handout --attention_type vanilla --mixed_precision bf16 --torch_compile`
fills empty compiler caches of its own and leaves a finetuned checkpoint. Then, each round and each way:
the same command warm (whole process, and its start-up: every phase up to the pretraining stage's first
step, from the marks in `results.json`), `scripts/evaluate_checkpoint.py` on that checkpoint's dev questions
(whole process); and, `--bare_rounds` times each way, a process that only imports torch and the model's
libraries and makes its first CUDA tensor, each part timed inside it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_knowgpt.utils.timeline import phase_seconds

REPO_ROOT = Path(__file__).resolve().parents[2]
WAYS = {"thread": "1", "inline": "0"}
# The start of every command, timed inside the process: torch, the model's libraries, the first CUDA tensor.
BARE = """
import json, time
started = time.perf_counter()
from hf_knowgpt.utils import cuda_context
cuda_context.start_cuda_context()
import torch
torch_imported = time.perf_counter()
import hf_knowgpt.modeling_knowgpt
libraries_imported = time.perf_counter()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
print(json.dumps({"torch_s": torch_imported - started, "libraries_s": libraries_imported - torch_imported,
                  "first_tensor_s": time.perf_counter() - libraries_imported}))
"""
STARTUP_END = "pretrain: device set up, corpus read, model built, examples encoded"


def timed(command, env):
    started = time.time()
    subprocess.run(command, check=True, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return started, time.time()


def bare_start(env) -> dict:
    started = time.time()
    output = subprocess.run([sys.executable, "-c", BARE], check=True, env=env, cwd=REPO_ROOT, capture_output=True)
    return {"process_s": time.time() - started, **json.loads(output.stdout.decode().strip().splitlines()[-1])}


def train_command(data_dir, output_dir):
    return [
        sys.executable, "scripts/train.py", "--recipe", "handout", "--attention_type", "vanilla",
        "--data_dir", str(data_dir), "--mixed_precision", "bf16", "--torch_compile", "--output_dir", str(output_dir),
    ]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of train.py and evaluate_checkpoint.py")
    parser.add_argument("--bare_rounds", type=int, default=6, help="rounds of the imports-only process")
    parser.add_argument("--output", default=None, help="write the runs as JSON here")
    args = parser.parse_args()
    data_dir = args.data_dir.resolve()
    work = Path(tempfile.mkdtemp(prefix="knowgpt-cuda-context-"))
    env = {name: str(work / name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KNOWGPT_COMPILE_CACHE")}
    env = {**os.environ, **env}
    started, ended = timed(train_command(data_dir, work / "cold"), env)
    print(f"cold train.py (fills the caches): {ended - started:.1f} s", flush=True)
    checkpoint = work / "cold" / "finetuned"
    runs = []
    for round_index in range(args.rounds):
        for way, flag in WAYS.items():
            way_env = {**env, "KNOWGPT_EARLY_CUDA": flag}
            output_dir = work / f"{way}-{round_index}"
            started, ended = timed(train_command(data_dir, output_dir), way_env)
            summary = json.loads((output_dir / "results.json").read_text())
            phases = phase_seconds(started, summary["timeline"], ended)
            labels = [label for label, _ in phases]
            startup = sum(seconds for _, seconds in phases[: labels.index(STARTUP_END) + 1])
            evaluate = [
                sys.executable, "scripts/evaluate_checkpoint.py", "--model_name_or_path", str(checkpoint),
                "--eval_corpus_path", str(data_dir / "birth_dev.tsv"), "--outputs_path", str(output_dir / "dev.txt"),
            ]  # fmt: skip
            eval_started, eval_ended = timed(evaluate, way_env)
            runs.append(
                {
                    "way": way,
                    "round": round_index,
                    "train_s": ended - started,
                    "train_startup_s": startup,
                    "phases": phases,
                    "evaluate_s": eval_ended - eval_started,
                    "dev_accuracy": summary["dev"]["accuracy"],
                }
            )
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "phases"}), flush=True)
    bare = []
    for round_index in range(args.bare_rounds):
        for way, flag in WAYS.items():
            bare.append({"way": way, "round": round_index, **bare_start({**env, "KNOWGPT_EARLY_CUDA": flag})})
            print(json.dumps(bare[-1]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"commands": runs, "imports_only": bare}, indent=2))
    print(f"\n{'way':<8}{'round':>6}{'evaluate s':>12}{'train start-up s':>18}{'train s':>9}")
    for run in runs:
        print(
            f"{run['way']:<8}{run['round']:>6}{run['evaluate_s']:>12.2f}{run['train_startup_s']:>18.2f}{run['train_s']:>9.1f}"
        )
    print(f"\n{'way':<8}{'round':>6}{'import torch s':>16}{'libraries s':>13}{'first tensor s':>16}{'process s':>11}")
    for run in bare:
        print(
            f"{run['way']:<8}{run['round']:>6}{run['torch_s']:>16.2f}{run['libraries_s']:>13.2f}"
            f"{run['first_tensor_s']:>16.2f}{run['process_s']:>11.2f}"
        )


if __name__ == "__main__":
    main()
