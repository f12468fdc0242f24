"""A CUDA device's context made on a thread while a command imports its libraries.

A process's first use of a CUDA device makes the device's primary context (the driver's `cuInit` and
`cuDevicePrimaryCtxRetain`), a few tenths of a second on an H200 (benchmarks/RESULTS.md). Torch makes it inside
calls that hold the interpreter's lock, so nothing else runs meanwhile; the driver's own calls through ctypes let
it go, so made on a thread the context is ready by the time torch asks for it, and torch's runtime then takes
the same primary context. Nothing here imports torch.
"""

import ctypes
import os
import threading

# False: no thread; torch makes the context when it first needs it (what a benchmark compares against).
ENABLED = True


def device_index(device: str | None) -> int | None:
    """The CUDA ordinal of a `--device` value: None and "cuda" (CUDA where there is one) are device 0; None for a
    device that is not CUDA's."""
    if device is None or device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def _make_primary_context(index: int) -> None:
    """cuInit, then retain device `index`'s primary context (kept until the process ends); on any failure, no
    driver or no such device, nothing: torch reports it as it would."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), index) == 0:
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)


def start_primary_context(device: str | None) -> threading.Thread | None:
    """Start making the primary context of the CUDA device that `device` names (`device_index`) on a daemon
    thread, and return it; None where ENABLED is off or the device is not CUDA's."""
    index = device_index(device)
    if not ENABLED or index is None:
        return None
    # read by the driver at cuInit: torch sets this default before its own, which now comes second
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    thread = threading.Thread(target=_make_primary_context, args=(index,), name="cuda-context", daemon=True)
    thread.start()
    return thread


__all__ = ["device_index", "start_primary_context"]
