"""Run the test suite as several pytest processes at once, and report every process even where its time ran out.

On the GPU machine the whole suite takes longer than one call allows in one process, and most of its time is the
CPU's (compiling, starting processes), so it runs as several processes sharing the card. The collected test ids are
dealt out in turn, so that each process gets a share of every file and of its slow tests. A process still running at
`--limit` gets SIGINT: pytest then stops and prints what failed so far and its counts, which a kill would lose.

    bash benchmarks/gpu_machine.sh python3 benchmarks/gpu_test_suite.py --processes 6 --limit 330 --part 1/3 \
        --output $OUT

The whole suite takes more than one call of the GPU machine (more than 3,400 process-seconds, six or seven at once on
one H100, torch 2.11, benchmarks/results/h100_pytest_suite_torch211_2026_12_06.txt): `--part 1/3` to `--part 3/3` in
three calls run every id once (a third, 351 or 352 ids: six processes of 117–313 s, the calls 284–346 s,
benchmarks/results/h100_pytest_suite_part1of3_2026_12_06.txt and the parts after it).

Anything after `--` goes to pytest's collection (files, ids, `-k`); the default is the whole of `tests`. It runs
where it is started (the repository's root above): pytest's ids are relative to it.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 30  # after SIGINT, for pytest to print its summary
COUNTED = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")


def collect(selection: list[str]) -> list[str]:
    """The test ids pytest collects for `selection`, in its order."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection]
    result = subprocess.run(command, capture_output=True, text=True)
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"pytest collected no tests for {selection}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return ids


def deal(ids: list[str], processes: int) -> list[list[str]]:
    """The ids in `processes` groups, dealt in turn: each group takes every `processes`-th id."""
    return [group for group in (ids[start::processes] for start in range(processes)) if group]


def counts(log: str) -> dict[str, int]:
    """The counts of pytest's last summary line in `log` ("3 failed, 10 passed, 2 skipped in 5.0s")."""
    summaries = [line for line in log.splitlines() if re.match(r"=*\s*\d+ \w+.* in [\d.]+s\b", line)]
    if not summaries:
        return {}
    found = dict((word, int(number)) for number, word in re.findall(r"(\d+) (\w+)", summaries[-1]))
    found["errors"] = found.pop("error", 0) + found.pop("errors", 0)
    return {word: found.get(word, 0) for word in COUNTED}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_groups(groups: list[list[str]], limit_s: float, output: Path, compile_threads: int) -> list[dict]:
    """Each group in a pytest process of its own, all at once; each stopped by SIGINT at `limit_s`."""
    output.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(compile_threads))
    started = time.monotonic()
    runs = []
    for number, ids in enumerate(groups):
        log_path = output / f"group{number}.log"
        log = open(log_path, "w")
        command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *ids]
        # SIGINT at its default in the child: a shell's background job ignores it, and Python then keeps it ignored
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint)
        runs.append(dict(group=number, ids=len(ids), process=process, log=log, log_path=log_path, stopped=False))
    for run in runs:
        try:
            run["process"].wait(timeout=max(0.0, started + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            run["stopped"] = True
            run["process"].send_signal(signal.SIGINT)
            try:
                run["process"].wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                run["process"].kill()
                run["process"].wait()
        run["seconds"] = time.monotonic() - started
        run["log"].close()
    return runs


def report(runs: list[dict], collected: int) -> str:
    """A table of each process's counts, then every failure's line, then how many ids did not run."""
    lines = [f"{'group':>5} {'ids':>5} " + " ".join(f"{word:>8}" for word in COUNTED) + "  seconds  ended"]
    totals = dict.fromkeys(COUNTED, 0)
    failures = []
    for run in runs:
        log = run["log_path"].read_text(errors="replace")
        found = counts(log)
        for word in COUNTED:
            totals[word] += found.get(word, 0)
        if run["stopped"]:
            ended = "stopped at the limit" if found else "stopped at the limit, no summary"
        else:
            ended = f"exit {run['process'].returncode}"
        row = " ".join(f"{found.get(word, '?')!s:>8}" for word in COUNTED)
        lines.append(f"{run['group']:>5} {run['ids']:>5} {row}  {run['seconds']:7.0f}  {ended}")
        failures += [line for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    ran = sum(totals.values())
    lines.append(f"{'all':>5} {collected:>5} " + " ".join(f"{totals[word]:>8}" for word in COUNTED))
    lines += failures
    lines.append(f"{ran} of {collected} collected ids ran; {collected - ran} did not (logs: group<N>.log)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=6, help="pytest processes at once (default 6)")
    parser.add_argument("--limit", type=float, default=480, help="seconds before each process is stopped (480)")
    parser.add_argument("--output", type=Path, default=Path("suite-logs"), help="folder for each process's log")
    parser.add_argument("--compile_threads", type=int, default=2, help="TORCHINDUCTOR_COMPILE_THREADS of each (2)")
    parser.add_argument(
        "--part",
        default="1/1",
        help="K/N: only every N-th collected id from the K-th, to split the suite over N calls",
    )
    parser.add_argument("selection", nargs="*", default=["tests"], help="after --: what pytest collects")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, not {args.processes}")
    part = re.fullmatch(r"(\d+)/(\d+)", args.part)
    if not part or not 1 <= int(part[1]) <= int(part[2]):
        parser.error(f"--part takes K/N with 1 ≤ K ≤ N, not {args.part!r}")
    collected = collect(args.selection)
    ids = collected[int(part[1]) - 1 :: int(part[2])]
    groups = deal(ids, args.processes)
    processes = f"{len(groups)} process" + ("es" if len(groups) > 1 else "")
    heading = (
        f"{len(ids)} of {len(collected)} collected test ids (part {args.part}) in {processes}, "
        f"{args.limit:.0f} s each at most"
    )
    print(heading, flush=True)
    runs = run_groups(groups, args.limit, args.output, args.compile_threads)
    text = report(runs, len(ids))
    (args.output / "summary.txt").write_text(f"{heading}\n{text}\n")
    print(text)
    return 0 if all(not run["stopped"] and run["process"].returncode == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
