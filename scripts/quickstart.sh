#!/usr/bin/env bash
# The main job on the embedded synthetic corpus, sized for a CPU: the quickstart recipe in one command
# (pretraining with the questions mixed in → dev accuracy → test predictions), the questions alone
# trained from scratch for comparison, then questions asked through the "birthplace-qa" pipeline, all in
# one process (scripts/quickstart.py: torch and transformers imported once). Pass a folder to write
# elsewhere (default outputs/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/quickstart}
# plain python (`accelerate launch` would add 2.5–3.3 s here); bf16 autocast where the CPU has bf16
# instructions (AVX-512 BF16 or AMX: a fifth less time on the project's CPU), fp32 elsewhere, where bf16
# would be emulated and slower
precision=no
if grep -qswE "avx512_bf16|amx_bf16" /proc/cpuinfo; then precision=bf16; fi
exec python scripts/quickstart.py --mixed_precision "$precision" --output_dir "$out"
