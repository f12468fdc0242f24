"""Answer every question of a birthplace TSV and score the answers when the file has gold places.

    python scripts/evaluate_checkpoint.py --model_name_or_path outputs/finetune-pretrained \\
        --eval_corpus_path birth_dev.tsv --outputs_path predictions/dev.txt

Greedy decoding with the KV cache, at most 32 characters after `question⁇`, in batches; the prediction
is the text up to the next ⁇. Prints `Correct: c out of t: pct%` and writes `<outputs>.metrics.json`
when gold places exist; the checkpoint is only read, unless --update_model_card records the accuracy in
its model card.
"""

import argparse

from ..options import HANDOUT_MAX_NEW_TOKENS
from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="finetuned checkpoint folder or Hub id")
    parser.add_argument("--eval_corpus_path", default=None, help="questions (TAB places); default: synthetic dev set")
    parser.add_argument("--outputs_path", default=None, help="where to write one prediction per line")
    parser.add_argument("--batch_size", type=int, default=512, help="questions decoded together")
    parser.add_argument(
        "--max_new_tokens", type=int, default=HANDOUT_MAX_NEW_TOKENS, help="characters generated at most"
    )
    parser.add_argument("--write_scores", action="store_true", help="also write each answer's probability")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda when available)")
    parser.add_argument("--num_people", type=int, default=None, help="size of the synthetic corpus used without paths")
    parser.add_argument(
        "--update_model_card",
        action="store_true",
        help="record the accuracy in the checkpoint's model card (otherwise the checkpoint is only read)",
    )
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def main(argv=None):
    from ..utils import timeline

    timeline.reset()
    timeline.mark("interpreter and command start-up")
    args = parse_args(argv)
    from ..utils.cuda_context import start_primary_context

    start_primary_context(args.device)  # while torch and transformers load
    from ..analysis.evaluation import evaluate_birthplaces

    cli.libraries_loaded()
    timeline.mark("flags read, libraries imported (torch, transformers)")
    result = evaluate_birthplaces(
        args.model_name_or_path,
        eval_corpus_path=args.eval_corpus_path,
        outputs_path=args.outputs_path,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        write_scores=args.write_scores,
        device=args.device,
        update_model_card=args.update_model_card,
        **cli.synthetic_size(args),
    )
    timeline.mark("questions answered, predictions written")
    print(result["message"])
    return result


if __name__ == "__main__":
    cli.run_script(main)
