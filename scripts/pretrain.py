#!/usr/bin/env python
"""Pretrain KnowGPT with span corruption, the handouts' recipe by default.

`python scripts/pretrain.py --help` lists the flags; the command lives in `hf_knowgpt/commands/pretrain.py`.
"""

from hf_knowgpt.commands import cli, pretrain

if __name__ == "__main__":
    cli.run_script(pretrain.main)
