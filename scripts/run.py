#!/usr/bin/env python
"""The handouts' command line, unchanged, on top of hf_knowgpt:

    python scripts/run.py pretrain vanilla wiki.txt --writing_params_path vanilla.pretrain.params
    python scripts/run.py finetune vanilla wiki.txt --reading_params_path vanilla.pretrain.params \\
        --writing_params_path vanilla.finetune.params --finetune_corpus_path birth_places_train.tsv
    python scripts/run.py evaluate vanilla wiki.txt --reading_params_path vanilla.finetune.params \\
        --eval_corpus_path birth_dev.tsv --outputs_path vanilla.pretrain.dev.predictions

Every command printed in the 2021, 2023 and 2024 handouts runs as written. The params paths become
checkpoint folders (loadable with from_pretrained); a --reading_params_path that is a state dict saved by
the handouts' own code is converted on the fly. --max_epochs shortens a run.
"""

import _no_shadowing  # noqa: F401, I001  (must come before anything imports `evaluate`)
import argparse
from pathlib import Path

from hf_knowgpt import workflows
from hf_knowgpt.configuration_knowgpt import ATTENTION_TYPES
from hf_knowgpt.convert_cs224n import convert_cs224n_checkpoint


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("function", choices=["pretrain", "finetune", "evaluate"], help="what to do")
    parser.add_argument("variant", choices=ATTENTION_TYPES, help="attention variant")
    parser.add_argument("pretrain_corpus_path", help="the pretraining corpus (wiki.txt): vocabulary and schedule size")
    parser.add_argument("--reading_params_path", default=None, help="checkpoint to start from or to evaluate")
    parser.add_argument("--writing_params_path", default=None, help="where to save the trained checkpoint")
    parser.add_argument("--finetune_corpus_path", default=None, help="question TAB place lines for finetuning")
    parser.add_argument("--eval_corpus_path", default=None, help="questions to answer when evaluating")
    parser.add_argument("--outputs_path", default=None, help="where evaluation writes its predictions")
    parser.add_argument("--pretrain_lr", type=float, default=6e-3, help="pretraining learning rate (handout: 6e-3)")
    parser.add_argument("--finetune_lr", type=float, default=6e-4, help="finetuning learning rate (handout: 6e-4)")
    parser.add_argument("--bottleneck_dim", type=int, default=32, help="perceiver latent positions (2023 handout)")
    parser.add_argument(
        "--tb_expt_name", default="run", help="TensorBoard run name (logs go to the checkpoint folder)"
    )
    parser.add_argument("--max_epochs", type=int, default=None, help="shorten the run (default: the handouts')")
    parser.add_argument("--seed", type=int, default=0, help="seed")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model_overrides = {"bottleneck_dim": args.bottleneck_dim}
    training = {
        "max_epochs": args.max_epochs,
        "seed": args.seed,
        "overwrite_output_dir": True,
        "run_name": args.tb_expt_name,
    }
    if args.function == "pretrain":
        if not args.writing_params_path:
            raise SystemExit("run.py pretrain needs --writing_params_path")
        workflows.pretrain(
            args.writing_params_path,
            attention_type=args.variant,
            pretrain_corpus_path=args.pretrain_corpus_path,
            model_overrides=model_overrides,
            training_overrides={**training, "learning_rate": args.pretrain_lr},
        )
    elif args.function == "finetune":
        if not args.writing_params_path or not args.finetune_corpus_path:
            raise SystemExit("run.py finetune needs --writing_params_path and --finetune_corpus_path")
        workflows.finetune(
            args.writing_params_path,
            model_name_or_path=readable_checkpoint(args),
            finetune_corpus_path=args.finetune_corpus_path,
            pretrain_corpus_path=args.pretrain_corpus_path,
            attention_type=args.variant,
            model_overrides=model_overrides,
            training_overrides={**training, "learning_rate": args.finetune_lr},
        )
    else:
        if not args.reading_params_path or not args.eval_corpus_path:
            raise SystemExit("run.py evaluate needs --reading_params_path and --eval_corpus_path")
        result = workflows.evaluate_birthplaces(
            readable_checkpoint(args), eval_corpus_path=args.eval_corpus_path, outputs_path=args.outputs_path
        )
        print(result["message"])


def readable_checkpoint(args):
    """A checkpoint folder as is; a state dict saved by the handouts' code converted next to it."""
    path = args.reading_params_path
    if path is None or Path(path).is_dir():
        return path
    converted = Path(f"{path}.hf")
    convert_cs224n_checkpoint(path, args.pretrain_corpus_path, converted)
    print(f"Converted the handout checkpoint {path} to {converted}")
    return str(converted)


if __name__ == "__main__":
    main()
