"""The graphed step's update (`hf_knowgpt.kernels.multi_tensor_adamw`): clipping, the scheduled learning rate and
AdamW in three launches compute what `clip_grad_norm_` and torch's AdamW compute, keep the optimizer's state where
a checkpoint saves it, resume from it, and leave out parameters that have no gradient.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`pip install triton`, then `TRITON_INTERPRET=1 python -m pytest tests/test_multi_tensor_adamw.py`); the test of
when the kernels apply runs everywhere.
"""

import io

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import KERNEL_SKIP, needs_kernel

from hf_knowgpt.kernels import multi_tensor_adamw
from hf_knowgpt.kernels.multi_tensor_adamw import (
    MultiTensorAdamW,
    multi_tensor_adamw_applies,
)

# Shapes that cross the update's and the norm's block boundaries, and tensors smaller than a block.
SHAPES = [(257, 32), (32,), (3, 5), (2500,), (7,)]
LEARNING_RATES = [6e-3, 3e-3, 1e-3]  # fewer than the steps: past the end, the last one holds


def make_parameters(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE)) for shape in SHAPES]


def make_optimizer(parameters, capturable_rate: bool):
    """The trainer's optimizer: the handout's groups (the 1-d tensors undecayed), betas (0.9, 0.95)."""
    groups = [
        {"params": [p for p in parameters if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in parameters if p.dim() == 1], "weight_decay": 0.0},
    ]
    learning_rate = torch.tensor(LEARNING_RATES[0], device=DEVICE) if capturable_rate else LEARNING_RATES[0]
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), foreach=False)
    if capturable_rate:  # as share_device_learning_rate leaves it: one tensor for every group
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
    return optimizer


def gradients(step, scale=1.0):
    generator = torch.Generator().manual_seed(1000 + step)
    return [scale * torch.randn(shape, generator=generator).to(DEVICE) for shape in SHAPES]


def set_gradients(parameters, step, scale, missing=None):
    """Step `step`'s gradients, none for the parameter numbered `missing`."""
    for index, (parameter, gradient) in enumerate(zip(parameters, gradients(step, scale))):
        parameter.grad = None if index == missing else gradient


def torch_step(parameters, optimizer, step, max_norm, scale, missing=None):
    set_gradients(parameters, step, scale, missing)
    if max_norm:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    for group in optimizer.param_groups:
        group["lr"] = LEARNING_RATES[min(step, len(LEARNING_RATES) - 1)]
    optimizer.step()


class KernelSteps:
    """MultiTensorAdamW over a copy of the parameters, as the graphed step drives it."""

    def __init__(self, max_norm, seed=0):
        self.parameters = make_parameters(seed)
        self.optimizer = make_optimizer(self.parameters, capturable_rate=True)
        self.learning_rate = self.optimizer.param_groups[0]["lr"]
        self.step_counter = torch.zeros((), dtype=torch.long, device=DEVICE)
        rates = torch.tensor(LEARNING_RATES, device=DEVICE)
        self.update = MultiTensorAdamW(self.optimizer, self.parameters, max_norm, rates, self.learning_rate)

    def step(self, step, scale, missing=None):
        set_gradients(self.parameters, step, scale, missing)
        self.step_counter.fill_(step)
        self.update.step(self.step_counter)


def both_ways(max_norm):
    """Parameters with torch's AdamW, and a copy of them with the kernels."""
    parameters = make_parameters()
    return parameters, make_optimizer(parameters, capturable_rate=False), KernelSteps(max_norm)


def step_both_ways(parameters, optimizer, kernel, step, max_norm, scale, missing=None):
    torch_step(parameters, optimizer, step, max_norm, scale, missing)
    kernel.step(step, scale, missing)


