#!/usr/bin/env python
"""Does a checkpoint know when it does not know? Writes report.md and PNG plots.

`python scripts/analyze_knowledge.py --help` lists the flags; the command lives in `hf_knowgpt/commands/analyze_knowledge.py`.
"""

from hf_knowgpt.commands import analyze_knowledge, cli

if __name__ == "__main__":
    cli.run_script(analyze_knowledge.main)
