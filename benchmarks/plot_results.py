#!/usr/bin/env python
"""Plots for the README from the recorded GPU runs (benchmarks/results/*.json): pretraining loss curves
against the handouts' curve, and dev accuracy against pretraining epochs.

    python benchmarks/plot_results.py --results benchmarks/results --output docs
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HANDOUT_CURVE = [(0, 5.55), (22, 3.28), (100, 2.81), (460, 2.53), (1000, 2.32), (1400, 2.02), (2300, 1.36),
                 (4600, 0.96), (9000, 0.64), (14949, 0.53)]  # fmt: skip
FILES = {  # file: labels for its variants where the variant's name alone would be ambiguous
    "h200_reproduce_vanilla_rope.json": {},
    "h200_reproduce_synthesizer_perceiver.json": {},
    "h200_reproduce_knowledge.json": {"knowledge": "knowledge, 4..112 truncation, finetuned"},
    "h200_knowledge_dev_s01.json": {},
    "h200_rope512_dev.json": {"rope+n_embd=512": "rope, n_embd 512 (the anchor's width)"},
    "h200_vanilla_plain_path_dev.json": {"vanilla": "vanilla, plain path (fp32, unfused)"},
    "h200_vanilla_bf16_dev.json": {"vanilla": "vanilla, bf16 (fp32 attention kernel)"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default="benchmarks/results")
    parser.add_argument("--output", default="docs")
    args = parser.parse_args()
    rows = []
    for name, labels in FILES.items():
        for row in json.loads((Path(args.results) / name).read_text())["rows"]:
            rows.append({**row, "variant": labels.get(row["variant"], row["variant"])})
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row["seed"] == 0 and row.get("loss_curve"):
            curve = row["loss_curve"]
            axis.plot([p["step"] for p in curve], [p["loss"] for p in curve], label=row["variant"], linewidth=1)
    axis.plot(*zip(*HANDOUT_CURVE), "ko", label="handouts' vanilla run (REPRODUCING.md)")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("pretraining loss (mean of 50 steps)")
    axis.set_title("Pretraining on wiki.txt, seed 0, NVIDIA H200")
    axis.set_ylim(0, 4)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output / "loss_curves.png", dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    for row in rows:
        if row.get("accuracy_by_epoch"):
            points = row["accuracy_by_epoch"]
            axis.plot([p["epoch"] for p in points], [p["accuracy"] for p in points], "o-", label=row["variant"])
    axis.axhline(5.0, color="gray", linestyle=":", label="London baseline")
    axis.set_xlabel("pretraining epochs (then the handouts' 10 finetuning epochs)")
    axis.set_ylabel("dev exact match (%)")
    axis.set_title("Dev accuracy against pretraining epochs (seed 0)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output / "accuracy_by_epoch.png", dpi=120)
    plt.close(figure)
    print(f"wrote {output / 'loss_curves.png'} and {output / 'accuracy_by_epoch.png'}")


if __name__ == "__main__":
    main()
