"""Linear layers whose weight and bias gradients are computed on a CUDA stream of their own, beside the rest
of the backward pass, which does not wait for them.

Why: a training step of the handouts' model is some 200 kernels of a few microseconds each, run one after the
other, most too small to fill the device. Of a linear layer's three gradients only its input's lies on the
backward pass's path (the layer before needs it); its weight's and bias's are read by nothing until clipping
and the optimizer. On a second stream they run while the path goes on, in the multiprocessors its small
kernels leave idle, and the step waits for them once, after the backward pass (`WeightGradientsAside.join`).

How: `layers_knowgpt.project` sends linear layers that carry a `gradient_slot` (set by `attach`) through the
op `knowgpt::linear`, the product of their concatenated weights, whose backward op (`knowgpt::linear_backward`)
computes the input's gradient on the current stream and, on the side stream, the weights' and biases'. It
stores those in the layers' `.grad` as autograd's accumulation does (assigned where None, added to otherwise),
so autograd itself returns none for them. Until the join it holds the tensors the side stream reads, so that
neither the caching allocator nor autograd's in-place accumulation of an input's gradient reuses them; a
compiled step must also keep inductor from reusing their buffers (`INDUCTOR_OPTIONS`). Inside a CUDA graph
capture the side stream is forked from the capturing stream and joined back, so the graph holds both.

On a CPU (no streams) the same ops compute everything in order: how the tests check the arithmetic.
"""

import weakref

import torch
from torch import nn
from torch.nn import functional as F

# A compiled step must not write into a buffer the side stream may still read: inductor otherwise hands a
# buffer whose last reader has run to a later kernel (`allow_buffer_reuse`) or lets a kernel write its output
# over an input it reads last (`inplace_buffers`).
INDUCTOR_OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}

# The models attached (`WeightGradientsAside`) by number, and what the side stream reads until the next join.
_attached: "weakref.WeakValueDictionary[int, WeightGradientsAside]" = weakref.WeakValueDictionary()
_held: list[torch.Tensor] = []
_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device):
    """The stream weight gradients run on, for a CUDA `device`; None elsewhere."""
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


@torch.library.custom_op("knowgpt::linear", mutates_args=())
def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, model: int, slots: list[int]
) -> torch.Tensor:
    """`F.linear(input, weight, bias)`, differentiable in `input` alone: the gradients of `weight` and `bias`
    (the concatenated weights of the layers in `slots` of the attached `model`, in order) go to those layers'
    `.grad` aside."""
    return F.linear(input, weight, bias)


@linear.register_fake
def _(input, weight, bias, model, slots):
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.custom_op("knowgpt::linear_backward", mutates_args=())
def linear_backward(
    grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, model: int, slots: list[int]
) -> torch.Tensor:
    """The gradient of `knowgpt::linear`'s input, after starting those of its layers' weights and biases aside."""
    layers = [_attached[model].layers[slot] for slot in slots]
    rows = grad.reshape(-1, grad.shape[-1]), input.reshape(-1, input.shape[-1])
    stream = _side_stream(grad.device)
    if stream is not None:  # read by the side stream until the join: nothing may free or write over them before
        _held.extend((grad, input, *rows))  # the originals too: autograd adds into a gradient nobody else holds
    _weight_and_bias_gradients(*rows, layers, stream)
    return grad @ weight


@linear_backward.register_fake
def _(grad, input, weight, model, slots):
    return grad.new_empty(input.shape)


def _setup_context(ctx, inputs, output):
    input, weight, _, model, slots = inputs
    ctx.save_for_backward(input, weight)
    ctx.model, ctx.slots = model, slots


def _backward(ctx, grad):
    input, weight = ctx.saved_tensors
    return linear_backward(grad, input, weight, ctx.model, ctx.slots), None, None, None, None


linear.register_autograd(_backward, setup_context=_setup_context)


def _weight_and_bias_gradients(grad: torch.Tensor, input: torch.Tensor, layers: list[nn.Linear], stream) -> None:
    """grad (tokens, Σ outputs) and input (tokens, inputs): each layer's weight gradient (its rows of
    gradᵀ·input, in grad's precision as autograd's product, then the parameter's) and bias gradient (its
    columns of grad summed in the parameter's precision), computed on `stream` (None: the current one) once the
    current stream has reached this point. Gradients that do not exist yet are made on the current stream."""
    sizes = [layer.out_features for layer in layers]
    parameters = [parameter for layer in layers for parameter in (layer.weight, layer.bias)]
    fresh = all(parameter.grad is None for parameter in parameters)
    if fresh:  # one buffer for the weights and one for the biases, each layer's gradients views of them
        weight_grad = torch.empty((sum(sizes), input.shape[1]), device=grad.device, dtype=layers[0].weight.dtype)
        bias_grad = torch.empty(sum(sizes), device=grad.device, dtype=layers[0].bias.dtype)
        for layer, weight_part, bias_part in zip(layers, weight_grad.split(sizes), bias_grad.split(sizes)):
            layer.weight.grad, layer.bias.grad = weight_part, bias_part
    else:  # added to, as autograd accumulates (a layer run twice in one step)
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(stream):  # None: no stream change
        product = grad.t() @ input
        if fresh:
            weight_grad.copy_(product)
            torch.sum(grad, 0, dtype=bias_grad.dtype, out=bias_grad)
            return
        for layer, weight_part, bias_part in zip(layers, product.split(sizes), grad.split(sizes, dim=1)):
            layer.weight.grad.add_(weight_part)
            layer.bias.grad.add_(bias_part.sum(0, dtype=layer.bias.grad.dtype))


class WeightGradientsAside:
    """The linear layers of a model trained with their weight gradients aside. `attach(model)` numbers the model
    (the lowest number no attached model holds, so that a process's first model is always 0 and a step compiled
    by one process is the step of the next) and its layers (`gradient_slot`: the model's number and the layer's);
    `join()` makes the current stream wait for the gradients started so far; `detach()` takes the numbers away,
    and the layers run as plain products again. The output embeddings are left out: inductor pads the
    vocabulary's product (`force_shape_pad`), which the op would hide from it."""

    def __init__(self, model: nn.Module, number: int):
        self.number = number
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.layers = [
            module
            for module in model.modules()
            if type(module) is nn.Linear and module is not output and module.bias is not None
        ]
        # made here, not while a graph is captured; None on a CPU
        self.stream = _side_stream(self.layers[0].weight.device) if self.layers else None

    @classmethod
    def attach(cls, model: nn.Module) -> "WeightGradientsAside":
        number = next(number for number in range(len(_attached) + 1) if number not in _attached)
        aside = cls(model, number)
        _attached[number] = aside
        for slot, layer in enumerate(aside.layers):
            layer.gradient_slot = (number, slot)
        return aside

    def join(self) -> None:
        """The current stream waits for every weight gradient started so far; their inputs are let go."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        _held.clear()

    def detach(self) -> None:
        for layer in self.layers:
            if getattr(layer, "gradient_slot", (None,))[0] == self.number:
                del layer.gradient_slot
        if _attached.get(self.number) is self:
            del _attached[self.number]


__all__ = ["INDUCTOR_OPTIONS", "WeightGradientsAside", "linear"]
