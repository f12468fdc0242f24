"""The command lines: one module per command (`train`, `pretrain`, `finetune`, `evaluate`, `ask`,
`analyze_knowledge`, `london_baseline`, `run`, `convert_cs224n_checkpoint`), each a `parse_args` and a
`main`, run by `scripts/<command>.py` and by the `knowgpt <command>` console script (`knowgpt`); `cli`
holds the flags and plans they share."""
