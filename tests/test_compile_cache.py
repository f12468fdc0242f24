"""What a compiled step compiled is kept by the package (`hf_knowgpt.training.compile_cache`): a process
whose compiler caches are empty loads it and finds every graph in the caches; a damaged file is skipped."""

import json
import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hf_knowgpt.training import compile_cache

# A small training step compiled (forward and backward), its artifacts loaded first when the file is there and
# saved after; prints the compiler's cache counters.
STEP = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    from hf_knowgpt.training.compile_cache import load_artifacts, save_artifacts
    from pathlib import Path

    path = Path(sys.argv[1])
    loaded = load_artifacts(path)
    layer = torch.nn.Linear(16, 8)
    step = torch.compile(lambda x: torch.nn.functional.gelu(layer(x)).sum())
    step(torch.randn(4, 16)).backward()
    saved = save_artifacts(path)
    print(json.dumps({"loaded": loaded, "saved": saved, "inductor": dict(counters["inductor"]),
                      "aot_autograd": dict(counters["aot_autograd"])}))
    """
)


def run_step(path, inductor_cache):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    completed = subprocess.run(
        [sys.executable, "-c", STEP, str(path)], env=env, capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_a_process_with_empty_caches_finds_what_an_earlier_one_compiled(tmp_path):
    path = compile_cache.artifacts_file(model={"n_embd": 16}, rows=4)
    path = tmp_path / path.name
    first = run_step(path, tmp_path / "inductor-first")
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0 and first["saved"] and not first["loaded"]
    # A new machine's (or a rebooted one's) empty inductor cache, the package's file kept:
    second = run_step(path, tmp_path / "inductor-second")
    assert second["loaded"] and not second["saved"]  # nothing compiled anew: the file is left as it is
    assert second["inductor"].get("fxgraph_cache_hit", 0) == first["inductor"]["fxgraph_cache_miss"]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["aot_autograd"].get("autograd_cache_hit", 0) == 1, second


def test_the_file_depends_on_the_key_and_the_versions(monkeypatch, tmp_path):
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path))
    path = compile_cache.artifacts_file(model={"n_embd": 16}, rows=4)
    assert path.parent == tmp_path
    assert path == compile_cache.artifacts_file(rows=4, model={"n_embd": 16})
    assert path != compile_cache.artifacts_file(model={"n_embd": 32}, rows=4)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert path != compile_cache.artifacts_file(model={"n_embd": 16}, rows=4)
    monkeypatch.delenv("KNOWGPT_COMPILE_CACHE")
    monkeypatch.setenv("KNOWGPT_CACHE", str(tmp_path / "package"))
    assert compile_cache.compile_cache_dir() == tmp_path / "package" / "compiled"


def test_the_code_digest_covers_the_package_the_corpus_logic_and_the_models_own_files(tmp_path, monkeypatch):
    """A loaded compiled function runs what was traced when it was saved, so the file is kept per version of the
    code: the package's, `data_loaders`' (the step's span corruption), and the files beside the model's class."""
    import importlib.util

    from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM

    config = KnowGPTConfig(vocab_size=12, block_size=8, n_layer=1, n_embd=8, n_head=2)
    names = {(path.parent.name, path.name) for path in compile_cache.traced_sources(KnowGPTForCausalLM(config))}
    assert {("hf_knowgpt", "modeling_knowgpt.py"), ("kernels", "fused_attention.py")} <= names
    assert {("training", "fast_path.py"), ("data_loaders", "span_corruption.py")} <= names

    source = tmp_path / "my_models" / "modeling_mine.py"
    source.parent.mkdir()
    source.write_text("from hf_knowgpt import KnowGPTForCausalLM\n\n\nclass Mine(KnowGPTForCausalLM):\n    pass\n")
    spec = importlib.util.spec_from_file_location("modeling_mine", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "modeling_mine", module)
    spec.loader.exec_module(module)
    mine = module.Mine(config)
    assert source.resolve() in compile_cache.traced_sources(mine)
    before = compile_cache.code_digest(mine)
    assert before == compile_cache.code_digest(mine) != compile_cache.code_digest(KnowGPTForCausalLM(config))
    source.write_text(source.read_text().replace("pass", "def forward(self, *args, **kwargs):\n        return None"))
    assert compile_cache.code_digest(mine) != before  # the file edited: what was compiled for it is not reused


def test_saving_a_step_removes_the_least_recently_used_steps_over_the_limit(tmp_path, monkeypatch):
    """Every version of the code gets files of its own, so the folder is bounded: saving a step removes whole
    steps, least recently saved or loaded first, until the folder holds at most the limit; never the step just
    saved, one being compiled in the background, or files that are not steps'."""
    import pytest

    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE_MAX_MB", str(15000 / 2**20))

    def step(stem, age):
        files = [tmp_path / f"{stem}.bin", tmp_path / f"{stem}.functions", tmp_path / f"{stem}.log"]
        for path, size in zip(files, (4000, 1000, 100)):
            path.write_bytes(b"x" * size)
            os.utime(path, (1e9 - age, 1e9 - age))
        return files

    compiling = step("compiling", age=500)  # the oldest, locked by a background compile
    (tmp_path / "compiling.compiling").write_text("1")
    oldest, older, recent = step("oldest", 400), step("older", 300), step("recent", 200)
    (tmp_path / "notes.txt").write_bytes(b"n" * 50000)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: object())
    assert compile_cache.load_artifacts(oldest[0])  # loaded: now the most recently used
    assert compile_cache._write_whole(tmp_path / "new.bin", b"y" * 4000, "compiled artifacts")
    gone = [path for path in [*compiling, *oldest, *older, *recent] if not path.exists()]
    assert gone == [*older, *recent]  # 5100 + 5100 + 4000 bytes left, under 15000 once both are gone
    assert (tmp_path / "new.bin").exists() and (tmp_path / "notes.txt").exists()

    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("KNOWGPT_COMPILE_CACHE_MAX_MB", bad)
        with pytest.raises(ValueError, match="KNOWGPT_COMPILE_CACHE_MAX_MB"):
            compile_cache.artifacts_file(model={"n_embd": 16})
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE_MAX_MB", "0")
    assert compile_cache.cache_limit_bytes() == 0


