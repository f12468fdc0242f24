"""The main job on the embedded synthetic corpus, in one process: the quickstart recipe (pretraining with
the training questions mixed in → dev accuracy → test predictions), the questions alone trained from
scratch for comparison, then questions asked through the "birthplace-qa" pipeline. It runs what these
three commands run, paying for the imports of torch and transformers once instead of three times (3.5–4 s
per process on a 2-core CPU):

    python scripts/train.py --recipe quickstart --output_dir OUT --overwrite_output_dir
    python scripts/train.py --recipe quickstart --no_do_pretrain --output_dir OUT-scratch --overwrite_output_dir
    python scripts/ask.py --model_name_or_path OUT/pretrained --from_file DEV --limit 5

Flags it does not know go to both trainings (`--mixed_precision bf16`, `--pretrain_max_epochs 2
--finetune_max_epochs 2`, say).
"""

import argparse
from pathlib import Path

from . import ask, cli, train

PIPELINE_QUESTIONS = 5


def parse_args(argv=None):
    # the flags it does not know go to train.py whole: none may be read as an abbreviation of these
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--output_dir", default="outputs/quickstart", help="the run's folder (replaced if it exists)")
    parser.add_argument("--eval_corpus_path", default=None, help="dev questions (default: the synthetic dev set)")
    return parser.parse_known_args(argv)


def main(argv=None):
    args, train_flags = parse_args(argv)
    common = ["--recipe", "quickstart", "--overwrite_output_dir"]
    if args.eval_corpus_path is not None:
        common += ["--eval_corpus_path", args.eval_corpus_path]
    common += train_flags
    print("== with pretraining", flush=True)
    train.main([*common, "--output_dir", args.output_dir])
    print("== without pretraining", flush=True)
    train.main([*common, "--no_do_pretrain", "--output_dir", f"{args.output_dir}-scratch"])
    print('== asking the pretrained model through pipeline("birthplace-qa")', flush=True)
    dev = args.eval_corpus_path
    if dev is None:
        from data_loaders import synthetic_corpus_files

        dev = synthetic_corpus_files().dev
    pretrained = Path(args.output_dir) / "pretrained"
    ask.main(["--model_name_or_path", str(pretrained), "--from_file", str(dev), "--limit", str(PIPELINE_QUESTIONS)])


if __name__ == "__main__":
    cli.run_script(main)
