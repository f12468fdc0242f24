#!/usr/bin/env python
"""Variants of the training step's kernels, each as the whole `scripts/train.py` command (one process per
run), variants alternating within each seed so that the machine's drift hits all; a table of dev accuracy,
compilation and capture (and how many graphs were captured, the first of which compiles), pretraining steps,
the whole process and how many kernel configurations coordinate-descent tuning timed (`tuned`: none in a run
that found every kernel's tuned configuration kept) printed last.

    python benchmarks/diagnostics/step_variants.py --variants splits3,splits1 --seeds 0,1,2 --output OUT.json -- \\
        --recipe handout --attention_type vanilla --data_dir .data --mixed_precision bf16 --torch_compile

Each run is `scripts/train.py` with the flags after `--`, its own `--seed` and `--output_dir`, the variant set
before the command starts (`--run_one`); `a+b` names the variants a and b set together. Each variant has its own TorchInductor, Triton and package (compiled
artifacts) caches, empty before its first run: a variant's first seed runs cold, the others warm (`--caches
DIR` keeps them under DIR, where other runs of this script find them). `compare_accuracy.py` reads the JSON
files of several such runs and compares the accuracy of groups of them. `--output` is written again after each
run, and `--start_by SECONDS` starts no run more than SECONDS after the script began, for a machine lent for a
fixed time.

Variants (`VARIANTS`): the fused attention kernel's fp32 emulation in 3 bf16 parts per operand, 2 (as it is) or 1
(`fused_attention.DEFAULT_SPLITS`); its dropout mask taking eight 16-bit uniforms from each Philox evaluation (as it
is, `uniforms8`), its four 32-bit ones (`uniforms4`) or one (`uniforms1`, `fused_attention.UNIFORMS_PER_DRAW`); its
backward pass's softmax correction from a kernel of its own or recomputed by every backward program (`correction-kernel`, `correction-inline`,
`fused_attention.PRECOMPUTED_CORRECTION`); its forward and correction programs on one warp (`attention-forward-1-warp`,
as it is now) or two (`attention-forward-2-warps`, `fused_attention.NUM_WARPS`); packed steps' token counts rounded up to multiples
of 512 instead of 256, fewer graphs to capture (`bucket512`, `GraphedStepper.BUCKET`); three warm-up steps
before every graph's capture, not only the first's, each restored afterwards (`warmup3-every-graph`,
`GraphedStepper.LATER_WARMUP_STEPS`); a later graph captured as the first one is, after a warm-up step whose
state is restored, with the device synchronized and the memory caches emptied (torch.cuda.graph's way), instead
of after its first step run uncaptured as the step it is (`restored-later-graphs`,
`GraphedStepper.LATER_GRAPHS_AFTER_THEIR_STEP`); packed steps made ready on the host each alone instead of 64
at a time (`steps-made-ready-each-alone`, `packed_steps.plan_packed_steps`); the update by torch, the clipping compiled with the step and then fused
AdamW, instead of the multi-tensor kernels (`torch-adamw`, `GraphedStepper.MULTI_TENSOR_UPDATE`; the `eager-clip`
variants mean something only beside it, the clipping being the kernels' own otherwise); inductor options added
to the graphed step's or taken from them (`GraphedStepper.INDUCTOR_OPTIONS`: `no-shape-pad` pads only the matrix products inductor judges
compute-bound, not every one whose sizes are not multiples of 8 such as the vocabulary's 257 logits; `pdl`
launches each inductor kernel while the one before it ends (programmatic dependent launch, Hopper and later);
`cooperative-reductions` does a split reduction in one kernel with a grid-wide barrier, `no-split-reductions`
in one kernel without splitting it; `mix-order-any-size` lets inductor take a reduction over rows and one over
columns of the same tensor (a LayerNorm's backward: its input's gradient and its weight's) in one kernel whatever
the tensor's size, where it otherwise does so only for tensors it knows to hold 5·2²⁰ elements or more and 4096
rows or more (`triton.mix_order_reduction_non_strict_mode`), `no-mix-order` never; `fallback-random` draws the
residual dropouts' uniforms with ATen's kernels instead of inductor's Philox inside the kernels that use them;
`fast-exp` has inductor's kernels take Triton's approximate exp (`use_fast_math`) instead of libdevice's;
`gelu-gradient-one-exp` computes GELU's gradient from one exponential (`layers_knowgpt.GELU_GRADIENT_ONE_EXP`, as
it is), `gelu-gradient-by-autograd` from libdevice's erf and exp, as autograd's `gelu_backward` is compiled;
`gelu-forward-one-exp` computes GELU itself from one exponential where the gradient is
(`layers_knowgpt.GELU_FORWARD_ONE_EXP`, as it is), `gelu-forward-by-torch` by torch's erf;
`pointwise-autotune` times several block sizes for each pointwise kernel while compiling (`max_autotune_pointwise`);
`no-combo-kernels` launches every kernel on its own instead of several independent ones in one launch, `combo-pointwise-only` leaves reductions out of those combo kernels,
`combo-shared-blocks` gives all the kernels of a combo one set of block sizes instead of each its own (options
of recent torch releases: a run stops where the installed torch lacks a variant's option); `max-autotune-gemm`
times Triton's matrix-product templates against cuBLAS for each product, fusing the pointwise work after a
product into a template that wins (bias, GELU), `max-autotune-gemm-triton` takes the templates only;
`coordinate-descent` tunes each kernel's block sizes and warps, `coordinate-descent-dynamic-launch` too with
the kernels launched through Triton's launcher instead of inductor's static one, so that a later run finds the
tuned configurations (it adds `--tune_kernels` to the command), `dynamic-launch` the launcher alone, untuned
(the two halves of `--tune_kernels` apart); inductor's `triton.multi_kernel` is not offered: on torch 2.11 a
run that loads its kernels from the cache fails, `results/h100_step_variants_pad_bucket.log`); dynamo's
experimental cache of its traced code and guards, so that a warm run need not trace again
(`caching-precompile`, `torch._dynamo.config.caching_precompile`; on torch 2.11 it fails at the first capture,
`results/h200_step_variants_caching_precompile_failure.log`); the step's parts compiled the default way,
traced by dynamo in every run, instead of compiled whole and kept (`traced-every-run`,
`compile_cache.PrecompiledFunction`); the compiled artifacts not loaded into the compiler's caches where the
traced step's file is there (`functions-only`: what loading them costs a warm run); inductor's compile threads
left as they are while the step loads, so that its pool of compile workers starts
(`compile-workers-when-loaded`, `compile_cache._compile_in_this_process`); torch's and Triton's digests, which
inductor's and Triton's caches are keyed on, computed when the step loads instead of on a thread while the data
and model are made ready (`compiler-keys-when-loaded`, `compile_cache.prefetch_compiler_keys`); the loss summed
over all the tokens at once, where the model sums 256 at a time and then those sums (`loss-one-level`,
`layers_knowgpt.LOSS_CHUNK`); the attention's input projection's and the MLP's first bias gradients by
autograd's sums instead of the column-sum kernel (`bias-gradient-by-autograd`, `layers_knowgpt.BIAS_GRADIENT_KERNEL`); the
linear layers' weight gradients as products written in fp32 instead of bf16 products cast to fp32
(`fp32-weight-gradients`, `layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`, as it is now; `weight-gradients-by-autograd` the
other way); the residual stream in fp32 under autocast (`residual-in-fp32`: `--residual_in_fp32`) or in autocast's
dtype (`residual-in-autocast-dtype`: `--no_residual_in_fp32`, `KnowGPTConfig.residual_in_fp32`); every residual sum
with its dropout and the LayerNorm after it as the package's Triton kernel each way instead of inductor's
(`fused-layers`: it adds `--fused_layers` to the command), its dropout mask stored by the
forward kernel for the backward one (`fused-layers-mask-stored`, `fused_layers.RESIDUAL_MASK_STORED`), its backward
kernel's column sums kept per row until its last tile (`fused-layers-sums-at-end`, `fused_layers.COLUMN_SUMS_AT_END`), that with
tiles of 1024 elements and 2 backward programs per multiprocessor (`fused-layers-sums-at-end-1024-2`); each
dropout's mask in a compiled step drawn by the package's kernel, eight 16-bit uniforms per Philox evaluation, and
multiplied in by inductor's kernels, instead of inductor drawing one evaluation per element inside them
(`dropout-mask-kernel`, `layers_knowgpt.DROPOUT_MASK_KERNEL`, as it is now; `dropout-mask-by-inductor` the other
way), the masks of the embeddings' and the blocks' branches' dropouts drawn in one launch a step instead of one each
(`dropout-masks-together`, `layers_knowgpt.DROPOUT_MASKS_TOGETHER`, as it is now; `dropout-masks-one-by-one` the other
way); cuBLAS and cuBLASLt given no
workspace, so no split-K product with a reduce kernel of its own (`blas-no-workspace`, environment variables set before the run starts); the compiled step's weight-gradient products
taken together in one launch at the end of its backward pass, with the wide layers' bias gradients
(`weight-gradients-together`, `GraphedStepper.WEIGHT_GRADIENTS_TOGETHER`, as it is now; `weight-gradients-apart` the
other way), that with the tokens in two parts (`weight-gradients-together-splits2`, `grouped_products.SPLITS`), that
without the bias gradients, left to `column_sums`'s kernels (`weight-gradients-together-without-sums`,
`grouped_products.COLUMN_SUMS_TOGETHER`), that with the narrow layers' bias gradients taken into the launch too
(`narrow-bias-sums-together`, `layers_knowgpt.NARROW_BIAS_SUMS_TOGETHER`, as it is now; `narrow-bias-sums-apart` the
other way); the attention kernel handed the queries, keys and values as one stacked
tensor, their gradients written as one instead of concatenated after (`stacked-attention-inputs`,
`attention_knowgpt.STACKED_ATTENTION_INPUTS`, as it is now; `three-attention-inputs` the other way); the update's gradients concatenated into one
buffer before its kernels read them, instead of read where autograd left them (`gradients-concatenated`,
`multi_tensor_adamw.GRADIENTS_IN_PLACE`); parts of the compiled step left uncompiled: its batch (`eager-batch`,
`GraphedStepper.compiled_device_batch`), its clipping and learning rate (`eager-clip`), both
(`eager-batch-clip`); CPU training without keeping freed memory for reuse (`fast_path.reuse_freed_memory`).
Several GPUs, four processes at width 1024:

    python benchmarks/diagnostics/step_variants.py --processes 4 --variants as-is,no-combo-kernels --seeds 0,1 -- \\
        --recipe handout --attention_type vanilla --data_dir .data --mixed_precision bf16 --torch_compile \\
        --n_embd 1024 --n_head 16 --pretrain_max_epochs 100

(`--processes N`: each run under `accelerate launch --multi_gpu --num_processes N`, one GPU each). On a CPU,
for instance:

    python benchmarks/diagnostics/step_variants.py --variants as-is,no-memory-reuse --seeds 0,0,0 -- \\
        --recipe quickstart --pretrain_max_epochs 10 --no_do_finetune --mixed_precision bf16
"""

