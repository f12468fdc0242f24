"""The MLP's GELU inside its matrix products, by Triton kernels: `mlp_with_gelu_in_products(states, fc_weight,
fc_bias, proj_weight, proj_bias)` is `proj(gelu(fc(states)))` under bf16 or fp16 autocast, forward and backward.

Why: in the compiled training step the MLP's GELU is a pass of its own each way over the (tokens, 4·n_embd)
states, at the memory's speed: forward it reads the first product's output and writes the activation, backward it
reads the activation's gradient (which the second product's backward wrote) and the first product's output and
writes their product. At the handout step's 7680 tokens those passes took 11.9 and about 12.8 µs per layer on an
H200 (`benchmarks/diagnostics/profile_step.py`), a fifteenth of the step.

How: a blocked matrix product whose epilogue finishes the job while its tile is still in registers. Forward,
fc's product adds the bias, writes the pre-activation (rounded to the products' dtype, as F.linear under autocast
rounds it) and the GELU of that rounded value: no pass reads the pre-activation back. Backward, the product of the
output gradient and proj's weight is multiplied by GELU's derivative at the stored pre-activation before it is
written: the activation's gradient is never written or read (and is not rounded to bf16 before the multiplication,
where the unfused path rounds it); the same epilogue sums its tile's columns, so fc's bias gradient needs no pass
of its own (each tile writes its row of partial sums in fp32, torch adds them: no atomics, a seeded run repeats).
The other products (proj forward, the weight gradients, the input gradient) are cuBLAS's as before, the weight
gradients written in fp32 as `layers_knowgpt.linear` writes them. GELU is the exact (erf) one, torch's default.

It applies to 2-D or 3-D bf16/fp16 states under autocast on CUDA (or Triton's interpreter); `gelu_products_apply`
says whether a call qualifies.
"""

import torch
from torch.nn import functional as F

from .column_sums import _fp32_weight_gradient, weight_gradient
from .fused_attention import _interpreted, triton

if triton is not None:
    import triton.language as tl

    from .fused_layers import _gelu_and_slope

# Tile of the products: rows (tokens) × columns (features) × the inner dimension per step, rows of tiles grouped
# for the cache, warps and software-pipelining stages. Chosen with benchmarks/diagnostics/gelu_products.py.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 8, 3


def gelu_products_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or _interpreted())


