"""KnowGPT: the CS224N minGPT fork as a 🤗 causal language model.

Token embedding + learned absolute position embedding (none with RoPE), dropout, pre-LayerNorm blocks
(attention, then a GELU MLP of width 4·n_embd), final LayerNorm and an untied, bias-free head.
The four `attention_type`s share the block and differ only in how attention scores are formed:

- vanilla: softmax(Q Kᵀ/√d) V, causal;
- rope: the same with queries and keys rotated by their positions (adjacent feature pairs);
- synthesizer: softmax(ReLU(X A + b₁) B + b₂) V: the "keys" are learned columns of B indexed by key
  position, so it runs through the same attention kernel with K = Bᵀ[positions] and a bias b₂;
- perceiver: a learned basis C cross-attends to the input (down-projection), n_layer − 2 ordinary blocks
  run over the bottleneck, and the input cross-attends back to it (up-projection).

Masks are position based (a key is visible when its position is at most the query's and it is not
padding), built by one helper, so left-padded batches and the KV cache give the same tokens as
unpadded, uncached calls.
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_knowgpt import KnowGPTConfig

logger = logging.get_logger(__name__)

# transformers 5.2x renamed the cache field of model outputs and the forward keyword from
# `past_key_values` to `cache`; the model accepts both and fills whichever the installed version has.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _with_cache(output_class, cache, **fields):
    return output_class(**fields, **{_CACHE_FIELD: cache})


def _deprecated_cache_keyword(forward):
    """Where transformers renamed `past_key_values` to `cache`, the old keyword still works and warns as
    transformers' own models do (their removal version); older versions pass it as the current name."""
    if _CACHE_FIELD != "cache":
        return forward
    from transformers.utils.deprecation import deprecate_kwarg

    return deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")(forward)


def supports_fused_attention(*args, **kwargs) -> bool:
    """`fused_attention.supports_fused_attention`, imported on first use: Triton takes a second to import,
    and only bf16 training on a GPU runs the fused kernel."""
    from .fused_attention import supports_fused_attention

    return supports_fused_attention(*args, **kwargs)


def fused_causal_attention(*args, **kwargs):
    from .fused_attention import fused_causal_attention

    return fused_causal_attention(*args, **kwargs)


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


