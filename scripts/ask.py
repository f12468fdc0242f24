#!/usr/bin/env python
"""Ask a checkpoint where people were born, through the "birthplace-qa" pipeline.

`python scripts/ask.py --help` lists the flags; the command lives in `hf_knowgpt/commands/ask.py`.
"""

from hf_knowgpt.commands import ask, cli

if __name__ == "__main__":
    cli.run_script(ask.main)
