"""The hyperparameters and bookkeeping of one training run (torch-free: the scripts resolve them before
loading anything heavy)."""

from dataclasses import asdict, dataclass

HANDOUT_WARMUP_TOKENS = 512 * 20


@dataclass
class TrainingArguments:
    """Hyperparameters and bookkeeping of one run. Defaults are the handouts' pretraining recipe."""

    output_dir: str
    max_epochs: int = 650
    batch_size: int = 128  # the global batch, split across processes
    # transformers' convention instead: this many rows per process, the global batch this × processes
    per_device_train_batch_size: int | None = None
    learning_rate: float = 6e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_norm_clip: float = 1.0
    warmup_tokens: int = HANDOUT_WARMUP_TOKENS
    final_tokens: int | None = None  # None: max_epochs · examples · block_size, the handout's pretraining value
    shuffle: bool = False
    seed: int = 0
    packed: bool = True
    # Eager path: the packed token count rounded up to a multiple of this (padding positions, no targets).
    # None: 64 under bf16 on a CPU, where oneDNN builds its kernels for each new shape (10 quickstart epochs:
    # 13.5–13.9 s against 16.9–17.6 s unrounded, benchmarks/RESULTS.md), else 1.
    pack_multiple: int | None = None
    # Eager path: rows sorted by length and run as this many gradient-accumulated groups, each only as wide
    # as its longest row, so attention (and its dropout masks) covers ~half the grid. None: up to 4 groups
    # of ≥ 32 rows on CPU, 1 on GPU (where more, smaller kernels cost more than they save). Same gradient;
    # dropout draws differ.
    length_groups: int | None = None
    training_path: str = "auto"  # graphed on one CUDA device, else eager; "plain" is the handouts' way
    # torch.compile the model inside the graphed step. "auto": compile where an earlier run's compiled artifacts
    # for this model and step are saved (hf_knowgpt.training.compile_cache); otherwise train uncompiled, which
    # is faster than compiling from nothing, while a background process compiles for the next run
    # (hf_knowgpt.training.background_compile). Several processes compile as with True.
    compile: bool | str = False
    # With compile: inductor times each kernel's block sizes and warps once (coordinate-descent tuning) and keeps
    # the fastest, so later runs load tuned kernels. The first compilation takes about a minute longer; under
    # compile="auto" the background process waits for this run to end, so that its timings are its own. The
    # knowledge recipe answered about 0.6 points less tuned, in runs made side by side (benchmarks/RESULTS.md).
    tune_kernels: bool = False
    # "no", "bf16" or "fp16"; None: accelerate's configuration (`accelerate launch --mixed_precision`, else no)
    mixed_precision: str | None = None
    # On a CUDA fast path, causal self-attention of a model on "sdpa" runs through the fused Triton kernel
    # (attn_implementation "triton", hf_knowgpt.kernels.fused_attention) for the run, when Triton is installed.
    fused_attention: bool = True
    # On the graphed CUDA path, compiled or not, each residual sum with its dropout and the LayerNorm after it runs
    # as one fused Triton kernel each way (KnowGPTModel.fused_layers, hf_knowgpt.kernels.fused_layers), when Triton
    # is installed.
    fused_layers: bool = False
    # With several processes, the dtype the processes' gradients are summed in: "fp32", or "bf16", which halves
    # what the all-reduce moves (each gradient rounded to bf16 before the sum). One process sums nothing.
    gradient_reduce_dtype: str = "fp32"
    # Stop after this many optimizer steps of the max_epochs schedule (the learning rates stay those of the
    # whole run): the first part of a long run, for studies of early training. None: run to the end.
    stop_after_steps: int | None = None
    log_every: int = 50
    checkpointing_steps: str | None = None  # an integer, or "epoch"
    save_total_limit: int = 2
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    report_to: str | None = None
    run_name: str = "knowgpt"

    def __post_init__(self):
        """Values that would otherwise fail deep inside a run, refused at once with the field named."""
        from ..options import GRADIENT_REDUCE_DTYPES, TRAINING_PATHS
        from ..utils.errors import InputError

        for name in ("max_epochs", "batch_size", "log_every", "save_total_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"must be a positive integer, got {value!r}")
        if self.per_device_train_batch_size is not None and self.per_device_train_batch_size < 1:
            raise InputError(
                "per_device_train_batch_size", f"must be a positive integer, got {self.per_device_train_batch_size!r}"
            )
        if self.training_path not in TRAINING_PATHS:
            raise InputError("training_path", f"must be one of {list(TRAINING_PATHS)}, got {self.training_path!r}")
        if self.compile not in (True, False, "auto"):
            raise InputError("compile", f"must be True, False or 'auto', got {self.compile!r}")
        if self.tune_kernels not in (True, False):
            raise InputError("tune_kernels", f"must be True or False, got {self.tune_kernels!r}")
        if self.tune_kernels and not self.compile:
            raise InputError("tune_kernels", "tunes the compiled step's kernels", "give --torch_compile too")
        if self.mixed_precision not in (None, "no", "bf16", "fp16"):
            raise InputError("mixed_precision", f"must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.gradient_reduce_dtype not in GRADIENT_REDUCE_DTYPES:
            raise InputError(
                "gradient_reduce_dtype",
                f"must be one of {list(GRADIENT_REDUCE_DTYPES)}, got {self.gradient_reduce_dtype!r}",
            )
        every = self.checkpointing_steps
        if every is not None and not (
            str(every) == "epoch"
            or str(every).isdigit()
            or (str(every).startswith("epochs:") and str(every)[len("epochs:") :].isdigit())
        ):
            raise InputError("checkpointing_steps", f"must be N, 'epoch' or 'epochs:K', got {every!r}")

    def fingerprint(self) -> dict:
        """What defines the run: a directory holding another fingerprint holds a different run."""
        keep = (
            "max_epochs batch_size learning_rate betas weight_decay grad_norm_clip warmup_tokens final_tokens "
            "shuffle seed"
        ).split()
        values = asdict(self)
        return {key: (list(values[key]) if isinstance(values[key], tuple) else values[key]) for key in keep}


__all__ = ["HANDOUT_WARMUP_TOKENS", "TrainingArguments"]
