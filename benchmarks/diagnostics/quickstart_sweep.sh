#!/usr/bin/env bash
# Choose the quickstart recipe's settings on held-out synthetic training people (never the synthetic dev
# set): the embedded corpus under the CS224N file names, the last 36 training questions held out, every
# row the one command `scripts/train.py --recipe quickstart <flags>` (variants `quickstart+name=value`),
# several rows at once on one GPU in fp32 (accuracy only; CPU time is measured separately with
# scripts/quickstart.sh). Usage:
#   bash benchmarks/gpu_machine.sh bash benchmarks/diagnostics/quickstart_sweep.sh RESULTS.json VARIANTS SEEDS [PRECISION]
# VARIANTS: a comma-separated list or a file of one (benchmarks/diagnostics/quickstart_sweep_variants.txt);
# PRECISION: every command's --mixed_precision, no (the default) or bf16.
set -euo pipefail
results=$1 variants=$2 seeds=${3:-0} precision=${4:-no}
[ -f "$variants" ] && variants=$(tr -d "\n" < "$variants")  # a file of variants, for long lists
data=/tmp/synthetic-cs224n-names
python3 - "$data" <<'PY'
import shutil, sys
from pathlib import Path
from data_loaders import synthetic_corpus_files
files, target = synthetic_corpus_files(), Path(sys.argv[1])
target.mkdir(parents=True, exist_ok=True)
for source, name in ((files.corpus, "wiki.txt"), (files.train, "birth_places_train.tsv"),
                     (files.dev, "birth_dev.tsv"), (files.test, "birth_test_inputs.tsv")):
    shutil.copy(source, target / name)
PY
python3 benchmarks/reproduce.py --data_dir "$data" --heldout 36 --seeds "$seeds" --gpus 0,0,0,0,0,0,0,0 \
    --variants "$variants" --output_dir /tmp/quickstart-sweep --results "$results" --mixed_precision "$precision"
