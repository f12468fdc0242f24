"""Does a checkpoint know when it does not know? Writes report.md and PNG plots.

    python scripts/analyze_knowledge.py --model_name_or_path rope-finetune --eval_corpus_path birth_dev.tsv \
        --calibration_corpus_path heldout.tsv --pretrain_corpus_path wiki.txt --train_corpus_path birth_places_train.tsv \
        --output_dir docs/knowledge_report

Accuracy against coverage, a reliability diagram with its expected calibration error, the threshold that
reaches --target_accuracy on the calibration questions (which the checkpoint must not have trained on;
never the evaluation file), and the scores of made-up people against real ones. Without paths it uses the
synthetic corpus (its test people, whose answers the generator knows, as calibration questions).
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_knowgpt  # noqa: F401
from data_loaders import generate_people, synthetic_corpus_files
from data_loaders.synthetic import DEFAULT_NUM_PEOPLE, split_people

from ..analysis.knowledge_report import analyze_knowledge
from ..utils.checkpoints import quiet_progress_bars
from ..utils.errors import InputError
from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="finetuned checkpoint folder or Hub id")
    parser.add_argument("--eval_corpus_path", default=None, help="question TAB place lines to evaluate")
    parser.add_argument("--calibration_corpus_path", default=None, help="labeled questions the model did not train on")
    parser.add_argument("--pretrain_corpus_path", default=None, help="the corpus: made-up names must not occur in it")
    parser.add_argument("--train_corpus_path", default=None, help="training questions: their place frequencies")
    parser.add_argument("--output_dir", default="knowledge_report", help="where report.md and the plots go")
    parser.add_argument("--target_accuracy", type=float, default=0.8, help="accuracy the threshold should reach")
    parser.add_argument("--num_unseen", type=int, default=500, help="made-up people to ask about")
    parser.add_argument(
        "--calibration_note", default="", help="a sentence added to the report about the calibration set"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the made-up names")
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cli.libraries_loaded()
    if args.eval_corpus_path is None:  # the synthetic corpus: its test people's answers are known to the generator
        files = synthetic_corpus_files()
        calibration = files.directory / "test_labeled.tsv"
        _, _, test_people = split_people(generate_people(DEFAULT_NUM_PEOPLE, 0))
        calibration.write_text(
            "".join(f"Where was {p.name} born?\t{p.place}\n" for p in test_people), encoding="utf-8"
        )
        args.eval_corpus_path, args.pretrain_corpus_path = files.dev, files.corpus
        args.train_corpus_path, args.calibration_corpus_path = files.train, args.calibration_corpus_path or calibration
    if args.calibration_corpus_path is None:
        raise InputError("--calibration_corpus_path", "is needed", "labeled questions the checkpoint did not train on")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with quiet_progress_bars():  # the report's output, not transformers' loading bar
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    summary = analyze_knowledge(
        model, tokenizer, args.eval_corpus_path, args.calibration_corpus_path, args.output_dir,
        corpus_path=args.pretrain_corpus_path, train_path=args.train_corpus_path,
        target_accuracy=args.target_accuracy, num_unseen=args.num_unseen, seed=args.seed,
        checkpoint_name=str(args.model_name_or_path), calibration_note=args.calibration_note,
    )  # fmt: skip
    print(json.dumps(summary, indent=2))
    print(f"Wrote {args.output_dir}/report.md and its plots")


if __name__ == "__main__":
    cli.run_script(main)
