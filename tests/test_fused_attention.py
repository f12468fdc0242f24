"""The fused Triton attention kernel computes causal attention with dropout exactly (to fp32 rounding),
forward and backward, against an fp64 reference that uses the kernel's own dropout mask; and the
"triton" attention implementation falls back to SDPA wherever the kernel does not apply.

The kernel tests need Triton and either a CUDA device or Triton's interpreter on the CPU
(`pip install triton`, then `TRITON_INTERPRET=1 python -m pytest tests/test_fused_attention.py`).
"""

import math

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE
from conftest import TRITON_INTERPRETED as INTERPRETED
from conftest import needs_kernel

from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM
from hf_knowgpt.attention_knowgpt import apply_rotary, rotary_angles
from hf_knowgpt.kernels import fused_attention
from hf_knowgpt.kernels.fused_attention import dropout_keep_mask, fused_causal_attention, supports_fused_attention


def reference_attention(query, key, value, scale, keep=None, dropout_p=0.0, bias=None):
    """fp64 causal attention; dropout applies `keep` (the kernel's mask) to the softmax weights; `bias` is
    added to each key's score."""
    length = query.shape[-2]
    scores = query.double() @ key.double().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    if keep is not None:
        weights = torch.where(keep, weights * kept_scale(dropout_p), 0.0)
    return weights @ value.double()


def kept_scale(dropout_p):
    """What the kernels multiply kept weights by: with 16-bit uniforms, kept where at least round(p·2¹⁶), the
    inverse of that keep rate; with uniforms in [0, 1), 1 / (1 − p)."""
    if fused_attention.UNIFORMS_PER_DRAW == 8:
        return 2**16 / (2**16 - round(dropout_p * 2**16))
    return 1 / (1 - dropout_p)


def head_inputs(batch, heads, length, head_dim, dtype, transposed):
    """Query, key and value as the model hands them over: (B, H, T, D) views of (B, T, H·D) projections."""
    tensors = []
    for _ in range(3):
        if transposed:
            states = torch.randn(batch, length, heads * head_dim, device=DEVICE)
            tensor = states.view(batch, length, heads, head_dim).transpose(1, 2)
        else:
            tensor = torch.randn(batch, heads, length, head_dim, device=DEVICE)
        tensors.append(tensor.to(dtype).requires_grad_())
    return tensors


@pytest.fixture(params=[16, 32, 128], ids=lambda size: f"block{size}")
def block_size(request, monkeypatch):
    """The kernels split a sequence into blocks of this many queries and keys (128: one block)."""
    monkeypatch.setattr(fused_attention, "BLOCK_SIZE", request.param)
    return request.param


KERNEL_VARIANTS = {
    "as-is": {},
    "one-uniform-per-draw": {"UNIFORMS_PER_DRAW": 1},
    "four-uniforms-per-draw": {"UNIFORMS_PER_DRAW": 4},
    "correction-in-backward": {"PRECOMPUTED_CORRECTION": False},
}


