"""Dropout masks drawn by a Triton kernel, eight elements from each Philox evaluation, for compiled training steps.

Why: in a compiled step inductor draws each dropout's uniforms inside the kernel that applies it, one Philox
evaluation (ten rounds) per element. At the handout's 7600 × 256 residual sums that makes the kernel which adds a
residual branch and applies the LayerNorm after it take 18.8 µs forward where it takes 7.0 µs without dropout and
6.8 µs with the mask handed in as bytes (`benchmarks/diagnostics/dropout_draws.py`, H100, benchmarks/RESULTS.md).
Here one kernel draws a whole mask, each evaluation's four 32-bit outputs giving eight 16-bit uniforms, and the
mask goes to the multiply that inductor fuses into the kernel around it.

What: element n of a mask takes uniform n, the 16-bit half n mod 2 (low half first) of output (n mod 8) // 2 of
Philox4x32-10 at counter n // 8 under the call's seed (Triton's `randint4x`), and is kept where that uniform is
at least `dropped_levels` (round(p · 2¹⁶)): `KnowGPTDropout`'s rule on a CPU, which cuts its uniforms from 64-bit
draws. `philox_reference` computes the same uniforms in Python for the tests.
"""

import torch

from .fused_attention import UNIFORM_LEVELS, _interpreted, draw_seed, triton

if triton is not None:
    import triton.language as tl

    from .fused_attention import _eight_uniforms

# Philox counters per program; each gives 8 mask elements.
COUNTERS_PER_PROGRAM = 256
UNIFORMS_PER_EVALUATION = 8


def dropout_masks_available() -> bool:
    """Whether the kernel can draw masks here: Triton and a CUDA device, or Triton's interpreter."""
    return triton is not None and (torch.cuda.is_available() or _interpreted())


if triton is not None:

    @triton.jit
    def _keep_mask_kernel(SEED, KEEP, numel, dropped_levels, COUNTERS: tl.constexpr):
        counters = tl.program_id(0).to(tl.int64) * COUNTERS + tl.arange(0, COUNTERS)
        uniforms = _eight_uniforms(tl.load(SEED), counters[:, None])  # (COUNTERS, 8): element 8c + lane
        elements = counters[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(KEEP + elements, (uniforms >= dropped_levels).to(tl.int8), mask=elements < numel)

    @torch.library.triton_op("knowgpt::dropout_keep_mask", mutates_args=())
    def _dropout_keep_mask(seed: torch.Tensor, numel: int, dropped_levels: int) -> torch.Tensor:
        """The mask of `numel` elements, a byte each."""
        keep = torch.empty(numel, dtype=torch.int8, device=seed.device)
        programs = triton.cdiv(numel, COUNTERS_PER_PROGRAM * UNIFORMS_PER_EVALUATION)
        torch.library.wrap_triton(_keep_mask_kernel)[(programs,)](
            seed, keep, numel, dropped_levels, COUNTERS=COUNTERS_PER_PROGRAM
        )
        return keep


def dropout_keep_mask(shape, dropped_levels: int, device, seed: torch.Tensor | None = None) -> torch.Tensor:
    """The boolean mask of the elements a dropout keeps: element n where its uniform (see the module's
    docstring) is at least `dropped_levels` of 2¹⁶. `seed` (a one-element int64 tensor on `device`): drawn from
    torch's generator when not given."""
    if not 0 <= dropped_levels <= UNIFORM_LEVELS:
        raise ValueError(f"dropped_levels must lie in [0, {UNIFORM_LEVELS}], got {dropped_levels}")
    if seed is None:
        seed = draw_seed(device)
    shape = torch.Size(shape)
    numel = shape.numel()
    keep = _dropout_keep_mask(seed, numel, int(dropped_levels))
    # != 0, not a view as bool: dynamo cannot trace a dtype view of an op's output; compiled, inductor fuses it
    # into the kernel that reads the mask
    return keep.view(shape) != 0


def _philox_4x32_10(counter: int, key: int) -> list[int]:
    """Philox4x32-10 of counter (c0, c1) = (counter mod 2³², counter // 2³²), c2 = c3 = 0, and key (seed mod 2³²,
    seed // 2³²), in plain integers: the four 32-bit outputs, in order."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = counter & mask, counter >> 32, 0, 0
    k0, k1 = key & mask, (key >> 32) & mask
    for _ in range(10):
        product_a, product_b = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (product_b >> 32) ^ c1 ^ k0,
            product_b & mask,
            (product_a >> 32) ^ c3 ^ k1,
            product_a & mask,
        )
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return [c0, c1, c2, c3]


def philox_reference(seed: int, numel: int) -> torch.Tensor:
    """Uniforms 0 … numel − 1 of the kernel's layout for `seed`, computed in Python (slow: for tests)."""
    uniforms = []
    for counter in range((numel + 7) // 8):
        for word in _philox_4x32_10(counter, seed):
            uniforms += [word & 0xFFFF, word >> 16]
    return torch.tensor(uniforms[:numel], dtype=torch.int64)


__all__ = ["dropout_keep_mask", "dropout_masks_available", "philox_reference"]
