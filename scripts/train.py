#!/usr/bin/env python
"""A whole recipe in one command: pretraining → finetuning (when the recipe has it) → dev accuracy → test predictions.

`python scripts/train.py --help` lists the flags; the command lives in `hf_knowgpt/commands/train.py`.
"""

from hf_knowgpt.commands import cli, train

if __name__ == "__main__":
    cli.run_script(train.main)
