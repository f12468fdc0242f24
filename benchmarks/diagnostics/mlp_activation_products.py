#!/usr/bin/env python
"""The MLP's GELU inside its matrix products, at the handout step's size (7680 packed tokens, 256 → 1024 → 256, bf16):
whether a Triton product with the activation in its epilogue beats cuBLAS's product and inductor's separate kernel.

In the compiled step (`results/h100_profile_handout_gelu_one_exp_2026_12_05.txt`) GELU takes 11.7 µs a layer and its
gradient 14.0 µs, both moving the MLP's 7680 × 1024 states between products: 0.10 of the step's 1.19 ms. A product
that applies the activation before it writes its tile (forward: h = x·W₁ᵀ + b₁ and GELU(h) both written; backward:
dh = (dy·W₂) ∘ GELU′(h)) saves reading its own output back. Timed here, each called `CALLS` times back to back in one
CUDA graph, replayed: the step's way (cuBLAS's product, then torch.compile's kernel), the Triton product alone, with
the activation (libdevice's erf, or one exponential as `layers_knowgpt.gelu_slope`), and with the epilogue's memory
traffic alone (the second store; the load of the states), for several tile shapes. A table of µs per call is printed
last, with each result's largest difference from the step's way.

On an H100 (2026-12-06, `results/h100_mlp_activation_products_2026_12_06.txt`) the epilogue's bytes cost less than
the separate kernels (forward 18.4 µs against 12.4 + 11.8; backward 16.2 against 10.6 + 16.5), but its arithmetic
does not overlap the short products (K = 256): with the activation from one exponential 24.8-27.2 µs forward and
28.3-32.1 µs backward, no faster than the step's way; so the package keeps cuBLAS's products.

    python benchmarks/diagnostics/mlp_activation_products.py
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from benchmarks.diagnostics.gelu_gradient import gelu_gradient_one_exp  # noqa: E402

CALLS = 20
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [
    (128, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
]
# The constants of layers_knowgpt._normal_cdf_and_gaussian (A&S 7.1.26 and the rest; literals there, see why): Triton
# reads a global inside a kernel only as a constexpr.
INVERSE_SQRT_2 = tl.constexpr(0.7071067811865476)
INVERSE_SQRT_2PI = tl.constexpr(0.3989422804014327)
ERF_P = tl.constexpr(0.3275911)
A1, A2, A3, A4, A5 = (tl.constexpr(a) for a in (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429))
LOG2_E = tl.constexpr(1.4426950408889634)
# The epilogues: the product alone; its GELU (written beside it) or the product times GELU′ of given states, by
# libdevice's erf or from one exponential; the second store alone; the product times the states loaded, no arithmetic.
PRODUCT, GELU_ERF, GELU_GRADIENT_ERF, GELU_ONE_EXP, GELU_GRADIENT_ONE_EXP, STORED_TWICE, TIMES_LOADED = (
    tl.constexpr(epilogue) for epilogue in range(7)
)


@triton.jit
def _normal_tail(x):
    """(1 − Φ(|x|), e^{−x²/2}) from one exponential (Abramowitz & Stegun 7.1.26), as `layers_knowgpt.gelu_slope`."""
    gaussian = tl.exp2(x * x * (-0.5 * LOG2_E))
    t = 1.0 / (tl.abs(x) * (ERF_P * INVERSE_SQRT_2) + 1.0)
    polynomial = t * (0.5 * A5) + 0.5 * A4
    polynomial = polynomial * t + 0.5 * A3
    polynomial = polynomial * t + 0.5 * A2
    polynomial = polynomial * t + 0.5 * A1
    return t * polynomial * gaussian, gaussian


@triton.jit
def _product(
    A, B, BIAS, HIDDEN, OUT, rows_total,
    sa_m, sa_k, sb_k, sb_n,
    N: tl.constexpr, K: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """OUT = epilogue(A·B (+ bias)) for A (M, K), B (K, N) given by strides, EPILOGUE one of the module's: GELU's
    write the product to HIDDEN and its GELU to OUT, GELU′'s multiply the product by GELU′(HIDDEN)."""
    program = tl.program_id(0)
    column_tiles = N // BLOCK_N
    rows = (program // column_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (program % column_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = rows < rows_total
    accumulated = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(0, K, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        a = tl.load(A + rows[:, None].to(tl.int64) * sa_m + depth[None, :] * sa_k, mask=inside[:, None], other=0.0)
        b = tl.load(B + depth[:, None] * sb_k + cols[None, :] * sb_n)
        accumulated = tl.dot(a, b, accumulated)
    if HAS_BIAS:
        accumulated += tl.load(BIAS + cols).to(tl.float32)[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    if EPILOGUE == GELU_ERF or EPILOGUE == GELU_ONE_EXP or EPILOGUE == STORED_TWICE:
        hidden = accumulated.to(HIDDEN.dtype.element_ty)
        tl.store(HIDDEN + offsets, hidden, mask=inside[:, None])
        x = hidden.to(tl.float32)
        if EPILOGUE == GELU_ERF:
            accumulated = 0.5 * x * (1 + tl.erf(x * INVERSE_SQRT_2))
        elif EPILOGUE == GELU_ONE_EXP:
            tail, _ = _normal_tail(x)
            accumulated = x * tl.where(x < 0, tail, 1.0 - tail)
    elif EPILOGUE == GELU_GRADIENT_ERF or EPILOGUE == GELU_GRADIENT_ONE_EXP:
        x = tl.load(HIDDEN + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
        if EPILOGUE == GELU_GRADIENT_ERF:
            slope = 0.5 * (1 + tl.erf(x * INVERSE_SQRT_2)) + x * tl.exp(-0.5 * x * x) * INVERSE_SQRT_2PI
        else:
            tail, gaussian = _normal_tail(x)
            slope = tl.where(x < 0, tail, 1.0 - tail) + x * gaussian * INVERSE_SQRT_2PI
        accumulated = accumulated.to(OUT.dtype.element_ty).to(tl.float32) * slope
    elif EPILOGUE == TIMES_LOADED:
        accumulated *= tl.load(HIDDEN + offsets, mask=inside[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + offsets, accumulated.to(OUT.dtype.element_ty), mask=inside[:, None])


def triton_product(a, b, bias, hidden, out, epilogue, config):
    block_m, block_n, block_k, warps, stages = config
    rows, depth = a.shape
    columns = b.shape[1]
    grid = (triton.cdiv(rows, block_m) * (columns // block_n),)
    _product[grid](
        a, b, bias if bias is not None else a, hidden if hidden is not None else out, out, rows,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        N=columns, K=depth, EPILOGUE=epilogue.value, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7680)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mlp_activation_products.py times CUDA kernels: run it on a GPU machine")
    generator = torch.Generator(device="cuda").manual_seed(0)
    width = 4 * args.n_embd

    def normal(*shape, scale=1.0):
        return (torch.randn(shape, device="cuda", generator=generator) * scale).to(torch.bfloat16)

    x = normal(args.tokens, args.n_embd)
    fc_weight, fc_bias = normal(width, args.n_embd, scale=args.n_embd**-0.5), normal(width, scale=0.1)
    grad_y = normal(args.tokens, args.n_embd)
    proj_weight = normal(args.n_embd, width, scale=width**-0.5)
    gelu = torch.compile(F.gelu, dynamic=False)
    gelu_gradient = torch.compile(gelu_gradient_one_exp, dynamic=False)

    hidden_ref = torch.addmm(fc_bias, x, fc_weight.t())
    activated_ref = gelu(hidden_ref)
    grad_hidden_ref = gelu_gradient(grad_y @ proj_weight, hidden_ref)
    hidden = torch.empty_like(hidden_ref)
    activated = torch.empty_like(hidden_ref)
    grad_hidden = torch.empty_like(hidden_ref)

    def timed(name, call, result=None, reference=None):
        call()
        torch.cuda.synchronize()
        error = (result.float() - reference.float()).abs().max().item() if result is not None else float("nan")

        def calls():
            for _ in range(CALLS):
                call()

        microseconds = 1000 * graphed_ms(calls, args.replays) / CALLS
        rows.append((name, microseconds, error))
        print(rows[-1], flush=True)

    rows = []
    timed("forward, the step's way: cuBLAS addmm", lambda: torch.addmm(fc_bias, x, fc_weight.t()))
    timed("forward, the step's way: compiled GELU", lambda: gelu(hidden_ref))
    timed("backward, the step's way: cuBLAS mm", lambda: grad_y @ proj_weight)
    timed("backward, the step's way: compiled GELU′", lambda: gelu_gradient(grad_hidden_ref, hidden_ref))
    for config in CONFIGS:
        label = "×".join(map(str, config[:3])) + f" w{config[3]} s{config[4]}"
        try:
            timed(
                f"forward, Triton product + bias {label}",
                lambda c=config: triton_product(x, fc_weight.t(), fc_bias, None, hidden, PRODUCT, c),
                hidden, hidden_ref,
            )  # fmt: skip
            timed(
                f"forward, Triton product + bias + GELU {label}",
                lambda c=config: triton_product(x, fc_weight.t(), fc_bias, hidden, activated, GELU_ERF, c),
                activated, activated_ref,
            )  # fmt: skip
            timed(
                f"forward, Triton product + bias + GELU, one exp {label}",
                lambda c=config: triton_product(x, fc_weight.t(), fc_bias, hidden, activated, GELU_ONE_EXP, c),
                activated, activated_ref,
            )  # fmt: skip
            timed(
                f"backward, Triton product × GELU′, one exp {label}",
                lambda c=config: triton_product(grad_y, proj_weight, None, hidden_ref, grad_hidden, GELU_GRADIENT_ONE_EXP, c),
                grad_hidden, grad_hidden_ref,
            )  # fmt: skip
            timed(
                f"forward, Triton product + bias, stored twice {label}",
                lambda c=config: triton_product(x, fc_weight.t(), fc_bias, hidden, activated, STORED_TWICE, c),
            )  # fmt: skip
            timed(
                f"backward, Triton product × hidden {label}",
                lambda c=config: triton_product(grad_y, proj_weight, None, hidden_ref, grad_hidden, TIMES_LOADED, c),
            )  # fmt: skip
            timed(
                f"backward, Triton product × GELU′ {label}",
                lambda c=config: triton_product(grad_y, proj_weight, None, hidden_ref, grad_hidden, GELU_GRADIENT_ERF, c),
                grad_hidden, grad_hidden_ref,
            )  # fmt: skip
        except Exception as error:  # a tile shape that does not fit the multiprocessor's memory
            print(f"{label}: {type(error).__name__}: {str(error)[-600:]}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{args.tokens} tokens × {args.n_embd} → {width}")  # fmt: skip
    name_width = max(len(row[0]) for row in rows) + 2
    print(f"{'kernel':<{name_width}}{'µs per call':>13}{'max |difference|':>18}")
    for name, microseconds, error in rows:
        print(f"{name:<{name_width}}{microseconds:>13.2f}{error:>18.3g}")


if __name__ == "__main__":
    main()
