#!/usr/bin/env python
"""The fused residual + dropout + LayerNorm and bias + GELU kernels (`hf_knowgpt.kernels.fused_layers`)
against the plain PyTorch composition, forward + backward, on a CUDA GPU. Prints a table last.

    python benchmarks/bench_fused_layers.py [--reps 200] [--dropout 0.1]

Shapes: the handouts' (16384 rows = 128 sequences × 128 positions, n_embd 256), the handout recipe's packed
step (7680 tokens, n_embd 256) and the knowledge runs' (65536 rows, n_embd 512); the MLP's GELU runs on rows
4·n_embd wide. Dtypes: `fp32` (all fp32), `autocast`
(as the model trains under bf16 autocast: the residual stream fp32, the branch and the MLP's hidden states
bf16, parameters fp32), `bf16` (all activations bf16, parameters fp32). PyTorch runs under bf16 autocast
for the last two, as the model does. `torch` for bias + GELU is gelu(x + bias) in x's dtype; `torch gelu
only` times gelu(x) alone, what the model pays when the bias is added inside the matmul, the bound a fused
bias + GELU must beat. `torch compiled` is the residual's composition compiled by inductor, its LayerNorm's
output cast to bf16 under autocast as the next layer casts it: what a compiled training step runs without
`--fused_layers`; `fused, normalized bf16` writes that output in bf16 itself, as the model asks under autocast;
`+ branch bias` adds the branch's last layer's bias too (the compiled composition summing its gradient, the fused
kernel adding the bias and summing its gradient itself), as a step with `--fused_layers` does; `mask stored` has the
forward kernel write its dropout mask as bytes for the backward kernel to read (`fused_layers.RESIDUAL_MASK_STORED`),
`column sums at end` has the backward kernel keep its column sums per row until its last tile
(`fused_layers.COLUMN_SUMS_AT_END`), `both` both.
Each time is the median of `--reps` forward + backward passes (`--passes forward`: forward passes alone,
without gradients), timed with CUDA events:
`graphed`, one CUDA graph of the pass replayed (GPU time alone, as the graphed training step runs it), and
`eager`, the pass launched from Python (launch overhead included: at the handouts' shape it dominates).
The speed-up compares graphed times.
"""

import argparse
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import graphed  # noqa: E402

from hf_knowgpt.kernels import fused_layers  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

SHAPES = {"handout": (16384, 256), "handout-packed": (7680, 256), "knowledge": (65536, 512)}
EPS = 1e-5


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="timed forward + backward passes per variant")
    parser.add_argument("--warmup", type=int, default=20, help="untimed passes first (compilation, caches)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout on the residual branch")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="row shapes")
    parser.add_argument(
        "--dtypes", nargs="+", default=["fp32", "autocast", "bf16"], choices=["fp32", "autocast", "bf16"],
        help="fp32; the model's bf16 autocast (fp32 residual stream, bf16 branch); bf16 activations",
    )  # fmt: skip
    parser.add_argument(
        "--tile_elements", type=int, default=None,
        help=f"elements per program tile, for tuning (default fused_layers.TILE_ELEMENTS = {fused_layers.TILE_ELEMENTS})",
    )  # fmt: skip
    parser.add_argument(
        "--programs_per_sm", type=int, default=None,
        help="programs per multiprocessor of the backward kernels, which write one partial sum each, for tuning "
        f"(default fused_layers.PROGRAMS_PER_SM = {fused_layers.PROGRAMS_PER_SM})",
    )  # fmt: skip
    parser.add_argument(
        "--passes", choices=["forward+backward", "forward"], default="forward+backward",
        help="what each variant times: a training step's share (default) or its forward pass alone, without gradients",
    )  # fmt: skip
    parser.add_argument(
        "--ops", nargs="+", choices=["residual", "gelu"], default=["residual", "gelu"], help="which ops to time"
    )  # fmt: skip
    return parser.parse_args()


