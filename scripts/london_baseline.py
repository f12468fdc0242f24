#!/usr/bin/env python
"""The handouts' London baseline: answer "London" to every question (5.0% on birth_dev.tsv).

`python scripts/london_baseline.py --help` lists the flags; the command lives in `hf_knowgpt/commands/london_baseline.py`.
"""

from hf_knowgpt.commands import cli, london_baseline

if __name__ == "__main__":
    cli.run_script(london_baseline.main)
