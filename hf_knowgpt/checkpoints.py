"""Checkpoint folders on disk: their names, how to list and validate them, and atomic writes.

Every file is written beside its final name and renamed into place, and checkpoint folders are staged
and renamed whole, so a run killed at any moment leaves the last complete checkpoint loadable.
"""

import json
import os
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = ".staging-"
TRAINER_STATE = "trainer_state.json"
ACCELERATE_STATE = "accelerate_state"


def list_checkpoints(output_dir) -> list[Path]:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def validate_checkpoint(path) -> dict:
    """The trainer state of a complete checkpoint; a clear error naming the path and what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    missing = [
        name
        for name in (TRAINER_STATE, "config.json", "model.safetensors", ACCELERATE_STATE)
        if not (path / name).exists()
    ]
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete or corrupt: missing {', '.join(missing)}")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        return {"global_step": int(state["global_step"]), **state}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"checkpoint {path} is corrupt: {TRAINER_STATE} is unreadable ({error})") from error


def write_text_atomic(path, text: str):
    """Write a file beside its final name and rename it into place: a reader never sees half of it."""
    path = Path(path)
    staging = path.with_name(f"{STAGING_PREFIX}{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def write_json_atomic(path, payload):
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


__all__ = [
    "ACCELERATE_STATE",
    "CHECKPOINT_PREFIX",
    "STAGING_PREFIX",
    "TRAINER_STATE",
    "list_checkpoints",
    "validate_checkpoint",
    "write_json_atomic",
    "write_text_atomic",
]
