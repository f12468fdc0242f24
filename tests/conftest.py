import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled training runs in the tests keep their artifacts here, not in the user's cache.
os.environ.setdefault("KNOWGPT_COMPILE_CACHE", tempfile.mkdtemp(prefix="knowgpt-test-compiled-"))

REPO_ROOT = Path(__file__).resolve().parents[1]
# The CS224N files are read from ../shared/data (or KNOWGPT_DATA, e.g. a copy carried to the GPU machine).
DATA_DIR = Path(os.environ.get("KNOWGPT_DATA", REPO_ROOT.parent / "shared" / "data"))
WIKI = DATA_DIR / "wiki.txt"
TRAIN_TSV = DATA_DIR / "birth_places_train.tsv"
DEV_TSV = DATA_DIR / "birth_dev.tsv"
TEST_TSV = DATA_DIR / "birth_test_inputs.tsv"
HAS_DATA = all(p.exists() for p in (WIKI, TRAIN_TSV, DEV_TSV, TEST_TSV))
needs_data = pytest.mark.skipif(not HAS_DATA, reason=f"CS224N data not present in {DATA_DIR}")

sys.path.insert(0, str(Path(__file__).resolve().parent))

ATTENTION_TYPES = ["vanilla", "rope", "synthesizer", "perceiver"]
# The environment of launched processes that must train on CPUs (gloo), as the several-process tests are written
# for: on a GPU machine each process would take a GPU of its own, and a machine with one GPU has none for the
# second ("CUDA error: invalid device ordinal").
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}

# The Triton kernels (hf_knowgpt.kernels) run on a CUDA device, or on the CPU under Triton's interpreter.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_skip_reason() -> str | None:
    from hf_knowgpt.kernels.fused_attention import triton

    if triton is None:
        return "Triton is not installed (CPU builds of torch come without it)"
    if not (torch.cuda.is_available() or TRITON_INTERPRETED):
        return "no CUDA device; TRITON_INTERPRET=1 runs the kernels on the CPU"
    return None


KERNEL_SKIP = _kernel_skip_reason()
needs_kernel = pytest.mark.skipif(KERNEL_SKIP is not None, reason=KERNEL_SKIP or "")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not TRITON_INTERPRETED else "cpu"


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state: a test that made a CPU accelerator would otherwise put
    every later Accelerator() on the CPU, a GPU present or not."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def tiny_config(attention_type="vanilla", **overrides):
    from hf_knowgpt import KnowGPTConfig

    values = dict(
        vocab_size=23,
        block_size=24,
        n_layer=3,
        n_head=2,
        n_embd=16,
        attention_type=attention_type,
        bottleneck_dim=7,
        unk_token_id=22,
    )
    values.update(overrides)
    return KnowGPTConfig(**values)


def perturbed_model(attention_type, **overrides):
    """A tiny KnowGPTForCausalLM in eval mode whose every parameter matters (the handout init zeroes some
    tensors, so all are perturbed)."""
    from hf_knowgpt import KnowGPTForCausalLM

    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config(attention_type, **overrides)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def enable_activation_checkpointing(model, checkpoint_kwargs=None, **options):
    """Checkpointing on through the name this transformers has: `activation_checkpointing_enable` where it exists
    (5.23 on; from 5.25 the old name warns until v6), else `gradient_checkpointing_enable` (5.17). Both take
    `every_n_layers` and `offload`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(checkpoint_kwargs, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **options)


def disable_activation_checkpointing(model):
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def write_cs224n_named_synthetic(directory, num_people=40, seed=0) -> Path:
    """A synthetic corpus written under the CS224N file names (what --data_dir expects)."""
    from data_loaders import write_synthetic_corpus

    files = write_synthetic_corpus(Path(directory) / "synthetic", num_people=num_people, seed=seed)
    data = Path(directory) / "data"
    data.mkdir(parents=True, exist_ok=True)
    for source, name in ((files.corpus, "wiki.txt"), (files.train, "birth_places_train.tsv"),
                         (files.dev, "birth_dev.tsv"), (files.test, "birth_test_inputs.tsv")):  # fmt: skip
        (data / name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return data


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


def run_checkpoint_code_without_the_package(folder, checks: str):
    """Load the checkpoint in `folder` with `trust_remote_code` in a fresh process where this package cannot be
    imported (an editable install imports it from anywhere), then run `checks`: Python lines that see `model`
    (the causal LM, in eval mode), `tokenizer`, `torch` and `folder`. The model must run the checkpoint's own
    code, the tokenizer must round-trip, and the package must stay unimported."""
    script = f"""
import importlib.abc, sys
class WithoutThePackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("hf_knowgpt", "data_loaders"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, WithoutThePackage())
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = Path({str(folder)!r})
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert tokenizer.decode(tokenizer("abc")["input_ids"]) == "abc"
{textwrap.dedent(checks)}
assert "hf_knowgpt" not in sys.modules, "the package was imported"
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=folder,
        env={"HF_HUB_OFFLINE": "1", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
