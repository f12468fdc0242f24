"""What a compiled training step compiled, kept by the package across processes whose compiler caches are empty.

torch.compile keeps its results in TorchInductor's cache (by default in the system's temporary folder,
emptied by a reboot or a new container) and Triton's. `torch.compiler.save_cache_artifacts` gathers what a
process compiled or found there into bytes, and `load_cache_artifacts` writes such bytes back into the
caches, so a later process on the same kind of card, with the same versions, finds them there instead of
compiling again. The package keeps one file per model and step shape under `compile_cache_dir()`:
`$KNOWGPT_COMPILE_CACHE`, else `$KNOWGPT_CACHE/compiled`, else `~/.cache/hf_knowgpt/compiled`. A file that
cannot be read or loaded is reported and skipped: it never stops a run.
"""

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def compile_cache_dir() -> Path:
    if "KNOWGPT_COMPILE_CACHE" in os.environ:
        return Path(os.environ["KNOWGPT_COMPILE_CACHE"])
    return Path(os.environ.get("KNOWGPT_CACHE", Path.home() / ".cache" / "hf_knowgpt")) / "compiled"


def artifacts_file(**key) -> Path:
    """The file for what the step described by `key` (JSON-serializable values: the model's config, the step's
    shapes, the card) compiles, with torch's and Triton's versions added."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    described = json.dumps({**key, "torch": torch.__version__, "triton": triton_version}, sort_keys=True, default=str)
    return compile_cache_dir() / f"{hashlib.sha256(described.encode()).hexdigest()[:24]}.bin"


def load_artifacts(path: Path) -> bool:
    """Write the artifacts saved in `path` into the compiler's caches; whether there were any."""
    if not path.is_file():
        return False
    try:  # a damaged file or one from another version: compile as if it were absent
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
        problem = None if info is not None else "damaged, or written by another version"
    except Exception as error:
        info, problem = None, f"{type(error).__name__}: {error}"
    if problem is not None:
        logger.warning("compiled artifacts in %s not loaded (%s); compiling anew", path, problem)
    return info is not None


def compiled_anew() -> bool:
    """Whether this process compiled something it did not find in the caches (an inductor or AOTAutograd miss)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] > 0 or counters["aot_autograd"]["autograd_cache_miss"] > 0


def save_artifacts(path: Path) -> bool:
    """Save what this process compiled or found in the caches to `path` (written whole or not at all), where the
    file is absent or the process compiled something anew; whether it wrote."""
    if path.is_file() and not compiled_anew():
        return False
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as partial:
            try:
                partial.write(artifacts[0])
                partial.close()
                os.replace(partial.name, path)
            finally:
                Path(partial.name).unlink(missing_ok=True)  # gone after the replace; removed if it failed
    except OSError as error:  # a read-only home, a full disk: the run itself is done and saved
        logger.warning("compiled artifacts not saved to %s (%s)", path, error)
        return False
    return True


__all__ = ["artifacts_file", "compile_cache_dir", "compiled_anew", "load_artifacts", "save_artifacts"]
