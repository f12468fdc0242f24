"""Pretrain, finetune and evaluate: what the command-line scripts do, as functions.

Each stage takes a resolved `RunConfig` (`hf_knowgpt.training.run_config`: the recipe's values and the flags the
user gave) and a `DataFiles`. `run_recipe` runs a whole recipe in one process: pretraining → finetuning
(when the recipe has it) → dev evaluation → test predictions. `pretrain` and `finetune` are the same
stages for library users, resolved from plain keyword settings (`pretrain("out", attention_type="rope",
max_epochs=3)`). With no corpus, everything runs on the synthetic biography corpus.
"""

import json
import logging
import os
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from accelerate.utils import set_seed

from data_loaders.corpus import DataFiles, person_documents, read_birthplaces, read_corpus
from data_loaders.encoding import (
    encode_birthplace_examples,
    encode_document_variants,
    encode_documents,
    encode_question_variants,
)
from data_loaders.truncation import MIN_DOCUMENT_LENGTH

from ..analysis.evaluation import dataset_id, evaluate_birthplaces, load_checkpoint, london_baseline, scores_path
from ..configuration_knowgpt import KnowGPTConfig
from ..modeling_knowgpt import KnowGPTForCausalLM
from ..tokenization_knowgpt import KnowGPTTokenizerFast
from ..utils import timeline
from ..utils.checkpoints import list_checkpoints, looks_like_hub_id, write_json_atomic
from ..utils.errors import InputError
from ..utils.model_card import describe_device, read_card_facts, write_model_card
from .compile_cache import prefetch_compiler_keys, saved_steps
from .data import FinetuningData, MixedData, PretrainingData, VariantRows
from .run_config import RunConfig, plan_finetuning, plan_pretraining, qualify
from .trainer import KnowGPTTrainer, make_accelerator

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


def new_model(tokenizer, model_settings: dict, seed: int = 0) -> KnowGPTForCausalLM:
    """A freshly initialized model (seeded) of the resolved configuration."""
    config = KnowGPTConfig(vocab_size=len(tokenizer), unk_token_id=tokenizer.unk_token_id, **model_settings)
    set_seed(seed)  # the initial weights
    return KnowGPTForCausalLM(config)


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


