#!/usr/bin/env python
"""Where the samples of a sampling profiler's run fall, inside a chosen function, by kinds of work.

    py-spy record -r 250 -f raw --idle -o warm.txt -- python scripts/train.py --recipe handout ...
    python benchmarks/diagnostics/sampled_stacks.py warm.txt --within 'GraphedStepper._compile' \\
        --kind "Triton's digest=triton_key" --kind "torch's digest=torch_key" --kind 'imports=_find_and_load'

Reads py-spy's raw output (one line per distinct stack: its frames from the outermost, separated by `;`, then
the number of samples) and keeps the stacks that pass through a frame matching `--within` (a regular
expression). Each such stack counts toward the first `--kind NAME=REGEX` that matches any of its frames, in the
order given, or toward "the rest"; each kind's share of the samples is printed, with the sampled seconds at the
rate given. Sampling slows a Python process (py-spy stops it to read each sample), so the shares carry over to
an unsampled run better than the seconds do.
"""

import argparse
import re
from pathlib import Path


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """(frames from the outermost, samples) of each line of a py-spy raw file."""
    stacks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        frames, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise SystemExit(f"{path}, line {number}: not 'frame;frame;... samples': {line[:80]!r}")
        stacks.append((frames.split(";") if frames else [], int(count)))
    return stacks


def shares(stacks, within: str, kinds: list[tuple[str, str]]) -> dict[str, int]:
    """Samples of each kind (and "the rest") among the stacks that pass through a frame matching `within`."""
    inside, kinds = re.compile(within), [(name, re.compile(pattern)) for name, pattern in kinds]
    counts = {name: 0 for name, _ in kinds} | {"the rest": 0}
    for frames, count in stacks:
        if not any(inside.search(frame) for frame in frames):
            continue
        kind = next((name for name, pattern in kinds if any(pattern.search(frame) for frame in frames)), "the rest")
        counts[kind] += count
    return counts


def parse_kind(text: str) -> tuple[str, str]:
    name, separator, pattern = text.partition("=")
    if not separator or not name or not pattern:
        raise argparse.ArgumentTypeError(f"--kind {text!r}: write NAME=REGEX")
    re.compile(pattern)
    return name, pattern


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy's output with -f raw")
    parser.add_argument("--within", default=".", help="only stacks through a frame matching this (default: all)")
    parser.add_argument("--kind", type=parse_kind, action="append", default=[], help="NAME=REGEX, first match wins")
    parser.add_argument("--rate", type=float, default=250.0, help="samples per second of the recording (-r)")
    args = parser.parse_args(argv)
    counts = shares(read_stacks(args.raw), args.within, args.kind)
    total = sum(counts.values())
    print(f"{total / args.rate:.2f} s sampled through {args.within!r}")
    print(f"{'kind':<44} {'share':>7} {'sampled s':>10}")
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{name:<44} {100 * count / max(total, 1):6.1f}% {count / args.rate:10.2f}")


if __name__ == "__main__":
    main()
