"""Triton kernels the model can run: `fused_attention`, a fused causal attention kernel for short bf16 sequences
(`attn_implementation="triton"`), and `column_sums`, the linear layers' bias gradients while training on a GPU.
The model imports them on first use, by their absolute names: checkpoints do not carry them, and their code runs
SDPA and autograd's sums where the package is not installed."""

import os
import sys
import threading
from pathlib import Path


def pin_triton_ptxas() -> None:
    """Point Triton at torch's own ptxas (TRITON_PTXAS_PATH), as inductor does when it first compiles.

    Triton keys its disk cache on that variable, so a kernel built before inductor set it (say, the fused
    attention kernel launched eagerly) and the same kernel looked up after (a finetuning stage that follows a
    compiled pretraining stage) missed each other's builds, in every process: 1.96 s of a warm compiled run
    (benchmarks/RESULTS.md). Set once at the start of a CUDA run, every build sees the same value. A value
    the user set is kept."""
    import torch

    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = str(ptxas)


def use_training_matmul_settings() -> None:
    """The matrix-product settings a CUDA training run uses: fp32 products on tensor cores (TF32), and split-K
    partial sums of bf16 products kept in fp32 (weight gradients sum over ~15k positions; bf16 partial sums lose
    them)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def release_compile_workers() -> threading.Thread | None:
    """Shut TorchInductor's pool of compile workers down on a thread of its own, once nothing more will be
    compiled. At exit a process otherwise waits for the pool's shutdown (its atexit handler: 1.0–1.2 s of a
    compiled run on an H100 machine, benchmarks/RESULTS.md); started after training, it overlaps evaluation
    and writing. The thread is not a daemon: the process still waits for it before exiting, and inductor's
    own atexit handler then finds no pool left. None where inductor never ran."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None:
        return None
    thread = threading.Thread(target=async_compile.shutdown_compile_workers, name="release-compile-workers")
    thread.start()
    return thread
