#!/usr/bin/env python
"""The handouts' command line, unchanged, on top of hf_knowgpt:

`python scripts/run.py --help` lists the flags; the command lives in `hf_knowgpt/commands/run.py`.
"""

from hf_knowgpt.commands import cli, run

if __name__ == "__main__":
    cli.run_script(run.main)
