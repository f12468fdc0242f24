"""The CUDA context made on a thread while a command imports (hf_knowgpt.utils.cuda_context)."""

import os

import pytest
import torch

from hf_knowgpt.utils import cuda_context


@pytest.fixture(autouse=True)
def no_thread_yet(monkeypatch):
    monkeypatch.setattr(cuda_context, "_context_thread", None)
    for name in ("LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KNOWGPT_EARLY_CUDA", "1")  # asked for (off by default)


@pytest.fixture
def retained(monkeypatch):
    """A CUDA build of torch, whatever this machine's is; the driver calls replaced by a record of the
    device index whose context would be made."""
    indices = []
    monkeypatch.setattr(cuda_context, "_torch_has_cuda", lambda: True)
    monkeypatch.setattr(cuda_context, "_retain_primary_context", indices.append)
    return indices


def test_the_context_is_made_once_for_the_process_device(retained, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second process of accelerate launch uses cuda:1
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    thread = cuda_context.start_cuda_context()
    thread.join()
    assert retained == [1]
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # what torch would have set before initializing the driver
    assert cuda_context.start_cuda_context() is thread
    assert retained == [1]


@pytest.mark.parametrize("device, index", [("cuda:2", 2), ("cuda", 0), (torch.device("cuda", 3), 3)])
def test_the_device_the_user_named_is_the_one_made(retained, device, index):
    cuda_context.start_cuda_context(device).join()
    assert retained == [index]


@pytest.mark.parametrize(
    "device, environment",
    [("cpu", {}), ("mps", {}), (None, {"KNOWGPT_EARLY_CUDA": "0"}), (None, {"KNOWGPT_EARLY_CUDA": None}),
     (None, {"ACCELERATE_USE_CPU": "true"})],
)  # fmt: skip
def test_no_context_where_no_gpu_is_wanted_or_unasked(retained, monkeypatch, device, environment):
    for name, value in environment.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    assert cuda_context.start_cuda_context(device) is None
    assert retained == []


def test_the_build_is_read_without_importing_torch():
    assert cuda_context._torch_has_cuda() == torch.backends.cuda.is_built()


def test_a_torch_without_cuda_starts_nothing(monkeypatch):
    monkeypatch.setattr(cuda_context, "_torch_has_cuda", lambda: False)
    assert cuda_context.start_cuda_context() is None


def test_the_driver_calls_report_instead_of_raising():
    """No driver (a CPU machine) or no such device: False, nothing raised on the thread."""
    assert cuda_context._retain_primary_context(10_000) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_torch_uses_the_context_the_thread_made():
    assert cuda_context._retain_primary_context(0) is True
    assert torch.empty(1, device="cuda:0").device == torch.device("cuda", 0)
