#!/usr/bin/env python
"""Reproduce the README's results table: every row is the README's one command (`scripts/train.py`),
run as a user runs it, once per seed.

    python benchmarks/reproduce.py --data_dir ../shared/data --mixed_precision bf16 --torch_compile \\
        --variants vanilla-nopretrain,vanilla,rope,synthesizer,perceiver,knowledge --seeds 0,1,2

A variant is a base and options. Bases: `vanilla-nopretrain` (the handouts' finetuning from scratch),
`vanilla`, `rope`, `synthesizer`, `perceiver` (the handouts' recipe with that attention), `knowledge`
(`--recipe knowledge`) and `quickstart` (`--recipe quickstart`, for the synthetic corpus). Each option
`+name=value` adds `--name value` to the command, `+name=on` adds `--name` and `+name=off` adds
`--no_name`: `knowledge+n_embd=512+pretrain_max_epochs=500`,
`knowledge+do_finetune=on+finetune_recipe=handout`. So every row is a command a user can type, printed
before it runs; its whole wall time (interpreter, imports, compilation, training, evaluation) is recorded.

--heldout N is for choosing hyperparameters: the last N training questions are held out (scored instead of
dev), the rest are the training questions; no test predictions. A finetuned variant's pretrained checkpoint
is scored too (`pretrained_accuracy`, through scripts/evaluate_checkpoint.py). --curve_every E saves a checkpoint
every E pretraining epochs (seed 0) and scores each one (finetuned first when the variant finetunes), all
through the scripts: accuracy against pretraining epochs. Results go to --results (JSON); checkpoints and
predictions to --output_dir. A table is printed last.

--gpus 0,1,2,3 runs the rows side by side, one command per GPU at a time (each sees only its GPU through
CUDA_VISIBLE_DEVICES, as a user running it there would); every command is still the one-GPU command, and
its process time is its own wall time. Logs then go to each row's folder only.
"""

import argparse
import json
import os
import queue
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
sys.path.insert(0, str(REPO_ROOT))

# Exact match on birth_dev.tsv reported by the handouts and public solutions (the anchors).
ANCHORS = {
    "london-baseline": "5.0%",
    "vanilla-nopretrain": "1.0–2.0% (1.2% here with the handouts' code)",
    "vanilla": "18.6–22.6%",
    "rope": "36.4% (n_embd 512)",
    "synthesizer": "9.8%",
    "perceiver": "5.0%",
    "knowledge": "goal ≥ 60%",
}
BASES = {
    "vanilla-nopretrain": ["--recipe", "handout", "--attention_type", "vanilla", "--no_do_pretrain"],
    **{
        name: ["--recipe", "handout", "--attention_type", name]
        for name in ("vanilla", "rope", "synthesizer", "perceiver")
    },
    "knowledge": ["--recipe", "knowledge"],
    "quickstart": ["--recipe", "quickstart"],
}


def split_train(train_path: Path, heldout: int, directory: Path):
    lines = train_path.read_text(encoding="utf-8").strip("\n").split("\n")
    directory.mkdir(parents=True, exist_ok=True)
    kept, held = directory / "train_part.tsv", directory / "heldout.tsv"
    kept.write_text("\n".join(lines[:-heldout]) + "\n", encoding="utf-8")
    held.write_text("\n".join(lines[-heldout:]) + "\n", encoding="utf-8")
    return kept, held


def variant_flags(variant: str) -> list[str]:
    """`knowledge+n_embd=512+mixed_training=off` → the train.py flags of that variant."""
    base, *options = variant.split("+")
    if base not in BASES:
        raise ValueError(f"unknown variant base {base!r} in {variant!r}; choose from {sorted(BASES)}")
    flags = list(BASES[base])
    for option in options:
        name, separator, value = option.partition("=")
        if not separator:
            raise ValueError(f"variant option {option!r} in {variant!r} is not name=value")
        if value == "on":
            flags.append(f"--{name}")
        elif value == "off":
            flags.append(f"--no_{name}")
        else:
            flags += [f"--{name}", value]
    return flags


def flags_given_twice(variant: str, extra_flags) -> list[str]:
    """Settings that a variant's options and the shared flags (--flags, --torch_compile) both give: the later
    one would silently win, so the row would not be the variant it is named after."""

    def names(flags):
        return {flag[2:].removeprefix("no_") for flag in flags if flag.startswith("--")}

    return sorted(names(variant_flags(variant)) & names(extra_flags))


def launcher(mixed_precision: str, num_processes: int = 1) -> tuple[list[str], list[str]]:
    """How the README launches train.py: one process is a plain `python` with `--mixed_precision`;
    several go through `accelerate launch --multi_gpu`, every value it would otherwise warn about given.
    Returns (what comes before the script, flags after it)."""
    if num_processes == 1:
        return [sys.executable], ["--mixed_precision", mixed_precision]
    accelerate = shutil.which("accelerate")
    command = [accelerate, "launch"] if accelerate else [sys.executable, "-m", "accelerate.commands.launch"]
    command += ["--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1"]
    return command + ["--mixed_precision", mixed_precision, "--dynamo_backend", "no"], []