@dataclass
class AttentionContext:
    """Positions and visibility shared by every attention layer of one forward call.

    `causal_only` marks the training case (no cache, no padding mask): attention is plain causal
    over the index and the fused kernels run without an explicit mask. `implementation` is the attention
    implementation of this call: the config's, or "eager" when the attention weights are asked for.
    """

    query_positions: torch.Tensor  # (B or 1, Tq)
    key_positions: torch.Tensor  # (B or 1, Tk), past and present keys
    key_valid: torch.Tensor | None  # (B, Tk) bool, False for padding
    causal_only: bool
    positions_are_indices: bool = False  # query t (of every row) is at position t: no position_ids, no past
    implementation: str = "sdpa"

    def visibility(self, query_positions=None, key_positions=None, key_valid="same") -> torch.Tensor:
        """Boolean (B, 1, Tq, Tk) mask: a key is visible when it is real and not after the query."""
        query_positions = self.query_positions if query_positions is None else query_positions
        key_positions = self.key_positions if key_positions is None else key_positions
        key_valid = self.key_valid if isinstance(key_valid, str) else key_valid
        visible = key_positions[:, None, :] <= query_positions[:, :, None]
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
    """The fused Triton kernel (`hf_knowgpt.fused_attention`: bf16 in and out, computed as in fp32) where
    it applies: causal bf16 self-attention without a padding mask over at most 128 positions on a CUDA
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
    even, odd = states[..., 0::2].float(), states[..., 1::2].float()
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(states.dtype)


def split_heads(states: torch.Tensor, n_head: int) -> torch.Tensor:
    batch, length, width = states.shape
    return states.view(batch, length, n_head, width // n_head).transpose(1, 2)


def merge_heads(states: torch.Tensor) -> torch.Tensor:
    batch, n_head, length, head_dim = states.shape
    return states.transpose(1, 2).reshape(batch, length, n_head * head_dim)


def project(hidden_states: torch.Tensor, layers, place=None) -> list[torch.Tensor]:
    """Several Linear layers of one input, each output passed through `place` (say, into the (B, T) grid).
    Plain ones run as one product of their concatenated weights (one kernel instead of several, forward and
    backward, and one `place`); layers that are replaced or hooked (adapters) run as the modules they are."""
    place = place or (lambda states: states)
    plain = all(
        type(layer) is nn.Linear and layer.bias is not None and not (layer._forward_hooks or layer._forward_pre_hooks)
        for layer in layers
    )
    if not plain:
        return [place(layer(hidden_states)) for layer in layers]
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers])
    projected = place(F.linear(hidden_states, weight, bias))
    return list(projected.split([layer.out_features for layer in layers], dim=-1))


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


class KnowGPTMLP(nn.Module):
    def __init__(self, config: KnowGPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        return self.dropout(self.proj(self.act(self.fc(hidden_states))))


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
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _project(self, hidden_states, grid: TokenGrid, in_grid: bool):
        """Queries, keys and values per token and head: (…, H, D), in the (B, T) grid when `in_grid`,
        else as `hidden_states` come (packed tokens stay packed)."""
        projected = project(hidden_states, (self.query, self.key, self.value), grid.to_grid if in_grid else None)
        return [states.unflatten(-1, (self.n_head, self.head_dim)) for states in projected]

    def _packed_kernel_applies(self, grid: TokenGrid, context: AttentionContext, cache) -> bool:
        return reads_packed_tokens(grid, context, cache, by_position=self.rotary)

    def forward(self, hidden_states, grid: TokenGrid, context: AttentionContext, cache: Cache | None):
        """(output, attention weights (B, H, T, past + T) or None when the implementation has none)."""
        packed_kernel = self._packed_kernel_applies(grid, context, cache)
        query, key, value = self._project(hidden_states, grid, in_grid=not packed_kernel)
        scale = 1.0 / math.sqrt(self.head_dim)
        dropout_p = self.config.attn_pdrop if self.training else 0.0
        if packed_kernel and supports_fused_attention(query, key, value, None, True, seq_len=grid.seq_len):
            rotary = None
            if self.rotary:  # the kernel rotates queries and keys itself, by their index in the row
                indices = torch.arange(grid.seq_len, device=query.device)
                rotary = rotary_angles(indices, self.head_dim, self.config.rope_theta)
            attended = fused_causal_attention(
                query, key, value, scale, dropout_p,
                lengths=grid.row_lengths, starts=grid.row_starts, seq_len=grid.seq_len, rotary=rotary,
            )  # fmt: skip
            return self.resid_dropout(self.proj(attended.flatten(-2))), None
        if packed_kernel:  # the kernel does not take these tensors after all: through the grid as usual
            query, key, value = (grid.to_grid(states) for states in (query, key, value))
        if self.rotary:
            cos, sin = rotary_angles(context.query_positions, self.head_dim, self.config.rope_theta)
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B or 1, T, 1, D/2): the heads axis
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        query, key, value = (states.transpose(1, 2) for states in (query, key, value))  # (B, H, T, D)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        mask = None if context.causal_only else additive_mask(context.visibility(), query.dtype)
        attended, weights = attention_function(self.config, context.implementation)(
            query,
            key,
            value,
            mask,
            scale=scale,
            dropout_p=dropout_p,
            is_causal=context.causal_only,
            lengths=grid.row_lengths,
        )
        return self.resid_dropout(self.proj(grid.from_grid(merge_heads(attended)))), weights


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
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

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
                return self.resid_dropout(self.proj(attended.flatten(-2))), None
            features, value = (grid.to_grid(states.flatten(-2)) for states in (features, value))
        features, value = split_heads(features, self.n_head), split_heads(value, self.n_head)
        # The new tokens' synthesized keys, cached like ordinary keys: column t of B for position t.
        key = self.w2.t()[context.query_positions][:, None].to(value.dtype)
        key = key.expand(value.shape[0], 1, -1, -1)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        key = key.expand(value.shape[0], self.n_head, -1, -1)
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
        return self.resid_dropout(self.proj(grid.from_grid(merge_heads(attended)))), weights


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
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

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


class KnowGPTBlock(GradientCheckpointingLayer):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). Returns (states, attention
    weights or None)."""

    def __init__(self, config: KnowGPTConfig, layer_idx: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if config.attention_type == "synthesizer":
            self.attn = KnowGPTSynthesizerAttention(config, layer_idx)
        else:
            self.attn = KnowGPTSelfAttention(config, layer_idx, rotary=config.attention_type == "rope")
        self.ln2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = KnowGPTMLP(config)

    def forward(self, hidden_states, grid, context, cache=None):
        attended, weights = self.attn(self.ln1(hidden_states), grid, context, cache)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.ln2(hidden_states)), weights


