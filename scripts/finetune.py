#!/usr/bin/env python
"""Finetune KnowGPT to answer "Where was [person] born?", the handouts' recipe by default.

`python scripts/finetune.py --help` lists the flags; the command lives in `hf_knowgpt/commands/finetune.py`.
"""

from hf_knowgpt.commands import cli, finetune

if __name__ == "__main__":
    cli.run_script(finetune.main)