def checkpointed(optimizer) -> dict:
    """The optimizer's state as a checkpoint gives it back (accelerate saves it with torch.save)."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def assert_close_in_fp32(got, want, name):
    """As close as fp32 arithmetic in another order leaves them: a few units in the last place of the largest
    element (torch's moments are interpolations, `lerp`, where the kernels multiply and add)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=lambda text: f"{name}: {text}")


def assert_same_state(kernel_parameters, kernel_optimizer, parameters, optimizer):
    for index, (got, want) in enumerate(zip(kernel_parameters, parameters)):
        assert_close_in_fp32(got, want, f"parameter {index}")
        got_state, want_state = kernel_optimizer.state[got], optimizer.state[want]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_in_fp32(got_state[key], want_state[key], f"{key} {index}")
        assert float(got_state["step"]) == float(want_state["step"])


@needs_kernel
@pytest.mark.parametrize(
    "max_norm, scale",
    [(1.0, 1.0), (1e3, 1.0), (0.0, 1.0), (1.0, 1e-4)],
    ids=["clipped", "not-clipped", "no-clipping", "small-gradients"],
)
def test_steps_match_clip_grad_norm_and_torch_adamw(max_norm, scale):
    parameters, optimizer, kernel = both_ways(max_norm)
    for step in range(5):
        step_both_ways(parameters, optimizer, kernel, step, max_norm, scale)
        want_rate = LEARNING_RATES[min(step, len(LEARNING_RATES) - 1)]
        assert kernel.learning_rate.item() == pytest.approx(want_rate, rel=1e-6)
        assert_same_state(kernel.parameters, kernel.optimizer, parameters, optimizer)
    # The gradients are left unclipped: the clipping is applied inside the update.
    torch.testing.assert_close(kernel.parameters[0].grad, gradients(4, scale)[0])


@needs_kernel
def test_the_state_saves_and_resumes_as_torch_adamw_state():
    """A checkpoint written after kernel steps resumes torch's AdamW, and one written by torch's resumes the
    kernels, each continuing exactly as the other would."""
    max_norm, scale = 1.0, 1.0
    parameters, optimizer, kernel = both_ways(max_norm)
    for step in range(2):
        step_both_ways(parameters, optimizer, kernel, step, max_norm, scale)
    kernel_saved = checkpointed(kernel.optimizer)
    torch_saved = checkpointed(optimizer)

    # kernel state → torch's optimizer, against torch's own run
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in kernel.parameters]
    resumed_optimizer = make_optimizer(resumed, capturable_rate=False)
    resumed_optimizer.load_state_dict(kernel_saved)
    for group in resumed_optimizer.param_groups:
        group["lr"] = LEARNING_RATES[0]
    # torch state → the kernels
    continued = KernelSteps(max_norm)
    with torch.no_grad():
        for parameter, saved in zip(continued.parameters, parameters):
            parameter.copy_(saved)
    continued.optimizer.load_state_dict(torch_saved)
    for group in continued.optimizer.param_groups:  # as the trainer's share_device_learning_rate does
        group["lr"] = continued.learning_rate
    for step in range(2, 4):
        torch_step(parameters, optimizer, step, max_norm, scale)
        torch_step(resumed, resumed_optimizer, step, max_norm, scale)
        continued.step(step, scale)
    assert_same_state(resumed, resumed_optimizer, parameters, optimizer)
    assert_same_state(continued.parameters, continued.optimizer, parameters, optimizer)
    # the moments are views of the flat buffers, so they are what is saved
    state = continued.optimizer.state[continued.parameters[0]]
    assert state["exp_avg"].untyped_storage().data_ptr() == continued.update.exp_avg.untyped_storage().data_ptr()


@needs_kernel
def test_a_parameter_without_a_gradient_is_left_out_as_torch_leaves_it():
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    for step in range(3):
        step_both_ways(parameters, optimizer, kernel, step, max_norm=1.0, scale=1.0, missing=2)
    assert kernel.parameters[2] not in kernel.optimizer.state
    torch.testing.assert_close(kernel.parameters[2], make_parameters()[2], rtol=0, atol=0)
    kept = [i for i in range(len(SHAPES)) if i != 2]
    assert_same_state([kernel.parameters[i] for i in kept], kernel.optimizer, [parameters[i] for i in kept], optimizer)
    kernel.parameters[3].grad = None
    with pytest.raises(RuntimeError, match="had a gradient at the first step"):
        kernel.update.step(kernel.step_counter)


def test_applies_only_to_the_optimizers_it_computes(monkeypatch):
    if KERNEL_SKIP is not None:
        assert not multi_tensor_adamw_applies(make_optimizer(make_parameters(), True), make_parameters())
        return
    parameters = make_parameters()
    assert multi_tensor_adamw_applies(make_optimizer(parameters, capturable_rate=True), parameters)
    assert not multi_tensor_adamw_applies(make_optimizer(parameters, capturable_rate=False), parameters)
    optimizer = make_optimizer(parameters, capturable_rate=True)
    assert not multi_tensor_adamw_applies(optimizer, parameters[:-1])  # a parameter the optimizer holds is missing
    amsgrad = make_optimizer(parameters, capturable_rate=True)
    amsgrad.param_groups[1]["amsgrad"] = True
    assert not multi_tensor_adamw_applies(amsgrad, parameters)
    betas = make_optimizer(parameters, capturable_rate=True)
    betas.param_groups[1]["betas"] = (0.9, 0.999)
    assert not multi_tensor_adamw_applies(betas, parameters)
    adam = torch.optim.Adam(parameters, lr=torch.tensor(1e-3, device=DEVICE))
    assert not multi_tensor_adamw_applies(adam, parameters)
    half = [torch.nn.Parameter(p.detach().bfloat16()) for p in parameters]
    assert not multi_tensor_adamw_applies(make_optimizer(half, capturable_rate=True), half)
    monkeypatch.setattr(multi_tensor_adamw, "triton", None)
    assert not multi_tensor_adamw_applies(make_optimizer(parameters, capturable_rate=True), parameters)


