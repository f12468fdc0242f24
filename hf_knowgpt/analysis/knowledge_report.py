"""The knowledge report of a checkpoint: calibration, selective accuracy, seen versus made-up people.

`analyze_knowledge(...)` answers three sets of questions with the checkpoint — the evaluation questions,
calibration questions it did not train on (for choosing a threshold, never the evaluation set), and
questions about made-up people (names from the synthetic-corpus generator that occur nowhere in the
corpus) — and writes `report.md` with PNG plots into a folder.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np

from data_loaders import read_birthplaces
from data_loaders.synthetic import REGIONS, make_names

from ..qa import QUESTION_TEMPLATE, greedy_continuations, predict_birthplaces
from .knowledge_metrics import (
    apply_threshold,
    area_under_accuracy_coverage,
    auroc,
    knowledge_breakdowns,
    place_distribution,
    recitation_probe,
    recitation_prompts,
    reliability,
    selective_accuracy,
    threshold_for_accuracy,
)


def _score(model, tokenizer, records, batch_size):
    predictions = predict_birthplaces(model, tokenizer, [r.question for r in records], batch_size)
    scores = np.array([p.score for p in predictions])
    correct = np.array([p.answer == r.answer for p, r in zip(predictions, records)], dtype=float)
    return predictions, scores, correct


def analyze_knowledge(
    model,
    tokenizer,
    eval_path,
    calibration_path,
    output_dir,
    corpus_path=None,
    train_path=None,
    target_accuracy: float = 0.8,
    num_unseen: int = 500,
    seed: int = 0,
    batch_size: int = 512,
    checkpoint_name: str = "",
    calibration_note: str = "",
    recitation_window: int = 112,
) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    evaluation = read_birthplaces(eval_path)
    calibration = read_birthplaces(calibration_path)
    if any(r.answer is None for r in evaluation + calibration):
        raise ValueError("the evaluation and calibration files need gold places (question TAB place)")
    eval_predictions, eval_scores, eval_correct = _score(model, tokenizer, evaluation, batch_size)
    _, calibration_scores, calibration_correct = _score(model, tokenizer, calibration, batch_size)

    # Made-up people: generated names that occur nowhere in the corpus or the question files.
    known_text = Path(corpus_path).read_text(encoding="utf-8") if corpus_path else ""
    known = {r.name for r in evaluation + calibration}
    if train_path:
        known |= {r.name for r in read_birthplaces(train_path)}
    candidates = make_names(num_unseen * 2, seed=seed, exclude=known)
    unseen = [(name, style) for name, style in candidates if name not in known_text][:num_unseen]
    unseen_predictions = predict_birthplaces(
        model, tokenizer, [QUESTION_TEMPLATE.format(name) for name, _ in unseen], batch_size
    )
    unseen_scores = np.array([p.score for p in unseen_predictions])

    coverage, accuracy = selective_accuracy(eval_scores, eval_correct)
    bins, ece = reliability(eval_scores, eval_correct)
    threshold = threshold_for_accuracy(calibration_scores, calibration_correct, target_accuracy)
    eval_coverage, eval_accuracy_at = apply_threshold(eval_scores, eval_correct, threshold.value)
    unseen_answered = float((unseen_scores >= threshold.value).mean())
    seen_vs_unseen = auroc(eval_scores, unseen_scores)

    train_places = [r.answer for r in read_birthplaces(train_path)] if train_path else [r.answer for r in calibration]
    train_counts = Counter(train_places)
    unseen_places = [p.answer for p in unseen_predictions]
    by_style = {}
    for (_, style), prediction in zip(unseen, unseen_predictions):
        by_style.setdefault(style, []).append(prediction.answer)
    origin_rows = []
    for style, answers in sorted(by_style.items()):
        region = set(REGIONS[style]["places"])
        in_region = np.mean([a in region for a in answers])
        base_rate = sum(train_counts[p] for p in region) / max(len(train_places), 1)
        top = Counter(answers).most_common(3)
        origin_rows.append((style, len(answers), in_region, base_rate, top))

    breakdowns, probe = [], None
    if corpus_path:
        corpus_lines = known_text.split("\n")  # the corpus, read once above
        names, places = [r.name for r in evaluation], [r.answer for r in evaluation]
        breakdowns = knowledge_breakdowns(names, places, eval_correct, corpus_lines, train_places)
        window = min(recitation_window, model.config.block_size)
        prompts = recitation_prompts(names, places, corpus_lines, window)
        recitations = greedy_continuations(
            model, tokenizer, [p[1] for p in prompts], [len(p[2]) - len(p[1]) for p in prompts], batch_size
        )
        probe = recitation_probe(prompts, recitations, eval_correct, window)

    # -- plots -----------------------------------------------------------------------------------------------------
    if breakdowns:
        figure, axes = plt.subplots(1, len(breakdowns), figsize=(5 * len(breakdowns), 3.8))
        for axis, breakdown in zip(axes, breakdowns):
            labels = [label for label, count, _ in breakdown.buckets if count]
            values = [100 * accuracy for _, count, accuracy in breakdown.buckets if count]
            counts = [count for _, count, _ in breakdown.buckets if count]
            bars = axis.bar(labels, values, color="tab:blue", alpha=0.75)
            for bar, count in zip(bars, counts):
                axis.annotate(f"n={count}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                              va="bottom", fontsize=7)  # fmt: skip
            axis.set_title(breakdown.name, fontsize=9)
            axis.set_ylabel("exact match (%)")
            axis.tick_params(axis="x", labelsize=8)
        figure.tight_layout()
        figure.savefig(output_dir / "accuracy_breakdowns.png", dpi=120)
        plt.close(figure)

    figure, axis = plt.subplots(figsize=(5.5, 4))
    axis.plot(coverage * 100, accuracy * 100, label="most confident first")
    axis.axhline(eval_correct.mean() * 100, color="gray", linestyle=":", label="answering everything")
    axis.scatter([eval_coverage * 100], [eval_accuracy_at * 100], color="red", zorder=3,
                 label=f"threshold {threshold.value:.2f} (from calibration)")  # fmt: skip
    axis.set_xlabel("coverage (% of questions answered)")
    axis.set_ylabel("exact match among answered (%)")
    axis.set_title("Accuracy against coverage")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output_dir / "accuracy_coverage.png", dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(5.5, 4))
    filled = [b for b in bins if b.count]
    axis.bar([(b.low + b.high) / 2 for b in filled], [b.accuracy for b in filled], width=0.09, alpha=0.7,
             label="accuracy in bin")  # fmt: skip
    axis.plot([0, 1], [0, 1], color="gray", linestyle=":", label="perfect calibration")
    axis.set_xlabel("score (probability of the answer)")
    axis.set_ylabel("fraction correct")
    axis.set_title(f"Reliability (ECE {ece:.3f})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output_dir / "reliability.png", dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(5.5, 4))
    edges = np.linspace(0, 1, 21)
    axis.hist(eval_scores[eval_correct == 1], bins=edges, alpha=0.6, label="real people, correct", density=True)
    axis.hist(eval_scores[eval_correct == 0], bins=edges, alpha=0.6, label="real people, wrong", density=True)
    axis.hist(unseen_scores, bins=edges, alpha=0.6, label="made-up people", density=True)
    axis.set_xlabel("score")
    axis.set_ylabel("density")
    axis.set_title(f"Scores of seen and unseen people (AUROC {seen_vs_unseen:.3f})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output_dir / "seen_unseen_scores.png", dpi=120)
    plt.close(figure)

    summary = {
        "checkpoint": checkpoint_name,
        "eval_file": Path(eval_path).name,
        "eval_questions": len(evaluation),
        "accuracy": float(eval_correct.mean()),
        "area_under_accuracy_coverage": area_under_accuracy_coverage(eval_scores, eval_correct),
        "expected_calibration_error": ece,
        "calibration_file": Path(calibration_path).name,
        "calibration_questions": len(calibration),
        "target_accuracy": target_accuracy,
        "threshold": threshold.value,
        "threshold_reached_target_on_calibration": threshold.reached,
        "calibration_coverage": threshold.coverage,
        "calibration_accuracy": threshold.accuracy,
        "eval_coverage_at_threshold": eval_coverage,
        "eval_accuracy_at_threshold": eval_accuracy_at,
        "unseen_people": len(unseen),
        "unseen_answered_at_threshold": unseen_answered,
        "auroc_seen_vs_unseen": seen_vs_unseen,
        "mean_score_seen": float(eval_scores.mean()),
        "mean_score_unseen": float(unseen_scores.mean()),
        "breakdowns": {b.name: b.buckets for b in breakdowns},
    }
    if probe is not None:
        summary["recitation_probe"] = {
            "window": probe.window,
            "people": probe.people,
            "stored": probe.stored,
            "recited_exactly": probe.recited_exactly,
            "stored_and_answered": probe.table.get((True, True), 0),
            "stored_not_answered": probe.table.get((True, False), 0),
            "not_stored_answered": probe.table.get((False, True), 0),
            "not_stored_not_answered": probe.table.get((False, False), 0),
        }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))

    recited_note = (
        f" (the model recites {model.config.recitation_length} characters before answering: the probability of "
        "its recitation and answer together)"
        if getattr(model.config, "recitation_length", 0)
        else ""
    )
    lines = [
        f"# Knowledge report: {checkpoint_name or 'checkpoint'}",
        "",
        f"Scores are the model's probability of its whole answer including the closing ⁇{recited_note}. Evaluation: "
        f"`{summary['eval_file']}` ({len(evaluation)} questions); threshold chosen on `{summary['calibration_file']}` "
        f"({len(calibration)} questions), never on the evaluation file. {calibration_note}".rstrip(),
        "",
        "| measure | value |",
        "|---|---|",
        f"| exact match, answering everything | {100 * summary['accuracy']:.1f}% |",
        f"| area under accuracy–coverage | {summary['area_under_accuracy_coverage']:.3f} |",
        f"| expected calibration error (10 bins) | {ece:.3f} |",
        f"| threshold for {100 * target_accuracy:.0f}% accuracy (calibration) | {threshold.value:.3f} "
        f"(calibration: {100 * threshold.coverage:.1f}% answered, {100 * threshold.accuracy:.1f}% correct"
        f"{'' if threshold.reached else '; target not reached, best shown'}) |",
        f"| at that threshold on evaluation | {100 * eval_coverage:.1f}% answered, {100 * eval_accuracy_at:.1f}% correct |",
        f"| made-up people answered at that threshold | {100 * unseen_answered:.1f}% of {len(unseen)} |",
        f"| AUROC, score as a seen/unseen detector | {seen_vs_unseen:.3f} |",
        f"| mean score: real people / made-up people | {summary['mean_score_seen']:.3f} / {summary['mean_score_unseen']:.3f} |",
        "",
        "![accuracy against coverage](accuracy_coverage.png) ![reliability](reliability.png) "
        "![seen and unseen scores](seen_unseen_scores.png)",
        "",
        *(
            [
                "## Accuracy by property of the person",
                "",
                "![accuracy by offset, shared place and length](accuracy_breakdowns.png)",
                "",
                *[
                    line
                    for breakdown in breakdowns
                    for line in [
                        f"| {breakdown.name} | questions | exact match |",
                        "|---|---|---|",
                        *[
                            f"| {label} | {count} | {100 * accuracy:.1f}% |"
                            for label, count, accuracy in breakdown.buckets
                            if count
                        ],
                        "",
                    ]
                ],
            ]
            if breakdowns
            else []
        ),
        *(
            [
                "## Stored, and given back?",
                "",
                f"For the {probe.people} evaluated people whose place lies in their biography's first {probe.window} "
                "characters: the model recites the biography from its opening up to the name (greedy); the place "
                "is *stored* when the recitation holds it. Stored and not answered is knowledge the model has and "
                "does not give back when asked.",
                "",
                f"Recited exactly: {probe.recited_exactly} of {probe.people}; place stored: {probe.stored} of "
                f"{probe.people}.",
                "",
                "| | answered right | answered wrong |",
                "|---|---|---|",
                f"| place stored | {probe.table.get((True, True), 0)} | {probe.table.get((True, False), 0)} |",
                f"| place not stored | {probe.table.get((False, True), 0)} | {probe.table.get((False, False), 0)} |",
                "",
            ]
            if probe is not None
            else []
        ),
        "## Reliability",
        "",
        "| score bin | questions | mean score | fraction correct |",
        "|---|---|---|---|",
        *[
            f"| {b.low:.1f}–{b.high:.1f} | {b.count} | {b.confidence:.3f} | {b.accuracy:.3f} |"
            for b in bins
            if b.count
        ],
        "",
        "## Where the model places people it never read about",
        "",
        "| place | made-up people | share | share of training answers |",
        "|---|---|---|---|",
        *[
            f"| {place} | {count} | {100 * share:.1f}% | {100 * train_counts[place] / max(len(train_places), 1):.1f}% |"
            for place, count, share in place_distribution(unseen_places)
        ],
        "",
        "By the naming style of the made-up name (the synthetic generator's syllable sets), the share of answers "
        "that fall in that style's region, against the share of training answers in the region:",
        "",
        "| name style | people | answers in the style's region | training answers in that region | most frequent answers |",
        "|---|---|---|---|---|",
        *[
            f"| {style} | {n} | {100 * in_region:.1f}% | {100 * base:.1f}% | "
            + ", ".join(f"{p} ({c})" for p, c in top)
            + " |"
            for style, n, in_region, base, top in origin_rows
        ],
        "",
        "## Examples",
        "",
        "| question | answer | score | gold |",
        "|---|---|---|---|",
    ]
    order = np.argsort(-eval_scores)
    for index in list(order[:3]) + list(order[len(order) // 2 : len(order) // 2 + 2]) + list(order[-3:]):
        p, r = eval_predictions[index], evaluation[index]
        lines.append(f"| {r.question} | {p.answer} | {p.score:.3f} | {r.answer} |")
    for (name, style), prediction in list(zip(unseen, unseen_predictions))[:6]:
        lines.append(
            f"| Where was {name} born? *(made up, {style} style)* | {prediction.answer} | {prediction.score:.3f} | — |"
        )
    (output_dir / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return summary


__all__ = ["analyze_knowledge"]
