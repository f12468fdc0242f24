"""The values that configuration fields and command-line flags accept, in a module that imports nothing
heavy: the scripts build their `--help` from it without loading torch or transformers."""

ATTENTION_TYPES = ("vanilla", "rope", "synthesizer", "perceiver")
ATTENTION_KERNEL_DTYPES = ("float32", "float16", "bfloat16", None)
TRAINING_PATHS = ("auto", "graphed", "eager", "plain")
GRADIENT_REDUCE_DTYPES = ("fp32", "bf16")  # what several processes sum their gradients in
HANDOUT_MAX_NEW_TOKENS = 32  # characters the handouts' evaluation generates after `question⁇`

__all__ = [
    "ATTENTION_KERNEL_DTYPES",
    "ATTENTION_TYPES",
    "GRADIENT_REDUCE_DTYPES",
    "HANDOUT_MAX_NEW_TOKENS",
    "TRAINING_PATHS",
]