import argparse
import atexit
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_knowgpt.utils.checkpoints import write_json_atomic
from hf_knowgpt.utils.timeline import phase_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_processes import launch  # noqa: E402  (benchmarks/ is not a package)

VARIANTS = {
    "as-is": {},
    # "attention_knowgpt", "fused_attention", "fused_layers", "grouped_products", "layers_knowgpt", "multi_tensor_adamw":
    # settings of those modules, which they read at each launch or call
    "splits3": {"fused_attention": {"DEFAULT_SPLITS": 3}},
    "splits1": {"fused_attention": {"DEFAULT_SPLITS": 1}},
    "splits2": {"fused_attention": {"DEFAULT_SPLITS": 2}},
    "uniforms4": {"fused_attention": {"UNIFORMS_PER_DRAW": 4}},
    "uniforms1": {"fused_attention": {"UNIFORMS_PER_DRAW": 1}},
    "uniforms8": {"fused_attention": {"UNIFORMS_PER_DRAW": 8}},
    "correction-kernel": {"fused_attention": {"PRECOMPUTED_CORRECTION": True}},
    "correction-inline": {"fused_attention": {"PRECOMPUTED_CORRECTION": False}},
    # The forward (and correction) programs on one warp (as it is now) or two, the backward's on two, as
    # `bench_attention.py --groups launch` times them ("forward 2 warps" against the library's defaults).
    "attention-forward-1-warp": {"fused_attention": {"NUM_WARPS": {16: 1}, "BACKWARD_NUM_WARPS": {16: 2}}},
    "attention-forward-2-warps": {"fused_attention": {"NUM_WARPS": {16: 2}, "BACKWARD_NUM_WARPS": {16: 2}}},
    "bucket512": {"bucket": 512},
    "warmup3-every-graph": {"later_warmup_steps": 3, "later_graphs_after_their_step": False},
    # a later graph captured as the first one is (torch.cuda.graph: the device synchronized, the caches emptied),
    # after a warm-up step whose state is restored (GraphedStepper.LATER_GRAPHS_AFTER_THEIR_STEP)
    "restored-later-graphs": {"later_graphs_after_their_step": False},
    "coordinate-descent": {"inductor": {"coordinate_descent_tuning": True}},
    "coordinate-descent-dynamic-launch": {"flags": ["--tune_kernels"]},  # GraphedStepper.TUNING_OPTIONS
    "dynamic-launch": {"inductor": {"use_static_cuda_launcher": False}},
    "aggressive-fusion": {"inductor": {"aggressive_fusion": True}},
    "no-combo-kernels": {"inductor": {"combo_kernels": False}},
    "combo-pointwise-only": {"inductor": {"combo_kernels_pointwise_only": True}},
    "combo-shared-blocks": {"inductor": {"combo_kernel_per_subkernel_blocks": False}},
    "no-shape-pad": {"inductor": {"force_shape_pad": False}},
    "max-autotune-gemm": {"inductor": {"max_autotune_gemm": True}},
    "max-autotune-gemm-triton": {"inductor": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON"}},
    "pdl": {"inductor": {"triton.enable_pdl": True}},
    "cooperative-reductions": {"inductor": {"triton.cooperative_reductions": True}},
    "no-split-reductions": {"inductor": {"split_reductions": False}},
    "mix-order-any-size": {"inductor": {"triton.mix_order_reduction_non_strict_mode": True}},
    "no-mix-order": {"inductor": {"triton.mix_order_reduction": False}},
    "fallback-random": {"inductor": {"fallback_random": True}},
    # Triton's fast exp (ex2.approx, denormals flushed) where inductor writes libdevice's exact one: the loss's, and
    # GELU's gradient's with `gelu-gradient-by-autograd` (an exp and an erf per element of the MLP's 7680 × 1024
    # states, 21.8 µs a layer on an H100; `gelu_slope` takes an exp2 instead)
    "fast-exp": {"inductor": {"use_fast_math": True}},
    # several block sizes of each pointwise kernel timed at compilation, the fastest kept
    "pointwise-autotune": {"inductor": {"max_autotune_pointwise": True}},
    "caching-precompile": {"dynamo": {"caching_precompile": True}},
    "traced-every-run": {"traced_every_run": True},
    "functions-only": {"functions_only": True},
    "compile-workers-when-loaded": {"compile_workers_when_loaded": True},
    "compiler-keys-when-loaded": {"compiler_keys_when_loaded": True},
    "no-memory-reuse": {"memory_reuse": False},
    "loss-one-level": {"layers_knowgpt": {"LOSS_CHUNK": 0}},
    "bias-gradient-by-autograd": {"layers_knowgpt": {"BIAS_GRADIENT_KERNEL": False}},
    "fp32-weight-gradients": {"layers_knowgpt": {"WEIGHT_GRADIENT_IN_FP32": True}},
    "weight-gradients-by-autograd": {"layers_knowgpt": {"WEIGHT_GRADIENT_IN_FP32": False}},
    "narrow-bias-sums-together": {"layers_knowgpt": {"NARROW_BIAS_SUMS_TOGETHER": True}},
    "narrow-bias-sums-apart": {"layers_knowgpt": {"NARROW_BIAS_SUMS_TOGETHER": False}},
    "dropout-mask-kernel": {"layers_knowgpt": {"DROPOUT_MASK_KERNEL": True}},
    "dropout-mask-by-inductor": {"layers_knowgpt": {"DROPOUT_MASK_KERNEL": False}},
    "dropout-masks-together": {"layers_knowgpt": {"DROPOUT_MASKS_TOGETHER": True}},
    "dropout-masks-one-by-one": {"layers_knowgpt": {"DROPOUT_MASKS_TOGETHER": False}},
    # GELU's gradient from one exponential (layers_knowgpt.gelu_slope) instead of libdevice's erf and exp
    "gelu-gradient-one-exp": {"layers_knowgpt": {"GELU_GRADIENT_ONE_EXP": True}},
    "gelu-gradient-by-autograd": {"layers_knowgpt": {"GELU_GRADIENT_ONE_EXP": False}},
    # GELU itself from one exponential (layers_knowgpt.gelu_from_one_exp) or torch's erf, where the gradient is
    "gelu-forward-one-exp": {"layers_knowgpt": {"GELU_FORWARD_ONE_EXP": True}},
    "gelu-forward-by-torch": {"layers_knowgpt": {"GELU_FORWARD_ONE_EXP": False}},
    "residual-in-fp32": {"flags": ["--residual_in_fp32"]},  # KnowGPTConfig.residual_in_fp32
    "residual-in-autocast-dtype": {"flags": ["--no_residual_in_fp32"]},
    "fused-layers": {"flags": ["--fused_layers"]},  # KnowGPTModel.fused_layers, compiled or not
    "fused-layers-mask-stored": {"flags": ["--fused_layers"], "fused_layers": {"RESIDUAL_MASK_STORED": True}},
    "fused-layers-sums-at-end": {"flags": ["--fused_layers"], "fused_layers": {"COLUMN_SUMS_AT_END": True}},
    # with the tiles and backward programs that ran the residual kernels fastest (bench_fused_layers.py --tile_elements
    # 1024 --programs_per_sm 2: 0.043 ms against inductor's 0.048, H200, 2026-12-05)
    "fused-layers-sums-at-end-1024-2": {
        "flags": ["--fused_layers"],
        "fused_layers": {"COLUMN_SUMS_AT_END": True, "TILE_ELEMENTS": 1024, "PROGRAMS_PER_SM": 2},
    },
    "gradients-concatenated": {"multi_tensor_adamw": {"GRADIENTS_IN_PLACE": False}},
    # the weight-gradient products in one launch at the end of the backward pass (GraphedStepper.WEIGHT_GRADIENTS_TOGETHER,
    # kernels.grouped_products), the tokens whole or in two parts, the wide layers' bias gradients in the launch too or
    # not; compiled steps only
    "weight-gradients-together": {"weight_gradients_together": True},
    "weight-gradients-together-splits2": {"weight_gradients_together": True, "grouped_products": {"SPLITS": 2}},
    "weight-gradients-together-without-sums": {
        "weight_gradients_together": True,
        "grouped_products": {"COLUMN_SUMS_TOGETHER": False},
    },
    "weight-gradients-apart": {"weight_gradients_together": False},  # cuBLAS's products, column_sums's kernels
    # the attention kernel handed one projection's queries, keys and values as one tensor, their gradients written as
    # one (attention_knowgpt.STACKED_ATTENTION_INPUTS), or as three tensors, their gradients concatenated after
    "stacked-attention-inputs": {"attention_knowgpt": {"STACKED_ATTENTION_INPUTS": True}},
    "three-attention-inputs": {"attention_knowgpt": {"STACKED_ATTENTION_INPUTS": False}},
    # "env": set in the run's environment before it starts. No cuBLAS or cuBLASLt workspace: no split-K product
    # that keeps its partial sums there and adds them up in a reduce kernel of its own (16 a step at the handout's
    # size, 2.2 µs each)
    "blas-no-workspace": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}},
    "eager-batch": {"uncompiled": ("compiled_device_batch",)},
    "eager-clip": {"uncompiled": ("compiled_clip_and_rate",)},
    "eager-batch-clip": {"uncompiled": ("compiled_device_batch", "compiled_clip_and_rate")},
    # the update by torch: the clipping compiled with the step, then fused AdamW (GraphedStepper.MULTI_TENSOR_UPDATE)
    "torch-adamw": {"multi_tensor_update": False},
    # packed steps made ready on the host each alone, as before packed_steps.plan_packed_steps
    "steps-made-ready-each-alone": {"each_step_alone": True},
}


