#!/usr/bin/env python
"""Attention kernels side by side at the handouts' training shape: forward + backward of causal
attention with dropout 0.1 on bf16 projections (batch 128, 8 heads, 114 positions, head size 32), one
CUDA graph per kernel replayed many times. Prints a table last.

    python benchmarks/bench_attention.py --data_dir .data

Kernels (`--groups`): `sweep`, the fused Triton kernel (`hf_knowgpt.kernels.fused_attention`) with 1–3
half-precision parts of its fp32 operands and several block sizes and warp counts, told each row's real
length (as packed training does: the lengths of the recipe's first batch of corrupted wiki.txt documents)
or not; SDPA with the inputs cast to fp32 (the memory-efficient kernel: what `attention_kernel_dtype="float32"`
runs); SDPA in bf16 (flash: fast, but training diverges with it); unfused fp32. `rope`: rotary queries and
keys, rotated first and attended by SDPA in fp32, against the fused kernel rotating them itself (and the
kernel without rotation). `synthesizer`: keys by position shared by all rows and heads plus a bias per key,
as SDPA in fp32 with the bias in its mask (what the synthesizer ran before) against the fused kernel. SDPA
and the unfused kernel compute every position whatever the lengths. `dropout`: the default kernel taking
four dropout uniforms from each Philox evaluation, one, or running without dropout. `correction`: the
backward pass's softmax correction dOᵢ·Oᵢ computed by a kernel of its own or in every backward program.
`launch`: warps, software-pipelining stages and (backward) block size of each kernel alone. `registers`: the most
registers a thread of each kernel may take (`maxnreg`). Each group's
first kernel is its baseline, for the speed ratio and the differences.
"""

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_knowgpt.attention_knowgpt import (  # noqa: E402
    _in_precision,
    additive_mask,
    apply_rotary,
    eager_attention,
    rotary_angles,
    sdpa_attention,
)
from hf_knowgpt.kernels import fused_attention  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402


@contextlib.contextmanager
def launch_options(block_size=None, num_warps=None, **constants):
    """Launch the fused kernels (forward and backward) with this block size and warp count, and with the
    kernel module's other constants given (`UNIFORMS_PER_DRAW=1`, `BACKWARD_NUM_STAGES=2`, ...), for the
    duration."""
    if block_size is not None:
        forward = num_warps or fused_attention.launch_warps(False, block_size)
        backward = num_warps or fused_attention.launch_warps(True, block_size)
        constants |= {
            "BLOCK_SIZE": block_size,
            "NUM_WARPS": {**fused_attention.NUM_WARPS, block_size: forward},
            "BACKWARD_NUM_WARPS": {**fused_attention.BACKWARD_NUM_WARPS, block_size: backward},
        }
    original = {name: getattr(fused_attention, name) for name in constants}
    for name, value in constants.items():
        setattr(fused_attention, name, value)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(fused_attention, name, value)


def triton_kernel(splits, lengths=None, **options):
    def attention(query, key, value, scale, dropout_p):
        return fused_attention.fused_causal_attention(
            query, key, value, scale, dropout_p, splits=splits, lengths=lengths, **options
        )

    return attention


def without_dropout(attention):
    def undropped(query, key, value, scale, dropout_p):
        return attention(query, key, value, scale, 0.0)

    return undropped


def rotated_first(attention, cos, sin):
    def rotated(query, key, value, scale, dropout_p):
        return attention(apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value, scale, dropout_p)

    return rotated


def sdpa_fp32_with_bias(bias):
    """The synthesizer's previous path: a (T, D) key table expanded over rows and heads, the bias in the mask."""
    fp32_sdpa = _in_precision(sdpa_attention, torch.float32)

    def attention(query, table, value, scale, dropout_p):
        length = query.shape[-2]
        visible = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        mask = additive_mask(visible, torch.float32, bias[:length])
        keys = table[:length].expand_as(query)
        attended, _ = fp32_sdpa(query, keys, value, mask, scale=scale, dropout_p=dropout_p, is_causal=False)
        return attended

    return attention


