#!/usr/bin/env python
"""How long a script's process spends in Python's cyclic garbage collections, by the phase of its timeline.

    python benchmarks/diagnostics/gc_collections.py --report gc.json scripts/train.py --recipe handout ...

Runs the script (here, as its own `__main__`) with a `gc.callbacks` recorder: each collection's seconds and
objects collected go to the phase it fell in (the phase after the last `hf_knowgpt.utils.timeline` mark, as
`results.json` names them) and its generation. The report is written as JSON when the process ends (the
scripts run their atexit handlers, `cli.run_script`) and the collections of more than a millisecond are
printed. benchmarks/RESULTS.md ("What collections are left") gives such a recording of the README's
`--torch_compile auto` command, cold and warm, on an H200.
"""

import atexit
import gc
import json
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hf_knowgpt.utils import timeline  # noqa: E402


class CollectionRecorder:
    """Seconds, count and objects collected of every collection, by phase and generation."""

    def __init__(self):
        self.started = None
        self.by_phase = {}  # "phase | genN" -> [collections, seconds, collected]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        marks = timeline.marks()
        label = f"{marks[-1][0] if marks else 'start'} | gen{info['generation']}"
        entry = self.by_phase.setdefault(label, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += time.perf_counter() - self.started
        entry[2] += info["collected"]

    def total_seconds(self) -> float:
        return sum(seconds for _, seconds, _ in self.by_phase.values())

    def write(self, path) -> None:
        report = {
            label: [count, round(seconds, 4), collected]
            for label, (count, seconds, collected) in self.by_phase.items()
        }
        Path(path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"{self.total_seconds():.3f} s in collections; written to {path}", file=sys.stderr)
        for label, (count, seconds, collected) in sorted(self.by_phase.items(), key=lambda item: -item[1][1]):
            if seconds > 1e-3:
                print(
                    f"  {seconds:7.3f} s  {count:5d} collections  {collected:7d} collected  {label}", file=sys.stderr
                )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 3 or argv[0] != "--report":
        raise SystemExit("usage: gc_collections.py --report REPORT.json SCRIPT [its flags]")
    report, script = argv[1], argv[2]
    recorder = CollectionRecorder()
    gc.callbacks.append(recorder)
    atexit.register(recorder.write, report)
    sys.argv = argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
