"""Fused Triton kernels for the elementwise and row-wise work of a transformer block's training step.

Why: around its matrix products a pre-LayerNorm block spends its time moving activations. Unfused, the
residual add with dropout and the next LayerNorm take four kernels forward (mask, scale, add, norm) and as
many back, each a full pass over the (tokens, n_embd) states; the MLP's bias and GELU take two more each
way over the (tokens, 4·n_embd) ones. Here each is one kernel forward and one backward:

- `fused_residual_layer_norm(residual, branch, weight, bias, eps, dropout_p, training)` gives
  `new = residual + dropout(branch)` and `layer_norm(new)` in one pass over the rows (statistics in fp32),
  and in the backward pass the gradients of residual, branch, weight and bias in one more (the gradient of
  `new` arrives from both outputs). The dropout mask is not stored (unless `RESIDUAL_MASK_STORED`): both
  kernels draw it from the call's seed (element n = offset + i of the call keeps its value when uniform n is
  at least dropout_p, uniform n being one of the four outputs Philox gives at counter n // 4, in
  `fused_attention._four_uniforms`'s layout, so each evaluation serves four adjacent elements), and only the
  seed and offset are kept for backward. `normalized_dtype` writes the LayerNorm's output in the dtype the
  next layer takes (bf16 under autocast) instead of casting it after.
- `fused_bias_gelu(x, bias)` gives `gelu(x + bias)` (the exact erf GELU, torch's default) and in the
  backward pass the gradients of x and bias (the bias's summed in fp32 inside the kernel).

Measured (benchmarks/bench_fused_layers.py, H100, forward + backward in a CUDA graph, dropout 0.1, 2026-11-27):
residual + dropout + LayerNorm 1.45–1.66× faster than PyTorch's composition at the handouts' 16384 × 256
and 1.75–1.97× at 65536 × 512; bias + GELU 1.6–1.7× faster than gelu(x + bias), yet 1.3–1.4× slower than
gelu(x) alone: it pays only where the bias is a separate add, not where a Linear adds it in its matmul.
Launched eagerly from Python at the handouts' shape, Triton's launch overhead makes both slower than PyTorch.

Where a kernel does not apply (no Triton, a CPU tensor without Triton's interpreter, another dtype, rows
wider than `MAX_WIDTH`), the functions run the same computation as plain PyTorch, so calling them is
always correct.
"""

import torch
import torch.nn.functional as F

from .fused_attention import _interpreted, draw_seed, triton

if triton is not None:
    import triton.language as tl

    from .fused_attention import _four_uniforms

# The widest row (n_embd) the LayerNorm kernel takes: a row lies in one program's registers.
MAX_WIDTH = 1024
# Elements per tile (rows × padded columns) a program works on at once: several narrow rows (8 of 256) per
# program, so enough memory requests are in flight. 2048 ran fastest of 1024–8192 on an H100
# (benchmarks/bench_fused_layers.py --tile_elements).
TILE_ELEMENTS = 2048
# Programs per multiprocessor of the backward kernels, which loop over tiles to sum over rows.
PROGRAMS_PER_SM = 4
# The residual kernels' dropout mask written by the forward kernel as one byte per element and read by the backward
# kernel (True), or drawn again there from the seed (False), as a way to find why this backward kernel is slower than
# inductor's (about 30 against 12 µs at the handout's 7680 × 256, H200). Forward + backward 0.068 against 0.071 ms
# drawing it, inductor's composition 0.047 (H200, benchmarks/RESULTS.md): off.
RESIDUAL_MASK_STORED = False
# The residual backward kernel's column sums (the LayerNorm's weight and bias gradients, the branch bias's) kept per
# row of its tile in registers and summed over the rows once at the end (True), or summed over each tile's rows as it
# goes (False: a reduction across the program's warps per tile and sum). Forward + backward 0.051 against 0.071 ms
# (inductor's composition 0.047), and with TILE_ELEMENTS = 1024 and PROGRAMS_PER_SM = 2 0.043 against inductor's
# 0.048, yet the handout command's steps took 21.5 s with it in one run against 20.6-21.3 s without (H200,
# benchmarks/RESULTS.md): off, as `--fused_layers` is in compiled steps, until timed side by side.
COLUMN_SUMS_AT_END = False
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def fused_layers_available() -> bool:
    """Whether the kernels can run here: Triton and a CUDA device, or Triton's interpreter."""
    return triton is not None and (torch.cuda.is_available() or _interpreted())


