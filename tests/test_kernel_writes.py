"""What torch.compile takes each of the package's Triton kernels to write: its outputs, and none of its inputs.

Compiled code gives every argument that its analysis of a kernel takes for written a copy made before the launch
(functionalization), so an input taken for written costs a copy kernel at every launch of every compiled step. The
attention kernels once read their sequences' lengths and first tokens through a helper, whose results the
analysis follows back to every argument the helper was handed: their LENGTHS and STARTS counted as written, and
each compiled step copied them before each attention launch. The analysis here is torch's own
(`identify_accessed_tensors`; in torch 2.11, `identify_mutated_tensors`), run on each launch as the package makes
it, for an sm_90 target. The copy is also why no argument a kernel writes may share memory with another (the
attention kernels' launches are checked for it).
These need Triton, not a GPU (`pip install -e ".[triton]"`).
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="the analysis builds each kernel's Triton IR (CPU torch comes without)")

from hf_knowgpt.attention_knowgpt import rotary_angles  # noqa: E402
from hf_knowgpt.kernels import column_sums, dropout_masks, fused_attention, fused_layers  # noqa: E402


class _Recorded:
    """A kernel whose launches are recorded, by argument name, instead of run."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*arguments, **options):
            self.launches.append((self.kernel, dict(zip(self.kernel.arg_names, arguments)) | options))

        return launch


@pytest.fixture
def sm90(monkeypatch):
    """Triton's active driver set to an sm_90 target for the analysis, which asks the driver for one."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", Sm90())  # restored after: a CPU has no driver to reset to


@pytest.fixture
def launches(sm90, monkeypatch):
    """Launches through `torch.library.wrap_triton` and of the fused layers' kernels, recorded."""
    recorded = []
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: _Recorded(kernel, recorded))
    for name in ("_residual_layer_norm_forward", "_residual_layer_norm_backward", "_bias_gelu_forward",
                 "_bias_gelu_backward"):  # fmt: skip
        monkeypatch.setattr(fused_layers, name, _Recorded(getattr(fused_layers, name), recorded))
    return recorded


def written(kernel, arguments) -> set[str]:
    """The tensor arguments torch.compile takes `kernel` to write at this launch."""
    from torch._higher_order_ops import triton_kernel_wrap

    arguments = {name: arguments[name] for name in kernel.arg_names}  # a recording may hold launch options too
    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, arguments, {})
        names = [dep.name for dep in accesses.read_writes.writes]
    else:  # torch 2.11: the same analysis, giving the written arguments' names alone
        names = triton_kernel_wrap.identify_mutated_tensors(kernel, arguments, {})
    return {name for name in names if isinstance(arguments[name], torch.Tensor)}


def assert_writes(launches, expected):
    """Each launch writes what `expected` gives for its kernel's name, and every expected kernel ran."""
    assert sorted({kernel.fn.__name__ for kernel, _ in launches}) == sorted(expected)
    for kernel, arguments in launches:
        assert written(kernel, arguments) == set(expected[kernel.fn.__name__]), kernel.fn.__name__


ATTENTION_CALLS = ["grid", "grid-lengths", "packed", "packed-rotary", "packed-stacked", "grid-key-table-bias"]


