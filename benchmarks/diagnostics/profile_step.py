#!/usr/bin/env python
"""Per-step time of the graphed pretraining step in its variants (dense or packed, eager or
torch.compile'd kernels, fp32 with TF32 matmuls or bf16 autocast), on wiki.txt with the handout model,
and the top CUDA kernels of one of them (`--profile`). Prints a table last.

    python benchmarks/diagnostics/profile_step.py --data_dir .data

A variant is `dense|packed:no|bf16[:compile][:eager-attn|:triton-attn[=1|2|3][:block=N][:grid-attn]][:kernel=float32|float16|none][:separate-qkv][:no-combo][:autotune][:dense-inputs]`:
`eager-attn` runs attention unfused (matrix products, softmax, dropout: `attn_implementation="eager"`),
`triton-attn` through the fused Triton kernel with that many splits (`attn_implementation="triton"`) and
blocks of N positions (default the library's), otherwise SDPA; `separate-qkv` runs the query, key and
value layers as three products (as before they were fused into one); `grid-attn` moves packed tokens into
the (B, T) grid and back around the Triton kernel (as before it read them packed); `no-combo` compiles
without inductor's `combo_kernels` (independent small kernels launched as one; the library's default) and
`autotune` with `max_autotune` (matrix-product templates with fused epilogues); `dense-inputs` hands the
kernel's (B, H, T, D) calls contiguous copies of their inputs (a torch.compile diagnostic); `kernel=` sets `attention_kernel_dtype` (the precision of the attention kernel under bf16;
default float32).
"""

import argparse
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch
import torch._dynamo.config
from accelerate.state import AcceleratorState

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_loaders import encode_documents, read_corpus  # noqa: E402
from hf_knowgpt import (  # noqa: E402
    KnowGPTConfig,
    KnowGPTForCausalLM,
    attention_knowgpt,  # noqa: E402
)
from hf_knowgpt.attention_knowgpt import KnowGPTSelfAttention  # noqa: E402
from hf_knowgpt.kernels import fused_attention  # noqa: E402
from hf_knowgpt.training.arguments import TrainingArguments  # noqa: E402
from hf_knowgpt.training.data import PretrainingData  # noqa: E402
from hf_knowgpt.training.fast_path import GraphedStepper  # noqa: E402
from hf_knowgpt.training.recipes import HANDOUT  # noqa: E402
from hf_knowgpt.training.trainer import KnowGPTTrainer, make_accelerator  # noqa: E402
from hf_knowgpt.training.workflows import corpus_tokenizer  # noqa: E402

LIBRARY_BLOCK_SIZE = fused_attention.BLOCK_SIZE


def parse_variant(variant: str) -> dict:
    parts = variant.split(":")
    options = dict(packed=parts[0] == "packed", precision=parts[1], compile_model="compile" in parts[2:])
    options["attn_implementation"] = "eager" if "eager-attn" in parts[2:] else "sdpa"
    for part in parts[2:]:
        if part.startswith("triton-attn"):
            options["attn_implementation"] = "triton"
            fused_attention.DEFAULT_SPLITS = int(part.partition("=")[2] or 3)
            blocks = [p.split("=", 1)[1] for p in parts[2:] if p.startswith("block=")]
            fused_attention.BLOCK_SIZE = int(blocks[-1]) if blocks else LIBRARY_BLOCK_SIZE
    kernels = [p.split("=", 1)[1] for p in parts[2:] if p.startswith("kernel=")]
    options["kernel_dtype"] = None if kernels[-1:] == ["none"] else (kernels[-1] if kernels else "float32")
    options["separate_projections"] = "separate-qkv" in parts[2:]
    options["grid_attention"] = "grid-attn" in parts[2:]
    options["dense_kernel_inputs"] = "dense-inputs" in parts[2:]
    return options


def inductor_options(variant: str) -> dict:
    parts = variant.split(":")[2:]
    return {"combo_kernels": "no-combo" not in parts, "max_autotune": "autotune" in parts}


