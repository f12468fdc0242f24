#!/usr/bin/env python
"""Time the README's commands as a user waits for them: whole processes, start-up and compilation included.

    python benchmarks/bench_user_path.py --data_dir ../shared/data                 # on a GPU machine
    python benchmarks/bench_user_path.py --startup_only                            # start-up figures (any machine)

On a GPU, in one run:
1. The README's `python scripts/train.py --recipe handout --attention_type vanilla --data_dir DATA
   --mixed_precision bf16 --torch_compile auto`, cold (empty TorchInductor, Triton and package caches, as on a
   fresh machine: it trains uncompiled while a background process compiles for the next run, which waits for
   that process to end; the wait is recorded) and warm (the caches the run before left), beside the same
   command not compiled (cold) and with `--torch_compile` (cold and warm). Command → printed dev accuracy.
   --runs picks others: not compiled and warm, with or without `--fused_layers`; compiled with one compile
   thread (no pool of compile workers to start and stop); compiled with empty compiler caches but the
   artifacts the package saved from an earlier compiled run (`compiled-cold-saved-artifacts`: a new machine
   or container given ~/.cache/hf_knowgpt); compiled under `accelerate launch --mixed_precision bf16`
   (warm), whose launcher is a process of its own; with `--tune_kernels` added, compiled (`tuned-cold`,
   `tuned-warm`) or `auto` (`auto-tuned-cold`, `auto-tuned-warm`). With --processes N (N > 1) every run is the
   README's several-GPU command instead, `accelerate launch --multi_gpu --num_processes N --num_machines 1
   --mixed_precision bf16 --dynamo_backend no scripts/train.py ...` with the same flags but bf16, which the
   launcher gives: one process per GPU, timed as a user waits for the launcher.
2. `scripts/evaluate_checkpoint.py` on the finetuned checkpoint (500 questions).
3. The handouts' own loop beside it (benchmarks/handout_loop.py: their model arithmetic, trainer and
   evaluation re-stated), a few epochs and questions timed as a whole process and the rest of their
   recipe (650 pretraining epochs, 10 finetuning epochs, 500 questions) added at the measured rates, or
   their whole recipe with --handout_epochs all.
Run it with the python of `benchmarks/pip_environment.py` to time what `pip install -e .` installs and nothing
more on a machine whose image has more (transformers imports scipy and torchvision when they are there); the
JSON and the table name the python and which of those packages it could import.
The table ends with where a run's seconds go: start-up, imports, data, the training loop's set-up, loading what
earlier runs compiled, compilation and capture, steps, saving, evaluation and exit, from the marks train.py writes
into results.json (`timeline`) and each stage's `setup_seconds`, `load_seconds` and `warmup_seconds`; the
evaluation's line, where its seconds go, from the marks it writes to `$KNOWGPT_TIMELINE_FILE`.
Always: `import hf_knowgpt`, `scripts/pretrain.py --help` and `scripts/train.py --help`, best of three.
A table is printed last; --output writes JSON.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_processes import launch  # benchmarks/ is not a package: this script's folder is on the path

from hf_knowgpt.utils.timeline import phase_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
RUNS = (
    "compiled-cold",
    "compiled-cold-saved-artifacts",
    "compiled-warm",
    "compiled-warm-one-compile-thread",
    "compiled-warm-accelerate-launch",
    "uncompiled-cold",
    "uncompiled-warm",
    "uncompiled-cold-fused-layers",
    "uncompiled-warm-fused-layers",
    "auto-cold",
    "auto-warm",
    "tuned-cold",
    "tuned-warm",
    "auto-tuned-cold",
    "auto-tuned-warm",
)
DEFAULT_RUNS = ("uncompiled-cold", "auto-cold", "auto-warm", "compiled-cold", "compiled-warm")
# The compiler's caches, and the package's copy of what a compiled run compiled (hf_knowgpt.training.compile_cache).
CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KNOWGPT_COMPILE_CACHE")


def wait_for_background_compiles(folder: Path, timeout: float = 600.0) -> float:
    """Seconds waited until no background compile (`--torch_compile auto`) holds a lock in `folder`."""
    started = time.perf_counter()
    while any(folder.glob("*.compiling")) and time.perf_counter() - started < timeout:
        time.sleep(0.2)
    return time.perf_counter() - started


def train_commands(recipe: list, processes: int = 1) -> dict[str, list]:
    """Each of RUNS as the command it runs: `python scripts/train.py RECIPE --mixed_precision bf16 ...` on one
    process, the README's several-GPU command (`accelerate launch --multi_gpu ...`, bf16 from the launcher) on
    `processes` > 1."""
    launched = launch(processes, "bf16", SCRIPTS / "train.py", *recipe)
    direct = (
        launched if processes > 1 else [sys.executable, SCRIPTS / "train.py", *recipe, "--mixed_precision", "bf16"]
    )
    return {
        "compiled-cold": [*direct, "--torch_compile"],
        "compiled-cold-saved-artifacts": [*direct, "--torch_compile"],
        "compiled-warm": [*direct, "--torch_compile"],
        "compiled-warm-one-compile-thread": [*direct, "--torch_compile"],
        "compiled-warm-accelerate-launch": [*launched, "--torch_compile"],
        "uncompiled-cold": direct,
        "uncompiled-warm": direct,
        "uncompiled-cold-fused-layers": [*direct, "--fused_layers"],
        "uncompiled-warm-fused-layers": [*direct, "--fused_layers"],
        "auto-cold": [*direct, "--torch_compile", "auto"],
        "auto-warm": [*direct, "--torch_compile", "auto"],
        "tuned-cold": [*direct, "--torch_compile", "--tune_kernels"],
        "tuned-warm": [*direct, "--torch_compile", "--tune_kernels"],
        "auto-tuned-cold": [*direct, "--torch_compile", "auto", "--tune_kernels"],
        "auto-tuned-warm": [*direct, "--torch_compile", "auto", "--tune_kernels"],
    }


def timed(command, log: Path, env=None, clock: dict | None = None) -> tuple[float, str]:
    """Wall seconds of a whole process, as a user waits for it; its output is kept in `log`, and its start
    and end on the wall clock in `clock` (for hf_knowgpt.utils.timeline's marks)."""
    print("+ " + " ".join(map(str, command)), flush=True)
    started, wall_started = time.perf_counter(), time.time()
    completed = subprocess.run(
        [str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if clock is not None:
        clock.update(started=wall_started, ended=time.time())
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


# Packages the README's install does not bring that transformers imports when present (scipy's optimizers and
# torchvision, for its object-detection losses) or that GPU images often carry (scikit-learn).
EXTRA_PACKAGES = ("scipy", "torchvision", "sklearn")
# The stack whose versions a result names: a figure holds for these versions, which a fresh install moves on.
STACK = ("torch", "triton", "transformers", "accelerate", "tokenizers", "huggingface_hub", "safetensors", "datasets")


def environment() -> dict:
    """The python that runs the commands, which of EXTRA_PACKAGES it can import and the versions of STACK."""
    present = [name for name in EXTRA_PACKAGES if importlib.util.find_spec(name) is not None]
    versions = {}
    for name in STACK:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": sys.executable, "prefix": sys.prefix, "extra_packages_present": present, "versions": versions}


def last_finetuned_checkpoint(work: Path, parser: argparse.ArgumentParser) -> Path:
    """The finetuned checkpoint of the last `train.py` run in a workdir of this script (`run-N/finetuned`); where
    there is none, the diagnostic's `parser` exits saying so."""
    runs = sorted(work.glob("run-*/finetuned"), key=lambda path: int(path.parent.name.split("-")[1]))
    if not runs:
        parser.error(f"{work} holds no run-*/finetuned checkpoint: run bench_user_path.py with --workdir {work} first")
    return runs[-1]


def startup_times() -> dict:
    return {
        "import_hf_knowgpt_s": best_of([sys.executable, "-c", "import hf_knowgpt"]),
        "pretrain_help_s": best_of([sys.executable, SCRIPTS / "pretrain.py", "--help"]),
        "train_help_s": best_of([sys.executable, SCRIPTS / "train.py", "--help"]),
    }


def accuracy_line(output: str) -> str:
    lines = re.findall(r"Correct: \d+ out of \d+: [\d.]+%", output)
    return lines[0] if lines else "-"


def handout_loop(data: Path, attention_type: str, work: Path, epochs: tuple[int, int, int] | None) -> dict:
    """The handouts' own loop (benchmarks/handout_loop.py) as a whole process: their whole recipe when
    `epochs` is None, else (pretraining epochs, finetuning epochs, questions) and the rest of their recipe
    (650 epochs, 10 epochs, 500 questions) added at the per-epoch and per-question times it measured, the
    first epoch of each stage (worker start-up, CUDA warm-up) counted once as it would be."""
    command = [sys.executable, REPO_ROOT / "benchmarks" / "handout_loop.py", "--data_dir", data,
               "--attention_type", attention_type, "--output_dir", work / "handout-loop"]  # fmt: skip
    if epochs:
        command += ["--pretrain_epochs", epochs[0], "--finetune_epochs", epochs[1], "--questions", epochs[2]]
    seconds, output = timed(command, work / "handout-loop.log")
    measured = json.loads(output.strip().split("\n")[-1])
    later_pretrain, later_finetune = measured["pretrain_epoch_s"][1:], measured["finetune_epoch_s"][1:]
    remaining = (
        (650 - len(measured["pretrain_epoch_s"])) * sum(later_pretrain) / len(later_pretrain)
        + (10 - len(measured["finetune_epoch_s"])) * sum(later_finetune) / len(later_finetune)
        + (500 - measured["questions"]) * measured["question_s"]
    )
    return {
        "command": " ".join(map(str, command)),
        "process_s": seconds,
        "recipe_s": seconds + remaining,
        "whole_recipe_run": not epochs,
        **measured,
    }


def breakdown(started: float, ended: float, summary: dict) -> list[tuple[str, float]]:
    """Every second of a train.py process by phase (hf_knowgpt.utils.timeline), a stage's training split
    into the loop's set-up (optimizer, accelerate's preparation, the stepper), loading what earlier processes
    compiled, compilation and graph capture (its warm-up) and the steps. Results written before the set-up was
    timed (no `setup_seconds`) count it with the steps."""
    rows = []
    for label, seconds in phase_seconds(started, summary["timeline"], ended):
        stage = label.split(":")[0]
        if label.endswith("(compilation and capture included)"):
            facts = summary["stages"][stage]
            warmup, loading = facts["warmup_seconds"], facts.get("load_seconds", 0.0)
            setup = facts.get("setup_seconds", loading)  # the loading happens inside the set-up
            if "setup_seconds" in facts:
                rows.append((f"{stage}: training loop set up (optimizer, accelerate, stepper)", setup - loading))
            rows += [(f"{stage}: compiled step loaded", loading), (f"{stage}: compilation and graph capture", warmup)]
            rows.append((f"{stage}: steps", seconds - setup - warmup))
        else:
            rows.append((label, seconds))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="folder with the CS224N files")
    parser.add_argument("--attention_type", default="vanilla")
    parser.add_argument(
        "--handout_epochs",
        default="4,2,50",
        help="pretraining epochs, finetuning epochs and questions of the handouts' loop timed, the rest of "
        "their recipe added at the measured rates; 'all' runs their whole recipe (default 4,2,50)",
    )
    parser.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"train.py runs, in order, from {', '.join(RUNS)} (default {','.join(DEFAULT_RUNS)}); a cold run "
        "empties the TorchInductor and Triton caches first, a warm one reuses what the runs before it left",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="GPUs: above 1, every run is the README's `accelerate launch --multi_gpu --num_processes N` command",
    )
    parser.add_argument("--startup_only", action="store_true", help="only the start-up figures")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--output", default=None, help="write every measurement as JSON here")
    args = parser.parse_args(argv)

    runs = args.runs.split(",")
    if unknown := set(runs) - set(RUNS):
        parser.error(f"unknown --runs {sorted(unknown)}; choose from {', '.join(RUNS)}")
    epochs = None
    if args.handout_epochs != "all":
        try:
            epochs = tuple(int(n) for n in args.handout_epochs.split(","))
        except ValueError:
            epochs = ()
        # the first epoch of each stage holds the loader's and CUDA's warm-up, so rates come from the later ones
        if len(epochs) != 3 or epochs[0] < 2 or epochs[1] < 2 or epochs[2] < 1:
            parser.error(f"--handout_epochs takes 'all' or P,F,Q with P, F ≥ 2 and Q ≥ 1, got {args.handout_epochs!r}")

    if args.processes < 1:
        parser.error(f"--processes takes a count of GPUs, 1 or more, got {args.processes}")
    if args.processes > 1 and not args.startup_only:  # before the start-up figures are timed
        import torch

        if args.processes > torch.cuda.device_count():
            parser.error(
                f"--processes {args.processes} takes one GPU each; this machine has {torch.cuda.device_count()}"
            )
    results = {"environment": environment(), "startup": startup_times()}
    print(json.dumps(results["environment"]), flush=True)
    print(json.dumps(results["startup"]), flush=True)
    if not args.startup_only:
        import torch

        results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        results["processes"] = args.processes
        work = Path(args.workdir or tempfile.mkdtemp(prefix="knowgpt-user-path-"))
        data = Path(args.data_dir)
        recipe = ["--recipe", "handout", "--attention_type", args.attention_type, "--data_dir", data]
        commands = train_commands(recipe, args.processes)
        # a run named twice is kept twice: the second as "<run> (2)", and so on
        keys = [
            run if runs[:i].count(run) == 0 else f"{run} ({runs[:i].count(run) + 1})" for i, run in enumerate(runs)
        ]
        for run, key in zip(runs, keys):
            output_dir = work / f"run-{len(results)}"
            command = [*commands[run], "--output_dir", output_dir]
            env = {name: str(work / name) for name in CACHES}  # one set of caches, emptied by a cold run
            # `--torch_compile auto` may leave a process compiling for the next run: the next run waits for it
            background_s = wait_for_background_compiles(Path(env["KNOWGPT_COMPILE_CACHE"]))
            if run.endswith("one-compile-thread"):
                env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
            if "-cold" in run:  # saved artifacts: a fresh machine given what an earlier run compiled
                kept = ("KNOWGPT_COMPILE_CACHE",) if run.endswith("saved-artifacts") else ()
                for folder in set(CACHES) - set(kept):
                    shutil.rmtree(env[folder], ignore_errors=True)
            clock = {}
            seconds, output = timed(command, work / f"{output_dir.name}.log", env=env, clock=clock)
            summary = json.loads((output_dir / "results.json").read_text())
            results[key] = {
                "command": " ".join(map(str, command)),
                "env": env,
                "output_dir": str(output_dir),
                "process_s": seconds,
                "accuracy": accuracy_line(output),
                "breakdown_s": breakdown(clock["started"], clock["ended"], summary),
                "pretrain_compiled": summary["stages"]["pretrain"].get("compiled"),
                "waited_for_background_compile_s": background_s,
            }
            print(json.dumps(results[key]), flush=True)
        checkpoint = Path(results[keys[-1]]["output_dir"]) / "finetuned"
        marks_file, clock = work / "evaluate.timeline.json", {}
        seconds, output = timed(
            [sys.executable, SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint, "--eval_corpus_path",
             data / "birth_dev.tsv", "--outputs_path", work / "evaluate.predictions"],
            work / "evaluate.log", env={"KNOWGPT_TIMELINE_FILE": str(marks_file)}, clock=clock,
        )  # fmt: skip
        marks = json.loads(marks_file.read_text())
        results["evaluate"] = {
            "process_s": seconds,
            "accuracy": accuracy_line(output),
            "breakdown_s": phase_seconds(clock["started"], marks, clock["ended"]),
        }
        results["handout_loop"] = handout_loop(data, args.attention_type, work, epochs)
        print(json.dumps(results["handout_loop"]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))

    startup = results["startup"]
    gpus = f" × {results['processes']} processes" if results.get("processes", 1) > 1 else ""
    print(f"\n{results.get('device', 'start-up only')}{gpus}; whole processes, as a user waits")
    present = results["environment"]["extra_packages_present"]
    print(f"python {sys.executable}; of {', '.join(EXTRA_PACKAGES)} it imports: {', '.join(present) or 'none'}")
    print(", ".join(f"{name} {version}" for name, version in results["environment"]["versions"].items()))
    print(f"{'import hf_knowgpt':<64}{startup['import_hf_knowgpt_s']:>8.2f} s")
    print(f"{'scripts/pretrain.py --help':<64}{startup['pretrain_help_s']:>8.2f} s")
    print(f"{'scripts/train.py --help':<64}{startup['train_help_s']:>8.2f} s")
    if args.startup_only:
        return results
    handout = results["handout_loop"]
    how = "whole recipe run" if handout["whole_recipe_run"] else "measured epochs and questions, the rest added"
    print(
        f"{'the handouts’ own loop, ' + args.attention_type:<64}{handout['recipe_s']:>8.1f} s   ({how}: "
        f"{sum(handout['pretrain_epoch_s'][1:]) / max(1, len(handout['pretrain_epoch_s']) - 1):.3f} s per "
        f"pretraining epoch, {1000 * handout['question_s']:.0f} ms per question"
        + (f", {handout['correct']} of {handout['questions']} right)" if handout["whole_recipe_run"] else ")")
    )
    # `keys`: the runs as `results` names them, a repeated run as "<run> (2)"
    for run in keys:
        row = results[run]
        print(
            f"{'train.py ' + args.attention_type + ' bf16, ' + run:<64}{row['process_s']:>8.1f} s   "
            f"{row['accuracy']}   ({handout['recipe_s'] / row['process_s']:.1f}× less than the handouts' loop)"
        )
    evaluate = results["evaluate"]
    print(f"{'scripts/evaluate_checkpoint.py, 500 questions':<64}{evaluate['process_s']:>8.1f} s   (" + "; ".join(
        f"{label} {seconds:.2f} s" for label, seconds in evaluate["breakdown_s"]) + ")")  # fmt: skip
    print(f"\nwhere the seconds go (train.py {args.attention_type}, bf16); columns: " + "; ".join(
        f"{i + 1} = {run}" for i, run in enumerate(keys)))  # fmt: skip
    print(f"{'phase':<70}" + "".join(f"{i + 1:>8}" for i in range(len(keys))))
    columns = [dict(results[run]["breakdown_s"]) for run in keys]
    for label in dict.fromkeys(label for run in keys for label, _ in results[run]["breakdown_s"]):
        print(f"{label:<70}" + "".join(f"{column.get(label, 0.0):>8.1f}" for column in columns))
    print(f"{'whole process':<70}" + "".join(f"{results[run]['process_s']:>8.1f}" for run in keys))
    compiled = "".join(f"{'yes' if results[run]['pretrain_compiled'] else 'no':>8}" for run in keys)
    print(f"{'pretraining step compiled':<70}" + compiled)
    waited = "".join(f"{results[run]['waited_for_background_compile_s']:>8.1f}" for run in keys)
    print(f"{'(before the run) waited for a background compile, s':<70}" + waited)
    return results


if __name__ == "__main__":
    main()