def median_ms(step, reps: int, warmup: int) -> float:
    """Median over `reps` of one call of `step`, each between its own pair of CUDA events."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def forward_backward(function, inputs, autocast: bool, backward: bool = True):
    """One training step's share of `function`: its outputs, then the gradients of all `inputs` for fixed
    output gradients (made once, on the first call); without `backward`, its outputs alone, without
    gradients."""
    output_grads = []

    def step():
        if not backward:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                function(*inputs)
            return
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            outputs = function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if not output_grads:
            output_grads.extend(torch.randn_like(output) for output in outputs)
        torch.autograd.grad(outputs, inputs, output_grads)

    return step


def layer_inputs(rows, width, dtype):
    activation = {"fp32": torch.float32, "autocast": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
    residual_dtype = torch.float32 if dtype == "autocast" else activation

    def tensor(shape, tensor_dtype):
        return torch.randn(shape, device="cuda").to(tensor_dtype).requires_grad_()

    layer = (tensor((rows, width), residual_dtype), tensor((rows, width), activation))
    layer += (tensor(width, torch.float32), tensor(width, torch.float32))
    gelu = (tensor((rows, 4 * width), activation), tensor(4 * width, torch.float32))
    return layer, gelu


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_layers.py times CUDA kernels: it needs a CUDA GPU (none is visible here).")
    if fused_layers.triton is None:
        sys.exit("bench_fused_layers.py needs Triton (it ships with CUDA builds of torch).")
    if args.tile_elements is not None:
        fused_layers.TILE_ELEMENTS = args.tile_elements
    if args.programs_per_sm is not None:
        fused_layers.PROGRAMS_PER_SM = args.programs_per_sm
    print(f"device: {describe_device()}, torch {torch.__version__}, triton {fused_layers.triton.__version__}")
    p = args.dropout

    def torch_layer(residual, branch, weight, bias):
        return fused_layers.residual_layer_norm_reference(residual, branch, weight, bias, EPS, p, True)

    def fused_layer(residual, branch, weight, bias):
        return fused_layers.fused_residual_layer_norm(residual, branch, weight, bias, EPS, p, True)

    def fused_layer_low(residual, branch, weight, bias):
        return fused_layers.fused_residual_layer_norm(
            residual, branch, weight, bias, EPS, p, True, normalized_dtype=torch.bfloat16
        )

    def torch_layer_for_the_next_product(residual, branch, weight, bias, branch_bias=None):
        if branch_bias is not None:
            branch = branch + branch_bias.to(branch.dtype)
        new, normalized = torch_layer(residual, branch, weight, bias)
        return new, normalized.to(torch.bfloat16) if torch.is_autocast_enabled("cuda") else normalized

    def fused_layer_low_biased(residual, branch, weight, bias, branch_bias):
        return fused_layers.fused_residual_layer_norm(
            residual, branch, weight, bias, EPS, p, True, normalized_dtype=torch.bfloat16, branch_bias=branch_bias
        )

    def with_settings(function, **settings):
        """`function` called with fused_layers' `settings` (RESIDUAL_MASK_STORED, COLUMN_SUMS_AT_END) in force,
        each restored after the call; a captured graph keeps what its kernels were launched with."""

        def call(*inputs):
            with mock.patch.multiple(fused_layers, **settings):
                return function(*inputs)

        return call

    def timed(function, inputs, under_autocast):
        return forward_backward(function, inputs, under_autocast, backward=args.passes == "forward+backward")

    rows_out = []
    for shape_name in args.shapes:
        rows, width = SHAPES[shape_name]
        for dtype in args.dtypes:
            torch.manual_seed(0)
            layer, gelu = layer_inputs(rows, width, dtype)
            autocast = dtype != "fp32"
            torch._dynamo.reset()  # each shape and dtype compiled afresh, as a step compiles its own
            compiled_layer = torch.compile(torch_layer_for_the_next_product, dynamic=False)
            biased = (*layer, torch.randn(width, device="cuda", requires_grad=True))
            residual_group, gelu_group = f"residual+dropout({p})+LN", "bias+GELU"
            variants = []
            if "residual" in args.ops:
                variants += [
                    (residual_group, (rows, width), "torch", timed(torch_layer, layer, autocast)),
                    (residual_group, (rows, width), "torch compiled", timed(compiled_layer, layer, autocast)),
                    (residual_group, (rows, width), "fused", timed(fused_layer, layer, False)),
                ]
            if "residual" in args.ops and autocast:
                variants += [
                    (residual_group, (rows, width), "fused, normalized bf16", timed(fused_layer_low, layer, False)),
                    (residual_group, (rows, width), "torch compiled + branch bias", timed(compiled_layer, biased, autocast)),
                    (residual_group, (rows, width), "fused, normalized bf16 + branch bias", timed(fused_layer_low_biased, biased, False)),
                    (residual_group, (rows, width), "fused, normalized bf16 + branch bias, mask stored", timed(with_settings(fused_layer_low_biased, RESIDUAL_MASK_STORED=True), biased, False)),
                    (residual_group, (rows, width), "fused, normalized bf16 + branch bias, column sums at end", timed(with_settings(fused_layer_low_biased, COLUMN_SUMS_AT_END=True), biased, False)),
                    (residual_group, (rows, width), "fused, normalized bf16 + branch bias, both", timed(with_settings(fused_layer_low_biased, RESIDUAL_MASK_STORED=True, COLUMN_SUMS_AT_END=True), biased, False)),
                ]  # fmt: skip
            if "gelu" in args.ops:
                variants += [
                    (gelu_group, (rows, 4 * width), "torch", timed(fused_layers.bias_gelu_reference, gelu, False)),
                    (gelu_group, (rows, 4 * width), "torch gelu only", timed(F.gelu, gelu[:1], False)),
                    (gelu_group, (rows, 4 * width), "fused", timed(fused_layers.fused_bias_gelu, gelu, False)),
                ]
            baseline = {}
            for group, group_shape, variant, step in variants:
                eager_ms = median_ms(step, args.reps, args.warmup)
                graph_ms = median_ms(graphed(step), args.reps, args.warmup)
                baseline.setdefault(group, graph_ms)  # each group's first variant: plain PyTorch
                shape = f"{group_shape[0]}×{group_shape[1]}"
                rows_out.append((group, shape, dtype, variant, graph_ms, eager_ms, baseline[group] / graph_ms))
                print(
                    f"  {group} {shape} {dtype} {variant}: {graph_ms:.3f} ms graphed, {eager_ms:.3f} eager", flush=True
                )
            del layer, gelu
            torch.cuda.empty_cache()

    header = ("op", "shape", "dtype", "variant")
    widths = [max(len(header[i]), *(len(str(row[i])) for row in rows_out)) for i in range(4)]
    print(
        f"\ntile elements: {fused_layers.TILE_ELEMENTS}, backward programs per multiprocessor: "
        f"{fused_layers.PROGRAMS_PER_SM}, dropout {p}, median of {args.reps}, passes timed: {args.passes}"
    )
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)) + " | graphed ms |   eager ms | speed-up (graphed)")
    for *cells, graph_ms, eager_ms, ratio in rows_out:
        print(
            " | ".join(c.ljust(w) for c, w in zip(cells, widths))
            + f" | {graph_ms:10.3f} | {eager_ms:10.3f} | {ratio:.2f}×"
        )


if __name__ == "__main__":
    main()
