"""The column-sum kernel (hf_knowgpt.kernels.column_sums) sums a matrix's rows as torch does, and the linear layers
that take their bias gradient from it (`layers_knowgpt.BIAS_GRADIENT_KERNEL`), and their weight gradient as a
product written in fp32 (`layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`), train as autograd's do.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`TRITON_INTERPRET=1 python -m pytest tests/test_column_sums.py`).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE as DEVICE
from conftest import TRITON_INTERPRETED, needs_kernel, tiny_config

from hf_knowgpt import layers_knowgpt
from hf_knowgpt.kernels import column_sums as column_sums_module
from hf_knowgpt.kernels.column_sums import column_sums, linear_with_summed_bias_gradient


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


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_linear_without_a_bias_is_autograds_linear(autocast):
    """With no bias (a branch whose bias a fused kernel adds) the function is F.linear without one, output and
    gradients bit for bit; and `layers_knowgpt.linear(..., leave_bias_out=True)` leaves a plain layer's bias out
    (`branch_bias` hands it over) and runs another layer whole."""
    torch.manual_seed(0)
    states = torch.randn(3, 50, 32, device=DEVICE, requires_grad=True)
    layer = torch.nn.Linear(32, 96).to(DEVICE)
    grad = torch.randn(3, 50, 96, device=DEVICE)
    results = []
    for function in (linear_with_summed_bias_gradient, lambda states, weight, bias: F.linear(states, weight)):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = function(states, layer.weight, None)
        results.append((out, *torch.autograd.grad(out, (states, layer.weight), grad.to(out.dtype))))
    for got, want in zip(*results):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        unbiased = layers_knowgpt.linear(layer, states, leave_bias_out=True)
        assert layers_knowgpt.branch_bias(layer) is layer.bias
        torch.testing.assert_close(unbiased, results[1][0], rtol=0, atol=0)
        layer.register_forward_hook(lambda module, inputs, output: None)
        assert layers_knowgpt.branch_bias(layer) is None
        torch.testing.assert_close(layers_knowgpt.linear(layer, states, leave_bias_out=True), layer(states))


def tiny_model_both_ways(flag, compiled: bool, monkeypatch, dynamic: bool = False):
    """A tiny model's loss and every parameter's gradient under bf16 autocast, on CUDA, with `layers_knowgpt.<flag>`
    (or, for a callable `flag`, `flag(model, value)`) False and then True, compiled by inductor (for a symbolic
    token count where `dynamic`) or not: ((loss, gradients), (loss, gradients))."""
    from hf_knowgpt import KnowGPTForCausalLM

    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config(resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)).cuda().train()
    ids = torch.randint(0, model.config.vocab_size, (4, model.config.block_size), device="cuda")
    seen = []
    for value in (False, True):
        if callable(flag):
            flag(model, value)
        else:
            monkeypatch.setattr(layers_knowgpt, flag, value)
        model.zero_grad()
        step = torch.compile(model, dynamic=dynamic) if compiled else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(input_ids=ids, labels=ids).loss
        loss.backward()
        seen.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        torch._dynamo.reset()
    return seen


def assert_alike_within_bf16(both_ways):
    """The second of `tiny_model_both_ways`'s pairs is the first to within bf16's precision: the loss within a unit,
    each gradient within about a unit of bf16 of its largest element (one rounding more or fewer moves it so far),
    or of the model's largest gradient where its own are far below (sums that cancel)."""
    (loss, grads), (loss2, grads2) = both_ways
    torch.testing.assert_close(loss2, loss, rtol=2**-7, atol=0)
    overall_largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        bound = 2**-6 * max(grad.abs().max().item(), 2**-6 * overall_largest)
        torch.testing.assert_close(grads2[name], grad, rtol=2**-5, atol=bound, msg=lambda t, n=name: f"{n}: {t}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers take the kernel on CUDA tensors only")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_alike_with_the_bias_gradient_kernel(compiled, monkeypatch):
    """A model's loss and every parameter's gradient under bf16 autocast are the same with the attention's and
    the MLP's first bias gradients by the kernel (compiled by inductor, or not) as without."""
    monkeypatch.setattr(layers_knowgpt, "WEIGHT_GRADIENT_IN_FP32", False)  # autograd's weight gradients either way
    (loss, grads), (loss2, grads2) = tiny_model_both_ways("BIAS_GRADIENT_KERNEL", compiled, monkeypatch)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    overall_largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        # The bias gradients differ by autograd's bf16 rounding of its sums. The rest are the same products and
        # sums, bit for bit eager. Compiled, inductor fuses the two graphs' kernels apart, so an fp32 sum (a
        # LayerNorm's backward, say) may come in another order; where its result is then rounded to bf16 for the
        # next product, that can move it one bf16 unit, and the layers below carry it on: an H200 gave the
        # embedding's gradient 2.9e-5 apart where its largest element is 0.14 (2^-12.3 of it), another run
        # 1.5e-8. A wrong gradient (a missing or transposed term) is apart by the size of the gradient itself. A
        # gradient far below the model's largest is the rounding of sums that cancel (the keys' bias: softmax
        # ignores a shift shared by every key, so its exact gradient is zero; an H200 gave 4.6e-8 at most, 7.5e-9
        # apart), so the bound is of the model's gradients too. Compiled without the kernel, inductor may sum a
        # bias gradient's terms before their rounding to bf16 (it does not emulate a fused kernel's casts), where
        # the kernel sums the rounded terms: within a bf16 unit of the largest element (an H100 gave the MLP's first
        # bias 2.1e-5 apart where its largest element is 0.0107, 2^-9 of it).
        summed = name.endswith(("fc.bias", "attn.query.bias", "attn.key.bias", "attn.value.bias"))
        largest = max(grad.abs().max().item(), 2**-10 * overall_largest)
        if summed and compiled:
            tolerance = dict(rtol=2**-7, atol=2**-7 * largest)
        elif summed or compiled:
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
    """The model's linear layers (`layers_knowgpt.linear`, `project`) choose the kernel's path inside a graph that
    torch.compile captures whole, as the compiled training step is (fullgraph): here on the CPU, the kernel's
    path allowed there and its sums falling back to torch's. The path is the one taken: under bf16 autocast its
    bias gradients are fp32 sums, where autograd's are rounded to bf16."""
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(column_sums_module, "column_sums_available", lambda: True)
    monkeypatch.setattr(layers_knowgpt, "WEIGHT_GRADIENT_IN_FP32", False)  # autograd's path when the kernel's is off
    torch.manual_seed(0)
    fc, query, key = (torch.nn.Linear(16, 48) for _ in range(3))
    states = torch.randn(40, 16, requires_grad=True)

    def layers(states):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first = layers_knowgpt.linear(fc, states)
            second, third = layers_knowgpt.project(states, (query, key))
        return (first.float() ** 2).sum() + (second.float() * third.float()).sum()

    parameters = [states, fc.bias, query.bias, key.bias, fc.weight]
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL", False)
    by_autograd = torch.autograd.grad(layers(states), parameters)
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL", True)
    compiled = torch.compile(layers, fullgraph=True, backend="aot_eager")
    by_kernel = torch.autograd.grad(compiled(states), parameters)
    for name, got, want in zip(("states", "fc.bias", "query.bias", "key.bias", "fc.weight"), by_kernel, by_autograd):
        unit = 2**-7 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2**-7, atol=unit, msg=lambda text, n=name: f"{n}: {text}")
    assert not torch.equal(by_kernel[1], by_autograd[1]), "the bias gradient was autograd's bf16 sum"


