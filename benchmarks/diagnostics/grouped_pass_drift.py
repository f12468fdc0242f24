#!/usr/bin/env python
"""How far the weight-gradient pass (`hf_knowgpt.kernels.grouped_products.WeightGradientsTogether`) moves a
compiled model's gradients, against how far bf16 autocast moves them from fp32: the small model of
`tests/test_grouped_products.py::test_a_compiled_model_takes_its_weight_gradients_together_and_gets_the_same_ones`,
one batch, compiled without the pass twice and with it twice, and eager in fp32. Per parameter: whether each
compile gives the same gradients twice, the largest difference the pass makes, the elements beyond the test's
former element-wise tolerance (1e-5 + 1e-4 of the value), and the relative distances to fp32. Needs a CUDA device.

    python benchmarks/diagnostics/grouped_pass_drift.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM, layers_knowgpt  # noqa: E402
from hf_knowgpt.kernels.grouped_products import WeightGradientsTogether  # noqa: E402


def gradients(model, ids, options):
    """Compiled with these inductor options under bf16 autocast; with None, eager in fp32."""
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    compiled = model if options is None else torch.compile(model, options=options)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=options is not None):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def main():
    with_pass = {"post_grad_custom_post_pass": WeightGradientsTogether(column_sums=True)}
    for narrow_sums in (False, True):
        layers_knowgpt.NARROW_BIAS_SUMS_TOGETHER = narrow_sums
        config = KnowGPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128)
        torch.manual_seed(0)
        model = KnowGPTForCausalLM(config).cuda().eval()
        ids = torch.randint(0, 256, (8, 128), device="cuda")
        apart, apart_again = gradients(model, ids, {}), gradients(model, ids, {})
        together, together_again = gradients(model, ids, with_pass), gradients(model, ids, with_pass)
        fp32 = gradients(model, ids, None)
        print(f"narrow_sums={narrow_sums}")
        header = ("apart==apart2", "tog==tog2", "maxdiff", "n>tol", "reldiff", "err_apart", "err_tog")
        print(f"{'param':45s} " + " ".join(f"{h:>13s}" for h in header))
        for name, a in apart.items():
            t, r = together[name], fp32[name]
            difference = (t - a).abs()
            beyond = int((difference > 1e-5 + 1e-4 * a.abs()).sum())
            cells = (
                str(torch.equal(a, apart_again[name])),
                str(torch.equal(t, together_again[name])),
                f"{difference.max().item():.2e}",
                str(beyond),
                f"{((t - a).norm() / a.norm()).item():.2e}",
                f"{((a - r).norm() / r.norm()).item():.2e}",
                f"{((t - r).norm() / r.norm()).item():.2e}",
            )
            print(f"{name:45s} " + " ".join(f"{c:>13s}" for c in cells))


if __name__ == "__main__":
    main()
