"""Column sums of a (rows, columns) matrix in fp32, by a Triton kernel: a linear layer's bias gradient, summed over
a training step's tokens (`linear_with_summed_bias_gradient`, which the model's linear layers run while training
on a GPU: hf_knowgpt.layers_knowgpt.BIAS_GRADIENT_KERNEL), and a LayerNorm's weight and bias gradients, Σ g·x̂ and
Σ g in one pass (`layer_norm_with_summed_parameter_gradients`: LAYER_NORM_GRADIENT_KERNEL there).

Why: compiled for a symbolic token count, inductor takes these sums at 1.1-1.2 TB/s on an H200: 12.75 µs for the
MLP's (7680, 1024) bf16 gradient and 10.8 µs for the attention's (7680, 768), where this kernel and the sum of
its partial sums take 7.6 and 7.1 µs (`benchmarks/diagnostics/column_sums.py`, benchmarks/RESULTS.md). A
LayerNorm's two sums over (7680, 256) fp32 gradients and inputs: 14.6 µs by inductor, 12.2 µs by this kernel.

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
# The same for a LayerNorm's two sums, timed at (7680, 256) fp32.
NORMALIZED_BLOCK_ROWS, NORMALIZED_PROGRAMS_PER_MULTIPROCESSOR, NORMALIZED_NUM_WARPS = 32, 4, 2
# Multiprocessors assumed under Triton's interpreter (CPU tensors), which has none.
INTERPRETED_MULTIPROCESSORS = 4


def column_sums_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _strip_sums(
        MATRIX, X, MEAN, RSTD, PARTIAL, n_rows, n_cols, rows_per_program, partial_stride,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, NORMALIZED: tl.constexpr,
    ):  # fmt: skip
        """Rows [program · rows_per_program, …) of one block of columns, summed in fp32 into row `program` of
        PARTIAL (zeros where the strip lies past the last row). NORMALIZED: MATRIX is a LayerNorm's output
        gradient g, and Σ g · (x − mean) · rstd goes into row `program` of the second partial sums,
        `partial_stride` further on."""
        column_block, program = tl.program_id(0), tl.program_id(1)
        cols = column_block * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
        first = program * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        total = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)
        normalized_total = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), tl.float32)
        for start in range(first, last, BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS)
            mask = (rows[:, None] < last) & (cols[None, :] < n_cols)
            offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
            grad = tl.load(MATRIX + offsets, mask=mask, other=0.0).to(tl.float32)
            total += grad
            if NORMALIZED:
                x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
                mean = tl.load(MEAN + rows, mask=rows < last, other=0.0)
                rstd = tl.load(RSTD + rows, mask=rows < last, other=0.0)
                normalized_total += grad * (x - mean[:, None]) * rstd[:, None]
        tl.store(PARTIAL + program * n_cols + cols, tl.sum(total, 0), mask=cols < n_cols)
        if NORMALIZED:
            normalized_sums = tl.sum(normalized_total, 0)
            tl.store(PARTIAL + partial_stride + program * n_cols + cols, normalized_sums, mask=cols < n_cols)

    def _strip_layout(matrix, block_rows, programs_per_multiprocessor):
        """(column blocks, strips, rows per program): the strip count fixed by the device, not the row count."""
        n_rows, n_cols = matrix.shape
        column_blocks = triton.cdiv(n_cols, BLOCK_COLUMNS)
        if matrix.is_cuda:
            multiprocessors = torch.cuda.get_device_properties(matrix.device).multi_processor_count
        else:
            multiprocessors = INTERPRETED_MULTIPROCESSORS
        strips = max(1, multiprocessors * programs_per_multiprocessor // column_blocks)
        rows_per_program = (n_rows + strips * block_rows - 1) // (strips * block_rows) * block_rows
        return column_blocks, strips, rows_per_program

    @torch.library.triton_op("knowgpt::column_sums", mutates_args=())
    def _column_sums(matrix: torch.Tensor) -> torch.Tensor:
        n_rows, n_cols = matrix.shape
        column_blocks, strips, rows_per_program = _strip_layout(matrix, BLOCK_ROWS, PROGRAMS_PER_MULTIPROCESSOR)
        partial = torch.empty(strips, n_cols, device=matrix.device, dtype=torch.float32)
        torch.library.wrap_triton(_strip_sums)[(column_blocks, strips)](
            matrix, matrix, matrix, matrix, partial, n_rows, n_cols, rows_per_program, 0,
            BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLUMNS=BLOCK_COLUMNS, NORMALIZED=False, num_warps=NUM_WARPS,
        )  # fmt: skip
        return partial.sum(0)

    @torch.library.triton_op("knowgpt::layer_norm_parameter_sums", mutates_args=())
    def _layer_norm_parameter_sums(
        grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
    ) -> torch.Tensor:
        n_rows, n_cols = grad.shape
        column_blocks, strips, rows_per_program = _strip_layout(
            grad, NORMALIZED_BLOCK_ROWS, NORMALIZED_PROGRAMS_PER_MULTIPROCESSOR
        )
        # both sums' partial sums in one buffer, so that one reduction finishes them
        partial = torch.empty(2, strips, n_cols, device=grad.device, dtype=torch.float32)
        torch.library.wrap_triton(_strip_sums)[(column_blocks, strips)](
            grad, x, mean, rstd, partial, n_rows, n_cols, rows_per_program, strips * n_cols,
            BLOCK_ROWS=NORMALIZED_BLOCK_ROWS, BLOCK_COLUMNS=BLOCK_COLUMNS, NORMALIZED=True,
            num_warps=NORMALIZED_NUM_WARPS,
        )  # fmt: skip
        return partial.sum(1)


def column_sums(matrix: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of a contiguous (rows, columns) matrix, in fp32 (the kernel where Triton runs, else torch)."""
    if matrix.dim() != 2:
        raise ValueError(f"column_sums takes a (rows, columns) matrix, got shape {tuple(matrix.shape)}")
    if not column_sums_available() or (matrix.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        return matrix.sum(0, dtype=torch.float32)
    return _column_sums(matrix.contiguous())


class _LinearWithSummedBiasGradient(torch.autograd.Function):
    """F.linear(states, weight, bias) computed in `dtype`, its bias gradient by `column_sums` in fp32; the other
    gradients are autograd's for the same products."""

    @staticmethod
    def forward(ctx, states, weight, bias, dtype):
        ctx.dtypes = states.dtype, weight.dtype, bias.dtype
        states, weight = states.to(dtype), weight.to(dtype)
        ctx.save_for_backward(states, weight)
        return F.linear(states, weight, bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        states, weight = ctx.saved_tensors
        states_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_rows = grad.reshape(-1, grad.shape[-1])
        needs_states, needs_weight, _, _ = ctx.needs_input_grad  # the bias needs its gradient to come here at all
        grad_states = (grad @ weight).to(states_dtype) if needs_states else None
        grad_weight = (grad_rows.t() @ states.reshape(-1, states.shape[-1])).to(weight_dtype) if needs_weight else None
        return grad_states, grad_weight, column_sums(grad_rows).to(bias_dtype), None


def linear_with_summed_bias_gradient(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(states, weight, bias) in the dtype autocast gives it (the products autograd would run under the
    same autocast), its bias gradient summed over the rows by `column_sums` in fp32, where autograd's sum is in
    the products' dtype."""
    device_type = states.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else states.dtype
    return _LinearWithSummedBiasGradient.apply(states, weight, bias, dtype)


def layer_norm_parameter_sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """(Σ g·x̂, Σ g) over the rows, fp32, for a LayerNorm's output gradient g and input x, both (rows, columns),
    and each row's mean and 1/std, x̂ = (x − mean)·rstd: its weight and bias gradients (the kernel where Triton
    runs, else torch)."""
    rows = grad.shape[:1]
    if grad.dim() != 2 or x.shape != grad.shape or mean.shape != rows or rstd.shape != rows:
        raise ValueError(
            "layer_norm_parameter_sums takes (rows, columns) gradients and inputs and a mean and rstd per row, "
            f"got {tuple(grad.shape)}, {tuple(x.shape)}, {tuple(mean.shape)}, {tuple(rstd.shape)}"
        )
    if not column_sums_available() or (grad.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        grad = grad.float()
        normalized = (x.float() - mean.float()[:, None]) * rstd.float()[:, None]
        return (grad * normalized).sum(0), grad.sum(0)
    sums = _layer_norm_parameter_sums(grad.contiguous(), x.contiguous(), mean.contiguous(), rstd.contiguous())
    return sums[1], sums[0]


class _LayerNormWithSummedParameterGradients(torch.autograd.Function):
    """F.layer_norm over the last dimension; the input's gradient is autograd's, the weight's and bias's come
    from `layer_norm_parameter_sums` in one pass over the output gradient and the input."""

    @staticmethod
    def forward(ctx, states, weight, bias, eps):
        width = states.shape[-1]
        out, mean, rstd = torch.native_layer_norm(states, (width,), weight, bias, eps)
        ctx.save_for_backward(states, weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        states, weight, mean, rstd = ctx.saved_tensors
        width = states.shape[-1]
        needs_states, needs_weight, needs_bias, _ = ctx.needs_input_grad
        grad_states = None
        if needs_states:
            grad_states = torch.ops.aten.native_layer_norm_backward(
                grad, states, (width,), mean, rstd, weight, None, (True, False, False)
            )[0]
        grad_weight = grad_bias = None
        if needs_weight or needs_bias:
            grad_weight, grad_bias = layer_norm_parameter_sums(
                grad.reshape(-1, width), states.reshape(-1, width), mean.reshape(-1), rstd.reshape(-1)
            )
            grad_weight = grad_weight.to(weight.dtype) if needs_weight else None
            grad_bias = grad_bias.to(weight.dtype) if needs_bias else None
        return grad_states, grad_weight, grad_bias, None


def layer_norm_with_summed_parameter_gradients(
    states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """F.layer_norm(states, (width,), weight, bias, eps), its weight and bias gradients by
    `layer_norm_parameter_sums`. states, weight and bias share a floating dtype (a LayerNorm runs in fp32
    under autocast, and this model's residual stream is fp32)."""
    return _LayerNormWithSummedParameterGradients.apply(states, weight, bias, eps)


__all__ = [
    "column_sums",
    "column_sums_available",
    "layer_norm_parameter_sums",
    "layer_norm_with_summed_parameter_gradients",
    "linear_with_summed_bias_gradient",
]
