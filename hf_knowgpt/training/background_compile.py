"""Compile a training step for the next run, in a process of its own, while this run trains uncompiled.

`--torch_compile auto` compiles only where an earlier run saved what it compiled for the same model and step
(`compile_cache`): then the step loads from the caches in seconds. Elsewhere compiling from nothing costs more
than it saves in one handout-sized run (about 30 s of compilation against about 12 s of faster steps on an
H100), so the run trains uncompiled and `start_background_compile` hands the step to a detached process:
the same model configuration, training arguments and data, trained for one step with `compile=True` into a
temporary folder, which leaves the compiled artifacts in the package's file for the next run. It needs a
free moment of the GPU for that step, and CPU cores for the compilation; its output goes to a log beside the
artifacts. One process at a time per file: a lock file next to it, removed when the process ends. With
`tune_kernels` it starts only once the run has ended: tuning times every kernel on the GPU, and the run's
own kernels would distort those timings.
"""

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .compile_cache import LOCK_SUFFIX, LOG_SUFFIX

logger = logging.getLogger(__name__)


def log_file(artifacts: Path) -> Path:
    """Where the process compiling for `artifacts` writes its output (kept after it ends)."""
    return artifacts.with_suffix(LOG_SUFFIX)


def _running(pid: int) -> bool:
    """Whether a process has the id `pid` (0: this process's group, which runs). One of another user counts as
    ended: it took the id of ours."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _claim(lock: Path) -> bool:
    """Create `lock` holding this process's id; False where a live process holds it (a dead one's is taken over)."""
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            if _running(int(lock.read_text() or 0)):  # empty: its claimer has yet to write its id
                return False  # its process still compiles
        except (ValueError, FileNotFoundError):
            pass
        lock.unlink(missing_ok=True)  # left by a process that died (a reboot, a kill)
        return _claim(lock)
    with os.fdopen(descriptor, "w") as file:
        file.write(str(os.getpid()))
    return True


def start_background_compile(trainer, artifacts: Path, attn_implementation: str | None) -> subprocess.Popen | None:
    """Start the process that compiles `trainer`'s step (its model on `attn_implementation` before the run chose
    a kernel) and saves it to `artifacts`; None where one already runs for that file. The process outlives this
    one if it must (a session of its own)."""
    artifacts.parent.mkdir(parents=True, exist_ok=True)
    lock = artifacts.with_suffix(LOCK_SUFFIX)
    if not _claim(lock):
        return None
    log_path = log_file(artifacts)
    if log_path.is_file():  # no process holds the lock, yet the step was not saved: the last attempt failed
        logger.warning(
            "an earlier background compile did not save %s (its log: %s); trying again", artifacts, log_path
        )
    work = Path(tempfile.mkdtemp(prefix="knowgpt-background-compile-"))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    specification = {  # the classes go by reference: the child imports them from where they are defined
        "trainer_class": type(trainer),
        "model_class": type(unwrapped),
        "config": unwrapped.config.to_dict(),
        "attn_implementation": attn_implementation,
        "args": dataclasses.replace(trainer.args, compile=True, stop_after_steps=1, output_dir=str(work / "run"),
                                    report_to=None, checkpointing_steps=None, resume_from_checkpoint=None),
        "data": trainer.data,
    }  # fmt: skip
    torch.save(specification, work / "specification.pt")
    # Inductor's compile workers on all but two cores: the run's own loop keeps one to feed the GPU.
    environment = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) - 2))}
    after = os.getpid() if trainer.args.tune_kernels else 0  # the process to wait for; 0: none
    with open(log_path, "w") as log:  # the child keeps its own handle
        child = subprocess.Popen(
            [sys.executable, "-m", "hf_knowgpt.training.background_compile", str(work / "specification.pt"), str(lock),
             str(after)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=environment,
        )  # fmt: skip
    lock.write_text(str(child.pid))  # the child's now: a later run sees whether it still compiles
    return child


def trainer_from_specification(path: Path):
    """The trainer `start_background_compile` described: a fresh model of the same configuration (its weights do
    not matter to what is compiled), the same arguments (compiled, one step) and the same data."""
    specification = torch.load(path, weights_only=False)
    model_class = specification["model_class"]
    model = model_class(model_class.config_class.from_dict(specification["config"]))
    model.set_attn_implementation(specification["attn_implementation"] or "sdpa")
    return specification["trainer_class"](model, specification["data"], specification["args"])


def wait_for_exit(pid: int, poll_seconds: float = 0.5) -> None:
    """Return once no process has the id `pid` (0: at once)."""
    while pid and _running(pid):
        time.sleep(poll_seconds)


def main(argv=None) -> None:
    specification, lock, after = argv or sys.argv[1:]
    specification, lock = Path(specification), Path(lock)
    os.nice(10)  # the run that started this one comes first on the CPU
    try:
        wait_for_exit(int(after))
        trainer_from_specification(specification).train()  # one step, compiled; the stepper saves its artifacts
    finally:
        lock.unlink(missing_ok=True)
        shutil.rmtree(specification.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
