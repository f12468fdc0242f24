#!/usr/bin/env python
"""Where does bf16 training of the handouts' recipe go wrong? The first steps of the handouts' vanilla
pretraining (the whole 650-epoch learning-rate schedule, stopped early) under several precision settings,
side by side in one run; prints the loss at the handouts' logged steps last.

    python benchmarks/diagnostics/precision_study.py --data_dir .data --steps 3000

Settings (each a fresh model from the same seed; bf16 means autocast with fp32 master weights):
- fp32: TF32 matrix products, the reference;
- bf16: everything autocast, as `--mixed_precision bf16` trains;
- bf16-attn-fp32: bf16, but the attention kernel itself (scores, softmax, dropout, weighted sum) in fp32:
  the library's default `attention_kernel_dtype="float32"`; the other settings set it to None unless named;
- bf16-attn-fp32-eager: bf16-attn-fp32 with the attention unfused (`attn_implementation="eager"`: the
  scores and the weighted sum are fp32 matrix products, on TF32 tensor cores like every fp32 product here);
- bf16-attn-triton: bf16, the attention through the fused Triton kernel (`attn_implementation="triton"`,
  as in fp32: its fp32 operands split into 3 bf16 parts); -split2 and -split1: 2 parts (about 16 bits) or
  1 (rounded to bf16 where the flash kernel rounds, but with the softmax correction from fp32);
- bf16-attn-fp16: bf16, but the attention kernel in fp16 (`attention_kernel_dtype="float16"`: flash);
- bf16-attn-block-fp32: bf16, but each whole attention sublayer (projections too) in fp32;
- bf16-mlp-fp32: bf16, but each MLP sublayer in fp32;
- bf16-head-fp32: bf16, but the language-model head (the logits) in fp32;
- bf16-no-flash: bf16 with the flash kernel disabled (memory-efficient or math attention instead);
- bf16-eager: bf16 on the eager (host-driven, uncaptured) path instead of the CUDA graph.
The patches of the sublayer, head, no-flash and eager settings exist only inside this study.
"""

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_loaders import encode_documents, read_corpus  # noqa: E402
from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM, attention_knowgpt  # noqa: E402
from hf_knowgpt.kernels import fused_attention  # noqa: E402
from hf_knowgpt.training.data import PretrainingData  # noqa: E402
from hf_knowgpt.training.recipes import HANDOUT  # noqa: E402
from hf_knowgpt.training.run_config import resolve_run_config  # noqa: E402
from hf_knowgpt.training.trainer import KnowGPTTrainer, make_accelerator  # noqa: E402
from hf_knowgpt.training.workflows import corpus_tokenizer  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

SETTINGS = (
    "fp32",
    "bf16",
    "bf16-attn-fp32",
    "bf16-attn-fp32-eager",
    "bf16-attn-triton",
    "bf16-attn-triton-split2",
    "bf16-attn-triton-split1",
    "bf16-attn-fp16",
    "bf16-attn-block-fp32",
    "bf16-mlp-fp32",
    "bf16-head-fp32",
    "bf16-no-flash",
    "bf16-eager",
)
# Steps at which the handouts' public vanilla run logged its loss (REPRODUCING.md).
HANDOUT_LOSS = {100: 2.81, 460: 2.53, 1000: 2.32, 1400: 2.02, 2300: 1.36, 4600: 0.96}


