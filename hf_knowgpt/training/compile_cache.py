"""What a compiled training step compiled, kept by the package across processes whose compiler caches are empty.

torch.compile keeps its results in TorchInductor's cache (by default in the system's temporary folder, emptied
by a reboot or a new container) and Triton's. `torch.compiler.save_cache_artifacts` gathers what a process
compiled or found there into bytes, and `load_cache_artifacts` writes such bytes back into the caches, so a
later process on the same kind of card, with the same versions, finds them there instead of compiling again.
The package keeps one file per model, step shape and version of the code under `compile_cache_dir()`:
`$KNOWGPT_COMPILE_CACHE`, else `$KNOWGPT_CACHE/compiled`, else `~/.cache/hf_knowgpt/compiled`. A file that
cannot be read or loaded is reported and skipped: it never stops a run. Once the folder holds more than
`$KNOWGPT_COMPILE_CACHE_MAX_MB` (2048 by default), saving a step removes the files of the steps least recently
saved or loaded.

Those caches hold what inductor and AOTAutograd made of a traced graph, not the tracing itself: a process
that finds everything there still has dynamo trace the step's Python bytecode, most of a warm run's
compilation (benchmarks/RESULTS.md). `PrecompiledFunction` compiles a function whole ahead of its call
(`torch.compile(...).aot_compile`), and `save_functions` keeps dynamo's output too, guards and bytecode, in a
second file beside the artifacts (`functions_file`), which a later process loads instead of tracing. While it
loads them, inductor runs with one compile thread (`load_functions`): it would otherwise start its pool of
compile workers for code whose kernels all come from its caches, and wait for the pool's shutdown at exit.
"""

import contextlib
import hashlib
import inspect
import io
import json
import logging
import os
import pickle
import random
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


# One step's files beside its `.bin` of artifacts: its traced functions, a background compile's log, and that
# compile's lock while it runs (`background_compile`).
FUNCTIONS_SUFFIX, LOG_SUFFIX, LOCK_SUFFIX = ".functions", ".log", ".compiling"
STEP_SUFFIXES = (".bin", FUNCTIONS_SUFFIX, LOG_SUFFIX)
DEFAULT_MAX_MB = 2048


def compile_cache_dir() -> Path:
    if "KNOWGPT_COMPILE_CACHE" in os.environ:
        return Path(os.environ["KNOWGPT_COMPILE_CACHE"])
    return Path(os.environ.get("KNOWGPT_CACHE", Path.home() / ".cache" / "hf_knowgpt")) / "compiled"


def artifacts_file(**key) -> Path:
    """The file for what the step described by `key` (JSON-serializable values: the model's config, the step's
    shapes, the card) compiles, with torch's and Triton's versions added. Checks the folder's size limit."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    described = json.dumps({**key, "torch": torch.__version__, "triton": triton_version}, sort_keys=True, default=str)
    cache_limit_bytes()  # a bad limit stops the run before it trains, not when it saves the step
    return compile_cache_dir() / f"{hashlib.sha256(described.encode()).hexdigest()[:24]}.bin"


def traced_sources(model) -> list[Path]:
    """The Python files whose code a compiled step of `model` may trace: this package's and `data_loaders`', and
    those beside the model's class (a checkpoint's own code, a subclass of the user's)."""
    import data_loaders
    import hf_knowgpt

    files = [*Path(hf_knowgpt.__file__).parent.rglob("*.py"), *Path(data_loaders.__file__).parent.rglob("*.py")]
    try:
        model_file = inspect.getsourcefile(type(model))
    except TypeError:  # a class whose module has no file
        model_file = None
    if model_file:
        files += Path(model_file).parent.glob("*.py")
    return sorted({path.resolve() for path in files})


def code_digest(model) -> str:
    """A digest of `traced_sources(model)`, for the key of `artifacts_file`. A loaded compiled function runs what
    was traced when it was saved, without tracing the Python again: kept for other code (an edited model, an
    upgraded package) it would run that code."""
    digest = hashlib.sha256()
    for path in traced_sources(model):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def cache_limit_bytes() -> int:
    """`$KNOWGPT_COMPILE_CACHE_MAX_MB` in bytes: how much the folder of compiled steps may hold."""
    given = os.environ.get("KNOWGPT_COMPILE_CACHE_MAX_MB", str(DEFAULT_MAX_MB))
    try:
        megabytes = float(given)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise ValueError(f"KNOWGPT_COMPILE_CACHE_MAX_MB must be a number of megabytes (0 or more), not {given!r}")
    return int(megabytes * 2**20)


