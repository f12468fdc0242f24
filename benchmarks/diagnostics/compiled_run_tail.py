#!/usr/bin/env python
"""Where a compiled run's last seconds go: the finetuning stage's graph capture (2.6 s after a compiled
pretraining stage, 0.3 s after an uncompiled one) and the process's exit (1.2 s compiled, 0.2 s not).

    python benchmarks/diagnostics/compiled_run_tail.py --data_dir .data [--epochs 20] [--profile OUT.prof]

Runs `scripts/train.py --recipe handout --attention_type vanilla --mixed_precision bf16 --torch_compile`
(pretraining cut to `--epochs`) twice in this process's children over the same fresh caches — the first
fills them, the second is the warm run measured — the second inside this process under cProfile. Then, as
`cli.run_script` would at the end, it times the joins of the threads left running (named) and the atexit
handlers, and prints the profile's functions of Triton, inductor and the graphed stepper by cumulative time.
Every Triton compilation of the warm run is logged with its stage, kernel and seconds: Triton's own JIT
(`JITFunction._do_compile`: the fused kernels launched eagerly, on a miss of its in-process cache, whether
or not its disk cache then has the binary) and `triton.compile` (inductor's kernels go there directly).
"""

import argparse
import atexit
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.bench_user_path import CACHES  # noqa: E402


def _log_triton_compilations() -> list:
    """Wrap Triton's two ways in to a compilation and the trainer's stages; returns the log they fill."""
    import triton
    from triton.runtime.jit import JITFunction

    from hf_knowgpt.training.trainer import KnowGPTTrainer

    log, stage = [], ["start"]

    def timed(kind, function, name_of):
        def wrapper(*arguments, **options):
            started = time.perf_counter()
            try:
                return function(*arguments, **options)
            finally:
                log.append((stage[0], kind, name_of(arguments), time.perf_counter() - started))

        return wrapper

    if hasattr(JITFunction, "_do_compile"):
        JITFunction._do_compile = timed("JIT (eager launch)", JITFunction._do_compile, lambda a: a[0].__name__)
    triton.compile = timed("triton.compile", triton.compile, lambda a: str(getattr(a[0], "name", a[0]))[:38])
    import triton.compiler.compiler as compiler_module

    compiler_module.compile = triton.compile
    train_stage = KnowGPTTrainer.train

    def train_with_stage(self):
        stage[0] = Path(self.args.output_dir).name
        variables = {name: os.environ.get(name) for name in ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH")}
        print(f"{stage[0]} starts; Triton's environment: {variables}", flush=True)
        return train_stage(self)

    KnowGPTTrainer.train = train_with_stage
    return log


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--profile", default=None, help="write the warm run's cProfile statistics here")
    args = parser.parse_args()
    caches = Path(tempfile.mkdtemp(prefix="knowgpt-tail-"))
    for variable in CACHES:
        os.environ[variable] = str(caches / variable)
    flags = ["--recipe", "handout", "--attention_type", "vanilla", "--data_dir", args.data_dir,
             "--mixed_precision", "bf16", "--torch_compile", "--pretrain_max_epochs", str(args.epochs)]  # fmt: skip
    started = time.perf_counter()
    cold = [sys.executable, str(REPO / "scripts/train.py"), *flags, "--output_dir", str(caches / "cold")]
    subprocess.run(cold, check=True, capture_output=True)
    print(f"cold run (fills the caches): {time.perf_counter() - started:.1f} s", flush=True)

    from hf_knowgpt.commands import cli, train

    compilations = _log_triton_compilations()
    sys.argv = ["train.py", *flags, "--output_dir", str(caches / "warm")]
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.runcall(cli.main_guard, train.main)
    print(f"warm run in this process, under cProfile: {time.perf_counter() - started:.1f} s", flush=True)
    results = json.loads((caches / "warm" / "results.json").read_text())
    for name, stage in results["stages"].items():
        print(f"{name}: compilation and capture {stage['warmup_seconds']:.2f} s, steps {stage['train_seconds']:.2f} s")

    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    started = time.perf_counter()
    for thread in left:
        thread.join()
    joined = time.perf_counter() - started
    print(f"non-daemon threads left: {[t.name for t in left]}, joined in {joined:.3f} s")
    daemons = [t.name for t in threading.enumerate() if t.daemon]
    print(f"daemon threads: {daemons}")
    print(
        f"child processes: {subprocess.run(['pgrep', '-P', str(os.getpid())], capture_output=True, text=True).stdout.split()}"
    )
    started = time.perf_counter()
    atexit._run_exitfuncs()
    print(f"atexit handlers: {time.perf_counter() - started:.3f} s", flush=True)

    print(f"\nTriton compilations of the warm run ({len(compilations)}):")
    for stage, kind, kernel, seconds in compilations:
        print(f"{stage:>10}  {kind:<28}{kernel:<40}{seconds:8.3f} s")
    for stage in dict.fromkeys(stage for stage, *_ in compilations):
        total = sum(seconds for s, _, _, seconds in compilations if s == stage)
        print(f"{stage:>10}  total {total:.3f} s")

    if args.profile:
        profiler.dump_stats(args.profile)
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative")
    wanted = ("triton", "_inductor", "fast_path.py", "autotune", "jit.py", "compiler.py")
    rows = [(key, value) for key, value in stats.stats.items() if any(part in key[0] for part in wanted)]
    rows.sort(key=lambda item: -item[1][3])
    print(f"\n{'cumulative s':>12} {'calls':>8}  function (Triton, inductor, the graphed stepper)")
    for (filename, line, name), (_, calls, _, cumulative, _) in rows[:45]:
        short = filename.split("site-packages/")[-1].split("/work/main/")[-1]
        print(f"{cumulative:12.3f} {calls:8d}  {short}:{line}({name})")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
