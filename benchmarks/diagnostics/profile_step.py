#!/usr/bin/env python
"""Where a training step's device time goes: `scripts/train.py` with the given flags, its optimizer steps 20–40
under `torch.profiler` (CUDA kernels on a GPU), the kernels' table sorted by device time printed after the
run's own output. Inside a replayed CUDA graph the profiler sees one launch, not its kernels, so on the
graphed path (`--training_path auto` on a GPU, compiled or not) the profiled steps run the captured step's
body directly: the same kernels, compiled ones included, launched one by one.

    python benchmarks/diagnostics/profile_step.py --recipe handout --attention_type vanilla --data_dir .data \\
        --mixed_precision bf16 --torch_compile --pretrain_max_epochs 3 --no_do_finetune --output_dir /tmp/p

Under `accelerate launch --multi_gpu --num_processes N ... benchmarks/diagnostics/profile_step.py <flags>` the
first process prints the tables (its all-reduce waits for the others: outside the graph the processes do not
launch in step). After the tables, the slowest inductor kernels are described from the code inductor
generated: what they fuse, their size hints, and the sizes they are launched with; run with
TORCHINDUCTOR_BENCHMARK_KERNEL=1, also the bytes inductor estimates each moves and the bandwidth that makes.
`--generated_code DIR` (taken out before the rest goes to train.py) also copies every module inductor generated
that defines one of the profiled kernels into DIR, whole, to be read on another machine.
"""

import os
import re
import shutil
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hf_knowgpt.commands import cli, train
from hf_knowgpt.training import fast_path, trainer

FIRST, LAST = 20, 40
INDUCTOR_KERNELS_DESCRIBED = 16
INDUCTOR, OTHER = "inductor's fused kernels", "other"
# CUDA kernels by what they do, first match wins (names as cuBLAS, inductor and hf_knowgpt.kernels give them)
KERNEL_KINDS = (
    (
        "attention (hf_knowgpt fused kernel)",
        r"_forward_kernel|_correction_kernel|_backward_kernel|attention|flash|fmha",
    ),
    ("matrix products (cuBLAS)", r"nvjet|cutlass|gemm|splitK|cublas"),
    ("optimizer and clipping (fused AdamW, foreach norms)", r"adam|multi_tensor|foreach"),
    (INDUCTOR, r"^triton_"),
    ("memory copies and fills", r"Memcpy|Memset|copy|fill"),
)
optimizer_step = trainer.KnowGPTTrainer.optimizer_step
graphed_run = fast_path.GraphedStepper.run
state = {"steps": 0, "profiler": None}


def start():
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    state["profiler"] = profile(activities=activities)
    state["profiler"].__enter__()


def stop():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    state["profiler"].__exit__(None, None, None)
    if int(os.environ.get("RANK", "0")) != 0:  # under `accelerate launch`, the first process prints the tables
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    averages = state["profiler"].key_averages()
    table = averages.table(sort_by=f"self_{device}_time_total", row_limit=40)
    steps = LAST - FIRST + 1
    print(f"\nsteps {FIRST}–{LAST} ({steps} steps):\n{table}", flush=True)
    if device == "cuda":
        kernels = [
            event
            for event in state["profiler"].events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False)  # ranges such as Optimizer.step, not kernels
        ]
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"device kernels per step: {len(kernels) / steps:.0f}, their time per step: {busy / steps:.3f} ms")
        shares, others, inductor = {}, {}, {}  # kind / name of an "other" or inductor kernel -> (count, milliseconds)

        def add(table, key, milliseconds):
            count, total = table.get(key, (0, 0.0))
            table[key] = (count + 1, total + milliseconds)

        for kernel in kernels:
            kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, kernel.name, re.I)), OTHER)
            add(shares, kind, kernel.device_time / 1e3)
            if kind == OTHER:
                add(others, kernel.name, kernel.device_time / 1e3)
            elif kind == INDUCTOR:
                add(inductor, kernel.name, kernel.device_time / 1e3)
        for kind, (count, milliseconds) in sorted(shares.items(), key=lambda item: -item[1][1]):
            print(
                f"  {kind:<52}{count / steps:>6.0f} kernels{milliseconds / steps:>9.3f} ms{milliseconds / busy:>7.0%}"
            )
        print("the 'other' kernels:")
        for name, (count, milliseconds) in sorted(others.items(), key=lambda item: -item[1][1])[:20]:
            print(f"  {name[:100]:<100}{count / steps:>6.1f} per step{milliseconds / steps:>9.4f} ms")
        slowest = sorted(inductor.items(), key=lambda item: -item[1][1])[:INDUCTOR_KERNELS_DESCRIBED]
        describe_inductor_kernels({name: (count / steps, ms / count) for name, (count, ms) in slowest})


