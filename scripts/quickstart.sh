#!/usr/bin/env bash
# The main job on the embedded synthetic biography corpus, sized for a CPU: the quickstart recipe in one
# command (pretraining with the questions mixed in → dev accuracy → test predictions), the questions alone
# trained from scratch for comparison, then questions asked through the "birthplace-qa" pipeline. Pass a
# folder to write elsewhere (default outputs/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/quickstart}
# every value accelerate would otherwise warn about, given; one process with all CPU threads
launch="accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no --num_cpu_threads_per_process $(nproc)"

echo "== with pretraining"
$launch scripts/train.py --recipe quickstart --output_dir "$out" --overwrite_output_dir
echo "== without pretraining"
$launch scripts/train.py --recipe quickstart --no_do_pretrain --output_dir "$out-scratch" --overwrite_output_dir
echo "== asking the pretrained model through pipeline(\"birthplace-qa\")"
dev=$(python -c "from data_loaders import synthetic_corpus_files; print(synthetic_corpus_files().dev)")
python scripts/ask.py --model_name_or_path "$out/pretrained" --from_file "$dev" --limit 5
