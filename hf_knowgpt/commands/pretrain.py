"""Pretrain KnowGPT with span corruption, the handouts' recipe by default.

    accelerate launch scripts/pretrain.py --attention_type rope                     # synthetic corpus
    accelerate launch scripts/pretrain.py --pretrain_corpus_path wiki.txt --attention_type rope
    accelerate launch --mixed_precision bf16 --num_processes 2 scripts/pretrain.py ...

Every flag not given takes the --recipe's value. The output directory is a `save_pretrained` checkpoint
(config, safetensors, tokenizer, model card, training arguments and metrics); `--checkpointing_steps`
adds resumable checkpoint-N folders. `scripts/train.py` runs a whole recipe in one command.
"""

import argparse

from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_recipe_argument(parser)
    parser.add_argument(
        "--pretrain_corpus_path", default=None, help="one document per line (wiki.txt); default: the synthetic corpus"
    )
    parser.add_argument(
        "--mixed_training_corpus_path",
        default=None,
        help="question TAB place lines mixed into every pretraining epoch (the knowledge recipe's mixed training)",
    )
    cli.add_model_arguments(parser)
    cli.add_data_arguments(parser)
    cli.add_training_arguments(parser, stage="pretrain")
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def run_config(args):
    """The run's settings and files, resolved from the recipe and the flags given."""
    return cli.pretraining_plan(args)


def main(argv=None):
    args = parse_args(argv)
    config, files = run_config(args)
    cli.print_run_config(config)
    from ..training import workflows

    cli.run_training(workflows.run_pretraining, config, files, hub=cli.hub_options(args))


if __name__ == "__main__":
    cli.run_script(main)
