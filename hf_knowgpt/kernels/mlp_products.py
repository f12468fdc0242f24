"""The MLP's GELU inside its matrix products, by a Triton kernel: the first layer's product writes its output and that
output's GELU, and the backward pass's product into the hidden states writes its result times GELU's derivative.

Why: in a compiled bf16 training step the MLP's hidden states (tokens × 4·n_embd) went from a product to GELU's kernel
and back, and in the backward pass from a product to the gradient's kernel and back: at the handout's size 11.7 and
14.0 µs a layer (H100, benchmarks/RESULTS.md), kernels that only move those bytes. A product that applies the
activation to its tile before writing it reads nothing back.

How: one kernel, an output tile per program (tokens by BLOCK_M, features by BLOCK_N), the product in fp32 on tensor
cores; its epilogue rounds the product to the output's dtype, as the step's product does, and then takes GELU or its
derivative of that rounded value in fp32. Both from one exponential (Abramowitz & Stegun 7.1.26, within 1.5e-7 of
erf, as `layers_knowgpt.gelu_slope`): libdevice's erf in the epilogue made the products twice as slow. The autograd
function `mlp_with_activation_in_products` runs the whole MLP with these products, its weight gradients and bias sums
as the package's linear layers take them (`column_sums.weight_gradient`, `column_sums.column_sums`), so a compiled
step's pass `grouped_products.WeightGradientsTogether` takes them into its one launch as before.
"""

import os

import torch

from .column_sums import column_sums, weight_gradient

try:  # Triton ships with CUDA builds of torch; CPU builds go without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed torch
    triton = None

# Output tile and depth per load, warps and pipeline stages.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 3
# The epilogues: GELU of the product, written with the product itself; the product times GELU′ of given states.
ACTIVATION, ACTIVATION_GRADIENT = 1, 2

# Abramowitz & Stegun 7.1.26, as layers_knowgpt restates them (the kernels sit below the model's files; a test holds
# the two equal).
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_INVERSE_SQRT_2 = 0.7071067811865476
_INVERSE_SQRT_2PI = 0.3989422804014327
_LOG2_E = 1.4426950408889634


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def activation_in_products_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or _interpreted())


