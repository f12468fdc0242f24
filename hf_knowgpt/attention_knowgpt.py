"""How KnowGPT computes attention: the attention layers of the four `attention_type`s and the attention
functions they call, chosen by implementation in one registry.

- `KnowGPTSelfAttention`: vanilla causal self-attention, with rotary queries and keys for rope;
- `KnowGPTSynthesizerAttention`: the dense Synthesizer, whose keys are learned columns indexed by position;
- `KnowGPTCrossAttention`: one stream over another, the perceiver's down- and up-projection.

Each layer forms queries, keys and values and hands them to `attention_function(config, implementation)`:
"sdpa" (PyTorch's fused kernels), "eager" (the handouts' unfused computation, the one that returns its
weights) or "triton" (the fused kernel of `hf_knowgpt.kernels` for bf16 training on a GPU, SDPA elsewhere),
run in the config's `attention_kernel_dtype`. Masks follow the tokens' order and padding, built by one
helper (`AttentionContext.visibility`); `TokenGrid` says where the computed tokens sit in the (batch, time)
grid (all of it, or only the real tokens of packed training).
"""

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property, partial

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache

from .configuration_knowgpt import KnowGPTConfig
from .layers_knowgpt import DropoutMasks, KnowGPTDropout, linear, project, stacked_projection


def _fused_kernel():
    """`hf_knowgpt.kernels.fused_attention`, imported on first use (Triton takes a second to import, and only
    bf16 training on a GPU runs it), or None where the package is not installed: a checkpoint carries the
    model's files but not the kernel, so its code loaded with `trust_remote_code` runs SDPA instead."""
    try:
        from hf_knowgpt.kernels import fused_attention
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("hf_knowgpt"):
            raise
        return None
    return fused_attention


def supports_fused_attention(*args, **kwargs) -> bool:
    """`fused_attention.supports_fused_attention` where the kernel is installed; False elsewhere."""
    kernel = _fused_kernel()
    return kernel is not None and kernel.supports_fused_attention(*args, **kwargs)


def fused_causal_attention(*args, **kwargs):
    return _fused_kernel().fused_causal_attention(*args, **kwargs)


# The packed kernel handed the three projections as one stacked tensor, so that their gradients come back as one
# instead of three concatenated after (one kernel of 5.4 µs a layer in the handout step's profile, H200): with the
# weight gradients taken together, the handout recipe's steps 19.4-19.8 s against 19.8-20.1 s, three pairs side by
# side on an H100 (benchmarks/RESULTS.md, step_variants.py's `stacked-attention-inputs`).
STACKED_ATTENTION_INPUTS = True

# Groups of rows for attention on a CPU (TokenGrid.length_groups). A packed quickstart step under bf16 (16 rows of
# a batch's lengths) took 33.8 ms in 4 groups, 34.5 in 3, 35.0 in 2, 35.4 in 5 and 37.1 ms in one grid
# (benchmarks/diagnostics/cpu_step_costs.py, the project's CPU; benchmarks/RESULTS.md).
LENGTH_GROUPS = 4


