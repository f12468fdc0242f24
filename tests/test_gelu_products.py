"""The MLP with GELU inside its matrix products (hf_knowgpt.kernels.gelu_products) computes what the products,
GELU and their roundings under bf16 autocast compute, forward and backward, and the model's MLP takes it only
where `layers_knowgpt.GELU_IN_PRODUCTS` asks and it applies.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`TRITON_INTERPRET=1 python -m pytest tests/test_gelu_products.py`).
"""

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import needs_kernel
from torch.nn import functional as F

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels import gelu_products
from hf_knowgpt.kernels.gelu_products import mlp_reference, mlp_with_gelu_in_products


def mlp_inputs(shape, width, hidden):
    torch.manual_seed(0)
    states = torch.randn(*shape, width, device=DEVICE, requires_grad=True)
    fc_weight = (torch.randn(hidden, width, device=DEVICE) / width**0.5).requires_grad_()
    fc_bias = torch.randn(hidden, device=DEVICE, requires_grad=True)
    proj_weight = (torch.randn(width, hidden, device=DEVICE) / hidden**0.5).requires_grad_()
    proj_bias = torch.randn(width, device=DEVICE, requires_grad=True)
    return states, fc_weight, fc_bias, proj_weight, proj_bias


def rounded_reference(states, fc_weight, fc_bias, proj_weight, proj_bias, grad):
    """The output and gradients in fp64 from the bf16-rounded inputs, rounding to bf16 where the kernels round:
    the pre-activation, the activation, the output, and the pre-activation's gradient (not the activation's)."""
    bf16 = lambda tensor: tensor.detach().bfloat16().double()  # noqa: E731
    rows = bf16(states).reshape(-1, states.shape[-1])
    fc_weight, fc_bias, proj_weight, proj_bias = map(bf16, (fc_weight, fc_bias, proj_weight, proj_bias))
    pre = bf16(rows @ fc_weight.T + fc_bias)
    activation = bf16(F.gelu(pre))
    out = bf16(activation @ proj_weight.T + proj_bias)
    grad_rows = bf16(grad).reshape(-1, grad.shape[-1])
    cdf = 0.5 * (1 + torch.erf(pre / 2**0.5))
    slope = cdf + pre * torch.exp(-0.5 * pre**2) / (2 * torch.pi) ** 0.5
    grad_pre = bf16((grad_rows @ proj_weight) * slope)
    grads = (
        (grad_pre @ fc_weight).view(states.shape),
        grad_pre.T @ rows,
        grad_pre.sum(0),
        grad_rows.T @ activation,
        grad_rows.sum(0),
    )
    return out.view(*states.shape[:-1], -1), grads