def test_a_missing_or_damaged_file_is_skipped(tmp_path, caplog):
    assert not compile_cache.load_artifacts(tmp_path / "absent.bin")
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(b"not artifacts")
    assert not compile_cache.load_artifacts(damaged)
    assert "not loaded" in caplog.text and str(damaged) in caplog.text


# A small step compiled whole (`PrecompiledFunction`) over three batch sizes, its rows dynamic: loaded first
# from the functions file when it is there, saved after; prints what dynamo traced and what the step computed.
PRECOMPILED_STEP = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from torch._dynamo.utils import counters
    from hf_knowgpt.training.compile_cache import PrecompiledFunction, load_functions, save_functions

    def step(layer, inputs, targets):
        return torch.nn.functional.cross_entropy(torch.nn.functional.gelu(layer(inputs)), targets)

    path = Path(sys.argv[1])
    torch._inductor.config.compile_threads = 2  # as on a machine of several cores, whatever this one has
    threads = []
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    compiled = PrecompiledFunction(step, "step", dynamic_arguments={1: 0, 2: 0})
    loaded = load_functions(path, [compiled])
    losses = []
    for rows in (4, 6, 9):
        inputs, targets = torch.randn(rows, 16), torch.randint(0, 8, (rows,))
        loss = compiled(layer, inputs, targets)
        threads.append(torch._inductor.config.compile_threads)
        loss.backward()
        losses.append(loss.item())
        assert abs(loss.item() - step(layer, inputs, targets).item()) < 1e-6
    saved = save_functions(path, [compiled])
    print(json.dumps({"loaded": loaded, "saved": saved, "entries": len(compiled.entries),
                      "traced": counters["stats"].get("calls_captured", 0), "losses": losses,
                      "gradient": layer.weight.grad.tolist(), "compile_threads": threads}))
    """
)


def test_a_later_process_loads_the_traced_function_and_traces_nothing(tmp_path):
    """`PrecompiledFunction` keeps what dynamo traced: a process that loads the functions file runs the step
    without tracing it, one graph for every batch size, and computes what the first process computed. Its
    inductor cache is empty, so the graph comes from the file alone (on a CPU its C++ kernels are built again
    from the code the file holds, with one compile thread: no pool of compile workers is started)."""
    path = tmp_path / "step.functions"
    runs = []
    for name in ("first", "later"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
        env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)  # a count set there is kept while loading
        completed = subprocess.run([sys.executable, "-c", PRECOMPILED_STEP, str(path)], env=env,
                                   capture_output=True, text=True, timeout=600)  # fmt: skip
        assert completed.returncode == 0, completed.stderr[-3000:]
        runs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    first, later = runs
    assert not first["loaded"] and first["saved"] and first["traced"] > 0 and first["entries"] == 1
    assert later["loaded"] and not later["saved"] and later["traced"] == 0 and later["entries"] == 1
    assert later["losses"] == first["losses"] and later["gradient"] == first["gradient"]
    assert first["compile_threads"] == [2, 2, 2] and later["compile_threads"] == [1, 1, 1]


def test_a_function_that_cannot_compile_whole_compiles_the_default_way(tmp_path, caplog):
    def breaks(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    compiled = compile_cache.PrecompiledFunction(breaks, "breaks")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert "breaks could not be compiled whole" in caplog.text and compiled.fallback is not None
    assert not compiled.entries and not compile_cache.save_functions(tmp_path / "f.functions", [compiled])
    assert not (tmp_path / "f.functions").exists()


class _FailingEntry:
    """A compiled entry whose guards hold and whose call raises from its `failing_call`-th call on."""

    def __init__(self, failing_call=1):
        self.calls, self.failing_call = 0, failing_call

    def guard_check(self, *args, **kwargs):
        return True

    def __call__(self, x):
        self.calls += 1
        if self.calls >= self.failing_call:
            raise IndexError("list index out of range")
        return torch.sin(x)


def test_an_entry_that_fails_its_first_call_is_dropped_and_the_function_runs_uncompiled(tmp_path, caplog):
    calls = []

    def sine(x):
        calls.append(x)
        return torch.sin(x)

    entry = _FailingEntry()
    compiled = compile_cache.PrecompiledFunction(sine, "sine")
    compiled._compile = lambda args, kwargs: entry
    x = torch.linspace(0, 1, 5)
    assert torch.equal(compiled(x), torch.sin(x)) and len(calls) == 1
    assert "sine's compiled code failed on its first call (IndexError: list index out of range)" in caplog.text
    assert compiled.runs_uncompiled and not compiled.entries and entry.calls == 1
    assert torch.equal(compiled(2 * x), torch.sin(2 * x)) and len(calls) == 2 and entry.calls == 1
    assert not compile_cache.save_functions(tmp_path / "f.functions", [compiled])  # nothing compiled to keep


def test_an_error_of_the_function_itself_is_raised_again_by_its_uncompiled_call():
    def rejects(x):
        raise ValueError("x must be positive")

    compiled = compile_cache.PrecompiledFunction(rejects, "rejects")
    compiled._compile = lambda args, kwargs: _FailingEntry()
    with pytest.raises(ValueError, match="x must be positive"):
        compiled(torch.zeros(2))


def test_an_entry_that_ran_once_raises_its_later_errors():
    entry = _FailingEntry(failing_call=2)
    compiled = compile_cache.PrecompiledFunction(torch.sin, "sine")
    compiled._compile = lambda args, kwargs: entry
    assert torch.equal(compiled(torch.zeros(2)), torch.zeros(2))
    with pytest.raises(IndexError):
        compiled(torch.zeros(2))
    assert compiled.entries == [entry] and not compiled.runs_uncompiled


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def _doubled_sum(x):
    return _Doubled.apply(x).sum()


def _tripled_sum(x):
    return (1.5 * _Doubled.apply(x)).sum()


def test_functions_compiled_after_the_same_seed_each_run_their_own(tmp_path, monkeypatch):
    """A graph with an autograd.Function cannot be hashed, and `aot_compile` keys its AOTAutograd cache entry by
    `random.random()`: two functions compiled after the same `random.seed` (two seeded runs) drew one key, and
    the second ran the first's code (8.0 for 12.0 here, torch 2.13 on a CPU; torch 2.11's model steps on an H100).
    Compiling leaves the caller's Python random state as it found it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x = torch.ones(4, requires_grad=True)
    results = []
    for function in (_doubled_sum, _tripled_sum):
        random.seed(0)
        results.append(compile_cache.PrecompiledFunction(function, function.__name__)(x).item())
        assert random.random() == random.Random(0).random()  # the seeded stream untouched by compiling
    assert results == [8.0, 12.0]


