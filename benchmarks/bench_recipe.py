#!/usr/bin/env python
"""Time the handouts' recipe: the plain path (how the handouts' code works) against the fast paths, in one run.

    python benchmarks/bench_recipe.py --data_dir ../shared/data --epochs 3                # speed per epoch
    python benchmarks/bench_recipe.py --data_dir ../shared/data --full --paths graphed    # whole recipe

For each attention type and training path it pretrains on wiki.txt (or the synthetic corpus without
--data_dir) for --epochs epochs and reports the steady-state seconds per epoch (the first epoch, which
holds graph capture / compilation and allocator warm-up, is reported apart), handout-position throughput
(127 target positions per example, as the handouts count tokens), model FLOP utilisation against a bf16
matrix product measured in the same run, and the speedup over the plain path. With --full the fast paths
also run the whole recipe — 650 pretraining epochs, 10 finetuning epochs, dev evaluation — and report its
time end to end, with start-up and warm-up apart. A table is printed last; --output writes JSON.
"""

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from itertools import product  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_loaders import (  # noqa: E402
    encode_birthplace_examples,
    encode_documents,
    read_birthplaces,
    read_corpus,
    synthetic_corpus_files,
)
from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM  # noqa: E402
from hf_knowgpt.kernels.fused_attention import fused_attention_available  # noqa: E402
from hf_knowgpt.qa import predict_birthplaces  # noqa: E402
from hf_knowgpt.training.data import FinetuningData, PretrainingData  # noqa: E402
from hf_knowgpt.training.recipes import HANDOUT  # noqa: E402
from hf_knowgpt.training.run_config import resolve_run_config  # noqa: E402
from hf_knowgpt.training.trainer import KnowGPTTrainer, make_accelerator  # noqa: E402
from hf_knowgpt.training.workflows import corpus_tokenizer  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

IMPORT_SECONDS = time.perf_counter() - _STARTED


