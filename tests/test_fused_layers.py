"""The fused Triton kernels of the block's residual add + dropout + LayerNorm and of the MLP's bias + GELU
compute, forward and backward, what an fp64 PyTorch reference computes (with the kernels' own dropout mask);
and where they do not apply, the functions are the plain PyTorch composition.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`pip install triton`, then `TRITON_INTERPRET=1 python -m pytest tests/test_fused_layers.py`); the fallback
test runs everywhere.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE as DEVICE
from conftest import KERNEL_SKIP, needs_kernel
from conftest import TRITON_INTERPRETED as INTERPRETED

from hf_knowgpt.kernels import fused_layers
from hf_knowgpt.kernels.fused_layers import (
    fused_bias_gelu,
    fused_residual_layer_norm,
    residual_dropout_keep_mask,
)

EPS = 1e-5
# bf16 only on the GPU: the interpreter's bf16 arithmetic is not the GPU's (see test_fused_attention.py).
DTYPES = [torch.float32] + ([pytest.param(torch.bfloat16, id="bfloat16")] if DEVICE == "cuda" else [])


def layer_inputs(shape, dtype, residual_dtype=None):
    """residual, branch (the attention's or MLP's output), and LayerNorm weight and bias off their init."""
    width = shape[-1]
    residual = torch.randn(shape, device=DEVICE).to(residual_dtype or dtype).requires_grad_()
    branch = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(width, device=DEVICE)).requires_grad_()
    bias = (0.1 * torch.randn(width, device=DEVICE)).requires_grad_()
    return residual, branch, weight, bias


def reference_residual_layer_norm(residual, branch, weight, bias, keep=None, dropout_p=0.0):
    """fp64: dropout applies `keep` (the kernels' mask) to the branch."""
    branch = branch.double()
    if keep is not None:
        branch = torch.where(keep, branch / (1 - dropout_p), 0.0)
    new = residual.double() + branch
    return new, F.layer_norm(new, (new.shape[-1],), weight.double(), bias.double(), EPS)


def assert_close_to(got, want, dtype, name, precision=None):
    """Computed in fp32 and rounded once: for bf16, within about one unit in the last place of the largest
    (sums of many terms cancel, so a small element is judged against the largest); for fp32, what fp32
    sums of a few hundred terms lose. `precision` (default: `dtype`) is the coarsest precision the result
    went through: LayerNorm's inputs are the new residual rounded to its dtype, as in PyTorch, so with bf16
    activations even the fp32 weight's and bias's gradients are only as exact as bf16."""
    scale = want.abs().max().item()
    if (precision or dtype) == torch.bfloat16:
        tolerance = dict(rtol=2**-7, atol=2**-8 * scale)
    else:
        tolerance = dict(rtol=1e-5, atol=1e-5 * scale)
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, not {dtype}"
    torch.testing.assert_close(got, want.to(dtype), **tolerance, msg=lambda text: f"{name}: {text}")


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(1, 96), (37, 96), (2, 75, 96), (150, 256)], ids=str)
def test_residual_layer_norm_matches_fp64_reference(shape, dropout_p, dtype):
    """Both outputs, and the gradients of residual, branch, weight and bias with gradients arriving at both
    outputs; widths 96 (not a power of two: masked columns) and 256, row counts that leave the last tile
    partly empty and (150 × 256) make the backward programs loop over several tiles."""
    torch.manual_seed(0)
    residual, branch, weight, bias = layer_inputs(shape, dtype)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, dropout_p, True, seed=seed)
    keep = residual_dropout_keep_mask(seed, shape, dropout_p) if dropout_p else None
    expected_new, expected_normalized = reference_residual_layer_norm(residual, branch, weight, bias, keep, dropout_p)
    assert_close_to(new, expected_new, dtype, "new residual")
    assert_close_to(normalized, expected_normalized, dtype, "normalized")

    grad_new, grad_normalized = torch.randn_like(new), torch.randn_like(normalized)
    inputs = (residual, branch, weight, bias)
    grads = torch.autograd.grad((new, normalized), inputs, (grad_new, grad_normalized))
    expected_grads = torch.autograd.grad(
        (expected_new, expected_normalized), inputs, (grad_new.double(), grad_normalized.double())
    )
    for name, got, want, tensor in zip(("residual", "branch", "weight", "bias"), grads, expected_grads, inputs):
        assert_close_to(got, want, tensor.dtype, f"gradient of {name}", precision=dtype)
    if dropout_p:
        assert not grads[1].masked_select(~keep).any(), "gradient of a dropped branch element"