COUNTERS_FILE = "inductor_counters.json"


def write_inductor_counters(output_dir: Path) -> None:
    """Inductor's counters of this process (`coordesc_tuning_bench`: kernel configurations timed by
    coordinate-descent tuning) and its metric `codegen_mix_order_reduction` (kernels generated as reductions over
    rows and columns at once) into the run's output directory, from the first process only; nothing where the
    run did not compile, so that a process that never imported dynamo does not import it at exit."""
    if os.environ.get("RANK", "0") != "0" or "torch._dynamo.utils" not in sys.modules:
        return
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    found = dict(counters["inductor"])
    found["codegen_mix_order_reduction"] = getattr(metrics, "codegen_mix_order_reduction", None)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / COUNTERS_FILE).write_text(json.dumps(found))


def setting_modules() -> dict:
    """The modules whose settings a variant may set, by the keys of VARIANTS that name them."""
    from hf_knowgpt import attention_knowgpt, layers_knowgpt
    from hf_knowgpt.kernels import fused_attention, fused_layers, grouped_products, multi_tensor_adamw

    return {
        "attention_knowgpt": attention_knowgpt,
        "fused_attention": fused_attention,
        "fused_layers": fused_layers,
        "grouped_products": grouped_products,
        "layers_knowgpt": layers_knowgpt,
        "multi_tensor_adamw": multi_tensor_adamw,
    }


