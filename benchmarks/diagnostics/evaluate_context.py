#!/usr/bin/env python
"""`scripts/evaluate_checkpoint.py` as a whole process with the CUDA context made on a thread while it imports
(`hf_knowgpt.utils.cuda_context`, as the script runs) and with the thread off (torch makes the context when it
first needs it), alternating round by round, the order swapped each round; the script itself is timed too. A
table of seconds per run and medians is printed last.

    python benchmarks/bench_user_path.py --data_dir DATA --runs auto-cold --workdir W
    python benchmarks/diagnostics/evaluate_context.py --workdir W --data_dir DATA --rounds 5 [--python P]

W is a folder of bench_user_path.py's runs: its last run's finetuned checkpoint answers the dev questions. P is
the interpreter to run (say one of `benchmarks/pip_environment.py`'s, with PYTHONPATH emptied as a user's shell
has it); this one by default.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_user_path import SCRIPTS, accuracy_line, last_finetuned_checkpoint, timed  # noqa: E402

# the script's own lines, with the thread set on or off first
WRAPPER = """import sys
from hf_knowgpt.utils import cuda_context
cuda_context.ENABLED = {enabled}
from hf_knowgpt.commands import cli, evaluate
sys.argv = ["evaluate_checkpoint.py", *sys.argv[1:]]
cli.run_script(evaluate.main)
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="bench_user_path.py's --workdir, a run done")
    parser.add_argument("--data_dir", required=True, help="folder with the CS224N files")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run the script with")
    parser.add_argument("--output", default=None, help="write every measurement as JSON here")
    args = parser.parse_args(argv)

    work, data = Path(args.workdir).resolve(), Path(args.data_dir).resolve()
    checkpoint = last_finetuned_checkpoint(work, parser)
    flags = ["--model_name_or_path", checkpoint, "--eval_corpus_path", data / "birth_dev.tsv"]
    sides = {
        "context on a thread": [args.python, "-c", WRAPPER.format(enabled=True)],
        "context by torch": [args.python, "-c", WRAPPER.format(enabled=False)],
        "scripts/evaluate_checkpoint.py": [args.python, SCRIPTS / "evaluate_checkpoint.py"],
    }
    seconds = {side: [] for side in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            tag = f"evaluate-context-{round_}-{list(sides).index(side)}"
            command = [*sides[side], *flags, "--outputs_path", work / f"{tag}.predictions"]
            elapsed, output = timed(command, work / f"{tag}.log")
            seconds[side].append(elapsed)
            print(f"{side}: {elapsed:.2f} s, {accuracy_line(output)}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"python": args.python, "seconds": seconds}, indent=2))
    print(f"\n{'evaluate_checkpoint.py, 500 questions':<36}{'seconds, in the order run':<44}{'median':>8}")
    for side, values in seconds.items():
        print(f"{side:<36}{' '.join(f'{s:.2f}' for s in values):<44}{statistics.median(values):>8.2f}")
    return seconds


if __name__ == "__main__":
    main()
