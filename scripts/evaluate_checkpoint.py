#!/usr/bin/env python
"""Answer every question of a birthplace TSV and score the answers when the file has gold places.

`python scripts/evaluate_checkpoint.py --help` lists the flags; the command lives in `hf_knowgpt/commands/evaluate.py`.
"""

from hf_knowgpt.commands import cli, evaluate

if __name__ == "__main__":
    cli.run_script(evaluate.main)