@needs_kernel
def test_residual_layer_norm_mixed_dtypes_as_under_autocast():
    """Under bf16 autocast the residual stream is fp32 and the branch (a Linear's output) bf16: the sum and
    its LayerNorm come out fp32, each input's gradient in its own dtype."""
    torch.manual_seed(0)
    shape, dropout_p = (40, 96), 0.1
    residual, branch, weight, bias = layer_inputs(shape, torch.bfloat16, residual_dtype=torch.float32)
    seed = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, dropout_p, True, seed=seed)
    keep = residual_dropout_keep_mask(seed, shape, dropout_p)
    expected_new, expected_normalized = reference_residual_layer_norm(residual, branch, weight, bias, keep, dropout_p)
    assert_close_to(new, expected_new, torch.float32, "new residual")
    assert_close_to(normalized, expected_normalized, torch.float32, "normalized")
    grad_new, grad_normalized = torch.randn_like(new), torch.randn_like(normalized)
    grads = torch.autograd.grad((new, normalized), (residual, branch), (grad_new, grad_normalized))
    expected_grads = torch.autograd.grad(
        (expected_new, expected_normalized), (residual, branch), (grad_new.double(), grad_normalized.double())
    )
    assert_close_to(grads[0], expected_grads[0], torch.float32, "gradient of residual")
    assert_close_to(grads[1], expected_grads[1], torch.bfloat16, "gradient of branch")


@needs_kernel
@pytest.mark.parametrize("sums_at_end", [False, True], ids=["sums-per-tile", "sums-at-end"])
@pytest.mark.parametrize("branch_dtype", [torch.float32, pytest.param(torch.bfloat16, id="bfloat16")])
@pytest.mark.parametrize("shape", [(37, 96), (150, 256)], ids=str)
def test_branch_bias_added_and_its_gradient_summed(shape, branch_dtype, sums_at_end, monkeypatch):
    """`branch_bias`: the branch is branch + bias (added in fp32 to the branch as it is) before dropout, and the
    bias's gradient, the column sums of the branch's, comes from the backward kernel; the other gradients are
    those of the sum. Residual fp32 (as under autocast); 150 × 256 makes the backward programs loop. The column
    sums per tile or once at the end of a program's tiles (COLUMN_SUMS_AT_END) alike."""
    monkeypatch.setattr(fused_layers, "COLUMN_SUMS_AT_END", sums_at_end)
    torch.manual_seed(0)
    dropout_p, width = 0.1, shape[-1]
    residual, branch, weight, bias = layer_inputs(shape, branch_dtype, residual_dtype=torch.float32)
    branch_bias = (0.5 * torch.randn(width, device=DEVICE)).requires_grad_()
    inputs = (residual, branch, branch_bias, weight, bias)
    seed = torch.tensor([21], dtype=torch.int64, device=DEVICE)
    new, normalized = fused_residual_layer_norm(
        residual, branch, weight, bias, EPS, dropout_p, True, seed=seed, branch_bias=branch_bias
    )
    keep = residual_dropout_keep_mask(seed, shape, dropout_p)
    biased = branch.double() + branch_bias.double()
    expected_new, expected_normalized = reference_residual_layer_norm(residual, biased, weight, bias, keep, dropout_p)
    assert_close_to(new, expected_new, torch.float32, "new residual")
    assert_close_to(normalized, expected_normalized, torch.float32, "normalized")
    grad_new, grad_normalized = torch.randn_like(new), torch.randn_like(normalized)
    grads = torch.autograd.grad((new, normalized), inputs, (grad_new, grad_normalized))
    expected_grads = torch.autograd.grad(
        (expected_new, expected_normalized), inputs, (grad_new.double(), grad_normalized.double())
    )
    names = ("residual", "branch", "branch's bias", "weight", "bias")
    for name, got, want, tensor in zip(names, grads, expected_grads, inputs):
        assert_close_to(got, want, tensor.dtype, f"gradient of {name}")