@pytest.fixture(params=list(KERNEL_VARIANTS))
def kernel_variant(request, monkeypatch):
    """The kernels as they are, their dropout masks taking one uniform from each Philox evaluation or its four
    32-bit outputs instead of eight 16-bit halves, or the backward pass's softmax correction recomputed by every
    backward program."""
    for name, value in KERNEL_VARIANTS[request.param].items():
        monkeypatch.setattr(fused_attention, name, value)
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("length,transposed", [(37, True), (128, False), (192, True)])
@pytest.mark.parametrize("splits", [3, 2], ids=["3-parts", "2-parts"])
def test_kernel_matches_fp64_reference_forward_and_backward(
    dtype, dropout_p, length, transposed, splits, block_size, kernel_variant
):
    if dropout_p == 0.0 and kernel_variant in ("one-uniform-per-draw", "four-uniforms-per-draw"):
        pytest.skip("without dropout no uniforms are drawn")
    if length > 128 and kernel_variant != "as-is":
        pytest.skip("the variants are checked at the shorter lengths (the interpreter is slow)")
    if splits == 2 and (length > 128 or kernel_variant != "as-is"):
        pytest.skip("two parts are checked with the kernels as they are at the shorter lengths")
    torch.manual_seed(0)
    batch, heads, head_dim = 2, 3, 32
    query, key, value = head_inputs(batch, heads, length, head_dim, dtype, transposed)
    scale = 1 / math.sqrt(head_dim)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    out = fused_causal_attention(query, key, value, scale, dropout_p, splits=splits, seed=seed)
    keep = dropout_keep_mask(seed, batch, heads, length, dropout_p) if dropout_p else None
    expected = reference_attention(query, key, value, scale, keep, dropout_p)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), grad)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad.double())

    assert out.dtype == dtype and out.shape == query.shape
    assert all(g.dtype == dtype and g.shape == query.shape for g in grads)
    # Three parts compute as in fp32, so each result is the exact one rounded to bf16: within one unit in its
    # last place (2⁻⁷ relative). Two parts carry each fp32 operand to about 2⁻¹⁷ of itself, so a sum of
    # products is off by up to about 2⁻¹⁶ of its largest terms: where terms cancel, a result can miss by that
    # much of the largest result (one part, 2⁻⁹ of it, fails this).
    ulp = 2**-7
    torch.testing.assert_close(out, expected.to(dtype), rtol=ulp, atol=1e-6 if splits == 3 else bound(expected))
    # Where the exact gradient is zero (the first query sees one key: dS = P (dP − P dP) = 0), fp32's
    # rounding of the difference leaves about 1e-6 (seen at length 192).
    for name, got, want in zip("qkv", grads, expected_grads):
        message = lambda text, name=name: f"gradient of {name}: {text}"  # noqa: E731
        atol = 1e-5 if splits == 3 else bound(want)
        torch.testing.assert_close(got, want, rtol=ulp, atol=atol, msg=message)


def bound(exact):
    """Two parts' tolerance for results near zero: 2⁻¹³ of the largest exact result, a margin of 8 over the
    2⁻¹⁶ that two parts can miss by."""
    return 2**-13 * exact.abs().max().item()


@needs_kernel
def test_lengths_mark_right_padding(block_size):
    """With `lengths`, real positions get what the whole sequence gives them, padding gets zeros, and the
    padding's output gradient is ignored; blocks of padding alone are skipped."""
    torch.manual_seed(0)
    batch, heads, length, head_dim, dropout_p = 4, 2, 70, 16, 0.2
    query, key, value = head_inputs(batch, heads, length, head_dim, torch.bfloat16, True)
    lengths = torch.tensor([70, 5, 33, 64], device=DEVICE)
    real = (torch.arange(length, device=DEVICE) < lengths[:, None])[:, None, :, None]  # (B, 1, T, 1)
    scale, seed = 0.25, torch.tensor([99], dtype=torch.int64, device=DEVICE)
    out = fused_causal_attention(query, key, value, scale, dropout_p, splits=3, seed=seed, lengths=lengths)
    keep = dropout_keep_mask(seed, batch, heads, length, dropout_p)
    expected = reference_attention(query, key, value, scale, keep, dropout_p)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), grad)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad.double() * real)

    ulp = 2**-7
    torch.testing.assert_close(out, (expected * real).to(out.dtype), rtol=ulp, atol=1e-6)
    for name, got, want in zip("qkv", grads, expected_grads):
        message = lambda text, name=name: f"gradient of {name}: {text}"  # noqa: E731
        torch.testing.assert_close(got, want, rtol=ulp, atol=1e-6, msg=message)
        assert not got.masked_select(~real).any(), f"gradient of {name} nonzero at padding"
    with pytest.raises(ValueError, match="lengths must hold one integer per sequence"):
        fused_causal_attention(query, key, value, scale, lengths=lengths[:2])


