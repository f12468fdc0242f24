"""The column-sum kernel (hf_knowgpt.kernels.column_sums) sums a matrix's rows as torch does, and a LayerNorm's
Σ g·x̂ and Σ g; the linear layers that take their bias gradient from it (`layers_knowgpt.BIAS_GRADIENT_KERNEL`)
and the LayerNorms that take their weight and bias gradients from it (`LAYER_NORM_GRADIENT_KERNEL`) train as
autograd's do.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`TRITON_INTERPRET=1 python -m pytest tests/test_column_sums.py`).
"""

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import TRITON_INTERPRETED, needs_kernel, tiny_config

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels import column_sums as column_sums_module
from hf_knowgpt.kernels.column_sums import (
    column_sums,
    layer_norm_parameter_sums,
    layer_norm_with_summed_parameter_gradients,
    linear_with_summed_bias_gradient,
)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 96), (300, 257), (1100, 64), (2049, 768)])
def test_kernel_sums_every_column_over_every_row(rows, cols, dtype):
    """fp32 sums of every column, whatever the row count against the strips (one row; more rows than strips
    hold at once) and the column count against the blocks (257: a partial block)."""
    torch.manual_seed(0)
    matrix = torch.randn(rows, cols, device=DEVICE).to(dtype)
    got = column_sums(matrix)
    want = matrix.double().sum(0)
    assert got.dtype == torch.float32 and got.shape == (cols,)
    # fp32 sums of up to ~2000 terms of size ~1: off by a few units of fp32's last place of the partial sums
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_column_sums_takes_a_matrix():
    with pytest.raises(ValueError, match=r"takes a \(rows, columns\) matrix, got shape \(2, 3, 4\)"):
        column_sums(torch.zeros(2, 3, 4))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 96), (300, 257), (2049, 256)])
def test_kernel_sums_a_layer_norms_parameter_gradients(rows, cols, dtype):
    """Σ g·(x − mean)·rstd and Σ g over the rows, fp32, for gradients of either dtype (fp32 inputs, as a
    LayerNorm under autocast has), whatever the row and column counts against the strips and blocks."""
    torch.manual_seed(0)
    grad = torch.randn(rows, cols, device=DEVICE).to(dtype)
    x = torch.randn(rows, cols, device=DEVICE) * 3 + 1
    mean, rstd = x.mean(1), x.var(1, unbiased=False).add(1e-5).rsqrt()
    got_weight, got_bias = layer_norm_parameter_sums(grad, x, mean, rstd)
    normalized = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    want_weight, want_bias = (grad.double() * normalized).sum(0), grad.double().sum(0)
    assert got_weight.dtype == got_bias.dtype == torch.float32 and got_weight.shape == got_bias.shape == (cols,)
    torch.testing.assert_close(got_weight.double(), want_weight, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_bias.double(), want_bias, rtol=1e-5, atol=1e-4)


def test_layer_norm_parameter_sums_names_the_shapes_it_takes():
    with pytest.raises(ValueError, match=r"mean and rstd per row, got \(4, 8\), \(4, 8\), \(4, 1\), \(4, 1\)"):
        layer_norm_parameter_sums(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 1), torch.zeros(4, 1))


