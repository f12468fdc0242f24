"""The dropout-mask kernel (hf_knowgpt.kernels.dropout_masks) draws the uniforms its docstring states (against
Philox4x32-10 computed in Python), keeps elements at the rate asked, and repeats with the seed; and a compiled
`KnowGPTDropout` with DROPOUT_MASK_KERNEL on drops and scales as the module promises, its mask from the kernel.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU (`pip install triton`, then
`TRITON_INTERPRET=1 python -m pytest tests/test_dropout_masks.py`); the compiled module's test needs a CUDA device.
"""

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import enable_activation_checkpointing, needs_kernel

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels import dropout_masks
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


def _train_step(model, ids):
    """One forward and backward pass in training: the loss and every parameter's gradient."""
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters()]


@needs_kernel
@pytest.mark.parametrize("attention_type", ["vanilla", "synthesizer"])
def test_residual_dropouts_take_their_masks_from_one_draw(attention_type, monkeypatch):
    """DROPOUT_MASKS_TOGETHER, where the kernel's masks apply (here forced, uncompiled): one draw for the call's
    embeddings' and blocks' branches' dropouts, each taking a mask of its own, and the step is the one in which each
    dropout applies that mask alone; with gradient checkpointing every dropout draws its own."""
    from conftest import perturbed_model

    draws = []

    def recorded_draw(shape, dropped_levels, device):
        draws.append(tuple(shape))
        return dropout_keep_mask(shape, dropped_levels, device)

    monkeypatch.setattr(layers_knowgpt, "_mask_kernel", lambda states: recorded_draw)
    # no dropout of attention weights: its draws would differ between the two ways
    model = perturbed_model(attention_type, embd_pdrop=0.3, resid_pdrop=0.3, attn_pdrop=0.0).to(DEVICE).train()
    config = model.config
    ids = torch.randint(0, config.vocab_size - 1, (2, 9), device=DEVICE)
    masks_per_call = 1 + 2 * config.n_layer
    taken = []
    real_take = layers_knowgpt.DropoutMasks.take

    def recorded_take(self, states, p):
        keep = real_take(self, states, p)
        taken.append(keep)
        return keep

    monkeypatch.setattr(layers_knowgpt.DropoutMasks, "take", recorded_take)
    monkeypatch.setattr(layers_knowgpt, "DROPOUT_MASKS_TOGETHER", True)
    torch.manual_seed(5)
    together = _train_step(model, ids)
    assert draws == [(masks_per_call, 2, 9, config.n_embd)], "one draw of every residual-stream mask"
    assert len(taken) == masks_per_call and all(keep is not None for keep in taken)
    slab = taken[0]._base
    assert all(keep._base is slab for keep in taken)
    assert sorted(keep.storage_offset() for keep in taken) == [i * taken[0].numel() for i in range(masks_per_call)]

    # each dropout applying, as the module does, the mask of its own that the calls took in this order
    masks = iter([keep.clone() for keep in taken])

    def dropout_with_the_next_mask(self, input, masks_drawn_together=None):
        assert masks_drawn_together is None
        return input.mul(next(masks)).mul_(65536 / (65536 - round(self.p * 65536)))

    monkeypatch.setattr(layers_knowgpt, "DROPOUT_MASKS_TOGETHER", False)
    with monkeypatch.context() as patched:
        patched.setattr(layers_knowgpt.KnowGPTDropout, "forward", dropout_with_the_next_mask)
        alone = _train_step(model, ids)
    assert torch.equal(together[0], alone[0])
    for got, want in zip(together[1], alone[1]):
        assert torch.equal(got, want)

    draws.clear()
    taken.clear()
    monkeypatch.setattr(layers_knowgpt, "DROPOUT_MASKS_TOGETHER", True)
    enable_activation_checkpointing(model)
    _train_step(model, ids)
    assert not taken, "no masks drawn together with gradient checkpointing"
    assert all(shape == (2, 9, config.n_embd) for shape in draws)  # (a CPU's dropout draws its own way)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the masks drawn together apply to compiled CUDA steps")
def test_compiled_model_draws_its_residual_masks_once(monkeypatch):
    """Compiled for CUDA with DROPOUT_MASKS_TOGETHER: each training step draws the residual stream's masks in one
    call of the kernel, and trains (a finite loss, every parameter's gradient) as the uncompiled model does on
    average."""
    from conftest import perturbed_model

    draws = []
    real_draw = dropout_masks.dropout_keep_mask

    def recorded_draw(shape, dropped_levels, device, seed=None):
        draws.append(tuple(shape))
        return real_draw(shape, dropped_levels, device, seed)

    monkeypatch.setattr(dropout_masks, "dropout_keep_mask", recorded_draw)
    monkeypatch.setattr(layers_knowgpt, "DROPOUT_MASKS_TOGETHER", True)
    model = perturbed_model("vanilla", embd_pdrop=0.1, resid_pdrop=0.1).cuda().train()
    ids = torch.randint(0, model.config.vocab_size - 1, (4, 20), device="cuda")
    compiled = torch.compile(model)
    losses = []
    for _ in range(8):
        model.zero_grad()
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        assert all(parameter.grad is not None for parameter in model.parameters())
    # traced once, or recorded at every call where dynamo replays the list's appends: one draw a step either way
    assert set(draws) == {(1 + 2 * model.config.n_layer, 4, 20, model.config.n_embd)} and len(draws) in (1, 8)
    assert len(set(losses)) > 1, "each step draws fresh masks"
    model.zero_grad()
    with torch.no_grad():
        uncompiled = [model(ids, labels=ids).loss.item() for _ in range(8)]
    assert abs(sum(losses) / 8 - sum(uncompiled) / 8) < 0.2
