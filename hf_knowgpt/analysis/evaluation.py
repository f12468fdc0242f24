"""Answering a file of birthplace questions with a checkpoint, and scoring the answers the handouts' way.

Kept apart from training so that evaluating a checkpoint loads only what answering needs (no accelerate,
no training code).
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_loaders.corpus import DataFiles, read_birthplaces

from ..qa import HANDOUT_MAX_NEW_TOKENS, format_accuracy, handout_accuracy, predict_birthplaces
from ..utils import timeline
from ..utils.checkpoints import (
    check_model_folder,
    looks_like_hub_id,
    quiet_progress_bars,
    write_json_atomic,
    write_text_atomic,
)
from ..utils.errors import InputError

SYNTHETIC_DATASET = "synthetic-biographies"


def dataset_id(path) -> str:
    return SYNTHETIC_DATASET if "synthetic-" in str(path) else "cs224n-knowledge-access"


def load_checkpoint(model_name_or_path, device=None):
    """(model, tokenizer) of a checkpoint folder or Hub id; a folder that is not a loadable checkpoint, or a
    Hub id that cannot be had, is an InputError naming it and what is wrong."""
    if not looks_like_hub_id(model_name_or_path):
        check_model_folder(model_name_or_path)
    try:
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
            tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    except OSError as error:  # a Hub id that is not there, or no network
        raise InputError(model_name_or_path, f"cannot be loaded: {str(error).splitlines()[0]}") from error
    if device is not None:
        model.to(device)
    return model, tokenizer


def default_eval_path(model_name_or_path, num_people=None) -> Path:
    """Without --eval_corpus_path: the synthetic dev questions, for a model trained on the synthetic corpus
    only; a model trained on anything else (or not saying) would be scored on people it never read about."""
    if model_name_or_path is not None:
        from ..utils.model_card import read_card_facts

        facts = read_card_facts(model_name_or_path) or {}
        if facts.get("dataset_id") != SYNTHETIC_DATASET:
            trained_on = facts.get("data_description", "data it does not record")
            raise InputError(
                model_name_or_path,
                f"was trained on {trained_on}, not the synthetic corpus that is scored without --eval_corpus_path",
                "give --eval_corpus_path, e.g. birth_dev.tsv",
            )
    return DataFiles.synthetic(num_people).dev


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
    eval_path = Path(eval_corpus_path) if eval_corpus_path else default_eval_path(model_name_or_path, num_people)
    records = read_birthplaces(eval_path)  # before loading the model: a bad file is found at once
    if model is None:
        device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_checkpoint(model_name_or_path, device)
        timeline.mark("questions read, checkpoint loaded")  # a command's phase; a caller's own model adds none
    questions, gold = [r.question for r in records], [r.answer for r in records]
    lines = [r.line for r in records]
    predictions = predict_birthplaces(
        model, tokenizer, questions, batch_size, max_new_tokens, source=str(eval_path), lines=lines
    )
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
            from ..utils.model_card import add_evaluation_to_card

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
        raise InputError(eval_path, "has no gold places", "a baseline is scored on 'question TAB place' lines")
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


def metric_path() -> str:
    """The shipped `evaluate` metric module: `evaluate.load(metric_path())` works offline."""
    return str(Path(__file__).parent / "metrics" / "birthplace_accuracy" / "birthplace_accuracy.py")


def load_metric():
    import evaluate

    return evaluate.load(metric_path())


__all__ = [
    "dataset_id",
    "default_eval_path",
    "evaluate_birthplaces",
    "load_checkpoint",
    "load_metric",
    "london_baseline",
    "metric_path",
    "scores_path",
]