def test_layer_norm_with_summed_parameter_gradients_is_autograds_layer_norm():
    """The output and the input's gradient are F.layer_norm's bit for bit; the weight's and bias's gradients
    are fp32 sums of the same terms in another order (by the kernel on a CUDA device or under Triton's
    interpreter, else by torch)."""
    torch.manual_seed(0)
    states = (torch.randn(3, 50, 64, device=DEVICE) * 2 + 0.5).requires_grad_()
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    bias = torch.randn(64, device=DEVICE, requires_grad=True)
    grad = torch.randn(3, 50, 64, device=DEVICE)
    out = torch.nn.functional.layer_norm(states, (64,), weight, bias, 1e-5)
    want = torch.autograd.grad(out, (states, weight, bias), grad)
    out2 = layer_norm_with_summed_parameter_gradients(states, weight, bias, 1e-5)
    got = torch.autograd.grad(out2, (states, weight, bias), grad)
    assert torch.equal(out2, out)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for name, have, expected in zip(("weight", "bias"), got[1:], want[1:]):
        assert have.dtype == torch.float32
        torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-5, msg=lambda text, n=name: f"{n}: {text}")
    # the input frozen (only the LayerNorm trained): no input gradient is asked for
    (grad_weight,) = torch.autograd.grad(
        layer_norm_with_summed_parameter_gradients(states.detach(), weight, bias, 1e-5), weight, grad
    )
    torch.testing.assert_close(grad_weight, want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_linear_with_summed_bias_gradient_is_autograds_linear(autocast):
    """The layer's output and gradients are F.linear's under the same autocast: the products bit for bit, the
    bias gradient summed in fp32 where autograd rounds its sum to bf16 first (by the kernel on a CUDA device or
    under Triton's interpreter, else by torch)."""
    torch.manual_seed(0)
    states = torch.randn(3, 50, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(96, 32, device=DEVICE, requires_grad=True)
    bias = torch.randn(96, device=DEVICE, requires_grad=True)
    grad = torch.randn(3, 50, 96, device=DEVICE)
    results = []
    for summed in (False, True):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            if summed:
                out = linear_with_summed_bias_gradient(states, weight, bias)
            else:
                out = torch.nn.functional.linear(states, weight, bias)
        results.append((out, *torch.autograd.grad(out, (states, weight, bias), grad.to(out.dtype))))
    (out, grad_states, grad_weight, grad_bias), (out2, grad_states2, grad_weight2, grad_bias2) = results
    assert out2.dtype == out.dtype and torch.equal(out2, out)
    assert grad_states2.dtype == torch.float32 and grad_weight2.dtype == torch.float32
    torch.testing.assert_close(grad_states2, grad_states, rtol=0, atol=0)
    torch.testing.assert_close(grad_weight2, grad_weight, rtol=0, atol=0)
    exact = grad.to(out.dtype).double().sum((0, 1))
    torch.testing.assert_close(grad_bias2.double(), exact, rtol=1e-5, atol=1e-4)
    # autograd's sum is rounded to the products' dtype, within one of its units of the kernel's; in fp32 both
    # sums are fp32's, of 150 terms in another order: a few units of their partial sums apart
    unit = 2**-8 if autocast else 2**-16
    torch.testing.assert_close(grad_bias, grad_bias2, rtol=unit, atol=unit * exact.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers take the kernel on CUDA tensors only")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("flag", ["BIAS_GRADIENT_KERNEL", "LAYER_NORM_GRADIENT_KERNEL"])
def test_model_trains_alike_with_the_column_sum_kernel(flag, compiled, monkeypatch):
    """A model's loss and every parameter's gradient under bf16 autocast are the same with the attention's and
    the MLP's first bias gradients (BIAS_GRADIENT_KERNEL), or the LayerNorms' weight and bias gradients
    (LAYER_NORM_GRADIENT_KERNEL), by the kernel (compiled by inductor, or not) as without; the other flag off."""
    from hf_knowgpt import KnowGPTForCausalLM

    for other in {"BIAS_GRADIENT_KERNEL", "LAYER_NORM_GRADIENT_KERNEL"} - {flag}:
        monkeypatch.setattr(layers_knowgpt, other, False)
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config(resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)).cuda().train()
    ids = torch.randint(0, model.config.vocab_size, (4, model.config.block_size), device="cuda")
    seen = []
    for kernel in (False, True):
        monkeypatch.setattr(layers_knowgpt, flag, kernel)
        model.zero_grad()
        step = torch.compile(model, dynamic=False) if compiled else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        seen.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        torch._dynamo.reset()
    (loss, grads), (loss2, grads2) = seen
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    if flag == "BIAS_GRADIENT_KERNEL":
        summed = ("fc.bias", "attn.query.bias", "attn.key.bias", "attn.value.bias")
    else:
        summed = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "ln_f.weight", "ln_f.bias")
    overall_largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        # The bias gradients differ by autograd's bf16 rounding of its sums; a LayerNorm's by the order of the
        # fp32 sums. The rest are the same products and sums, bit for bit eager. Compiled, inductor fuses the
        # two graphs' kernels apart, so an fp32 sum (a LayerNorm's backward, say) may come in another order;
        # where its result is then rounded to bf16 for the next product, that can move it one bf16 unit, and
        # the layers below carry it on: an H200 gave the embedding's gradient 2.9e-5 apart where its largest
        # element is 0.14 (2^-12.3 of it), another run 1.5e-8. A wrong gradient (a missing or transposed term)
        # is apart by the size of the gradient itself. A gradient far below the model's largest is the rounding
        # of sums that cancel (the keys' bias: softmax ignores a shift shared by every key, so its exact gradient
        # is zero; an H200 gave 4.6e-8 at most, 7.5e-9 apart), so the bound is of the model's gradients too.
        largest = max(grad.abs().max().item(), 2**-10 * overall_largest)
        if name.endswith(summed) or compiled:
            tolerance = dict(rtol=2**-7, atol=2**-10 * largest)
        else:
            tolerance = dict(rtol=0, atol=0)
        torch.testing.assert_close(grads2[name], grad, **tolerance, msg=lambda text, n=name: f"{n}: {text}")


def test_linear_with_summed_bias_gradient_of_a_bias_alone():
    """Only the bias trained (inputs and weight frozen, as BitFit trains): its gradient, and no product for the
    others."""
    torch.manual_seed(0)
    states, weight = torch.randn(2, 5, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    bias = torch.randn(4, device=DEVICE, requires_grad=True)
    grad = torch.randn(2, 5, 4, device=DEVICE)
    out = linear_with_summed_bias_gradient(states, weight, bias)
    (grad_bias,) = torch.autograd.grad(out, bias, grad)
    torch.testing.assert_close(grad_bias, grad.sum((0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    TRITON_INTERPRETED, reason="the interpreter would run the kernel on the trace's fake tensors, which have no data"
)
def test_layers_take_the_kernel_path_in_one_compiled_graph(monkeypatch):
    """The model's linear layers (`layers_knowgpt.linear`, `project`) and LayerNorms (`layer_norm`) choose the
        kernel's path inside a graph that torch.compile captures whole, as the compiled training step is (fullgraph):
        here on the CPU, the kernel's path allowed there and its sums falling back to torch's. The path is the one
        taken: under bf16 autocast the linear layers' bias gradients are fp32 sums, where autograd's are rounded to
        bf16, and the LayerNorm's backward takes its parameters' gradients from `layer_norm_parameter_sums` (doubled here, to tell
    them from autograd's)."""
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(column_sums_module, "column_sums_available", lambda: True)

    def doubled_layer_norm_parameter_sums(*arguments):  # marks the path: the LayerNorm's gradients come out doubled
        return tuple(2 * sums for sums in layer_norm_parameter_sums(*arguments))

    monkeypatch.setattr(column_sums_module, "layer_norm_parameter_sums", doubled_layer_norm_parameter_sums)
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(16)
    fc, query, key = (torch.nn.Linear(16, 48) for _ in range(3))
    states = torch.randn(40, 16, requires_grad=True)

    def layers(states):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            normalized = layers_knowgpt.layer_norm(norm, states)
            first = layers_knowgpt.linear(fc, normalized)
            second, third = layers_knowgpt.project(normalized, (query, key))
        return (first.float() ** 2).sum() + (second.float() * third.float()).sum()

    names = ("states", "fc.bias", "query.bias", "key.bias", "fc.weight", "norm.weight", "norm.bias")
    parameters = [states, fc.bias, query.bias, key.bias, fc.weight, norm.weight, norm.bias]
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL", False)
    monkeypatch.setattr(layers_knowgpt, "LAYER_NORM_GRADIENT_KERNEL", False)
    by_autograd = torch.autograd.grad(layers(states), parameters)
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL", True)
    monkeypatch.setattr(layers_knowgpt, "LAYER_NORM_GRADIENT_KERNEL", True)
    compiled = torch.compile(layers, fullgraph=True, backend="aot_eager")
    by_kernel = torch.autograd.grad(compiled(states), parameters)
    for name, got, want in zip(names, by_kernel, by_autograd):
        want = 2 * want if name.startswith("norm.") else want
        unit = 2**-7 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=unit, msg=lambda text, n=name: f"{n}: {text}")
    assert not torch.equal(by_kernel[1], by_autograd[1]), "the bias gradient was autograd's bf16 sum"