@needs_kernel
def test_packed_sequences_match_the_grid(block_size):
    """Packed tokens (sequences back to back, as views of one (tokens, 3·H·D) projection, as the model
    hands them over) give bit for bit what the (B, H, T, D) call with `lengths` gives at the real
    positions, forward and backward, with the same dropout mask."""
    torch.manual_seed(0)
    batch, heads, length, head_dim, dropout_p = 4, 2, 70, 16, 0.2
    lengths = torch.tensor([70, 5, 33, 64], device=DEVICE)
    starts = lengths.cumsum(0) - lengths
    tokens = int(lengths.sum())
    projected = torch.randn(tokens, 3 * heads * head_dim, device=DEVICE).to(torch.bfloat16).requires_grad_()
    packed = projected.view(tokens, 3, heads, head_dim).unbind(1)
    real = torch.arange(length, device=DEVICE) < lengths[:, None]  # (B, T)
    grid = [torch.zeros(batch, length, heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    for states, tokens_of_head in zip(grid, packed):
        states[real] = tokens_of_head.detach()
    grid = [states.transpose(1, 2).requires_grad_() for states in grid]  # (B, H, T, D) views
    scale, seed = 0.25, torch.tensor([99], dtype=torch.int64, device=DEVICE)

    out = fused_causal_attention(*packed, scale, dropout_p, seed=seed, lengths=lengths, starts=starts, seq_len=length)
    expected = fused_causal_attention(*grid, scale, dropout_p, seed=seed, lengths=lengths)
    assert out.shape == (tokens, heads, head_dim)
    assert torch.equal(out, expected.transpose(1, 2)[real])
    grad = torch.randn_like(out)
    (projected_grad,) = torch.autograd.grad(out, projected, grad)
    grid_grad = torch.zeros_like(expected.transpose(1, 2))
    grid_grad[real] = grad
    expected_grads = torch.autograd.grad(expected, grid, grid_grad.transpose(1, 2))
    for name, got, want in zip("qkv", projected_grad.view(tokens, 3, heads, head_dim).unbind(1), expected_grads):
        assert torch.equal(got, want.transpose(1, 2)[real]), f"gradient of {name}"

    with pytest.raises(ValueError, match="need all of lengths, starts and seq_len"):
        fused_causal_attention(*packed, scale, lengths=lengths, starts=starts)
    with pytest.raises(ValueError, match="cover every token: lengths sum to 171, not 172"):
        fused_causal_attention(*packed, scale, lengths=lengths - torch.tensor([1, 0, 0, 0], device=DEVICE),
                               starts=starts, seq_len=length)  # fmt: skip
    with pytest.raises(ValueError, match="seq_len ≤ 256"):
        fused_causal_attention(*packed, scale, lengths=lengths, starts=starts, seq_len=257)


@needs_kernel
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_stacked_queries_keys_and_values_give_the_separate_calls_results(block_size, rotary):
    """One (tokens, 3, H, D) tensor of queries, keys and values (key and value None) gives bit for bit the output of
    the call with its three parts, and one gradient that stacks their three gradients (written where it lies, not
    concatenated after), with rotary tables too."""
    torch.manual_seed(0)
    heads, length, head_dim, dropout_p = 2, 40, 16, 0.2
    lengths = torch.tensor([40, 7, 25], device=DEVICE)
    starts = lengths.cumsum(0) - lengths
    tokens = int(lengths.sum())
    stacked = torch.randn(tokens, 3, heads, head_dim, device=DEVICE).to(torch.bfloat16).requires_grad_()
    parts = [part.detach().clone().requires_grad_() for part in stacked.unbind(1)]
    table = rotary_angles(torch.arange(length, device=DEVICE), head_dim, theta=10000.0) if rotary else None
    options = dict(seed=torch.tensor([7], dtype=torch.int64, device=DEVICE), lengths=lengths, starts=starts)
    options.update(seq_len=length, rotary=table)
    out = fused_causal_attention(stacked, None, None, 0.25, dropout_p, **options)
    expected = fused_causal_attention(*parts, 0.25, dropout_p, **options)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    (stacked_grad,) = torch.autograd.grad(out, stacked, grad)
    expected_grads = torch.autograd.grad(expected, parts, grad)
    assert stacked_grad.shape == stacked.shape
    for name, got, want in zip("qkv", stacked_grad.unbind(1), expected_grads):
        assert torch.equal(got, want), f"gradient of {name}"
    with pytest.raises(ValueError, match="must stack queries, keys and values of packed sequences"):
        fused_causal_attention(stacked, None, None, 0.25)


@needs_kernel
def test_rotary_in_the_kernel_is_rotating_first(block_size):
    """With rotary tables the kernel gives what rotating queries and keys beforehand (the model's
    `apply_rotary`) and then attending gives, forward and backward (gradients of the unrotated inputs)."""
    torch.manual_seed(0)
    batch, heads, length, head_dim, dropout_p = 2, 3, 45, 32, 0.2
    query, key, value = head_inputs(batch, heads, length, head_dim, torch.bfloat16, True)
    cos, sin = rotary_angles(torch.arange(length, device=DEVICE), head_dim, theta=10000.0)  # (T, D/2)
    scale, seed = 1 / math.sqrt(head_dim), torch.tensor([5], dtype=torch.int64, device=DEVICE)
    out = fused_causal_attention(query, key, value, scale, dropout_p, seed=seed, rotary=(cos, sin))
    rotated = fused_causal_attention(
        apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value, scale, dropout_p, seed=seed
    )
    # Rotated queries and keys are rounded to bf16 either way, but Triton's interpreter rounds differently
    # from torch (toward zero), so an element may differ by a few units of bf16 rounding (2⁻⁸ relative)
    # of the largest; a wrong angle, sign or pairing moves the results by their whole size.
    unit = 2**-8

    def assert_near(got, want, name):
        torch.testing.assert_close(got, want, rtol=4 * unit, atol=4 * unit * want.abs().max().item(), msg=name)

    assert_near(out, rotated, "output")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), grad)
    expected_grads = torch.autograd.grad(rotated, (query, key, value), grad)
    for name, got, want in zip("qkv", grads, expected_grads):
        assert_near(got, want, f"gradient of {name}")
    assert (out - fused_causal_attention(query, key, value, scale, dropout_p, seed=seed)).abs().max() > 0.1
    with pytest.raises(ValueError, match="rotary tables must be"):
        fused_causal_attention(query, key, value, scale, rotary=(cos[:-1], sin[:-1]))