class _ScaledDropout(torch.nn.Module):
    def __init__(self, rate):
        super().__init__()
        self.rate, self.linear = rate, torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.linear(x), self.rate, training=False).sum() * (1 - self.rate)


def _call(module, x):
    return module(x)


def test_modules_with_other_float_attributes_each_compile_whole():
    """A second module whose float attribute (a dropout rate) differs, compiled in the same process with automatic
    dynamic shapes: dynamo would make the float symbolic and restart its analysis, which `aot_compile` does not
    do (the second call fell back, through an error with an empty message). Floats are compiled as constants."""
    x = torch.randn(4, 8)
    for rate in (0.5, 0.25, 0.125):
        module = _ScaledDropout(rate)
        compiled = compile_cache.PrecompiledFunction(_call, f"rate {rate}", dynamic=None)
        assert torch.allclose(compiled(module, x), module(x))
        assert len(compiled.entries) == 1 and compiled.fallback is None


def _sine(x):
    return torch.sin(x)


def _cosine(x):
    return torch.cos(x)


def test_compile_threads_come_back_before_anything_is_compiled_anew(tmp_path, monkeypatch):
    """Loading a functions file leaves inductor one compile thread; a function the file does not cover gives the
    threads back before it compiles. A thread count the user set is never touched."""
    from torch._inductor import config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    saved = compile_cache.PrecompiledFunction(_sine, "sine")
    saved(torch.zeros(2))
    path = tmp_path / "f.functions"
    assert compile_cache.save_functions(path, [saved])
    with config.patch(compile_threads=3):
        loaded, uncovered = (compile_cache.PrecompiledFunction(_sine, "sine"),
                             compile_cache.PrecompiledFunction(_cosine, "cosine"))  # fmt: skip
        assert compile_cache.load_functions(path, [loaded, uncovered])
        assert config.compile_threads == 1
        loaded(torch.zeros(2))  # its loaded entry: nothing compiled
        assert config.compile_threads == 1 and not loaded.compiled_anew
        assert torch.equal(uncovered(torch.zeros(2)), torch.ones(2))
        assert config.compile_threads == 3 and uncovered.compiled_anew
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
        assert compile_cache.load_functions(path, [compile_cache.PrecompiledFunction(_sine, "sine")])
        assert config.compile_threads == 3


