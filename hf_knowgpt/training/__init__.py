"""Training KnowGPT: named recipes (`recipes`) and the one resolution of a run's settings from a recipe and
the flags given (`run_config`), the run's hyperparameters (`arguments`), what a step reads (`data`), the
handouts' optimizer groups and schedule (`optimization`), the loop (`trainer`) and how it shows its
progress (`progress`), the three ways a step runs, CUDA graphs included (`fast_path`), and a recipe's stages
as functions (`workflows`). Nothing is imported here: `recipes`, `run_config` and `arguments` load without
torch, so the scripts answer `--help` at once."""
