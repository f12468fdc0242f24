"""A whole recipe in one command: pretraining → finetuning (when the recipe has it) → dev accuracy → test predictions.

    accelerate launch scripts/train.py --recipe handout --attention_type vanilla --data_dir ../shared/data --output_dir runs/vanilla
    accelerate launch --mixed_precision bf16 scripts/train.py --recipe knowledge --data_dir ../shared/data --output_dir runs/knowledge
    accelerate launch scripts/train.py --recipe quickstart                          # the synthetic corpus

--data_dir names a folder with the CS224N files (wiki.txt, birth_places_train.tsv, birth_dev.tsv,
birth_test_inputs.tsv); each can also be given on its own. Every flag not given takes the --recipe's
value; the resolved configuration is printed first. Checkpoints go to OUTPUT_DIR/pretrained and
OUTPUT_DIR/finetuned (the same folders pretrain.py and finetune.py write), predictions to
OUTPUT_DIR/dev.predictions and OUTPUT_DIR/test.predictions, timings and accuracy to OUTPUT_DIR/results.json;
the dev accuracy is printed the handouts' way (`Correct: x out of N: y%`). Stage-specific values take a
prefix (--pretrain_max_epochs, --finetune_learning_rate); the others apply to both stages.
"""

import argparse

from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_recipe_argument(parser)
    files = parser.add_argument_group("data files")
    files.add_argument(
        "--data_dir", default=None, help="folder with the four CS224N files (default: synthetic corpus)"
    )
    files.add_argument("--pretrain_corpus_path", default=None, help="pretraining corpus (default: DATA_DIR/wiki.txt)")
    files.add_argument(
        "--train_corpus_path",
        "--finetune_corpus_path",
        default=None,
        help="training questions, question TAB place (finetuning, mixed training; default: DATA_DIR/birth_places_train.tsv)",
    )
    files.add_argument(
        "--eval_corpus_path", default=None, help="questions scored after training (DATA_DIR/birth_dev.tsv)"
    )
    files.add_argument(
        "--test_corpus_path", default=None, help="questions answered, not scored (DATA_DIR/birth_test_inputs.tsv)"
    )
    stages = parser.add_argument_group("stages")
    stages.add_argument(
        "--do_pretrain",
        action=cli.BooleanFlag,
        default=True,
        help="pretrain first (default on; off: finetune from scratch)",
    )
    stages.add_argument(
        "--do_finetune",
        action=cli.BooleanFlag,
        default=None,
        help="finetune (default: when the recipe has that stage)",
    )
    cli.add_finetune_recipe_argument(stages)
    parser.add_argument("--eval_batch_size", type=int, default=512, help="questions decoded together")
    cli.add_model_arguments(parser)
    cli.add_data_arguments(parser)
    cli.add_training_arguments(parser, stage=None)
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def run_config(args):
    """The run's settings and files, resolved from the recipe and the flags given."""
    return cli.recipe_plan(args)


def main(argv=None):
    from ..utils import timeline

    timeline.reset()
    timeline.mark("interpreter and command start-up")
    args = parse_args(argv)
    config, files = run_config(args)
    cli.print_run_config(config)
    timeline.mark("flags read, recipe resolved (first imports of torch and transformers)")
    from ..training import workflows

    timeline.mark("libraries imported")

    return cli.run_training(
        workflows.run_recipe,
        config,
        files,
        args.output_dir,
        hub=cli.hub_options(args),
        eval_batch_size=args.eval_batch_size,
    )


if __name__ == "__main__":
    cli.run_script(main)
