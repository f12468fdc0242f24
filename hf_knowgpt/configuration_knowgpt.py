"""KnowGPT configuration: the CS224N minGPT fork's hyperparameters as a `PreTrainedConfig`."""

from transformers import PretrainedConfig

from .options import ATTENTION_KERNEL_DTYPES, ATTENTION_TYPES


class KnowGPTConfig(PretrainedConfig):
    r"""
    Configuration of a character-level KnowGPT model (the CS224N "Self-Attention, Transformers, and
    Pretraining" GPT). Defaults are the handouts' model: 4 layers, 8 heads, width 256, 128 positions.

    Args:
        vocab_size (`int`): number of character ids, pad and mask included (257 for `wiki.txt`: the
            handouts' 256 ids plus one unknown-character id).
        block_size (`int`): the most positions a sequence may have (the handouts' `block_size`).
        n_layer (`int`), n_head (`int`), n_embd (`int`): depth, attention heads, width.
        embd_pdrop, resid_pdrop, attn_pdrop (`float`): dropout on embeddings, residual branches, attention.
        attention_type (`str`): one of "vanilla", "rope", "synthesizer", "perceiver".
        bottleneck_dim (`int`): number of latent positions of the perceiver's bottleneck.
        rope_theta (`float`): base of the rotary frequencies, theta_i = rope_theta^(-2(i-1)/d_head).
        initializer_range (`float`): standard deviation of the N(0, sigma) weight init.
        layer_norm_epsilon (`float`): LayerNorm epsilon (PyTorch's default, as the handouts use).
        attention_kernel_dtype (`str` or `None`): the precision of the attention kernel (scores, softmax,
            dropout, weighted sum) when the projections run in half precision (bf16/fp16 autocast or a
            half-precision model): "float32" (default), "float16", "bfloat16" or None (the inputs' own).
            With the kernel in bf16 or fp16 the handouts' recipe diverges in bf16 at its learning rate of
            6e-3; in fp32 it trains like fp32 (benchmarks/diagnostics/precision_study.py). Nothing changes in fp32.
        residual_in_fp32 (`bool`): True (default): the residual stream (the embeddings' sum and each block's
            output) keeps the embeddings' dtype, fp32 under bf16/fp16 autocast too, as autocast leaves it. False:
            under autocast the stream runs in autocast's dtype, which halves the bytes of the LayerNorms, residual
            sums and dropouts that read and write it; the LayerNorms still compute in fp32. Nothing changes
            without autocast.
        recitation_length (`int`): 0 (default): a question is answered at once, `question⁇answer⁇`. Above 0
            the model first recites what it read about the person, up to this many characters of their
            document, and answers after it: `question⁇recitation⁇answer⁇` (the birthplace-qa pipeline and
            evaluation return the answer, and the recitation beside it).
        future_tokens (`int`): 0 (default): one language-model head. Above 0, as many further linear heads on
            the last hidden state, head j predicting the token `1 + j·future_token_spacing` positions ahead
            (multi-token prediction): in training, the mean of their cross-entropies joins the loss, so each
            position must carry what follows it further on. Generation and evaluation use `lm_head` alone.
        future_token_spacing (`int`): positions between the offsets the further heads predict (1: the 2nd,
            3rd, ... token ahead).
        pad_token_id, mask_token_id, unk_token_id (`int`): ids of "□", "⁇" and the unknown character.
        eos_token_id (`int`): "⁇" (1), which closes every answer (`question⁇answer⁇`), so generation stops
            after the answer; the generation config takes it from here.
    """

    model_type = "knowgpt"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "max_position_embeddings": "block_size",
    }

    vocab_size: int = 257
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    attention_type: str = "vanilla"
    bottleneck_dim: int | None = 32
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    attention_kernel_dtype: str | None = "float32"
    residual_in_fp32: bool = True
    recitation_length: int = 0
    future_tokens: int = 0
    future_token_spacing: int = 1
    use_cache: bool = True
    pad_token_id: int | None = 0
    mask_token_id: int | None = 1
    unk_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = 1
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        self._validate_knowgpt_fields()
        super().__post_init__(**kwargs)

    def _validate_knowgpt_fields(self):
        def require_int(name, minimum):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"KnowGPTConfig.{name} must be an integer >= {minimum}, got {value!r}")

        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            require_int(name, 1)
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"KnowGPTConfig.{name} must be a probability in [0, 1), got {value!r}")
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(
                f"KnowGPTConfig.attention_type must be one of {list(ATTENTION_TYPES)}, got {self.attention_type!r}"
            )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"KnowGPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"allowed n_head values for this width: {[h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]}"
            )
        head_dim = self.n_embd // self.n_head
        if self.attention_type == "rope" and head_dim % 2 != 0:
            raise ValueError(
                f"KnowGPTConfig: attention_type 'rope' rotates pairs of features, so the head size "
                f"n_embd / n_head must be even, got {self.n_embd} / {self.n_head} = {head_dim}"
            )
        if self.attention_kernel_dtype not in ATTENTION_KERNEL_DTYPES:
            raise ValueError(
                f"KnowGPTConfig.attention_kernel_dtype must be one of {list(ATTENTION_KERNEL_DTYPES)}, "
                f"got {self.attention_kernel_dtype!r}"
            )
        if not isinstance(self.residual_in_fp32, bool):
            raise ValueError(f"KnowGPTConfig.residual_in_fp32 must be true or false, got {self.residual_in_fp32!r}")
        if (
            isinstance(self.recitation_length, bool)
            or not isinstance(self.recitation_length, int)
            or not 0 <= self.recitation_length < self.block_size
        ):
            raise ValueError(
                f"KnowGPTConfig.recitation_length must be an integer in 0..block_size-1={self.block_size - 1}, "
                f"got {self.recitation_length!r}"
            )
        for name, minimum in (("future_tokens", 0), ("future_token_spacing", 1)):
            require_int(name, minimum)
        if 1 + self.future_tokens * self.future_token_spacing >= self.block_size:
            raise ValueError(
                f"KnowGPTConfig: the furthest future-token head predicts 1 + future_tokens · future_token_spacing = "
                f"{1 + self.future_tokens * self.future_token_spacing} positions ahead, which a block of "
                f"{self.block_size} positions never holds"
            )
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 1:
            raise ValueError(f"KnowGPTConfig.rope_theta must be a number > 1, got {self.rope_theta!r}")
        if self.attention_type == "perceiver":
            if self.bottleneck_dim is None:
                raise ValueError(
                    "KnowGPTConfig.bottleneck_dim is required with attention_type 'perceiver' "
                    f"(an integer in 1..block_size={self.block_size})"
                )
            if isinstance(self.bottleneck_dim, bool) or not isinstance(self.bottleneck_dim, int):
                raise ValueError(f"KnowGPTConfig.bottleneck_dim must be an integer, got {self.bottleneck_dim!r}")
            if not 1 <= self.bottleneck_dim <= self.block_size:
                raise ValueError(
                    f"KnowGPTConfig.bottleneck_dim must be in 1..block_size={self.block_size} "
                    f"for attention_type 'perceiver', got {self.bottleneck_dim}"
                )
            if self.n_layer < 2:
                raise ValueError(
                    "KnowGPTConfig.n_layer must be >= 2 for attention_type 'perceiver' (a down-projection "
                    f"and an up-projection block around n_layer - 2 latent blocks), got {self.n_layer}"
                )
        for name in ("pad_token_id", "mask_token_id", "unk_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(
                    f"KnowGPTConfig.{name} must be None or an id in 0..vocab_size-1={self.vocab_size - 1}, got {value!r}"
                )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Saved configs name their class in auto_map, so trust_remote_code loads them without this package.
KnowGPTConfig.register_for_auto_class()

__all__ = ["KnowGPTConfig", "ATTENTION_TYPES"]
