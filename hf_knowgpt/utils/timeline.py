"""Wall-clock marks of one process's phases, so a benchmark can account for every second a user waits.

Each mark is `(label, time.time())`, named after the phase that just ended; wall-clock stamps compare with
the clock of the process that launched this one, which also saw the interpreter start and the exit. A
command starts afresh (`reset`), and a whole-recipe run writes the marks since then to `results.json` as
`timeline`. Any command run through `cli.run_script` also writes its marks as JSON to the file that
`$KNOWGPT_TIMELINE_FILE` names, where that is set (`benchmarks/bench_user_path.py` sets it for
`scripts/evaluate_checkpoint.py`)."""

import json
import os
import time

_marks: list[tuple[str, float]] = []


def reset() -> None:
    _marks.clear()


def mark(label: str) -> None:
    """Record that the phase `label` ended now."""
    _marks.append((label, time.time()))


def marks() -> list[tuple[str, float]]:
    return list(_marks)


def write_if_asked() -> None:
    """The marks, as JSON, to `$KNOWGPT_TIMELINE_FILE` where it is set; otherwise nothing."""
    path = os.environ.get("KNOWGPT_TIMELINE_FILE")
    if path:
        with open(path, "w") as file:
            json.dump(_marks, file)


def phase_seconds(started: float, stamps, ended: float) -> list[tuple[str, float]]:
    """The seconds of each phase between a launcher's `started` and `ended` (process start and exit, wall
    clock): the first mark's phase began at `started`; what follows the last mark is `exit`."""
    bounds = [started, *(stamp for _, stamp in stamps), ended]
    labels = [label for label, _ in stamps] + ["exit"]
    return [(label, bounds[i + 1] - bounds[i]) for i, label in enumerate(labels)]
