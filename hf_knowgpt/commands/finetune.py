"""Finetune KnowGPT to answer "Where was [person] born?", the handouts' recipe by default.

    accelerate launch scripts/finetune.py --model_name_or_path outputs/pretrain-vanilla     # 10 epochs
    accelerate launch scripts/finetune.py --pretrain_corpus_path wiki.txt \\
        --finetune_corpus_path birth_places_train.tsv                                       # from scratch, 75 epochs

Without --model_name_or_path the model starts from scratch with the vocabulary of the pretraining corpus,
as the handouts do. The schedule's final_tokens is 200 · (pretraining documents) · block_size. Every flag
not given takes the --recipe's value.
"""

import argparse

from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_recipe_argument(parser)
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
    cli.add_finetune_recipe_argument(parser)
    cli.add_model_arguments(parser)
    cli.add_training_arguments(parser, stage="finetune")
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def run_config(args):
    """The run's settings and files, resolved from the recipe and the flags given."""
    return cli.finetuning_plan(args)


def main(argv=None):
    args = parse_args(argv)
    config, files = run_config(args)
    cli.print_run_config(config)
    from ..training import workflows

    cli.run_training(
        workflows.run_finetuning,
        config,
        files,
        model_name_or_path=args.model_name_or_path,
        hub=cli.hub_options(args),
    )


if __name__ == "__main__":
    cli.run_script(main)