@needs_kernel
@pytest.mark.parametrize("packed", [False, True], ids=["grid", "packed"])
def test_keys_by_position_with_a_bias(block_size, packed):
    """The synthesizer's attention: one (T, D) table of keys by position shared by every sequence and head,
    and a bias per key position. Results and gradients (the table's and the bias's summed over sequences and
    heads) are the exact ones rounded, with lengths; the packed call gives the grid call's numbers."""
    torch.manual_seed(0)
    batch, heads, length, head_dim, dropout_p = 4, 2, 70, 16, 0.2
    lengths = torch.tensor([70, 5, 33, 64], device=DEVICE)
    query, _, value = head_inputs(batch, heads, length, head_dim, torch.bfloat16, True)
    table = torch.randn(length + 10, head_dim, device=DEVICE).to(torch.bfloat16).requires_grad_()  # T' > T
    bias = torch.randn(length + 10, device=DEVICE, requires_grad=True)
    real = torch.arange(length, device=DEVICE) < lengths[:, None]  # (B, T)
    seed = torch.tensor([11], dtype=torch.int64, device=DEVICE)

    out = fused_causal_attention(query, table, value, 1.0, dropout_p, splits=3, seed=seed, lengths=lengths, bias=bias)
    keep = dropout_keep_mask(seed, batch, heads, length, dropout_p)
    expected = reference_attention(query, table[:length], value, 1.0, keep, dropout_p, bias=bias[:length])
    mask = real[:, None, :, None]
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, table, value, bias), grad)
    expected_grads = torch.autograd.grad(expected, (query, table, value, bias), grad.double() * mask)
    ulp = 2**-7
    torch.testing.assert_close(out, (expected * mask).to(out.dtype), rtol=ulp, atol=1e-6)
    for name, got, want in zip(("query", "key table", "value", "bias"), grads, expected_grads):
        # Sums in fp32 of terms up to the size of the largest result (the table's and the bias's also over the
        # 8 sequence-heads): where they cancel, a result far smaller than the largest is off by up to ~2⁻¹⁶ of
        # that, still far below one bf16 unit (2⁻⁸) of it (an H200 was off by up to 5.7e-6 against an atol of 1e-6).
        tolerance = dict(rtol=ulp if got.dtype == torch.bfloat16 else 1e-5, atol=2**-16 * want.abs().max().item())
        torch.testing.assert_close(got, want.to(got.dtype), **tolerance, msg=lambda text, n=name: f"{n}: {text}")
    assert not grads[1][length:].any() and not grads[3][length:].any()  # positions past T: never used

    if packed:
        starts = lengths.cumsum(0) - lengths
        tokens = [states.detach().transpose(1, 2)[real].requires_grad_() for states in (query, value)]
        packed_out = fused_causal_attention(tokens[0], table, tokens[1], 1.0, dropout_p, splits=3, seed=seed,
                                            lengths=lengths, starts=starts, seq_len=length, bias=bias)  # fmt: skip
        assert torch.equal(packed_out, out.transpose(1, 2)[real])
        packed_grads = torch.autograd.grad(packed_out, (tokens[0], table, tokens[1], bias), grad.transpose(1, 2)[real])
        assert torch.equal(packed_grads[0], grads[0].transpose(1, 2)[real])
        assert torch.equal(packed_grads[2], grads[2].transpose(1, 2)[real])
        assert torch.equal(packed_grads[1], grads[1]) and torch.equal(packed_grads[3], grads[3])
    with pytest.raises(ValueError, match="bias must hold one value per key position"):
        fused_causal_attention(query, table, value, 1.0, lengths=lengths, bias=bias[:10])
    with pytest.raises(ValueError, match="rotary needs keys per token"):
        cos, sin = rotary_angles(torch.arange(length, device=DEVICE), head_dim, theta=10000.0)
        fused_causal_attention(query, table, value, 1.0, rotary=(cos, sin))