@needs_kernel
def test_normalized_written_in_the_next_layers_dtype():
    """`normalized_dtype=torch.bfloat16` (what the model asks under bf16 autocast): the LayerNorm's output is
    the fp32 one rounded to bf16, and every gradient is the one the fp32 output gets from that bf16 gradient
    (as autocast's cast passes it back), bit for bit (the output within a unit of bf16 under the interpreter,
    which rounds toward zero); the new residual stays fp32."""
    torch.manual_seed(0)
    shape, dropout_p = (40, 96), 0.1
    residual, branch, weight, bias = layer_inputs(shape, torch.bfloat16, residual_dtype=torch.float32)
    inputs = (residual, branch, weight, bias)
    seed = torch.tensor([11], dtype=torch.int64, device=DEVICE)
    grad_new = torch.randn(shape, device=DEVICE)
    grad_normalized = torch.randn(shape, device=DEVICE).bfloat16()
    results = []
    for normalized_dtype in (None, torch.bfloat16):
        new, normalized = fused_residual_layer_norm(
            residual, branch, weight, bias, EPS, dropout_p, True, seed=seed, normalized_dtype=normalized_dtype
        )
        grads = torch.autograd.grad((new, normalized), inputs, (grad_new, grad_normalized.to(normalized.dtype)))
        results.append((new, normalized, grads))
    (new, normalized, grads), (new_low, normalized_low, grads_low) = results
    assert new_low.dtype == torch.float32 and normalized_low.dtype == torch.bfloat16
    assert torch.equal(new_low, new)
    if INTERPRETED:  # the interpreter rounds fp32 to bf16 toward zero, the GPU to nearest: one unit apart at most
        torch.testing.assert_close(normalized_low.float(), normalized.bfloat16().float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(normalized_low, normalized.bfloat16())
    for name, got, want in zip(("residual", "branch", "weight", "bias"), grads_low, grads):
        assert torch.equal(got, want), f"gradient of {name}"


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (2, 19, 384), (70, 1024), (9, 2048)], ids=str)
def test_bias_gelu_matches_fp64_reference(shape, dtype):
    """gelu(x + bias) and the gradients of x and bias; 384 columns (4 × 96: masked columns), 2048 (two
    column blocks), 70 × 1024 (backward programs looping over several row tiles)."""
    torch.manual_seed(0)
    x = (2 * torch.randn(shape, device=DEVICE)).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    out = fused_bias_gelu(x, bias)
    expected = F.gelu(x.double() + bias.double())
    assert_close_to(out, expected, dtype, "gelu")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, bias), grad)
    expected_grads = torch.autograd.grad(expected, (x, bias), grad.double())
    assert_close_to(grads[0], expected_grads[0], dtype, "gradient of x")
    assert_close_to(grads[1], expected_grads[1], torch.float32, "gradient of bias")


@needs_kernel
@pytest.mark.parametrize("width", [96, 90])
def test_kernel_drops_what_the_mask_function_drops(width):
    """With a zero residual and a branch of ones, the new residual is the kernel's mask scaled by 1/(1 − p):
    the mask `residual_dropout_keep_mask` draws element by element, offset included; forward and backward
    alike. Width 96 with offsets that are multiples of 4 takes the tiles' path of one Philox evaluation per
    four elements; width 90, or an offset of 1003, the path of one per element."""
    shape, dropout_p = (33, width), 0.25
    zeros = torch.zeros(shape, device=DEVICE)
    weight, bias = torch.ones(width, device=DEVICE), torch.zeros(width, device=DEVICE)
    seed = torch.tensor([77], dtype=torch.int64, device=DEVICE)
    for offset in (0, 1000, 1003):
        ones = torch.ones(shape, device=DEVICE, requires_grad=True)
        new, _ = fused_residual_layer_norm(zeros, ones, weight, bias, EPS, dropout_p, True, seed=seed, offset=offset)
        keep = residual_dropout_keep_mask(seed, shape, dropout_p, offset=offset)
        scaled = torch.where(keep, torch.tensor(1 / (1 - dropout_p)), 0.0)
        assert torch.equal(new, scaled)
        (grad_branch,) = torch.autograd.grad(new.sum(), ones)
        assert torch.equal(grad_branch, scaled)
    shifted = residual_dropout_keep_mask(seed, (2 * 33 * width,), dropout_p)[33 * width :]  # counters continue
    assert torch.equal(residual_dropout_keep_mask(seed, shape, dropout_p, offset=33 * width), shifted.view(shape))


