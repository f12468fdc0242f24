#!/usr/bin/env python
"""Column sums over a step's tokens, as the compiled handout step's backward pass takes them (the linear layers'
bias gradients and the LayerNorms' weight and bias gradients: about a sixth of the step's device time, at about
1.1-1.3 TB/s in `results/h200_profile_handout_current.txt`), timed at the step's size (7680 packed tokens): eager
torch; inductor's kernels compiled for a symbolic token count, as in the step; for the bias gradients, the
package's kernel (`hf_knowgpt.kernels.column_sums`, its settings as they are); and the same kind of Triton kernel
written here, with the settings of `--configs` (block sizes, strips and warps): each program sums a strip of rows
of a block of columns, torch the strips' sums. Each way runs `CALLS` times back to back in one CUDA graph,
replayed; a table of µs per call and GB/s is printed last.

    python benchmarks/diagnostics/column_sums.py
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from hf_knowgpt.kernels.column_sums import column_sums  # noqa: E402

TOKENS, CALLS, REPLAYS = 7680, 20, 50


@triton.jit
def _strip_sums(
    GRAD, X, MEAN, RSTD, PARTIAL, PARTIAL_NORMALIZED, n_rows, n_cols, rows_per_program,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, NORMALIZED: tl.constexpr,
):  # fmt: skip
    """Rows [program · rows_per_program, …) of columns block: Σ grad, and with NORMALIZED Σ grad · (x − mean) · rstd
    (a LayerNorm's bias and weight gradients), into row `program` of the partial sums."""
    column_block, program = tl.program_id(0), tl.program_id(1)
    cols = column_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    normalized_total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    for start in range(first, last, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < last) & (cols[None, :] < n_cols)
        offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        grad = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
        total += grad
        if NORMALIZED:
            x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=rows < last, other=0.0)
            rstd = tl.load(RSTD + rows, mask=rows < last, other=0.0)
            normalized_total += grad * (x - mean[:, None]) * rstd[:, None]
    tl.store(PARTIAL + program * n_cols + cols, tl.sum(total, 0), mask=cols < n_cols)
    if NORMALIZED:
        tl.store(PARTIAL_NORMALIZED + program * n_cols + cols, tl.sum(normalized_total, 0), mask=cols < n_cols)


def strip_sums(grad, x=None, mean=None, rstd=None, block_rows=32, block_cols=128, programs_per_sm=4, warps=4):
    """Σ grad over rows (and Σ grad · x̂ with x, mean, rstd), fp32: strips of rows summed by one kernel, the
    strips' sums by torch."""
    n_rows, n_cols = grad.shape
    column_blocks = triton.cdiv(n_cols, block_cols)
    sms = torch.cuda.get_device_properties(grad.device).multi_processor_count
    strips = max(1, min(triton.cdiv(n_rows, block_rows), sms * programs_per_sm // column_blocks))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, strips), block_rows) * block_rows
    strips = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty(strips, n_cols, device=grad.device)
    normalized = x is not None
    partial_normalized = torch.empty(strips, n_cols, device=grad.device) if normalized else partial
    _strip_sums[(column_blocks, strips)](
        grad, x if normalized else grad, mean if normalized else grad, rstd if normalized else grad,
        partial, partial_normalized, n_rows, n_cols, rows_per_program,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, NORMALIZED=normalized, num_warps=warps,
    )  # fmt: skip
    return (partial.sum(0), partial_normalized.sum(0)) if normalized else partial.sum(0)


def bias_gradient(grad):
    return grad.sum(0, dtype=torch.float32)


def layer_norm_gradients(grad, x, mean, rstd):
    return grad.sum(0), (grad * (x - mean[:, None]) * rstd[:, None]).sum(0)


def microseconds(step) -> float:
    """Device µs per call of `step`, CALLS calls back to back in one graph, replayed REPLAYS times."""
    return 1000 * graphed_ms(lambda: [step() for _ in range(CALLS)], REPLAYS) / CALLS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs",
        default="32x128x4x4,64x128x4x4,32x256x4x4,16x256x4x4,32x128x8x4,32x128x2x4,32x64x4x2,64x256x2x8",
        help="the Triton kernel's settings to time: rows per load x columns per block x programs per "
        "multiprocessor x warps, comma-separated",
    )
    args = parser.parse_args(argv)
    configs = [tuple(int(n) for n in config.split("x")) for config in args.configs.split(",")]
    compiled_bias = torch.compile(bias_gradient, dynamic=True)
    compiled_norm = torch.compile(layer_norm_gradients, dynamic=True)
    rows = []
    cases = [(f"bias gradient, bf16 ({TOKENS}, {width})", width, False) for width in (1024, 768, 256)]
    cases.append((f"LayerNorm weight + bias gradients, fp32 ({TOKENS}, 256)", 256, True))
    for label, width, normalized in cases:
        if normalized:
            inputs = [torch.randn(TOKENS, width, device="cuda"), torch.randn(TOKENS, width, device="cuda")]
            inputs += [torch.randn(TOKENS, device="cuda"), torch.rand(TOKENS, device="cuda") + 0.5]
            bytes_read = inputs[0].nbytes + inputs[1].nbytes + 8 * TOKENS
            ways = {
                "eager torch": lambda i=inputs: layer_norm_gradients(*i),
                "inductor": lambda i=inputs: compiled_norm(*i),
            }
        else:
            inputs = [torch.randn(TOKENS, width, device="cuda", dtype=torch.bfloat16)]
            bytes_read = inputs[0].nbytes
            ways = {
                "eager torch": lambda i=inputs: bias_gradient(*i),
                "inductor": lambda i=inputs: compiled_bias(*i),
                "hf_knowgpt kernel": lambda i=inputs: column_sums(*i),
            }
        for block_rows, block_cols, per_sm, warps in configs:
            ways[f"Triton strips {block_rows}x{block_cols}, {per_sm}/SM, {warps} warps"] = (
                lambda i=inputs, b=block_rows, c=block_cols, p=per_sm, w=warps: strip_sums(
                    *i, block_rows=b, block_cols=c, programs_per_sm=p, warps=w
                )
            )
        expected = ways["eager torch"]()
        for way, step in ways.items():
            got = step()
            for want, have in zip(expected if normalized else [expected], got if normalized else [got]):
                torch.testing.assert_close(have.float(), want.float(), rtol=1e-4, atol=1e-3 * want.abs().max().item())
            us = microseconds(step)
            rows.append((label, way, us, bytes_read / us / 1e3))
            print(f"{label}: {way}: {us:.2f} µs", flush=True)
    print(f"\n{torch.cuda.get_device_name()}; {CALLS} calls back to back per graph, {REPLAYS} replays")
    print(f"{'column sums':<56}{'way':<44}{'µs':>8}{'GB/s':>8}")
    for label, way, us, rate in rows:
        print(f"{label:<56}{way:<44}{us:>8.2f}{rate:>8.0f}")


if __name__ == "__main__":
    main()
