#!/usr/bin/env python
"""Dev accuracy of groups of `step_variants.py` runs, read from the JSON files it writes (`--output`): each
group's runs, mean ± standard deviation, range and mean final loss, then how far each later group's mean
lies from the first group's, in standard errors of the difference (Welch's). A table printed last.

    python benchmarks/diagnostics/compare_accuracy.py \\
        --group 'untuned=benchmarks/results/h200x4_step_variants_splits1_knowledge_seed*.json:as-is' \\
        --group 'tuned=benchmarks/results/h200_step_variants_knowledge_tuned*.json'

A group is NAME=GLOB, or NAME=GLOB:VARIANT to keep only that variant's runs; a group may be given several
globs, separated by commas. A run stands once even where two globs match its file.
"""

import argparse
import glob
import json
import math
import statistics
from pathlib import Path


def parse_group(text: str) -> tuple[str, list[tuple[str, str | None]]]:
    name, separator, patterns = text.partition("=")
    if not separator or not name or not patterns:
        raise argparse.ArgumentTypeError(f"--group {text!r}: write NAME=GLOB[:VARIANT][,GLOB[:VARIANT]...]")
    sources = []
    for pattern in patterns.split(","):
        path, _, variant = pattern.partition(":")
        sources.append((path, variant or None))
    return name, sources


def group_runs(sources: list[tuple[str, str | None]]) -> list[dict]:
    """The runs of every file the globs match, one variant's where one is named, each file read once."""
    runs, seen = [], set()
    for pattern, variant in sources:
        files = sorted(glob.glob(pattern))
        if not files:
            raise SystemExit(f"no file matches {pattern!r}")
        for file in files:
            for index, run in enumerate(json.loads(Path(file).read_text())):
                key = (Path(file).resolve(), index)  # one file reached by two spellings of its path
                if (variant is None or run["variant"] == variant) and key not in seen:
                    seen.add(key)
                    runs.append({**run, "file": file})
    return runs


def summarize(runs: list[dict]) -> dict:
    accuracies = [100 * run["dev_accuracy"] for run in runs]
    return {
        "runs": len(runs),
        "accuracies": accuracies,
        "mean": statistics.mean(accuracies),
        "std": statistics.stdev(accuracies) if len(runs) > 1 else float("nan"),
        "low": min(accuracies),
        "high": max(accuracies),
        "final_loss": statistics.mean(run["final_loss"] for run in runs),
    }


def standard_errors_apart(first: dict, other: dict) -> float:
    """(other − first) over the standard error of the difference of two means of unequal variances."""
    error = math.sqrt(first["std"] ** 2 / first["runs"] + other["std"] ** 2 / other["runs"])
    return (other["mean"] - first["mean"]) / error if error > 0 else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=parse_group, action="append", required=True, help="NAME=GLOB[:VARIANT]")
    args = parser.parse_args(argv)
    groups = {name: summarize(group_runs(sources)) for name, sources in args.group}
    first = next(iter(groups.values()))
    width = max(16, *(len(name) + 1 for name in groups))
    print(
        f"{'group':<{width}}{'runs':>5}{'dev % mean ± std':>19}{'range':>14}{'final loss':>12}{'vs first':>10}  dev %"
    )
    for name, group in groups.items():
        apart = "" if group is first else f"{standard_errors_apart(first, group):+.1f} se"
        print(
            f"{name:<{width}}{group['runs']:>5}{group['mean']:>12.2f} ± {group['std']:.2f}"
            f"{group['low']:>8.1f}–{group['high']:<5.1f}{group['final_loss']:>12.4f}{apart:>10}  "
            + ", ".join(f"{accuracy:.1f}" for accuracy in group["accuracies"])
        )
    return groups


if __name__ == "__main__":
    main()
