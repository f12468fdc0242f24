"""Column sums of a (rows, columns) matrix in fp32, by a Triton kernel: a linear layer's bias gradient, summed over
a training step's tokens (`linear_with_summed_bias_gradient`, which the model's linear layers run while training
on a GPU: hf_knowgpt.layers_knowgpt.BIAS_GRADIENT_KERNEL). The same autograd function writes their weight
gradients in fp32 by the product itself (hf_knowgpt.layers_knowgpt.WEIGHT_GRADIENT_IN_FP32).

Why: compiled for a symbolic token count, inductor takes these sums at 1.1-1.2 TB/s on an H200: 12.75 µs for the
MLP's (7680, 1024) bf16 gradient and 10.8 µs for the attention's (7680, 768), where this kernel and the sum of
its partial sums take 7.6 and 7.1 µs (`benchmarks/diagnostics/column_sums.py`, benchmarks/RESULTS.md).

How: each program sums a strip of rows of a block of columns, `BLOCK_ROWS` rows per load, and writes its sums to
a row of partial sums of its own; torch then sums those few rows. No atomics: the order of the sums is fixed, so
a seeded run repeats. The number of strips is fixed by the device, not by the row count, so one compiled graph
serves every token count.
"""

import os

import torch
from torch.nn import functional as F

try:  # Triton ships with CUDA builds of torch; CPU builds go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch
    triton = None

# Rows per load and columns per program, programs per multiprocessor and warps per program: the fastest of the
# settings timed at (7680, 1024) and (7680, 768) bf16 on an H200 (benchmarks/diagnostics/column_sums.py).
BLOCK_ROWS, BLOCK_COLUMNS, PROGRAMS_PER_MULTIPROCESSOR, NUM_WARPS = 128, 64, 2, 4
# Multiprocessors assumed under Triton's interpreter (CPU tensors), which has none.
INTERPRETED_MULTIPROCESSORS = 4


def column_sums_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _strip_sums(
        MATRIX, PARTIAL, n_rows, n_cols, rows_per_program, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr
    ):
        """Rows [program · rows_per_program, …) of one block of columns, summed in fp32 into row `program` of
        PARTIAL (zeros where the strip lies past the last row)."""
        column_block, program = tl.program_id(0), tl.program_id(1)
        cols = column_block * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        first = program * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        total = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)
        for start in range(first, last, BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS)
            mask = (rows[:, None] < last) & (cols[None, :] < n_cols)
            offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
            total += tl.load(MATRIX + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(PARTIAL + program * n_cols + cols, tl.sum(total, 0), mask=cols < n_cols)

    @torch.library.triton_op("knowgpt::column_sums", mutates_args=())
    def _column_sums(matrix: torch.Tensor) -> torch.Tensor:
        n_rows, n_cols = matrix.shape
        column_blocks = triton.cdiv(n_cols, BLOCK_COLUMNS)
        if matrix.is_cuda:
            multiprocessors = torch.cuda.get_device_properties(matrix.device).multi_processor_count
        else:
            multiprocessors = INTERPRETED_MULTIPROCESSORS
        strips = max(1, multiprocessors * PROGRAMS_PER_MULTIPROCESSOR // column_blocks)
        rows_per_program = (n_rows + strips * BLOCK_ROWS - 1) // (strips * BLOCK_ROWS) * BLOCK_ROWS
        partial = torch.empty(strips, n_cols, device=matrix.device, dtype=torch.float32)
        torch.library.wrap_triton(_strip_sums)[(column_blocks, strips)](
            matrix, partial, n_rows, n_cols, rows_per_program,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=BLOCK_COLUMNS, num_warps=NUM_WARPS,
        )  # fmt: skip
        return partial.sum(0)


def column_sums(matrix: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of a contiguous (rows, columns) matrix, in fp32 (the kernel where Triton runs, else torch)."""
    if matrix.dim() != 2:
        raise ValueError(f"column_sums takes a (rows, columns) matrix, got shape {tuple(matrix.shape)}")
    if not column_sums_available() or (matrix.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        return matrix.sum(0, dtype=torch.float32)
    return _column_sums(matrix.contiguous())


def _fp32_weight_gradient(states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a weight gradient can be one product written in fp32: bf16 or fp16 products of an fp32 weight on
    CUDA, where torch.mm takes `out_dtype`."""
    return states.is_cuda and states.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32


def weight_gradient(grad_rows: torch.Tensor, input_rows: torch.Tensor, in_fp32: bool) -> torch.Tensor:
    """gradᵀ·inputs of a linear layer; written in fp32 by the product itself where `in_fp32` (no rounding to the
    products' dtype, no cast after it: see `_fp32_weight_gradient`)."""
    if in_fp32:
        return torch.mm(grad_rows.t(), input_rows, out_dtype=torch.float32)
    return grad_rows.t() @ input_rows


class _LinearWithFp32ParameterGradients(torch.autograd.Function):
    """F.linear(states, weight, bias) computed in `dtype`, its bias gradient summed in fp32 (by `column_sums`
    where `bias_by_kernel`, else by torch), its weight gradient a product written in fp32 where
    `weight_gradient_in_fp32` and `_fp32_weight_gradient` allow; the other gradients are autograd's for the
    same products."""

    @staticmethod
    def forward(ctx, states, weight, bias, dtype, bias_by_kernel, weight_gradient_in_fp32):
        ctx.dtypes = states.dtype, weight.dtype, bias.dtype if bias is not None else None
        ctx.bias_by_kernel = bias_by_kernel
        low_states, low_weight = states.to(dtype), weight.to(dtype)
        ctx.fp32_weight_gradient = weight_gradient_in_fp32 and _fp32_weight_gradient(low_states, weight)
        ctx.save_for_backward(low_states, low_weight)
        return F.linear(low_states, low_weight, bias.to(dtype) if bias is not None else None)

    @staticmethod
    def backward(ctx, grad):
        states, weight = ctx.saved_tensors
        states_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_rows = grad.reshape(-1, grad.shape[-1])
        needs_states, needs_weight = ctx.needs_input_grad[:2]  # the bias needs its gradient to come here at all
        grad_states = (grad @ weight).to(states_dtype) if needs_states else None
        grad_weight = None
        if needs_weight:
            state_rows = states.reshape(-1, states.shape[-1])
            grad_weight = weight_gradient(grad_rows, state_rows, ctx.fp32_weight_gradient).to(weight_dtype)
        grad_bias = None
        if bias_dtype is not None:
            grad_bias = column_sums(grad_rows) if ctx.bias_by_kernel else grad_rows.sum(0, dtype=torch.float32)
            grad_bias = grad_bias.to(bias_dtype)
        return grad_states, grad_weight, grad_bias, None, None, None


def linear_with_summed_bias_gradient(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bias_by_kernel: bool = True,
    weight_gradient_in_fp32: bool = False,
) -> torch.Tensor:
    """F.linear(states, weight, bias) in the dtype autocast gives it (the products autograd would run under the
    same autocast), its bias gradient summed over the rows in fp32 (by `column_sums` where `bias_by_kernel`,
    else by torch), where autograd's sum is in the products' dtype. With `weight_gradient_in_fp32`, on CUDA, the
    weight gradient of bf16 or fp16 products is one product written in fp32, where autograd's is rounded to the
    products' dtype and then cast to the weight's."""
    device_type = states.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else states.dtype
    return _LinearWithFp32ParameterGradients.apply(
        states, weight, bias, dtype, bias_by_kernel, weight_gradient_in_fp32
    )


__all__ = ["column_sums", "column_sums_available", "linear_with_summed_bias_gradient"]