def describe_inductor_kernels(kernels: dict[str, tuple[float, float]]):
    """What inductor fused into each of its slowest kernels, from the code it generated (its cache holds each
    compiled graph's module): the source nodes and ATen operators, the launch heuristics with their size hints,
    whether it is a combo kernel (several kernels in one launch), and the sizes its call sites launch it with. A
    name can belong to several graphs (forward, backward, batch, clipping); each is printed."""
    print("\nthe slowest inductor kernels, as generated:")
    paths = generated_modules()
    modules = [path.read_text(errors="ignore") for path in paths]
    if state.get("generated_code"):
        folder = Path(state["generated_code"])
        folder.mkdir(parents=True, exist_ok=True)
        for path, module in zip(paths, modules):
            if any(kernel_definition(name) in module for name in kernels):
                shutil.copy(path, folder / path.name)
        print(f"(the modules that define them copied to {folder})")
    for name, (per_step, milliseconds) in kernels.items():
        print(f"{name}: {per_step:.1f} per step, {1000 * milliseconds:.1f} µs each")
        for module in modules:
            for line in describe_generated_kernel(module, name, 1000 * milliseconds):
                print(f"    {line[:400]}")


def generated_modules() -> list[Path]:
    """The files of the modules inductor loaded in this process (its cache also holds other processes' graphs,
    such as tests' small models, whose kernels can bear the same names); the whole cache where it loaded none."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    loaded = [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]
    files = {Path(module.__file__) for module in loaded if getattr(module, "__file__", None)}
    return sorted(path for path in files if path.exists()) or list(Path(cache_dir()).rglob("*.py"))


def kernel_definition(name: str) -> str:
    """How a module inductor generated begins the definition of its kernel `name`."""
    return f"{name} = async_compile.triton('{name}'"


def describe_generated_kernel(module: str, name: str, microseconds: float) -> list[str]:
    """The lines of one generated module that say what kernel `name` is (none where it is not defined there)."""
    definition = kernel_definition(name)
    if definition not in module:
        return []
    before, after = module.split(definition, 1)
    comments = []
    for line in reversed(before.rstrip("\n").splitlines()):  # the comment block right above the definition
        if not line.startswith("#"):
            break
        comments.insert(0, line)
    sources = [line for line in comments if line.startswith("# Topologically Sorted Source Nodes")]
    quote = "'" * 3  # the kernel's source is a triple-quoted string
    body = after.split(quote, 2)[1] if after.count(quote) >= 2 else after
    heuristics = [
        line.strip()
        for line in body.splitlines()
        if line.startswith("@triton_heuristics") or "size_hints=" in line or "reduction_hint=" in line
    ]
    combo = ["combo kernel (several kernels in one launch)"] if "combo_grid_meta" in body else []
    launches = sorted({line.strip() for line in module.splitlines() if f"{name}.run(" in line})
    return [*sources, *heuristics, *combo, *bytes_moved(body, microseconds), *launches[:3], "--"]


def bytes_moved(body: str, microseconds: float) -> list[str]:
    """Inductor's estimate of the bytes a kernel reads and writes (`kernel_num_gb`, written into the kernel's
    metadata under TORCHINDUCTOR_BENCHMARK_KERNEL=1, from the sizes it was compiled for), and the bandwidth
    that makes at the profiled time: how far the kernel is from memory-bound."""
    found = re.search(r"'kernel_num_gb':\s*([0-9.eE+-]+)", body)
    if found is None:
        return []
    megabytes = 1000 * float(found.group(1))
    return [
        f"moves about {megabytes:.1f} MB (inductor's estimate): {1000 * megabytes / microseconds:.0f} GB/s at {microseconds:.1f} µs"
    ]


def profiled_step(self, *args, **kwargs):
    state["steps"] += 1
    if state["steps"] == FIRST:
        start()
    loss = optimizer_step(self, *args, **kwargs)
    if state["steps"] == LAST:
        stop()
    return loss


def profiled_graphed_run(self, first_step, count, should_stop):
    """Steps FIRST–LAST run the captured body outside its graph (fresh gradients, as the capture had)."""
    if first_step + count <= FIRST or first_step > LAST:
        return graphed_run(self, first_step, count, should_stop)
    for global_step in range(first_step, first_step + count):
        if not FIRST <= global_step + 1 <= LAST:
            graphed_run(self, global_step, 1, should_stop)
            continue
        capacity = self._prepare_packed(global_step) if self.packed else None
        taken = capacity not in self.graphs and self.capture(global_step, capacity)  # a later graph takes its step
        if global_step + 1 == FIRST:
            start()
        if not taken:
            self.optimizer.zero_grad(set_to_none=True)
            self._body(capacity)
        if global_step + 1 == LAST:
            stop()
    return count


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if "--generated_code" in arguments:
        at = arguments.index("--generated_code")
        state["generated_code"] = arguments[at + 1]
        del arguments[at : at + 2]
    trainer.KnowGPTTrainer.optimizer_step = profiled_step
    fast_path.GraphedStepper.run = profiled_graphed_run
    sys.argv = ["train.py", *arguments]
    cli.run_script(train.main)  # as scripts/train.py runs it: the collector held until the libraries are loaded
