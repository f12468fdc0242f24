"""The dropout-mask kernel (hf_knowgpt.kernels.dropout_masks) draws the uniforms its docstring states (against
Philox4x32-10 computed in Python), keeps elements at the rate asked, and repeats with the seed; and a compiled
`KnowGPTDropout` with DROPOUT_MASK_KERNEL on drops and scales as the module promises, its mask from the kernel.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU (`pip install triton`, then
`TRITON_INTERPRET=1 python -m pytest tests/test_dropout_masks.py`); the compiled module's test needs a CUDA device.
"""

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import needs_kernel

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels.dropout_masks import dropout_keep_mask, philox_reference


@needs_kernel
@pytest.mark.parametrize("shape", [(1,), (13,), (37, 96), (3, 1000, 7)], ids=str)
@pytest.mark.parametrize("seed", [0, 9, 2**40 + 77])
def test_mask_is_the_stated_philox_uniforms_at_the_threshold(shape, seed):
    """Every element (sizes not a multiple of 8, several programs, a seed past 32 bits) is kept exactly where
    its uniform, computed in plain Python, is at least the threshold."""
    dropped_levels = round(0.1 * 2**16)
    keep = dropout_keep_mask(shape, dropped_levels, DEVICE, torch.tensor([seed], device=DEVICE))
    assert keep.dtype == torch.bool and keep.shape == torch.Size(shape)
    numel = keep.numel()
    expected = philox_reference(seed, numel) >= dropped_levels
    assert torch.equal(keep.flatten().cpu(), expected)


@needs_kernel
def test_mask_keeps_at_the_rate_asked_and_repeats_with_the_seed():
    torch.manual_seed(0)
    for p in (0.1, 0.5):
        keep = dropout_keep_mask((200, 1000), round(p * 2**16), DEVICE)
        assert abs(keep.double().mean().item() - (1 - p)) < 0.005  # 200k draws: > 7 standard deviations
    # the lanes of one evaluation are not copies of each other: neighbours agree about as often as chance has it
    keep = dropout_keep_mask((80000,), 2**15, DEVICE).view(-1, 8).double()
    for lane in range(1, 8):
        assert abs((keep[:, 0] == keep[:, lane]).double().mean().item() - 0.5) < 0.02
    torch.manual_seed(3)
    first = dropout_keep_mask((50, 64), 6554, DEVICE)
    torch.manual_seed(3)
    assert torch.equal(dropout_keep_mask((50, 64), 6554, DEVICE), first)
    assert not torch.equal(dropout_keep_mask((50, 64), 6554, DEVICE), first)  # a fresh seed next call
    assert dropout_keep_mask((40,), 0, DEVICE).all() and not dropout_keep_mask((40,), 2**16, DEVICE).any()
    with pytest.raises(ValueError, match="dropped_levels"):
        dropout_keep_mask((4,), 2**16 + 1, DEVICE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the module's kernel mask applies to compiled CUDA steps")
def test_compiled_dropout_takes_its_mask_from_the_kernel(monkeypatch):
    """Compiled on CUDA with DROPOUT_MASK_KERNEL: the step's code calls the kernel, the module drops at rate p,
    scales kept elements by 2¹⁶ / (2¹⁶ − round(p·2¹⁶)), passes gradients where it kept values, and draws anew
    each call; uncompiled, it is torch's dropout."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(layers_knowgpt, "DROPOUT_MASK_KERNEL", True)
    p = 0.1
    dropout = layers_knowgpt.KnowGPTDropout(p).train()
    compiled = torch.compile(dropout, fullgraph=True)
    states = (torch.rand(300, 1000, device="cuda") + 1).requires_grad_()  # no zeros of its own
    dropped, codes = run_and_get_code(compiled, states)
    assert any("dropout_keep_mask" in code or "_keep_mask_kernel" in code for code in codes)
    kept = dropped != 0
    assert abs(1 - kept.double().mean().item() - p) < 0.005
    scale = 65536 / (65536 - round(p * 65536))
    torch.testing.assert_close(dropped[kept], states.detach()[kept] * scale)
    dropped.sum().backward()
    torch.testing.assert_close(states.grad, kept.float() * scale)
    assert not torch.equal(compiled(states) != 0, kept)
