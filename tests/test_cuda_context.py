"""The CUDA context made on a thread while a command imports (hf_knowgpt.utils.cuda_context): which device a
`--device` value names, the driver calls made, nothing where there is no driver, and torch working on the
context so made (on a CUDA machine)."""

import subprocess
import sys

import pytest
import torch

from hf_knowgpt.utils import cuda_context


@pytest.mark.parametrize(
    "device,index",
    [(None, 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("mps", None), ("cuda:x", None)],
)
def test_device_index(device, index):
    assert cuda_context.device_index(device) == index


class FakeDriver:
    def __init__(self, init_status=0):
        self.calls, self.init_status = [], init_status

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self.init_status

    def cuDeviceGet(self, device_pointer, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        device_pointer._obj.value = 10 + ordinal  # byref(c_int): the handle the driver would write
        return 0

    def cuDevicePrimaryCtxRetain(self, context_pointer, device):
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value))
        return 0


def test_the_thread_retains_the_named_devices_primary_context(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda_context.ctypes, "CDLL", lambda name: driver)
    thread = cuda_context.start_primary_context("cuda:2")
    thread.join(timeout=10)
    assert thread.daemon and not thread.is_alive()
    assert driver.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 12)]


def test_a_failed_init_goes_no_further(monkeypatch):
    driver = FakeDriver(init_status=100)  # CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(cuda_context.ctypes, "CDLL", lambda name: driver)
    cuda_context.start_primary_context(None).join(timeout=10)
    assert driver.calls == [("cuInit", 0)]


def test_no_driver_no_error(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_context.ctypes, "CDLL", missing)
    thread = cuda_context.start_primary_context(None)
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_no_thread_off_cuda_or_when_disabled(monkeypatch):
    assert cuda_context.start_primary_context("cpu") is None
    monkeypatch.setattr(cuda_context, "ENABLED", False)
    assert cuda_context.start_primary_context("cuda") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and its driver")
def test_torch_runs_on_the_context_made_by_the_thread():
    """In a fresh process: the thread's context made before torch is imported, torch then computes on the
    device, and the context current there is the device's primary context (the one the thread retained)."""
    code = (
        "from hf_knowgpt.utils import cuda_context\n"
        "cuda_context.start_primary_context('cuda').join()\n"
        "import ctypes, torch\n"
        "assert (torch.arange(4, device='cuda') * 2).tolist() == [0, 2, 4, 6]\n"
        "driver = ctypes.CDLL('libcuda.so.1')\n"
        "flags, active = ctypes.c_uint(), ctypes.c_int()\n"
        "assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0\n"
        "assert active.value == 1\n"
        "current, primary = ctypes.c_void_p(), ctypes.c_void_p()\n"
        "assert driver.cuCtxGetCurrent(ctypes.byref(current)) == 0\n"
        "assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0\n"
        "assert current.value == primary.value, (current.value, primary.value)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_lazy_module_loading_as_torch_sets_it(monkeypatch):
    """The driver reads CUDA_MODULE_LOADING at cuInit, which the thread now calls before torch: the thread sets
    torch's default first, and leaves a user's own value alone."""
    monkeypatch.setattr(cuda_context.ctypes, "CDLL", lambda name: FakeDriver())
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    cuda_context.start_primary_context("cuda").join(timeout=10)
    assert cuda_context.os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    cuda_context.start_primary_context("cuda").join(timeout=10)
    assert cuda_context.os.environ["CUDA_MODULE_LOADING"] == "EAGER"