@needs_kernel
@pytest.mark.parametrize("width, offset", [(96, 0), (90, 0), (96, 1003)], ids=["quads", "odd-width", "odd-offset"])
def test_stored_mask_gives_what_the_drawn_one_gives(width, offset, monkeypatch):
    """With RESIDUAL_MASK_STORED the forward kernel writes its mask as bytes and the backward kernel reads them
    instead of drawing the mask again: outputs and every gradient (the branch's bias's included) are those of the
    kernels that draw it twice, on the tiles' path of four elements per Philox evaluation and on the path of one
    per element, the branch's gradient zero at the same elements. Bit for bit under the interpreter; on a GPU
    within fp32's rounding, the store making another compiled program whose sums may round otherwise (an H100 gave
    LayerNorm outputs apart in the last bits, 2026-12-05). 150 rows make the backward programs loop; without
    dropout nothing is stored."""
    torch.manual_seed(0)
    shape, dropout_p = (150, width), 0.25
    residual, branch, weight, bias = layer_inputs(shape, torch.float32)
    branch_bias = (0.5 * torch.randn(width, device=DEVICE)).requires_grad_()
    inputs = (residual, branch, branch_bias, weight, bias)
    seed = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    grads_out = (torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE))
    results, stored_masks = [], []
    real_empty = torch.empty

    def recording_empty(*args, dtype=None, **kwargs):  # the mask's buffer is the only int8 one of its shape
        tensor = real_empty(*args, dtype=dtype, **kwargs)
        if dtype == torch.int8 and tuple(tensor.shape) == shape:
            stored_masks.append(tensor)
        return tensor

    monkeypatch.setattr(fused_layers.torch, "empty", recording_empty)
    for stored in (False, True):
        monkeypatch.setattr(fused_layers, "RESIDUAL_MASK_STORED", stored)
        outputs = fused_residual_layer_norm(
            residual, branch, weight, bias, EPS, dropout_p, True, seed=seed, offset=offset, branch_bias=branch_bias
        )
        results.append((*outputs, *torch.autograd.grad(outputs, inputs, grads_out)))
    names = ("new residual", "normalized", *(f"gradient of {name}" for name in ("residual", "branch", "branch bias")))
    for name, drawn, read in zip((*names, "gradient of weight", "gradient of bias"), *results):
        if INTERPRETED:
            assert torch.equal(read, drawn), f"{name} differs with the mask stored"
        else:
            assert_close_to(read, drawn, torch.float32, f"{name} with the mask stored")
    assert torch.equal(results[1][3] == 0, results[0][3] == 0), "the branch's gradient vanishes elsewhere when stored"
    assert len(stored_masks) == 1, "the mask is stored once, and only when asked"
    keep = residual_dropout_keep_mask(seed, shape, dropout_p, offset=offset)
    assert torch.equal(stored_masks[0].bool(), keep)
    fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.0, True, seed=seed)
    assert len(stored_masks) == 1, "without dropout no mask is stored"


