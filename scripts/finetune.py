#!/usr/bin/env python
"""Finetune KnowGPT to answer "Where was [person] born?", the handouts' recipe by default.

    accelerate launch scripts/finetune.py --model_name_or_path outputs/pretrain-vanilla     # 10 epochs
    accelerate launch scripts/finetune.py --pretrain_corpus_path wiki.txt \\
        --finetune_corpus_path birth_places_train.tsv                                       # from scratch, 75 epochs

Without --model_name_or_path the model starts from scratch with the vocabulary of the pretraining corpus,
as the handouts do. The schedule's final_tokens is 200 · (pretraining documents) · block_size.
"""

import _no_shadowing  # noqa: F401, I001  (must come before anything imports `evaluate`)
import argparse

from hf_knowgpt import workflows
from hf_knowgpt.cli import (
    add_model_arguments,
    add_training_arguments,
    run_training,
    workflow_arguments,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model_name_or_path", default=None, help="pretrained checkpoint folder or Hub id; omit to start from scratch"
    )
    parser.add_argument(
        "--finetune_corpus_path", default=None, help="question TAB place lines; default: the synthetic train set"
    )
    parser.add_argument(
        "--pretrain_corpus_path",
        default=None,
        help="the pretraining corpus: vocabulary when starting from scratch, and the schedule's corpus size",
    )
    add_model_arguments(parser)
    add_training_arguments(parser)
    args = parser.parse_args(argv)
    if args.output_dir is None:
        args.output_dir = "outputs/finetune-" + (
            "pretrained" if args.model_name_or_path else f"scratch-{args.attention_type or args.recipe}"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    run_training(
        workflows.finetune,
        args.output_dir,
        model_name_or_path=args.model_name_or_path,
        finetune_corpus_path=args.finetune_corpus_path,
        pretrain_corpus_path=args.pretrain_corpus_path,
        attention_type=args.attention_type,
        **workflow_arguments(args),
    )


if __name__ == "__main__":
    main()
