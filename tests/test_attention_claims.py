"""The handouts' written claims about attention, checked on this project's own modules."""

import math

import pytest
import torch
from conftest import tiny_config

from hf_knowgpt.attention_knowgpt import AttentionContext, TokenGrid, apply_rotary, rotary_angles, sdpa_attention
from hf_knowgpt.modeling_knowgpt import KnowGPTBlock


def full_visibility(length):
    """Every query sees every key: attention with no causal mask and no position information."""
    zeros = torch.zeros(1, length, dtype=torch.long)
    return AttentionContext(zeros, zeros, None, causal_only=False)


def sinusoidal_positions(length, width):
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    frequencies = 10000 ** (-torch.arange(0, width, 2, dtype=torch.float32) / width)
    table = torch.zeros(length, width)
    table[:, 0::2], table[:, 1::2] = (positions * frequencies).sin(), (positions * frequencies).cos()
    return table


@pytest.fixture
def block():
    torch.manual_seed(0)
    return KnowGPTBlock(tiny_config("vanilla", n_embd=32, n_head=4), layer_idx=0).eval()


def run_block(block, states):
    output, _ = block(states, TokenGrid(*states.shape[:2]), full_visibility(states.shape[1]))
    return output


def test_attention_and_mlp_without_positions_are_permutation_equivariant(block):
    states = torch.randn(1, 9, 32)
    permutation = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    output = run_block(block, states)
    permuted_output = run_block(block, states[:, permutation])
    assert torch.allclose(permuted_output, output[:, permutation], atol=1e-5)  # Z_perm = P Z


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_position_embeddings_break_permutation_equivariance(block, positions):
    torch.manual_seed(1)
    table = torch.randn(9, 32) if positions == "learned" else sinusoidal_positions(9, 32)
    states = torch.randn(1, 9, 32)
    permutation = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    output = run_block(block, states + table)
    permuted_output = run_block(block, states[:, permutation] + table)
    assert not torch.allclose(permuted_output, output[:, permutation], atol=1e-3)


@pytest.mark.parametrize("t1, t2", [(5, 2), (2, 5), (17, 17), (0, 30), (100, 3)])
def test_rope_scores_depend_only_on_relative_position(t1, t2):
    generator = torch.Generator().manual_seed(t1 * 31 + t2)
    query, key = torch.randn(2, 1, 1, 1, 32, generator=generator)

    def rotate(vector, position):
        cos, sin = rotary_angles(torch.tensor([[position]]), head_dim=32, theta=10000.0)
        return apply_rotary(vector, cos, sin)

    absolute = (rotate(query, t1) * rotate(key, t2)).sum()
    relative = (rotate(query, t1 - t2) * rotate(key, 0)).sum()
    assert torch.allclose(absolute, relative, atol=1e-4)
    assert rotate(query, t1).norm().item() == pytest.approx(query.norm().item(), rel=1e-5)  # a rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_eager_and_compiled_rotate_each_pair_by_its_angle(dtype):
    """Eagerly a complex product, under torch.compile real arithmetic: both are the 2×2 rotation of each
    adjacent pair, in value and in gradient."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 3, 8, generator=generator).to(dtype)  # (B, T, H, D)
    cos, sin = rotary_angles(torch.arange(5)[None] + 3, head_dim=8, theta=10000.0)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    even, odd = states.float()[..., 0::2], states.float()[..., 1::2]
    expected = torch.zeros(states.shape)
    expected[..., 0::2], expected[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    upstream = torch.randn(states.shape, generator=generator).to(dtype)
    results = []
    for rotate in (apply_rotary, torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)):
        leaf = states.clone().requires_grad_()
        rotated = rotate(leaf, cos, sin)
        (rotated.float() * upstream.float()).sum().backward()
        results.append((rotated, leaf.grad))
    for rotated, grad in results:
        assert rotated.dtype == dtype
        torch.testing.assert_close(rotated, expected.to(dtype))  # fp32: within a few ulps (fused or not)
        # the gradient rotates back: by the angle's negative
        up_even, up_odd = upstream.float()[..., 0::2], upstream.float()[..., 1::2]
        expected_grad = torch.zeros(states.shape)
        expected_grad[..., 0::2] = up_even * cos + up_odd * sin
        expected_grad[..., 1::2] = -up_even * sin + up_odd * cos
        torch.testing.assert_close(grad, expected_grad.to(dtype))


def test_query_on_the_sum_of_two_orthonormal_keys_averages_their_values():
    torch.manual_seed(0)
    keys = torch.linalg.qr(torch.randn(16, 16))[0][:6]  # 6 orthonormal keys of width 16
    values = torch.randn(6, 8)
    a, b = 1, 4
    target = (values[a] + values[b]) / 2
    errors = []
    for beta in (0.5, 2.0, 8.0, 32.0):
        query = beta * (keys[a] + keys[b])
        output, _ = sdpa_attention(
            query[None, None, None], keys[None, None], values[None, None], None, 1.0, 0.0, False
        )
        errors.append((output[0, 0, 0] - target).norm().item())
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]))
    assert errors[-1] < 1e-5  # float32 rounding; the other weights are e^-32


def test_a_key_of_varying_norm_makes_one_head_unstable_and_two_heads_stable():
    """Σ_a = αI + ½ μ_a μ_aᵀ: k_a's length varies; q = β(μ_a + μ_b) in one head swings between v_a and v_b,
    while two heads (q₁ = βμ_a, q₂ = βμ_b, averaged) keep returning ½(v_a + v_b)."""
    torch.manual_seed(0)
    width, n_keys, samples, alpha, beta = 32, 8, 4000, 1e-4, 40.0
    means = torch.linalg.qr(torch.randn(width, width))[0][:n_keys]
    values = torch.randn(n_keys, width)
    a, b = 0, 1
    keys = means + alpha**0.5 * torch.randn(samples, n_keys, width)
    keys[:, a] += (0.5**0.5) * torch.randn(samples, 1) * means[a]  # the ½ μ_a μ_aᵀ term
    values = values.expand(samples, n_keys, width)

    one_head_query = beta * (means[a] + means[b])
    single = sdpa_attention(
        one_head_query.expand(samples, 1, 1, width), keys[:, None], values[:, None], None, 1.0, 0.0, False
    )[0][:, 0, 0]
    two_head_queries = beta * torch.stack([means[a], means[b]])[None, :, None].expand(samples, 2, 1, width)
    two = sdpa_attention(
        two_head_queries,
        keys[:, None].expand(-1, 2, -1, -1),
        values[:, None].expand(-1, 2, -1, -1),
        None,
        1.0,
        0.0,
        False,
    )[0][:, :, 0].mean(dim=1)

    single_variance = single.var(dim=0).sum().item()
    two_variance = two.var(dim=0).sum().item()
    assert single_variance > 10 * two_variance  # measured about 30x at these settings
    target = (values[0, a] + values[0, b]) / 2
    near = (two - target).norm(dim=-1) < 0.1 * target.norm()
    single_near = (single - target).norm(dim=-1) < 0.1 * target.norm()
    assert near.float().mean() > 0.8 > 0.2 > single_near.float().mean()
    assert math.isfinite(single_variance) and single_variance > 0.1