def _kernels_apply(*tensors) -> bool:
    """Whether the kernels compute a call on these tensors (else the PyTorch fallback does)."""
    if triton is None or any(tensor is None for tensor in tensors):
        return False
    device = tensors[0].device
    return (
        (device.type == "cuda" or _interpreted())
        and all(tensor.device == device and tensor.dtype in KERNEL_DTYPES for tensor in tensors)
        and tensors[0].numel() > 0
    )


def _tile(width: int, max_block: int | None = None) -> tuple[int, int, int]:
    """Rows per tile, padded columns per tile (a power of two) and warps, for rows `width` wide."""
    block_cols = triton.next_power_of_2(width)
    if max_block is not None:
        block_cols = min(block_cols, max_block)
    block_rows = max(1, TILE_ELEMENTS // block_cols)
    return block_rows, block_cols, 8 if block_rows * block_cols >= 4096 else 4


def _reducing_programs(device, tiles: int) -> int:
    """Programs for a backward kernel that also sums over rows: a few per multiprocessor, each looping over
    tiles and writing one partial sum per column, so the sum needs neither atomics nor a (rows, width)
    buffer. On a GPU the count does not depend on the rows (programs past the last tile write zeros), so a
    step compiled for any number of tokens keeps one graph. (At most two in the interpreter, where programs
    run one after another: enough to test the loop.)"""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, 2))