def _mark_used(path: Path) -> None:
    """A loaded step's file counts as recently used, so that pruning keeps it."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache: nothing to prune there either
        pass


def prune(folder: Path, keep: str) -> list[Path]:
    """Remove the files of the steps least recently saved or loaded from `folder` until its steps' files hold at
    most `cache_limit_bytes()`; never those of step `keep` (a file's stem) or of a step being compiled in the
    background (its `.compiling` lock). Returns the files removed."""
    limit, steps = cache_limit_bytes(), {}
    for path in folder.iterdir():
        if path.suffix in STEP_SUFFIXES and path.is_file():
            steps.setdefault(path.stem, []).append(path)
    stats = {stem: [path.stat() for path in files] for stem, files in steps.items()}
    sizes = {stem: sum(stat.st_size for stat in of_step) for stem, of_step in stats.items()}
    last_used = {stem: max(stat.st_mtime for stat in of_step) for stem, of_step in stats.items()}
    total, removed = sum(sizes.values()), []
    for stem in sorted(steps, key=last_used.get):
        if total <= limit:
            break
        if stem == keep or (folder / f"{stem}{LOCK_SUFFIX}").exists():
            continue
        for path in steps[stem]:
            path.unlink(missing_ok=True)  # another process may have pruned it first
            removed.append(path)
        total -= sizes[stem]
    if removed:
        logger.info("removed %d compiled-step files from %s (over %d MB)", len(removed), folder, limit >> 20)
    return removed


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
    else:
        _mark_used(path)
    return info is not None


def compiled_anew() -> bool:
    """Whether this process compiled something it did not find in the caches (an inductor or AOTAutograd miss)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] > 0 or counters["aot_autograd"]["autograd_cache_miss"] > 0


