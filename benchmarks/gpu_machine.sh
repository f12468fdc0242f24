#!/usr/bin/env bash
# Prepare the GPU machine of the `device` tool and run a command there:
#   bash benchmarks/gpu_machine.sh python3 benchmarks/bench_recipe.py --data_dir .data --full
# The machine has torch, transformers and accelerate but not datasets/evaluate: their wheels travel in .whl/
# (../shared/device/wheels.sh), and the CS224N files in .data/ (both git-ignored, named in `carry`).
#
# Its processes did not reuse the packages' bytecode caches (.pyc), which `pip install` leaves on any
# ordinary machine: a process run after several others still spent 5.8 s compiling torch's and
# transformers' sources (cProfile, H100). Bytecode goes to /tmp/pycache instead, and one import of the
# stack fills it before anything is timed, as an install would have.
set -euo pipefail
# .whl_user/ (benchmarks/user_stack_wheels.sh, when carried): the Hugging Face stack as `pip install -e .`
# resolves it on a fresh machine, in place of the image's older one, so that timings are of what a user runs
wheels=(.whl/*.whl) && [ -d .whl_user ] && wheels+=(.whl_user/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
export PYTHONPATH="/tmp/site:$PWD" KNOWGPT_DATA="$PWD/.data" KNOWGPT_CACHE=/tmp/knowgpt-cache
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, accelerate, datasets, evaluate, triton, torch._inductor, torch._dynamo, sklearn, hf_knowgpt.training.workflows, hf_knowgpt.kernels.fused_attention; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
exec "$@"
