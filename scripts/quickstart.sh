#!/usr/bin/env bash
# The main job on the embedded synthetic biography corpus, sized for a CPU: the quickstart recipe in one
# command (pretraining with the questions mixed in → dev accuracy → test predictions), the questions alone
# trained from scratch for comparison, then questions asked through the "birthplace-qa" pipeline. Pass a
# folder to write elsewhere (default outputs/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/quickstart}
# one process on all CPU threads: plain python (`accelerate launch` would add 2.5–3.3 s to each run here);
# bf16 autocast where the CPU has bf16 instructions (AVX-512 BF16 or AMX: a fifth less time on the project's
# CPU), fp32 elsewhere, where bf16 would be emulated and slower
precision=no
if grep -qswE "avx512_bf16|amx_bf16" /proc/cpuinfo; then precision=bf16; fi
launch="python scripts/train.py --mixed_precision $precision"

echo "== with pretraining"
$launch --recipe quickstart --output_dir "$out" --overwrite_output_dir
echo "== without pretraining"
$launch --recipe quickstart --no_do_pretrain --output_dir "$out-scratch" --overwrite_output_dir
echo "== asking the pretrained model through pipeline(\"birthplace-qa\")"
dev=$(python -c "from data_loaders import synthetic_corpus_files; print(synthetic_corpus_files().dev)")
python scripts/ask.py --model_name_or_path "$out/pretrained" --from_file "$dev" --limit 5
