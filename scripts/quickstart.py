#!/usr/bin/env python
"""The main job on the embedded synthetic corpus, in one process (what `bash scripts/quickstart.sh` runs).

`python scripts/quickstart.py --help` lists the flags; the command lives in `hf_knowgpt/commands/quickstart.py`.
"""

from hf_knowgpt.commands import cli, quickstart

if __name__ == "__main__":
    cli.run_script(quickstart.main)
