"""Pretrain, finetune and evaluate: what the command-line scripts (and `scripts/run.py`) do, as functions.

With no corpus path, each stage uses the synthetic biography corpus (`data_loaders.synthetic_corpus_files`),
so everything runs out of the box; with the CS224N files it runs the handouts' experiments.
"""

import json
import logging
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_loaders import (
    encode_birthplace_examples,
    encode_documents,
    load_birthplaces,
    load_corpus,
    synthetic_corpus_files,
)
from data_loaders.span_corruption import MIN_DOCUMENT_LENGTH, max_truncation_length
from data_loaders.synthetic import DEFAULT_NUM_PEOPLE

from .configuration_knowgpt import KnowGPTConfig
from .model_card import add_evaluation_to_card, describe_device, read_card_facts, write_model_card
from .modeling_knowgpt import KnowGPTForCausalLM
from .qa import HANDOUT_MAX_NEW_TOKENS, format_accuracy, load_metric, predict_birthplaces
from .recipes import Recipe, StageRecipe, get_recipe
from .tokenization_knowgpt import KnowGPTTokenizerFast
from .training import (
    FinetuningData,
    KnowGPTTrainer,
    MixedData,
    PretrainingData,
    TrainingArguments,
    make_accelerator,
    write_text_atomic,
)

logger = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """A run stopped by SIGINT/SIGTERM after saving a checkpoint; resume it with --resume_from_checkpoint."""

    def __init__(self, signal_number: int, checkpoint_step: int):
        super().__init__(f"stopped by signal {signal_number}; checkpoint-{checkpoint_step} saved")
        self.signal_number, self.checkpoint_step = signal_number, checkpoint_step


def command_line() -> str:
    """The command that is running, as a user would type it (accelerate's launcher included)."""
    script = shlex.join(sys.argv)
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        launch = ["accelerate", "launch"]
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
            launch += ["--mixed_precision", os.environ["ACCELERATE_MIXED_PRECISION"]]
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            launch += ["--num_processes", os.environ["WORLD_SIZE"]]
        return shlex.join(launch) + " " + script
    return "python " + script


# The question template's characters join every vocabulary, so questions never hit the unknown id; wiki.txt
# contains them all, so its vocabulary stays exactly the handouts'.
QUESTION_CHARACTERS = "Where was born?"


def corpus_tokenizer(corpus_path) -> KnowGPTTokenizerFast:
    return KnowGPTTokenizerFast.from_corpus(
        Path(corpus_path).read_text(encoding="utf-8"), extra_characters=QUESTION_CHARACTERS
    )


def new_model(tokenizer, recipe: Recipe, attention_type=None, model_overrides=None, seed=None) -> KnowGPTForCausalLM:
    """A freshly initialized model (seeded) with the recipe's sizes, overridden where given."""
    values = {**recipe.model, **{k: v for k, v in (model_overrides or {}).items() if v is not None}}
    config = KnowGPTConfig(
        vocab_size=len(tokenizer),
        attention_type=attention_type or recipe.attention_type,
        unk_token_id=tokenizer.unk_token_id,
        **values,
    )
    set_seed(seed or 0)  # the initial weights
    return KnowGPTForCausalLM(config)


def default_data(num_people: int = DEFAULT_NUM_PEOPLE):
    return synthetic_corpus_files(num_people)


def _dataset_id(path) -> str:
    return "synthetic-biographies" if "synthetic-" in str(path) else "cs224n-knowledge-access"


def stage_training_arguments(stage: StageRecipe, output_dir, corpus_documents, block_size, overrides: dict):
    """A recipe stage's `TrainingArguments`: its epochs, batch and learning rate, and the schedule's
    final_tokens counted on the pretraining corpus (`corpus_documents` documents) as the handouts count
    them; `overrides` (None values ignored) replace any field."""
    final_tokens = (
        None if stage.final_tokens_epochs is None else stage.final_tokens_epochs * corpus_documents * block_size
    )
    values = dict(
        output_dir=str(output_dir),
        max_epochs=stage.max_epochs,
        batch_size=stage.batch_size,
        learning_rate=stage.learning_rate,
        final_tokens=final_tokens,
        **stage.extra,
    )
    values.update({key: value for key, value in overrides.items() if value is not None})
    return TrainingArguments(**values)


