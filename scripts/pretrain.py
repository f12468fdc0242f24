#!/usr/bin/env python
"""Pretrain KnowGPT with span corruption, the handouts' recipe by default.

    accelerate launch scripts/pretrain.py --attention_type rope                     # synthetic corpus
    accelerate launch scripts/pretrain.py --pretrain_corpus_path wiki.txt --attention_type rope
    accelerate launch --mixed_precision bf16 --num_processes 2 scripts/pretrain.py ...

The output directory is a `save_pretrained` checkpoint (config, safetensors, tokenizer, model card,
training arguments and metrics); `--checkpointing_steps` adds resumable checkpoint-N folders.
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
        "--pretrain_corpus_path", default=None, help="one document per line (wiki.txt); default: the synthetic corpus"
    )
    parser.add_argument(
        "--mixed_training_corpus_path",
        default=None,
        help="question TAB place lines mixed into every pretraining epoch (the knowledge recipe's mixed training)",
    )
    parser.add_argument(
        "--min_truncation_length",
        type=int,
        default=None,
        help="shortest document prefix an example reads (handout: 4; knowledge recipe: 112, the whole ⌊7B/8⌋)",
    )
    add_model_arguments(parser)
    add_training_arguments(parser)
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or f"outputs/pretrain-{args.attention_type or args.recipe}"
    return args


def main(argv=None):
    args = parse_args(argv)
    run_training(
        workflows.pretrain,
        args.output_dir,
        attention_type=args.attention_type,
        pretrain_corpus_path=args.pretrain_corpus_path,
        mixed_training_corpus_path=args.mixed_training_corpus_path,
        min_truncation_length=args.min_truncation_length,
        **workflow_arguments(args),
    )


if __name__ == "__main__":
    main()
