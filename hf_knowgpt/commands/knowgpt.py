"""The `knowgpt` console script: `knowgpt <command> [flags]` runs the command as `python scripts/<command>.py
[flags]` does (`knowgpt evaluate` is `scripts/evaluate_checkpoint.py`), under `accelerate launch` too:
`accelerate launch -m hf_knowgpt.commands.knowgpt train ...`."""

import importlib
import sys

COMMANDS = {
    "train": "a whole recipe: pretraining → finetuning → dev accuracy → test predictions",
    "pretrain": "pretrain with span corruption",
    "finetune": "finetune to answer birthplace questions",
    "evaluate": "answer a file of questions with a checkpoint and score the answers",
    "ask": "ask a checkpoint where people were born",
    "quickstart": "the main job on the synthetic corpus: train, the comparison without pretraining, ask",
    "analyze_knowledge": "a checkpoint's knowledge report: calibration, selective accuracy, made-up people",
    "london_baseline": "the handouts' London baseline",
    "run": "the handouts' command line (run.py pretrain|finetune|evaluate ...)",
    "convert_cs224n_checkpoint": "convert a model saved by the handouts' code",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return "usage: knowgpt <command> [flags]   (knowgpt <command> --help lists its flags)\n\ncommands:\n" + "\n".join(
        lines
    )


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, flags = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"knowgpt: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    command = importlib.import_module(f"hf_knowgpt.commands.{name}")
    cli = importlib.import_module("hf_knowgpt.commands.cli")
    sys.argv = [f"knowgpt {name}", *flags]  # the command's --help and errors name it as typed
    cli.main_guard(command.main)
    return 0


def console():
    """The console script: `main` in a process that ends as soon as the command is done, as the scripts' do
    (`cli.run_script`)."""
    from . import cli

    cli.run_script(main)


if __name__ == "__main__":
    console()