def attention_launches(call):
    """The attention kernels' launches, recorded (`fused_attention.recorded_launches`), for a forward and backward
    call of one shape: on the (B, H, T, D) grid as the model's views of one projection give it, with lengths, packed
    tokens (with rotary, with the inputs stacked), keys by position with a bias. Returns the launches and what each
    kernel is meant to write."""
    heads, head_dim, length = 2, 16, 20
    lengths = starts = rotary = bias = stacked = None
    if call.startswith("packed"):
        lengths, starts = torch.tensor([20, 15], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
        query, key, value = (torch.randn(35, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
        if call == "packed-rotary":
            rotary = rotary_angles(torch.arange(length), head_dim, 10000.0)
        if call == "packed-stacked":  # one tensor in, one gradient out
            stacked = torch.randn(35, 3, heads, head_dim, dtype=torch.bfloat16)
            query, key, value = stacked.unbind(1)
    else:
        projected = torch.randn(2, length, 3 * heads * head_dim, dtype=torch.bfloat16)
        query, key, value = (x.unflatten(-1, (heads, head_dim)).transpose(1, 2) for x in projected.chunk(3, -1))
        if call == "grid-lengths":
            lengths = torch.tensor([20, 7], dtype=torch.int32)
        if call == "grid-key-table-bias":
            key, bias = torch.randn(length, head_dim, dtype=torch.bfloat16), torch.randn(length)
    cos, sin = rotary if rotary is not None else (None, None)
    seed, options = torch.tensor([1]), (length, 0.25, 0.1, 3, 16)
    inputs = (query, key, value) if stacked is None else (stacked, None, None)
    with fused_attention.recorded_launches() as launches:
        out, out32, lse, _, _ = torch.ops.knowgpt.causal_attention_forward(
            *inputs, seed, lengths, starts, cos, sin, bias, *options
        )
        torch.ops.knowgpt.causal_attention_backward(
            out, query, key, value, out32, lse, seed, lengths, starts, cos, sin, bias, *options, stacked is not None
        )
    gradients = ["GRAD_Q"] if stacked is not None else ["GRAD_Q", "GRAD_K", "GRAD_V"]  # stacked: one, in GRAD_Q
    written = {
        "_forward_kernel": ["OUT", "OUT32", "LSE"] + (["QR", "KR"] if rotary is not None else []),
        "_correction_kernel": ["CORRECTION"],
        "_backward_kernel": gradients + (["GRAD_BIAS"] if bias is not None else []),
    }
    return launches, written


@pytest.mark.parametrize("call", ATTENTION_CALLS)
def test_attention_kernels_write_only_their_outputs(sm90, call):
    """The forward, correction and backward kernels in each of `attention_launches`' calls, the handout's packed
    launch with its inputs stacked among them."""
    assert_writes(*attention_launches(call))


@pytest.mark.parametrize("call", ATTENTION_CALLS)
def test_no_written_kernel_argument_shares_memory_with_another(call):
    """torch.compile replaces each kernel argument it takes for written by a copy made before the launch
    and rebinds that argument's tensor to it, one argument after another: a tensor passed as two arguments
    may end up bound to the copy the kernel never wrote (how the perceiver's compiled latent blocks once
    trained on stale gradients). So each written argument must be memory of its own."""
    launches, written = attention_launches(call)
    assert [kernel.fn.__name__ for kernel, _ in launches] == [
        "_forward_kernel",
        "_correction_kernel",
        "_backward_kernel",
    ]
    for kernel, arguments in launches:
        name = kernel.fn.__name__
        tensors = {argument: value for argument, value in arguments.items() if isinstance(value, torch.Tensor)}
        for output in written[name]:
            storage = tensors[output].untyped_storage().data_ptr()
            sharing = [
                other
                for other, value in tensors.items()
                if other != output and value.untyped_storage().data_ptr() == storage
            ]
            assert not sharing, f"{name}: {output} shares memory with {sharing}"


def test_column_sums_and_dropout_mask_kernels_write_only_their_outputs(launches):
    column_sums._column_sums(torch.randn(300, 64, dtype=torch.bfloat16))
    dropout_masks._dropout_keep_mask(torch.tensor([3]), 1000, 6554)
    assert_writes(launches, {"_strip_sums": ["PARTIAL"], "_keep_mask_kernel": ["KEEP"]})


@pytest.mark.parametrize("mask_stored", [False, True], ids=["mask-drawn", "mask-stored"])
def test_fused_layer_kernels_write_only_their_outputs(launches, mask_stored, monkeypatch):
    """The residual sum + dropout + LayerNorm kernels (with the branch's bias, the mask drawn again or stored) and
    the bias + GELU kernels, forward and backward."""
    monkeypatch.setattr(fused_layers, "RESIDUAL_MASK_STORED", mask_stored)
    rows, width = 40, 64
    residual = torch.randn(rows, width, requires_grad=True)
    branch = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    parameters = [torch.randn(width, requires_grad=True) for _ in range(3)]  # branch bias, weight, bias
    new_residual, normalized = fused_layers._ResidualLayerNorm.apply(
        residual, branch, *parameters, 1e-5, 0.1, torch.tensor([5]), 0, torch.bfloat16
    )
    (new_residual.sum() + normalized.float().sum()).backward()
    x, bias = torch.randn(rows, 4 * width, requires_grad=True), torch.randn(4 * width, requires_grad=True)
    fused_layers._BiasGelu.apply(x, bias).sum().backward()
    assert_writes(
        launches,
        {
            "_residual_layer_norm_forward": ["NEW_RESIDUAL", "NORMALIZED", "MEAN", "RSTD"]
            + (["KEEP"] if mask_stored else []),
            "_residual_layer_norm_backward": ["GRAD_RESIDUAL", "GRAD_BRANCH", "GRAD_PARTS"],
            "_bias_gelu_forward": ["OUT"],
            "_bias_gelu_backward": ["GRAD_X", "GRAD_BIAS_PARTS"],
        },
    )


def test_attention_launches_take_their_warps_from_the_module_tables(monkeypatch):
    """The forward and correction kernels run on `NUM_WARPS`' warps for their block size, the backward kernel on
    `BACKWARD_NUM_WARPS`' (`fused_attention.launch_warps`): what `step_variants.py` and `bench_attention.py` set to
    time other launches."""
    launches, _ = attention_launches("packed")
    warps = {kernel.fn.__name__: arguments["num_warps"] for kernel, arguments in launches}
    assert warps == {"_forward_kernel": 1, "_correction_kernel": 1, "_backward_kernel": 2}  # blocks of 16
    monkeypatch.setattr(fused_attention, "NUM_WARPS", {16: 4})
    monkeypatch.setattr(fused_attention, "BACKWARD_NUM_WARPS", {16: 8})
    launches, _ = attention_launches("packed")
    warps = {kernel.fn.__name__: arguments["num_warps"] for kernel, arguments in launches}
    assert warps == {"_forward_kernel": 4, "_correction_kernel": 4, "_backward_kernel": 8}
