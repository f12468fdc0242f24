#!/usr/bin/env python
"""The handouts' recipe through the scripts on one GPU and on several (`accelerate launch --num_processes N`),
one after the other on the same machine. Prints a table last.

    python benchmarks/bench_processes.py --data_dir .data --processes 1,2,4 --mixed_precision bf16
    python benchmarks/bench_processes.py --data_dir .data --processes 1,2,4 --mixed_precision bf16 \
        --pretrain_args "--n_embd 512 --n_head 8" --epochs 100 --pretrain_only

For each attention type and process count it runs, as a user would, `accelerate launch scripts/pretrain.py`
(650 epochs of wiki.txt unless --epochs), `accelerate launch scripts/finetune.py` (10 epochs) with the same
number of processes, then `scripts/evaluate_checkpoint.py` on birth_dev.tsv (`--pretrain_only`: the
pretraining alone, for model sizes the handouts do not finetune), and reports each stage's wall time, the
pretraining's training seconds with and without warm-up (graph capture and compilation), its speedup over
the first process count, the loss at a few steps (same global batches and semantics: the curves should agree
up to rounding) and the dev accuracy. Every process count is timed on the same machine in the same run.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSS_STEPS = (1400, 2300, 4600, 9000, 14949)


def launch(processes: int, mixed_precision: str, script: Path, *arguments) -> list[str]:
    """`script` with `arguments` under accelerate's launcher, `processes` processes (one GPU each), as the README
    writes it: `accelerate launch [--multi_gpu] --num_processes N --num_machines 1 --mixed_precision P
    --dynamo_backend no`. The launcher is this python's environment's (its `accelerate` script, as an activated
    virtual environment finds it, else the module): one found elsewhere on PATH would run another python's packages."""
    accelerate = Path(sys.executable).with_name("accelerate")
    command = (
        [str(accelerate), "launch"] if accelerate.is_file() else [sys.executable, "-m", "accelerate.commands.launch"]
    )
    command += ["--multi_gpu"] * (processes > 1) + ["--num_processes", str(processes), "--num_machines", "1"]
    command += ["--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    return [*command, str(script), *map(str, arguments)]


def timed(command: list[str], log: Path) -> tuple[float, str]:
    """Run a command (its output to `log` and back to the caller); wall seconds, including interpreter start."""
    started = time.perf_counter()
    with log.open("w") as sink:
        completed = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    text = log.read_text()
    if completed.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({completed.returncode}); its output:\n{text[-4000:]}")
    return seconds, text


def loss_at(curve: list[dict], step: int) -> float | None:
    """Mean of the logged losses over the 50 steps before `step` (the log is every 50 steps); None past the run."""
    before = [point for point in curve if point["step"] <= step]
    return before[-1]["loss"] if before and step <= curve[-1]["step"] else None


def run_one(args, attention_type: str, processes: int, work: Path) -> dict:
    data = Path(args.data_dir)
    pretrained, finetuned = (
        work / f"{attention_type}-{processes}-pretrain",
        work / f"{attention_type}-{processes}-finetune",
    )
    common = ["--seed", args.seed, "--overwrite_output_dir"] + (["--torch_compile"] if args.torch_compile else [])
    epochs = ["--max_epochs", args.epochs] if args.epochs else []
    finetune_epochs = ["--max_epochs", args.finetune_epochs] if args.finetune_epochs else []
    pretrain_seconds, _ = timed(
        launch(processes, args.mixed_precision, ROOT / "scripts" / "pretrain.py", "--attention_type", attention_type,
               "--pretrain_corpus_path", data / "wiki.txt", "--output_dir", pretrained, *epochs, *common,
               *shlex.split(args.pretrain_args)),
        work / f"{attention_type}-{processes}-pretrain.log",
    )  # fmt: skip
    results = json.loads((pretrained / "train_results.json").read_text())
    row = {
        "attention_type": attention_type,
        "processes": processes,
        "pretrain_args": args.pretrain_args,
        "device": results["device"],
        "num_processes": results["num_processes"],
        "mixed_precision": results["mixed_precision"],
        "steps": results["global_step"],
        "pretrain_wall_s": pretrain_seconds,
        "pretrain_train_s": results["train_seconds"],
        "pretrain_warmup_s": results["warmup_seconds"],
        "pretrain_steps_s": results["train_seconds"] - results["warmup_seconds"],
        "final_loss": results["final_loss"],
        "loss_at": {step: loss_at(results["loss_curve"], step) for step in LOSS_STEPS},
        "finetune_wall_s": None,
        "finetune_train_s": None,
        "evaluate_wall_s": None,
        "dev_correct": None,
        "dev_total": None,
    }
    if args.pretrain_only:
        return row
    finetune_seconds, _ = timed(
        launch(processes, args.mixed_precision, ROOT / "scripts" / "finetune.py", "--model_name_or_path", pretrained,
               "--pretrain_corpus_path", data / "wiki.txt", "--finetune_corpus_path",
               data / "birth_places_train.tsv", "--output_dir", finetuned, *finetune_epochs, *common),
        work / f"{attention_type}-{processes}-finetune.log",
    )  # fmt: skip
    evaluate_seconds, output = timed(
        [sys.executable, str(ROOT / "scripts" / "evaluate_checkpoint.py"), "--model_name_or_path", str(finetuned),
         "--eval_corpus_path", str(data / "birth_dev.tsv"), "--outputs_path", str(work / f"{finetuned.name}.dev")],
        work / f"{attention_type}-{processes}-evaluate.log",
    )  # fmt: skip
    correct = re.search(r"Correct: (\d+) out of (\d+)", output)
    finetune_results = json.loads((finetuned / "train_results.json").read_text())
    row.update(
        finetune_wall_s=finetune_seconds,
        finetune_train_s=finetune_results["train_seconds"],
        evaluate_wall_s=evaluate_seconds,
        dev_correct=int(correct.group(1)) if correct else None,
        dev_total=int(correct.group(2)) if correct else None,
    )
    return row


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="folder holding the CS224N files")
    parser.add_argument("--processes", default="1,2", help="process counts (one GPU each), the first is the baseline")
    parser.add_argument("--attention_types", default="vanilla")
    parser.add_argument("--mixed_precision", default="bf16", choices=["no", "bf16"])
    parser.add_argument("--torch_compile", action="store_true", help="compile the model inside the graphed step")
    parser.add_argument("--epochs", type=int, default=None, help="pretraining epochs (default: the recipe's 650)")
    parser.add_argument("--finetune_epochs", type=int, default=None, help="finetuning epochs (default: 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pretrain_args", default="", help='more flags for pretrain.py, e.g. "--n_embd 512 --n_head 8"'
    )
    parser.add_argument("--pretrain_only", action="store_true", help="time the pretraining alone")
    parser.add_argument("--work_dir", default="outputs/bench_processes")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    rows = []
    for attention_type in args.attention_types.split(","):
        for processes in map(int, args.processes.split(",")):
            rows.append(run_one(args, attention_type, processes, work))
            print(json.dumps(rows[-1]), flush=True)
            if args.output:
                Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")

    print(
        f"\n{rows[0]['device']}, {rows[0]['mixed_precision']}, torch.compile {args.torch_compile}, "
        f"pretrain.py flags {args.pretrain_args or 'none'}"
    )
    header = (
        f"{'attention':<12}{'procs':>6}{'pretrain wall s':>16}{'train s':>9}{'warm-up s':>10}{'steps s':>9}"
        f"{'speedup':>8}{'finetune wall s':>16}{'eval wall s':>12}  {'loss @1400/2300/4600/9000/end':<32}{'dev':>7}"
    )
    print(header)
    baseline = {}
    for row in rows:
        base = baseline.setdefault(row["attention_type"], row["pretrain_steps_s"])
        losses = "/".join(f"{row['loss_at'][step]:.2f}" for step in LOSS_STEPS if row["loss_at"][step] is not None)
        dev = f"{100 * row['dev_correct'] / row['dev_total']:.1f}%" if row["dev_total"] else "-"
        print(
            f"{row['attention_type']:<12}{row['processes']:>6}{row['pretrain_wall_s']:>16.1f}"
            f"{row['pretrain_train_s']:>9.1f}{row['pretrain_warmup_s']:>10.1f}{row['pretrain_steps_s']:>9.1f}"
            f"{base / row['pretrain_steps_s']:>7.2f}×{seconds(row['finetune_wall_s']):>16}"
            f"{seconds(row['evaluate_wall_s']):>12}"
            f"  {losses:<32}{dev:>7}"
        )


if __name__ == "__main__":
    main()