def variant_settings(variant: str) -> dict:
    """A variant's settings; `a+b` names the variants a and b together: their module settings, inductor options and
    environments merged, their flags and uncompiled parts joined. Two parts that set one thing differently are an
    error, not a silent choice."""
    parts = variant.split("+")
    if unknown := [part for part in parts if part not in VARIANTS]:
        raise ValueError(f"unknown variant {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    merged = {}
    for part in parts:
        for key, value in VARIANTS[part].items():
            if key not in merged:
                merged[key] = value
            elif isinstance(value, dict) and isinstance(merged[key], dict):
                if clash := [name for name in value if name in merged[key] and merged[key][name] != value[name]]:
                    raise ValueError(f"variant {variant}: its parts set {key} {', '.join(clash)} differently")
                merged[key] = {**merged[key], **value}
            elif isinstance(value, (list, tuple)) and isinstance(merged[key], (list, tuple)):
                merged[key] = (*merged[key], *value)
            elif merged[key] != value:
                raise ValueError(f"variant {variant}: its parts set {key} differently")
    return merged


def options_this_torch_lacks(settings: dict) -> list[str]:
    """The inductor options of a variant's settings that the installed torch does not have: the graphed step would
    leave them out and the run would measure the code as it is."""
    options = settings.get("inductor", {})
    if not options:  # the package (and torch) imported only where there is something to check
        return []
    from hf_knowgpt.training.fast_path import known_inductor_options

    return sorted(options.keys() - known_inductor_options(options).keys())


def run_one(variant: str, train_args: list[str]) -> None:
    from hf_knowgpt.commands import cli, train
    from hf_knowgpt.training import trainer
    from hf_knowgpt.training.fast_path import GraphedStepper

    settings = variant_settings(variant)
    inductor_options = settings.get("inductor", {})
    if unknown := options_this_torch_lacks(settings):
        raise SystemExit(f"variant {variant}: this torch's inductor has no option {', '.join(unknown)}")
    if settings.get("dynamo"):
        import torch._dynamo

        for name, value in settings["dynamo"].items():
            setattr(torch._dynamo.config, name, value)
    for module_name, module in setting_modules().items():
        for name, value in settings.get(module_name, {}).items():
            setattr(module, name, value)
    GraphedStepper.INDUCTOR_OPTIONS = {**GraphedStepper.INDUCTOR_OPTIONS, **inductor_options}
    GraphedStepper.BUCKET = settings.get("bucket", GraphedStepper.BUCKET)
    if settings.get("each_step_alone"):
        from diagnostics.host_step_plan import prepare_each_step_alone

        GraphedStepper._prepare_packed = prepare_each_step_alone
    GraphedStepper.LATER_WARMUP_STEPS = settings.get("later_warmup_steps", GraphedStepper.LATER_WARMUP_STEPS)
    GraphedStepper.MULTI_TENSOR_UPDATE = settings.get("multi_tensor_update", GraphedStepper.MULTI_TENSOR_UPDATE)
    GraphedStepper.WEIGHT_GRADIENTS_TOGETHER = settings.get(
        "weight_gradients_together", GraphedStepper.WEIGHT_GRADIENTS_TOGETHER
    )
    GraphedStepper.LATER_GRAPHS_AFTER_THEIR_STEP = settings.get(
        "later_graphs_after_their_step", GraphedStepper.LATER_GRAPHS_AFTER_THEIR_STEP
    )
    if settings.get("traced_every_run"):  # every part compiled the default way: dynamo traces it in every run
        from hf_knowgpt.training import compile_cache

        def not_whole(self, args, kwargs):
            raise RuntimeError("traced-every-run variant")

        compile_cache.PrecompiledFunction._compile = not_whole
    if settings.get("functions_only"):  # the compiled artifacts left out of the caches where the traced step is kept
        from hf_knowgpt.training import compile_cache, fast_path

        load_artifacts = fast_path.load_artifacts
        fast_path.load_artifacts = lambda path: (
            False if compile_cache.functions_file(path).is_file() else load_artifacts(path)
        )
    if settings.get("compile_workers_when_loaded"):  # inductor's pool of compile workers started by loading, as before
        from hf_knowgpt.training import compile_cache

        compile_cache._compile_in_this_process = lambda: None
    if settings.get("compiler_keys_when_loaded"):  # torch's and Triton's digests computed by the loading itself
        from hf_knowgpt.training import workflows

        workflows.prefetch_compiler_keys = lambda: None
    if not settings.get("memory_reuse", True):
        trainer.reuse_freed_memory = lambda: None
    if settings.get("uncompiled"):
        original_init = GraphedStepper.__init__

        def init_with_uncompiled_parts(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            for part in settings["uncompiled"]:
                setattr(self, part, None)

        GraphedStepper.__init__ = init_with_uncompiled_parts
    if "--output_dir" in train_args:  # run_script runs the exit handlers before it ends the process
        atexit.register(write_inductor_counters, Path(train_args[train_args.index("--output_dir") + 1]))
    sys.argv = ["train.py", *train_args, *settings.get("flags", ())]
    cli.run_script(train.main)


def variant_caches(root: Path, variant: str) -> dict:
    """The environment that gives a variant's runs their TorchInductor, Triton and package caches under `root`."""
    return {
        name: str(root / f"{variant}-caches" / name)
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KNOWGPT_COMPILE_CACHE")
    }


def parse_args(argv=None):
    """This script's flags, and the rest for `scripts/train.py`. No abbreviations: `--seed` (train.py's, given to
    each run) must not be taken for `--seeds`."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--variants",
        default="splits3,splits1",
        help=f"from {', '.join(VARIANTS)}, in order; a+b runs the variants a and b together",
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--output", default=None, help="write the runs as JSON here (again after each run)")
    parser.add_argument(
        "--start_by",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no run later than this many seconds after this script started (a machine lent for a fixed"
        " time): the runs left are named and skipped",
    )
    parser.add_argument(
        "--caches",
        default=None,
        help="keep each variant's caches under this folder instead of a new temporary one, so that runs of this"
        " script one after another or at once share them (a folder filled elsewhere: its runs start warm)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="more than 1: each run under `accelerate launch --multi_gpu`"
    )
    parser.add_argument("--run_one", default=None, help=argparse.SUPPRESS)
    args, train_args = parser.parse_known_args(argv)
    return parser, args, [a for a in train_args if a != "--"]


def main(argv=None):
    parser, args, train_args = parse_args(argv)
    if args.run_one is not None:
        return run_one(args.run_one, train_args)
    variants = args.variants.split(",")
    for variant in variants:
        try:
            settings = variant_settings(variant)
        except ValueError as error:
            parser.error(f"--variants: {error}")
        if unknown := options_this_torch_lacks(settings):  # refused before any run, not after the runs before it
            parser.error(f"--variants: {variant}: this torch's inductor has no option {', '.join(unknown)}")
    precision = train_args[train_args.index("--mixed_precision") + 1] if "--mixed_precision" in train_args else "no"
    work = Path(tempfile.mkdtemp(prefix="knowgpt-step-variants-"))
    runs, began = [], time.perf_counter()
    planned = [(seed, variant) for seed in args.seeds.split(",") for variant in variants]
    for number, (seed, variant) in enumerate(planned):
        if args.start_by is not None and time.perf_counter() - began > args.start_by:
            left = ", ".join(f"{later} seed {later_seed}" for later_seed, later in planned[number:])
            print(f"--start_by {args.start_by:g} s passed: not started: {left}", flush=True)
            break
        output_dir = work / f"{variant}-seed{seed}-run{len(runs)}"
        caches = variant_caches(Path(args.caches) if args.caches else work, variant)
        this_run = [__file__, "--run_one", variant, *train_args, "--seed", seed]
        if args.processes > 1:
            command = launch(args.processes, precision, *this_run)
        else:
            command = [sys.executable, *this_run]
        command += ["--output_dir", str(output_dir)]
        started, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        started_wall = time.time()  # the timeline's marks are wall clock
        environment = {**os.environ, **caches, **variant_settings(variant).get("env", {})}
        subprocess.run(command, check=True, env=environment)
        seconds, ended_wall = time.perf_counter() - started, time.time()
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults
        summary = json.loads((output_dir / "results.json").read_text())
        pretrain = summary["stages"]["pretrain"]
        phases = dict(phase_seconds(started_wall, summary["timeline"], ended_wall))
        steps_s = pretrain["train_seconds"] - pretrain["warmup_seconds"]  # loading precedes train_seconds
        counters_file = output_dir / COUNTERS_FILE
        counters = json.loads(counters_file.read_text()) if counters_file.is_file() else {}
        runs.append(
            {
                "variant": variant,
                "seed": int(seed),
                "process_s": seconds,
                "pretrain_capture_s": pretrain["warmup_seconds"],
                "pretrain_graphs": len(pretrain["captures"]),
                "pretrain_first_capture_s": pretrain["captures"][0]["seconds"] if pretrain["captures"] else 0.0,
                "pretrain_load_s": pretrain.get("load_seconds", 0.0),
                # the loop's set-up less the loading: optimizer, accelerate's preparation, the stepper
                "pretrain_setup_s": pretrain.get("setup_seconds", 0.0) - pretrain.get("load_seconds", 0.0),
                "pretrain_steps_s": steps_s,
                "exit_s": phases["exit"],
                "process_less_steps_s": seconds - steps_s,
                "page_faults": faults,
                "coordesc_benchmarks": counters.get("coordesc_tuning_bench", 0),
                "mix_order_kernels": counters.get("codegen_mix_order_reduction"),
                "final_loss": pretrain["final_loss"],
                "dev_accuracy": summary["dev"]["accuracy"],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
        if args.output:  # after each run, so that a run cut short leaves those before it
            write_json_atomic(args.output, runs)
    width = max([20] + [len(run["variant"]) + 2 for run in runs])
    print(
        f"\n{'variant':<{width}}{'seed':>6}{'dev %':>8}{'final loss':>12}{'capture s':>11}{'graphs':>8}"
        f"{'first s':>9}{'set-up s':>10}{'load s':>8}{'steps s':>9}{'exit s':>8}{'process s':>11}{'less steps':>12}{'page faults':>13}{'tuned':>7}"
    )
    for run in runs:
        print(
            f"{run['variant']:<{width}}{run['seed']:>6}{100 * run['dev_accuracy']:>8.1f}{run['final_loss']:>12.3f}"
            f"{run['pretrain_capture_s']:>11.1f}{run['pretrain_graphs']:>8}{run['pretrain_first_capture_s']:>9.1f}"
            f"{run['pretrain_setup_s']:>10.2f}{run['pretrain_load_s']:>8.2f}{run['pretrain_steps_s']:>9.1f}{run['exit_s']:>8.2f}{run['process_s']:>11.1f}"
            f"{run['process_less_steps_s']:>12.1f}{run['page_faults']:>13,}{run['coordesc_benchmarks']:>7}"
        )


if __name__ == "__main__":
    main()
