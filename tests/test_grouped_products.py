"""The weight gradients taken together (hf_knowgpt.kernels.grouped_products): the `knowgpt::transposed_products` op
against fp64 (its Triton kernel under the interpreter or on a GPU, its torch products elsewhere), and the pass over a
backward graph that puts one call of it where the fp32 weight-gradient products were.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU (`pip install triton`, then
`TRITON_INTERPRET=1 python -m pytest tests/test_grouped_products.py`); the pass and the op's torch products run
everywhere; the compiled model's test needs a CUDA device.
"""

import json

import pytest
import torch
from conftest import KERNEL_DEVICE, TRITON_INTERPRETED, needs_kernel
from torch.fx.experimental.proxy_tensor import make_fx

from hf_knowgpt.kernels import column_sums, grouped_products
from hf_knowgpt.kernels.fused_attention import triton
from hf_knowgpt.kernels.grouped_products import WeightGradientsTogether, transposed_products

# Tracing `column_sums`'s op (a triton_op) needs Triton's compiler: under the interpreter its kernel is Python that
# would run on the tracer's fake tensors.
traces_column_sums = pytest.mark.skipif(
    triton is None or TRITON_INTERPRETED,
    reason="needs Triton, not its interpreter (CPU builds of torch come without it)"
    if triton is None
    else "under Triton's interpreter, tracing column_sums's op runs its kernel on fake tensors",
)


def operands(tokens, shapes, device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gradients = [torch.randn(tokens, rows, generator=generator).to(device, dtype) for rows, _ in shapes]
    inputs = [torch.randn(tokens, cols, generator=generator).to(device, dtype) for _, cols in shapes]
    return gradients, inputs


def exact_products(gradients, inputs, summed=()) -> torch.Tensor:
    products = [(g.double().t() @ x.double()).flatten() for g, x in zip(gradients, inputs)]
    return torch.cat(products + [gradients[index].double().sum(0) for index in summed])


def assert_products(got, gradients, inputs, summed=()):
    want = exact_products(gradients, inputs, summed)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # bf16 operands multiply exactly in fp32; only the fp32 sums round (a few hundred terms at most here)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# the interpreter's memory holds no bf16 (see test_fused_attention.py): fp32 operands there, bf16 on the GPU
KERNEL_DTYPE = torch.bfloat16 if KERNEL_DEVICE == "cuda" else torch.float32


@needs_kernel
@pytest.mark.parametrize("summed", [(), (0, 2), (1,)], ids=["products", "two-column-sums", "one-column-sum"])
@pytest.mark.parametrize(
    "tokens, blocks, splits",
    [(64, (16, 16, 16), 1), (80, (16, 16, 16), 2), (70, (32, 16, 16), 3), (16, (16, 32, 16), 2)],
    ids=["whole", "two-parts", "three-uneven-parts", "a-part-past-the-tokens"],
)
def test_the_kernel_computes_every_product_of_one_launch(monkeypatch, tokens, blocks, splits, summed):
    """Products of several shapes in one launch (tiles of several products, rows and columns that do not fill a
    tile), the tokens whole or in parts, uneven ones and one with no tokens at all included; with some gradients'
    column sums after them (blocks of columns that do not fill a block, a gradient summed that is not the first)."""
    block_m, block_n, block_k = blocks
    settings = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, NUM_STAGES=1)
    for name, value in dict(settings, SUM_BLOCK_TOKENS=2 * block_k).items():  # loads that overrun a part's end
        monkeypatch.setattr(grouped_products, name, value)
    launched = []
    monkeypatch.setattr(grouped_products, "_products_in_torch", lambda *_: launched.append("torch"))
    gradients, inputs = operands(tokens, [(32, 16), (16, 48), (48, 32)], KERNEL_DEVICE, KERNEL_DTYPE)
    assert_products(transposed_products(gradients, inputs, list(summed)), gradients, inputs, summed)
    assert launched == [], "the kernel should have run, not torch's products"


@needs_kernel
def test_operands_the_kernel_cannot_load_go_to_torchs_products():
    """Widths that are not multiples of 16 (the kernel tells the compiler its loads are 16-byte aligned)."""
    gradients, inputs = operands(32, [(16, 8), (24, 16)], KERNEL_DEVICE, KERNEL_DTYPE)
    assert not grouped_products._kernel_applies(gradients, inputs)
    assert_products(transposed_products(gradients, inputs, [1]), gradients, inputs, (1,))