if triton is not None:
    _P, _HALF_A1, _HALF_A2, _HALF_A3, _HALF_A4, _HALF_A5 = (
        tl.constexpr(value) for value in (ERF_P * _INVERSE_SQRT_2, *(0.5 * a for a in ERF_A))
    )
    _MINUS_HALF_LOG2_E = tl.constexpr(-0.5 * _LOG2_E)
    _GAUSSIAN_SCALE = tl.constexpr(_INVERSE_SQRT_2PI)

    @triton.jit
    def _normal_cdf_and_gaussian(x):
        """(Φ(x), e^{−x²/2}) in fp32: the tail 1 − Φ(|x|) = ½·t·P(t)·e^{−x²/2}, t = 1/(1 + p·|x|/√2)."""
        gaussian = tl.exp2(x * x * _MINUS_HALF_LOG2_E)
        t = 1.0 / (tl.abs(x) * _P + 1.0)
        polynomial = t * _HALF_A5 + _HALF_A4
        polynomial = polynomial * t + _HALF_A3
        polynomial = polynomial * t + _HALF_A2
        polynomial = polynomial * t + _HALF_A1
        tail = t * polynomial * gaussian
        return tl.where(x < 0, tail, 1.0 - tail), gaussian

    @triton.jit
    def _product_with_activation(
        A, B, BIAS, STATES, OUT, rows_total, sa_m, sa_k, sb_k, sb_n,
        N: tl.constexpr, K: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One (BLOCK_M, BLOCK_N) tile of A·B (+ BIAS) for A (rows_total, K) and B (K, N) given by strides, rounded to
        OUT's dtype. EPILOGUE ACTIVATION: that written to STATES and its GELU to OUT; ACTIVATION_GRADIENT: it times
        GELU′(STATES) written to OUT."""
        program = tl.program_id(0)
        rows = (program // (N // BLOCK_N)) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (program % (N // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (rows < rows_total)[:, None]
        accumulated = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, K, BLOCK_K):
            depth = start + tl.arange(0, BLOCK_K)
            a = tl.load(A + rows[:, None].to(tl.int64) * sa_m + depth[None, :] * sa_k, mask=inside, other=0.0)
            b = tl.load(B + depth[:, None] * sb_k + cols[None, :] * sb_n)
            accumulated = tl.dot(a, b, accumulated)
        if HAS_BIAS:
            accumulated += tl.load(BIAS + cols).to(tl.float32)[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        rounded = accumulated.to(OUT.dtype.element_ty)
        if EPILOGUE == 1:
            tl.store(STATES + offsets, rounded, mask=inside)
            x = rounded.to(tl.float32)
            cdf, _ = _normal_cdf_and_gaussian(x)
            result = x * cdf
        else:
            x = tl.load(STATES + offsets, mask=inside, other=0.0).to(tl.float32)
            cdf, gaussian = _normal_cdf_and_gaussian(x)
            result = rounded.to(tl.float32) * (cdf + x * gaussian * _GAUSSIAN_SCALE)
        tl.store(OUT + offsets, result.to(OUT.dtype.element_ty), mask=inside)

    def _launch(a, b, bias, states, out, epilogue):
        rows, depth = a.shape
        columns = b.shape[1]
        grid = (triton.cdiv(rows, BLOCK_M) * (columns // BLOCK_N),)
        torch.library.wrap_triton(_product_with_activation)[grid](
            a, b, bias if bias is not None else a, states, out, rows,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            N=columns, K=depth, EPILOGUE=epilogue, HAS_BIAS=bias is not None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip

    @torch.library.triton_op("knowgpt::linear_gelu", mutates_args=())
    def _linear_gelu(
        states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = states.new_empty((states.shape[0], weight.shape[0]))
        activated = torch.empty_like(hidden)
        _launch(states, weight.t(), bias, hidden, activated, ACTIVATION)
        return hidden, activated

    @torch.library.triton_op("knowgpt::product_gelu_gradient", mutates_args=())
    def _product_gelu_gradient(grad: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)
        _launch(grad, weight, None, hidden, grad_hidden, ACTIVATION_GRADIENT)
        return grad_hidden


def activation_in_products_applies(states: torch.Tensor, fc_weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes an MLP of these (…, n_embd) states and (hidden, n_embd) first weight computed in
    `dtype`: bf16 or fp16 on CUDA (fp32 under Triton's interpreter, whose memory holds no bf16), widths that whole
    tiles and loads cover."""
    hidden_features, in_features = fc_weight.shape
    on_cpu = states.device.type == "cpu"
    return (
        activation_in_products_available()
        and (states.device.type == "cuda" or (on_cpu and _interpreted()))
        and (dtype == torch.float32 if on_cpu else dtype in (torch.bfloat16, torch.float16))
        and hidden_features % BLOCK_N == 0  # both products' columns
        and in_features % BLOCK_K == 0  # both products' depth
    )


class _MLPWithActivationInProducts(torch.autograd.Function):
    """proj(GELU(fc(states))) computed in `dtype`, the GELU and its gradient inside the kernel's products, the
    parameters' gradients as `column_sums.linear_with_summed_bias_gradient` takes them (weights' in fp32 where
    `weight_gradients_in_fp32`, biases' summed in fp32, fc's and proj's by `column_sums` where `biases_by_kernel`
    says so)."""

    @staticmethod
    def forward(
        ctx, states, fc_weight, fc_bias, proj_weight, proj_bias, dtype, biases_by_kernel, weight_gradients_in_fp32
    ):
        ctx.dtypes = states.dtype, fc_weight.dtype, fc_bias.dtype, proj_weight.dtype
        ctx.proj_bias_dtype = proj_bias.dtype if proj_bias is not None else None
        ctx.biases_by_kernel = biases_by_kernel
        ctx.in_fp32 = weight_gradients_in_fp32 and states.is_cuda and fc_weight.dtype == torch.float32
        ctx.in_fp32 = ctx.in_fp32 and dtype in (torch.bfloat16, torch.float16)
        low_states = states.reshape(-1, states.shape[-1]).to(dtype)
        low_fc, low_proj = fc_weight.to(dtype), proj_weight.to(dtype)
        hidden, activated = _linear_gelu(low_states.contiguous(), low_fc, fc_bias.to(dtype))
        out = activated @ low_proj.t()
        if proj_bias is not None:
            out = out + proj_bias.to(dtype)
        ctx.save_for_backward(low_states, low_fc, low_proj, hidden, activated)
        return out.view(*states.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        states, fc_weight, proj_weight, hidden, activated = ctx.saved_tensors
        states_dtype, fc_weight_dtype, fc_bias_dtype, proj_weight_dtype = ctx.dtypes
        grad_rows = grad.reshape(-1, grad.shape[-1]).to(states.dtype).contiguous()
        grad_hidden = _product_gelu_gradient(grad_rows, proj_weight, hidden)
        grad_proj_weight = weight_gradient(grad_rows, activated, ctx.in_fp32).to(proj_weight_dtype)
        grad_proj_bias = None
        if ctx.proj_bias_dtype is not None:
            grad_proj_bias = _bias_gradient(grad_rows, ctx.biases_by_kernel[1]).to(ctx.proj_bias_dtype)
        grad_states = (grad_hidden @ fc_weight).to(states_dtype).view(*grad.shape[:-1], states.shape[-1])
        grad_fc_weight = weight_gradient(grad_hidden, states, ctx.in_fp32).to(fc_weight_dtype)
        grad_fc_bias = _bias_gradient(grad_hidden, ctx.biases_by_kernel[0]).to(fc_bias_dtype)
        return grad_states, grad_fc_weight, grad_fc_bias, grad_proj_weight, grad_proj_bias, None, None, None


def _bias_gradient(grad_rows: torch.Tensor, by_kernel: bool) -> torch.Tensor:
    return column_sums(grad_rows) if by_kernel else grad_rows.sum(0, dtype=torch.float32)


def mlp_with_activation_in_products(
    states: torch.Tensor,
    fc_weight: torch.Tensor,
    fc_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
    biases_by_kernel: tuple[bool, bool] = (True, True),
    weight_gradients_in_fp32: bool = True,
) -> torch.Tensor:
    """F.linear(F.gelu(F.linear(states, fc_weight, fc_bias)), proj_weight, proj_bias) in the dtype autocast gives it,
    GELU and its gradient inside the products (see the module's docstring); `activation_in_products_applies` says
    where the kernel takes it. `biases_by_kernel`: whether fc's and proj's bias gradients are summed by `column_sums`
    (else by torch); `weight_gradients_in_fp32`: the weights' gradients written in fp32 by their products, on CUDA."""
    device_type = states.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else states.dtype
    if not activation_in_products_applies(states, fc_weight, dtype):
        raise ValueError(
            f"mlp_with_activation_in_products: no kernel for {dtype} states on {states.device} with weights "
            f"{tuple(fc_weight.shape)} (see activation_in_products_applies)"
        )
    return _MLPWithActivationInProducts.apply(
        states, fc_weight, fc_bias, proj_weight, proj_bias, dtype, tuple(biases_by_kernel), weight_gradients_in_fp32
    )


__all__ = ["activation_in_products_applies", "mlp_with_activation_in_products"]