def recipe_lengths(data_dir, batch, length):
    """Lengths of the recipe's first batch of corrupted documents (as the training step sees them)."""
    from data_loaders import encode_documents, read_corpus
    from hf_knowgpt.training.data import PretrainingData
    from hf_knowgpt.training.workflows import corpus_tokenizer

    corpus = Path(data_dir) / "wiki.txt"
    data = PretrainingData(*encode_documents(corpus_tokenizer(corpus), read_corpus(corpus), 128), 128)
    lengths, _ = data.plan(torch.arange(batch), torch.Generator().manual_seed(0))
    return lengths.clamp(max=length)


def library_kernel(function, kernel_dtype):
    wrapped = _in_precision(function, kernel_dtype) if kernel_dtype is not None else function

    def attention(query, key, value, scale, dropout_p):
        attended, _ = wrapped(query, key, value, None, scale=scale, dropout_p=dropout_p, is_causal=True)
        return attended

    return attention


def graphed(step, after_capture=None):
    """`step` captured in a CUDA graph (after warm-up passes on a side stream, as capture requires): its replay.
    `after_capture`, where given, is called once the capture ends (the multi-tensor update fills its tables then)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    if after_capture is not None:
        after_capture()
    return graph.replay


def graphed_ms(step, replays, after_capture=None):
    """Milliseconds of device time per call of `step`, captured in one graph and replayed `replays` times."""
    replay = graphed(step, after_capture)
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def time_kernel(attention, inputs, grad, scale, dropout_p, replays):
    """Milliseconds per forward + backward, from one captured graph replayed `replays` times."""

    def step():
        out = attention(*inputs, scale, dropout_p)
        return torch.autograd.grad(out, inputs, grad)

    return graphed_ms(step, replays)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=114, help="⌊7·128/8⌋ + 2, the longest training example")
    parser.add_argument("--head_dim", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--data_dir", default=".data", help="where wiki.txt is (for realistic row lengths)")
    parser.add_argument(
        "--groups",
        default="sweep",
        help="comma-separated: sweep, rope, synthesizer, dropout, correction, launch, registers",
    )
    parser.add_argument("--results", default=None, help="JSON file for the table")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    shape = (args.batch, args.length, args.heads, args.head_dim)
    # Views of (B, T, H·D) projections, as the model hands them over.
    inputs = [torch.randn(shape, device="cuda").bfloat16().transpose(1, 2).requires_grad_() for _ in range(3)]
    grad = torch.randn(args.batch, args.heads, args.length, args.head_dim, device="cuda").bfloat16()
    scale = 1 / math.sqrt(args.head_dim)

    lengths = recipe_lengths(args.data_dir, args.batch, args.length).cuda()
    print(f"row lengths: mean {lengths.float().mean():.1f}, min {lengths.min()}, max {lengths.max()}")
    cos, sin = rotary_angles(torch.arange(args.length, device="cuda"), args.head_dim, 10000.0)
    table = (torch.randn(args.length, args.head_dim, device="cuda") * 0.01).bfloat16().requires_grad_()
    bias = torch.randn(args.length, device="cuda").requires_grad_()
    groups = {}  # group: {name: (attention, inputs, launch options of the fused kernel)}
    sweep = groups["sweep"] = {
        "sdpa, inputs cast to fp32 (memory-efficient)": (library_kernel(sdpa_attention, torch.float32), inputs, {}),
        "sdpa bf16 (flash; diverges in training)": (library_kernel(sdpa_attention, None), inputs, {}),
        "unfused fp32 (TF32 products)": (library_kernel(eager_attention, torch.float32), inputs, {}),
        "triton, library defaults, lengths": (triton_kernel(None, lengths), inputs, {}),
        "triton, library defaults, no lengths": (triton_kernel(None), inputs, {}),
    }
    for splits in (3, 1):
        for block, num_warps in ((16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)):
            options = {"block_size": block, "num_warps": num_warps}
            name = f"triton {splits} split(s), {block}-blocks, {num_warps} warps"
            sweep[name + ", lengths"] = (triton_kernel(splits, lengths), inputs, options)
            if splits == 3 and block in (32, 128):
                sweep[name + ", no lengths"] = (triton_kernel(splits), inputs, options)
    fp32_sdpa = library_kernel(sdpa_attention, torch.float32)
    groups["rope"] = {
        "rope: sdpa fp32, rotated first": (rotated_first(fp32_sdpa, cos, sin), inputs, {}),
        "rope: triton, rotated first (separate kernels), lengths": (
            rotated_first(triton_kernel(None, lengths), cos, sin),
            inputs,
            {},
        ),
        "rope: triton rotating in the kernel, lengths": (triton_kernel(None, lengths, rotary=(cos, sin)), inputs, {}),
        "rope: triton without rotation (vanilla), lengths": (triton_kernel(None, lengths), inputs, {}),
    }
    # What drawing the dropout mask costs (the forward kernel draws it once, the backward kernel twice).
    groups["dropout"] = {
        "dropout: triton, 4 uniforms per Philox draw, lengths": (
            triton_kernel(None, lengths),
            inputs,
            {"UNIFORMS_PER_DRAW": 4},
        ),
        "dropout: triton, 8 uniforms per Philox draw, lengths": (
            triton_kernel(None, lengths),
            inputs,
            {"UNIFORMS_PER_DRAW": 8},
        ),
        "dropout: triton, 1 uniform per Philox draw, lengths": (
            triton_kernel(None, lengths),
            inputs,
            {"UNIFORMS_PER_DRAW": 1},
        ),
        "dropout: triton, no dropout, lengths": (without_dropout(triton_kernel(None, lengths)), inputs, {}),
    }
    groups["correction"] = {
        "correction: triton, its own kernel, lengths": (
            triton_kernel(None, lengths),
            inputs,
            {"PRECOMPUTED_CORRECTION": True},
        ),
        "correction: triton, in every backward program, lengths": (
            triton_kernel(None, lengths),
            inputs,
            {"PRECOMPUTED_CORRECTION": False},
        ),
    }
    # Launch settings of each kernel alone (the other at the library's): blocks of 16 positions, the forward kernel
    # on 1 warp, the backward on 2.
    launches = {
        "forward 2 stages": {"NUM_STAGES": 2},
        "forward 1 stage": {"NUM_STAGES": 1},
        "forward 4 stages": {"NUM_STAGES": 4},
        "forward 2 warps": {"NUM_WARPS": {16: 2}},
        "forward 4 warps": {"NUM_WARPS": {16: 4}},
        "backward 1 warp": {"BACKWARD_NUM_WARPS": {16: 1}},
        "backward 4 warps": {"BACKWARD_NUM_WARPS": {16: 4}},
        "backward 1 stage": {"BACKWARD_NUM_STAGES": 1},
        "backward 2 stages": {"BACKWARD_NUM_STAGES": 2},
        "backward 4 stages": {"BACKWARD_NUM_STAGES": 4},
        "forward blocks of 32, 1 warp": {"BLOCK_SIZE": 32, "BACKWARD_BLOCK_SIZE": 16, "NUM_WARPS": {32: 1}},
        "forward blocks of 32, 2 warps": {"BLOCK_SIZE": 32, "BACKWARD_BLOCK_SIZE": 16, "NUM_WARPS": {32: 2}},
        "backward blocks of 32, 2 warps": {"BACKWARD_BLOCK_SIZE": 32, "BACKWARD_NUM_WARPS": {32: 2}},
        "backward blocks of 32, 4 warps": {"BACKWARD_BLOCK_SIZE": 32, "BACKWARD_NUM_WARPS": {32: 4}},
        "backward blocks of 32, 8 warps": {"BACKWARD_BLOCK_SIZE": 32, "BACKWARD_NUM_WARPS": {32: 8}},
    }
    # Registers a thread may take (`maxnreg`): fewer let more programs share a multiprocessor, at the cost of spills.
    registers = {
        "backward ≤ 96 registers": {"BACKWARD_MAX_REGISTERS": 96},
        "backward ≤ 80 registers": {"BACKWARD_MAX_REGISTERS": 80},
        "backward ≤ 72 registers": {"BACKWARD_MAX_REGISTERS": 72},
        "backward ≤ 64 registers": {"BACKWARD_MAX_REGISTERS": 64},
        "forward ≤ 72 registers": {"MAX_REGISTERS": 72},
        "forward ≤ 64 registers": {"MAX_REGISTERS": 64},
        "forward ≤ 72, backward ≤ 96 registers": {"MAX_REGISTERS": 72, "BACKWARD_MAX_REGISTERS": 96},
        "backward 1 warp, ≤ 96 registers": {"BACKWARD_NUM_WARPS": {16: 1}, "BACKWARD_MAX_REGISTERS": 96},
        "library defaults again (the machine's drift)": {},
    }
    for group, settings in (("launch", launches), ("registers", registers)):  # each after the library's defaults
        groups[group] = {
            f"{group}: triton, {name}, lengths": (triton_kernel(None, lengths), inputs, constants)
            for name, constants in {"library defaults": {}, **settings}.items()
        }
    synthesizer_inputs = [inputs[0], table, inputs[2]]
    groups["synthesizer"] = {
        "synthesizer: sdpa fp32, bias in the mask": (sdpa_fp32_with_bias(bias), synthesizer_inputs, {}),
        "synthesizer: triton, key table + bias, lengths": (
            triton_kernel(None, lengths, bias=bias),
            synthesizer_inputs,
            {},
        ),
        # What each part costs: the table alone, the bias alone (keys per token), neither (vanilla).
        "synthesizer: triton, key table, no bias, lengths": (triton_kernel(None, lengths), synthesizer_inputs, {}),
        "synthesizer: triton, keys per token + bias, lengths": (triton_kernel(None, lengths, bias=bias), inputs, {}),
        "synthesizer: triton, keys per token, no bias, lengths": (triton_kernel(None, lengths), inputs, {}),
    }

    real = (torch.arange(args.length, device="cuda") < lengths[:, None])[:, None, :, None]  # compared there
    rows = []
    for group in args.groups.split(","):
        reference = None
        for name, (attention, group_inputs, options) in groups[group].items():
            try:
                with launch_options(**options):
                    milliseconds = time_kernel(attention, group_inputs, grad, scale, args.dropout, args.replays)
                    with torch.no_grad():  # against the group's first kernel, without dropout
                        result = attention(*group_inputs, scale, 0.0).float()
                        reference = result if reference is None else reference
                        error = ((result - reference) * real).abs().max().item()
            except Exception as failure:  # a warp count a kernel cannot run with is reported, not fatal
                milliseconds, error = float("nan"), f"{type(failure).__name__}: {str(failure)[:80]}"
            rows.append({"group": group, "kernel": name, "ms": milliseconds, "max_abs_difference": error})
            print(json.dumps(rows[-1]), flush=True)
    if args.results:
        Path(args.results).write_text(json.dumps({"device": describe_device(), "args": vars(args), "rows": rows}))
    print(
        f"\n{describe_device()}; forward + backward, ({args.batch}, {args.heads}, {args.length}, {args.head_dim}) bf16"
    )
    print(f"{'kernel':<60}{'ms':>8}{'vs first':>10}  max |difference| to the group's first at real positions")
    baselines = {}
    for row in rows:
        baseline = baselines.setdefault(row["group"], row["ms"])
        error = row["max_abs_difference"]
        error = f"{error:.2e}" if isinstance(error, float) else error
        print(f"{row['kernel']:<60}{row['ms']:>8.3f}{baseline / row['ms']:>9.2f}×  {error}")


if __name__ == "__main__":
    main()
