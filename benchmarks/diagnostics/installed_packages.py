#!/usr/bin/env python
"""The README's commands in two Python environments of one machine, alternating round by round: this
machine's python (with whatever its image carries besides the package's requirements) and one holding only
what `pip install -e .` installs (`benchmarks/pip_environment.py`). What the extra packages cost a user's
process: transformers imports scipy's optimizers and torchvision when they are there.

    python benchmarks/bench_user_path.py --data_dir DATA --runs auto-cold,auto-warm --workdir W
    python benchmarks/diagnostics/installed_packages.py --workdir W --data_dir DATA --rounds 3 --train_rounds 2

W is a folder of bench_user_path.py's runs: its compiler caches make every `scripts/train.py` here warm
(`--torch_compile auto`, as bench_user_path.py's `auto-warm`), and its last run's finetuned checkpoint is what
`scripts/evaluate_checkpoint.py` answers the dev questions with. The pip environment is made in W/pip-env
unless `--pip_python` names one. A table is printed last; --output writes JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import pip_environment  # noqa: E402
from benchmarks.bench_user_path import (  # noqa: E402
    CACHES,
    EXTRA_PACKAGES,
    SCRIPTS,
    accuracy_line,
    breakdown,
    last_finetuned_checkpoint,
    timed,
)


def importable(python: Path, env: dict) -> list[str]:
    probe = f"import importlib.util as u; print(','.join(n for n in {EXTRA_PACKAGES!r} if u.find_spec(n)))"
    output = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, env=env).stdout
    return [name for name in output.strip().split(",") if name]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="bench_user_path.py's --workdir, its runs done")
    parser.add_argument("--data_dir", required=True, help="folder with the CS224N files")
    parser.add_argument("--pip_python", default=None, help="the python of an environment made by pip_environment.py")
    parser.add_argument("--rounds", type=int, default=3, help="evaluate_checkpoint.py runs per environment")
    parser.add_argument("--train_rounds", type=int, default=1, help="warm train.py runs per environment")
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="one train.py per environment first, untimed (each environment's "
        "Triton cache key holds its own path to ptxas, so its first run may build the eager kernels again)",
    )
    parser.add_argument("--output", default=None, help="write every measurement as JSON here")
    args = parser.parse_args(argv)

    work, data = Path(args.workdir).resolve(), Path(args.data_dir).resolve()
    checkpoint = last_finetuned_checkpoint(work, parser)
    pip_python = Path(args.pip_python) if args.pip_python else work / "pip-env" / "bin" / "python"
    if not pip_python.exists():
        pip_python, missing = pip_environment.create(pip_python.parents[1])
        for requirement in missing:
            print(f"not on this machine, left out of the pip environment: {requirement}", flush=True)
    caches = {name: str(work / name) for name in CACHES}
    # this machine's python as the benchmarks run it; the pip environment without PYTHONPATH, as a user's shell
    environments = {
        "this machine's python": (Path(sys.executable), {}),
        "pip install -e . only": (pip_python, {"PYTHONPATH": ""}),
    }
    results = {
        name: {"python": str(python), "extra_packages_present": importable(python, {**os.environ, **env}),
               "evaluate_s": [], "train": []}
        for name, (python, env) in environments.items()
    }  # fmt: skip
    train_command = [SCRIPTS / "train.py", "--recipe", "handout", "--attention_type", "vanilla", "--data_dir", data,
                     "--mixed_precision", "bf16", "--torch_compile", "auto"]  # fmt: skip
    if args.warmup:
        for python, env in environments.values():
            tag = "pip" if env else "machine"
            command = [python, *train_command, "--output_dir", work / f"train-{tag}-warmup"]
            timed(command, work / f"train-{tag}-warmup.log", env={**caches, **env})
    for round_ in range(max(args.rounds, args.train_rounds)):
        for name, (python, env) in environments.items():
            tag = f"{'pip' if env else 'machine'}-{round_}"
            if round_ < args.rounds:
                seconds, output = timed(
                    [python, SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint,
                     "--eval_corpus_path", data / "birth_dev.tsv", "--outputs_path", work / f"evaluate-{tag}.predictions"],
                    work / f"evaluate-{tag}.log", env=env,
                )  # fmt: skip
                results[name]["evaluate_s"].append(seconds)
                print(f"{name}: evaluate_checkpoint.py {seconds:.2f} s, {accuracy_line(output)}", flush=True)
            if round_ < args.train_rounds:
                output_dir = work / f"train-{tag}"
                command = [python, *train_command, "--output_dir", output_dir]
                clock = {}
                seconds, output = timed(command, work / f"train-{tag}.log", env={**caches, **env}, clock=clock)
                summary = json.loads((output_dir / "results.json").read_text())
                results[name]["train"].append(
                    {"process_s": seconds, "accuracy": accuracy_line(output),
                     "breakdown_s": breakdown(clock["started"], clock["ended"], summary)}
                )  # fmt: skip
                print(f"{name}: train.py {seconds:.1f} s, {accuracy_line(output)}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))

    print(
        f"\n{'environment':<28}{'imports of ' + ', '.join(EXTRA_PACKAGES):<40}{'evaluate_checkpoint.py, s':<36}{'median':>8}"
    )
    for name, row in results.items():
        each = " ".join(f"{s:.2f}" for s in row["evaluate_s"])
        median = statistics.median(row["evaluate_s"]) if row["evaluate_s"] else float("nan")
        print(f"{name:<28}{', '.join(row['extra_packages_present']) or 'none':<40}{each:<36}{median:>8.2f}")
    if args.train_rounds:
        print(f"\nwarm train.py (handout, vanilla, bf16, --torch_compile auto), s; columns: {' | '.join(results)}")
        labels = dict.fromkeys(
            label for row in results.values() for run in row["train"] for label, _ in run["breakdown_s"]
        )
        for label in labels:
            cells = [
                " ".join(f"{dict(run['breakdown_s']).get(label, 0.0):5.1f}" for run in row["train"])
                for row in results.values()
            ]
            print(f"{label:<70}" + " | ".join(f"{cell:>14}" for cell in cells))
        cells = [" ".join(f"{run['process_s']:5.1f}" for run in row["train"]) for row in results.values()]
        print(f"{'whole process':<70}" + " | ".join(f"{cell:>14}" for cell in cells))
    return results


if __name__ == "__main__":
    main()