def test_weight_gradient_in_fp32_falls_back_off_cuda():
    """Off CUDA (no torch.mm with out_dtype there) the weight gradient asked in fp32 is autograd's product, bit for
    bit; the bias gradient summed by torch (`bias_by_kernel=False`) is the fp32 sum."""
    torch.manual_seed(0)
    states = torch.randn(2, 30, 16, requires_grad=True)
    weight = torch.randn(24, 16, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    grad = torch.randn(2, 30, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.nn.functional.linear(states, weight, bias)
        asked = linear_with_summed_bias_gradient(states, weight, bias, False, True)
    by_autograd = torch.autograd.grad(plain, (states, weight, bias), grad.to(plain.dtype))
    by_function = torch.autograd.grad(asked, (states, weight, bias), grad.to(asked.dtype))
    assert torch.equal(by_function[0], by_autograd[0]) and torch.equal(by_function[1], by_autograd[1])
    exact = grad.to(torch.bfloat16).double().sum((0, 1))
    torch.testing.assert_close(by_function[2].double(), exact, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.mm takes out_dtype on CUDA only")
@pytest.mark.parametrize("bias_by_kernel", [True, False], ids=["bias-by-kernel", "bias-by-torch"])
def test_weight_gradient_in_fp32_is_the_unrounded_product(bias_by_kernel):
    """Under bf16 autocast the weight gradient asked in fp32 is the product of the bf16 gradient and inputs
    unrounded: within fp32's error of the exact product, where autograd's is rounded to bf16 (about 2^-9 of
    each element apart). The input gradient stays autograd's, bit for bit."""
    torch.manual_seed(0)
    states = torch.randn(4, 500, 64, device="cuda", requires_grad=True)
    weight = torch.randn(96, 64, device="cuda", requires_grad=True)
    bias = torch.randn(96, device="cuda", requires_grad=True)
    grad = torch.randn(4, 500, 96, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = torch.nn.functional.linear(states, weight, bias)
        asked = linear_with_summed_bias_gradient(states, weight, bias, bias_by_kernel, True)
    by_autograd = torch.autograd.grad(plain, (states, weight, bias), grad.to(plain.dtype))
    by_function = torch.autograd.grad(asked, (states, weight, bias), grad.to(asked.dtype))
    assert torch.equal(by_function[0], by_autograd[0])
    assert by_function[1].dtype == torch.float32
    low_grad = grad.to(torch.bfloat16).double().reshape(-1, 96)
    exact = low_grad.t() @ states.detach().to(torch.bfloat16).double().reshape(-1, 64)
    scale = exact.abs().max().item()
    torch.testing.assert_close(by_function[1].double(), exact, rtol=2**-16, atol=2**-16 * scale)
    assert (by_autograd[1].double() - exact).abs().max().item() > 2**-12 * scale, "autograd's was not rounded"
    torch.testing.assert_close(by_function[2].double(), low_grad.sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.mm takes out_dtype on CUDA only")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_alike_with_weight_gradients_in_fp32(compiled, monkeypatch):
    """A model's loss is the same and every gradient within bf16's rounding with every plain linear layer's
    weight gradient written in fp32 (`layers_knowgpt.WEIGHT_GRADIENT_IN_FP32`) as without; the weight gradients
    are not autograd's bf16-rounded ones, so the path was taken."""
    (loss, grads), (loss2, grads2) = tiny_model_both_ways("WEIGHT_GRADIENT_IN_FP32", compiled, monkeypatch)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    overall_largest = max(grad.abs().max().item() for grad in grads.values())
    for name, grad in grads.items():
        # as in test_model_trains_alike_with_the_bias_gradient_kernel: one bf16 unit moved where a sum in
        # another order is rounded for the next product, carried on by the layers below
        largest = max(grad.abs().max().item(), 2**-10 * overall_largest)
        tolerance = dict(rtol=2**-7, atol=2**-10 * largest)
        torch.testing.assert_close(grads2[name], grad, **tolerance, msg=lambda text, n=name: f"{n}: {text}")
    for layer in ("mlp.proj", "attn.proj", "mlp.fc", "attn.query"):
        name = f"transformer.blocks.0.{layer}.weight"
        assert not torch.equal(grads2[name], grads[name]), f"{name}: autograd's bf16 product"


def test_narrow_layers_take_the_function_only_for_fp32_weight_gradients(monkeypatch):
    """A layer too narrow for the column-sum kernel (`linear(..., bias_by_kernel=False)`) runs as F.linear, its
    bias gradient autograd's bf16 sum, unless WEIGHT_GRADIENT_IN_FP32 routes it through the function, whose bias
    gradient is the fp32 sum (here on the CPU, the function allowed there)."""
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(column_sums_module, "column_sums_available", lambda: True)
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 8)
    states = torch.randn(300, 16)
    bias_gradients = []
    for in_fp32 in (False, True):
        monkeypatch.setattr(layers_knowgpt, "WEIGHT_GRADIENT_IN_FP32", in_fp32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layers_knowgpt.linear(proj, states, bias_by_kernel=False)
        bias_gradients.append(torch.autograd.grad((out.float() ** 2).sum(), proj.bias)[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = proj(states)
    (by_autograd,) = torch.autograd.grad((out.float() ** 2).sum(), proj.bias)
    assert torch.equal(bias_gradients[0], by_autograd)
    assert not torch.equal(bias_gradients[1], by_autograd), "the fp32 flag left the narrow layer to autograd"
    torch.testing.assert_close(bias_gradients[1], by_autograd, rtol=2**-7, atol=2**-7 * by_autograd.abs().max().item())


@pytest.mark.skipif(
    TRITON_INTERPRETED, reason="the interpreter would run the kernel on the trace's fake tensors, which have no data"
)
@pytest.mark.parametrize("together", [False, True], ids=["apart", "together"])
def test_narrow_layers_sum_their_bias_gradients_by_the_kernel_only_where_compiled_and_told(together, monkeypatch):
    """NARROW_BIAS_SUMS_TOGETHER: a narrow layer (`linear(..., bias_by_kernel=False)`) sums its bias gradient by
    `column_sums` inside a compiled graph, where the weight-gradient pass can take the sum into its launch, and by
    torch uncompiled; off, by torch either way. (`column_sums` here gives twice the sum, so that its result shows
    which path ran: dynamo refuses a recording side effect inside the autograd function.)"""
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(column_sums_module, "column_sums_available", lambda: True)
    monkeypatch.setattr(layers_knowgpt, "NARROW_BIAS_SUMS_TOGETHER", together)
    monkeypatch.setattr(column_sums_module, "column_sums", lambda matrix: 2 * matrix.sum(0, dtype=torch.float32))
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 8)
    states = torch.randn(300, 16)

    def loss_of(states):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (layers_knowgpt.linear(proj, states, bias_by_kernel=False).float() ** 2).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = proj(states)
    fp32_sum = (2 * output.float()).sum(0)  # the bias gradient of Σ output², summed in fp32
    (eager,) = torch.autograd.grad(loss_of(states), proj.bias)
    torch.testing.assert_close(eager, fp32_sum, rtol=1e-5, atol=1e-5 * fp32_sum.abs().max().item())
    torch._dynamo.reset()
    (compiled,) = torch.autograd.grad(torch.compile(loss_of, fullgraph=True, backend="aot_eager")(states), proj.bias)
    expected = 2 * fp32_sum if together else fp32_sum
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5 * fp32_sum.abs().max().item())
