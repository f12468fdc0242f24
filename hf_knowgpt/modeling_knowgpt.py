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

Here: the MLP, the blocks (the perceiver's two cross-attention blocks included), and the 🤗 classes
(`KnowGPTPreTrainedModel`, the `KnowGPTModel` backbone, `KnowGPTForCausalLM`). How attention is computed,
the four types' attention layers and the registry of attention implementations, is in `attention_knowgpt`.
Masks follow the tokens' order (a key is visible when it comes no later than the query and is not
padding; `position_ids` only place tokens), built by one helper, so left-padded batches and the KV cache
give the same tokens as unpadded, uncached calls.
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .attention_knowgpt import (
    ATTENTION_FUNCTIONS,
    AttentionContext,
    KnowGPTCrossAttention,
    KnowGPTSelfAttention,
    KnowGPTSynthesizerAttention,
    TokenGrid,
)
from .configuration_knowgpt import KnowGPTConfig
from .layers_knowgpt import (
    KnowGPTDropout,
    KnowGPTEmbedding,
    autocast_dtype,
    causal_lm_loss,
    mlp,
    residual_dropout_masks,
    residual_layer_norm,
)

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


class KnowGPTMLP(nn.Module):
    def __init__(self, config: KnowGPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = KnowGPTDropout(config.resid_pdrop)

    def forward(self, hidden_states, dropout_masks=None):
        return self.dropout(self.branch(hidden_states), dropout_masks)

    def branch(self, hidden_states, leave_proj_bias_out: bool = False):
        """The MLP before its dropout; `leave_proj_bias_out`: see `layers_knowgpt.branch_bias`. (A fused bias + GELU
        kernel after a bias-free fc was slower than GELU alone: benchmarks/bench_fused_layers.py.)"""
        return mlp(hidden_states, self.fc, self.act, self.proj, leave_proj_bias_out)


class KnowGPTBlock(GradientCheckpointingLayer):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). Returns (states, weights or None)."""

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
        return hidden_states + self.mlp(self.ln2(hidden_states), context.dropout_masks), weights

    def forward_fused(self, hidden_states, normalized, norm_after: nn.LayerNorm, grid, context, cache=None):
        """forward() in training with the fused kernels (`KnowGPTModel.fused_layers`), given ln1(hidden_states)
        as `normalized`: each residual sum runs with its branch's dropout and the LayerNorm after it (ln2, then
        `norm_after`: the next block's ln1 or the final LayerNorm) in one kernel. Returns (the block's output,
        norm_after of it, attention weights or None). The kernel also adds the branches' last biases."""
        attended, weights = self.attn(normalized, grid, context, cache)
        dropout_p = self.attn.resid_dropout.p
        hidden_states, normalized = residual_layer_norm(hidden_states, attended, self.attn.proj, self.ln2, dropout_p)
        branch = self.mlp.branch(normalized, leave_proj_bias_out=True)
        dropout_p = self.mlp.dropout.p
        hidden_states, normalized = residual_layer_norm(hidden_states, branch, self.mlp.proj, norm_after, dropout_p)
        return hidden_states, normalized, weights


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

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """The attention implementations KnowGPT runs: fused ("sdpa", the default), unfused handout-style
        ("eager") and, for bf16 training on a GPU, the fused Triton kernel with SDPA elsewhere ("triton"; see
        `triton_attention`). transformers asks this wherever an implementation is chosen (the config,
        `from_pretrained(attn_implementation=...)`, `set_attn_implementation`), so all of them take these three
        and refuse the rest with transformers' own message."""
        requested = "sdpa" if requested_attention is None else requested_attention
        if requested not in ATTENTION_FUNCTIONS:
            choices = ", ".join(f'`attn_implementation="{name}"`' for name in sorted(ATTENTION_FUNCTIONS))
            raise ValueError(
                f'Specified `attn_implementation="{requested}"` is not supported. The only possible arguments are '
                f"{choices}."
            )
        return requested

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
    """The KnowGPT backbone: embeddings, blocks and final LayerNorm; returns the last hidden states.

    `fused_layers` (off unless set; the trainer sets it under `--fused_layers` on a GPU with Triton): in
    training without gradient checkpointing, every residual sum (the attention's and the MLP's of each block)
    runs with its branch's dropout, the bias of the branch's last layer and the LayerNorm that follows it (ln2,
    the next block's ln1, ln_f) as one Triton kernel each way (`hf_knowgpt.kernels.fused_layers`,
    `KnowGPTBlock.forward_fused`); under autocast the LayerNorms' outputs, the last hidden state included, come
    in autocast's dtype.

    `attention_by_length` (off unless set; the trainer sets it for training on a CPU, whose packed batches it
    orders longest first): packed causal self-attention runs group by group of rows, each group only as
    wide as its longest row (`TokenGrid.length_groups`). It reads the rows' lengths on the host, which a
    captured CUDA graph must never do.
    """

    fused_layers = False
    attention_by_length = False

    def __init__(self, config: KnowGPTConfig):
        super().__init__(config)
        self.tok_emb = KnowGPTEmbedding(config.vocab_size, config.n_embd)
        self.pos_emb = None if config.attention_type == "rope" else KnowGPTEmbedding(config.block_size, config.n_embd)
        self.drop = KnowGPTDropout(config.embd_pdrop)
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
        given = input_ids if input_ids is not None else inputs_embeds
        batch_size, seq_len = given.shape[:2]
        if use_cache is None:
            use_cache = config.use_cache and token_index is None
        if token_index is not None and (use_cache or cache is not None or attention_mask is not None):
            raise ValueError("token_index (packed training) cannot be combined with a cache or an attention_mask")
        if use_cache and cache is None:
            cache = DynamicCache()
        if getattr(cache, "is_compileable", False):  # StaticCache and its kin: buffers of a fixed length
            raise ValueError(f"KnowGPT runs with a cache that grows (DynamicCache, generate's default), not "
                             f"{type(cache).__name__}: leave out cache_implementation='static'")  # fmt: skip
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
        context = self._attention_context(given.device, batch_size, seq_len, past_length, attention_mask, position_ids)
        context.implementation = implementation
        # no block recomputed: forward_fused does not checkpoint, and masks drawn together would be drawn again
        stream_training = self.training and config.attention_type != "perceiver"
        stream_training = stream_training and not any(block.gradient_checkpointing for block in self.blocks)
        context.fused_layers = self.fused_layers and stream_training
        context.by_length = self.attention_by_length
        grid = TokenGrid(batch_size, seq_len, token_index)
        if inputs_embeds is None:
            inputs_embeds = self.tok_emb(grid.from_grid(input_ids))
        else:
            inputs_embeds = grid.from_grid(inputs_embeds)
        hidden_states = inputs_embeds
        if self.pos_emb is not None:
            positions = context.query_positions.expand(batch_size, seq_len)
            hidden_states = hidden_states + self.pos_emb(grid.from_grid(positions))
        hidden_states = self._in_stream_dtype(hidden_states)
        if stream_training and not context.fused_layers:
            branches = (dropout for block in self.blocks for dropout in (block.attn.resid_dropout, block.mlp.dropout))
            context.dropout_masks = residual_dropout_masks([self.drop, *branches], hidden_states)
        embeddings = hidden_states = self.drop(hidden_states, context.dropout_masks)

        if config.attention_type == "perceiver":
            hidden_states, states, attentions = self._perceiver_forward(hidden_states, grid, context, cache)
        else:
            states, attentions = [], []
            normalized = self.blocks[0].ln1(hidden_states) if context.fused_layers else None
            for block, norm_after in zip(self.blocks, [*(block.ln1 for block in self.blocks[1:]), self.ln_f]):
                if context.fused_layers:  # the next LayerNorm comes with the residual sum: forward_fused
                    hidden_states, normalized, weights = block.forward_fused(
                        hidden_states, normalized, norm_after, grid, context, cache=cache
                    )
                else:
                    hidden_states, weights = block(hidden_states, grid, context, cache=cache)
                states.append(hidden_states)
                attentions.append(weights)
        hidden_states = normalized if context.fused_layers else self.ln_f(hidden_states)

        output = _with_cache(
            BaseModelOutputWithPast,
            cache if use_cache else None,
            last_hidden_state=hidden_states,
            hidden_states=(embeddings, *states[:-1], hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()

    def _in_stream_dtype(self, states: torch.Tensor) -> torch.Tensor:
        """`states` as the residual stream carries them: in autocast's dtype where it is on and the config's
        `residual_in_fp32` is off, else as they are."""
        dtype = autocast_dtype(states)
        return states if self.config.residual_in_fp32 or dtype is None else states.to(dtype)

    def _attention_context(self, device, batch_size, seq_len, past_length, attention_mask, position_ids):
        """Each token's order (its index among its row's real tokens: what a key's visibility follows) and
        position (what encodes it: `position_ids` for the new tokens where given, else the order), on the
        inputs' device: with weights offloaded (`device_map`), the embedding's own weight may not be there."""
        key_valid = None
        if attention_mask is None:
            key_order = torch.arange(past_length + seq_len, device=device)[None]
        elif attention_mask.dim() != 2 or attention_mask.shape != (batch_size, past_length + seq_len):
            raise ValueError(f"attention_mask must be 2-D (batch, cached + new positions) = "
                             f"{(batch_size, past_length + seq_len)}, got {tuple(attention_mask.shape)}")  # fmt: skip
        else:
            key_valid = attention_mask.bool()
            key_order = (key_valid.long().cumsum(-1) - 1).clamp(min=0)
        query_order = key_order[:, past_length:]
        query_positions, key_positions = query_order, key_order
        if position_ids is not None:
            query_positions = position_ids
            rows = max(key_order.shape[0], position_ids.shape[0])
            key_positions = torch.cat([key_order[:, :past_length].expand(rows, -1), position_ids.expand(rows, -1)], 1)
        plain = attention_mask is None and past_length == 0
        return AttentionContext(
            query_positions, key_positions, key_valid, causal_only=plain,
            positions_are_indices=plain and position_ids is None, query_order=query_order, key_order=key_order,
        )  # fmt: skip

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
        down_visible = context.visibility(query_order=latent_positions)
        latents, weights = down(input_key, input_value, down_visible, implementation=context.implementation)
        latents = self._in_stream_dtype(latents)
        states, attentions = [latents], [weights]
        latent_context = AttentionContext(
            latent_positions, latent_positions, None, causal_only=True, implementation=context.implementation
        )
        latent_grid = TokenGrid(latents.shape[0], n_latents)
        for block in self.blocks:
            latents, weights = block(latents, latent_grid, latent_context)
            states.append(latents)
            attentions.append(weights)
        query_visible = context.visibility(key_order=latent_positions, key_valid=None)
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
        # Multi-token prediction (`config.future_tokens`): heads for tokens further ahead, trained, never sampled.
        self.future_heads = nn.ModuleList(
            nn.Linear(config.n_embd, config.vocab_size, bias=False) for _ in range(config.future_tokens)
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.tok_emb

    def set_input_embeddings(self, value):
        self.transformer.tok_emb = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' resize, and the further heads (`config.future_tokens`) resized as `lm_head` is: they
        predict the same vocabulary."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        for index, head in enumerate(self.future_heads):
            self.future_heads[index] = self._get_resized_lm_head(
                head, embeddings.num_embeddings, mean_resizing=mean_resizing
            )
        return embeddings

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
            next_targets = shift_labels if shift_labels is not None else F.pad(labels[:, 1:], (0, 1), value=-100)
            targets = next_targets
            if token_index is not None:
                targets = targets.reshape(-1).index_select(0, token_index)
            elif logits_to_keep:
                targets = targets[:, -logits_to_keep:]
            loss = causal_lm_loss(logits, targets, num_items_in_batch)
            if self.training and len(self.future_heads) and not (token_index is None and logits_to_keep):
                normalizer = num_items_in_batch
                if normalizer is None:  # the next-token loss's count (its mean), at least 1
                    normalizer = (targets != -100).sum().clamp(min=1)
                loss = loss + self._future_token_loss(hidden_states, next_targets, token_index, normalizer)

        output = _with_cache(
            CausalLMOutputWithPast,
            getattr(outputs, _CACHE_FIELD),
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()

    def _future_token_loss(self, hidden_states, next_targets, token_index, normalizer):
        """The further heads' mean cross-entropy, each summed over its targets and divided by `normalizer` (the
        next-token loss's count, so that both weigh a target alike). `next_targets` (B, T): the token after each
        position; head j's target at t is the one `j · future_token_spacing` positions after that, within
        the row (-100 past its end)."""
        losses = []
        for number, head in enumerate(self.future_heads, start=1):
            further = number * self.config.future_token_spacing
            targets = F.pad(next_targets[:, further:], (0, further), value=-100)
            if token_index is not None:
                targets = targets.reshape(-1).index_select(0, token_index)
            losses.append(causal_lm_loss(head(hidden_states), targets, normalizer))
        return torch.stack(losses).mean()


# Saved checkpoints get this code beside the weights and an auto_map pointing at it.
KnowGPTModel.register_for_auto_class("AutoModel")
KnowGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["KnowGPTEmbedding", "KnowGPTForCausalLM", "KnowGPTModel", "KnowGPTPreTrainedModel"]