def gelu_products_apply(states: torch.Tensor, fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> bool:
    """Whether `mlp_with_gelu_in_products` runs its kernels on this call: Triton, a CUDA tensor (or the
    interpreter), bf16 or fp16 autocast, and weights of matching shapes."""
    device_type = states.device.type
    return (
        triton is not None
        and (device_type == "cuda" or (_interpreted() and device_type == "cpu"))
        and torch.is_autocast_enabled(device_type)
        and torch.get_autocast_dtype(device_type) in (torch.bfloat16, torch.float16)
        and states.dim() in (2, 3)
        and states.numel() > 0
        and fc_weight.shape[1] == states.shape[-1] == proj_weight.shape[0]
        and proj_weight.shape[1] == fc_weight.shape[0]
    )


if triton is not None:

    @triton.jit
    def _product_kernel(
        A, B, BIAS, PRE, OUT, SUMS, M, N, K,
        sa_m, sa_k, sb_k, sb_n,
        FORWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        """One (BLOCK_M, BLOCK_N) tile of A·B (fp32 sums). FORWARD: + BIAS, written to PRE in its dtype, and
        the GELU of that rounded value to OUT. Otherwise: times GELU's derivative at PRE, written to OUT, and the
        tile's column sums of what was written (fp32) to row `tile_m` of SUMS. PRE and OUT are contiguous (M, N)."""
        program = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        # Tiles in groups of GROUP_M rows, column after column, so neighbouring programs share A's rows in cache.
        group = program // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (program % (GROUP_M * tiles_n)) % group_rows
        tile_n = (program % (GROUP_M * tiles_n)) // group_rows
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        # What the epilogue reads, loaded before the products so that its latency hides behind them.
        if FORWARD:
            bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)
        else:
            pre = tl.load(PRE + offsets, mask=inside, other=0.0)
        # Rows and columns past the matrices read wrapped ones (their results are never written), so the loads
        # need a mask on the inner dimension only: what lets Triton stage them through shared memory.
        a_pointers = A + (rows % M)[:, None].to(tl.int64) * sa_m + tl.arange(0, BLOCK_K)[None, :] * sa_k
        b_pointers = B + tl.arange(0, BLOCK_K)[:, None] * sb_k + (cols % N)[None, :] * sb_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            left = K - step * BLOCK_K
            a = tl.load(a_pointers, mask=tl.arange(0, BLOCK_K)[None, :] < left, other=0.0)
            b = tl.load(b_pointers, mask=tl.arange(0, BLOCK_K)[:, None] < left, other=0.0)
            if INTERPRETED:  # the interpreter multiplies half-precision bit patterns as integers
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_pointers += BLOCK_K * sa_k
            b_pointers += BLOCK_K * sb_k
        if FORWARD:
            pre = (acc + bias[None, :]).to(PRE.dtype.element_ty)
            tl.store(PRE + offsets, pre, mask=inside)
            out, _ = _gelu_and_slope(pre.to(tl.float32))
        else:
            _, slope = _gelu_and_slope(pre.to(tl.float32))
            out = acc * slope
        out = out.to(OUT.dtype.element_ty)
        tl.store(OUT + offsets, out, mask=inside)
        if not FORWARD:
            column_sums = tl.sum(tl.where(inside, out.to(tl.float32), 0.0), 0)
            tl.store(SUMS + tile_m * N + cols, column_sums, mask=cols < N)

    def _launch(a, b, bias, pre, out, sums, forward):
        (m, k), n = a.shape, b.shape[1]
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        torch.library.wrap_triton(_product_kernel)[grid](
            a, b, bias, pre, out, sums, m, n, k, *a.stride(), *b.stride(),
            FORWARD=forward, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
            INTERPRETED=_interpreted(), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip

    @torch.library.triton_op("knowgpt::gelu_product", mutates_args=())
    def _gelu_product(
        states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(states·weightᵀ + bias, its GELU) for (M, K) states and an (N, K) weight, in the states' dtype."""
        pre = states.new_empty(states.shape[0], weight.shape[0])
        out = torch.empty_like(pre)
        unused = torch.empty(1, device=states.device)  # SUMS: written backward only
        _launch(states, weight.t(), bias, pre, out, unused, forward=True)
        return pre, out

    @torch.library.triton_op("knowgpt::gelu_gradient_product", mutates_args=())
    def _gelu_gradient_product(
        grad: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad·weight) ∘ GELU′(pre), the gradient of the pre-activation, for an (M, K) output gradient of a
        (K, N) weight and the (M, N) pre-activation; and its column sums in fp32 (the bias's gradient)."""
        out = torch.empty_like(pre)
        sums = torch.empty(triton.cdiv(pre.shape[0], BLOCK_M), pre.shape[1], device=pre.device)
        _launch(grad, weight, pre, pre, out, sums, forward=False)  # BIAS is not read backward: `pre` stands in
        return out, sums.sum(0)


def _dtype_of(tensor: torch.Tensor | None) -> torch.dtype | None:
    return tensor.dtype if tensor is not None else None


class _MLPWithGeluInProducts(torch.autograd.Function):
    """proj(gelu(fc(states))) with every product in `dtype`; see the module docstring."""

    @staticmethod
    def forward(ctx, states, fc_weight, fc_bias, proj_weight, proj_bias, dtype):
        ctx.dtypes = states.dtype, fc_weight.dtype, fc_bias.dtype, proj_weight.dtype, _dtype_of(proj_bias)
        shape = states.shape
        rows = states.reshape(-1, shape[-1]).to(dtype).contiguous()
        low_fc_weight, low_proj_weight = fc_weight.to(dtype), proj_weight.to(dtype)
        pre, activation = _gelu_product(rows, low_fc_weight, fc_bias.to(dtype))
        out = F.linear(activation, low_proj_weight, proj_bias.to(dtype) if proj_bias is not None else None)
        ctx.fp32_weight_gradients = _fp32_weight_gradient(rows, fc_weight), _fp32_weight_gradient(rows, proj_weight)
        ctx.save_for_backward(rows, low_fc_weight, low_proj_weight, pre, activation)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        rows, fc_weight, proj_weight, pre, activation = ctx.saved_tensors
        states_dtype, fc_weight_dtype, fc_bias_dtype, proj_weight_dtype, proj_bias_dtype = ctx.dtypes
        fc_fp32, proj_fp32 = ctx.fp32_weight_gradients
        grad_rows = grad.reshape(-1, grad.shape[-1]).to(rows.dtype).contiguous()
        grad_proj_weight = weight_gradient(grad_rows, activation, proj_fp32).to(proj_weight_dtype)
        grad_proj_bias = None if proj_bias_dtype is None else grad_rows.sum(0, dtype=torch.float32).to(proj_bias_dtype)
        grad_pre, grad_fc_bias = _gelu_gradient_product(grad_rows, proj_weight, pre)
        grad_fc_weight = weight_gradient(grad_pre, rows, fc_fp32).to(fc_weight_dtype)
        grad_fc_bias = grad_fc_bias.to(fc_bias_dtype)
        grad_states = (grad_pre @ fc_weight).to(states_dtype).view(*grad.shape[:-1], rows.shape[-1])
        return grad_states, grad_fc_weight, grad_fc_bias, grad_proj_weight, grad_proj_bias, None


def mlp_with_gelu_in_products(states, fc_weight, fc_bias, proj_weight, proj_bias):
    """proj(gelu(fc(states))) in autocast's dtype with GELU inside fc's product forward and inside the
    gradient's product backward (see the module docstring); proj_bias None: proj's product without a bias.
    Call it where `gelu_products_apply` holds."""
    dtype = torch.get_autocast_dtype(states.device.type)
    with torch.autocast(states.device.type, enabled=False):  # the products' dtype is chosen here, once
        return _MLPWithGeluInProducts.apply(states, fc_weight, fc_bias, proj_weight, proj_bias, dtype)


def mlp_reference(states, fc_weight, fc_bias, proj_weight, proj_bias):
    """The composition the kernels fuse: F.linear, GELU, F.linear (under the caller's autocast)."""
    return F.linear(F.gelu(F.linear(states, fc_weight, fc_bias)), proj_weight, proj_bias)


__all__ = ["gelu_products_apply", "gelu_products_available", "mlp_reference", "mlp_with_gelu_in_products"]