def test_the_op_checks_its_operands():
    gradients, inputs = operands(8, [(16, 16)], "cpu", torch.float32)
    with pytest.raises(ValueError, match="one of each per product"):
        transposed_products(gradients, inputs + inputs)
    with pytest.raises(ValueError, match="same tokens"):
        transposed_products(gradients, [torch.zeros(9, 16)])
    with pytest.raises(ValueError, match="summed names gradients"):
        transposed_products(gradients, inputs, [1])


def weight_gradients_like_a_backward_pass(g1, x1, g2, x2, g3, x3, other):
    """Three weight-gradient products as the linear layers write them, the second's result used before the third's
    operands exist (as an update's sum might be), and an fp32 product the pass must leave alone."""
    first = torch.mm(g1.t(), x1, out_dtype=torch.float32)
    second = torch.mm(g2.t(), x2, out_dtype=torch.float32)
    norm = second.square().sum()
    g3 = g3 * 2  # computed after the first products, as later layers' gradients are
    third = torch.mm(g3.t(), x3, out_dtype=torch.float32)
    untouched = other.t() @ other
    return first, second, third, norm, untouched


def test_the_pass_puts_one_call_where_the_weight_gradient_products_were():
    """Traced with fake tensors (torch.mm's out_dtype has no CPU kernel), the graph holds three `mm.dtype` products;
    after the pass, none and one `transposed_products` after the last operand, and run on the CPU (the op's torch
    products) the graph gives what fp64 gives."""
    shapes = [(32, 16), (16, 48), (48, 32)]
    gradients, inputs = operands(24, shapes, "cpu", torch.bfloat16)
    other = torch.randn(24, 8)
    arguments = [t for pair in zip(gradients, inputs) for t in pair] + [other]
    traced = make_fx(weight_gradients_like_a_backward_pass, tracing_mode="fake")(*arguments)
    products = [n for n in traced.graph.nodes if n.target is torch.ops.aten.mm.dtype]
    assert len(products) == 3
    WeightGradientsTogether()(traced.graph)
    traced.recompile()
    targets = [n.target for n in traced.graph.nodes]
    assert torch.ops.aten.mm.dtype not in targets
    assert targets.count(torch.ops.knowgpt.transposed_products.default) == 1
    assert targets.count(torch.ops.aten.mm.default) == 1  # the fp32 product, left as it was
    first, second, third, norm, untouched = traced(*arguments)
    doubled = [gradients[0], gradients[1], gradients[2] * 2]
    want = exact_products(doubled, inputs)
    got = torch.cat([first.flatten(), second.flatten(), third.flatten()])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(norm.double(), second.double().square().sum())
    torch.testing.assert_close(untouched, other.t() @ other)


def test_the_pass_makes_one_call_for_each_token_count():
    """Products over two token counts in one graph (the perceiver's latent layers beside its input layers): one call
    each, since one launch takes one token count; run on the CPU, the graph gives fp64's products."""
    shapes = [(32, 16), (16, 48)]
    first_gradients, first_inputs = operands(24, shapes, "cpu", torch.bfloat16)
    latent_gradients, latent_inputs = operands(40, shapes, "cpu", torch.bfloat16, seed=1)
    gradients, inputs = first_gradients + latent_gradients, first_inputs + latent_inputs
    arguments = [t for pair in zip(gradients, inputs) for t in pair]

    def four_products(*pairs):
        return [torch.mm(g.t(), x, out_dtype=torch.float32) for g, x in zip(pairs[::2], pairs[1::2])]

    traced = make_fx(four_products, tracing_mode="fake")(*arguments)
    WeightGradientsTogether()(traced.graph)
    traced.recompile()
    calls = [n for n in traced.graph.nodes if n.target is torch.ops.knowgpt.transposed_products.default]
    assert [len(call.args[0]) for call in calls] == [2, 2]
    got = torch.cat([product.flatten() for product in traced(*arguments)])
    want = exact_products(gradients, inputs)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_pass_leaves_a_graph_with_one_product_as_it_is():
    gradients, inputs = operands(8, [(16, 16)], "cpu", torch.bfloat16)

    def one(g, x):
        return torch.mm(g.t(), x, out_dtype=torch.float32)

    traced = make_fx(one, tracing_mode="fake")(gradients[0], inputs[0])
    before = [n.target for n in traced.graph.nodes]
    WeightGradientsTogether()(traced.graph)
    assert [n.target for n in traced.graph.nodes] == before