@needs_kernel
def test_dropout_mask_rate_and_repeatability():
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE)
    keep = residual_dropout_keep_mask(seed, (256, 1024), 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.005  # 262,144 draws: σ ≈ 0.0006
    assert torch.equal(keep, residual_dropout_keep_mask(seed, (256, 1024), 0.1))
    assert (keep != residual_dropout_keep_mask(seed + 1, (256, 1024), 0.1)).float().mean() > 0.1  # ~18% apart
    # Neighbours that share a Philox evaluation are drawn apart: both dropped about p² = 1% of the time, not p.
    lanes = (~keep).view(-1, 4).float()
    for lane in range(1, 4):
        assert abs((lanes[:, 0] * lanes[:, lane]).mean().item() - 0.01) < 0.003  # 65,536 pairs: σ ≈ 0.0004
    # Each call draws its seed from torch's generator: two calls differ, a reseeded call repeats.
    residual, branch, weight, bias = layer_inputs((20, 96), torch.float32)
    torch.manual_seed(3)
    first, _ = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.5, True)
    second, _ = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.5, True)
    torch.manual_seed(3)
    again, _ = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.5, True)
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


@needs_kernel
def test_eval_mode_applies_no_dropout():
    torch.manual_seed(0)
    residual, branch, weight, bias = layer_inputs((30, 96), torch.float32)
    new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.5, False)
    expected_new, expected_normalized = reference_residual_layer_norm(residual, branch, weight, bias)
    assert torch.equal(new, residual + branch)
    assert_close_to(normalized, expected_normalized, torch.float32, "normalized")
    (grad_branch,) = torch.autograd.grad(new.sum(), branch)
    assert torch.equal(grad_branch, torch.ones_like(branch))