def in_fp32(forward):
    """Run a module's forward with autocast off and floating inputs in fp32."""

    def wrapped(*args, **kwargs):
        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return forward(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def patched_attention(setting: str):
    """Keep the flash kernel out for the duration of one setting."""
    original = attention_knowgpt.ATTENTION_FUNCTIONS["sdpa"]

    def attention_without_flash(*args, **kwargs):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return original(*args, **kwargs)

    if setting == "bf16-no-flash":
        attention_knowgpt.ATTENTION_FUNCTIONS["sdpa"] = attention_without_flash
    try:
        yield
    finally:
        attention_knowgpt.ATTENTION_FUNCTIONS["sdpa"] = original


def patch_model(model, setting: str):
    if setting == "bf16-head-fp32":
        model.lm_head.forward = in_fp32(model.lm_head.forward)
    for block in model.transformer.blocks:
        if setting == "bf16-attn-block-fp32":
            block.attn.forward = in_fp32(block.attn.forward)
        elif setting == "bf16-mlp-fp32":
            block.mlp.forward = in_fp32(block.mlp.forward)


def run_setting(setting, corpus, steps, seed, compile_model, workdir):
    tokenizer = corpus_tokenizer(corpus)
    documents = read_corpus(corpus)
    config = KnowGPTConfig(
        vocab_size=len(tokenizer),
        attention_type="vanilla",
        unk_token_id=tokenizer.unk_token_id,
        attention_kernel_dtype="float32"
        if setting.startswith(("bf16-attn-fp32", "bf16-attn-triton"))
        else "float16"
        if setting == "bf16-attn-fp16"
        else None,
        **HANDOUT.model,
    )
    block = config.block_size
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no" if setting == "fp32" else "bf16"
    AcceleratorState._reset_state(True)
    on_gpu = torch.cuda.is_available()
    given = {
        "pretrain.training_path": "graphed" if on_gpu and setting != "bf16-eager" else "eager",
        "pretrain.fused_attention": False,  # each setting names its attention kernel
        "pretrain.compile": compile_model and on_gpu,
        "pretrain.stop_after_steps": steps,
        "pretrain.seed": seed,
        "pretrain.overwrite_output_dir": True,
        "pretrain.log_every": 50,
    }
    args = resolve_run_config(
        HANDOUT, given, output_dirs={"pretrain": workdir / setting}, corpus_documents=len(documents)
    ).pretrain
    accelerator = make_accelerator(args)
    torch.manual_seed(seed)
    model = KnowGPTForCausalLM(config)
    patch_model(model, setting)
    if setting == "bf16-attn-fp32-eager":
        model.set_attn_implementation("eager")
    if setting.startswith("bf16-attn-triton"):
        model.set_attn_implementation("triton")
        fused_attention.DEFAULT_SPLITS = int(setting.removeprefix("bf16-attn-triton").removeprefix("-split") or 3)
    data = PretrainingData(*encode_documents(tokenizer, documents, block), block)
    with patched_attention(setting):
        result = KnowGPTTrainer(model, data, args, accelerator).train()
    curve = {point["step"]: point["loss"] for point in result.loss_curve}
    return {"setting": setting, "seconds": result.train_seconds, "loss_curve": curve}


def loss_near(curve: dict, step: int):
    """The mean logged loss of the 50 steps ending at `step` (or the last logged before it)."""
    logged = [s for s in curve if s <= step]
    return curve[max(logged)] if logged else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="folder with wiki.txt")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps of the 14,950-step schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch_compile", action="store_true")
    parser.add_argument("--output_dir", default="/tmp/knowgpt-precision")
    parser.add_argument("--results", default=None, help="JSON file for every setting")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        parser.error(f"unknown --settings {unknown}; choose from {list(SETTINGS)}")

    rows = []
    for setting in settings:
        rows.append(run_setting(setting, Path(args.data_dir) / "wiki.txt", args.steps, args.seed,
                                args.torch_compile, Path(args.output_dir)))  # fmt: skip
        print(json.dumps({"setting": setting, "seconds": rows[-1]["seconds"]}), flush=True)
        if args.results:
            Path(args.results).write_text(json.dumps({"device": describe_device(), "rows": rows}, indent=1))

    marks = [s for s in (*HANDOUT_LOSS, args.steps) if s <= args.steps]
    marks = sorted(set(marks))
    print(f"\n{describe_device()}; vanilla, handouts' schedule, seed {args.seed}; loss (mean of 50 steps) at step")
    print(f"{'setting':<22}" + "".join(f"{m:>8}" for m in marks) + f"{'s':>8}")
    print(f"{'handouts':<22}" + "".join(f"{HANDOUT_LOSS.get(m, float('nan')):>8.2f}" for m in marks))
    for row in rows:
        losses = [loss_near(row["loss_curve"], m) for m in marks]
        print(
            f"{row['setting']:<22}"
            + "".join(f"{loss:>8.2f}" if loss is not None else f"{'-':>8}" for loss in losses)
            + f"{row['seconds']:>8.1f}"
        )


if __name__ == "__main__":
    main()