def _write_whole(path: Path, data: bytes, what: str) -> bool:
    """`data` to `path` through a temporary file beside it, so a reader finds the old file or the new one; then
    the folder pruned to its limit (`prune`)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as partial:
            try:
                partial.write(data)
                partial.close()
                os.replace(partial.name, path)
            finally:
                Path(partial.name).unlink(missing_ok=True)  # gone after the replace; removed if it failed
    except OSError as error:  # a read-only home, a full disk: the run itself is done and saved
        logger.warning("%s not saved to %s (%s)", what, path, error)
        return False
    try:
        prune(path.parent, keep=path.stem)
    except OSError as error:  # files removed under it by another process pruning the folder
        logger.warning("compiled steps in %s not pruned (%s)", path.parent, error)
    return True


def save_artifacts(path: Path) -> bool:
    """Save what this process compiled or found in the caches to `path` (written whole or not at all), where the
    file is absent or the process compiled something anew; whether it wrote."""
    if path.is_file() and not compiled_anew():
        return False
    artifacts = torch.compiler.save_cache_artifacts()
    return artifacts is not None and _write_whole(path, artifacts[0], "compiled artifacts")


def _first_line(error: Exception) -> str:
    """An error's first line for a warning (torch's messages run long; some are empty)."""
    return next(iter(str(error).splitlines()), "")


# Inductor's compile threads as they were before `load_functions` left one, to be given back before anything is
# compiled anew (None: nothing to give back).
_compile_threads_before_loading: int | None = None


def _compile_in_this_process(tuned: bool = False) -> None:
    """One inductor compile thread, in this process, while a step is loaded from files. Code that inductor loads
    starts its pool of compile workers (a process of `compile_threads` workers) as soon as it names a kernel,
    even where every kernel comes from the caches; the pool's start competes with the run, and the process
    waits for its shutdown at exit (1.0–1.2 s of a warm compiled run against 0.1 s with one thread on an
    H100, benchmarks/RESULTS.md). A thread count the user set (TORCHINDUCTOR_COMPILE_THREADS) is kept; for a
    `tuned` step (`tune_kernels`), a count above one is warned of: kernels loaded by the workers come back
    without the mark that says they were tuned (triton.Config's pickling drops `found_by_coordesc`), and are tuned
    again (33 and 87 of 141–155 kernels in two runs, H100, torch 2.11, benchmarks/RESULTS.md)."""
    global _compile_threads_before_loading
    user_threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    if tuned and user_threads not in (None, "", "0", "1"):
        logger.warning(
            "TORCHINDUCTOR_COMPILE_THREADS=%s: the tuned kernels load through inductor's compile workers, which "
            "lose their tuning, so they are tuned again in this run; unset it (or set 1) to load them as tuned",
            user_threads,
        )
    if user_threads is not None or _compile_threads_before_loading is not None:
        return
    from torch._inductor import config
    from torch._inductor.async_compile import get_compile_threads

    _compile_threads_before_loading = get_compile_threads()
    config.compile_threads = 1


def _allow_compile_workers() -> None:
    """Give inductor back the compile threads `_compile_in_this_process` took, before compiling anew."""
    global _compile_threads_before_loading
    if _compile_threads_before_loading is not None:
        from torch._inductor import config

        config.compile_threads = _compile_threads_before_loading
        _compile_threads_before_loading = None


# The thread computing the digests inductor and Triton key their caches on (`prefetch_compiler_keys`).
_compiler_keys: threading.Thread | None = None


def prefetch_compiler_keys() -> None:
    """Start computing, on a thread of its own, the digests of the installed torch and Triton that inductor and
    Triton key their caches on (`torch_key`, `triton_key`): each process computes them once, at the first kernel
    it loads, by reading and hashing torch's Python sources and Triton's compiler and libtriton, mostly with
    Python's lock released. Started before the data and the model are made ready, it overlaps them;
    `wait_for_compiler_keys` joins it before a step loads (on an H200 a warm step loaded 0.5 s sooner,
    benchmarks/RESULTS.md). Nothing on a machine without CUDA or Triton. The modules are imported here, on the
    calling thread, so that no import runs on two threads at once."""
    global _compiler_keys
    if _compiler_keys is not None or not torch.cuda.is_available():
        return
    try:
        from torch._inductor.codecache import torch_key
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton: nothing is compiled for a GPU
        return

    def compute():
        try:
            torch_key()
            triton_key()
        except Exception as error:  # whoever needs them computes them again, and meets the error there
            logger.debug("compiler keys not computed ahead (%s: %s)", type(error).__name__, error)

    _compiler_keys = threading.Thread(target=compute, name="compiler-keys", daemon=True)
    _compiler_keys.start()


def wait_for_compiler_keys() -> None:
    """Join the thread of `prefetch_compiler_keys`, where one started: the keys' caches are not locked, so a
    kernel loaded meanwhile would compute them a second time."""
    if _compiler_keys is not None:
        _compiler_keys.join()


def saved_steps() -> bool:
    """Whether the package's folder of compiled steps holds any (`--torch_compile auto` may load one)."""
    folder = compile_cache_dir()
    return folder.is_dir() and any(folder.glob(f"*{FUNCTIONS_SUFFIX}"))


@contextlib.contextmanager
def _python_random_from_os():
    """Python's `random` seeded from the OS inside the block, the caller's state given back after it.

    For a graph it cannot hash (one calling a `torch.autograd.Function`, as the model's step does), `aot_compile`
    keys AOTAutograd's on-disk cache entry by `random.random()`. Every seeded run seeds `random`, so two seeded
    processes drew the same key and the second was given the first's compiled graph: of another model, it
    raised IndexError on its first call (torch 2.11, H100), or, with the same inputs, silently ran the other
    code (tests/test_compile_cache.py). The caller's state is given back, so compiling draws nothing from it.
    """
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


class PrecompiledFunction:
    """`function` compiled whole (no graph break) ahead of its first call, by `torch.compile(...).aot_compile`,
    so that what dynamo traced can be kept and loaded by a later process (`load`, `serialized`).

    Each entry is one compiled graph with the guards it was compiled under (shapes, dtypes, constant arguments;
    a dimension marked dynamic stays symbolic). A call runs the first entry whose guards hold; where none does,
    the call's arguments are compiled into a new entry, as dynamo recompiles. Where compiling whole fails (a
    graph break, a torch without `aot_compile`), the function is compiled the default way and nothing is kept.
    `function` takes every object it reads as an argument (no closure): a loaded entry reads them from its call.

    `dynamic_arguments` ({position: dimension}) names the sizes compiled as symbols (`torch._dynamo.mark_dynamic`)
    on a copy of the argument, never on the caller's tensor: an entry loaded from a file takes only unmarked
    tensors (its guards are rebuilt without the marking), one compiled here takes either.

    An entry that raises on its first call in this process is dropped, with a warning, and that call and every
    later one run `function` uncompiled (`runs_uncompiled`): an error of `function` itself is raised again
    there, and one of the compiled code costs speed, not the run (an entry handed another function's graph by
    torch's cache raised IndexError so: `_python_random_from_os`). A first call while a CUDA graph is being
    captured is not retried: the capture has failed by then.
    """

    def __init__(self, function, name: str, dynamic=None, options=None, dynamic_arguments: dict | None = None):
        self.function, self.name = function, name
        self.dynamic, self.options = dynamic, options
        self.dynamic_arguments = dynamic_arguments or {}
        self.entries = []
        self.called = set()  # ids of the entries called in this process
        self.compiled_anew = False  # an entry compiled in this process (not loaded)
        self.fallback = None  # the default torch.compile once compiling whole failed; `function` once an entry did

    @property
    def runs_uncompiled(self) -> bool:
        return self.fallback is self.function

    def _call_entry(self, entry, args, kwargs):
        if id(entry) in self.called or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return entry(*args, **kwargs)
        try:
            result = entry(*args, **kwargs)
        except Exception as error:
            logger.warning(
                "%s's compiled code failed on its first call (%s: %s); it runs uncompiled in this process",
                self.name, type(error).__name__, _first_line(error),
            )  # fmt: skip
            self.entries.remove(entry)
            self.fallback = self.function
            return self.function(*args, **kwargs)
        self.called.add(id(entry))
        return result

    def __call__(self, *args, **kwargs):
        if self.fallback is None:
            for entry in self.entries:
                if entry.guard_check(*args, **kwargs):
                    return self._call_entry(entry, args, kwargs)
            _allow_compile_workers()  # what was loaded does not cover this call: compile with every thread
            try:
                entry = self._compile(args, kwargs)
            except Exception as error:  # the default way traces and compiles what it can
                logger.warning(
                    "%s could not be compiled whole ahead of its call (%s: %s); compiled the default way, and "
                    "later processes trace it again", self.name, type(error).__name__, _first_line(error)
                )  # fmt: skip
                self.fallback = torch.compile(self.function, dynamic=self.dynamic, options=self.options)
            else:
                self.entries.append(entry)
                self.compiled_anew = True
                return self._call_entry(entry, args, kwargs)
            for position, dimension in self.dynamic_arguments.items():
                torch._dynamo.mark_dynamic(args[position], dimension)
        return self.fallback(*args, **kwargs)

    def _compile(self, args, kwargs):
        examples = list(args)
        for position, dimension in self.dynamic_arguments.items():
            examples[position] = args[position].clone()
            torch._dynamo.mark_dynamic(examples[position], dimension)
        # `enable_aot_compile` adds `aot_compile` (experimental). Floats are compiled as constants: dynamo makes a
        # float symbolic once it has seen another value for it in the same code (a second model with another
        # dropout rate, in one process), and then restarts its analysis, which `aot_compile` does not do.
        with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True), _python_random_from_os():
            compiler = torch.compile(self.function, fullgraph=True, dynamic=self.dynamic, options=self.options)
            entry = compiler.aot_compile((tuple(examples), kwargs))
        entry.disable_guard_check()  # `__call__` checked them
        return entry

    def serialized(self) -> list[bytes]:
        return [type(entry).serialize(entry).serialized_data for entry in self.entries]

    def load(self, serialized: list[bytes]) -> None:
        """Add entries an earlier process compiled (`serialized`), before those this one compiles."""
        for data in serialized:
            entry = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=self.function.__globals__)
            entry.disable_guard_check()
            self.entries.append(entry)


