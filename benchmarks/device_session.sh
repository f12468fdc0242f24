#!/usr/bin/env bash
# Prepare the GPU machine of the `device` tool and run a command there:
#   bash benchmarks/device_session.sh python3 benchmarks/bench_recipe.py --data_dir .data --full
# The machine has torch, transformers and accelerate but not datasets/evaluate: their wheels travel in .whl/
# (../shared/device/wheels.sh), and the CS224N files in .data/ (both git-ignored, named in `carry`).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" KNOWGPT_DATA="$PWD/.data" KNOWGPT_CACHE=/tmp/knowgpt-cache
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, accelerate, datasets, evaluate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
exec "$@"
