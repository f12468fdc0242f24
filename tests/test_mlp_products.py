"""The MLP with GELU inside its products (hf_knowgpt.kernels.mlp_products) computes what the plain MLP computes,
forward and backward, and the model takes it only where `layers_knowgpt.ACTIVATION_IN_PRODUCTS` applies.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`TRITON_INTERPRET=1 python -m pytest tests/test_mlp_products.py`).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE as DEVICE
from conftest import needs_kernel
from torch import nn

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels import mlp_products
from hf_knowgpt.kernels.mlp_products import activation_in_products_applies, mlp_with_activation_in_products

# The interpreter's memory holds no bf16: there the kernel runs in fp32, on a CUDA device in bf16.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _parameters(n_embd, hidden, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, scale):
        return (torch.randn(shape, generator=generator) * scale).to(DEVICE).requires_grad_()

    return (
        normal(hidden, n_embd, scale=n_embd**-0.5),
        normal(hidden, scale=0.5),
        normal(n_embd, hidden, scale=hidden**-0.5),
        normal(n_embd, scale=0.5),
    )


def _plain_mlp(states, fc_weight, fc_bias, proj_weight, proj_bias):
    return F.linear(F.gelu(F.linear(states, fc_weight, fc_bias)), proj_weight, proj_bias)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 200, 333])
@pytest.mark.parametrize("with_proj_bias", [True, False])
def test_mlp_and_its_gradients_are_the_plain_mlps(tokens, with_proj_bias):
    """Output and every gradient against F.linear, F.gelu, F.linear in fp64, for token counts that fill no tile,
    several, and end inside one; proj's bias left out (the model adds it after) or not."""
    torch.manual_seed(0)
    n_embd, hidden = 128, 512
    fc_weight, fc_bias, proj_weight, proj_bias = _parameters(n_embd, hidden)
    proj_bias = proj_bias if with_proj_bias else None
    states = torch.randn(1, tokens, n_embd, device=DEVICE, requires_grad=True)
    inputs = [states, fc_weight, fc_bias, proj_weight] + ([proj_bias] if with_proj_bias else [])
    grad = torch.randn(1, tokens, n_embd, device=DEVICE)
    with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
        out = mlp_with_activation_in_products(states, fc_weight, fc_bias, proj_weight, proj_bias)
    assert out.shape == (1, tokens, n_embd) and out.dtype == DTYPE
    got = torch.autograd.grad(out, inputs, grad.to(out.dtype))
    reference = [tensor.detach().double().requires_grad_() for tensor in inputs]
    want_out = _plain_mlp(*reference[:4], reference[4] if with_proj_bias else None)
    want = torch.autograd.grad(want_out, reference, grad.double())
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if DTYPE == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out.double(), want_out, **tolerance)
    for name, got_grad, want_grad, tensor in zip(
        ["states", "fc.weight", "fc.bias", "proj.weight", "proj.bias"], got, want, inputs
    ):
        assert got_grad.dtype == tensor.dtype, name  # each parameter's gradient in its own dtype
        scale = want_grad.abs().max()
        torch.testing.assert_close(got_grad.double() / scale, want_grad / scale, **tolerance, msg=name)


@needs_kernel
@pytest.mark.skipif(DTYPE != torch.float32, reason="checks the epilogue's fp32 arithmetic: the interpreter's dtype")
def test_gelu_in_the_products_is_within_rounding_of_torchs_exact_gelu():
    """The epilogue's GELU and GELU′ come from one exponential (A&S 7.1.26): against torch's erf over a range of
    states that covers both tails, they differ by no more than fp32's rounding would."""
    n_embd, hidden = 128, 128
    states = torch.linspace(-9, 9, 256 * n_embd, device=DEVICE).view(256, n_embd).requires_grad_()
    identity = torch.eye(n_embd, device=DEVICE)
    fc_weight = identity.requires_grad_()
    fc_bias = torch.zeros(hidden, device=DEVICE, requires_grad=True)
    proj_weight = identity.clone().requires_grad_()
    out = mlp_with_activation_in_products(states, fc_weight, fc_bias, proj_weight, None)
    (grad_states,) = torch.autograd.grad(out, states, torch.ones_like(out))
    exact = states.detach().double()
    torch.testing.assert_close(out.double(), F.gelu(exact), rtol=0, atol=5e-7)
    slope = torch.ops.aten.gelu_backward(torch.ones_like(exact), exact)
    torch.testing.assert_close(grad_states.double(), slope, rtol=0, atol=5e-7)


def test_the_kernels_constants_are_the_layers():
    """The kernel restates layers_knowgpt's A&S constants (it cannot import the model's files)."""
    assert mlp_products.ERF_P == layers_knowgpt._ERF_P
    assert mlp_products.ERF_A == layers_knowgpt._ERF_A


@needs_kernel
def test_the_kernel_takes_only_whole_tiles_of_features():
    states = torch.zeros(4, 256, device=DEVICE)
    assert activation_in_products_applies(states, torch.zeros(1024, 256, device=DEVICE), DTYPE)
    assert not activation_in_products_applies(states, torch.zeros(1000, 256, device=DEVICE), DTYPE)
    assert not activation_in_products_applies(states[:, :96], torch.zeros(384, 96, device=DEVICE), DTYPE)
    with pytest.raises(ValueError, match=r"no kernel .* weights \(1000, 256\)"):
        mlp_with_activation_in_products(states, torch.zeros(1000, 256, device=DEVICE), None, None, None)


def test_the_model_takes_the_kernel_only_when_compiling_for_cuda_under_16_bit_autocast():
    """Uncompiled, on a CPU or without autocast, the MLP runs as its layers: `_mlp_function` gives None."""
    fc, proj = nn.Linear(256, 1024), nn.Linear(1024, 256)
    states = torch.zeros(2, 256)
    assert layers_knowgpt._mlp_function(states, fc, nn.GELU(), proj) is None
    assert layers_knowgpt._mlp_function(states, fc, nn.GELU(approximate="tanh"), proj) is None