def train_command(variant, seed, files, output_dir, extra_flags=(), launch=()) -> list[str]:
    """The README's one command for one row: `python scripts/train.py <variant flags> ...` (or `accelerate
    launch ... scripts/train.py` for several processes)."""
    command = [*launch, str(SCRIPTS / "train.py"), *variant_flags(variant), "--seed", str(seed)]
    for flag, path in (
        ("--pretrain_corpus_path", files["corpus"]),
        ("--train_corpus_path", files["train"]),
        ("--eval_corpus_path", files["eval"]),
        ("--test_corpus_path", files.get("test")),
    ):
        if path is not None:
            command += [flag, str(path)]
    return command + ["--output_dir", str(output_dir), *extra_flags]


_WORKER = threading.local()  # the GPU of the worker thread running a command (--gpus), if any


def run_logged(command, log_path: Path) -> float:
    """Run a command as a user would, its output echoed and kept; returns its wall time in seconds. On a
    worker of --gpus, the command sees only that worker's GPU and its output goes to the log only."""
    gpu = getattr(_WORKER, "gpu", None)
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu) if gpu is not None else None
    print(("" if gpu is None else f"[GPU {gpu}] ") + "+ " + shlex.join(command), flush=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=environment
        )
        for line in process.stdout:
            log.write(line)
            if "\r" not in line and gpu is None:  # progress bars stay in the log
                sys.stdout.write(line)
        process.wait()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"exit status {process.returncode}: {shlex.join(command)} (log: {log_path})")
    return seconds


def score(checkpoint, eval_path, root: Path, name: str) -> float:
    """scripts/evaluate_checkpoint.py on a checkpoint; the accuracy in percent."""
    outputs = root / f"{name}.predictions"
    run_logged(
        [sys.executable, str(SCRIPTS / "evaluate_checkpoint.py"), "--model_name_or_path", str(checkpoint),
         "--eval_corpus_path", str(eval_path), "--outputs_path", str(outputs)],
        root / f"{name}.log",
    )  # fmt: skip
    return 100.0 * json.loads(outputs.with_name(outputs.name + ".metrics.json").read_text())["accuracy"]


def run_one(variant, seed, files, output_dir, launch, launch_flags, extra_flags, curve_every, heldout):
    root = output_dir / f"{variant}-seed{seed}"
    shutil.rmtree(root, ignore_errors=True)  # a fresh folder: no --overwrite_output_dir in the command
    root.mkdir(parents=True)
    flags = [*launch_flags, *extra_flags]
    if curve_every and seed == 0:
        flags += ["--checkpointing_steps", f"epochs:{curve_every}", "--save_total_limit", "1000"]
    run_dir = root / "run"
    command = train_command(variant, seed, files, run_dir, flags, launch)
    wall = run_logged(command, root / "train.log")
    results = json.loads((run_dir / "results.json").read_text())
    config = results["config"]
    stages = results["stages"]
    row = {
        "variant": variant,
        "seed": seed,
        "command": shlex.join(command),
        "process_s": wall,
        "pretrain_s": stages.get("pretrain", {}).get("train_seconds", 0.0),
        "pretrain_warmup_s": stages.get("pretrain", {}).get("warmup_seconds", 0.0),
        "finetune_s": stages.get("finetune", {}).get("train_seconds", 0.0),
        "final_pretrain_loss": stages.get("pretrain", {}).get("final_loss"),
        "correct": results["dev"]["correct"],
        "total": results["dev"]["total"],
        "accuracy": 100.0 * results["dev"]["accuracy"],
        "eval_s": results["dev"]["seconds"],
        "attention_type": config["model"]["attention_type"],
        "n_embd": config["model"]["n_embd"],
        "device": results["device"],
    }
    final = run_dir / ("finetuned" if "finetune" in stages else "pretrained")
    row["parameters"] = json.loads((final / "knowgpt_card.json").read_text())["parameters"]
    if heldout and "finetune" in stages and "pretrain" in stages:  # is the finetuning stage worth having?
        row["pretrained_accuracy"] = score(run_dir / "pretrained", files["eval"], root, "pretrained")
    if curve_every and seed == 0:
        row["accuracy_by_epoch"] = accuracy_by_epoch(run_dir, files, root, "finetune" in stages, launch, launch_flags)
    return row


