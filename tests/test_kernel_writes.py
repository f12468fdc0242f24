"""What torch.compile takes each of the package's Triton kernels to write: its outputs, and none of its inputs.

Compiled code gives every argument that its analysis of a kernel takes for written a copy made before the launch
(functionalization), so an input taken for written costs a copy kernel at every launch of every compiled step. The
attention kernels once read their sequences' lengths and first tokens through a helper, whose results the
analysis follows back to every argument the helper was handed: their LENGTHS and STARTS counted as written, and
each compiled step copied them before each attention launch. The analysis here is torch's own
(`identify_accessed_tensors`), run on each launch as the package makes it, for an sm_90 target: it needs Triton,
not a GPU (`pip install -e ".[triton]"`).
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="the analysis builds each kernel's Triton IR (CPU torch comes without)")

from hf_knowgpt.kernels import column_sums, dropout_masks, fused_attention, fused_layers  # noqa: E402


class _Recorded:
    """A kernel whose launches are recorded, by argument name, instead of run."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*arguments, **options):
            named = dict(zip(self.kernel.arg_names, arguments)) | options
            self.launches.append((self.kernel, {name: named[name] for name in self.kernel.arg_names}))

        return launch


@pytest.fixture
def launches(monkeypatch):
    """Launches through `torch.library.wrap_triton` and of the fused layers' kernels, recorded; Triton's active
    driver set to an sm_90 target for the analysis, which asks the driver for one."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    recorded = []
    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: _Recorded(kernel, recorded))
    for name in ("_residual_layer_norm_forward", "_residual_layer_norm_backward", "_bias_gelu_forward",
                 "_bias_gelu_backward"):  # fmt: skip
        monkeypatch.setattr(fused_layers, name, _Recorded(getattr(fused_layers, name), recorded))

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", Sm90())  # restored after: a CPU has no driver to reset to
    yield recorded


def written(kernel, arguments) -> set[str]:
    """The tensor arguments torch.compile takes `kernel` to write at this launch."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    accesses = identify_accessed_tensors(kernel, dict(arguments), {})
    return {dep.name for dep in accesses.read_writes.writes if isinstance(arguments[dep.name], torch.Tensor)}


def assert_writes(launches, expected):
    """Each launch writes what `expected` gives for its kernel's name, and every expected kernel ran."""
    assert sorted({kernel.fn.__name__ for kernel, _ in launches}) == sorted(expected)
    for kernel, arguments in launches:
        assert written(kernel, arguments) == set(expected[kernel.fn.__name__]), kernel.fn.__name__


@pytest.mark.parametrize("call", ["packed-stacked", "packed", "packed-rotary", "grid-lengths", "grid-key-table-bias"])
def test_attention_kernels_write_only_their_outputs(launches, call):
    """The forward, correction and backward kernels at the handout's packed launch (inputs stacked), with three
    inputs, with rotary, on the (B, H, T, D) grid with lengths, and with keys by position and a bias."""
    from hf_knowgpt.attention_knowgpt import rotary_angles

    heads, head_dim, length = 2, 16, 20
    lengths = starts = rotary = bias = stacked = None
    if call.startswith("packed"):
        lengths, starts = torch.tensor([20, 15], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32)
        query, key, value = (torch.randn(35, heads, head_dim, dtype=torch.bfloat16) for _ in range(3))
        if call == "packed-stacked":
            stacked = torch.randn(35, 3, heads, head_dim, dtype=torch.bfloat16)
            query, key, value = stacked.unbind(1)
        if call == "packed-rotary":
            rotary = rotary_angles(torch.arange(length), head_dim, 10000.0)
    else:
        query, key, value = (torch.randn(2, heads, length, head_dim, dtype=torch.bfloat16) for _ in range(3))
        lengths = torch.tensor([20, 7], dtype=torch.int32)
        if call == "grid-key-table-bias":
            key, bias = torch.randn(length, head_dim, dtype=torch.bfloat16), torch.randn(length)
    cos, sin = rotary if rotary is not None else (None, None)
    seed, options = torch.tensor([1]), (length, 0.25, 0.1, 2, 16)
    inputs = (query, key, value) if stacked is None else (stacked, None, None)
    out, out32, lse, _, _ = fused_attention._causal_attention_forward(
        *inputs, seed, lengths, starts, cos, sin, bias, *options
    )
    fused_attention._causal_attention_backward(
        out, query, key, value, out32, lse, seed, lengths, starts, cos, sin, bias, *options, stacked is not None
    )
    gradients = ["GRAD_Q"] if stacked is not None else ["GRAD_Q", "GRAD_K", "GRAD_V"]
    assert_writes(
        launches,
        {
            "_forward_kernel": ["OUT", "OUT32", "LSE"] + (["QR", "KR"] if rotary is not None else []),
            "_correction_kernel": ["CORRECTION"],
            "_backward_kernel": gradients + (["GRAD_BIAS"] if bias is not None else []),
        },
    )


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