@pytest.mark.parametrize("threads", [None, "1", "2"], ids=["unset", "one", "two"])
@pytest.mark.parametrize("tuned", [False, True], ids=["untuned", "tuned"])
def test_loading_a_tuned_step_with_compile_workers_is_warned_of(tmp_path, monkeypatch, caplog, threads, tuned):
    """A tuned step (`coordinate_descent_tuning` among its options) loaded while the user's
    TORCHINDUCTOR_COMPILE_THREADS keeps compile workers is warned of: its kernels come back from the workers
    without their tuning and are tuned again. Unset, or one thread, or an untuned step: no warning."""
    from torch._inductor import config

    options = {"coordinate_descent_tuning": True} if tuned else None
    saved = compile_cache.PrecompiledFunction(_sine, "sine")
    saved(torch.zeros(2))
    path = tmp_path / "f.functions"
    assert compile_cache.save_functions(path, [saved])
    if threads is None:
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", threads)
    with config.patch(compile_threads=config.compile_threads), caplog.at_level("WARNING"):
        compile_cache.load_functions(path, [compile_cache.PrecompiledFunction(_sine, "sine", options=options)])
        compile_cache._allow_compile_workers()
    warned = [r.getMessage() for r in caplog.records if "TORCHINDUCTOR_COMPILE_THREADS" in r.getMessage()]
    assert len(warned) == (1 if tuned and threads == "2" else 0), warned
    assert all(
        message.startswith("TORCHINDUCTOR_COMPILE_THREADS=2:") and "tuned again" in message for message in warned
    )