def products_and_bias_sums(g1, x1, g2, x2):
    """Two layers' weight gradients and, by `column_sums`'s op, their bias gradients, as the wide linear layers write
    them on a GPU."""
    first = torch.mm(g1.t(), x1, out_dtype=torch.float32)
    first_bias = column_sums._column_sums(g1)
    g2 = g2 * 2
    second = torch.mm(g2.t(), x2, out_dtype=torch.float32)
    return first, column_sums._column_sums(g2), first_bias, second


@traces_column_sums
@pytest.mark.parametrize("take_sums", [True, False], ids=["sums-taken", "sums-left"])
def test_the_pass_takes_the_column_sums_of_the_products_gradients_where_told(take_sums):
    """Traced with fake tensors, the graph holds `knowgpt::column_sums` calls on the products' gradients; with
    column_sums, the pass takes them into the one call as well (run on the CPU: the op's torch products and sums give
    fp64's), and without, leaves them where they are."""
    gradients, inputs = operands(24, [(32, 16), (48, 32)], "cpu", torch.bfloat16)
    arguments = [gradients[0], inputs[0], gradients[1], inputs[1]]
    traced = make_fx(products_and_bias_sums, tracing_mode="fake")(*arguments)
    WeightGradientsTogether(column_sums=take_sums)(traced.graph)
    traced.recompile()
    calls = [n for n in traced.graph.nodes if n.target is torch.ops.knowgpt.transposed_products.default]
    assert len(calls) == 1
    sums_left = [n for n in traced.graph.nodes if n.target is torch.ops.knowgpt.column_sums.default]
    if not take_sums:
        assert len(sums_left) == 2 and calls[0].args[2] == []
        return
    assert sums_left == [] and calls[0].args[2] == [0, 1]
    first, second_bias, first_bias, second = traced(*arguments)
    doubled = [gradients[0], gradients[1] * 2]
    want = exact_products(doubled, inputs, (0, 1))
    got = torch.cat([first.flatten(), second.flatten(), first_bias, second_bias])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_column_sums_setting_is_part_of_the_passs_name():
    """Inductor's cache and the compiled step's file are keyed by it: a step compiled with the sums taken must not be
    loaded for one without."""
    with_sums, without = WeightGradientsTogether(column_sums=True), WeightGradientsTogether(column_sums=False)
    assert with_sums.uuid() != without.uuid() and repr(with_sums) != repr(without)


def test_the_pass_names_itself_by_its_code_not_its_address():
    """Its repr is part of the compiled step's key (fast_path's artifacts file)."""
    assert repr(WeightGradientsTogether()) == repr(WeightGradientsTogether())
    assert "0x" not in repr(WeightGradientsTogether())


def small_model_and_batch():
    """The compiled-model test's CUDA model (two blocks of width 128, in eval mode: no dropout, so that every run sees
    the same arithmetic) and batch of 8 × 128 tokens, seeded; benchmarks/diagnostics/grouped_pass_drift.py takes
    them too."""
    from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM

    config = KnowGPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128, attention_type="vanilla")
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(config).cuda().eval()
    return model, torch.randint(0, 256, (8, 128), device="cuda")


