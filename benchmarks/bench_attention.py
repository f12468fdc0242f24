#!/usr/bin/env python
"""Attention kernels side by side at the handouts' training shape: forward + backward of causal
attention with dropout 0.1 on bf16 projections (batch 128, 8 heads, 114 positions, head size 32), one
CUDA graph per kernel replayed many times. Prints a table last.

    python benchmarks/bench_attention.py

Kernels: the fused Triton kernel (`hf_knowgpt.fused_attention`) with 1–3 half-precision parts of its fp32
operands, and several query-block sizes and warp counts; SDPA with the inputs cast to fp32 (the memory-efficient kernel: what `attention_kernel_dtype=
"float32"` ran before); SDPA in bf16 (flash: fast, but training diverges with it); unfused fp32.
"""

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_knowgpt import fused_attention  # noqa: E402
from hf_knowgpt.model_card import describe_device  # noqa: E402
from hf_knowgpt.modeling_knowgpt import _in_precision, eager_attention, sdpa_attention  # noqa: E402


@contextlib.contextmanager
def launch_options(overrides):
    """Launch the fused kernels (forward and backward) with these options for the duration."""
    original = fused_attention._launch_options
    fused_attention._launch_options = lambda length: {**original(length), **overrides}
    try:
        yield
    finally:
        fused_attention._launch_options = original


def triton_kernel(splits):
    def attention(query, key, value, scale, dropout_p):
        return fused_attention.fused_causal_attention(query, key, value, scale, dropout_p, splits=splits)

    return attention


def library_kernel(function, kernel_dtype):
    wrapped = _in_precision(function, kernel_dtype) if kernel_dtype is not None else function

    def attention(query, key, value, scale, dropout_p):
        return wrapped(query, key, value, None, scale=scale, dropout_p=dropout_p, is_causal=True)

    return attention


def time_kernel(attention, inputs, grad, scale, dropout_p, replays):
    """Milliseconds per forward + backward, from one captured graph replayed `replays` times."""

    def step():
        out = attention(*inputs, scale, dropout_p)
        return torch.autograd.grad(out, inputs, grad)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=114, help="⌊7·128/8⌋ + 2, the longest training example")
    parser.add_argument("--head_dim", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--results", default=None, help="JSON file for the table")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    shape = (args.batch, args.length, args.heads, args.head_dim)
    # Views of (B, T, H·D) projections, as the model hands them over.
    inputs = [torch.randn(shape, device="cuda").bfloat16().transpose(1, 2).requires_grad_() for _ in range(3)]
    grad = torch.randn(args.batch, args.heads, args.length, args.head_dim, device="cuda").bfloat16()
    scale = 1 / math.sqrt(args.head_dim)

    kernels = {  # name: (attention, launch options of the fused kernel)
        "sdpa, inputs cast to fp32 (memory-efficient)": (library_kernel(sdpa_attention, torch.float32), {}),
        "sdpa bf16 (flash; diverges in training)": (library_kernel(sdpa_attention, None), {}),
        "unfused fp32 (TF32 products)": (library_kernel(eager_attention, torch.float32), {}),
        "triton, library defaults": (triton_kernel(None), {}),
    }
    for splits in (3, 2, 1):
        for block_m, num_warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
            name = f"triton {splits} split(s), {block_m}-query blocks, {num_warps} warps"
            kernels[name] = (triton_kernel(splits), {"BLOCK_M": block_m, "num_warps": num_warps})

    with torch.no_grad():  # one reference: fp32 SDPA without dropout
        reference = library_kernel(sdpa_attention, torch.float32)(*inputs, scale, 0.0).float()
    rows = []
    for name, (attention, options) in kernels.items():
        try:
            with launch_options(options):
                milliseconds = time_kernel(attention, inputs, grad, scale, args.dropout, args.replays)
                with torch.no_grad():
                    error = (attention(*inputs, scale, 0.0).float() - reference).abs().max().item()
        except Exception as failure:  # a warp count a kernel cannot run with is reported, not fatal
            milliseconds, error = float("nan"), f"{type(failure).__name__}: {str(failure)[:80]}"
        rows.append({"kernel": name, "ms": milliseconds, "max_abs_difference": error})
        print(json.dumps(rows[-1]), flush=True)
    if args.results:
        Path(args.results).write_text(json.dumps({"device": describe_device(), "args": vars(args), "rows": rows}))
    baseline = rows[0]["ms"]
    print(
        f"\n{describe_device()}; forward + backward, ({args.batch}, {args.heads}, {args.length}, {args.head_dim}) bf16"
    )
    print(f"{'kernel':<56}{'ms':>8}{'vs sdpa fp32':>14}  max |difference| to fp32 sdpa (no dropout)")
    for row in rows:
        error = row["max_abs_difference"]
        error = f"{error:.2e}" if isinstance(error, float) else error
        print(f"{row['kernel']:<56}{row['ms']:>8.3f}{baseline / row['ms']:>13.2f}×  {error}")


if __name__ == "__main__":
    main()