if triton is not None:

    @triton.jit
    def _uniforms_at(seed, numbers):
        """Uniform n for each element number n, one Philox evaluation each: of the four outputs at counter n // 4,
        the one `_four_uniforms` lays out at position n mod 4 (first, third, second, fourth)."""
        first, second, third, fourth = tl.rand4x(seed, numbers // 4)
        lane = numbers % 4
        return tl.where(lane == 0, first, tl.where(lane == 1, third, tl.where(lane == 2, second, fourth)))

    @triton.jit
    def _keep_in_tile(
        SEED, rows, n_cols, offset, DROPOUT_P: tl.constexpr, BLOCK_COLS: tl.constexpr, QUADS: tl.constexpr
    ):  # fmt: skip
        """Which elements of a tile of rows (all BLOCK_COLS columns, padding included) survive dropout: element
        number n = offset + row · n_cols + column keeps its value where `_uniforms_at` gives at least p. With
        QUADS (offset and n_cols multiples of 4, so columns 4q … 4q + 3 share counter n // 4) one Philox
        evaluation serves the four; otherwise each element evaluates its own counter."""
        seed = tl.load(SEED)
        firsts = offset + rows.to(tl.int64) * n_cols  # each row's element number at column 0
        if QUADS:
            uniforms = _four_uniforms(seed, firsts[:, None] // 4 + tl.arange(0, BLOCK_COLS // 4)[None, :])
        else:
            uniforms = _uniforms_at(seed, firsts[:, None] + tl.arange(0, BLOCK_COLS)[None, :])
        return uniforms >= DROPOUT_P

    @triton.jit
    def _gelu_and_slope(u):
        """GELU(u) = u·Φ(u) (the exact erf GELU) and its derivative Φ(u) + u·φ(u), in fp32."""
        cdf = 0.5 * (1.0 + tl.erf(u * 0.7071067811865476))
        pdf = tl.exp(-0.5 * u * u) * 0.3989422804014327  # 1/√(2π)
        return u * cdf, cdf + u * pdf

    @triton.jit
    def _dropped(values, keep, DROPOUT_P: tl.constexpr):
        """Dropout of fp32 values: zeros where `keep` is false, the others scaled by 1 / (1 − p)."""
        return tl.where(keep, values * (1.0 / (1.0 - DROPOUT_P)), 0.0)

    @triton.jit
    def _tile_offsets(tile, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """A tile's rows, its columns, which of its elements exist, and their numbers (int64: a call may
        hold more than 2³¹ elements) in the row-major (rows, n_cols) layout; the numbers also count the
        dropout mask's elements."""
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        return rows, cols, inside, rows.to(tl.int64)[:, None] * n_cols + cols[None, :]

    @triton.jit
    def _residual_layer_norm_forward(
        RESIDUAL, BRANCH, BRANCH_BIAS, WEIGHT, BIAS, SEED, NEW_RESIDUAL, NORMALIZED, MEAN, RSTD, KEEP,
        n_rows, n_cols, offset, eps,
        DROPOUT_P: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, QUADS: tl.constexpr,
        HAS_BRANCH_BIAS: tl.constexpr, MASK_STORED: tl.constexpr,
    ):  # fmt: skip
        """One tile of rows: new = residual + dropout(branch + branch's bias), rounded to its dtype; then its
        LayerNorm from fp32 statistics of the rounded rows (what the backward kernel reads back), whose mean and
        1/σ are kept for the backward pass; with MASK_STORED the dropout mask too, a byte per element, in KEEP."""
        rows, cols, inside, elements = _tile_offsets(tl.program_id(0), n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
        branch = tl.load(BRANCH + elements, mask=inside, other=0.0).to(tl.float32)
        if HAS_BRANCH_BIAS:
            branch += tl.load(BRANCH_BIAS + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        if DROPOUT_P > 0:
            keep = _keep_in_tile(SEED, rows, n_cols, offset, DROPOUT_P, BLOCK_COLS, QUADS)
            if MASK_STORED:
                tl.store(KEEP + elements, keep.to(tl.int8), mask=inside)
            branch = _dropped(branch, keep, DROPOUT_P)
        residual = tl.load(RESIDUAL + elements, mask=inside, other=0.0).to(tl.float32)
        new = (residual + branch).to(NEW_RESIDUAL.dtype.element_ty)
        tl.store(NEW_RESIDUAL + elements, new, mask=inside)
        new = new.to(tl.float32)
        mean = tl.sum(new, 1) / n_cols
        centered = tl.where(inside, new - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / n_cols + eps)
        weight = tl.load(WEIGHT + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        bias = tl.load(BIAS + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        normalized = centered * rstd[:, None] * weight[None, :] + bias[None, :]
        tl.store(NORMALIZED + elements, normalized.to(NORMALIZED.dtype.element_ty), mask=inside)
        tl.store(MEAN + rows, mean, mask=rows < n_rows)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def _folded(values, ACC_ROWS: tl.constexpr):
        """A tile's (rows, columns) values as an accumulator of ACC_ROWS rows takes them: summed over the rows (1),
        or as they are."""
        if ACC_ROWS == 1:
            folded = tl.sum(values, 0)[None, :]
        else:
            folded = values
        return folded

    @triton.jit
    def _residual_layer_norm_backward(
        GRAD_NEW, GRAD_NORMALIZED, NEW_RESIDUAL, WEIGHT, MEAN, RSTD, SEED, KEEP,
        GRAD_RESIDUAL, GRAD_BRANCH, GRAD_PARTS,
        n_rows, n_cols, offset,
        DROPOUT_P: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, QUADS: tl.constexpr,
        HAS_BRANCH_BIAS: tl.constexpr, MASK_STORED: tl.constexpr, ACC_ROWS: tl.constexpr,
    ):  # fmt: skip
        """Tiles program, program + programs, …: the gradient of `new` (its own plus LayerNorm's) is the
        residual's, and through the mask (regenerated, or read from KEEP with MASK_STORED) the branch's; the
        program's sums over its rows of the weight's, the bias's and (HAS_BRANCH_BIAS) the branch's bias's
        gradients go to row `program` of the partial sums GRAD_PARTS[0], [1] and [2]. They accumulate in ACC_ROWS
        rows: BLOCK_ROWS (each tile's rows added as they are, summed once at the end) or 1 (summed per tile)."""
        program, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_COLS)
        weight = tl.load(WEIGHT + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        grad_weight = tl.zeros((ACC_ROWS, BLOCK_COLS), tl.float32)
        grad_bias = tl.zeros((ACC_ROWS, BLOCK_COLS), tl.float32)
        grad_branch_bias = tl.zeros((ACC_ROWS, BLOCK_COLS), tl.float32)
        for tile in range(program, tl.cdiv(n_rows, BLOCK_ROWS), programs):
            rows, cols, inside, elements = _tile_offsets(tile, n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
            new = tl.load(NEW_RESIDUAL + elements, mask=inside, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=rows < n_rows, other=0.0)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
            normalized = tl.where(inside, (new - mean[:, None]) * rstd[:, None], 0.0)  # before weight and bias
            grad_normalized = tl.load(GRAD_NORMALIZED + elements, mask=inside, other=0.0).to(tl.float32)
            grad_scaled = grad_normalized * weight[None, :]
            # d(new) = (dx̂ − mean(dx̂) − x̂·mean(dx̂·x̂)) / σ, plus the gradient `new` got directly.
            mean_grad = tl.sum(grad_scaled, 1) / n_cols
            mean_grad_normalized = tl.sum(grad_scaled * normalized, 1) / n_cols
            grad_new = (grad_scaled - mean_grad[:, None] - normalized * mean_grad_normalized[:, None]) * rstd[:, None]
            grad_new += tl.load(GRAD_NEW + elements, mask=inside, other=0.0).to(tl.float32)
            tl.store(GRAD_RESIDUAL + elements, grad_new.to(GRAD_RESIDUAL.dtype.element_ty), mask=inside)
            grad_branch = grad_new
            if DROPOUT_P > 0:
                if MASK_STORED:
                    keep = tl.load(KEEP + elements, mask=inside, other=0) != 0
                else:
                    keep = _keep_in_tile(SEED, rows, n_cols, offset, DROPOUT_P, BLOCK_COLS, QUADS)
                grad_branch = _dropped(grad_new, keep, DROPOUT_P)
            tl.store(GRAD_BRANCH + elements, grad_branch.to(GRAD_BRANCH.dtype.element_ty), mask=inside)
            grad_weight += _folded(grad_normalized * normalized, ACC_ROWS)
            grad_bias += _folded(grad_normalized, ACC_ROWS)
            if HAS_BRANCH_BIAS:
                grad_branch_bias += _folded(tl.where(inside, grad_branch, 0.0), ACC_ROWS)
        row = program * n_cols + cols
        tl.store(GRAD_PARTS + row, tl.sum(grad_weight, 0), mask=cols < n_cols)
        tl.store(GRAD_PARTS + programs * n_cols + row, tl.sum(grad_bias, 0), mask=cols < n_cols)
        if HAS_BRANCH_BIAS:
            tl.store(GRAD_PARTS + 2 * programs * n_cols + row, tl.sum(grad_branch_bias, 0), mask=cols < n_cols)

    @triton.jit
    def _bias_gelu_forward(
        X, BIAS, OUT, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
    ):  # fmt: skip
        """One tile of rows × columns: gelu(x + bias) = u·Φ(u), computed in fp32."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        elements = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        bias = tl.load(BIAS + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        u = tl.load(X + elements, mask=inside, other=0.0).to(tl.float32) + bias[None, :]
        out, _ = _gelu_and_slope(u)
        tl.store(OUT + elements, out.to(OUT.dtype.element_ty), mask=inside)

    @triton.jit
    def _bias_gelu_backward(
        GRAD_OUT, X, BIAS, GRAD_X, GRAD_BIAS_PARTS, n_rows, n_cols,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    ):  # fmt: skip
        """Row tiles program, program + programs, … of one block of columns: d(x + bias) = dy · (Φ(u) + u·φ(u)),
        recomputed from x; the program's column sums of it (the bias's gradient) go to row `program` of the
        partial sums."""
        program, programs = tl.program_id(0), tl.num_programs(0)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        bias = tl.load(BIAS + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        grad_bias = tl.zeros((BLOCK_COLS,), tl.float32)
        for tile in range(program, tl.cdiv(n_rows, BLOCK_ROWS), programs):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            elements = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
            u = tl.load(X + elements, mask=inside, other=0.0).to(tl.float32) + bias[None, :]
            _, slope = _gelu_and_slope(u)
            grad_u = tl.load(GRAD_OUT + elements, mask=inside, other=0.0).to(tl.float32) * slope
            tl.store(GRAD_X + elements, grad_u.to(GRAD_X.dtype.element_ty), mask=inside)
            grad_bias += tl.sum(grad_u, 0)
        tl.store(GRAD_BIAS_PARTS + program * n_cols + cols, grad_bias, mask=cols < n_cols)

    @triton.jit
    def _mask_kernel(SEED, KEEP, numel, offset, dropout_p, BLOCK: tl.constexpr):
        """The mask element by element, from `_uniforms_at` alone: what the kernels' tiles must agree with."""
        elements = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = _uniforms_at(tl.load(SEED), offset + elements) >= dropout_p
        tl.store(KEEP + elements, keep.to(tl.int8), mask=elements < numel)


def _quads(width: int, offset: int) -> bool:
    """Whether each Philox evaluation can serve four adjacent elements of a row (`_keep_in_tile`)."""
    return width % 4 == 0 and offset % 4 == 0


class _ResidualLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, branch, branch_bias, weight, bias, eps, dropout_p, seed, offset, normalized_dtype):
        width = residual.shape[-1]
        residual, branch = residual.contiguous(), branch.contiguous()
        n_rows = residual.numel() // width
        dtype = torch.promote_types(residual.dtype, branch.dtype)  # as residual + branch would give
        new_residual = torch.empty(residual.shape, dtype=dtype, device=residual.device)
        normalized = torch.empty(residual.shape, dtype=normalized_dtype or dtype, device=residual.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=residual.device)
        rstd = torch.empty_like(mean)
        block_rows, block_cols, num_warps = _tile(width)
        has_branch_bias = branch_bias is not None
        # read only with a branch bias; else memory of its own: compiled code may copy an argument it takes for
        # written and rebind the tensor, which must then be no other argument's
        unused = torch.empty(1, device=residual.device)
        mask_stored = RESIDUAL_MASK_STORED and dropout_p > 0
        # the mask's bytes where stored; else, like `unused`, a buffer of its own that is never read
        keep = torch.empty(residual.shape if mask_stored else (1,), dtype=torch.int8, device=residual.device)
        _residual_layer_norm_forward[(triton.cdiv(n_rows, block_rows),)](
            residual, branch, branch_bias.contiguous() if has_branch_bias else unused, weight.contiguous(),
            bias.contiguous(), seed, new_residual, normalized, mean, rstd,
            keep,
            n_rows, width, offset, eps,
            DROPOUT_P=dropout_p, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, QUADS=_quads(width, offset),
            HAS_BRANCH_BIAS=has_branch_bias, MASK_STORED=mask_stored, num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(new_residual, weight, mean, rstd, seed, keep)
        ctx.mask_stored = mask_stored
        ctx.options = dropout_p, offset, residual.dtype, branch.dtype, bias.dtype
        ctx.branch_bias_dtype = branch_bias.dtype if has_branch_bias else None
        ctx.column_sums_at_end = COLUMN_SUMS_AT_END  # the call's settings are those of its forward pass
        return new_residual, normalized

    @staticmethod
    def backward(ctx, grad_new, grad_normalized):
        new_residual, weight, mean, rstd, seed, keep = ctx.saved_tensors  # keep: read only where the mask is stored
        dropout_p, offset, residual_dtype, branch_dtype, bias_dtype = ctx.options
        width = new_residual.shape[-1]
        n_rows = new_residual.numel() // width
        grad_residual = torch.empty(new_residual.shape, dtype=residual_dtype, device=new_residual.device)
        grad_branch = torch.empty(new_residual.shape, dtype=branch_dtype, device=new_residual.device)
        block_rows, block_cols, num_warps = _tile(width)
        programs = _reducing_programs(new_residual.device, triton.cdiv(n_rows, block_rows))
        branch_bias_dtype = ctx.branch_bias_dtype
        sums = 2 if branch_bias_dtype is None else 3  # the weight's, the bias's, the branch's bias's
        parts = torch.empty(sums, programs, width, dtype=torch.float32, device=new_residual.device)
        _residual_layer_norm_backward[(programs,)](
            grad_new.contiguous(), grad_normalized.contiguous(), new_residual, weight.contiguous(), mean, rstd, seed,
            keep, grad_residual, grad_branch, parts,
            n_rows, width, offset,
            DROPOUT_P=dropout_p, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, QUADS=_quads(width, offset),
            HAS_BRANCH_BIAS=branch_bias_dtype is not None, MASK_STORED=ctx.mask_stored,
            ACC_ROWS=block_rows if ctx.column_sums_at_end else 1, num_warps=num_warps,
        )  # fmt: skip
        summed = parts.sum(1)  # one reduction for all of them
        grad_weight, grad_bias = summed[0].to(weight.dtype), summed[1].to(bias_dtype)
        grad_branch_bias = summed[2].to(branch_bias_dtype) if branch_bias_dtype is not None else None
        return grad_residual, grad_branch, grad_branch_bias, grad_weight, grad_bias, None, None, None, None, None


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        width = x.shape[-1]
        x = x.contiguous()
        n_rows = x.numel() // width
        out = torch.empty_like(x)
        block_rows, block_cols, num_warps = _tile(width, max_block=1024)
        grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(width, block_cols))
        _bias_gelu_forward[grid](
            x, bias.contiguous(), out, n_rows, width,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        )  # fmt: skip
        ctx.save_for_backward(x, bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, bias = ctx.saved_tensors
        width = x.shape[-1]
        n_rows = x.numel() // width
        grad_x = torch.empty_like(x)
        block_rows, block_cols, num_warps = _tile(width, max_block=1024)
        column_blocks = triton.cdiv(width, block_cols)
        # Each column block has its own programs, so fewer row programs keep the whole grid the same size.
        programs = max(1, _reducing_programs(x.device, triton.cdiv(n_rows, block_rows)) // column_blocks)
        grad_bias_parts = torch.empty(programs, width, dtype=torch.float32, device=x.device)
        _bias_gelu_backward[(programs, column_blocks)](
            grad_out.contiguous(), x, bias.contiguous(), grad_x, grad_bias_parts, n_rows, width,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps,
        )  # fmt: skip
        return grad_x, grad_bias_parts.sum(0).to(bias.dtype)


def residual_layer_norm_reference(
    residual, branch, weight, bias, eps, dropout_p, training, normalized_dtype=None, branch_bias=None
):
    """The plain PyTorch composition `fused_residual_layer_norm` fuses (its fallback)."""
    if branch_bias is not None:
        branch = branch + branch_bias.to(branch.dtype)  # as a Linear layer adds its bias under autocast
    new_residual = residual + F.dropout(branch, dropout_p, training)
    normalized = F.layer_norm(new_residual, (new_residual.shape[-1],), weight, bias, eps)
    return new_residual, normalized if normalized_dtype is None else normalized.to(normalized_dtype)


def bias_gelu_reference(x, bias):
    """The plain PyTorch composition `fused_bias_gelu` fuses (its fallback); the bias is cast to x's dtype,
    as a Linear layer's under autocast is."""
    return F.gelu(x + bias.to(x.dtype))


def fused_residual_layer_norm(
    residual, branch, weight, bias, eps, dropout_p, training, *, seed=None, offset=0, normalized_dtype=None,
    branch_bias=None,
):  # fmt: skip
    """`(new_residual, normalized)`: `new_residual = residual + dropout(branch)` and
    `normalized = layer_norm(new_residual, weight, bias, eps)` over the last dimension, forward and backward
    in one kernel each (see the module docstring). With `branch_bias` ((n_embd,), the branch's last layer's
    bias, left out of its product) the branch is branch + branch_bias, added in fp32, and the bias's gradient
    is summed in the backward kernel.

    residual and branch: one shape (..., n_embd), fp32 or bf16 each; both outputs have the dtype of
    residual + branch, or `normalized` the `normalized_dtype` given (fp32 or bf16: rounded once, as a cast
    after the LayerNorm rounds it). weight and bias: (n_embd,). Dropout (when `training` and dropout_p > 0) keeps element
    i (in row-major order) where the shared counter-based mask keeps offset + i for the call's `seed` (an
    int64 tensor of one element on the inputs' device; by default each call draws one from torch's
    generator, so torch.manual_seed repeats it); `residual_dropout_keep_mask` gives that mask. Elsewhere (see
    `_kernels_apply`, and rows wider than `MAX_WIDTH`) PyTorch computes it, dropout drawn as torch's."""
    dropout_p = float(dropout_p) if training else 0.0
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    width = residual.shape[-1]
    if not (
        _kernels_apply(residual, branch, weight, bias)
        and residual.shape == branch.shape
        and weight.shape == bias.shape == (width,)
        and width <= MAX_WIDTH
        and normalized_dtype in (None, *KERNEL_DTYPES)
        and (branch_bias is None or (_kernels_apply(branch_bias, weight) and branch_bias.shape == (width,)))
    ):
        return residual_layer_norm_reference(
            residual, branch, weight, bias, eps, dropout_p, training, normalized_dtype, branch_bias
        )
    if seed is None and dropout_p > 0:
        seed = draw_seed(residual.device)
    elif seed is None:  # never read: the kernels draw no mask
        seed = torch.zeros(1, dtype=torch.int64, device=residual.device)
    return _ResidualLayerNorm.apply(
        residual, branch, branch_bias, weight, bias, float(eps), dropout_p, seed, int(offset), normalized_dtype
    )


def fused_bias_gelu(x, bias):
    """gelu(x + bias) (exact erf GELU) for x of shape (..., n) and bias (n,), forward and backward in one
    kernel each; the result (and x's gradient) in x's dtype, the bias's gradient in its own. Elsewhere (see
    `_kernels_apply`) PyTorch computes it."""
    if not (_kernels_apply(x, bias) and bias.shape == (x.shape[-1],)):
        return bias_gelu_reference(x, bias)
    return _BiasGelu.apply(x, bias)


def residual_dropout_keep_mask(seed: torch.Tensor, shape, dropout_p: float, offset: int = 0) -> torch.Tensor:
    """The boolean mask of the `branch` elements `fused_residual_layer_norm` keeps for `seed` and `offset`,
    drawn by the same mask function, for tests and debugging (needs Triton)."""
    numel = int(torch.Size(shape).numel())
    keep = torch.empty(numel, dtype=torch.int8, device=seed.device)
    block = 1024
    _mask_kernel[(triton.cdiv(numel, block),)](seed, keep, numel, int(offset), float(dropout_p), BLOCK=block)
    return keep.bool().view(shape)


__all__ = [
    "MAX_WIDTH",
    "bias_gelu_reference",
    "fused_bias_gelu",
    "fused_layers_available",
    "fused_residual_layer_norm",
    "residual_dropout_keep_mask",
    "residual_layer_norm_reference",
]