def model_gradients(model, ids, options):
    """Each parameter's gradient of the loss on `ids`, the model compiled with these inductor options under bf16
    autocast; with None, eager in fp32."""
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    compiled = model if options is None else torch.compile(model, options=options)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=options is not None):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.mm's out_dtype, bf16 autocast)")
@pytest.mark.parametrize("narrow_sums", [False, True], ids=["wide-sums", "every-sum"])
def test_a_compiled_model_takes_its_weight_gradients_together_and_gets_the_same_ones(monkeypatch, narrow_sums):
    """A small model compiled with the pass and without, the same batch under bf16 autocast: with it, the op runs
    once in the backward pass, for every linear layer's weight gradient and the wide layers' bias gradients (with
    `layers_knowgpt.NARROW_BIAS_SUMS_TOGETHER`, every layer's), on its kernel; every gradient agrees with the run
    without it (the same products and sums, summed in another order) to within a tenth of what bf16 autocast itself
    moves it from fp32.

    Not element by element: the two graphs are fused and tuned apart, and an fp32 sum taken in another order can round
    an activation gradient to the neighbouring bf16 value, a step of 0.4-0.8% that reaches the embeddings' gradients
    (one H100 gave 2 of 32768 elements 1.25e-5 apart, where another gives 1e-9 at most)."""
    from hf_knowgpt import layers_knowgpt

    monkeypatch.setattr(layers_knowgpt, "NARROW_BIAS_SUMS_TOGETHER", narrow_sums)
    model, ids = small_model_and_batch()
    apart = model_gradients(model, ids, {})
    calls, sums = [], []
    kernel_applies, check_operands = grouped_products._kernel_applies, grouped_products._check_operands

    def recorded(gradients, inputs):
        calls.append((len(gradients), kernel_applies(gradients, inputs)))
        return calls[-1][1]

    def checked(gradients, inputs, summed):
        if not isinstance(gradients[0], torch._subclasses.FakeTensor):  # the calls that run, not their tracing
            sums.append(len(summed))
        return check_operands(gradients, inputs, summed)

    monkeypatch.setattr(grouped_products, "_kernel_applies", recorded)
    monkeypatch.setattr(grouped_products, "_check_operands", checked)
    together = model_gradients(model, ids, {"post_grad_custom_post_pass": WeightGradientsTogether(column_sums=True)})
    # four linear layers a block (the attention's input and output projections, the MLP's two), and the bias sums of
    # the two wide ones (the attention's input projection, the MLP's first layer), which `column_sums` takes, or of
    # all four
    assert calls == [(4 * model.config.n_layer, True)], calls
    assert sums == [(4 if narrow_sums else 2) * model.config.n_layer], sums
    assert apart.keys() == together.keys()
    fp32 = model_gradients(model, ids, None)
    for name in apart:
        moved_by_the_pass = torch.linalg.vector_norm(together[name] - apart[name])
        moved_by_bf16 = torch.linalg.vector_norm(apart[name] - fp32[name])
        assert moved_by_the_pass <= 0.1 * moved_by_bf16, (name, moved_by_the_pass.item(), moved_by_bf16.item())


def test_the_graphed_step_compiles_with_the_pass_only_where_told(monkeypatch):
    """On by default: the compiled step's inductor options carry the pass, with the column sums as the module says,
    and their text (the compiled step's key) is the same in every process; off, they do not."""
    from hf_knowgpt.training.fast_path import GraphedStepper

    options = GraphedStepper.inductor_options()
    assert options["post_grad_custom_post_pass"] == WeightGradientsTogether(column_sums=True)
    assert json.dumps(options, default=str) == json.dumps(GraphedStepper.inductor_options(), default=str)
    monkeypatch.setattr(grouped_products, "COLUMN_SUMS_TOGETHER", False)
    without_sums = GraphedStepper.inductor_options()["post_grad_custom_post_pass"]
    assert without_sums == WeightGradientsTogether(column_sums=False) != options["post_grad_custom_post_pass"]
    monkeypatch.setattr(GraphedStepper, "WEIGHT_GRADIENTS_TOGETHER", False)
    assert "post_grad_custom_post_pass" not in GraphedStepper.inductor_options()


