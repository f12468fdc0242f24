"""The handouts' London baseline: answer "London" to every question (5.0% on birth_dev.tsv).

python scripts/london_baseline.py --eval_corpus_path birth_dev.tsv --outputs_path london.dev.predictions
"""

import argparse

from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--eval_corpus_path", default=None, help="question TAB place lines; default: synthetic dev set"
    )
    parser.add_argument("--outputs_path", default="london_baseline.predictions", help="predictions file to write")
    parser.add_argument("--place", default="London", help="the one answer given to every question")
    parser.add_argument("--num_people", type=int, default=None, help="size of the synthetic corpus used without paths")
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from ..analysis.evaluation import london_baseline

    cli.libraries_loaded()
    result = london_baseline(args.eval_corpus_path, args.outputs_path, args.place, **cli.synthetic_size(args))
    print(result["message"])
    print(f"Wrote {args.outputs_path} and {args.outputs_path}.metrics.json")
    return result


if __name__ == "__main__":
    cli.run_script(main)
