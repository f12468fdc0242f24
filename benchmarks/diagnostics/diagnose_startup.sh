#!/usr/bin/env bash
# Where does the user's wait go? Imports, accelerate's launcher, evaluate_checkpoint.py and a warm train.py under cProfile,
# and finetuning graphed against eager. Run on the GPU machine (it ran on an H100, 2026-11-27):
#   bash benchmarks/gpu_machine.sh bash benchmarks/diagnostics/diagnose_startup.sh 2>&1 | tee $OUT/diag.log
# (.data holds the CS224N files; the profiles land in $OUT for `python -m pstats`.)
set -u
D=.data
T() { local s=$(date +%s%N); "$@" > /tmp/last.log 2>&1; local rc=$?; echo "$(( ($(date +%s%N) - s) / 1000000 )) ms rc=$rc :: $*"; [ $rc = 0 ] || tail -5 /tmp/last.log; }
T python3 -c "import torch"
T python3 -c "import torch; torch.zeros(1, device='cuda')"
T python3 -c "import torch, transformers; from transformers import AutoModelForCausalLM, GenerationMixin"
T python3 -c "import accelerate; from accelerate import Accelerator"
T accelerate launch --num_processes 1 --num_machines 1 --mixed_precision bf16 --dynamo_backend no scripts/train.py --help
T python3 scripts/train.py --help
# a cold run fills the caches (and is the cold figure with compile for pretraining only)
T python3 scripts/train.py --recipe handout --attention_type vanilla --data_dir $D --mixed_precision bf16 --torch_compile --output_dir /tmp/r1
cp /tmp/last.log $OUT/cold_direct.log
python3 -X importtime scripts/evaluate_checkpoint.py --model_name_or_path /tmp/r1/finetuned --eval_corpus_path $D/birth_dev.tsv --outputs_path /tmp/e0 2> /tmp/imp.txt > /dev/null
sort -t'|' -k2 -n /tmp/imp.txt | tail -25 > $OUT/evaluate_importtime.txt
T python3 scripts/evaluate_checkpoint.py --model_name_or_path /tmp/r1/finetuned --eval_corpus_path $D/birth_dev.tsv --outputs_path /tmp/e1
T python3 -m cProfile -o $OUT/evaluate.prof scripts/evaluate_checkpoint.py --model_name_or_path /tmp/r1/finetuned --eval_corpus_path $D/birth_dev.tsv --outputs_path /tmp/e2
# warm: the documented command, then the same under cProfile
T python3 scripts/train.py --recipe handout --attention_type vanilla --data_dir $D --mixed_precision bf16 --torch_compile --output_dir /tmp/r2
cp /tmp/last.log $OUT/warm_direct.log
T accelerate launch --num_processes 1 --num_machines 1 --mixed_precision bf16 --dynamo_backend no scripts/train.py --recipe handout --attention_type vanilla --data_dir $D --torch_compile --output_dir /tmp/r3
T python3 -m cProfile -o $OUT/train_warm.prof scripts/train.py --recipe handout --attention_type vanilla --data_dir $D --mixed_precision bf16 --torch_compile --output_dir /tmp/r4
# finetuning alone: graphed (auto) against eager
T python3 scripts/finetune.py --model_name_or_path /tmp/r1/pretrained --finetune_corpus_path $D/birth_places_train.tsv --mixed_precision bf16 --output_dir /tmp/f1
T python3 scripts/finetune.py --model_name_or_path /tmp/r1/pretrained --finetune_corpus_path $D/birth_places_train.tsv --mixed_precision bf16 --training_path eager --output_dir /tmp/f2
for f in /tmp/r1 /tmp/r2 /tmp/r3 /tmp/r4; do python3 -c "import json,sys; d=json.load(open('$f/results.json')); p=d['stages']['pretrain']; f=d['stages']['finetune']; print('$f', round(d['seconds_in_run_recipe'],1), 'pre', round(p['train_seconds'],1), 'warm', round(p['warmup_seconds'],1), 'fin', round(f['train_seconds'],1), round(f['warmup_seconds'],1), d['dev'])"; done
for f in /tmp/f1 /tmp/f2; do python3 -c "import json; d=json.load(open('$f/train_results.json')); print('$f', d['train_seconds'], d['warmup_seconds'])"; done