class KnowGPTPerceiverDownBlock(GradientCheckpointingLayer):
    """The basis C (bottleneck_dim × n_embd) cross-attends to the embedded input; latent j sees inputs up to position j.

    Following the 2023 handout's hints, the LayerNorm goes on C (the queries) and on the MLP input. Returns
    (latents, attention weights (B, H, bottleneck_dim, T) or None).
    """

    def __init__(self, config: KnowGPTConfig):
        super().__init__()
        self.C = nn.Parameter(torch.empty(1, config.bottleneck_dim, config.n_embd))
        self.ln1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = KnowGPTCrossAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = KnowGPTMLP(config)

    def forward(self, input_key, input_value, visible, implementation="sdpa"):
        basis = self.C.expand(input_key.shape[0], -1, -1)
        attended, weights = self.attn(self.ln1(basis), input_key, input_value, visible, implementation)
        latents = basis + attended
        return latents + self.mlp(self.ln2(latents)), weights


class KnowGPTPerceiverUpBlock(GradientCheckpointingLayer):
    """The embedded input cross-attends to the bottleneck output; position t sees latents up to t.

    Following the 2023 handout's hints, the LayerNorm goes on the latents (keys and values) and on the MLP
    input. Returns (states, attention weights (B, H, T, bottleneck_dim) or None).
    """

    def __init__(self, config: KnowGPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = KnowGPTCrossAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = KnowGPTMLP(config)

    def forward(self, input_states, latents, grid: TokenGrid, visible, implementation="sdpa"):
        key, value = self.attn.project_context(self.ln1(latents))
        attended, weights = self.attn(grid.to_grid(input_states), key, value, visible, implementation)
        hidden_states = input_states + grid.from_grid(attended)
        return hidden_states + self.mlp(self.ln2(hidden_states)), weights


class KnowGPTPreTrainedModel(PreTrainedModel):
    config_class = KnowGPTConfig
    config: KnowGPTConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KnowGPTBlock", "KnowGPTPerceiverDownBlock", "KnowGPTPerceiverUpBlock"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = False

    def set_attn_implementation(self, attn_implementation: str, **kwargs):
        """Switch between fused ("sdpa"), unfused handout-style ("eager") and, for bf16 training on a GPU,
        the fused Triton kernel with SDPA elsewhere ("triton"; see `triton_attention`)."""
        if attn_implementation not in ATTENTION_FUNCTIONS:
            raise ValueError(
                f"KnowGPT supports attn_implementation in {sorted(ATTENTION_FUNCTIONS)}, got {attn_implementation!r}"
            )
        self.config._attn_implementation = attn_implementation

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Name both heads in auto_map, so either Auto class loads any checkpoint with trust_remote_code.
        self.config.auto_map = {
            **(getattr(self.config, "auto_map", None) or {}),
            "AutoModel": "modeling_knowgpt.KnowGPTModel",
            "AutoModelForCausalLM": "modeling_knowgpt.KnowGPTForCausalLM",
        }
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module):
        """The handouts' init: N(0, 0.02) weights, zero biases, unit LayerNorms; zero position embedding
        (minGPT's `pos_emb` starts at zeros); the synthesizer's B ~ U(-0.001, 0.001); the perceiver's C Xavier."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if module is getattr(self.base_model, "pos_emb", None):
                init.zeros_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, KnowGPTSynthesizerAttention):
            init.uniform_(module.w2, -0.001, 0.001)
            init.zeros_(module.b2)
        elif isinstance(module, KnowGPTPerceiverDownBlock):
            init.xavier_uniform_(module.C)


class KnowGPTModel(KnowGPTPreTrainedModel):
    """The KnowGPT backbone: embeddings, blocks and final LayerNorm; returns the last hidden states."""

    def __init__(self, config: KnowGPTConfig):
        super().__init__(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = None if config.attention_type == "rope" else nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        if config.attention_type == "perceiver":
            self.down_block = KnowGPTPerceiverDownBlock(config)
            self.blocks = nn.ModuleList(KnowGPTBlock(config, i) for i in range(config.n_layer - 2))
            self.up_block = KnowGPTPerceiverUpBlock(config)
        else:
            self.blocks = nn.ModuleList(KnowGPTBlock(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_emb

    def set_input_embeddings(self, value):
        self.tok_emb = value

    @_deprecated_cache_keyword
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        token_index: torch.LongTensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        output_attentions (`bool`, *optional*, defaults to `config.output_attentions`):
            Return each layer's attention probabilities (after dropout), computed with the eager implementation
            for this call when the model runs another one (the fused kernels keep no weights). Vanilla and rope:
            n_layer tensors (B, n_head, T, past + T); synthesizer: its softmax weights, the same shapes. The
            perceiver's n_layer tensors are, in order: the down-projection's cross-attention of the
            bottleneck_dim latents over the input (B, n_head, bottleneck_dim, past + T), the n_layer - 2
            latent self-attentions (B, n_head, bottleneck_dim, bottleneck_dim), and the up-projection's
            cross-attention of the input over the latents (B, n_head, T, bottleneck_dim).
        output_hidden_states (`bool`, *optional*, defaults to `config.output_hidden_states`):
            Return n_layer + 1 hidden states: the embeddings, then each block's output (the last after the
            final LayerNorm). For the perceiver: the embeddings (T positions), the down-projection's output
            and each latent block's (bottleneck_dim positions each), then the up-projection's (T positions).
        token_index (`torch.LongTensor` of shape `(num_tokens,)`, *optional*):
            Flat indices (b·T + t) of the positions to compute, a prefix of each row; the others are right
            padding and are skipped. Hidden states then come back packed, shaped (num_tokens, n_embd).
            Training-only: it cannot be combined with a cache or an attention mask.
        """
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = getattr(config, "return_dict", True) if return_dict is None else return_dict
        if past_key_values is not None and cache is not None:
            raise ValueError("pass the KV cache once: as `cache` (or, on older transformers, `past_key_values`)")
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("KnowGPTModel.forward needs exactly one of input_ids or inputs_embeds")
        batch_size, seq_len = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if use_cache is None:
            use_cache = config.use_cache and token_index is None
        if token_index is not None and (use_cache or cache is not None or attention_mask is not None):
            raise ValueError("token_index (packed training) cannot be combined with a cache or an attention_mask")
        if use_cache and cache is None:
            cache = DynamicCache()
        past_length = cache.get_seq_length() if cache is not None else 0
        if past_length + seq_len > config.block_size:
            raise ValueError(
                f"KnowGPT sees at most block_size={config.block_size} positions, got "
                f"{past_length} cached + {seq_len} new"
            )

        implementation = config._attn_implementation or "sdpa"
        if output_attentions and implementation != "eager":
            logger.warning_once(
                f"KnowGPT: output_attentions=True runs attention with the eager implementation for these calls: "
                f"the {implementation!r} kernels keep no attention weights."
            )
            implementation = "eager"
        context = self._attention_context(batch_size, seq_len, past_length, attention_mask, position_ids)
        context.implementation = implementation
        grid = TokenGrid(batch_size, seq_len, token_index)
        if inputs_embeds is None:
            inputs_embeds = self.tok_emb(grid.from_grid(input_ids))
        else:
            inputs_embeds = grid.from_grid(inputs_embeds)
        hidden_states = inputs_embeds
        if self.pos_emb is not None:
            positions = context.query_positions.expand(batch_size, seq_len)
            hidden_states = hidden_states + self.pos_emb(grid.from_grid(positions))
        embeddings = hidden_states = self.drop(hidden_states)

        if config.attention_type == "perceiver":
            hidden_states, states, attentions = self._perceiver_forward(hidden_states, grid, context, cache)
        else:
            states, attentions = [], []
            for block in self.blocks:
                hidden_states, weights = block(hidden_states, grid, context, cache=cache)
                states.append(hidden_states)
                attentions.append(weights)
        hidden_states = self.ln_f(hidden_states)

        output = _with_cache(
            BaseModelOutputWithPast,
            cache if use_cache else None,
            last_hidden_state=hidden_states,
            hidden_states=(embeddings, *states[:-1], hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()

    def _attention_context(self, batch_size, seq_len, past_length, attention_mask, position_ids):
        device = self.tok_emb.weight.device
        if attention_mask is None:
            key_positions = torch.arange(past_length + seq_len, device=device)[None]
            query_positions = position_ids if position_ids is not None else key_positions[:, past_length:]
            if past_length == 0:
                key_positions = query_positions
            return AttentionContext(
                query_positions,
                key_positions,
                None,
                causal_only=past_length == 0,
                positions_are_indices=past_length == 0 and position_ids is None,
            )
        if attention_mask.dim() != 2 or attention_mask.shape != (batch_size, past_length + seq_len):
            raise ValueError(
                "attention_mask must be 2-D (batch, cached + new positions) = "
                f"{(batch_size, past_length + seq_len)}, got {tuple(attention_mask.shape)}"
            )
        key_valid = attention_mask.bool()
        key_positions = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        query_positions = position_ids if position_ids is not None else key_positions[:, past_length:]
        return AttentionContext(query_positions, key_positions, key_valid, causal_only=False)

    def _perceiver_forward(self, input_states, grid, context, cache):
        """Down-project, run the latent blocks, up-project: (output, each block's output, each block's
        attention weights or None).

        With a cache, only the down-projection's keys and values of the input are stored (layer 0): the
        bottleneck is recomputed from them at each step, which keeps it exact under any padding.
        """
        down, up = self.down_block, self.up_block
        input_key, input_value = down.attn.project_context(grid.to_grid(input_states))
        if cache is not None:
            input_key, input_value = cache.update(input_key, input_value, 0)
        n_latents = self.config.bottleneck_dim
        latent_positions = torch.arange(n_latents, device=input_states.device)[None]
        down_visible = context.visibility(query_positions=latent_positions)
        latents, weights = down(input_key, input_value, down_visible, implementation=context.implementation)
        states, attentions = [latents], [weights]
        latent_context = AttentionContext(
            latent_positions, latent_positions, None, causal_only=True, implementation=context.implementation
        )
        latent_grid = TokenGrid(latents.shape[0], n_latents)
        for block in self.blocks:
            latents, weights = block(latents, latent_grid, latent_context)
            states.append(latents)
            attentions.append(weights)
        query_visible = context.visibility(key_positions=latent_positions, key_valid=None)
        hidden_states, weights = up(input_states, latents, grid, query_visible, implementation=context.implementation)
        return hidden_states, [*states, hidden_states], [*attentions, weights]


class KnowGPTForCausalLM(KnowGPTPreTrainedModel, GenerationMixin):
    """KnowGPT with its language-model head; the loss follows transformers' convention (labels aligned
    with input_ids, shifted inside, -100 ignored), which is the handouts' (x, y) loss exactly."""

    _tied_weights_keys = {}

    def __init__(self, config: KnowGPTConfig):
        super().__init__(config)
        self.transformer = KnowGPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.tok_emb

    def set_input_embeddings(self, value):
        self.transformer.tok_emb = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @_deprecated_cache_keyword
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        token_index: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets aligned with `input_ids` (shifted inside the model); -100 is ignored.
        shift_labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets already shifted (position t predicts shift_labels[t]), as transformers' causal-LM loss takes
            them; used instead of `labels` when given.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            The loss is the sum over targets divided by this (the batch's trained targets over all processes and
            accumulation steps) instead of the mean, as in transformers' causal-LM loss.
        token_index (`torch.LongTensor` of shape `(num_tokens,)`, *optional*):
            See `KnowGPTModel.forward`: compute only these positions; logits come back packed, shaped
            (num_tokens, vocab_size), and the loss is the same as the dense loss.
        output_attentions, output_hidden_states: see `KnowGPTModel.forward`.
        """
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        outputs = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            token_index=token_index,
            **{_CACHE_FIELD: cache if cache is not None else past_key_values},
        )
        hidden_states = outputs.last_hidden_state
        if token_index is None and logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None or shift_labels is not None:
            # Position t predicts labels[t + 1]; the last position has no target.
            targets = shift_labels if shift_labels is not None else F.pad(labels[:, 1:], (0, 1), value=-100)
            if token_index is not None:
                targets = targets.reshape(-1).index_select(0, token_index)
            elif logits_to_keep:
                targets = targets[:, -logits_to_keep:]
            loss = causal_lm_loss(logits, targets, num_items_in_batch)

        output = _with_cache(
            CausalLMOutputWithPast,
            getattr(outputs, _CACHE_FIELD),
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


def causal_lm_loss(logits, targets, num_items_in_batch=None):
    """Mean cross-entropy over targets that are not -100, or their sum over `num_items_in_batch` when given
    (transformers' causal-LM loss)."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=-100)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items_in_batch


# Saved checkpoints get this code beside the weights and an auto_map pointing at it.
KnowGPTModel.register_for_auto_class("AutoModel")
KnowGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["KnowGPTModel", "KnowGPTForCausalLM", "KnowGPTPreTrainedModel", "TokenGrid"]
