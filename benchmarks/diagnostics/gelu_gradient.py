#!/usr/bin/env python
"""GELU's gradient at the MLP's size in the handout step (7680 packed tokens × 1024, bf16), as inductor compiles it,
against kernels that move the same bytes and do no arithmetic: whether it is bound by memory or by its erf and exp.

In the compiled step (`results/h100_profile_handout_narrow_sums_2026_12_05.txt`) the gradient takes 21.8 µs a layer
for 47 MB (two bf16 reads, one write: about 2.2 TB/s), where GELU itself takes 11.7 µs for 31 MB (about 2.7 TB/s).
Timed here, each compiled by torch.compile and called `CALLS` times back to back in one CUDA graph, replayed:
GELU's gradient as autograd gives it (`aten.gelu_backward`), the same with inductor's `use_fast_math`, the same
derivative written with exp2 (Φ(x) + x·φ(x)), the same from one exponential as the step takes it where
`layers_knowgpt.GELU_GRADIENT_ONE_EXP` is on (`gelu_slope`), GELU forward, and the bytes alone (a sum of the two
inputs; a copy). A table of µs per call and TB/s is printed last.

    python benchmarks/diagnostics/gelu_gradient.py
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_attention import graphed_ms  # noqa: E402
from hf_knowgpt.layers_knowgpt import gelu_from_one_exp, gelu_slope  # noqa: E402

CALLS = 20
LOG2_E = 1 / math.log(2)
INVERSE_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


def gelu_gradient(grad, states):
    return torch.ops.aten.gelu_backward(grad, states)


def gelu_gradient_exp2(grad, states):
    x = states.float()
    density = torch.exp2(x * x * (-0.5 * LOG2_E)) * INVERSE_SQRT_2PI
    return (grad.float() * (0.5 * (1 + torch.erf(x * math.sqrt(0.5))) + x * density)).to(grad.dtype)


def gelu_gradient_one_exp(grad, states):
    return (grad.float() * gelu_slope(states)).to(grad.dtype)


def gelu(grad, states):
    return F.gelu(states)


def gelu_one_exp(grad, states):
    return gelu_from_one_exp(states)


def two_inputs_summed(grad, states):
    return grad + states


def copied(grad, states):
    return states * 2


WAYS = [  # (name, function, inductor options, tensors read, tensors written, what it computes: checked against fp64)
    ("GELU's gradient (aten.gelu_backward)", gelu_gradient, {}, 2, 1, "gradient"),
    ("GELU's gradient, use_fast_math", gelu_gradient, {"use_fast_math": True}, 2, 1, "gradient"),
    ("GELU's gradient with exp2", gelu_gradient_exp2, {}, 2, 1, "gradient"),
    ("GELU's gradient, one exp (gelu_slope)", gelu_gradient_one_exp, {}, 2, 1, "gradient"),
    ("bytes alone: two inputs summed", two_inputs_summed, {}, 2, 1, None),
    ("GELU", gelu, {}, 1, 1, "gelu"),
    ("GELU from one exp (gelu_from_one_exp)", gelu_one_exp, {}, 1, 1, "gelu"),
    ("bytes alone: a copy (× 2)", copied, {}, 1, 1, None),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7680)
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width (4 · n_embd)")
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gelu_gradient.py times CUDA kernels: run it on a GPU machine")
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.tokens, args.width)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    states = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    references = {"gradient": gelu_gradient(grad.double(), states.double()), "gelu": F.gelu(states.double())}
    tensor_bytes = grad.numel() * grad.element_size()
    rows = []
    for name, function, options, reads, writes, computed in WAYS:
        compiled = torch.compile(function, options=options or None, dynamic=False)
        result = compiled(grad, states)
        want = references.get(computed)
        error = (result.double() - want).abs().max().item() if want is not None else float("nan")

        def calls(compiled=compiled):
            for _ in range(CALLS):
                compiled(grad, states)

        microseconds = 1000 * graphed_ms(calls, args.replays) / CALLS
        terabytes_per_second = (reads + writes) * tensor_bytes / (microseconds * 1e-6) / 1e12
        rows.append((name, microseconds, terabytes_per_second, error))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} × {args.width} bf16")
    width = max(len(row[0]) for row in rows) + 2
    print(f"{'kernel':<{width}}{'µs per call':>13}{'TB/s':>8}{'max |error| vs fp64':>22}")
    for name, microseconds, terabytes_per_second, error in rows:
        print(f"{name:<{width}}{microseconds:>13.2f}{terabytes_per_second:>8.2f}{error:>22.3g}")


if __name__ == "__main__":
    main()