def _card_facts(model, tokenizer, args, result, accelerator, data_description, dataset_id, extra) -> dict:
    config = model.config
    return {
        "model_name": Path(args.output_dir).name,
        "model_path": str(args.output_dir),
        "attention_type": config.attention_type,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "block_size": config.block_size,
        "bottleneck_dim": config.bottleneck_dim,
        "vocab_size": len(tokenizer),
        "parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "data_description": data_description,
        "dataset_id": dataset_id,
        **{k: v for k, v in asdict(args).items() if k not in ("output_dir", "resume_from_checkpoint")},
        "mixed_precision": accelerator.mixed_precision,
        "num_processes": accelerator.num_processes,
        "device": describe_device(accelerator.device),
        "train_seconds": round(result.train_seconds, 1) if result else "in progress",
        "examples_per_second": round(result.examples_per_second, 1) if result else "in progress",
        "final_loss": round(result.final_loss, 4) if result and result.final_loss is not None else "n/a",
        "evaluations": [],
        **extra,
    }


def _run(model, tokenizer, data, args, accelerator, card: dict, push_to_hub=False, hub_model_id=None, hub_token=None):
    """Train, save every checkpoint and the final model with tokenizer and card; optionally push."""

    def export(directory, unwrapped, result=None):
        tokenizer.save_pretrained(directory)
        facts = _card_facts(unwrapped, tokenizer, args, result, accelerator, **card)
        write_model_card(directory, facts)

    trainer = KnowGPTTrainer(model, data, args, accelerator, save_callback=export)
    result = trainer.train()
    metrics = {
        "global_step": result.global_step,
        "epochs": result.epochs,
        "final_loss": result.final_loss,
        "train_seconds": result.train_seconds,
        "warmup_seconds": result.warmup_seconds,
        "examples_per_second": result.examples_per_second,
        "interrupted": result.interrupted,
        "device": describe_device(accelerator.device),
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "loss_curve": result.loss_curve,
    }
    if result.interrupted:
        raise TrainingInterrupted(result.interrupted, result.global_step)
    trainer.save_callback = lambda directory, unwrapped: export(directory, unwrapped, result)
    trainer.save_final(metrics)
    if accelerator.is_main_process:
        accelerator.print(
            f"Saved {args.output_dir}: {result.global_step} steps, final loss {result.final_loss:.4f}, "
            f"{result.train_seconds:.1f} s on {describe_device(accelerator.device)}"
        )
        if push_to_hub:
            from .hub import push_checkpoint

            repo_id = hub_model_id or Path(args.output_dir).name
            push_checkpoint(args.output_dir, repo_id, token=hub_token)
            accelerator.print(f"Pushed {args.output_dir} to the Hub as {repo_id}")
    return accelerator.unwrap_model(trainer.model), metrics


