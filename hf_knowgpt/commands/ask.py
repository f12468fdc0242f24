"""Ask a checkpoint where people were born, through the "birthplace-qa" pipeline.

    python scripts/ask.py --model_name_or_path outputs/quickstart/pretrained "Khatchig Mouradian" "Where was Ada Lovelace born?"
    python scripts/ask.py --model_name_or_path outputs/quickstart/pretrained --from_file dev.tsv --limit 5

Each answer comes with the model's probability of it; --threshold withholds answers scored below it.
"""

import argparse

from data_loaders import read_birthplaces

from ..utils.checkpoints import check_model_folder, looks_like_hub_id, quiet_progress_bars
from ..utils.errors import InputError
from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("questions", nargs="*", help="questions or bare names")
    parser.add_argument("--model_name_or_path", required=True, help="finetuned checkpoint folder or Hub id")
    parser.add_argument("--from_file", default=None, help="also ask the questions of a birthplace TSV")
    parser.add_argument("--limit", type=int, default=None, help="ask at most this many questions from --from_file")
    parser.add_argument("--threshold", type=float, default=None, help="withhold answers with a lower probability")
    parser.add_argument("--device", default=None, help="cpu, cuda … (default: the pipeline's choice)")
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    questions, gold = list(args.questions), [None] * len(args.questions)
    if args.from_file:
        records = read_birthplaces(args.from_file)[: args.limit]
        questions += [r.question for r in records]
        gold += [r.answer for r in records]
    if not questions:
        raise InputError("scripts/ask.py", "nothing to ask", "give questions or --from_file")
    if not looks_like_hub_id(args.model_name_or_path):
        check_model_folder(args.model_name_or_path)
    from transformers import pipeline

    import hf_knowgpt  # noqa: F401  (registers the "birthplace-qa" task)

    cli.libraries_loaded()
    with quiet_progress_bars():  # transformers' "Loading weights" bar is not an answer
        qa = pipeline("birthplace-qa", model=args.model_name_or_path, device=args.device)
    for result, truth in zip(qa(questions, threshold=args.threshold), gold):
        answer = result["answer"] if not result["abstained"] else f"(abstains; best guess {result['best_guess']})"
        known = "" if truth is None else f"   [gold: {truth}]"
        print(f"{result['question']} → {answer}   p={result['score']:.3f}{known}")


if __name__ == "__main__":
    cli.run_script(main)