def measured_matmul_tflops(device) -> float | None:
    """bf16 8192³ products on random data (the peak MFU is quoted against)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12


def handout_flops_per_example(config: KnowGPTConfig) -> float:
    """Forward + backward FLOPs of one 127-position example the way the handouts compute it (nanoGPT's
    estimate: 6 per parameter per position, plus attention scores and sums)."""
    non_embedding = sum(
        p.numel()
        for n, p in KnowGPTForCausalLM(config).named_parameters()
        if "tok_emb" not in n and "pos_emb" not in n
    )
    positions = config.block_size - 1
    attention = 12 * config.n_layer * config.n_embd * positions
    return (6 * non_embedding + attention) * positions


def train(model, data, args, accelerator):
    trainer = KnowGPTTrainer(model, data, args, accelerator)
    result = trainer.train()
    return trainer, result


def run_case(
    attention_type, path, files, epochs, full, mixed_precision, seed, peak, workdir, kernel_dtype, attention_kernel
):
    logging.disable(logging.WARNING)
    tokenizer = corpus_tokenizer(files["corpus"])
    documents = read_corpus(files["corpus"])
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    AcceleratorState._reset_state(True)  # each case gets its own precision
    pretrain_epochs = HANDOUT.pretrain.max_epochs if full else epochs
    training_path = path.removesuffix("-compile").partition("-groups")[0]
    given = {
        "model.attention_type": attention_type,
        "model.attention_kernel_dtype": kernel_dtype,
        "pretrain.max_epochs": pretrain_epochs,
        "pretrain.training_path": training_path,
        "pretrain.compile": path.endswith("-compile"),
        "pretrain.log_every": 50 if full else 10**9,
        # finetuning: 80 steps would not repay a compilation
        "finetune.training_path": training_path,
        "finetune.log_every": 10**9,
        "run.seed": seed,
        "run.overwrite_output_dir": True,
        "run.fused_attention": attention_kernel == "triton",
    }
    if "-groups" in path:
        given["pretrain.length_groups"] = int(path.partition("-groups")[2])
    run = resolve_run_config(
        HANDOUT,
        given,
        stages=("pretrain", "finetune"),
        output_dirs={
            "pretrain": workdir / f"{attention_type}-{path}-pretrain",
            "finetune": workdir / f"{attention_type}-{path}-finetune",
        },
        corpus_documents=len(documents),
    )
    config = KnowGPTConfig(vocab_size=len(tokenizer), unk_token_id=tokenizer.unk_token_id, **run.model)
    block = config.block_size
    args = run.pretrain
    accelerator = make_accelerator(args)
    torch.manual_seed(seed)
    model = KnowGPTForCausalLM(config)
    data = PretrainingData(*encode_documents(tokenizer, documents, block), block)
    trainer, result = train(model, data, args, accelerator)
    epoch_times = result.epoch_seconds
    steady = (
        (epoch_times[-1] - epoch_times[0]) / max(len(epoch_times) - 1, 1) if len(epoch_times) > 1 else epoch_times[0]
    )
    row = {
        "attention_type": attention_type,
        "path": path,
        "mixed_precision": mixed_precision,
        "attention_kernel_dtype": kernel_dtype,
        # What ran: the fused kernel needs Triton and CUDA, the plain path is unfused.
        "attention_kernel": "eager"
        if path == "plain"
        else attention_kernel
        if fused_attention_available()
        else "sdpa",
        "device": describe_device(accelerator.device),
        "pretrain_epochs": pretrain_epochs,
        "first_epoch_s": epoch_times[0],
        "steady_s_per_epoch": steady,
        "positions_per_s": len(documents) * (block - 1) / steady,
        "examples_per_s": len(documents) / steady,
        "loss_curve": result.loss_curve,
        "final_loss": result.final_loss,
        "warmup_s": result.warmup_seconds,
    }
    flops = handout_flops_per_example(config) * len(documents) / steady
    row["model_tflops"] = flops / 1e12
    row["mfu"] = flops / (peak * 1e12) if peak else None
    if full:
        model = accelerator.unwrap_model(trainer.model)
        records = read_birthplaces(files["train"])
        questions, answers = [r.question for r in records], [r.answer for r in records]
        input_ids, labels = encode_birthplace_examples(tokenizer, questions, answers, block)
        finetune_args = run.finetune
        _, finetune_result = train(model, FinetuningData(input_ids, labels), finetune_args, accelerator)
        dev = read_birthplaces(files["dev"])
        dev_questions, dev_answers = [r.question for r in dev], [r.answer for r in dev]
        model.eval()
        predict_birthplaces(model, tokenizer, dev_questions[:64])  # warm the decoding kernels
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        predictions = predict_birthplaces(model, tokenizer, dev_questions)
        eval_seconds = time.perf_counter() - start
        correct = sum(p.answer == gold for p, gold in zip(predictions, dev_answers))
        row.update(
            pretrain_s=result.train_seconds,
            finetune_s=finetune_result.train_seconds,
            finetune_warmup_s=finetune_result.warmup_seconds,
            eval_s=eval_seconds,
            recipe_s=result.train_seconds + finetune_result.train_seconds + eval_seconds,
            dev_correct=correct,
            dev_total=len(dev),
        )
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data_dir", default=None, help="folder with wiki.txt and the TSVs (default: synthetic corpus)"
    )
    parser.add_argument("--epochs", type=int, default=3, help="pretraining epochs timed per path (first one apart)")
    parser.add_argument("--full", action="store_true", help="also run the whole recipe on the fast paths")
    parser.add_argument(
        "--paths",
        default="plain,auto",
        help="comma-separated: plain, eager, eager-groupsN (N length groups), graphed, graphed-compile, auto",
    )
    parser.add_argument("--attention_types", default="vanilla", help="comma-separated attention types")
    parser.add_argument(
        "--mixed_precision", default="no", help="for the fast paths: no, bf16, or both as no,bf16 (each path twice)"
    )
    parser.add_argument(
        "--attention_kernel_dtype",
        default="float32",
        help="attention kernel precision under bf16: float32, float16 or none (KnowGPTConfig.attention_kernel_dtype)",
    )
    parser.add_argument(
        "--attention_kernels",
        default="triton",
        help="for the fast paths on CUDA: triton (the fused kernel where it applies), sdpa, or both as sdpa,triton",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument("--output", default=None, help="write every measurement as JSON here")
    parser.add_argument("--workdir", default="/tmp/knowgpt-bench", help="scratch folder for checkpoints")
    args = parser.parse_args(argv)
    precisions = args.mixed_precision.split(",")
    if not set(precisions) <= {"no", "bf16"}:
        parser.error(f"--mixed_precision takes no, bf16 or no,bf16; got {args.mixed_precision!r}")
    kernels = args.attention_kernels.split(",")
    if not set(kernels) <= {"sdpa", "triton"}:
        parser.error(f"--attention_kernels takes sdpa, triton or sdpa,triton; got {args.attention_kernels!r}")

    if args.data_dir:
        data_dir = Path(args.data_dir)
        files = {
            "corpus": data_dir / "wiki.txt",
            "train": data_dir / "birth_places_train.tsv",
            "dev": data_dir / "birth_dev.tsv",
        }
    else:
        synthetic = synthetic_corpus_files()
        files = {"corpus": synthetic.corpus, "train": synthetic.train, "dev": synthetic.dev}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = measured_matmul_tflops(device)
    rows = []
    for attention_type in args.attention_types.split(","):
        for path in args.paths.split(","):
            plain = path == "plain"
            for precision, kernel in [("no", "eager")] if plain else product(precisions, kernels):
                row = run_case(
                    attention_type,
                    path,
                    files,
                    args.epochs,
                    args.full and not plain,
                    precision,
                    args.seed,
                    peak,
                    Path(args.workdir),
                    None if args.attention_kernel_dtype == "none" else args.attention_kernel_dtype,
                    kernel,
                )
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "loss_curve"}), flush=True)
                summary = {
                    "device": describe_device(device), "import_s": IMPORT_SECONDS, "bf16_matmul_tflops": peak,
                    "rows": rows,
                }  # fmt: skip
                if args.output:  # after every case: a run cut short keeps what it measured
                    Path(args.output).write_text(json.dumps(summary, indent=2))

    print(
        f"\ndevice: {summary['device']}; imports {IMPORT_SECONDS:.1f} s; measured bf16 matmul: {peak or 0:.0f} TFLOP/s"
    )
    header = f"{'attention':<12}{'path':<17}{'prec':<6}{'kernel':<8}{'s/epoch':>9}{'1st epoch':>10}{'pos/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'speedup':>9}{'recipe s':>10}{'dev':>9}"
    print(header)
    for row in rows:
        baseline = next(
            (r for r in rows if r["attention_type"] == row["attention_type"] and r["path"] == "plain"), None
        )
        speedup = baseline["steady_s_per_epoch"] / row["steady_s_per_epoch"] if baseline else float("nan")
        recipe = f"{row['recipe_s']:.1f}" if "recipe_s" in row else "-"
        dev = f"{100 * row['dev_correct'] / row['dev_total']:.1f}%" if "dev_correct" in row else "-"
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] else "-"
        print(
            f"{row['attention_type']:<12}{row['path']:<17}{row['mixed_precision']:<6}{row['attention_kernel']:<8}"
            f"{row['steady_s_per_epoch']:>9.3f}"
            f"{row['first_epoch_s']:>10.2f}{row['positions_per_s']:>12,.0f}{row['model_tflops']:>9.2f}{mfu:>7}"
            f"{speedup:>9.1f}{recipe:>10}{dev:>9}"
        )
    curves = [r for r in rows if len(r["loss_curve"]) > 10]
    if curves:
        print("\npretraining loss (mean of the 50 steps before) against the handouts' curve (REPRODUCING.md):")
        print(
            f"{'step':>6}{'handout':>9}"
            + "".join(
                f"{r['attention_type'][:5] + '/' + r['mixed_precision'] + '/' + r['attention_kernel'][:3]:>18}"
                for r in curves
            )
        )
        for step, reference in HANDOUT_CURVE:
            values = []
            for r in curves:
                nearest = min(r["loss_curve"], key=lambda point: abs(point["step"] - step))
                values.append(f"{nearest['loss']:>9.2f}@{nearest['step']:<4}")
            print(f"{step:>6}{reference:>9.2f}" + "".join(f"{v:>18}" for v in values))
    return summary


# The handouts' vanilla pretraining loss at these optimizer steps (a public 2024 run; REPRODUCING.md).
HANDOUT_CURVE = [
    (100, 2.81),
    (460, 2.53),
    (1000, 2.32),
    (1400, 2.02),
    (2300, 1.36),
    (4600, 0.96),
    (9000, 0.64),
    (14949, 0.53),
]


if __name__ == "__main__":
    main()
