"""Checkpoint folders on disk: their names, how to list and validate them, and atomic writes.

Every file is written beside its final name and renamed into place, and checkpoint folders are staged
and renamed whole, so a run killed at any moment leaves the last complete checkpoint loadable.
"""

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path

from .errors import InputError, MissingInputError, OutputError, UserError

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = ".staging-"
TRAINER_STATE = "trainer_state.json"
ACCELERATE_STATE = "accelerate_state"
# A write that failed with less than this left on its disk ran out of space (torch's zip writer reports a
# short write as a RuntimeError, without the operating system's errno).
FULL_DISK_BYTES = 1 << 20


def list_checkpoints(output_dir) -> list[Path]:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file (None when its header reads): only the header is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError, ValueError) as error:
        return f"not a readable safetensors file ({str(error).splitlines()[0]})"
    return None


def check_model_folder(path) -> Path:
    """A local folder that `from_pretrained` can load, or an InputError naming the folder or file and what is
    wrong: missing, a file, an interrupted run's output_dir (its checkpoints named), no config.json,
    unreadable config.json, missing or corrupt weights."""
    path = Path(path)
    if not path.exists():
        raise MissingInputError(path, "no such checkpoint folder", "give a folder written by the training scripts")
    if path.is_file():
        raise InputError(
            path, "is a file, not a checkpoint folder",
            "a state dict saved by the handouts' code converts with scripts/convert_cs224n_checkpoint.py",
        )  # fmt: skip
    if not (path / "config.json").is_file():
        checkpoints = list_checkpoints(path)
        if checkpoints:
            raise InputError(
                path,
                "holds no finished model: its run stopped early; its checkpoints are "
                + ", ".join(c.name for c in checkpoints),
                f"give one of them, e.g. {checkpoints[-1]}, or resume the run with --resume_from_checkpoint latest",
            )
        raise InputError(path, "not a checkpoint: no config.json", "give a folder written by the training scripts")
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(path / "config.json", f"not valid JSON ({error})", "the checkpoint is damaged") from error
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise InputError(path, "has no model.safetensors", "the checkpoint is incomplete: save or train it again")
    problem = safetensors_problem(weights)
    if problem:
        raise InputError(weights, problem, "the file is damaged: use another checkpoint or train again")
    return path


def validate_checkpoint(path) -> dict:
    """The trainer state of a complete, resumable checkpoint; an InputError naming the path and what is
    wrong (missing files, unreadable weights or optimizer state, unreadable trainer state)."""
    path = Path(path)
    if not path.is_dir():
        raise MissingInputError(path, "no such checkpoint", "--resume_from_checkpoint takes a checkpoint-N folder")
    missing = [
        name
        for name in (TRAINER_STATE, "config.json", "model.safetensors", ACCELERATE_STATE)
        if not (path / name).exists()
    ]
    if missing:
        raise InputError(path, f"incomplete or corrupt checkpoint: missing {', '.join(missing)}")
    for weights in (path / "model.safetensors", *sorted((path / ACCELERATE_STATE).glob("*.safetensors"))):
        problem = safetensors_problem(weights)
        if problem:
            raise InputError(weights, problem, "the checkpoint is damaged")
    for state in sorted((path / ACCELERATE_STATE).glob("*.bin")):  # torch.save's zip files
        if not zipfile.is_zipfile(state):
            raise InputError(state, "not a readable torch.save file", "the checkpoint is damaged")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return {"global_step": int(state["global_step"]), **state}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise InputError(path / TRAINER_STATE, f"unreadable ({error})", "the checkpoint is damaged") from error


def latest_valid_checkpoint(output_dir) -> tuple[Path, dict]:
    """The newest checkpoint-N of `output_dir` that validates, with its trainer state; a damaged newer one is
    skipped with a warning (a run killed while writing leaves the one before it whole)."""
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise MissingInputError(
            output_dir, "holds no checkpoint-N folder to resume from", "start the run without --resume_from_checkpoint"
        )
    problems = []
    for checkpoint in reversed(checkpoints):
        try:
            return checkpoint, validate_checkpoint(checkpoint)
        except InputError as error:
            logger.warning("skipping %s: %s", checkpoint.name, error)
            problems.append(str(error))
    raise InputError(output_dir, "no checkpoint-N folder is whole: " + "; ".join(problems))


@contextlib.contextmanager
def quiet_progress_bars():
    """transformers' own bars ("Loading weights", "Writing model shards") off for a load or save inside a
    run: they do not belong in a training log. The previous setting is restored."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def ran_out_of_space(error: BaseException, folder) -> bool:
    """Whether `error`, raised while writing into `folder`, means that its disk is full: the operating system
    said so (ENOSPC, EDQUOT), or a write failed with less than `FULL_DISK_BYTES` left there."""
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


@contextlib.contextmanager
def full_disk_as_output_error(folder, what: str, left_in: Path | None = None):
    """Writing `what` into `folder`: a full disk becomes an `OutputError` naming the folder (one line in the
    scripts); any other failure keeps its traceback. `left_in` names where the incomplete copy stays."""
    try:
        yield
    except Exception as error:
        if isinstance(error, UserError) or not ran_out_of_space(error, folder):
            raise
        remedy = "free some space there or give another --output_dir"
        if left_in is not None:
            remedy += f"; the incomplete copy is left in {Path(left_in).name}"
        raise OutputError(folder, f"no space left on its disk while writing {what}", remedy) from error


def looks_like_hub_id(name: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)) is not None and not Path(name).exists()


def write_text_atomic(path, text: str):
    """Write a file beside its final name and rename it into place: a reader never sees half of it."""
    path = Path(path)
    staging = path.with_name(f"{STAGING_PREFIX}{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def write_json_atomic(path, payload):
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


__all__ = [
    "check_model_folder",
    "full_disk_as_output_error",
    "latest_valid_checkpoint",
    "looks_like_hub_id",
    "quiet_progress_bars",
    "ran_out_of_space",
    "safetensors_problem",
    "ACCELERATE_STATE",
    "CHECKPOINT_PREFIX",
    "STAGING_PREFIX",
    "TRAINER_STATE",
    "list_checkpoints",
    "validate_checkpoint",
    "write_json_atomic",
    "write_text_atomic",
]
