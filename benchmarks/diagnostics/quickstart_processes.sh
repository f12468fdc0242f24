#!/usr/bin/env bash
# The quick start's three commands as three processes (as scripts/quickstart.sh ran them before) against
# scripts/quickstart.py (one process), alternating, with the trainings shortened by the flags given, so that
# what differs (start-up, imports) is not lost in the machine's drift:
#   bash benchmarks/diagnostics/quickstart_processes.sh ROUNDS --pretrain_max_epochs 10 --finetune_max_epochs 3
# Prints each run's wall seconds and the seconds each training reported.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=$1
shift
precision=no
if grep -qswE "avx512_bf16|amx_bf16" /proc/cpuinfo; then precision=bf16; fi
out=$(mktemp -d)
dev=$(python -c "from data_loaders import synthetic_corpus_files; print(synthetic_corpus_files().dev)")
three() {
  python scripts/train.py --mixed_precision $precision --recipe quickstart --output_dir "$out/q" --overwrite_output_dir "$@"
  python scripts/train.py --mixed_precision $precision --recipe quickstart --no_do_pretrain --output_dir "$out/q-scratch" --overwrite_output_dir "$@"
  python scripts/ask.py --model_name_or_path "$out/q/pretrained" --from_file "$dev" --limit 5
}
one() { python scripts/quickstart.py --mixed_precision $precision --output_dir "$out/q" "$@"; }
for round in $(seq "$rounds"); do
  for way in three one; do
    started=$(date +%s.%N)
    $way "$@" > "$out/log" 2>&1
    seconds=$(python -c "import time; print(f'{time.time() - $started:.1f}')")
    trained=$(grep -o "[0-9.]* s on CPU" "$out/log" | cut -d' ' -f1 | paste -sd/)
    echo "round $round  $way process(es): ${seconds} s whole, trainings ${trained} s, $(grep -c '→' "$out/log") answers"
  done
done
rm -rf "$out"