@needs_kernel
def test_fallback_matches_the_kernels(monkeypatch):
    """Without dropout (eval mode with p > 0, or p = 0 in training) the PyTorch fallback and the kernels agree,
    outputs and gradients."""
    torch.manual_seed(0)
    residual, branch, weight, bias = layer_inputs((37, 96), torch.float32)
    x = torch.randn(37, 384, device=DEVICE, requires_grad=True)
    fc_bias = torch.randn(384, device=DEVICE, requires_grad=True)
    inputs = (residual, branch, weight, bias, x, fc_bias)

    def run(training, dropout_p):
        new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, dropout_p, training)
        activated = fused_bias_gelu(x, fc_bias)
        outputs = (new, normalized, activated)
        grads = torch.autograd.grad(outputs, inputs, [torch.cos(o.detach()) for o in outputs])
        return outputs, grads

    for training, dropout_p in ((True, 0.0), (False, 0.3)):
        kernel_outputs, kernel_grads = run(training, dropout_p)
        with monkeypatch.context() as patch:
            patch.setattr(fused_layers, "_kernels_apply", lambda *tensors: False)
            fallback_outputs, fallback_grads = run(training, dropout_p)
        for got, want in zip((*kernel_outputs, *kernel_grads), (*fallback_outputs, *fallback_grads)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_only_supported_calls_use_the_kernels():
    """fp64, rows wider than MAX_WIDTH or mismatched shapes go to the fallback, which still computes them."""
    wide = torch.randn(4, fused_layers.MAX_WIDTH + 1, device=DEVICE)
    weight, bias = torch.ones(wide.shape[-1], device=DEVICE), torch.zeros(wide.shape[-1], device=DEVICE)
    assert fused_layers._kernels_apply(wide, wide, weight, bias)
    assert not fused_layers._kernels_apply(wide.double(), wide, weight, bias)
    new, normalized = fused_residual_layer_norm(wide, wide, weight, bias, EPS, 0.0, True)
    torch.testing.assert_close(normalized, F.layer_norm(2 * wide, (wide.shape[-1],), weight, bias, EPS))
    double = torch.randn(3, 8, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(
        fused_bias_gelu(double, torch.ones(8, device=DEVICE, dtype=torch.float64)), F.gelu(double + 1)
    )
    with pytest.raises(ValueError, match="dropout_p must be in"):
        fused_residual_layer_norm(wide, wide, weight, bias, EPS, 1.0, True)


def test_fallback_is_the_plain_composition(monkeypatch):
    """Where the kernels do not apply (here forced, so this runs with or without Triton), the functions are
    the block's PyTorch composition exactly: residual + dropout(branch) (torch's dropout, same generator
    draws), then LayerNorm; gelu(x + bias). Outputs and gradients bit for bit."""
    monkeypatch.setattr(fused_layers, "_kernels_apply", lambda *tensors: False)
    torch.manual_seed(0)
    residual, branch, weight, bias = layer_inputs((2, 7, 96), torch.float32)
    x = torch.randn(2, 7, 384, requires_grad=True)
    fc_bias = torch.randn(384, requires_grad=True)
    inputs = (residual, branch, weight, bias, x, fc_bias)

    def fused(training):
        new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.1, training)
        return new, normalized, fused_bias_gelu(x, fc_bias)

    def composed(training):
        new = residual + F.dropout(branch, 0.1, training)
        return new, F.layer_norm(new, (96,), weight, bias, EPS), F.gelu(x + fc_bias)

    for training in (True, False):
        torch.manual_seed(1)
        got = fused(training)
        torch.manual_seed(1)
        want = composed(training)
        gradients = [torch.cos(o.detach()) for o in want]
        got_grads = torch.autograd.grad(got, inputs, gradients)
        want_grads = torch.autograd.grad(want, inputs, gradients)
        for a, b in zip((*got, *got_grads), (*want, *want_grads)):
            assert torch.equal(a, b)
    assert not torch.equal(fused(True)[0], residual + branch)  # dropout does apply in training


@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED or KERNEL_SKIP is not None, reason="needs a CUDA device"
)
def test_compiled_and_graphed_calls_match_eager():
    """torch.compile (the model's `compile` option) and CUDA graph capture (its graphed training step) run the
    kernels to the same results as eager calls, dropout included for one seed."""
    torch.manual_seed(0)
    residual, branch, weight, bias = layer_inputs((64, 96), torch.bfloat16)
    x = torch.randn(64, 384, device=DEVICE, requires_grad=True)
    fc_bias = torch.randn(384, device=DEVICE, requires_grad=True)
    inputs = (residual, branch, weight, bias, x, fc_bias)
    seed = torch.tensor([3], dtype=torch.int64, device=DEVICE)

    def forward():
        new, normalized = fused_residual_layer_norm(residual, branch, weight, bias, EPS, 0.1, True, seed=seed)
        return new, normalized, fused_bias_gelu(x, fc_bias)

    output_grads = [torch.randn_like(output) for output in forward()]

    def step(function):
        outputs = function()
        grads = torch.autograd.grad(outputs, inputs, output_grads)
        # Detached: a kept autograd graph would tie the inputs' gradient accumulators to the default
        # stream, which the capture below may not wait on.
        return [tensor.detach() for tensor in (*outputs, *grads)]

    # The partial sums of the weight's and bias's gradients may be summed in another order when compiled, and
    # inductor builds the kernels again for its own launch: fp32 arithmetic differing in its last bit can round a
    # bf16 output the other way (one unit in 1 of 6144 elements, H200), so bf16 outputs may differ by one unit.
    eager = step(forward)
    for got, want in zip(step(torch.compile(forward)), eager):
        one_unit = 2.0**-7 if want.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got, want, rtol=one_unit, atol=1e-6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(forward)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(forward)
    graph.replay()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


@pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETED or KERNEL_SKIP is not None, reason="needs a CUDA device"
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_alike_with_fused_layers(compiled, monkeypatch):
    """A model's loss and every parameter's gradient under bf16 autocast, without dropout, are the plain blocks'
    to within bf16's precision with every residual sum and LayerNorm fused (`KnowGPTModel.fused_layers`), eager
    and compiled by inductor for a symbolic token count, as the training step is. (The LayerNorms' sums in
    another order, and the branches' biases added in fp32, move a rounding to bf16 by a unit at most.)"""
    from test_column_sums import assert_alike_within_bf16, tiny_model_both_ways

    def fused_layers(model, value):
        model.transformer.fused_layers = value

    assert_alike_within_bf16(tiny_model_both_ways(fused_layers, compiled, monkeypatch, dynamic=True))
