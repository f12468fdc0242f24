"""bf16 copies of the linear layers' weights (`layers_knowgpt.attach_weight_copies`, WEIGHT_COPIES_BY_UPDATE): the
layers read them under bf16 autocast instead of casting their fp32 weights, and compute what they compute without
them; the graphed step's multi-tensor update keeps them equal to the weights (on a GPU). The update's kernel alone
is tested in tests/test_multi_tensor_adamw.py."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_config

from hf_knowgpt import KnowGPTForCausalLM, layers_knowgpt
from hf_knowgpt.kernels import column_sums as column_sums_module
from hf_knowgpt.kernels.fused_attention import fused_attention_available


def tiny_model(attention_type="vanilla"):
    torch.manual_seed(0)
    config = tiny_config(attention_type, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    return KnowGPTForCausalLM(config)


@pytest.fixture
def products_by_the_package(monkeypatch):
    """The layers' products by the package's autograd function on the CPU too (a GPU's way), its column sums by
    torch: the function is what reads a copy."""
    monkeypatch.setattr(layers_knowgpt, "BIAS_GRADIENT_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(column_sums_module, "column_sums_available", lambda: True)
    monkeypatch.setattr(column_sums_module, "column_sums", lambda matrix: matrix.sum(0, dtype=torch.float32))


def test_each_modules_layers_of_one_input_width_share_one_stack_in_their_order():
    model = tiny_model()
    pairs = layers_knowgpt.attach_weight_copies(model, torch.bfloat16)
    attention, mlp = model.transformer.blocks[0].attn, model.transformer.blocks[0].mlp
    groups = {}
    for layer in (attention.query, attention.key, attention.value, attention.proj, mlp.fc, mlp.proj):
        group, start, stack = getattr(layer, layers_knowgpt.WEIGHT_COPY)
        groups.setdefault(group, []).append((start, layer.out_features, stack))
    # the attention's four layers take n_embd features: one stack, rows in the order the module holds them;
    # the MLP's two take n_embd and 4·n_embd: one stack each
    assert sorted(len(members) for members in groups.values()) == [1, 1, 4]
    for members in groups.values():
        assert [start for start, _, _ in members] == [
            sum(rows for _, rows, _ in members[:i]) for i in range(len(members))
        ]
        assert all(stack is members[0][2] for _, _, stack in members)
    linear_weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(pairs) == len(linear_weights) and {id(w) for w, _ in pairs} == {id(w) for w in linear_weights}
    for weight, weight_copy in pairs:
        assert weight_copy.dtype == torch.bfloat16 and torch.equal(weight_copy, weight.detach().to(torch.bfloat16))
    layers_knowgpt.detach_weight_copies(model)
    assert not any(hasattr(m, layers_knowgpt.WEIGHT_COPY) for m in model.modules())


def test_layers_find_their_copy_only_in_order_and_under_autocast_of_its_dtype():
    model = tiny_model()
    layers_knowgpt.attach_weight_copies(model, torch.bfloat16)
    attention = model.transformer.blocks[0].attn
    states = torch.randn(5, model.config.n_embd)
    qkv = (attention.query, attention.key, attention.value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = layers_knowgpt._weight_copy(qkv, states)
        assert torch.equal(found, torch.cat([layer.weight for layer in qkv]).detach().to(torch.bfloat16))
        assert layers_knowgpt._weight_copy((attention.key, attention.query), states) is None  # not rows in order
        assert layers_knowgpt._weight_copy((attention.query, model.transformer.blocks[0].mlp.fc), states) is None
        assert torch.equal(layers_knowgpt._weight_copy([attention.value], states), found[-model.config.n_embd :])
    with torch.autocast("cpu", dtype=torch.float16):
        assert layers_knowgpt._weight_copy(qkv, states) is None
    assert layers_knowgpt._weight_copy(qkv, states) is None  # no autocast: the fp32 weights


def loss_function(model, compiled: bool):
    """The model's bf16 loss and parameter gradients for some input ids; traced by dynamo once, where `compiled`,
    and then called as it was traced (a compiled step reads the copies at every call)."""

    def loss_of(input_ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=input_ids, labels=input_ids).loss

    if compiled:
        torch._dynamo.reset()
        loss_of = torch.compile(loss_of, fullgraph=True, backend="aot_eager")

    def loss_and_gradients(input_ids):
        model.zero_grad(set_to_none=True)
        loss = loss_of(input_ids)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    return loss_and_gradients


@pytest.mark.parametrize("attention_type", ["vanilla", "perceiver"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
def test_a_model_reading_its_copies_computes_what_it_computes_without_them(
    products_by_the_package, attention_type, compiled
):
    """The same loss and every parameter's gradient, bit for bit, with the copies read (traced by dynamo too, as a
    compiled step reads them); and they are read at every call: a copy changed after the trace changes the loss."""
    model = tiny_model(attention_type).train()
    input_ids = torch.randint(0, model.config.vocab_size - 1, (3, model.config.block_size))
    want_loss, want_gradients = loss_function(model, compiled)(input_ids)
    pairs = layers_knowgpt.attach_weight_copies(model, torch.bfloat16)
    with_copies = loss_function(model, compiled)
    loss, gradients = with_copies(input_ids)
    assert torch.equal(loss, want_loss)
    assert gradients.keys() == want_gradients.keys()
    for name, gradient in gradients.items():
        assert torch.equal(gradient, want_gradients[name]), name
    with torch.no_grad():
        for _, weight_copy in pairs:
            weight_copy.mul_(0.5)
    changed, _ = with_copies(input_ids)
    assert not torch.equal(changed, want_loss)


def test_a_model_without_gradients_reads_its_weights_not_its_copies(products_by_the_package):
    """Evaluation (no gradients) runs the layers as torch does: a copy, kept only for training steps, is not read."""
    model = tiny_model().eval()
    input_ids = torch.randint(0, model.config.vocab_size - 1, (2, model.config.block_size))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(input_ids=input_ids).logits
        pairs = layers_knowgpt.attach_weight_copies(model, torch.bfloat16)
        for _, weight_copy in pairs:
            weight_copy.zero_()
        assert torch.equal(model(input_ids=input_ids).logits, want)


@pytest.mark.skipif(not fused_attention_available(), reason="the multi-tensor update needs Triton and a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_graphed_bf16_steps_with_weight_copies_take_the_steps_without(tmp_path, monkeypatch, compiled):
    """The graphed step with WEIGHT_COPIES_BY_UPDATE against the step without: the same losses and parameters
    after three epochs of captured steps (the first graph captured after warm-up steps and a restored snapshot,
    which the copies follow), and each copy its weight cast to bf16 at the end."""
    from test_fast_path import _pretraining_data

    from hf_knowgpt.training.arguments import TrainingArguments
    from hf_knowgpt.training.fast_path import GraphedStepper
    from hf_knowgpt.training.trainer import KnowGPTTrainer

    tokenizer, data = _pretraining_data()
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), block_size=64, n_layer=2, n_head=2, n_embd=64,
                         embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    reference = KnowGPTForCausalLM(config).cuda()
    reference.set_attn_implementation("triton")
    results = {}
    for copies in (False, True):
        monkeypatch.setattr(layers_knowgpt, "WEIGHT_COPIES_BY_UPDATE", copies)
        model = copy.deepcopy(reference)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(copies)), max_epochs=3, batch_size=16, training_path="graphed",
            mixed_precision="bf16", compile=compiled,
        )  # fmt: skip
        trainer = KnowGPTTrainer(model, data, args)
        trainer.data.to("cuda")
        trainer.optimizer = trainer._make_optimizer(graphed=True)
        stepper = GraphedStepper(trainer, compile_model=compiled, packed=True, bucket=64)
        assert stepper.autocast_dtype == torch.bfloat16 and stepper.update is not None
        assert bool(stepper.update.weight_copies) == copies
        losses = []
        for first in range(0, 3 * stepper.steps_per_epoch, 3):
            stepper.run(first, min(3, 3 * stepper.steps_per_epoch - first), lambda: False)
            losses.append(stepper.take_loss().item())
        torch.cuda.synchronize()
        assert stepper.graphs
        for layer in model.modules():
            if hasattr(layer, layers_knowgpt.WEIGHT_COPY):
                _, start, stack = getattr(layer, layers_knowgpt.WEIGHT_COPY)
                held = stack[start : start + layer.out_features]
                assert torch.equal(held, layer.weight.detach().to(torch.bfloat16))
        results[copies] = losses, [p.detach().clone() for p in model.parameters()]
    if compiled:  # the compiled programs differ (no cast kernels): rounding may differ
        assert results[True][0] == pytest.approx(results[False][0], rel=1e-3)
    else:
        assert results[True][0] == results[False][0]
        for got, want in zip(results[True][1], results[False][1]):
            assert torch.equal(got, want)


def test_training_takes_the_copies_away_when_it_ends(tmp_path, monkeypatch):
    """After a run the model holds no copies: nothing would keep them equal to the weights (a later stage, an
    evaluation compiled by the user)."""
    from test_fast_path import _pretraining_data

    from hf_knowgpt.training.arguments import TrainingArguments
    from hf_knowgpt.training.trainer import KnowGPTTrainer

    tokenizer, data = _pretraining_data()
    model = KnowGPTForCausalLM(tiny_config(vocab_size=len(tokenizer), block_size=64))
    layers_knowgpt.attach_weight_copies(model, torch.bfloat16)  # as the graphed stepper gives them
    args = TrainingArguments(output_dir=str(tmp_path), max_epochs=1, batch_size=16, training_path="plain")
    KnowGPTTrainer(model, data, args).train()
    assert not any(hasattr(m, layers_knowgpt.WEIGHT_COPY) for m in model.modules())


# A linear layer reading its copy, compiled whole (`PrecompiledFunction`) and kept in a functions file: loaded
# first where the file is there, saved after. Prints the losses with the copy as attached and halved, compiled and
# uncompiled.
COPY_READING_STEP = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from hf_knowgpt import layers_knowgpt
    from hf_knowgpt.kernels import column_sums as column_sums_module
    from hf_knowgpt.training.compile_cache import PrecompiledFunction, load_functions, save_functions

    layers_knowgpt.BIAS_GRADIENT_KERNEL_DEVICES = ("cuda", "cpu")
    column_sums_module.column_sums_available = lambda: True
    column_sums_module.column_sums = lambda matrix: matrix.sum(0, dtype=torch.float32)

    def step(module, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (layers_knowgpt.linear(module[0], inputs).float() ** 2).mean()

    path = Path(sys.argv[1])
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 8))
    (pair,) = layers_knowgpt.attach_weight_copies(module, torch.bfloat16)
    compiled = PrecompiledFunction(step, "step")
    loaded = load_functions(path, [compiled])
    inputs = torch.randn(4, 16)
    losses, eager = [compiled(module, inputs).item()], [step(module, inputs).item()]
    with torch.no_grad():
        pair[1].mul_(0.5)
    losses.append(compiled(module, inputs).item())
    eager.append(step(module, inputs).item())
    saved = save_functions(path, [compiled])
    print(json.dumps({"loaded": loaded, "saved": saved, "losses": losses, "eager": eager}))
    """
)


def test_a_step_loaded_from_its_file_reads_the_copies_of_its_own_process(tmp_path):
    """The package keeps a compiled step (`compile_cache.save_functions`) for later processes: one that loads it
    reads its own model's copies at every call, as the process that traced it did."""
    path = tmp_path / "step.functions"
    runs = []
    for name in ("first", "later"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
        completed = subprocess.run([sys.executable, "-c", COPY_READING_STEP, str(path)], env=env,
                                   capture_output=True, text=True, timeout=600)  # fmt: skip
        assert completed.returncode == 0, completed.stderr[-3000:]
        runs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    first, later = runs
    assert not first["loaded"] and first["saved"] and later["loaded"]
    assert later["losses"] == first["losses"]
    assert first["losses"][1] != first["losses"][0]
    for run in runs:
        assert run["losses"] == pytest.approx(run["eager"], rel=1e-5)
