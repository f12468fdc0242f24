"""Creating a process's CUDA context on a thread of its own while the process goes on importing: off unless
`KNOWGPT_EARLY_CUDA=1`.

Why it exists: a process's first CUDA call spends a few tenths of a second in the driver (loading it, finding
the devices, creating the device's primary context), and the imports that come after torch's (transformers'
`modeling_utils` alone takes seconds) need no GPU. The thread calls the driver API itself through ctypes,
which lets go of Python's lock for each call, so the driver's work and the imports overlap; torch's own CUDA
initialization later finds the driver loaded and the primary context made (the one the CUDA runtime uses).

Why it is off: on an H200 (benchmarks/diagnostics/cuda_context_overlap.py, benchmarks/RESULTS.md) the first
CUDA tensor after the imports came 0.3 s sooner, yet the whole warm `scripts/train.py` took 1.2–1.5 s longer
in both rounds, several of its host-side phases (saving, reading the questions) 0.1–0.2 s each, for a
reason not found yet. A candidate: the driver was initialized before torch's initialization sets
`CUDA_MODULE_LOADING=LAZY` where the user has not set it, which the driver reads once; the thread now sets
that default first (not yet measured). Made through torch on the thread instead, the context held Python's
lock as long as it saved.
"""

import ctypes
import importlib.util
import os
import threading
from pathlib import Path

_context_thread: threading.Thread | None = None


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, without importing it (the thread starts before torch's
    1–2 s import): CUDA builds ship `lib/libtorch_cuda.so`."""
    spec = importlib.util.find_spec("torch")
    locations = spec.submodule_search_locations if spec is not None else None
    return bool(locations) and any((Path(folder) / "lib" / "libtorch_cuda.so").exists() for folder in locations)


def _wanted_device_index(device) -> int | None:
    """The index of the CUDA device a command will use among the visible ones, or None when it will not use
    one: `device` as the user gave it (None: the process's own, `$LOCAL_RANK` under `accelerate launch`);
    a torch without CUDA, or accelerate told to use the CPU, wants none."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not _torch_has_cuda():
        return None
    if device is None:
        return int(os.environ.get("LOCAL_RANK", "0"))
    kind, _, index = str(device).partition(":")
    if kind != "cuda":
        return None
    return int(index) if index else 0


def _retain_primary_context(index: int) -> bool:
    """Load the CUDA driver, initialize it and retain device `index`'s primary context (never released:
    torch uses it for the rest of the process). False where there is no driver or device; never raises."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver on this machine
        return False
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (
        driver.cuInit(0) == 0
        and driver.cuDeviceGet(ctypes.byref(device), index) == 0
        and driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    )


def start_cuda_context(device=None) -> threading.Thread | None:
    """Make device `device`'s CUDA context (see `_wanted_device_index`) on a daemon thread, once per process,
    and return that thread (None unless `KNOWGPT_EARLY_CUDA=1`, or when no CUDA device is wanted). Nothing
    is reported from the thread: a device that cannot be used fails the command's own first CUDA call, with
    the error where the user expects it."""
    global _context_thread
    if _context_thread is not None:
        return _context_thread
    if os.environ.get("KNOWGPT_EARLY_CUDA", "0") != "1":
        return None
    index = _wanted_device_index(device)
    if index is None:
        return None
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # torch's default, read by the driver at cuInit
    _context_thread = threading.Thread(target=_retain_primary_context, args=(index,), name="cuda-context", daemon=True)
    _context_thread.start()
    return _context_thread