def test_an_error_without_a_message_still_falls_back(monkeypatch, caplog):
    def fails(self, args, kwargs):
        raise RuntimeError()

    monkeypatch.setattr(compile_cache.PrecompiledFunction, "_compile", fails)
    compiled = compile_cache.PrecompiledFunction(torch.cos, "cos")
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
    assert "cos could not be compiled whole ahead of its call (RuntimeError: )" in caplog.text


def test_a_damaged_functions_file_is_skipped(tmp_path, caplog):
    compiled = compile_cache.PrecompiledFunction(torch.sin, "sin")
    assert not compile_cache.load_functions(tmp_path / "absent.functions", [compiled])
    damaged = tmp_path / "damaged.functions"
    damaged.write_bytes(b"not functions")
    assert not compile_cache.load_functions(damaged, [compiled])
    assert "not loaded" in caplog.text and str(damaged) in caplog.text and not compiled.entries


def _recording_keys(monkeypatch):
    """torch's and Triton's key functions replaced by ones that record the thread they ran on."""
    import types

    from torch._inductor import codecache

    threads = {}

    def key(name):
        def compute():
            threads[name] = threading.current_thread().name
            return name

        return compute

    monkeypatch.setattr(codecache, "torch_key", key("torch"))
    fakes = {name: types.ModuleType(name) for name in ("triton", "triton.runtime", "triton.runtime.cache")}
    fakes["triton.runtime.cache"].triton_key = key("triton")
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(compile_cache, "_compiler_keys", None)
    return threads


def test_the_compiler_keys_are_computed_on_a_thread_of_their_own_once(monkeypatch):
    threads = _recording_keys(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    compile_cache.prefetch_compiler_keys()
    started = compile_cache._compiler_keys
    compile_cache.wait_for_compiler_keys()
    assert threads == {"torch": "compiler-keys", "triton": "compiler-keys"}
    assert not started.is_alive()
    compile_cache.prefetch_compiler_keys()  # once per process
    assert compile_cache._compiler_keys is started


def test_no_compiler_keys_are_computed_without_cuda(monkeypatch):
    threads = _recording_keys(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    compile_cache.prefetch_compiler_keys()
    compile_cache.wait_for_compiler_keys()
    assert compile_cache._compiler_keys is None and threads == {}


def test_a_stage_prefetches_the_keys_where_it_compiles_or_may_load_a_saved_step(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from hf_knowgpt.training import workflows

    started = []
    monkeypatch.setattr(workflows, "prefetch_compiler_keys", lambda: started.append(True))
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path))
    for compile_setting in (False, "auto", True):
        workflows._prefetch_compiler_keys(SimpleNamespace(compile=compile_setting))
    assert started == [True]  # compiled; auto with nothing saved trains uncompiled
    (tmp_path / "0123.functions").write_bytes(b"")
    workflows._prefetch_compiler_keys(SimpleNamespace(compile="auto"))
    assert started == [True, True]
