"""Answering a file of birthplace questions with a checkpoint, and scoring the answers the handouts' way.

Kept apart from training so that `scripts/evaluate.py` loads only what answering needs (no accelerate,
no training code).
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_loaders.corpus import DataFiles, read_birthplaces

from .checkpoints import write_json_atomic, write_text_atomic
from .qa import HANDOUT_MAX_NEW_TOKENS, format_accuracy, handout_accuracy, predict_birthplaces


def dataset_id(path) -> str:
    return "synthetic-biographies" if "synthetic-" in str(path) else "cs224n-knowledge-access"


def evaluate_birthplaces(
    model_name_or_path,
    eval_corpus_path=None,
    outputs_path=None,
    batch_size: int = 512,
    max_new_tokens: int = HANDOUT_MAX_NEW_TOKENS,
    write_scores: bool = False,
    num_people: int | None = None,
    device=None,
    model=None,
    tokenizer=None,
    update_model_card: bool = False,
) -> dict:
    """Predict a birthplace for every question of `eval_corpus_path` (default: the synthetic dev set),
    write one prediction per line to `outputs_path`, and score them when the file has gold places. With
    `update_model_card`, the accuracy is also recorded in a local checkpoint's model card."""
    eval_path = Path(eval_corpus_path) if eval_corpus_path else DataFiles.synthetic(num_people).dev
    if model is None:
        device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path).to(device)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_name_or_path)
    records = read_birthplaces(eval_path)
    questions, gold = [r.question for r in records], [r.answer for r in records]
    predictions = predict_birthplaces(model, tokenizer, questions, batch_size, max_new_tokens)
    result = {"eval_file": eval_path.name, "predictions_file": str(outputs_path) if outputs_path else None}
    if outputs_path:
        outputs_path = Path(outputs_path)
        outputs_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(outputs_path, "".join(p.answer + "\n" for p in predictions))
        if write_scores:
            scores = "".join(f"{p.score:.6g}\t{p.log_probability:.6f}\t{int(p.closed)}\n" for p in predictions)
            write_text_atomic(scores_path(outputs_path), "score\tlog_probability\tclosed\n" + scores)
    result["predictions"] = [p.answer for p in predictions]
    result["scores"] = [p.score for p in predictions]
    if all(answer is not None for answer in gold):
        correct, total = handout_accuracy(gold, result["predictions"])
        result.update(correct=correct, total=total, accuracy=correct / total)
        result["message"] = format_accuracy(correct, total)
        if outputs_path:
            metrics_file = outputs_path.with_name(outputs_path.name + ".metrics.json")
            write_json_atomic(metrics_file, {k: result[k] for k in ("eval_file", "accuracy", "correct", "total")})
        if update_model_card and model_name_or_path and Path(model_name_or_path).is_dir():
            from .model_card import add_evaluation_to_card

            add_evaluation_to_card(
                model_name_or_path,
                {
                    "eval_file": eval_path.name,
                    "correct": correct,
                    "total": total,
                    "accuracy": correct / total,
                    "dataset_type": dataset_id(eval_path),
                },
            )
    else:
        result["message"] = (
            f"No gold birthplaces in {eval_path}: wrote {len(predictions)} predictions"
            + (f" to {outputs_path}" if outputs_path else "")
            + "; nothing was scored."
        )
    return result


def london_baseline(eval_corpus_path=None, outputs_path=None, place: str = "London", num_people: int | None = None):
    """The handouts' baseline: answer `place` to every question; scored with the same exact match."""
    eval_path = Path(eval_corpus_path) if eval_corpus_path else DataFiles.synthetic(num_people).dev
    gold = [record.answer for record in read_birthplaces(eval_path)]
    if any(answer is None for answer in gold):
        raise ValueError(f"{eval_path} has no gold places: a baseline needs them")
    predictions = [place] * len(gold)
    correct, total = handout_accuracy(gold, predictions)
    result = {
        "eval_file": eval_path.name,
        "place": place,
        "correct": correct,
        "total": total,
        "accuracy": correct / total,
        "message": format_accuracy(correct, total),
    }
    if outputs_path:
        outputs_path = Path(outputs_path)
        outputs_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(outputs_path, "".join(p + "\n" for p in predictions))
        metrics_file = outputs_path.with_name(outputs_path.name + ".metrics.json")
        write_json_atomic(metrics_file, {k: result[k] for k in ("eval_file", "place", "accuracy", "correct", "total")})
    return result


def scores_path(outputs_path) -> Path:
    outputs_path = Path(outputs_path)
    return outputs_path.with_name(outputs_path.name + ".scores.tsv")


__all__ = ["dataset_id", "evaluate_birthplaces", "london_baseline", "scores_path"]