class _Fp32WeightGradientLinear(torch.autograd.Function):
    """x · wᵀ (+ b) on bf16 operands whose weight gradient is `torch.mm(gradᵀ, x, out_dtype=torch.float32)`, as the
    package's linear layers write it on a GPU, and whose bias gradient (with a bias) is `column_sums`'s op. On the CPU
    torch has no kernel for that product, and without Triton's interpreter none runs the op's Triton kernel: a compiled
    backward pass runs only where the pass has replaced every product and taken every sum."""

    @staticmethod
    def forward(ctx, states, weight, bias):
        ctx.save_for_backward(states, weight)
        ctx.has_bias = bias is not None
        return _layer_product(states, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        states, weight = ctx.saved_tensors
        grad_states = grad @ weight.to(grad.dtype)
        weight_gradient = torch.mm(grad.t(), states, out_dtype=torch.float32)
        # Last: with no GPU driver Triton cannot tell that the kernel only reads `grad`, so a later use of it would
        # read the copy the kernel's wrapper makes, and the wrapper would stay in the graph beside the pass's call.
        bias_gradient = column_sums._column_sums(grad) if ctx.has_bias else None
        return grad_states, weight_gradient, bias_gradient


def _layer_product(states, weight, bias):
    product = states @ weight.to(states.dtype).t()
    return product if bias is None else product + bias.to(states.dtype)


def compiled_tanh_layers(weights, biases):
    """The loss of tanh layers (`_Fp32WeightGradientLinear`), the sum of the last one's squared outputs, compiled by
    inductor with the pass."""

    def loss_of(states):
        for weight, bias in zip(weights, biases):
            states = torch.tanh(_Fp32WeightGradientLinear.apply(states, weight, bias))
        return states.float().square().sum()

    return torch.compile(loss_of, options={"post_grad_custom_post_pass": WeightGradientsTogether(column_sums=True)})


def assert_fp64_layer_gradients(states, weights, biases):
    """Each layer's weight (and bias) gradient against fp64 of the same bf16 activations and gradients: the eager
    backward pass of `compiled_tanh_layers`' loss with the products and sums in fp64."""
    with torch.no_grad():
        activations, current = [], states
        for weight, bias in zip(weights, biases):
            activations.append(current)
            current = torch.tanh(_layer_product(current, weight.to(torch.bfloat16), bias))
        grad = 2 * current.double()
        for weight, bias, states_in in reversed(list(zip(weights, biases, activations))):
            output = torch.tanh(_layer_product(states_in, weight.to(torch.bfloat16), bias)).double()
            grad = (grad * (1 - output.square())).to(torch.bfloat16)
            expected = [(weight.grad, grad.double().t() @ states_in.double())]
            if bias is not None:
                expected.append((bias.grad, grad.double().sum(0)))
            for got, want in expected:
                torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
            grad = (grad @ weight.to(torch.bfloat16)).double()


SHAPES = [(32, 16), (48, 32), (16, 48)]  # (output, input) features of the compiled tests' three layers


def test_inductor_compiles_a_backward_pass_with_the_weight_gradients_together():
    """Three layers compiled by inductor with the pass, the tokens a symbol (as the packed step compiles them): the
    backward pass runs (torch.mm's out_dtype has no CPU kernel, so every product went to the op) and its weight
    gradients are fp64's, for two token counts through one graph."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    weights = [(0.2 * torch.randn(rows, cols, generator=generator)).requires_grad_() for rows, cols in SHAPES]
    biases = [None] * len(weights)
    compiled = compiled_tanh_layers(weights, biases)
    for tokens in (24, 40):
        states = torch.randn(tokens, 16, generator=generator).to(torch.bfloat16)
        torch._dynamo.mark_dynamic(states, 0)  # the tokens a symbol, the layers' widths not
        for weight in weights:
            weight.grad = None
        compiled(states).backward()
        assert_fp64_layer_gradients(states, weights, biases)


@traces_column_sums
def test_inductor_compiles_a_backward_pass_with_the_bias_sums_taken_together_too(monkeypatch):
    """Three layers with biases compiled by inductor with the pass, the tokens a symbol: in inductor's graph
    `column_sums`'s op is decomposed (its kernel's wrapper and the sum of its partial sums), and the pass takes all
    three sums into its one call with the products; the weight and bias gradients are fp64's for two token counts."""
    torch._dynamo.reset()
    summed = []
    products_in_torch = grouped_products._products_in_torch

    def recorded(gradients, inputs, sums):
        summed.append(list(sums))
        return products_in_torch(gradients, inputs, sums)

    monkeypatch.setattr(grouped_products, "_products_in_torch", recorded)
    generator = torch.Generator().manual_seed(0)
    weights = [(0.2 * torch.randn(rows, cols, generator=generator)).requires_grad_() for rows, cols in SHAPES]
    biases = [(0.1 * torch.randn(rows, generator=generator)).requires_grad_() for rows, _ in SHAPES]
    compiled = compiled_tanh_layers(weights, biases)
    for tokens in (24, 40):
        states = torch.randn(tokens, 16, generator=generator).to(torch.bfloat16)
        torch._dynamo.mark_dynamic(states, 0)
        for parameter in (*weights, *biases):
            parameter.grad = None
        compiled(states).backward()
        assert_fp64_layer_gradients(states, weights, biases)
    assert summed and all(sorted(sums) == [0, 1, 2] for sums in summed), summed