def pretrain(
    output_dir,
    attention_type: str | None = None,
    pretrain_corpus_path=None,
    mixed_training_corpus_path=None,
    recipe: str | Recipe = "handout",
    model_overrides: dict | None = None,
    training_overrides: dict | None = None,
    num_people: int = DEFAULT_NUM_PEOPLE,
    accelerator=None,
    push_to_hub: bool = False,
    hub_model_id: str | None = None,
    hub_token: str | None = None,
    command: str | None = None,
    min_truncation_length: int | None = None,
):
    """Pretrain with span corruption on `pretrain_corpus_path` (default: the synthetic corpus); with mixed
    training (the knowledge recipe), the questions of `mixed_training_corpus_path` join every epoch.
    `min_truncation_length` (default: the recipe's) is the shortest prefix of a document an example reads."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    attention_type = attention_type or recipe.attention_type
    corpus_path = Path(pretrain_corpus_path) if pretrain_corpus_path else default_data(num_people).corpus
    if recipe.mixed_training and mixed_training_corpus_path is None:
        if pretrain_corpus_path:
            raise ValueError(
                f"recipe {recipe.name!r} mixes question–answer examples into pretraining: "
                "pass --mixed_training_corpus_path (the training questions, e.g. birth_places_train.tsv)"
            )
        mixed_training_corpus_path = default_data(num_people).train
    documents = load_corpus(corpus_path)["train"]["text"]
    tokenizer = corpus_tokenizer(corpus_path)
    model = new_model(tokenizer, recipe, attention_type, model_overrides, (training_overrides or {}).get("seed"))
    block_size = model.config.block_size
    args = stage_training_arguments(recipe.pretrain, output_dir, len(documents), block_size, training_overrides or {})
    accelerator = accelerator or make_accelerator(args)
    if min_truncation_length is None:  # the recipe's, within what a smaller --block_size can hold
        min_truncation_length = min(recipe.min_truncation_length, max_truncation_length(block_size))
    data = PretrainingData(
        *encode_documents(tokenizer, documents, block_size, str(corpus_path)), block_size, min_truncation_length
    )
    data_description = f"span corruption on `{corpus_path.name}` ({len(documents)} documents)"
    if min_truncation_length != MIN_DOCUMENT_LENGTH:
        data_description += f", documents truncated to at least {min_truncation_length} characters"
    if mixed_training_corpus_path:
        questions = _birthplace_examples(tokenizer, mixed_training_corpus_path, block_size)
        data = MixedData(data, questions)
        data_description += (
            f", mixed with the {questions.num_examples} questions of `{Path(mixed_training_corpus_path).name}`"
        )
    card = dict(
        data_description=data_description,
        dataset_id=_dataset_id(corpus_path),
        extra={
            "stage": "pretrain",
            "stage_description": "Pretrained with span corruption (the handouts' objective); not finetuned.",
            "recipe": recipe.name,
            "corpus_documents": len(documents),
            "commands": [command or command_line()],
        },
    )
    return _run(model, tokenizer, data, args, accelerator, card, push_to_hub, hub_model_id, hub_token)


def finetune(
    output_dir,
    model_name_or_path=None,
    finetune_corpus_path=None,
    pretrain_corpus_path=None,
    attention_type: str | None = None,
    recipe: str | Recipe = "handout",
    model_overrides: dict | None = None,
    training_overrides: dict | None = None,
    num_people: int = DEFAULT_NUM_PEOPLE,
    accelerator=None,
    push_to_hub: bool = False,
    hub_model_id: str | None = None,
    hub_token: str | None = None,
    command: str | None = None,
):
    """Finetune on birthplace questions, from `model_name_or_path` or (when None) from scratch."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if model_name_or_path and recipe.finetune_pretrained is None:
        raise ValueError(
            f"recipe {recipe.name!r} has no finetuning stage: its pretrained checkpoint answers the questions "
            f"as it is (evaluate {model_name_or_path} directly), or pass --recipe handout to finetune anyway"
        )
    synthetic = default_data(num_people)
    finetune_path = Path(finetune_corpus_path) if finetune_corpus_path else synthetic.train
    base_facts = (
        read_card_facts(model_name_or_path) if model_name_or_path and Path(model_name_or_path).is_dir() else None
    )
    if pretrain_corpus_path:
        corpus_path = Path(pretrain_corpus_path)
    elif model_name_or_path is None:
        corpus_path = synthetic.corpus
    else:
        corpus_path = None
    corpus_documents = len(load_corpus(corpus_path)["train"]) if corpus_path else None
    if corpus_documents is None:
        corpus_documents = (base_facts or {}).get("corpus_documents")
        if corpus_documents is None:
            raise ValueError(
                f"{model_name_or_path} does not record its pretraining corpus size, which the handouts' schedule "
                "needs (final_tokens = 200 · documents · block_size): pass --pretrain_corpus_path"
            )

    if model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        stage = recipe.finetune_pretrained
        commands = list((base_facts or {}).get("commands", []))
        description = f"Pretrained, then finetuned on `{finetune_path.name}` from `{model_name_or_path}`."
    else:
        tokenizer = corpus_tokenizer(corpus_path)
        model = new_model(tokenizer, recipe, attention_type, model_overrides, (training_overrides or {}).get("seed"))
        stage = recipe.finetune_scratch
        commands = []
        description = (
            f"Finetuned on `{finetune_path.name}` from scratch (no pretraining), vocabulary of `{corpus_path.name}`."
        )
    block_size = model.config.block_size
    data = _birthplace_examples(tokenizer, finetune_path, block_size)
    args = stage_training_arguments(stage, output_dir, corpus_documents, block_size, training_overrides or {})
    accelerator = accelerator or make_accelerator(args)
    card = dict(
        data_description=f"`{finetune_path.name}` ({data.num_examples} questions)",
        dataset_id=_dataset_id(finetune_path),
        extra={
            "stage": "finetune",
            "stage_description": description,
            "recipe": recipe.name,
            "base_model": str(model_name_or_path) if model_name_or_path else None,
            "corpus_documents": corpus_documents,
            "commands": commands + [c for c in [command or command_line()] if c not in commands],
        },
    )
    return _run(model, tokenizer, data, args, accelerator, card, push_to_hub, hub_model_id, hub_token)