@needs_kernel
@pytest.mark.parametrize("call", ["grid", "packed-rotary", "packed-key-table-bias"])
def test_gradients_repeat_bit_for_bit(block_size, call, monkeypatch):
    """Two calls with one seed give the same output and gradients, bit for bit: each gradient is written by
    one program (no atomics), and the backward kernel regenerates the forward kernel's dropout mask. With
    lengths, packed tokens, rotary, keys by position with a bias, and backward blocks of the forward ones'
    size or twice it."""
    torch.manual_seed(0)
    batch, heads, length, head_dim, dropout_p = 4, 2, 70, 16, 0.2
    lengths = torch.tensor([70, 5, 33, 64], device=DEVICE)
    real = torch.arange(length, device=DEVICE) < lengths[:, None]  # (B, T)
    seed = torch.tensor([21], dtype=torch.int64, device=DEVICE)
    query, key, value = head_inputs(batch, heads, length, head_dim, torch.bfloat16, True)
    options = dict(seed=seed, lengths=lengths, block_size=block_size)
    if call != "grid":
        query, key, value = (states.detach().transpose(1, 2)[real].requires_grad_() for states in (query, key, value))
        options |= dict(starts=lengths.cumsum(0) - lengths, seq_len=length)
    if call == "packed-rotary":
        options["rotary"] = rotary_angles(torch.arange(length, device=DEVICE), head_dim, theta=10000.0)
    if call == "packed-key-table-bias":
        key = torch.randn(length, head_dim, device=DEVICE).to(torch.bfloat16).requires_grad_()
        options["bias"] = torch.randn(length, device=DEVICE, requires_grad=True)
    inputs = [query, key, value] + ([options["bias"]] if "bias" in options else [])
    grad = torch.randn(query.shape, device=DEVICE).to(torch.bfloat16)
    for backward_block in (None, 2 * block_size):
        monkeypatch.setattr(fused_attention, "BACKWARD_BLOCK_SIZE", backward_block)
        results = []
        for _ in range(2):
            out = fused_causal_attention(query, key, value, 0.25, dropout_p, **options)
            results.append((out, *torch.autograd.grad(out, inputs, grad)))
        for name, first, second in zip(("output", "query", "key", "value", "bias"), *results):
            differing = (first != second).sum().item()
            assert differing == 0, (
                f"{name}: {differing} elements differ between calls, backward blocks {backward_block}"
            )


