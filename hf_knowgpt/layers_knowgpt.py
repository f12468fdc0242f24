"""Layers that KnowGPT's attention and its blocks share: the token and position embeddings whose gradient is one
matrix product on a GPU (`KnowGPTEmbedding`), the dropout that is cheap on a CPU (`KnowGPTDropout`),
linear layers (`linear`), those of one input run as one matrix product (`project`), the MLP's two layers and
activation (`mlp`), a residual sum with the LayerNorm after it in one fused kernel (`residual_layer_norm`), and
the causal-LM loss (`causal_lm_loss`)."""

import torch
from torch import nn
from torch.nn import functional as F


class _RowsWithMatrixProductGradient(torch.autograd.Function):
    """weight[ids], whose gradient is one matrix product: one_hot(ids)ᵀ · grad."""

    @staticmethod
    def forward(ctx, weight, ids):
        ctx.save_for_backward(ids)
        ctx.num_rows = weight.shape[0]
        return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        ids = ids.reshape(1, -1)
        one_hot_rows = grad.new_zeros(ctx.num_rows, ids.shape[1]).scatter_(0, ids, 1.0)  # (rows, tokens)
        return one_hot_rows @ grad, None


class KnowGPTEmbedding(nn.Embedding):
    """`nn.Embedding` whose weight gradient, when training on a GPU, is one matrix product (the one-hot
    rows of the ids, transposed, times the incoming gradient) instead of PyTorch's sort of the ids and
    segmented sums: with a vocabulary of a few hundred characters the product is small, and the sort and
    sums took 6% of an uncompiled training step's device time (H100, benchmarks/RESULTS.md). The product
    also adds in a fixed order, so a seeded run repeats. In fp32 it follows the trainer's TF32 setting, as
    every fp32 matrix product of training does. Elsewhere (a CPU, evaluation, no gradient, under
    torch.compile, padding_idx, max_norm or sparse gradients) it is `nn.Embedding`.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (
            self.training
            and input.is_cuda
            and not torch.compiler.is_compiling()  # inductor generates its own gradient kernel
            and torch.is_grad_enabled()
            and self.weight.requires_grad
            and self.padding_idx is None
            and self.max_norm is None
            and not self.sparse
            and not self.scale_grad_by_freq
        ):
            return _RowsWithMatrixProductGradient.apply(self.weight, input)
        return super().forward(input)


class KnowGPTDropout(nn.Dropout):
    """`nn.Dropout` whose mask is cut from 16-bit uniforms where that is cheaper than torch's own draw: on a CPU,
    four from each 64-bit random draw, and in a step compiled for a GPU (where DROPOUT_MASK_KERNEL says so) eight
    from each Philox evaluation of the package's kernel (`hf_knowgpt.kernels.dropout_masks`).

    A CPU's Bernoulli sampler spends about 6 ns per element, a tenth of the quickstart model's training step
    (torch.profiler); one 64-bit draw per four elements costs under a third of that. Each element is kept when its
    uniform is at or above round(p·2¹⁶), so the drop rate is p to within 2⁻¹⁷; kept elements are scaled by the
    inverse of the exact keep rate. Elsewhere and in evaluation it is `nn.Dropout`. Both draw from torch's
    generator of the tensor's device, so a seed repeats a run.
    """

    def forward(self, input: torch.Tensor, masks: "DropoutMasks | None" = None) -> torch.Tensor:
        """`masks`: the forward call's masks drawn together (`residual_dropout_masks`), of which this call takes the
        next where its rate and shape are theirs."""
        if not self.drops():
            return super().forward(input)
        levels = dropped_levels(self.p)
        keep = masks.take(input, self.p) if masks is not None else None
        if keep is None and input.device.type == "cpu":
            words = torch.empty((input.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
            uniforms = words.view(torch.int16)[: input.numel()].view(input.shape)
            keep = uniforms >= levels - UNIFORM_LEVELS // 2
        elif keep is None:
            draw_mask = _mask_kernel(input)
            if draw_mask is None:
                return super().forward(input)
            keep = draw_mask(input.shape, levels, input.device)
        # mul by the bool mask saves only the mask for backward; the in-place scale saves nothing
        return input.mul(keep).mul_(kept_scale(self.p))

    def drops(self) -> bool:
        """Whether a call draws a mask of its own kind (else it is `nn.Dropout`'s: evaluation, p 0 or 1, in place)."""
        return self.training and 0 < self.p < 1 and not self.inplace


# In a training step compiled for a CUDA device, each `KnowGPTDropout`'s mask drawn by the package's kernel, eight
# 16-bit uniforms per Philox evaluation, and multiplied in by the kernel inductor makes of the work around it,
# instead of inductor drawing one Philox evaluation per element inside that kernel: the handout recipe's steps 0.3-0.5 s
# shorter in three pairs of runs (H100, benchmarks/RESULTS.md). Uncompiled, torch's own dropout (one kernel) stays
# cheaper than a mask kernel and a multiply. False: inductor's draws.
DROPOUT_MASK_KERNEL = True


UNIFORM_LEVELS = 2**16


def dropped_levels(p: float) -> int:
    """Of the 2¹⁶ values a 16-bit uniform takes, how many drop their element at dropout rate p: an element is kept
    where its uniform is at least this. The rule of every mask the package cuts from 16-bit uniforms (this module's
    on a CPU, `dropout_masks`' and the attention kernels' on a GPU, whose launch restates it: the kernels cannot
    import the model's files)."""
    return round(p * UNIFORM_LEVELS)


def kept_scale(p: float) -> float:
    """What a kept element is multiplied by at dropout rate p: the inverse of the rate at which `dropped_levels`
    keeps elements (0 where it keeps none, p within 2⁻¹⁷ of 1)."""
    kept_levels = UNIFORM_LEVELS - dropped_levels(p)
    return UNIFORM_LEVELS / kept_levels if kept_levels else 0.0


def _mask_kernel(states: torch.Tensor):
    """`dropout_masks.dropout_keep_mask` where DROPOUT_MASK_KERNEL applies to `states` (CUDA, compiling, Triton),
    else None."""
    if not (DROPOUT_MASK_KERNEL and states.device.type == "cuda" and torch.compiler.is_compiling()):
        return None
    try:  # the package's kernel: a checkpoint's own copy of this code runs without it
        from hf_knowgpt.kernels.dropout_masks import dropout_keep_mask, dropout_masks_available
    except ModuleNotFoundError:
        return None
    return dropout_keep_mask if dropout_masks_available() else None


# Where DROPOUT_MASK_KERNEL applies, the masks of a training call's residual-stream dropouts (the embeddings' and each
# block's two branches', one rate) drawn in one launch for the call (`residual_dropout_masks`) instead of one seed
# and one mask launch per dropout, the launches that are most of what a kernel-drawn mask costs: the handout's
# pretraining steps 0.3-0.4 s shorter in six pairs side by side on an H100 (RESULTS.md). False: a launch per dropout.
DROPOUT_MASKS_TOGETHER = True


class DropoutMasks:
    """Masks of one shape and one dropout rate drawn at once for several `KnowGPTDropout` calls of one forward pass,
    each call taking the next (`take`), so that no two share a mask."""

    def __init__(self, count: int, shape, p: float, draw, device):
        self.p, self.shape = p, torch.Size(shape)
        self.masks = draw((count, *shape), dropped_levels(p), device)
        self.taken = 0

    def take(self, states: torch.Tensor, p: float) -> torch.Tensor | None:
        """The next mask for a dropout at rate `p` of `states`; None where the rate or shape differ or none is left
        (the call then draws its own)."""
        if p != self.p or states.shape != self.shape or self.taken == len(self.masks):
            return None
        keep = self.masks[self.taken]
        self.taken += 1
        return keep


def residual_dropout_masks(dropouts, states: torch.Tensor) -> DropoutMasks | None:
    """`DropoutMasks` for the `KnowGPTDropout` modules `dropouts`, each to be called once in this forward pass on
    states of `states`' shape, at the rate most of them share, where DROPOUT_MASKS_TOGETHER and DROPOUT_MASK_KERNEL
    apply (training, compiled, on CUDA); else None."""
    if not DROPOUT_MASKS_TOGETHER:
        return None
    draw = _mask_kernel(states)
    rates = [dropout.p for dropout in dropouts if dropout.drops()]
    if draw is None or not rates:
        return None
    p = max(rates, key=rates.count)
    return DropoutMasks(rates.count(p), states.shape, p, draw, states.device)


def _unchanged(states: torch.Tensor) -> torch.Tensor:
    return states


def _plain(layer) -> bool:
    """An nn.Linear with a bias, neither replaced nor hooked: adapters, and accelerate's offloading (`device_map`),
    which swaps a layer's `forward` for one that first brings its weights in, need the module to run."""
    return (
        type(layer) is nn.Linear
        and layer.bias is not None
        and not (layer._forward_hooks or layer._forward_pre_hooks or "forward" in vars(layer))
    )


# Plain linear layers' bias gradients by the column-sum kernel (hf_knowgpt.kernels.column_sums) on these devices,
# instead of autograd's sum over the tokens: the handout recipe's steps 0.7-0.9 s shorter in three pairs of runs
# (H200, benchmarks/RESULTS.md). False: autograd's everywhere.
BIAS_GRADIENT_KERNEL = True
BIAS_GRADIENT_KERNEL_DEVICES = ("cuda",)
# Plain linear layers' weight gradients, where their products are bf16 or fp16 under autocast on CUDA, as one
# product written in fp32 (torch.mm's out_dtype) instead of a product rounded to bf16 and then cast to the fp32
# weight's dtype: no cast kernel after each product (about 3 µs each at the handout's size on an H200), and the
# handout recipe's steps 0.2-0.3 s shorter in three pairs of runs (benchmarks/RESULTS.md). Every plain layer
# takes it, the narrow ones (`linear(..., bias_by_kernel=False)`) with their bias gradients summed by torch in
# fp32. False: autograd's products.
WEIGHT_GRADIENT_IN_FP32 = True
# In a compiled training step, the narrow layers' bias gradients (`linear(..., bias_by_kernel=False)`: the attention's
# and the MLP's output projections) by the column-sum kernel too: the weight-gradient pass
# (`kernels.grouped_products.WeightGradientsTogether`) then takes their sums into its one launch beside their
# products, where autograd's sum is two of inductor's kernels per layer (partial sums, in kernels of 3.2 µs that
# also finish the LayerNorms' sums, and their total, 1.5 µs: the H100 profile of benchmarks/RESULTS.md).
# Uncompiled, the kernel alone does not pay at their width.
# On: 0.2–0.3 s less of a whole run's steps in five of six pairs on an H100 (benchmarks/RESULTS.md;
# step_variants.py's `narrow-bias-sums-apart` is the other way).
NARROW_BIAS_SUMS_TOGETHER = True


def autocast_dtype(states: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs on `states`' device, or None where it is off."""
    device_type = states.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _low_precision_autocast(states: torch.Tensor) -> bool:
    return autocast_dtype(states) in (torch.bfloat16, torch.float16)


def _linear_function(states: torch.Tensor, trained: torch.Tensor):
    """The kernel module's `linear_with_summed_bias_gradient` where it applies (training on a device of
    BIAS_GRADIENT_KERNEL_DEVICES with Triton: `trained`, the bias or, for a product without one, the weight, takes
    gradients), else None."""
    if not (states.device.type in BIAS_GRADIENT_KERNEL_DEVICES and trained.requires_grad and torch.is_grad_enabled()):
        return None
    try:  # the package's kernel: a checkpoint's own copy of this code runs without it
        from hf_knowgpt.kernels.column_sums import column_sums_available, linear_with_summed_bias_gradient
    except ModuleNotFoundError:
        return None
    return linear_with_summed_bias_gradient if column_sums_available() else None


def _linear(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bias_by_kernel: bool = True):
    bias_by_kernel = bias_by_kernel or (NARROW_BIAS_SUMS_TOGETHER and torch.compiler.is_compiling())
    bias_by_kernel = bias_by_kernel and BIAS_GRADIENT_KERNEL and bias is not None
    in_fp32 = WEIGHT_GRADIENT_IN_FP32 and _low_precision_autocast(states)
    function = _linear_function(states, weight if bias is None else bias) if bias_by_kernel or in_fp32 else None
    if function is None:
        return F.linear(states, weight, bias)
    return function(states, weight, bias, bias_by_kernel, in_fp32)


def linear(
    layer: nn.Linear, states: torch.Tensor, bias_by_kernel: bool = True, leave_bias_out: bool = False
) -> torch.Tensor:
    """layer(states); a plain layer (`_plain`) takes its bias gradient by the column-sum kernel where
    BIAS_GRADIENT_KERNEL and `bias_by_kernel` say so (False: a layer too narrow for the kernel to pay, unless
    NARROW_BIAS_SUMS_TOGETHER applies), and its weight gradient in fp32 where WEIGHT_GRADIENT_IN_FP32 says so.
    `leave_bias_out`: a plain layer's product comes without its bias, which `branch_bias` gives the caller to add
    (another layer runs whole)."""
    if not _plain(layer):
        return layer(states)
    return _linear(states, layer.weight, None if leave_bias_out else layer.bias, bias_by_kernel)


def branch_bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias that `linear(layer, ..., leave_bias_out=True)` and `mlp(..., leave_proj_bias_out=True)` leave out
    of the layer's product, for the caller to add: a plain layer's; None where the layer ran whole."""
    return layer.bias if _plain(layer) else None


# In a training step compiled for a CUDA device, the exact GELU's gradient Φ(x) + x·φ(x) from one exponential
# (`gelu_slope`) instead of inductor's composition of libdevice's erf and a separate exp: the gradient kernel reads
# two bf16 tensors and writes one; alone, 15.8 against 18.6 µs at the handout's MLP size, where a kernel that only
# moves those bytes takes 15.7 (benchmarks/diagnostics/gelu_gradient.py, H100), and 0.13-0.17 s less of the
# handout's steps in three pairs of whole runs (benchmarks/RESULTS.md). The forward: GELU_FORWARD_ONE_EXP, below.
# False: autograd's gradient (`gelu-gradient-by-autograd` in step_variants.py).
GELU_GRADIENT_ONE_EXP = True
GELU_GRADIENT_ONE_EXP_DEVICES = ("cuda",)


def _normal_cdf_and_gaussian(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Φ(x) and e^{−x²/2} of fp32 x from one exponential: e^{−x²/2} gives the tail 1 − Φ(|x|) = ½·t·P(t)·e^{−x²/2},
    and a reciprocal gives t.

    Abramowitz & Stegun 7.1.26: for z ≥ 0, erf(z) = 1 − t·(a₁ + a₂t + a₃t² + a₄t³ + a₅t⁴)·e^{−z²} + ε, t = 1/(1 + p·z),
    |ε| ≤ 1.5e-7; at z = |x|/√2, e^{−z²} is e^{−x²/2}. Its constants are literals here, not module globals: under
    `torch.compile(dynamic=True)` dynamo makes a float read from a global, a closure or an attribute a graph input,
    and one first read inside an autograd.Function's graph (`_GeluOneExpGradient`, once per layer) fails the next
    layer's ("should not be called on root SubgraphTracer", torch 2.11 and 2.13; the fault pytorch/pytorch#193194
    reports for checkpointed modules)."""
    gaussian = torch.exp2(x * x * (-0.5 * 1.4426950408889634))  # e^{−x²/2} = 2^{−x²·log₂(e)/2}
    t = torch.reciprocal(x.abs() * (0.3275911 * 0.7071067811865476) + 1)  # 1/(1 + p·|x|/√2)
    a1, a2, a3, a4, a5 = 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429
    polynomial = 0.5 * a5
    for coefficient in (a4, a3, a2, a1):
        polynomial = polynomial * t + 0.5 * coefficient
    tail = t * polynomial * gaussian  # 1 − Φ(|x|)
    return torch.where(x < 0, tail, 1 - tail), gaussian


def gelu_slope(states: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU's derivative Φ(x) + x·φ(x) in fp32, within 3e-7 of it (as aten's fp32 gradient is), from
    one exponential, which serves φ too."""
    x = states.float()
    cdf, gaussian = _normal_cdf_and_gaussian(x)
    return cdf + x * gaussian * 0.3989422804014327  # 1/√(2π)


def gelu_from_one_exp(states: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU x·Φ(x), computed in fp32 from one exponential and rounded once to the states' dtype: for
    |x| ≤ 12 within 1e-6 of it, no further than torch's own fp32 GELU."""
    x = states.float()
    value = x * _normal_cdf_and_gaussian(x)[0]
    # not `.to(states.dtype)` whatever the dtype: for fp32 states that returns `value` itself, and torch 2.11's dynamo
    # then routes the gradient of `_GeluOneExpGradient`'s output to that alias, so its input got none (fc's gradients
    # were zero; pytorch/pytorch#180642, fixed upstream by #180921)
    return value if value.dtype == states.dtype else value.to(states.dtype)


# Where GELU_GRADIENT_ONE_EXP applies, GELU itself from one exponential too (`gelu_from_one_exp`) instead of torch's
# erf: inductor's GELU kernel had been bound by libdevice's erf, not by its bytes (11.8 µs a layer where a copy of
# the same bytes takes 7.0; from one exponential 8.6), and the handout's steps 0.13-0.19 s shorter in three pairs of
# whole runs (H100, benchmarks/RESULTS.md). False: torch's GELU (`gelu-forward-by-torch` in step_variants.py).
GELU_FORWARD_ONE_EXP = True


class _GeluOneExpGradient(torch.autograd.Function):
    """The exact GELU, by torch or from one exponential (GELU_FORWARD_ONE_EXP); its gradient by `gelu_slope`, rounded
    once to the incoming gradient's dtype."""

    @staticmethod
    def forward(ctx, states):
        ctx.save_for_backward(states)
        return gelu_from_one_exp(states) if GELU_FORWARD_ONE_EXP else F.gelu(states)

    @staticmethod
    def backward(ctx, grad):
        (states,) = ctx.saved_tensors
        return (grad.float() * gelu_slope(states)).to(grad.dtype)


def activate(activation: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """activation(states); the exact GELU by `_GeluOneExpGradient` (its gradient, and with GELU_FORWARD_ONE_EXP
    itself, from one exponential) where GELU_GRADIENT_ONE_EXP applies (a plain exact `nn.GELU`, gradients wanted,
    compiling for a device of GELU_GRADIENT_ONE_EXP_DEVICES)."""
    applies = GELU_GRADIENT_ONE_EXP and type(activation) is nn.GELU and activation.approximate == "none"
    applies = applies and states.requires_grad and states.device.type in GELU_GRADIENT_ONE_EXP_DEVICES
    applies = applies and torch.compiler.is_compiling()
    return _GeluOneExpGradient.apply(states) if applies else activation(states)


def mlp(
    states: torch.Tensor, fc: nn.Linear, activation: nn.Module, proj: nn.Linear, leave_proj_bias_out: bool = False
) -> torch.Tensor:
    """proj(activation(fc(states))), by `linear` for each layer and `activate`; `leave_proj_bias_out` as `linear`'s
    `leave_bias_out`."""
    # proj's bias gradient stays autograd's: the column-sum kernel did not pay at its width (n_embd).
    activated = activate(activation, linear(fc, states))
    return linear(proj, activated, bias_by_kernel=False, leave_bias_out=leave_proj_bias_out)


def _concatenated_product(hidden_states: torch.Tensor, layers) -> torch.Tensor:
    """Plain Linear layers of one input as one product of their concatenated weights, outputs side by side."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers])
    return _linear(hidden_states, weight, bias)


def project(hidden_states: torch.Tensor, layers, place=None) -> list[torch.Tensor]:
    """Several Linear layers of one input, each output passed through `place` (say, into the (B, T) grid).
    Plain ones (`_plain`) run as one product of their concatenated weights (one kernel instead of several,
    forward and backward, and one `place`); others run as the modules they are."""
    if place is None:  # not `place or …`: torch 2.11's dynamo cannot take the truth of a bound method
        place = _unchanged
    if not all(_plain(layer) for layer in layers):
        return [place(layer(hidden_states)) for layer in layers]
    projected = place(_concatenated_product(hidden_states, layers))
    return list(projected.split([layer.out_features for layer in layers], dim=-1))


def stacked_projection(hidden_states: torch.Tensor, layers) -> torch.Tensor | None:
    """`project`'s one product of plain Linear layers of one width, their outputs stacked: (…, len(layers), width),
    a view whose gradient reaches the product as it is (no concatenation of the parts' gradients); None where a
    layer is not plain or the widths differ."""
    width = layers[0].out_features
    if not all(_plain(layer) and layer.out_features == width for layer in layers):
        return None
    return _concatenated_product(hidden_states, layers).unflatten(-1, (len(layers), width))


def _fused_layers():
    """`hf_knowgpt.kernels.fused_layers`, imported when a model first runs it (only training on a GPU with
    Triton does: `KnowGPTModel.fused_layers`). Inside try, so that a checkpoint's copy of this file loaded with
    `trust_remote_code` does not require the package."""
    try:
        from hf_knowgpt.kernels import fused_layers
    except ModuleNotFoundError as missing:
        raise ModuleNotFoundError("KnowGPTModel.fused_layers needs the hf_knowgpt package installed") from missing
    return fused_layers


def residual_layer_norm(states, branch, branch_layer: nn.Module, norm: nn.LayerNorm, dropout_p: float):
    """(states + dropout(branch), norm of that sum) by the fused kernel (`KnowGPTModel.fused_layers`, training
    only), the bias of the branch's last layer added there where its product left it out (`branch_bias`); the
    normalized states in autocast's dtype where it is on (what the next layer's product takes), else the sum's."""
    return _fused_layers().fused_residual_layer_norm(
        states, branch, norm.weight, norm.bias, norm.eps, dropout_p, True, normalized_dtype=autocast_dtype(states),
        branch_bias=branch_bias(branch_layer),
    )  # fmt: skip


# Tokens per partial sum of the loss; 0 sums them all at once.
LOSS_CHUNK = 256


def causal_lm_loss(logits, targets, num_items_in_batch=None):
    """Mean cross-entropy over targets that are not -100, or their sum over `num_items_in_batch` when given
    (transformers' causal-LM loss). The sum is taken `LOSS_CHUNK` tokens at a time, the last chunk padded with
    zeros, and then over those sums: compiled for a symbolic token count, inductor otherwise sums all the tokens
    in one program on one multiprocessor (16.5 µs of the handout recipe's step on an H200). The padding, not a
    test of the count, keeps one graph for every token count."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets, ignore_index=-100)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    losses = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    if LOSS_CHUNK:
        losses = F.pad(losses, (0, -losses.numel() % LOSS_CHUNK)).view(-1, LOSS_CHUNK).sum(1)
    return losses.sum() / num_items_in_batch


__all__ = [
    "KnowGPTDropout",
    "branch_bias",
    "causal_lm_loss",
    "dropped_levels",
    "kept_scale",
    "linear",
    "mlp",
    "project",
    "residual_layer_norm",
]
