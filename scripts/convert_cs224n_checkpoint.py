#!/usr/bin/env python
"""Convert a model saved by the CS224N handouts' code (`torch.save(model.state_dict(), path)`) into a

`python scripts/convert_cs224n_checkpoint.py --help` lists the flags; the command lives in `hf_knowgpt/commands/convert_cs224n_checkpoint.py`.
"""

from hf_knowgpt.commands import cli, convert_cs224n_checkpoint

if __name__ == "__main__":
    cli.run_script(convert_cs224n_checkpoint.main)