@needs_kernel
def test_gradients_that_are_not_contiguous_are_read_as_torch_reads_them():
    """A gradient laid out transposed (as some products leave one) is read element for element, not by its
    storage's order."""
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    for step in range(2):
        torch_step(parameters, optimizer, step, 1.0, 1.0)
        set_gradients(kernel.parameters, step, 1.0)
        first = kernel.parameters[0]
        first.grad = first.grad.t().contiguous().t()  # the same values, column-major
        assert not first.grad.is_contiguous()
        kernel.step_counter.fill_(step)
        kernel.update.step(kernel.step_counter)
        assert_same_state(kernel.parameters, kernel.optimizer, parameters, optimizer)


def graph_pool_segments():
    """(start, end) of every block of device memory that belongs to a CUDA graph's pool."""
    return [
        (segment["address"], segment["address"] + segment["total_size"])
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_each_captured_step_reads_its_own_graphs_gradients():
    """Three graphs of the update, captured in one memory pool as the graphed stepper captures one per token
    bucket, each graph's gradients made inside its capture and let go of once it ends (the stepper's
    `zero_grad(set_to_none=True)`, so that a later capture may take their memory), replayed in turn with new
    gradients: every replay reads its own graph's gradients (each capture's table of addresses, filled once the
    capture ends), step for step as torch's AdamW after `clip_grad_norm_`. The tables lie outside the graphs'
    pool: one there could lie where another graph writes its temporaries at each replay."""
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    step_both_ways(parameters, optimizer, kernel, 0, max_norm=1.0, scale=1.0)  # uncaptured: binds, compiles
    graphs, sources, pool = [], [], None
    for _ in range(3):
        source = [torch.zeros(shape, device="cuda") for shape in SHAPES]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            for parameter, values in zip(kernel.parameters, source):
                parameter.grad = values * 1.0  # made in the graph's memory, as the step's backward makes them
            kernel.update.step(kernel.step_counter)
        kernel.update.tables_captured()
        kernel.optimizer.zero_grad(set_to_none=True)
        pool = graph.pool()
        graphs.append(graph)
        sources.append(source)
    tables = kernel.update.captured_tables
    assert len(tables) == 3 and not kernel.update.unfilled_tables
    pool_segments = graph_pool_segments()
    assert pool_segments, "no memory of the graphs' pool found: the test proves nothing"
    for table, _ in tables:
        assert not any(start <= table.data_ptr() < end for start, end in pool_segments)
    for step in range(1, 7):
        which = step % 3
        for values, gradient in zip(sources[which], gradients(step)):
            values.copy_(gradient)
        kernel.step_counter.fill_(step)
        graphs[which].replay()
        torch_step(parameters, optimizer, step, 1.0, 1.0)
        torch.cuda.synchronize()
        assert_same_state(kernel.parameters, kernel.optimizer, parameters, optimizer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_second_step_in_one_capture_is_refused():
    """Two steps captured without `tables_captured()` between them would share one table: a clear error."""
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    step_both_ways(parameters, optimizer, kernel, 0, max_norm=1.0, scale=1.0)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="tables_captured"):
        with torch.cuda.graph(graph):
            for _ in range(2):
                for parameter, shape in zip(kernel.parameters, SHAPES):
                    parameter.grad = torch.ones(shape, device="cuda")
                kernel.update.step(kernel.step_counter)


@needs_kernel
def test_gradients_concatenated_first_update_alike(monkeypatch):
    """The benchmark's baseline (`GRADIENTS_IN_PLACE = False`: one buffer of every gradient, its parts' addresses
    computed on the device) steps as torch's AdamW does too."""
    monkeypatch.setattr(multi_tensor_adamw, "GRADIENTS_IN_PLACE", False)
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    for step in range(3):
        step_both_ways(parameters, optimizer, kernel, step, max_norm=1.0, scale=1.0)
        assert_same_state(kernel.parameters, kernel.optimizer, parameters, optimizer)


@needs_kernel
def test_gradients_from_one_buffer_update_alike():
    """Given every gradient in one buffer (`flat_gradients`, as a sum over processes leaves them), the kernels
    read them there, not `.grad`, and step as torch's AdamW does; a buffer of another size is refused."""
    parameters, optimizer, kernel = both_ways(max_norm=1.0)
    for step in range(3):
        torch_step(parameters, optimizer, step, max_norm=1.0, scale=1.0)
        set_gradients(kernel.parameters, step, scale=1.0)
        flat = torch.cat([p.grad.reshape(-1) for p in kernel.parameters])
        for parameter in kernel.parameters:
            parameter.grad.fill_(float("nan"))  # read from the buffer or not at all
        kernel.step_counter.fill_(step)
        kernel.update.step(kernel.step_counter, flat)
        assert_same_state(kernel.parameters, kernel.optimizer, parameters, optimizer)
    with pytest.raises(ValueError, match="flat_gradients must be one fp32 buffer of the 10778 updated elements"):
        kernel.update.step(kernel.step_counter, flat[:-1])
