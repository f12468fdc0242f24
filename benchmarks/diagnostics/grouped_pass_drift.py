#!/usr/bin/env python
"""How far the weight-gradient pass (`hf_knowgpt.kernels.grouped_products.WeightGradientsTogether`) moves a
compiled model's gradients, against how far bf16 autocast moves them from fp32: the small model and batch of
`tests/test_grouped_products.py`'s compiled-model test (its `small_model_and_batch` and `model_gradients`), compiled
without the pass twice and with it twice, and eager in fp32. Per parameter: whether each
compile gives the same gradients twice, the largest difference the pass makes, the elements beyond the test's
former element-wise tolerance (1e-5 + 1e-4 of the value), and the relative distances to fp32. Needs a CUDA device.

    python benchmarks/diagnostics/grouped_pass_drift.py
"""

import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from test_grouped_products import model_gradients, small_model_and_batch  # noqa: E402

from hf_knowgpt import layers_knowgpt  # noqa: E402
from hf_knowgpt.kernels.grouped_products import WeightGradientsTogether  # noqa: E402


def main():
    with_pass = {"post_grad_custom_post_pass": WeightGradientsTogether(column_sums=True)}
    for narrow_sums in (False, True):
        layers_knowgpt.NARROW_BIAS_SUMS_TOGETHER = narrow_sums
        model, ids = small_model_and_batch()
        apart, apart_again = model_gradients(model, ids, {}), model_gradients(model, ids, {})
        together, together_again = model_gradients(model, ids, with_pass), model_gradients(model, ids, with_pass)
        fp32 = model_gradients(model, ids, None)
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