class TokenGrid:
    """Where the computed tokens sit in the (batch, time) grid.

    Dense: every position is computed and hidden states are (B, T, C). Packed: only the positions in
    `token_index` (flat b·T + t) are computed and hidden states are (N, C); a corrupted training
    document fills about half of its 128 positions, the rest is right padding whose targets are never
    trained. Position-wise layers then do half the work; attention scatters tokens into the grid and
    gathers them back, except the fused kernel, which reads the rows packed (`row_starts`, `row_lengths`).
    The packed tokens must form a prefix of each row, so that no computed query sees an absent key.
    """

    def __init__(self, batch_size: int, seq_len: int, token_index: torch.Tensor | None = None):
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.token_index = token_index
        # Computed positions per row (packed), so that attention kernels can skip the padding after them,
        # and where each row's tokens start in the packed states (rows lie back to back, in order).
        self.row_lengths = self._row_lengths()
        self.row_starts = None if self.row_lengths is None else self.row_lengths.cumsum(0) - self.row_lengths

    @property
    def packed(self) -> bool:
        return self.token_index is not None

    def to_grid(self, states: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return states
        flat = states.new_zeros((self.batch_size * self.seq_len, *states.shape[1:]))
        flat = flat.index_copy(0, self.token_index, states)
        return flat.view(self.batch_size, self.seq_len, *states.shape[1:])

    def from_grid(self, states: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return states
        flat = states.reshape(self.batch_size * self.seq_len, *states.shape[2:])
        return flat.index_select(0, self.token_index)

    def _row_lengths(self) -> torch.Tensor | None:
        if not self.packed:
            return None
        rows = torch.div(self.token_index, self.seq_len, rounding_mode="floor")
        counts = torch.zeros(self.batch_size, dtype=torch.int32, device=rows.device)
        return counts.index_add_(0, rows, torch.ones_like(rows, dtype=torch.int32))

    @cached_property
    def length_groups(self) -> "LengthGroups | None":
        """On a CPU, packed rows that come longest first (as the trainer orders them there) as up to
        `LENGTH_GROUPS` groups of consecutive rows, each in a grid only as wide as its longest row. SDPA's cost
        grows with rows × width², and a batch's rows differ in length (the quickstart's: 89 tokens on average,
        the longest 125), so attention group by group does 0.6 of the work (4 groups). None where it does not apply
        (elsewhere the lengths would be read from the device, and a GPU trains packed through the fused
        kernel) or would save under a fifth."""
        if not self.packed or self.token_index.device.type != "cpu" or self.batch_size < 2:
            return None
        lengths = self.row_lengths
        if bool((lengths[1:] > lengths[:-1]).any()):
            return None
        shapes, indices, offset, work = [], [], 0, 0
        for rows in torch.arange(self.batch_size).tensor_split(min(LENGTH_GROUPS, self.batch_size)):
            group_lengths = lengths[rows]
            width = int(group_lengths[0])
            if width == 0:  # this row and the ones after it have no tokens
                break
            real = torch.arange(width)[None] < group_lengths[:, None]
            indices.append(real.flatten().nonzero()[:, 0] + offset)
            shapes.append((len(rows), width))
            offset, work = offset + len(rows) * width, work + len(rows) * width**2
        if not shapes or work >= 0.8 * self.batch_size * self.seq_len**2:
            return None
        return LengthGroups(torch.cat(indices), shapes)


class LengthGroups:
    """Packed tokens laid out as several grids of rows, one after another in one flat buffer: group g holds
    `shapes[g]` = (rows, width) positions, and packed token i sits at `index[i]` of the buffer. One scatter
    and one gather for all groups, and the buffer splits into the groups' grids as views."""

    def __init__(self, index: torch.Tensor, shapes: list[tuple[int, int]]):
        self.index = index
        self.shapes = shapes
        self.sizes = [rows * width for rows, width in shapes]

    @cached_property
    def positions(self) -> torch.Tensor:
        """Each buffer position's index in its row (what rope rotates by), built only when asked."""
        return torch.cat([torch.arange(width).repeat(rows) for rows, width in self.shapes])

    def to_buffer(self, states: torch.Tensor) -> torch.Tensor:
        """Packed (N, ...) states into the buffer (Σ rows·width, ...), zeros at the padding."""
        buffer = states.new_zeros((sum(self.sizes), *states.shape[1:]))
        return buffer.index_copy(0, self.index, states)

    def grids(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The buffer as each group's (rows, width, ...) grid."""
        parts = buffer.split(self.sizes)
        return [part.view(rows, width, *buffer.shape[1:]) for part, (rows, width) in zip(parts, self.shapes)]

    def from_grids(self, grids: list[torch.Tensor]) -> torch.Tensor:
        """The groups' (rows, width, ...) grids back to packed (N, ...) states."""
        return torch.cat([grid.flatten(0, 1) for grid in grids]).index_select(0, self.index)


@dataclass
class AttentionContext:
    """Positions and visibility shared by every attention layer of one forward call.

    Positions place tokens for what encodes them (the position embedding, rope's rotation, the synthesizer's
    keys): `position_ids` where given. Visibility follows the tokens' order alone, as in transformers'
    models: a key is visible when it is real and not after the query (`query_order`, `key_order`: each
    token's index among the row's real tokens; the positions, when not given). `causal_only` marks the
    training case (no cache, no padding mask): attention is plain causal over the index and the fused
    kernels run without an explicit mask. `implementation` is the attention implementation of this call:
    the config's, or "eager" when the attention weights are asked for. `fused_layers`: the blocks' fused
    residual kernels run this call (`KnowGPTModel.fused_layers`).
    """

    query_positions: torch.Tensor  # (B or 1, Tq)
    key_positions: torch.Tensor  # (B or 1, Tk), past and present keys
    key_valid: torch.Tensor | None  # (B, Tk) bool, False for padding
    causal_only: bool
    positions_are_indices: bool = False  # query t (of every row) is at position t: no position_ids, no past
    implementation: str = "sdpa"
    # the blocks' fused kernels (`hf_knowgpt.kernels.fused_layers`) run this call: each block then drops out
    # the attention branch inside its residual + LayerNorm kernel, so the attention layer returns it undropped
    fused_layers: bool = False
    # this call's residual-stream dropout masks drawn at once (`layers_knowgpt.residual_dropout_masks`), or None
    dropout_masks: DropoutMasks | None = None
    # packed self-attention group by group of rows of similar length (`KnowGPTModel.attention_by_length`)
    by_length: bool = False
    query_order: torch.Tensor | None = None  # (B or 1, Tq); None: the query positions
    key_order: torch.Tensor | None = None  # (B or 1, Tk); None: the key positions

    def __post_init__(self):
        self.query_order = self.query_positions if self.query_order is None else self.query_order
        self.key_order = self.key_positions if self.key_order is None else self.key_order

    def to(self, device, non_blocking=False) -> "AttentionContext":
        """This context with its tensors on `device`. Accelerate's hooks call it when a `device_map` puts a
        model's blocks on several devices, as they move every argument of a block to the block's device."""
        tensors = {field.name: getattr(self, field.name) for field in fields(self)}
        moved = {
            name: value.to(device, non_blocking=non_blocking)
            for name, value in tensors.items()
            if torch.is_tensor(value)
        }
        return replace(self, **moved)

    def visibility(self, query_order=None, key_order=None, key_valid="same") -> torch.Tensor:
        """Boolean (B, 1, Tq, Tk) mask: a key is visible when it is real and not after the query."""
        query_order = self.query_order if query_order is None else query_order
        key_order = self.key_order if key_order is None else key_order
        key_valid = self.key_valid if isinstance(key_valid, str) else key_valid
        visible = key_order[:, None, :] <= query_order[:, :, None]
        if key_valid is not None:
            visible = visible & key_valid[:, None, :]
        # A query that sees no key at all (a padding query before any real token) would turn the
        # softmax into NaN; let it see everything: its output is never used.
        visible = visible | ~visible.any(dim=-1, keepdim=True)
        return visible[:, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Turn a boolean visibility mask (plus an optional additive score bias) into the float mask SDPA adds."""
    blocked = torch.finfo(dtype).min
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, blocked)
    if bias is not None:
        mask = mask + bias.to(dtype)
    return mask


# Attention functions take (B, H, T, D) queries, keys and values and return (output, weights): the
# attention probabilities (B, H, Tq, Tk) from the eager function, None from the fused ones. `lengths` (B,),
# when given, marks the positions from lengths[b] on as right padding whose outputs are discarded: kernels
# may skip them.


def sdpa_attention(query, key, value, mask, scale, dropout_p, is_causal, lengths=None):
    attended = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    return attended, None


def eager_attention(query, key, value, mask, scale, dropout_p, is_causal, lengths=None):
    """Unfused attention, as the handouts compute it; the reference for the fused kernels, and the one that
    returns its weights (after dropout, as transformers' eager attention does)."""
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = F.softmax(scores.float(), dim=-1).to(value.dtype)
    weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0)
    return torch.matmul(weights, value), weights


def triton_attention(query, key, value, mask, scale, dropout_p, is_causal, lengths=None, fallback=sdpa_attention):
    """The fused Triton kernel (`hf_knowgpt.kernels.fused_attention`: bf16 in and out, softmax and sums in fp32) where
    it applies: causal bf16 self-attention without a padding mask over at most 256 positions on a CUDA
    device, i.e. bf16 training. `fallback` (SDPA) everywhere else: fp32, masks, the KV cache, the
    perceiver's cross-attention, CPU. (Packed training calls the kernel directly, the synthesizer's keys by
    position and bias included.)"""
    if supports_fused_attention(query, key, value, mask, is_causal):
        return fused_causal_attention(query, key, value, scale, dropout_p, lengths=lengths), None
    return fallback(query, key, value, mask, scale=scale, dropout_p=dropout_p, is_causal=is_causal)


ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "eager": eager_attention, "triton": triton_attention}


def attention_function(config: KnowGPTConfig, implementation: str | None = None):
    """The attention function of `implementation` (default: the config's), in the config's kernel dtype."""
    implementation = implementation or config._attn_implementation or "sdpa"
    if implementation not in ATTENTION_FUNCTIONS:
        raise ValueError(
            f"KnowGPT supports attn_implementation in {sorted(ATTENTION_FUNCTIONS)}, got {implementation!r}"
        )
    if implementation == "triton":  # the fused kernel is fp32 already; the kernel dtype applies to its fallback
        return partial(triton_attention, fallback=_in_kernel_dtype(sdpa_attention, config.attention_kernel_dtype))
    return _in_kernel_dtype(ATTENTION_FUNCTIONS[implementation], config.attention_kernel_dtype)


def _in_kernel_dtype(function, kernel_dtype: str | None):
    return function if kernel_dtype is None else _in_precision(function, getattr(torch, kernel_dtype))


def _in_precision(function, kernel_dtype: torch.dtype):
    """Run an attention function in `kernel_dtype` when its inputs come in half precision (bf16/fp16
    autocast or a half-precision model), and hand the result back in the inputs' precision."""

    def attention_in_precision(query, key, value, mask, **options):
        if query.dtype not in (torch.bfloat16, torch.float16) or query.dtype == kernel_dtype:
            return function(query, key, value, mask, **options)
        mask = mask.to(kernel_dtype) if mask is not None else None  # bf16's minimum becomes -inf in fp16
        with torch.autocast(query.device.type, enabled=False):
            attended, weights = function(
                query.to(kernel_dtype), key.to(kernel_dtype), value.to(kernel_dtype), mask, **options
            )
        return attended.to(query.dtype), None if weights is None else weights.to(query.dtype)

    return attention_in_precision


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of t·θ_i, θ_i = theta^(-2(i-1)/head_dim), i = 1..head_dim/2; shaped (*positions.shape, head_dim/2)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inverse_frequencies = theta ** (-exponents)
    angles = positions[..., None].float() * inverse_frequencies
    return angles.cos(), angles.sin()


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent feature pairs (x₂ᵢ, x₂ᵢ₊₁) by the angles: complex multiplication by e^{i t θ}."""
    if torch.compiler.is_compiling():  # inductor fuses the real arithmetic into one kernel; it has no complex ones
        return rotary_by_real_arithmetic(states, cos, sin)
    # eager: one complex product each way, not six real operations and a stack (3% of a CPU step)
    pairs = torch.view_as_complex(states.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).to(states.dtype)


def rotary_by_real_arithmetic(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary`'s rotation in real operations: four products, two sums and a stack."""
    even, odd = states.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(states.dtype)


def split_heads(states: torch.Tensor, n_head: int) -> torch.Tensor:
    batch, length, width = states.shape
    return states.view(batch, length, n_head, width // n_head).transpose(1, 2)


def merge_heads(states: torch.Tensor) -> torch.Tensor:
    batch, n_head, length, head_dim = states.shape
    return states.transpose(1, 2).reshape(batch, length, n_head * head_dim)


def reads_packed_tokens(grid: "TokenGrid", context: "AttentionContext", cache, by_position: bool):
    """Packed training with the fused kernel: it reads the packed tokens as they are. Attention that depends
    on positions (rope, the synthesizer's keys) takes them as each token's index in its row, so it needs
    positions that are those indices. (Where the kernel then turns out not to take the tensors, fp32 say,
    they go through the grid after all.)"""
    return (
        grid.packed
        and cache is None
        and context.causal_only
        and (context.positions_are_indices or not by_position)
        and context.implementation == "triton"
    )


def branch_output(layer: nn.Module, attended: torch.Tensor, context: AttentionContext) -> torch.Tensor:
    """An attention layer's heads projected back to the residual stream (`layer.proj`) and dropped out
    (`layer.resid_dropout`); where the block's fused residual kernel runs (`context.fused_layers`), neither
    dropped out nor, for a plain projection, given its bias (`branch_bias`): the kernel does both."""
    if context.fused_layers:
        return linear(layer.proj, attended, bias_by_kernel=False, leave_bias_out=True)
    return layer.resid_dropout(linear(layer.proj, attended, bias_by_kernel=False), context.dropout_masks)


class KnowGPTSelfAttention(nn.Module):
    """Causal multi-head self-attention (vanilla), with rotary queries and keys when `rotary`."""

    def __init__(self, config: KnowGPTConfig, layer_idx: int, rotary: bool = False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.rotary = rotary
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = KnowGPTDropout(config.resid_pdrop)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    @property
    def dropout_p(self) -> float:
        return self.config.attn_pdrop if self.training else 0.0

    def _project(self, hidden_states, grid: TokenGrid, in_grid: bool):
        """Queries, keys and values per token and head: (…, H, D), in the (B, T) grid when `in_grid`,
        else as `hidden_states` come (packed tokens stay packed)."""
        projected = project(hidden_states, (self.query, self.key, self.value), grid.to_grid if in_grid else None)
        return [states.unflatten(-1, (self.n_head, self.head_dim)) for states in projected]

    def _packed_kernel_applies(self, grid: TokenGrid, context: AttentionContext, cache) -> bool:
        return reads_packed_tokens(grid, context, cache, by_position=self.rotary)

    @staticmethod
    def _by_length(grid: TokenGrid, context: AttentionContext, cache) -> bool:
        """Packed causal training whose rows `TokenGrid.length_groups` splits, positions being row indices
        (each group's rows start at position 0), by an implementation that returns no weights."""
        return (
            context.by_length
            and cache is None
            and context.causal_only
            and context.positions_are_indices
            and context.implementation != "eager"
            and grid.length_groups is not None
        )

    def forward(self, hidden_states, grid: TokenGrid, context: AttentionContext, cache: Cache | None):
        """(output, attention weights (B, H, T, past + T) or None when the implementation has none)."""
        packed_kernel = self._packed_kernel_applies(grid, context, cache)
        if not packed_kernel and self._by_length(grid, context, cache):
            return branch_output(self, self._attend_by_length(hidden_states, grid, context), context), None
        # The packed kernel's three inputs as one tensor (STACKED_ATTENTION_INPUTS), where they are one product.
        stacked = None
        if packed_kernel and STACKED_ATTENTION_INPUTS:
            stacked = stacked_projection(hidden_states, (self.query, self.key, self.value))
        if stacked is not None:
            stacked = stacked.unflatten(-1, (self.n_head, self.head_dim))  # (tokens, 3, H, D)
            query, key, value = stacked.unbind(-3)
        else:
            query, key, value = self._project(hidden_states, grid, in_grid=not packed_kernel)
        if packed_kernel and supports_fused_attention(query, key, value, None, True, seq_len=grid.seq_len):
            rotary = None
            if self.rotary:  # the kernel rotates queries and keys itself, by their index in the row
                indices = torch.arange(grid.seq_len, device=query.device)
                rotary = rotary_angles(indices, self.head_dim, self.config.rope_theta)
            inputs = (query, key, value) if stacked is None else (stacked, None, None)
            attended = fused_causal_attention(
                *inputs, self.scale, self.dropout_p,
                lengths=grid.row_lengths, starts=grid.row_starts, seq_len=grid.seq_len, rotary=rotary,
            )  # fmt: skip
            return branch_output(self, attended.flatten(-2), context), None
        if packed_kernel:  # the kernel does not take these tensors after all: through the grid as usual
            query, key, value = (grid.to_grid(states) for states in (query, key, value))
        if self.rotary:
            query, key = self._rotate(query, key, context.query_positions)
        attended, weights = self._attend(query, key, value, grid, context, cache)
        return branch_output(self, attended, context), weights

    def _rotate(self, query, key, positions):
        """Rope: queries and keys (…, T, H, D) rotated by their positions (…, T)."""
        cos, sin = rotary_angles(positions, self.head_dim, self.config.rope_theta)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (…, T, 1, D/2): the heads axis
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def _attend(self, query, key, value, grid: TokenGrid, context: AttentionContext, cache):
        """Attention over grid-shaped (B, T, H, D) queries, keys and values, rotated where rope rotates:
        the packed (or grid) outputs merged over heads, and the weights where the implementation keeps them."""
        query, key, value = (states.transpose(1, 2) for states in (query, key, value))  # (B, H, T, D)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        mask = None if context.causal_only else additive_mask(context.visibility(), query.dtype)
        attended, weights = attention_function(self.config, context.implementation)(
            query,
            key,
            value,
            mask,
            scale=self.scale,
            dropout_p=self.dropout_p,
            is_causal=context.causal_only,
            lengths=grid.row_lengths,
        )
        return grid.from_grid(merge_heads(attended)), weights

    def _attend_by_length(self, hidden_states, grid: TokenGrid, context: AttentionContext):
        """Packed causal attention group by group of rows (`TokenGrid.length_groups`); the outputs packed.
        Rope rotates the whole buffer at once, by each position's index in its row: per group, the rotation's
        dozen small operations cost more than the narrower grids save."""
        groups = grid.length_groups
        projected = project(hidden_states, (self.query, self.key, self.value), groups.to_buffer)
        query, key, value = (states.unflatten(-1, (self.n_head, self.head_dim)) for states in projected)
        if self.rotary:
            query, key = self._rotate(query, key, groups.positions)
        attended = []
        for grid_query, grid_key, grid_value in zip(*(groups.grids(states) for states in (query, key, value))):
            dense = TokenGrid(*grid_query.shape[:2])
            attended.append(self._attend(grid_query, grid_key, grid_value, dense, context, None)[0])
        return groups.from_grids(attended)


class KnowGPTSynthesizerAttention(nn.Module):
    """Dense Synthesizer (2021 handout): per head softmax(ReLU(X A_i + b₁) B + b₂)(X V_i), causal.

    As in the handout's code, `w1` holds all heads' A_i (and b₁), and one B (`w2`, d/h × ℓ) with
    its bias `b2` is shared by the heads; ℓ = block_size. The score of key position j is a dot
    product with column j of B, so B's columns act as position-indexed keys.
    """

    def __init__(self, config: KnowGPTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.w1 = nn.Linear(config.n_embd, config.n_embd)
        self.w2 = nn.Parameter(torch.empty(config.head_dim, config.block_size))
        self.b2 = nn.Parameter(torch.empty(config.block_size))
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = KnowGPTDropout(config.resid_pdrop)

    def forward(self, hidden_states, grid: TokenGrid, context: AttentionContext, cache: Cache | None):
        """(output, its softmax weights (B, H, T, past + T) or None when the implementation has none)."""
        packed_kernel = reads_packed_tokens(grid, context, cache, by_position=True)
        features, value = project(hidden_states, (self.w1, self.value), None if packed_kernel else grid.to_grid)
        features = F.relu(features)
        dropout_p = self.config.attn_pdrop if self.training else 0.0
        if packed_kernel:
            features, value = (states.unflatten(-1, (self.n_head, self.head_dim)) for states in (features, value))
            # (block_size, D), the key of position t being column t of B; rows contiguous, for the kernel's loads
            keys = self.w2.t().to(value.dtype, memory_format=torch.contiguous_format)
            if supports_fused_attention(features, keys, value, None, True, seq_len=grid.seq_len):
                attended = fused_causal_attention(
                    features, keys, value, 1.0, dropout_p,
                    lengths=grid.row_lengths, starts=grid.row_starts, seq_len=grid.seq_len, bias=self.b2,
                )  # fmt: skip
                return branch_output(self, attended.flatten(-2), context), None
            features, value = (grid.to_grid(states.flatten(-2)) for states in (features, value))
        features, value = split_heads(features, self.n_head), split_heads(value, self.n_head)
        # The new tokens' synthesized keys, cached like ordinary keys: column t of B for position t, the same
        # for every head, held once per head as a cache holds keys (batch, heads, time, head_dim).
        key = self.w2.t()[context.query_positions][:, None].to(value.dtype)
        key = key.expand(value.shape[0], self.n_head, -1, -1)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        bias = self.b2[context.key_positions][:, None, None, :]
        visible = context.visibility()
        attended, weights = attention_function(self.config, context.implementation)(
            features,
            key,
            value,
            additive_mask(visible, features.dtype, bias),
            scale=1.0,
            dropout_p=dropout_p,
            is_causal=False,
        )
        return branch_output(self, grid.from_grid(merge_heads(attended)), context), weights


class KnowGPTCrossAttention(nn.Module):
    """Multi-head attention of one stream (queries) over another (keys and values), for the perceiver."""

    def __init__(self, config: KnowGPTConfig):
        super().__init__()
        self.config = config
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = KnowGPTDropout(config.resid_pdrop)

    def forward(self, query_states, key, value, visible, implementation: str):
        """query_states: (B, Tq, C); key, value: (B, h, Tk, d) already projected; visible: (B, 1, Tq, Tk).
        Returns (output, attention weights (B, H, Tq, Tk) or None)."""
        query = split_heads(self.query(query_states), self.n_head)
        attended, weights = attention_function(self.config, implementation)(
            query,
            key,
            value,
            additive_mask(visible, query.dtype),
            scale=1.0 / math.sqrt(self.head_dim),
            dropout_p=self.config.attn_pdrop if self.training else 0.0,
            is_causal=False,
        )
        return self.resid_dropout(self.proj(merge_heads(attended))), weights

    def project_context(self, context_states):
        return split_heads(self.key(context_states), self.n_head), split_heads(self.value(context_states), self.n_head)


__all__ = [
    "ATTENTION_FUNCTIONS",
    "AttentionContext",
    "KnowGPTCrossAttention",
    "KnowGPTSelfAttention",
    "KnowGPTSynthesizerAttention",
    "TokenGrid",
    "attention_function",
]