def accuracy_by_epoch(run_dir, files, root, finetunes: bool, launch, launch_flags):
    """Score every saved pretraining checkpoint (finetuned first, through scripts/finetune.py, when the
    variant finetunes): accuracy against pretraining epochs."""
    from hf_knowgpt.utils.checkpoints import list_checkpoints

    points = []
    for checkpoint in list_checkpoints(run_dir / "pretrained"):
        epoch = json.loads((checkpoint / "trainer_state.json").read_text())["epoch"]
        target = checkpoint
        if finetunes:
            target = root / f"curve-{checkpoint.name}"
            run_logged(
                [*launch, str(SCRIPTS / "finetune.py"), "--model_name_or_path", str(checkpoint),
                 "--finetune_corpus_path", str(files["train"]), "--output_dir", str(target), *launch_flags],
                root / f"curve-{checkpoint.name}.log",
            )  # fmt: skip
        points.append(
            {"epoch": round(epoch), "accuracy": score(target, files["eval"], root, f"curve-{checkpoint.name}")}
        )
    return points


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="folder with wiki.txt and the three TSVs")
    parser.add_argument("--variants", default="vanilla-nopretrain,vanilla,rope,synthesizer,perceiver,knowledge")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--heldout", type=int, default=0, help="score the last N training questions, not dev")
    parser.add_argument("--curve_every", type=int, default=0, help="pretraining epochs between curve points (seed 0)")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"], help="every command's precision")
    parser.add_argument(
        "--num_processes", type=int, default=1, help="processes: 1 runs python, more run accelerate launch --multi_gpu"
    )
    parser.add_argument("--torch_compile", action="store_true", help="pass --torch_compile to every command")
    parser.add_argument(
        "--gpus", default=None, help="run the rows side by side, one one-GPU command per listed GPU (0,1,2,3)"
    )
    parser.add_argument("--flags", default="", help="more train.py flags for every command (quoted)")
    parser.add_argument("--output_dir", default="/tmp/knowgpt-reproduce")
    parser.add_argument("--results", default=None, help="JSON file for every run")
    return parser.parse_args(argv)


def command_parts(args):
    """(files by role, launcher, launcher flags, other flags) shared by every row's command."""
    data_dir, output_dir = Path(args.data_dir), Path(args.output_dir)
    files = {"corpus": data_dir / "wiki.txt", "train": data_dir / "birth_places_train.tsv"}
    if args.heldout:
        files["train"], files["eval"] = split_train(files["train"], args.heldout, output_dir / "split")
        files["test"] = None
    else:
        files["eval"], files["test"] = data_dir / "birth_dev.tsv", data_dir / "birth_test_inputs.tsv"
    launch, launch_flags = launcher(args.mixed_precision, args.num_processes)
    extra_flags = shlex.split(args.flags) + (["--torch_compile"] if args.torch_compile else [])
    return files, launch, launch_flags, extra_flags


def main(argv=None):
    args = parse_args(argv)
    files, launch, launch_flags, extra_flags = command_parts(args)
    output_dir = Path(args.output_dir)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    for variant in args.variants.split(","):
        if twice := flags_given_twice(variant, extra_flags):
            raise SystemExit(f"error: variant {variant!r} and --flags both set {', '.join(twice)}: give each once")
    jobs = [(variant, seed) for variant in args.variants.split(",") for seed in map(int, args.seeds.split(","))]
    results, lock = {}, threading.Lock()

    def run_job(job):
        variant, seed = job
        try:
            row = run_one(
                variant, seed, files, output_dir, launch, launch_flags, extra_flags, args.curve_every, args.heldout
            )
        except Exception as error:  # record it and go on: one failed run must not cost the others
            print(json.dumps({"variant": variant, "seed": seed, "error": repr(error)}), flush=True)
            return
        with lock:
            results[job] = row
            print(json.dumps(row), flush=True)
            if args.results:
                rows = [results[j] for j in jobs if j in results]
                summary = {"device": row["device"], "heldout": args.heldout, "mixed_precision": args.mixed_precision,
                           "rows": rows}  # fmt: skip
                Path(args.results).write_text(json.dumps(summary, indent=1))

    if args.gpus is None:
        for job in jobs:
            run_job(job)
    else:
        pending = queue.Queue()
        for job in jobs:
            pending.put(job)

        def worker(gpu):
            _WORKER.gpu = gpu
            while True:
                try:
                    job = pending.get_nowait()
                except queue.Empty:
                    return
                run_job(job)

        threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in args.gpus.split(",")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    rows = [results[job] for job in jobs if job in results]
    device = rows[-1]["device"] if rows else None

    scored_on = f"the last {args.heldout} training questions (held out)" if args.heldout else "birth_dev.tsv"
    print(f"\n{device}; exact match on {scored_on}; whole commands ({' '.join(launch)} scripts/train.py ...)")
    print(
        f"{'variant':<26}{'params':>11}{'seeds':>6}{'mean':>8}{'std':>6} {'per seed':>22}{'train s':>9}{'process s':>11}  anchor"
    )
    for variant in dict.fromkeys(r["variant"] for r in rows):
        group = [r for r in rows if r["variant"] == variant]
        accuracies = [r["accuracy"] for r in group]
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        train = statistics.mean(r["pretrain_s"] + r["finetune_s"] for r in group)
        process = statistics.mean(r["process_s"] for r in group)
        per_seed = " ".join(f"{a:.1f}" for a in accuracies)
        print(
            f"{variant:<26}{group[0]['parameters']:>11}{len(group):>6}{statistics.mean(accuracies):>7.1f}%"
            f"{spread:>6.1f} {per_seed:>22}{train:>9.0f}{process:>11.0f}  {ANCHORS.get(variant.split('+')[0], '')}"
        )
    return rows


if __name__ == "__main__":
    main()