@needs_kernel
@pytest.mark.parametrize(
    "shape,width,hidden",
    [((2, 35), 32, 128), ((70,), 48, 192), ((3, 50), 64, 256)],
    ids=["3d", "2d-partial-tiles", "3d-several-inner-steps"],
)
def test_products_compute_the_rounded_composition(shape, width, hidden):
    """Output and every gradient are the fp64 composition's with the kernels' roundings, to within a unit of
    bf16 (sums in fp32 in another order may round the other way), with tiles partly outside the matrices and
    an inner dimension of one or several steps; and they are the plain layers' under the same autocast to
    within bf16's precision. A wrong GELU, derivative, bias or transposition misses by the size of the result."""
    inputs = mlp_inputs(shape, width, hidden)
    grad = torch.randn(*shape, width, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert gelu_products.gelu_products_apply(inputs[0], inputs[1], inputs[3])
        out = mlp_with_gelu_in_products(*inputs)
        plain = mlp_reference(*inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (*shape, width)
    grads = torch.autograd.grad(out, inputs, grad.bfloat16())
    plain_grads = torch.autograd.grad(plain, inputs, grad.bfloat16())
    expected, expected_grads = rounded_reference(*inputs, grad)

    unit = 2**-7
    torch.testing.assert_close(out.double(), expected, rtol=unit, atol=unit * expected.abs().max().item())
    torch.testing.assert_close(out, plain, rtol=2 * unit, atol=2 * unit * plain.abs().max().item())
    names = ("states", "fc.weight", "fc.bias", "proj.weight", "proj.bias")
    for name, got, want, autograds in zip(names, grads, expected_grads, plain_grads):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        # sums of products of bf16 numbers in fp32: a few units of fp32 of the largest term; the pre-activation's
        # gradient may round the other way than the reference's in a few elements, one unit of bf16 each
        torch.testing.assert_close(
            got.double(), want, rtol=unit, atol=unit * want.abs().max().item(), msg=lambda text, n=name: f"{n}: {text}"
        )
        # the plain path rounds the activation's gradient to bf16 before GELU's derivative: within two units
        torch.testing.assert_close(
            got,
            autograds.float(),
            rtol=4 * unit,
            atol=4 * unit * want.abs().max().item(),
            msg=lambda t, n=name: f"{n}: {t}",
        )


@needs_kernel
def test_products_without_proj_bias():
    """proj_bias None (a fused residual kernel adds it): proj's product alone, so adding the bias gives the
    output with it, to within a rounding of bf16; every other gradient is the same, bit for bit."""
    states, fc_weight, fc_bias, proj_weight, proj_bias = mlp_inputs((2, 35), 32, 128)
    weights = (states, fc_weight, fc_bias, proj_weight)
    grad = torch.randn(2, 35, 32, device=DEVICE).bfloat16()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        with_bias = mlp_with_gelu_in_products(*weights, proj_bias)
        without_bias = mlp_with_gelu_in_products(*weights, None)
    unit = 2**-7
    torch.testing.assert_close(
        without_bias.float() + proj_bias.bfloat16().float(),
        with_bias.float(),
        rtol=unit,
        atol=unit * with_bias.abs().max().item(),
    )
    for got, want in zip(
        torch.autograd.grad(without_bias, weights, grad), torch.autograd.grad(with_bias, weights, grad)
    ):
        assert torch.equal(got, want)


@needs_kernel
def test_mlp_takes_the_products_only_where_asked(monkeypatch):
    """`layers_knowgpt.mlp` runs the kernels' function while training under bf16 autocast with
    GELU_IN_PRODUCTS on, around the exact GELU; otherwise (the flag off, no gradients, fp32, GELU's tanh
    approximation) the layers as they are."""
    calls = []
    real = gelu_products.mlp_with_gelu_in_products
    monkeypatch.setattr(gelu_products, "mlp_with_gelu_in_products", lambda *args: calls.append(1) or real(*args))
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(32, 128).to(DEVICE), torch.nn.Linear(128, 32).to(DEVICE)
    states = torch.randn(40, 32, device=DEVICE)

    exact_gelu = torch.nn.GELU()

    def run(flag=True, activation=exact_gelu, autocast=True, grad=True):
        monkeypatch.setattr(layers_knowgpt, "GELU_IN_PRODUCTS", flag)
        calls.clear()
        with torch.set_grad_enabled(grad), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = layers_knowgpt.mlp(states, fc, activation, proj)
        return out, bool(calls)

    out, fused = run()
    assert fused
    plain, fused = run(flag=False)
    assert not fused
    torch.testing.assert_close(out, plain, rtol=2**-6, atol=2**-6 * plain.abs().max().item())
    assert not run(grad=False)[1]
    assert not run(autocast=False)[1]
    assert not run(activation=torch.nn.GELU(approximate="tanh"))[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the model's compiled training step runs on CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_alike_with_gelu_in_products(compiled, monkeypatch):
    """A model's loss and every parameter's gradient under bf16 autocast are the plain layers' to within bf16's
    precision with GELU inside the products, eager and compiled by inductor."""
    from test_column_sums import assert_alike_within_bf16, tiny_model_both_ways

    # one rounding fewer (the activation's gradient) moves each gradient by up to about a unit of bf16
    assert_alike_within_bf16(tiny_model_both_ways("GELU_IN_PRODUCTS", compiled, monkeypatch))
