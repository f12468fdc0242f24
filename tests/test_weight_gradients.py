"""Linear layers whose weight gradients are computed aside (`hf_knowgpt.kernels.weight_gradients`) give autograd's
gradients. On a CPU the op computes them in order (no streams); tests/test_fast_path.py runs the graphed step
with the side stream on a GPU."""

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ATTENTION_TYPES, tiny_config
from torch import nn

from hf_knowgpt import KnowGPTForCausalLM
from hf_knowgpt.kernels.weight_gradients import INDUCTOR_OPTIONS, WeightGradientsAside


def _model_pair(attention_type="vanilla"):
    torch.manual_seed(0)
    config = tiny_config(attention_type, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    model = KnowGPTForCausalLM(config)
    return model, copy.deepcopy(model)


def _loss(model, input_ids, autocast_dtype=None, repeats=1):
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        return sum(model(input_ids=input_ids, labels=input_ids).loss for _ in range(repeats))


def _backward(model, input_ids, aside=None, **loss_options):
    _loss(model, input_ids, **loss_options).backward()
    if aside is not None:
        aside.join()


def _assert_same_gradients(plain, attached, rtol=1e-6, atol=1e-7):
    for (name, expected), actual in zip(plain.named_parameters(), attached.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=rtol, atol=atol, msg=name)


def _input_ids(config, seed=0):
    return torch.randint(0, config.vocab_size, (3, config.block_size), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_gradients_aside_are_autograds_in_fp32(attention_type):
    plain, attached = _model_pair(attention_type)
    aside = WeightGradientsAside.attach(attached)
    input_ids = _input_ids(plain.config)
    _backward(plain, input_ids)
    _backward(attached, input_ids, aside)
    _assert_same_gradients(plain, attached)
    aside.detach()


def test_autograd_returns_no_gradient_for_the_numbered_weights_and_the_op_writes_them():
    _, attached = _model_pair()
    aside = WeightGradientsAside.attach(attached)
    attention = attached.transformer.blocks[0].attn
    loss = _loss(attached, _input_ids(attached.config))
    weights = [attention.query.weight, attention.proj.weight, attached.transformer.blocks[0].mlp.fc.weight]
    assert torch.autograd.grad(loss, weights, allow_unused=True) == (None,) * len(weights)
    aside.join()
    assert all(weight.grad is not None and weight.grad.abs().sum() > 0 for weight in weights)
    aside.detach()


def test_under_bf16_autocast_the_weight_gradients_are_autograds_and_the_bias_sums_finer():
    """Weight gradients: the same bf16 product, cast to fp32. Bias gradients: summed into fp32 where autograd rounds
    the bf16 sum, so they agree to bf16's precision."""
    plain, attached = _model_pair()
    aside = WeightGradientsAside.attach(attached)
    input_ids = _input_ids(plain.config)
    _backward(plain, input_ids, autocast_dtype=torch.bfloat16)
    _backward(attached, input_ids, aside, autocast_dtype=torch.bfloat16)
    numbered = {id(parameter) for layer in aside.layers for parameter in (layer.weight, layer.bias)}
    for (name, expected), actual in zip(plain.named_parameters(), attached.parameters()):
        if id(actual) in numbered and name.endswith("bias"):
            torch.testing.assert_close(actual.grad, expected.grad, rtol=2**-7, atol=2**-7 * expected.grad.abs().max())
        else:
            torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_layer_run_twice_in_one_step_adds_its_gradients():
    plain, attached = _model_pair()
    aside = WeightGradientsAside.attach(attached)
    input_ids = _input_ids(plain.config)
    _backward(plain, input_ids, repeats=2)
    _backward(attached, input_ids, aside, repeats=2)
    _assert_same_gradients(plain, attached)


def test_models_are_numbered_from_zero_and_detached_models_run_plain():
    first, second = _model_pair()
    aside_first = WeightGradientsAside.attach(first)
    aside_second = WeightGradientsAside.attach(second)
    assert (aside_first.number, aside_second.number) == (0, 1)
    assert {layer.gradient_slot for layer in aside_second.layers} == {
        (1, slot) for slot in range(len(aside_second.layers))
    }
    assert first.get_output_embeddings() not in aside_first.layers
    assert all(type(layer) is nn.Linear for layer in aside_first.layers)
    aside_first.detach()
    assert not any(hasattr(layer, "gradient_slot") for layer in aside_first.layers)
    assert WeightGradientsAside.attach(copy.deepcopy(first)).number == 0  # the free number is taken again
    # detached, the layers' gradients come from autograd again
    weight = first.transformer.blocks[0].attn.query.weight
    (gradient,) = torch.autograd.grad(_loss(first, _input_ids(first.config)), weight)
    assert gradient is not None and weight.grad is None
    aside_second.detach()


def test_compiled_with_the_ops_the_gradients_are_the_eager_ones():
    plain, attached = _model_pair()
    aside = WeightGradientsAside.attach(attached)
    input_ids = _input_ids(plain.config)
    _backward(plain, input_ids)
    compiled = torch.compile(_loss, fullgraph=True, options=INDUCTOR_OPTIONS)
    compiled(attached, input_ids).backward()
    aside.join()
    _assert_same_gradients(plain, attached, rtol=1e-5, atol=1e-6)
    aside.detach()


# The model's loss compiled whole with its layers numbered, loaded from the functions file where it is there:
# prints whether it was loaded, how much dynamo traced, the loss and a numbered layer's weight gradient.
PRECOMPILED_LOSS = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from torch._dynamo.utils import counters
    from conftest import tiny_config
    from hf_knowgpt import KnowGPTForCausalLM
    from hf_knowgpt.kernels.weight_gradients import INDUCTOR_OPTIONS, WeightGradientsAside
    from hf_knowgpt.training.compile_cache import PrecompiledFunction, load_functions, save_functions
    from hf_knowgpt.training.fast_path import model_loss

    path = Path(sys.argv[1])
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config(n_layer=2, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))
    aside = WeightGradientsAside.attach(model)
    compiled = PrecompiledFunction(model_loss, "model", options=INDUCTOR_OPTIONS)
    loaded = load_functions(path, [compiled])
    input_ids = torch.randint(0, 23, (3, 24), generator=torch.Generator().manual_seed(1))
    loss = compiled(model, input_ids, input_ids, None, torch.tensor(69.0), None)
    loss.backward()
    aside.join()
    save_functions(path, [compiled])
    gradient = model.transformer.blocks[0].mlp.fc.weight.grad
    print(json.dumps({"loaded": loaded, "traced": counters["stats"].get("calls_captured", 0), "loss": loss.item(),
                      "gradient": gradient.flatten().tolist()}))
    """
)


def test_a_later_process_loads_the_compiled_ops_and_gets_the_same_gradients(tmp_path):
    """The ops are kept in the compiled step's file (`compile_cache.PrecompiledFunction`): a process that loads it
    traces nothing and computes the first process's loss and weight gradients."""
    runs = []
    for name in ("first", "later"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
        completed = subprocess.run([sys.executable, "-c", PRECOMPILED_LOSS, str(tmp_path / "loss.functions")],
                                   env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert completed.returncode == 0, completed.stderr[-3000:]
        runs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    first, later = runs
    assert not first["loaded"] and first["traced"] > 0
    assert later["loaded"] and later["traced"] == 0
    assert later["loss"] == first["loss"] and later["gradient"] == first["gradient"]
    assert any(value != 0 for value in first["gradient"])
