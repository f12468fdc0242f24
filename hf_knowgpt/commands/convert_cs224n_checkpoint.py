"""Convert a model saved by the CS224N handouts' code (`torch.save(model.state_dict(), path)`) into a
`save_pretrained` directory.

    python scripts/convert_cs224n_checkpoint.py --params_path vanilla.finetune.params \
        --corpus_path wiki.txt --output_dir knowgpt-vanilla
"""

import argparse

from . import cli


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params_path", required=True, help="state dict written by the handouts' run.py")
    parser.add_argument("--corpus_path", required=True, help="the pretraining corpus it was trained with (wiki.txt)")
    parser.add_argument("--output_dir", required=True, help="where to write the 🤗 checkpoint")
    parser.add_argument(
        "--n_head",
        type=int,
        default=None,
        help="attention heads; read from the weights for rope and synthesizer, else the handouts' 8",
    )
    cli.add_debug_argument(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from ..convert_cs224n import convert_cs224n_checkpoint

    cli.libraries_loaded()
    model, tokenizer = convert_cs224n_checkpoint(args.params_path, args.corpus_path, args.output_dir, args.n_head)
    config = model.config
    print(
        f"Converted {args.params_path} ({config.attention_type}, {config.n_layer} layers, {config.n_head} heads, "
        f"width {config.n_embd}, vocabulary {len(tokenizer)}) to {args.output_dir}"
    )


if __name__ == "__main__":
    cli.run_script(main)