@needs_kernel
@pytest.mark.parametrize("uniforms_per_draw", [4, 8, 1])
def test_dropout_mask_rate_and_freshness(uniforms_per_draw, monkeypatch):
    monkeypatch.setattr(fused_attention, "UNIFORMS_PER_DRAW", uniforms_per_draw)
    batch, heads, length = 4, 2, 64
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE)
    keep = dropout_keep_mask(seed, batch, heads, length, 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.01  # 32,768 draws: σ ≈ 0.0017
    # Adjacent keys (with 4 or 8 uniforms per draw, outputs of one Philox evaluation) are dropped independently:
    # both of a pair in p² = 1% of pairs (16,384 pairs: σ ≈ 0.0008).
    dropped = ~keep.view(-1, 2)
    assert abs(dropped.all(-1).float().mean().item() - 0.01) < 0.004
    assert abs(dropped.float().mean().item() - 0.1) < 0.01
    assert torch.equal(keep, dropout_keep_mask(seed, batch, heads, length, 0.1))
    other = dropout_keep_mask(seed + 1, batch, heads, length, 0.1)
    assert (keep != other).float().mean() > 0.1  # independent masks differ in ~18% of places
    # Each call draws its own seed from torch's generator: two calls differ, a reseeded call repeats.
    query, key, value = head_inputs(1, 2, 40, 16, torch.bfloat16, False)
    torch.manual_seed(3)
    first = fused_causal_attention(query, key, value, 0.25, 0.5)
    second = fused_causal_attention(query, key, value, 0.25, 0.5)
    torch.manual_seed(3)
    again = fused_causal_attention(query, key, value, 0.25, 0.5)
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


@needs_kernel
def test_eight_uniforms_per_draw_are_the_dropout_mask_kernels_stream(monkeypatch):
    """With UNIFORMS_PER_DRAW 8, key k of query r of (batch·head) program n takes uniform (n·S + r)·S + k of the
    stream `dropout_masks` draws for the call's seed (S the padded length), and is kept where it is at least
    round(p·2¹⁶): the mask that module's kernel draws for the (programs, S, S) grid, and Philox computed in
    Python (`dropout_masks.philox_reference`)."""
    from hf_knowgpt.kernels.dropout_masks import dropout_keep_mask as mask_kernel_draws
    from hf_knowgpt.kernels.dropout_masks import philox_reference

    monkeypatch.setattr(fused_attention, "UNIFORMS_PER_DRAW", 8)
    batch, heads, length, seed = 1, 2, 20, 12345
    stride = 32  # the padded length of 20 positions
    seed_tensor = torch.tensor([seed], device=DEVICE)
    grid = (batch * heads, stride, stride)
    uniforms = philox_reference(seed, batch * heads * stride * stride).view(grid)
    # A rate halfway between two levels: p·2¹⁶ = u + ½ for an even uniform u the mask holds, which round() takes
    # down to u, so that uniform is kept (a rule of its own in the kernel, u + ½ > p·2¹⁶, would drop it).
    seen = uniforms[:, :length, :length]
    even = seen[seen % 2 == 0][0].item()
    for dropout_p in (0.3, (even + 0.5) / 2**16):
        levels = round(dropout_p * 2**16)
        keep = dropout_keep_mask(seed_tensor, batch, heads, length, dropout_p).view(-1, length, length).cpu()
        assert torch.equal(keep, (uniforms >= levels)[:, :length, :length])
        drawn = mask_kernel_draws(grid, levels, DEVICE, seed=seed_tensor).cpu()
        assert torch.equal(keep, drawn[:, :length, :length])
    assert levels == even and keep[seen == even].all()


@needs_kernel
@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer", "perceiver"])
@pytest.mark.parametrize("stacked_inputs", [False, True], ids=["three-inputs", "stacked-inputs"])
def test_triton_implementation_trains_like_sdpa(attention_type, stacked_inputs, monkeypatch):
    """Under bf16 autocast the model's loss and gradients are as close to fp32 training's with the fused
    kernel as with SDPA's fp32 kernel (no dropout): reading the packed tokens, or (the perceiver's latent
    blocks, 2 of its 4 layers) in the (B, H, T, D) layout; the queries, keys and values handed over as three
    tensors or, where told (STACKED_ATTENTION_INPUTS), as one."""
    import hf_knowgpt.attention_knowgpt as attention

    monkeypatch.setattr(attention, "STACKED_ATTENTION_INPUTS", stacked_inputs)
    kernel_calls, stacked_calls = [], []

    def recorded(*arguments, **options):
        kernel_calls.append(options)
        stacked_calls.append(arguments[1] is None)  # queries, keys and values in one tensor
        return fused_causal_attention(*arguments, **options)

    monkeypatch.setattr(attention, "fused_causal_attention", recorded)
    torch.manual_seed(0)
    config = KnowGPTConfig(
        vocab_size=60, n_layer=4 if attention_type == "perceiver" else 2, n_head=4, n_embd=64, block_size=48,
        attention_type=attention_type, bottleneck_dim=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    model = KnowGPTForCausalLM(config).to(DEVICE).train()
    input_ids = torch.randint(0, 60, (3, 48), device=DEVICE)
    lengths = [48, 30, 17]
    token_index = torch.cat([torch.arange(n, device=DEVICE) + 48 * row for row, n in enumerate(lengths)])

    def loss_and_gradient(implementation, autocast=True):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=input_ids, labels=input_ids, token_index=token_index, use_cache=False).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    exact_loss, exact_gradient = loss_and_gradient("sdpa", autocast=False)
    errors = {}
    for implementation in ("triton", "sdpa"):
        loss, gradient = loss_and_gradient(implementation)
        errors[implementation] = (
            abs(loss - exact_loss).item(),
            ((gradient - exact_gradient).norm() / exact_gradient.norm()).item(),
        )
    fused, sdpa = errors["triton"], errors["sdpa"]
    if attention_type == "perceiver":
        assert len(kernel_calls) == config.n_layer - 2 and not any("starts" in call for call in kernel_calls)
    else:
        assert len(kernel_calls) == config.n_layer and all("starts" in call for call in kernel_calls)  # packed
        # where told, one projection's three outputs stacked, except the synthesizer's keys by position
        stacks = stacked_inputs and attention_type in ("vanilla", "rope")
        assert all(stacked_calls) == stacks and any(stacked_calls) == stacks
    assert fused[1] < 0.02  # what bf16 projections cost: ~1% of the gradient
    assert fused[0] <= 2 * sdpa[0] + 1e-4 and fused[1] <= 1.5 * sdpa[1], errors


def test_only_unmasked_short_causal_half_precision_calls_qualify():
    query = torch.zeros(2, 4, 100, 32, device=DEVICE, dtype=torch.bfloat16)
    qualifies = fused_attention.triton is not None and (query.is_cuda or INTERPRETED)
    assert supports_fused_attention(query, query, query, None, True) == qualifies
    assert not supports_fused_attention(query, query, query, torch.zeros(2, 1, 100, 100), True)  # padding mask
    assert not supports_fused_attention(query, query, query, None, False)  # not causal
    single, half = query.float(), query.half()
    assert not supports_fused_attention(single, single, single, None, True)  # fp32: SDPA is the fp32 kernel
    assert not supports_fused_attention(half, half, half, None, True)  # fp16: not offered
    knowledge_block = torch.zeros(2, 4, 192, 32, device=DEVICE, dtype=torch.bfloat16)  # the knowledge recipe's
    assert supports_fused_attention(knowledge_block, knowledge_block, knowledge_block, None, True) == qualifies
    long = torch.zeros(2, 4, 257, 32, device=DEVICE, dtype=torch.bfloat16)
    assert not supports_fused_attention(long, long, long, None, True)  # beyond MAX_SEQ_LEN
    odd = torch.zeros(2, 4, 100, 24, device=DEVICE, dtype=torch.bfloat16)
    assert not supports_fused_attention(odd, odd, odd, None, True)  # head_dim not a power of two
    with pytest.raises(ValueError, match="fused_causal_attention needs"):
        fused_causal_attention(long, long, long, 0.1)


@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer", "perceiver"])
def test_triton_implementation_elsewhere_is_sdpa(attention_type):
    """With a padding mask, the KV cache, on CPU or for attention the kernel does not cover, "triton"
    gives what "sdpa" gives (its fallback), so a model can keep it for evaluation and generation."""
    torch.manual_seed(0)
    config = KnowGPTConfig(
        vocab_size=40, n_layer=3, n_head=2, n_embd=32, block_size=24, attention_type=attention_type,
        bottleneck_dim=8,
    )  # fmt: skip
    model = KnowGPTForCausalLM(config).eval()
    input_ids = torch.randint(0, 40, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding

    def outputs(implementation):
        model.set_attn_implementation(implementation)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        generated = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
        return logits, generated

    triton_logits, triton_generated = outputs("triton")
    sdpa_logits, sdpa_generated = outputs("sdpa")
    torch.testing.assert_close(triton_logits, sdpa_logits)
    assert torch.equal(triton_generated, sdpa_generated)
