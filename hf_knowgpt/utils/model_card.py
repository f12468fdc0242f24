"""Model cards for KnowGPT checkpoints, rendered with huggingface_hub's ModelCard from `model_cards/knowgpt.md`.

The facts behind a card are kept beside it in `knowgpt_card.json`, so evaluating a checkpoint later adds
its accuracy to the card (and to the Hub `model-index`) without losing anything.
"""

import json
import platform
from importlib import resources
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .checkpoints import write_text_atomic

CARD_FACTS = "knowgpt_card.json"


def describe_device(device: torch.device | str | None = None) -> str:
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def template_path() -> Path:
    return Path(str(resources.files("model_cards") / "knowgpt.md"))


def render_model_card(facts: dict) -> ModelCard:
    evaluations = facts.get("evaluations", [])
    tags = ["hf_knowgpt", "knowgpt", "cs224n", "character-level", "knowledge-access", facts["attention_type"]]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=[facts["dataset_id"]] if facts.get("dataset_id") else None,
        base_model=facts.get("base_model"),
        model_name=facts["model_name"],
        eval_results=[
            EvalResult(
                task_type="question-answering",
                task_name="Birthplace question answering",
                dataset_type=e.get("dataset_type", "cs224n-birthplaces"),
                dataset_name=e["eval_file"],
                metric_type="exact_match",
                metric_value=round(100 * e["accuracy"], 2),
                metric_name="exact match (%)",
            )
            for e in evaluations
        ]
        or None,
    )
    return ModelCard.from_template(card_data, template_path=template_path(), **{**facts, "evaluations": evaluations})


def write_model_card(directory, facts: dict) -> None:
    """Write README.md and the facts behind it into `directory` (each file atomically)."""
    directory = Path(directory)
    card = render_model_card(facts)
    write_text_atomic(directory / CARD_FACTS, json.dumps(facts, indent=2, default=str) + "\n")
    write_text_atomic(directory / "README.md", str(card))


def read_card_facts(directory) -> dict | None:
    path = Path(directory) / CARD_FACTS
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def add_evaluation_to_card(directory, evaluation: dict) -> bool:
    """Record an evaluation (eval_file, correct, total, accuracy) in a local checkpoint's card."""
    facts = read_card_facts(directory)
    if facts is None:
        return False
    kept = [e for e in facts.get("evaluations", []) if e["eval_file"] != evaluation["eval_file"]]
    facts["evaluations"] = kept + [evaluation]
    write_model_card(directory, facts)
    return True


__all__ = ["add_evaluation_to_card", "describe_device", "read_card_facts", "render_model_card", "write_model_card"]