def _birthplace_examples(tokenizer, path, block_size) -> FinetuningData:
    records = load_birthplaces(train=path)["train"]
    if any(answer is None for answer in records["answer"]):
        raise ValueError(f"{path} has questions without places: training needs 'question TAB place' lines")
    return FinetuningData(
        *encode_birthplace_examples(tokenizer, records["question"], records["answer"], block_size, str(path))
    )


def evaluate_birthplaces(
    model_name_or_path,
    eval_corpus_path=None,
    outputs_path=None,
    batch_size: int = 512,
    max_new_tokens: int = HANDOUT_MAX_NEW_TOKENS,
    write_scores: bool = False,
    num_people: int = DEFAULT_NUM_PEOPLE,
    device=None,
    model=None,
    tokenizer=None,
) -> dict:
    """Predict a birthplace for every question of `eval_corpus_path` (default: the synthetic dev set),
    write one prediction per line to `outputs_path`, and score them when the file has gold places."""
    eval_path = Path(eval_corpus_path) if eval_corpus_path else default_data(num_people).dev
    device = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model or AutoModelForCausalLM.from_pretrained(model_name_or_path).to(device)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_name_or_path)
    records = load_birthplaces(eval=eval_path)["eval"]
    predictions = predict_birthplaces(model, tokenizer, records["question"], batch_size, max_new_tokens)
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
    if all(answer is not None for answer in records["answer"]):
        metric = load_metric().compute(predictions=result["predictions"], references=records["answer"])
        result.update(metric)
        result["message"] = format_accuracy(metric["correct"], metric["total"])
        if outputs_path:
            metrics_file = outputs_path.with_name(outputs_path.name + ".metrics.json")
            write_text_atomic(
                metrics_file,
                json.dumps({k: result[k] for k in ("eval_file", "accuracy", "correct", "total")}, indent=2),
            )
        if model_name_or_path and Path(model_name_or_path).is_dir():
            add_evaluation_to_card(
                model_name_or_path,
                {
                    "eval_file": eval_path.name,
                    "correct": metric["correct"],
                    "total": metric["total"],
                    "accuracy": metric["accuracy"],
                    "dataset_type": _dataset_id(eval_path),
                },
            )
    else:
        result["message"] = (
            f"No gold birthplaces in {eval_path}: wrote {len(predictions)} predictions"
            + (f" to {outputs_path}" if outputs_path else "")
            + "; nothing was scored."
        )
    return result


def london_baseline(
    eval_corpus_path=None, outputs_path=None, place: str = "London", num_people: int = DEFAULT_NUM_PEOPLE
):
    """The handouts' baseline: answer `place` to every question; scored with the same metric."""
    eval_path = Path(eval_corpus_path) if eval_corpus_path else default_data(num_people).dev
    records = load_birthplaces(eval=eval_path)["eval"]
    if any(answer is None for answer in records["answer"]):
        raise ValueError(f"{eval_path} has no gold places: a baseline needs them")
    predictions = [place] * len(records)
    metric = load_metric().compute(predictions=predictions, references=records["answer"])
    result = {
        "eval_file": eval_path.name,
        "place": place,
        **metric,
        "message": format_accuracy(metric["correct"], metric["total"]),
    }
    if outputs_path:
        outputs_path = Path(outputs_path)
        outputs_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(outputs_path, "".join(p + "\n" for p in predictions))
        metrics_file = outputs_path.with_name(outputs_path.name + ".metrics.json")
        write_text_atomic(
            metrics_file,
            json.dumps({k: result[k] for k in ("eval_file", "place", "accuracy", "correct", "total")}, indent=2),
        )
    return result


def scores_path(outputs_path) -> Path:
    outputs_path = Path(outputs_path)
    return outputs_path.with_name(outputs_path.name + ".scores.tsv")


__all__ = [
    "TrainingInterrupted",
    "command_line",
    "evaluate_birthplaces",
    "finetune",
    "london_baseline",
    "pretrain",
    "scores_path",
    "stage_training_arguments",
]
