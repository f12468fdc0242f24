"""Layers that KnowGPT's attention and its blocks share: the dropout that is cheap on a CPU (`KnowGPTDropout`),
and linear layers of one input run as one matrix product (`project`), whose bias gradient can come from the
weight gradient's product (`linear`)."""

import torch
from torch import nn
from torch.nn import functional as F


class KnowGPTDropout(nn.Dropout):
    """`nn.Dropout` whose mask, on a CPU, is cut from 64-bit random draws, four 16-bit uniforms each.

    A CPU's Bernoulli sampler spends about 6 ns per element, a tenth of the quickstart model's training step
    (torch.profiler); one 64-bit draw per four elements costs under a third of that. Each element is kept when its uniform is at
    or above round(p·2¹⁶), so the drop rate is p to within 2⁻¹⁷; kept elements are scaled by the inverse
    of the exact keep rate. Elsewhere (a GPU's counter-based generator is already cheap) and in evaluation
    it is `nn.Dropout`. Both draw from torch's generator of the tensor's device, so a seed repeats a run.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or self.p >= 1 or input.device.type != "cpu" or self.inplace:
            return super().forward(input)
        dropped_levels = round(self.p * 65536)  # of the 2¹⁶ values a 16-bit uniform takes
        words = torch.empty((input.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
        uniforms = words.view(torch.int16)[: input.numel()].view(input.shape)
        keep = uniforms >= dropped_levels - 32768
        # mul by the bool mask saves only the mask for backward; the in-place scale saves nothing
        return input.mul(keep).mul_(65536 / (65536 - dropped_levels))


def _unchanged(states: torch.Tensor) -> torch.Tensor:
    return states


# Device types ("cuda") whose half-precision training takes a linear layer's bias gradient from its weight
# gradient's product (`_LinearWithBiasGradientInProduct`); none until that is measured faster as a whole run.
BIAS_GRADIENT_IN_PRODUCT_DEVICES: tuple[str, ...] = ()


class _LinearWithBiasGradientInProduct(torch.autograd.Function):
    """x · weightᵀ + bias in the autocast dtype `dtype`, whose weight and bias gradients are one matrix product:
    the incoming gradient, transposed, times the input with a column of ones appended. The ones column's
    product is the bias's gradient, which is otherwise a column sum over every token in a reduction kernel of
    its own; seven columns of zeros after it keep the rows' stride a multiple of 16 bytes, as the matrix
    products' kernels need. It can pay where the output is wider than the input (the attention's three
    projections, the MLP's first layer): the reduction it replaces reads the (tokens, out) gradient, while
    the input with its extra columns is (tokens, in + 8), written once more and read by the product."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, dtype):
        ctx.input_dtype, ctx.weight_dtype, ctx.bias_dtype = inputs.dtype, weight.dtype, bias.dtype
        inputs, weight = inputs.to(dtype), weight.to(dtype)
        ctx.save_for_backward(inputs, weight)
        return F.linear(inputs, weight, bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        inputs, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        grad_inputs = (grad @ weight).to(ctx.input_dtype)
        rows = inputs.reshape(-1, inputs.shape[-1])
        with_ones = torch.cat([rows, rows.new_ones(rows.shape[0], 1), rows.new_zeros(rows.shape[0], 7)], dim=1)
        both = grad.reshape(-1, grad.shape[-1]).t() @ with_ones  # (out, in + 8)
        grad_weight, grad_bias = both[:, : rows.shape[1]], both[:, rows.shape[1]]
        return grad_inputs, grad_weight.to(ctx.weight_dtype), grad_bias.to(ctx.bias_dtype), None


def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`; in half-precision autocast training on a device of `BIAS_GRADIENT_IN_PRODUCT_DEVICES`,
    through `_LinearWithBiasGradientInProduct` (the same values, the gradients added in another order)."""
    device = inputs.device.type
    if (
        device in BIAS_GRADIENT_IN_PRODUCT_DEVICES
        and bias is not None
        and torch.is_grad_enabled()
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) in (torch.bfloat16, torch.float16)
    ):
        return _LinearWithBiasGradientInProduct.apply(inputs, weight, bias, torch.get_autocast_dtype(device))
    return F.linear(inputs, weight, bias)


def project(hidden_states: torch.Tensor, layers, place=None) -> list[torch.Tensor]:
    """Several Linear layers of one input (or one), each output passed through `place` (say, into the (B, T)
    grid). Plain ones run as one product of their concatenated weights (one kernel instead of several, forward
    and backward, and one `place`) through `linear`; layers that are replaced or hooked (adapters) run as the
    modules they are."""
    if place is None:  # not `place or …`: torch 2.11's dynamo cannot take the truth of a bound method
        place = _unchanged
    plain = all(
        type(layer) is nn.Linear and layer.bias is not None and not (layer._forward_hooks or layer._forward_pre_hooks)
        for layer in layers
    )
    if not plain:
        return [place(layer(hidden_states)) for layer in layers]
    if len(layers) == 1:
        weight, bias = layers[0].weight, layers[0].bias
    else:
        weight = torch.cat([layer.weight for layer in layers])
        bias = torch.cat([layer.bias for layer in layers])
    projected = place(linear(hidden_states, weight, bias))
    return list(projected.split([layer.out_features for layer in layers], dim=-1))


__all__ = ["BIAS_GRADIENT_IN_PRODUCT_DEVICES", "KnowGPTDropout", "linear", "project"]
