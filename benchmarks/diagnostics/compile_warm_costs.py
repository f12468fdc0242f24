#!/usr/bin/env python
"""Where a compiled run's warm-up goes: the README's compiled command (`scripts/train.py --recipe handout
--attention_type vanilla --mixed_precision bf16 --torch_compile`, pretraining only, a few epochs) run twice in
fresh processes over the same TorchInductor and Triton caches (cold, then warm). Each process prints, at its
exit, dynamo's per-phase compile times, its graph and recompilation counts and the caches' hits, then
the table of both runs is printed last:

    python benchmarks/diagnostics/compile_warm_costs.py --data_dir .data [--epochs 20] [--profile warm.prof]

With --profile the warm run runs under cProfile (which slows dynamo's tracing, so its seconds are not the
run's), its statistics are written there and the functions taking most of the warm-up are printed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_user_path import CACHES  # noqa: E402

REPORT = r"""
import atexit, cProfile, json, os, runpy, sys
profiler = cProfile.Profile() if os.environ.get("PROFILE_OUT") else None
def report():
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.environ["PROFILE_OUT"])
    import torch._dynamo.utils as utils
    from torch._dynamo.utils import counters
    phases = {}
    try:  # seconds per phase: entire_frame_compile, backend_compile, inductor_compile, code_gen, ...
        phases = {k: round(float(v), 3) for k, v in utils.calculate_time_spent().items()}
    except Exception as error:
        phases = {"unavailable": repr(error)}
    out = {"compile_times_s": phases, "compile_times": str(utils.compile_times(repr="str", aggregate=True)),
           "counters": {group: dict(values) for group, values in counters.items()
                        if group in ("stats", "inductor", "aot_autograd", "recompiles", "graph_break")}}
    with open(os.environ["COMPILE_REPORT"], "w") as f:
        json.dump(out, f, default=str)
atexit.register(report)
sys.argv = sys.argv[1:]
if profiler is not None:
    profiler.enable()
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--output", default=None, help="JSON of both runs")
    parser.add_argument("--profile", default=None, help="run the warm run under cProfile; its statistics go here")
    args = parser.parse_args()
    caches = tempfile.mkdtemp(prefix="compile-caches-")
    env = dict(os.environ, **{name: f"{caches}/{name}" for name in CACHES})  # shared by both runs
    runs = []
    for name in ("cold", "warm"):
        report = Path(caches) / f"{name}.json"
        command = [sys.executable, "-c", REPORT, "scripts/train.py", "--recipe", "handout", "--attention_type",
                   "vanilla", "--data_dir", args.data_dir, "--mixed_precision", "bf16", "--torch_compile",
                   "--pretrain_max_epochs", str(args.epochs), "--no_do_finetune", "--overwrite_output_dir",
                   "--output_dir", f"{caches}/run-{name}"]  # fmt: skip
        started = time.perf_counter()
        profiled = {"PROFILE_OUT": str(Path(args.profile).resolve())} if args.profile and name == "warm" else {}
        result = subprocess.run(
            command, env=dict(env, COMPILE_REPORT=str(report), **profiled), capture_output=True, text=True
        )
        seconds = time.perf_counter() - started
        print(result.stdout[-1500:], result.stderr[-1500:], sep="\n", flush=True)
        results = json.loads((Path(caches) / f"run-{name}" / "results.json").read_text())
        stage = results["stages"]["pretrain"]
        runs.append(dict(run=name, process_s=seconds, warmup_s=stage["warmup_seconds"],
                         load_s=stage.get("load_seconds", 0.0), train_s=stage["train_seconds"],
                         **json.loads(report.read_text())))  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(runs, indent=1, default=str))
    for run in runs:
        print(f"\n== {run['run']}: process {run['process_s']:.1f} s, compiled step loaded {run['load_s']:.1f} s, "
              f"warm-up (compile + capture) {run['warmup_s']:.1f} s, steps {run['train_s']:.1f} s")  # fmt: skip
        for phase, seconds in run["compile_times_s"].items():
            print(f"  {phase:40s} {seconds}")
        print(run["compile_times"][:3000])
        for group, values in run["counters"].items():
            print(f"  {group}: {values}")
    if args.profile:
        print_profile(args.profile)


def print_profile(path: str, functions: int = 45) -> None:
    """The functions with the most cumulative time, then who calls the package's capture and what it calls."""
    import pstats

    stats = pstats.Stats(path)
    stats.sort_stats("cumulative").print_stats(functions)
    stats.print_callees("capture|load_artifacts|_prepare_packed|_compile|load_functions|load_compiled_function")


if __name__ == "__main__":
    main()