def _train(model, tokenizer, data, args, accelerator, card: dict, config: RunConfig, hub: dict | None = None):
    """Train one stage, save every checkpoint and the final model with tokenizer and card; optionally push.
    Returns the trained (unwrapped) model and the stage's metrics."""

    # as a 🤗 checkpoint's tokenizer does: truncation=True cuts at the model's block, pipelines warn beyond it
    tokenizer.model_max_length = model.config.block_size

    def export(directory, unwrapped, result=None):
        tokenizer.save_pretrained(directory)
        facts = _card_facts(unwrapped, tokenizer, args, result, accelerator, **card)
        write_model_card(directory, facts)

    stage = "pretrain" if args is config.pretrain else "finetune"
    trainer = KnowGPTTrainer(model, data, args, accelerator, save_callback=export, run_record=config.to_dict())
    timeline.mark(f"{stage}: model and data on the device")
    result = trainer.train()
    timeline.mark(f"{stage}: training (compilation and capture included)")
    metrics = {
        "global_step": result.global_step,
        "epochs": result.epochs,
        "final_loss": result.final_loss,
        "train_seconds": result.train_seconds,
        "warmup_seconds": result.warmup_seconds,
        "load_seconds": result.load_seconds,
        "setup_seconds": result.setup_seconds,
        "captures": result.captures,
        "compiled": result.compiled,
        "examples_per_second": result.examples_per_second,
        "epoch_seconds": result.epoch_seconds,
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
    model = accelerator.unwrap_model(trainer.model)
    accelerator.free_memory()  # the next stage prepares its own model, optimizer and scheduler
    timeline.mark(f"{stage}: final model saved")
    if accelerator.is_main_process:
        accelerator.print(
            f"Saved {args.output_dir}: {result.global_step} steps, final loss {result.final_loss:.4f}, "
            f"{result.train_seconds:.1f} s on {describe_device(accelerator.device)}"
        )
        hub = hub or {}
        if hub.get("push_to_hub"):
            from ..utils.hub import push_checkpoint

            repo_id = hub.get("hub_model_id") or Path(args.output_dir).name
            push_checkpoint(args.output_dir, repo_id, token=hub.get("hub_token"))
            accelerator.print(f"Pushed {args.output_dir} to the Hub as {repo_id}")
    return model, metrics


def _prefetch_compiler_keys(args) -> None:
    """A stage that loads or compiles its step has the compiler's keys computed while its data and model are
    made ready (`compile_cache.prefetch_compiler_keys`); with `--torch_compile auto`, where a step is saved."""
    if args.compile is True or (args.compile == "auto" and saved_steps()):
        prefetch_compiler_keys()


def _birthplace_records(path):
    records = read_birthplaces(path)
    if any(record.answer is None for record in records):
        raise InputError(
            path,
            "no line has a tab and a place: it looks like questions only",
            "training needs 'question TAB place' lines",
        )
    return records


def recitations(records, documents, length: int) -> list[str] | None:
    """What a model with `recitation_length` recites before each answer: the first `length` characters of the
    person's document (titled with their name, else the first naming them; nothing when none does)."""
    if not length:
        return None
    return [(document or "")[:length] for document in person_documents([r.name for r in records], documents)]


def _birthplace_examples(tokenizer, path, model_config, documents=None) -> FinetuningData:
    """The training questions as examples; a reciting model's recite from `documents` (the corpus's lines)."""
    records = _birthplace_records(path)
    questions, answers = [r.question for r in records], [r.answer for r in records]
    recited = None
    if model_config.recitation_length:
        if documents is None:
            raise InputError(
                path,
                f"the model recites before answering (recitation_length {model_config.recitation_length}), and no "
                "corpus holds what it recites",
                "pass --pretrain_corpus_path",
            )
        recited = recitations(records, documents, model_config.recitation_length)
    block_size = model_config.block_size
    return FinetuningData(*encode_birthplace_examples(tokenizer, questions, answers, block_size, str(path), recited))


def pretraining_data(config: RunConfig, files: DataFiles, tokenizer, block_size: int, documents: list[str]):
    """What the pretraining stage of `config` reads, and its description for the model card: the corpus's
    documents (each `document_repeats` times per epoch, as one of `document_variants` versions, a share read
    as plain text) and, with mixed training, the training questions (`question_repeats` times, in one of
    `question_variants` phrasings). Variation is drawn afresh at every exposure (`VariantRows`)."""
    source = str(files.corpus)
    repeats, seed = config.document_repeats, config.pretrain.seed
    width = config.longest_truncation
    if config.document_variants > 1:
        ids, lengths, counts = encode_document_variants(
            tokenizer, documents, block_size, config.document_variants, seed, source, width
        )
        variants = VariantRows.consecutive(counts).repeat(repeats)
    else:  # every copy draws its own corruption
        ids, lengths = encode_documents(tokenizer, documents, block_size, source, width)
        ids, lengths, variants = ids.repeat(repeats, 1), lengths.repeat(repeats), None
    data = PretrainingData(
        ids,
        lengths,
        block_size,
        config.min_truncation_length,
        variants,
        config.plain_text_fraction,
        config.max_truncation_length,
    )
    description = f"span corruption on `{Path(files.corpus).name}` ({len(documents)} documents)"
    if repeats != 1:
        description += f", each {repeats} times per epoch"
    if config.document_variants > 1:
        description += (
            f", each exposure one of up to {config.document_variants} versions (its phrases reordered behind its "
            "title)"
        )
    if config.plain_text_fraction:
        description += f", {config.plain_text_fraction:g} of exposures as plain text"
    if config.min_truncation_length != MIN_DOCUMENT_LENGTH:
        description += f", documents truncated to at least {config.min_truncation_length} characters"
    if config.max_truncation_length is not None:
        description += f", at most {config.max_truncation_length}"
    if not config.mixed_training:
        return data, description
    records = _birthplace_records(files.train)
    names, answers = [r.name for r in records], [r.answer for r in records]
    recited = recitations(records, documents, config.model["recitation_length"])
    input_ids, labels, counts = encode_question_variants(
        tokenizer, names, answers, config.question_variants, block_size, str(files.train), recited
    )
    if config.question_variants == 1:  # one phrasing: the plain examples, repeated
        questions = FinetuningData(
            input_ids.repeat(config.question_repeats, 1), labels.repeat(config.question_repeats, 1)
        )
    else:
        questions = FinetuningData(input_ids, labels, VariantRows.consecutive(counts).repeat(config.question_repeats))
    description += f", mixed with the {len(records)} questions of `{Path(files.train).name}`"
    if config.question_repeats != 1:
        description += f", each {config.question_repeats} times per epoch"
    if config.question_variants > 1:
        description += f", each exposure in one of {config.question_variants} phrasings"
    if recited is not None:
        description += (
            f"; each answer follows a recitation of the first {config.model['recitation_length']} characters of "
            "the person's document"
        )
    return MixedData(data, questions), description


def run_pretraining(
    config: RunConfig, files: DataFiles, *, model=None, tokenizer=None, accelerator=None, hub=None, command=None
):
    """The pretraining stage of a resolved run: span corruption on `files.corpus` (and, with mixed
    training, the questions of `files.train` in every epoch). Returns (model, tokenizer, metrics)."""
    args = config.pretrain
    _prefetch_compiler_keys(args)
    documents = read_corpus(files.corpus)
    tokenizer = tokenizer or corpus_tokenizer(files.corpus)
    model = model or new_model(tokenizer, config.model, args.seed)
    block_size = model.config.block_size
    accelerator = accelerator or make_accelerator(args)
    data, description = pretraining_data(config, files, tokenizer, block_size, documents)
    timeline.mark("pretrain: device set up, corpus read, model built, examples encoded")
    card = dict(
        data_description=description,
        dataset_id=dataset_id(files.corpus),
        extra={
            "stage": "pretrain",
            "stage_description": "Pretrained with span corruption (the handouts' objective); not finetuned.",
            "recipe": config.recipe,
            "corpus_documents": len(documents),
            "commands": [command or command_line()],
        },
    )
    model, metrics = _train(model, tokenizer, data, args, accelerator, card, config, hub)
    return model, tokenizer, metrics


def run_finetuning(
    config: RunConfig,
    files: DataFiles,
    *,
    model=None,
    tokenizer=None,
    model_name_or_path=None,
    accelerator=None,
    hub=None,
    command=None,
):
    """The finetuning stage of a resolved run, on the questions of `files.train`: from `model` (just
    pretrained in this process), from `model_name_or_path`, or from scratch with the vocabulary of
    `files.corpus`. Returns (model, tokenizer, metrics)."""
    args = config.finetune
    _prefetch_compiler_keys(args)
    base_facts = (
        read_card_facts(model_name_or_path) if model_name_or_path and Path(model_name_or_path).is_dir() else None
    )
    commands = list((base_facts or {}).get("commands", []))
    if model is None and model_name_or_path:
        model, tokenizer = load_checkpoint(model_name_or_path)
    if model is not None:
        source = model_name_or_path or "the model pretrained before it"
        description = f"Pretrained, then finetuned on `{Path(files.train).name}` from `{source}`."
    else:
        tokenizer = corpus_tokenizer(files.corpus)
        model = new_model(tokenizer, config.model, args.seed)
        description = (
            f"Finetuned on `{Path(files.train).name}` from scratch (no pretraining), vocabulary of "
            f"`{Path(files.corpus).name}`."
        )
    documents = read_corpus(files.corpus) if files.corpus else None
    corpus_documents = len(documents) if documents is not None else (base_facts or {}).get("corpus_documents")
    data = _birthplace_examples(tokenizer, files.train, model.config, documents)
    accelerator = accelerator or make_accelerator(args)
    timeline.mark("finetune: questions read, model ready, examples encoded")
    command = command or command_line()
    card = dict(
        data_description=f"`{Path(files.train).name}` ({data.num_examples} questions)",
        dataset_id=dataset_id(files.train),
        extra={
            "stage": "finetune",
            "stage_description": description,
            "recipe": config.recipe,
            # Hub metadata names Hub models only; a local folder is named in the description
            "base_model": str(model_name_or_path)
            if model_name_or_path and looks_like_hub_id(model_name_or_path)
            else None,
            "corpus_documents": corpus_documents,
            "commands": commands + [command] if command not in commands else commands,
        },
    )
    model, metrics = _train(model, tokenizer, data, args, accelerator, card, config, hub)
    return model, tokenizer, metrics


def pretrain(
    output_dir,
    recipe: str = "handout",
    pretrain_corpus_path=None,
    mixed_training_corpus_path=None,
    num_people: int | None = None,
    accelerator=None,
    hub: dict | None = None,
    command: str | None = None,
    **settings,
):
    """Pretrain for library users: `settings` are plain field names (`attention_type="rope"`,
    `max_epochs=3`, `min_truncation_length=112`), resolved over `recipe` exactly as the scripts' flags are.
    Without a corpus path, the synthetic corpus (and its training questions, for mixed training).
    Returns (model, metrics)."""
    if pretrain_corpus_path is None:
        files = DataFiles.synthetic(num_people)
    else:
        files = DataFiles(corpus=Path(pretrain_corpus_path))
    files = files.replaced(train=mixed_training_corpus_path)
    config = plan_pretraining(recipe, qualify(settings, "pretrain"), files, output_dir)
    model, _, metrics = run_pretraining(config, files, accelerator=accelerator, hub=hub, command=command)
    return model, metrics


def finetune(
    output_dir,
    model_name_or_path=None,
    finetune_corpus_path=None,
    pretrain_corpus_path=None,
    recipe: str = "handout",
    finetune_recipe: str | None = None,
    num_people: int | None = None,
    accelerator=None,
    hub: dict | None = None,
    command: str | None = None,
    **settings,
):
    """Finetune for library users, from `model_name_or_path` or (when None) from scratch; `settings` as
    for `pretrain`. Returns (model, metrics)."""
    synthetic = DataFiles.synthetic(num_people) if finetune_corpus_path is None or not model_name_or_path else None
    corpus = pretrain_corpus_path or (None if model_name_or_path else synthetic.corpus)
    train = finetune_corpus_path or synthetic.train
    files = DataFiles(corpus=Path(corpus) if corpus else None, train=Path(train))
    config = plan_finetuning(
        recipe, qualify(settings, "finetune"), files, output_dir, model_name_or_path, finetune_recipe
    )
    model, _, metrics = run_finetuning(
        config, files, model_name_or_path=model_name_or_path, accelerator=accelerator, hub=hub, command=command
    )
    return model, metrics


def _completed(stage_dir: Path) -> bool:
    """A stage whose final model was saved (the last file written is config.json, after train_results.json)."""
    return (stage_dir / "train_results.json").is_file() and (stage_dir / "config.json").is_file()


def _resuming(args, stage_dir: Path):
    """In a whole-recipe run, `--resume_from_checkpoint latest` applies to the stage that was interrupted: a
    stage not yet begun starts afresh."""
    if args.resume_from_checkpoint == "latest" and not list_checkpoints(stage_dir):
        return replace(args, resume_from_checkpoint=None)
    return args


def run_recipe(
    config: RunConfig,
    files: DataFiles,
    output_dir,
    *,
    accelerator=None,
    hub: dict | None = None,
    command: str | None = None,
    eval_batch_size: int = 512,
) -> dict:
    """A whole recipe in one process: pretraining (into output_dir/pretrained) → finetuning (into
    output_dir/finetuned) for the stages `config` has → the dev questions scored (`Correct: x out of N:
    y%`, the handouts' way) → predictions for the test questions. Each stage's checkpoint is saved as by the
    separate scripts; predictions and `results.json` go into `output_dir`. With `--resume_from_checkpoint
    latest`, a stage that finished is loaded instead of trained again."""
    started = time.perf_counter()
    output_dir = Path(output_dir)
    command = command or command_line()
    first = config.pretrain or config.finetune
    accelerator = accelerator or make_accelerator(first)
    model = tokenizer = None
    summary = {"config": config.to_dict(), "stages": {}, "device": describe_device(accelerator.device)}
    for stage in config.stages:
        args = getattr(config, stage)
        stage_dir = Path(args.output_dir)
        if args.resume_from_checkpoint and _completed(stage_dir):
            model, tokenizer = load_checkpoint(stage_dir)
            accelerator.print(f"{stage_dir} holds the finished {stage} stage: loaded, not trained again")
            summary["stages"][stage] = json.loads((stage_dir / "train_results.json").read_text())
            continue
        args = _resuming(args, stage_dir)
        stage_config = replace(config, **{stage: args})
        run = run_pretraining if stage == "pretrain" else run_finetuning
        model, tokenizer, metrics = run(
            stage_config, files, model=model, tokenizer=tokenizer, accelerator=accelerator, hub=hub, command=command
        )
        summary["stages"][stage] = {k: v for k, v in metrics.items() if k != "loss_curve"}
    if any(getattr(config, stage).compile for stage in config.stages):
        from ..kernels import release_compile_workers

        release_compile_workers()  # nothing more is compiled: the pool's shutdown overlaps evaluation
    answerer = Path(getattr(config, config.stages[-1]).output_dir)
    if accelerator.is_main_process:
        model.to(accelerator.device)
        for split, path in (("dev", files.dev), ("test", files.test)):
            if path is None:
                continue
            evaluation_started = time.perf_counter()
            result = evaluate_birthplaces(
                answerer,
                eval_corpus_path=path,
                outputs_path=output_dir / f"{split}.predictions",
                batch_size=eval_batch_size,
                model=model,
                tokenizer=tokenizer,
                update_model_card=True,
            )
            print(result["message"], flush=True)
            summary[split] = {
                k: result[k] for k in ("eval_file", "predictions_file", "accuracy", "correct", "total") if k in result
            }
            summary[split]["seconds"] = time.perf_counter() - evaluation_started
            timeline.mark(f"{split} questions answered and written")
        summary["seconds_in_run_recipe"] = time.perf_counter() - started
        summary["timeline"] = timeline.marks()
        write_json_atomic(output_dir / "results.json", summary)
    accelerator.wait_for_everyone()
    return summary


__all__ = [
    "TrainingInterrupted",
    "command_line",
    "evaluate_birthplaces",
    "finetune",
    "pretraining_data",
    "london_baseline",
    "pretrain",
    "run_finetuning",
    "run_pretraining",
    "run_recipe",
    "scores_path",
]
