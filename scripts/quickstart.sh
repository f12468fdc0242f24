#!/usr/bin/env bash
# The main job on the embedded synthetic biography corpus, sized for a CPU:
# pretrain (span corruption) → finetune → evaluate → ask through the pipeline, and the same finetuning
# without pretraining for comparison. Pass a folder to write elsewhere (default outputs/quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/quickstart}
# accelerate gives each process one CPU thread unless told otherwise
launch="accelerate launch --num_processes 1 --num_cpu_threads_per_process $(nproc)"

$launch scripts/pretrain.py --recipe quickstart --output_dir "$out/pretrained" --overwrite_output_dir
$launch scripts/finetune.py --recipe quickstart --model_name_or_path "$out/pretrained" \
    --output_dir "$out/finetuned" --overwrite_output_dir
$launch scripts/finetune.py --recipe quickstart --output_dir "$out/scratch" --overwrite_output_dir

echo "== dev accuracy with pretraining"
python scripts/evaluate.py --model_name_or_path "$out/finetuned" --outputs_path "$out/finetuned.dev.predictions"
echo "== dev accuracy without pretraining"
python scripts/evaluate.py --model_name_or_path "$out/scratch" --outputs_path "$out/scratch.dev.predictions"
echo "== asking the pretrained+finetuned model through pipeline(\"birthplace-qa\")"
dev=$(python -c "from data_loaders import synthetic_corpus_files; print(synthetic_corpus_files().dev)")
python scripts/ask.py --model_name_or_path "$out/finetuned" --from_file "$dev" --limit 5
