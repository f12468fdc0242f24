#!/usr/bin/env python
"""Time the README's commands as a user waits for them: whole processes, start-up and compilation included.

    python benchmarks/bench_user_path.py --data_dir ../shared/data                 # on a GPU machine
    python benchmarks/bench_user_path.py --startup_only                            # start-up figures (any machine)

On a GPU, in one run:
1. `python scripts/train.py --recipe handout --attention_type vanilla --data_dir DATA --mixed_precision bf16
   --torch_compile` twice: cold (empty TorchInductor and Triton caches, as on a fresh machine) and warm
   (the same caches, a second run on the same machine); then the same run under `accelerate launch
   --mixed_precision bf16` (warm), whose launcher is a process of its own. Command → printed dev accuracy.
2. `scripts/evaluate_checkpoint.py` on the finetuned checkpoint (500 questions).
3. The handouts' loop beside it: the plain path (`--training_path plain`: a DataLoader corrupting one
   document per item, every position computed, unfused attention, fp32) for a few pretraining and
   finetuning epochs through the same command, and the handouts' evaluation (one question at a time, 32
   forward passes without a cache), so its whole recipe is estimated as 650 pretraining epochs + 10
   finetuning epochs + 500 questions.
Always: `import hf_knowgpt`, `scripts/pretrain.py --help` and `scripts/train.py --help`, best of three.
A table is printed last; --output writes JSON.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"


def accelerate_launch(mixed_precision: str) -> list[str]:
    accelerate = shutil.which("accelerate")
    command = [accelerate, "launch"] if accelerate else [sys.executable, "-m", "accelerate.commands.launch"]
    return command + ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", mixed_precision,
                      "--dynamo_backend", "no"]  # fmt: skip


def timed(command, log: Path, env=None) -> tuple[float, str]:
    """Wall seconds of a whole process, as a user waits for it; its output is kept in `log`."""
    print("+ " + " ".join(map(str, command)), flush=True)
    started = time.perf_counter()
    completed = subprocess.run(
        [str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    seconds = time.perf_counter() - started
    log.write_text(completed.stdout)
    if completed.returncode:
        raise RuntimeError(f"exit status {completed.returncode}; output:\n{completed.stdout[-4000:]}")
    return seconds, completed.stdout


def best_of(command, runs=3) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([str(c) for c in command], check=True, capture_output=True, cwd=REPO_ROOT)
        times.append(time.perf_counter() - started)
    return min(times)


def startup_times() -> dict:
    return {
        "import_hf_knowgpt_s": best_of([sys.executable, "-c", "import hf_knowgpt"]),
        "pretrain_help_s": best_of([sys.executable, SCRIPTS / "pretrain.py", "--help"]),
        "train_help_s": best_of([sys.executable, SCRIPTS / "train.py", "--help"]),
    }


def accuracy_line(output: str) -> str:
    lines = re.findall(r"Correct: \d+ out of \d+: [\d.]+%", output)
    return lines[0] if lines else "-"


def handout_evaluation_seconds(checkpoint: Path, dev: Path, questions: int) -> float:
    """The handouts' evaluation loop: one question at a time, greedy, 32 full forward passes without a KV
    cache (their `sample`), on the GPU, in fp32; seconds per question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_knowgpt  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(checkpoint).cuda().eval()
    model.set_attn_implementation("eager")  # the handouts' unfused attention
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lines = dev.read_text(encoding="utf-8").strip("\n").split("\n")[:questions]
    started = time.perf_counter()
    with torch.no_grad():
        for line in lines:
            ids = torch.tensor([tokenizer(line.split("\t")[0] + "⁇")["input_ids"]], device="cuda")
            for _ in range(32):
                logits = model(ids[:, -model.config.block_size :], use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            ids.cpu()  # the handouts decode each answer on the host
    return (time.perf_counter() - started) / len(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="folder with the CS224N files")
    parser.add_argument("--attention_type", default="vanilla")
    parser.add_argument("--plain_epochs", type=int, default=3, help="pretraining epochs of the handouts' loop")
    parser.add_argument("--handout_questions", type=int, default=50, help="questions the handouts' loop answers")
    parser.add_argument("--startup_only", action="store_true", help="only the start-up figures")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--output", default=None, help="write every measurement as JSON here")
    args = parser.parse_args(argv)

    results = {"startup": startup_times()}
    print(json.dumps(results["startup"]), flush=True)
    if not args.startup_only:
        import torch

        results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        work = Path(args.workdir or tempfile.mkdtemp(prefix="knowgpt-user-path-"))
        caches = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton")}
        data = Path(args.data_dir)
        recipe = ["--recipe", "handout", "--attention_type", args.attention_type, "--data_dir", data]
        direct = [sys.executable, SCRIPTS / "train.py", *recipe, "--mixed_precision", "bf16", "--torch_compile"]
        launched = [*accelerate_launch("bf16"), SCRIPTS / "train.py", *recipe, "--torch_compile"]
        runs = (("cold", direct), ("warm", direct), ("warm, accelerate launch", launched))
        for run, command in runs:
            output_dir = work / f"{run.split(',')[0]}-{len(results)}-run"
            command = [*command, "--output_dir", output_dir]
            seconds, output = timed(command, work / f"{output_dir.name}.log", env=caches)
            summary = json.loads((output_dir / "results.json").read_text())
            results[run] = {
                "command": " ".join(map(str, command)),
                "output_dir": str(output_dir),
                "process_s": seconds,
                "accuracy": accuracy_line(output),
                "pretrain_train_s": summary["stages"]["pretrain"]["train_seconds"],
                "pretrain_warmup_s": summary["stages"]["pretrain"]["warmup_seconds"],
                "finetune_train_s": summary["stages"]["finetune"]["train_seconds"],
                "finetune_warmup_s": summary["stages"]["finetune"]["warmup_seconds"],
                "dev_eval_s": summary["dev"]["seconds"],
                "run_recipe_s": summary["seconds_in_run_recipe"],
            }
            print(json.dumps(results[run]), flush=True)
        checkpoint = Path(results["warm"]["output_dir"]) / "finetuned"
        seconds, output = timed(
            [sys.executable, SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint, "--eval_corpus_path",
             data / "birth_dev.tsv", "--outputs_path", work / "evaluate.predictions"],
            work / "evaluate.log",
        )  # fmt: skip
        results["evaluate"] = {"process_s": seconds, "accuracy": accuracy_line(output)}

        plain_dir = work / "plain-run"
        command = [*accelerate_launch("no"), SCRIPTS / "train.py", *recipe, "--training_path", "plain",
                   "--pretrain_max_epochs", args.plain_epochs, "--finetune_max_epochs", 2,
                   "--output_dir", plain_dir]  # fmt: skip
        seconds, _ = timed(command, work / "plain.log")
        per_epoch = {}
        for stage in ("pretrained", "finetuned"):
            marks = json.loads((plain_dir / stage / "train_results.json").read_text())["epoch_seconds"]
            per_epoch[stage] = (marks[-1] - marks[0]) / (len(marks) - 1)  # the first epoch apart (warm-up)
        per_question = handout_evaluation_seconds(checkpoint, data / "birth_dev.tsv", args.handout_questions)
        estimate = 650 * per_epoch["pretrained"] + 10 * per_epoch["finetuned"] + 500 * per_question
        results["handout_loop"] = {
            "command": " ".join(map(str, command)),
            "pretrain_s_per_epoch": per_epoch["pretrained"],
            "finetune_s_per_epoch": per_epoch["finetuned"],
            "evaluation_s_per_question": per_question,
            "recipe_estimate_s": estimate,
        }
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))

    startup = results["startup"]
    print(f"\n{results.get('device', 'start-up only')}; whole processes, as a user waits")
    print(f"{'import hf_knowgpt':<44}{startup['import_hf_knowgpt_s']:>8.2f} s")
    print(f"{'scripts/pretrain.py --help':<44}{startup['pretrain_help_s']:>8.2f} s")
    print(f"{'scripts/train.py --help':<44}{startup['train_help_s']:>8.2f} s")
    if not args.startup_only:
        handout = results["handout_loop"]
        for run in ("cold", "warm", "warm, accelerate launch"):
            row = results[run]
            print(
                f"{'train.py ' + args.attention_type + ' bf16, ' + run:<44}{row['process_s']:>8.1f} s   "
                f"{row['accuracy']}   ({handout['recipe_estimate_s'] / row['process_s']:.1f}× the handouts' loop; "
                f"steps {row['pretrain_train_s'] - row['pretrain_warmup_s']:.1f} s, warm-up {row['pretrain_warmup_s']:.1f} s)"
            )
        print(
            f"{'scripts/evaluate_checkpoint.py, 500 questions':<44}{results['evaluate']['process_s']:>8.1f} s   {results['evaluate']['accuracy']}"
        )
        print(
            f"{'handouts loop (estimate)':<44}{handout['recipe_estimate_s']:>8.1f} s   "
            f"({handout['pretrain_s_per_epoch']:.3f} s/epoch × 650 + {handout['finetune_s_per_epoch']:.3f} × 10 "
            f"+ {1000 * handout['evaluation_s_per_question']:.0f} ms × 500 questions)"
        )
    return results


if __name__ == "__main__":
    main()