def stepper_for(
    corpus,
    attention_type,
    packed,
    compile_model,
    precision,
    attn_implementation,
    kernel_dtype,
    separate_projections,
    grid_attention,
    dense_kernel_inputs,
):
    AcceleratorState._reset_state(True)
    torch._dynamo.reset()  # compiled code is reused across models otherwise, whatever the inductor options
    tokenizer = corpus_tokenizer(corpus)
    documents = read_corpus(corpus)
    config = KnowGPTConfig(
        vocab_size=len(tokenizer),
        attention_type=attention_type,
        attention_kernel_dtype=kernel_dtype,
        **HANDOUT.model,
    )
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(config).cuda()
    model.set_attn_implementation(attn_implementation)
    if separate_projections:  # a hooked layer runs as a module: three products instead of one
        for module in model.modules():
            if isinstance(module, KnowGPTSelfAttention):
                module.value.register_forward_pre_hook(lambda module, inputs: None)
    attention_knowgpt.fused_causal_attention = fused_attention.fused_causal_attention
    if dense_kernel_inputs:  # (B, H, T, D) calls get contiguous copies of their views (a compile diagnostic)

        def with_dense_inputs(query, key, value, *args, **kwargs):
            if query.dim() == 4:
                query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            return fused_attention.fused_causal_attention(query, key, value, *args, **kwargs)

        attention_knowgpt.fused_causal_attention = with_dense_inputs
    if grid_attention:  # the Triton kernel over the (B, T) grid, packed tokens scattered in and gathered out
        for module in model.modules():
            if isinstance(module, KnowGPTSelfAttention):
                module._packed_kernel_applies = lambda *arguments: False
    data = PretrainingData(*encode_documents(tokenizer, documents, 128), 128)
    args = TrainingArguments(output_dir="/tmp/profile", max_epochs=650, training_path="graphed", packed=packed)
    trainer = KnowGPTTrainer(model, data, args, make_accelerator(args))
    trainer.data.to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    trainer.optimizer = trainer._make_optimizer(graphed=True)
    stepper = GraphedStepper(trainer, compile_model=compile_model, packed=packed)
    stepper.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
    return stepper


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data_dir", default=".data")
    parser.add_argument("--attention_type", default="vanilla")
    parser.add_argument("--variants", default="dense:no,packed:no,packed:no:compile,packed:bf16,packed:bf16:compile")
    parser.add_argument("--profile", default="packed:bf16:compile", help="variant whose kernels are listed")
    parser.add_argument("--profile_rows", type=int, default=25)
    args = parser.parse_args()
    corpus = Path(args.data_dir) / "wiki.txt"
    torch._dynamo.config.recompile_limit = 64  # each variant's new model recompiles the same forward code

    for variant in filter(None, args.profile.split(",")):
        with patch.object(GraphedStepper, "INDUCTOR_OPTIONS", inductor_options(variant)):
            stepper = stepper_for(corpus, args.attention_type, **parse_variant(variant))
            stepper.run(0, 30, lambda: False)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                stepper.run(30, 10, lambda: False)
                torch.cuda.synchronize()
        kernels = profiler.key_averages()
        launches = sum(event.count for event in kernels if event.device_type == torch.autograd.DeviceType.CUDA)
        print(f"\n{variant}: {launches / 10:.0f} kernels per step")
        print(kernels.table(sort_by="self_cuda_time_total", row_limit=args.profile_rows, max_name_column_width=70))

    rows = []
    for variant in args.variants.split(","):
        with patch.object(GraphedStepper, "INDUCTOR_OPTIONS", inductor_options(variant)):
            stepper = stepper_for(corpus, args.attention_type, **parse_variant(variant))
            start = time.perf_counter()
            stepper.run(0, 230, lambda: False)  # ten epochs: captures, compilation, warm-up
            torch.cuda.synchronize()
            warmup = time.perf_counter() - start
            capture = stepper.capture_seconds
            start = time.perf_counter()
            stepper.run(230, 460, lambda: False)
            torch.cuda.synchronize()
            per_step = (time.perf_counter() - start) / 460
        loss = stepper.take_loss().item()
        rows.append((variant, warmup, capture, stepper.capture_seconds - capture, len(stepper.graphs), per_step, loss))
        print(rows[-1], flush=True)
    print(
        f"\n{'variant':<40}{'first 230 s':>12}{'capture s':>10}{'late capture s':>15}{'graphs':>7}"
        f"{'ms/step':>9}{'650 epochs s':>14}{'loss@690':>10}"
    )
    for variant, warmup, capture, late_capture, graphs, per_step, loss in rows:
        print(
            f"{variant:<40}{warmup:>12.1f}{capture:>10.1f}{late_capture:>15.2f}{graphs:>7}"
            f"{1000 * per_step:>9.2f}{per_step * 14950:>14.1f}{loss:>10.3f}"
        )


if __name__ == "__main__":
    main()
