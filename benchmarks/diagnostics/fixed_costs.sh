#!/usr/bin/env bash
# Where a warm `scripts/train.py` and `scripts/evaluate_checkpoint.py` spend the seconds that are not steps:
# the documented handout command cold (fills the caches), warm as it is and warm under py-spy; then
# evaluate_checkpoint.py on its checkpoint as it is, with scipy and scikit-learn hidden (packages the GPU image
# has and `pip install -e .` does not bring), under py-spy and under -X importtime. Run on the GPU machine:
#   bash benchmarks/gpu_machine.sh bash benchmarks/diagnostics/fixed_costs.sh
# with py-spy's wheel in .whl_tools/ (carried). Raw samples and import times land in $OUT; read the samples with
# benchmarks/diagnostics/sampled_stacks.py.
set -u
D=.data
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/tools .whl_tools/*.whl
SPY=/tmp/tools/bin/py-spy
T() { local s=$(date +%s%N); "$@" > /tmp/last.log 2>&1; local rc=$?; echo "$(( ($(date +%s%N) - s) / 1000000 )) ms rc=$rc :: ${*:0:12}"; [ $rc = 0 ] || tail -5 /tmp/last.log; }
TRAIN=(scripts/train.py --recipe handout --attention_type vanilla --data_dir $D --mixed_precision bf16 --torch_compile auto)
timeline() { python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/results.json"))
marks = d["timeline"]
for (name, at), (_, previous) in zip(marks[1:], marks[:-1]):
    print(f"  {at - previous:7.3f}  {name}")
for stage in ("pretrain", "finetune"):
    s = d["stages"][stage]
    print(f"  {stage}: load {s.get('load_seconds', 0):.3f} warm-up {s['warmup_seconds']:.3f} train {s['train_seconds']:.3f}")
PY
}
HIDE="import runpy, sys; sys.modules.update(scipy=None, sklearn=None); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
EVAL=(scripts/evaluate_checkpoint.py --model_name_or_path /tmp/r1/finetuned --eval_corpus_path $D/birth_dev.tsv --outputs_path /tmp/e)

T python3 "${TRAIN[@]}" --output_dir /tmp/r1
sleep 20  # the detached compile of a first `auto` run
T python3 "${TRAIN[@]}" --output_dir /tmp/r2
timeline /tmp/r2
T "$SPY" record -r 250 --idle --nonblocking -f raw -o "$OUT/train_warm.raw" -- python3 "${TRAIN[@]}" --output_dir /tmp/r3
timeline /tmp/r3
T python3 "${TRAIN[@]}" --output_dir /tmp/r4
timeline /tmp/r4
T python3 -c "$HIDE" "${TRAIN[@]}" --output_dir /tmp/r5
timeline /tmp/r5
for round in 1 2 3; do
  T python3 "${EVAL[@]}"
  T python3 -c "$HIDE" "${EVAL[@]}"
done
T "$SPY" record -r 250 --idle --nonblocking -f raw -o "$OUT/evaluate.raw" -- python3 "${EVAL[@]}"
python3 -X importtime "${EVAL[@]}" 2> /tmp/imp.txt > /dev/null
sort -t'|' -k2 -n -r /tmp/imp.txt | head -60 > "$OUT/evaluate_importtime.txt"
python3 -X importtime -c "$HIDE" "${EVAL[@]}" 2> /tmp/imp2.txt > /dev/null
sort -t'|' -k2 -n -r /tmp/imp2.txt | head -60 > "$OUT/evaluate_importtime_hidden.txt"
head -12 "$OUT/evaluate_importtime.txt" "$OUT/evaluate_importtime_hidden.txt"