def functions_file(artifacts: Path) -> Path:
    """Where the precompiled functions of the step whose artifacts are in `artifacts` are kept."""
    return artifacts.with_suffix(FUNCTIONS_SUFFIX)


def load_functions(path: Path, functions: list[PrecompiledFunction]) -> bool:
    """Load into `functions` the entries saved for them in `path` (by name); whether there were any. A file that
    cannot be read or loaded (damaged, another version) is reported and skipped: each function compiles anew.
    Where the file exists, inductor keeps one compile thread from here until a function compiles anew
    (`_compile_in_this_process`)."""
    if not path.is_file():
        return False
    tuned = any((function.options or {}).get("coordinate_descent_tuning") for function in functions)
    _compile_in_this_process(tuned)  # until something must be compiled anew (`PrecompiledFunction.__call__`)
    try:
        saved = pickle.loads(path.read_bytes())
        loaded = [(function, saved.get(function.name, [])) for function in functions]
        for function, serialized in loaded:
            function.load(serialized)
    except Exception as error:
        logger.warning("precompiled functions in %s not loaded (%s: %s); tracing anew", path, type(error).__name__,
                       _first_line(error))  # fmt: skip
        for function in functions:
            function.entries.clear()
        _allow_compile_workers()
        return False
    _mark_used(path)
    return any(serialized for _, serialized in loaded)


def save_functions(path: Path, functions: list[PrecompiledFunction]) -> bool:
    """Save the entries of `functions` to `path` (written whole or not at all), where one was compiled anew in
    this process; whether it wrote."""
    if not any(function.compiled_anew and function.entries for function in functions):
        return False
    try:
        data = pickle.dumps({function.name: function.serialized() for function in functions if function.entries})
    except Exception as error:  # an entry torch cannot serialize: later processes trace as before
        logger.warning("precompiled functions not saved to %s (%s: %s)", path, type(error).__name__, error)
        return False
    return _write_whole(path, data, "precompiled functions")


__all__ = [
    "PrecompiledFunction",
    "artifacts_file",
    "cache_limit_bytes",
    "code_digest",
    "compile_cache_dir",
    "compiled_anew",
    "functions_file",
    "load_artifacts",
    "load_functions",
    "prefetch_compiler_keys",
    "prune",
    "saved_steps",
    "save_artifacts",
    "save_functions",
    "traced_sources",
    "wait_for_compiler_keys",
]
