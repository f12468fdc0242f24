"""The handouts' command line, unchanged, on top of hf_knowgpt:

    python scripts/run.py pretrain vanilla wiki.txt --writing_params_path vanilla.pretrain.params
    python scripts/run.py finetune vanilla wiki.txt --reading_params_path vanilla.pretrain.params \\
        --writing_params_path vanilla.finetune.params --finetune_corpus_path birth_places_train.tsv
    python scripts/run.py evaluate vanilla wiki.txt --reading_params_path vanilla.finetune.params \\
        --eval_corpus_path birth_dev.tsv --outputs_path vanilla.pretrain.dev.predictions

Every command printed in the 2021, 2023 and 2024 handouts runs as written. The params paths become
checkpoint folders (loadable with from_pretrained); a --reading_params_path that is a state dict saved by
the handouts' own code is converted on the fly. --max_epochs shortens a run. A --writing_params_path that
holds a run is never replaced without --overwrite_output_dir; a run stopped by Ctrl-C saves a checkpoint
and continues with the same command plus --resume_from_checkpoint latest.
"""

import argparse
from pathlib import Path

from ..options import ATTENTION_TYPES
from ..utils.errors import InputError
from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suppress = argparse.SUPPRESS
    parser.add_argument("function", choices=["pretrain", "finetune", "evaluate"], help="what to do")
    parser.add_argument("variant", choices=ATTENTION_TYPES, help="attention variant")
    parser.add_argument("pretrain_corpus_path", help="the pretraining corpus (wiki.txt): vocabulary and schedule size")
    parser.add_argument("--reading_params_path", default=None, help="checkpoint to start from or to evaluate")
    parser.add_argument("--writing_params_path", default=None, help="where to save the trained checkpoint")
    parser.add_argument("--finetune_corpus_path", default=None, help="question TAB place lines for finetuning")
    parser.add_argument("--eval_corpus_path", default=None, help="questions to answer when evaluating")
    parser.add_argument("--outputs_path", default=None, help="where evaluation writes its predictions")
    parser.add_argument(
        "--pretrain_lr", dest="pretrain.learning_rate", type=float, default=suppress,
        help="pretraining learning rate (handout: 6e-3)",
    )  # fmt: skip
    parser.add_argument(
        "--finetune_lr", dest="finetune.learning_rate", type=float, default=suppress,
        help="finetuning learning rate (handout: 6e-4)",
    )  # fmt: skip
    parser.add_argument(
        "--bottleneck_dim", dest="model.bottleneck_dim", type=int, default=suppress,
        help="perceiver latent positions (2023 handout: 32)",
    )  # fmt: skip
    parser.add_argument(
        "--tb_expt_name",
        dest="run.run_name",
        default=suppress,
        help="TensorBoard run name (logs go to the checkpoint folder)",
    )
    parser.add_argument(
        "--max_epochs",
        dest="run.max_epochs",
        type=int,
        default=suppress,
        help="shorten the run (default: the handouts')",
    )
    parser.add_argument("--seed", dest="run.seed", type=int, default=suppress, help="seed (0)")
    parser.add_argument(
        "--overwrite_output_dir", dest="run.overwrite_output_dir", action=cli.BooleanFlag,
        help="replace a --writing_params_path that holds another run (otherwise it is never replaced)",
    )  # fmt: skip
    parser.add_argument(
        "--resume_from_checkpoint", dest="run.resume_from_checkpoint", default=suppress,
        help="continue an interrupted run: 'latest', or a checkpoint-N folder of --writing_params_path",
    )  # fmt: skip
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def given_settings(args) -> dict:
    """The flags given, for the stage that runs; the variant names the model of a new run only."""
    given = cli.given_settings(args)
    if args.function != "evaluate" and not (args.function == "finetune" and args.reading_params_path):
        given["model.attention_type"] = args.variant
    elif args.function == "finetune":  # a pretrained model keeps its own configuration
        given = {name: value for name, value in given.items() if not name.startswith("model.")}
    # handouts' run.py trains one stage: its flags are that stage's
    return {name.replace("run.", f"{args.function}.", 1) if name.startswith("run.") else name: value
            for name, value in given.items()}  # fmt: skip


def run_config(args):
    """The run's settings and files, resolved from the handouts' recipe and the flags given."""
    from data_loaders.corpus import DataFiles

    from ..training.run_config import plan_finetuning, plan_pretraining

    given = given_settings(args)
    if args.function == "pretrain":
        if not args.writing_params_path:
            raise InputError("run.py pretrain", "needs --writing_params_path", "where the trained model goes")
        files = DataFiles(corpus=Path(args.pretrain_corpus_path))
        return cli.checked_plan(plan_pretraining("handout", given, files, args.writing_params_path), given), files
    if not args.writing_params_path or not args.finetune_corpus_path:
        raise InputError("run.py finetune", "needs --writing_params_path and --finetune_corpus_path")
    files = DataFiles(corpus=Path(args.pretrain_corpus_path), train=Path(args.finetune_corpus_path))
    config = plan_finetuning("handout", given, files, args.writing_params_path, args.reading_params_path)
    return cli.checked_plan(config, given), files


def main(argv=None):
    args = parse_args(argv)
    if args.function == "evaluate":
        if not args.reading_params_path or not args.eval_corpus_path:
            raise InputError("run.py evaluate", "needs --reading_params_path and --eval_corpus_path")
        from ..training import workflows

        cli.libraries_loaded()
        result = workflows.evaluate_birthplaces(
            readable_checkpoint(args), eval_corpus_path=args.eval_corpus_path, outputs_path=args.outputs_path
        )
        print(result["message"])
        return
    config, files = run_config(args)
    cli.print_run_config(config)
    from ..training import workflows

    if args.function == "pretrain":
        cli.run_training(workflows.run_pretraining, config, files)
    else:
        cli.run_training(workflows.run_finetuning, config, files, model_name_or_path=readable_checkpoint(args))


def readable_checkpoint(args):
    """A checkpoint folder as is; a state dict saved by the handouts' code converted next to it."""
    path = args.reading_params_path
    if path is None or Path(path).is_dir():
        return path
    from ..convert_cs224n import convert_cs224n_checkpoint

    converted = Path(f"{path}.hf")
    convert_cs224n_checkpoint(path, args.pretrain_corpus_path, converted)
    print(f"Converted the handout checkpoint {path} to {converted}")
    return str(converted)


if __name__ == "__main__":
    cli.run_script(main)
