import base64
import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ONLY, DEV_TSV, REPO_ROOT, needs_data
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_knowgpt  # noqa: F401
from data_loaders import write_synthetic_corpus
from hf_knowgpt.analysis.evaluation import load_metric
from hf_knowgpt.qa import handout_accuracy
from hf_knowgpt.training import workflows
from hf_knowgpt.training.arguments import HANDOUT_WARMUP_TOKENS
from hf_knowgpt.training.data import packed_token_index, packed_token_indices
from hf_knowgpt.training.optimization import (
    handout_lr_multiplier,
    handout_lr_multipliers,
    handout_parameter_groups,
    rows_per_step,
)
from hf_knowgpt.training.trainer import KnowGPTTrainer
from hf_knowgpt.utils import checkpoints
from hf_knowgpt.utils.checkpoints import list_checkpoints, validate_checkpoint
from hf_knowgpt.utils.errors import OutputError

TINY_MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64"]
TINY_OVERRIDES = dict(n_layer=2, n_head=2, n_embd=32, block_size=64)
SCRIPTS = REPO_ROOT / "scripts"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(tmp_path_factory.mktemp("synthetic"), num_people=60, seed=0)


def run_script(*args, launcher=("python",), check=True, env=None, timeout=600):
    command = [*launcher, *[str(a) for a in args]]
    if launcher == ("python",):
        command[0] = sys.executable
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env={**os.environ, **(env or {})}
    )
    if check:
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


# -- the handouts' optimizer and schedule --------------------------------------------------------------------


def handout_trainer_learning_rates(num_examples, batch_size, epochs, block_size, base_lr, final_tokens):
    """The handout trainer's loop, restated: the rate used by each step, updated after it from (y >= 0).sum()."""
    lr, tokens, used = base_lr, 0, []
    for _ in range(epochs):
        for start in range(0, num_examples, batch_size):
            used.append(lr)
            tokens += min(batch_size, num_examples - start) * (block_size - 1)  # every y position, pads included
            if tokens < HANDOUT_WARMUP_TOKENS:
                multiplier = tokens / HANDOUT_WARMUP_TOKENS
            else:
                progress = (tokens - HANDOUT_WARMUP_TOKENS) / max(1, final_tokens - HANDOUT_WARMUP_TOKENS)
                multiplier = max(0.1, 0.5 * (1.0 + math.cos(math.pi * progress)))
            lr = base_lr * multiplier
    return used


def test_learning_rates_follow_the_handout_trainer_step_by_step():
    num_examples, batch_size, epochs, block = 2937, 128, 650, 128
    final_tokens = epochs * num_examples * block
    steps = rows_per_step(num_examples, batch_size, epochs)
    assert len(steps) == 14950 and steps[22] == 121  # 23 batches per epoch, the last one of 121
    ours = [6e-3 * m for m in handout_lr_multipliers(steps, block - 1, HANDOUT_WARMUP_TOKENS, final_tokens)]
    theirs = handout_trainer_learning_rates(num_examples, batch_size, epochs, block, 6e-3, final_tokens)
    assert len(ours) == len(theirs)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-12
    assert ours[0] == 6e-3  # the first step runs at the full rate (warmup is shorter than one batch)
    assert ours[-1] == pytest.approx(6e-4)  # the 10% floor
    assert handout_lr_multiplier(5120, 10240, 10**6) == 0.5


def test_weight_decay_applies_to_everything_but_biases():
    model = AutoModelForCausalLM.from_config(
        hf_knowgpt.KnowGPTConfig(attention_type="synthesizer", n_embd=32, n_head=2)
    )
    decay, no_decay = handout_parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "transformer.tok_emb.weight" in decayed and "transformer.pos_emb.weight" in decayed
    assert "transformer.blocks.0.ln1.weight" in decayed and "transformer.blocks.0.attn.b2" in decayed
    assert all("bias" in names[id(p)] for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_packed_index_takes_the_earliest_padding_of_each_row_first():
    """The padding added to reach a size: rounds over the rows, position lengths[b] + k in round k, rows in
    order; the same positions as sorting every padding position by (round, row)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        rows, width = (
            int(torch.randint(1, 12, (1,), generator=generator)),
            int(torch.randint(1, 10, (1,), generator=generator)),
        )
        lengths = torch.randint(0, width + 3, (rows,), generator=generator)
        count = int(lengths.clamp(max=width).sum())
        size = int(torch.randint(count, rows * width + 1, (1,), generator=generator))
        real = torch.arange(width)[None] < lengths[:, None]
        padding = sorted(
            (t - int(lengths[b]), b, b * width + t) for b in range(rows) for t in range(width) if not real[b, t]
        )
        expected = sorted([b * width + t for b in range(rows) for t in range(width) if real[b, t]]
                          + [flat for _, _, flat in padding[: size - count]])  # fmt: skip
        assert packed_token_index(lengths, width, size=size).tolist() == expected


def test_packed_index_keeps_row_prefixes_and_rounds_up():
    lengths = torch.tensor([5, 2, 7])
    index = packed_token_index(lengths, 8)
    assert index.tolist() == [0, 1, 2, 3, 4, 8, 9, 16, 17, 18, 19, 20, 21, 22]
    rounded = packed_token_index(lengths, 8, multiple=8)
    assert len(rounded) == 16
    for row in range(3):
        positions = sorted(i % 8 for i in rounded.tolist() if i // 8 == row)
        assert positions == list(range(len(positions))) and len(positions) >= lengths[row]


def test_packed_indices_of_several_steps_are_each_steps_own_one_after_another():
    """The host plans packed steps many at a time: the same indices as each step's alone, whatever each
    step's size (its real tokens up to its whole grid), and a size out of reach names the step."""
    generator = torch.Generator().manual_seed(1)
    steps, rows, width = 9, 6, 8
    lengths = torch.randint(0, width + 2, (steps, rows), generator=generator)
    counts = lengths.clamp(max=width).sum(dim=1)
    sizes = [int(torch.randint(int(count), rows * width + 1, (1,), generator=generator)) for count in counts]
    sizes[0], sizes[1] = int(counts[0]), rows * width  # no padding at all, then every position
    expected = torch.cat([packed_token_index(lengths[s], width, size=sizes[s]) for s in range(steps)])
    assert torch.equal(packed_token_indices(lengths, width, sizes), expected)
    sizes[4] = int(counts[4]) - 1
    with pytest.raises(ValueError, match=f"got {sizes[4]} \\(step 4 of 9\\)"):
        packed_token_indices(lengths, width, sizes)


# -- end to end ------------------------------------------------------------------------------------------------


def test_pretrain_finetune_evaluate_and_pipeline_end_to_end(corpus, tmp_path):
    pretrained, finetuned = tmp_path / "pretrained", tmp_path / "finetuned"
    run_script(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", pretrained,
               "--max_epochs", 3, "--batch_size", 16, *TINY_MODEL, "--report_to", "tensorboard")  # fmt: skip
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "training_args.json",
                 "train_results.json", "modeling_knowgpt.py"):  # fmt: skip
        assert (pretrained / name).is_file(), name
    assert list((pretrained / "runs").rglob("events.out.tfevents.*")), "no TensorBoard scalars in output_dir/runs"
    card = (pretrained / "README.md").read_text()
    assert "library_name: transformers" in card and "pretrain.py" in card and "| attention | `vanilla` |" in card

    run_script(SCRIPTS / "finetune.py", "--model_name_or_path", pretrained, "--finetune_corpus_path", corpus.train,
               "--output_dir", finetuned, "--max_epochs", 2, "--batch_size", 8)  # fmt: skip
    for checkpoint in (pretrained, finetuned):  # the tokenizer knows the model's block, as a 🤗 checkpoint's does
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        assert tokenizer.model_max_length == 64
        assert len(tokenizer("Where was " * 20, truncation=True)["input_ids"]) == 64
    card = (finetuned / "README.md").read_text()
    # a local base model is named in the text; Hub metadata (base_model) names Hub models only
    assert "base_model:" not in card and f"from `{pretrained}`" in card
    assert card.count("pretrain.py") == 1 and "finetune.py" in card and "https://github.com/)" not in card

    predictions = tmp_path / "dev.predictions"
    result = run_script(SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", finetuned, "--eval_corpus_path", corpus.dev,
                        "--outputs_path", predictions, "--write_scores", "--update_model_card")  # fmt: skip
    questions = corpus.dev.read_text().strip("\n").split("\n")
    lines = predictions.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(lines) == len(questions)
    metrics = json.loads(Path(f"{predictions}.metrics.json").read_text())
    assert f"Correct: {metrics['correct']} out of {len(questions)}: " in result.stdout
    assert (finetuned / "README.md").read_text().count("model-index") == 1

    unlabeled = run_script(SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", finetuned, "--eval_corpus_path",
                           corpus.test, "--outputs_path", tmp_path / "test.predictions")  # fmt: skip
    assert "nothing was scored" in unlabeled.stdout and "Correct" not in unlabeled.stdout
    assert (
        len((tmp_path / "test.predictions").read_text().split("\n")) - 1
        == len(corpus.test.read_text().split("\n")) - 1
    )

    first = questions[0].split("\t")[0]
    asked = run_script(SCRIPTS / "ask.py", "--model_name_or_path", finetuned, "--from_file", corpus.dev, "--limit", 2)
    assert asked.stdout.startswith(f"{first} → {lines[0]}   p=") and asked.stdout.count(" → ") == 2
    assert "Loading weights" not in asked.stderr, asked.stderr  # answers only, no loading bar

    qa = pipeline("birthplace-qa", model=str(finetuned))
    answer = qa(first)
    assert answer["question"] == first and answer["answer"] == lines[0]
    name = first.removeprefix("Where was ").removesuffix(" born?")
    batch = qa([name, questions[1].split("\t")[0]], batch_size=2)
    assert [b["answer"] for b in batch] == lines[:2]
    generated = pipeline("text-generation", model=str(finetuned))(first + "⁇", max_new_tokens=4, do_sample=False)
    assert generated[0]["generated_text"].startswith(first + "⁇")


def test_two_processes_under_accelerate_train_like_one(corpus, tmp_path):
    common = ["--pretrain_corpus_path", corpus.corpus, "--max_epochs", 2, "--batch_size", 16, *TINY_MODEL,
              "--embd_pdrop", 0, "--resid_pdrop", 0, "--attn_pdrop", 0]  # fmt: skip
    run_script(SCRIPTS / "pretrain.py", *common, "--output_dir", tmp_path / "one", env=CPU_ONLY)
    # Without MPI, accelerate's --cpu launcher starts one process; --multi_gpu starts them with torchrun, and
    # with no GPU visible they train together on CPUs (gloo).
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")  # fmt: skip
    run_script(SCRIPTS / "pretrain.py", *common, "--output_dir", tmp_path / "two", launcher=launcher, env=CPU_ONLY)
    one = json.loads((tmp_path / "one" / "train_results.json").read_text())
    two = json.loads((tmp_path / "two" / "train_results.json").read_text())
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert one["global_step"] == two["global_step"]
    # Same global batches, same examples, gradients normalized globally: the same training up to rounding.
    for a, b in zip(one["loss_curve"], two["loss_curve"]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], abs=2e-3)
    weights_one = load_file(tmp_path / "one" / "model.safetensors")
    weights_two = load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.allclose(weights_one[k], weights_two[k], atol=1e-3) for k in weights_one)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


def test_the_one_command_runs_a_whole_recipe_in_two_processes(corpus, tmp_path):
    """scripts/train.py under `accelerate launch --multi_gpu --num_processes 2` (CPUs: gloo): both stages, one
    dev score printed once, the test predictions and results written by the first process."""
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")  # fmt: skip
    result = run_script(SCRIPTS / "train.py", "--recipe", "handout", "--n_layer", 2, "--n_head", 4, "--n_embd", 128,
                        "--pretrain_batch_size", 16, "--finetune_batch_size", 16, "--pretrain_corpus_path", corpus.corpus,
                        "--train_corpus_path", corpus.train, "--eval_corpus_path", corpus.dev, "--test_corpus_path",
                        corpus.test, "--pretrain_max_epochs", 2, "--finetune_max_epochs", 1, "--output_dir",
                        tmp_path / "run", launcher=launcher, env=CPU_ONLY)  # fmt: skip
    assert result.stdout.count("Correct: ") == 1 and result.stdout.count("run configuration: recipe") == 1
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["stages"]["pretrain"]["num_processes"] == 2 and results["dev"]["total"] == 12
    assert len((tmp_path / "run" / "test.predictions").read_text().split("\n")) - 1 == 12


# -- resuming and faults -------------------------------------------------------------------------------------------


def pretrain_in_process(corpus, output_dir, **training):
    training = {"max_epochs": 3, "batch_size": 16, "overwrite_output_dir": False, **training}
    return workflows.pretrain(output_dir, pretrain_corpus_path=corpus.corpus, **TINY_OVERRIDES, **training)


def test_knowledge_recipe_reads_whole_windows_of_any_block_size(corpus, tmp_path):
    # block 64 holds ⌊7·64/8⌋ = 56 characters: the recipe's 112 is capped there, not refused; its 112-character
    # recitation cannot be capped (the question and answer need room too): the error says what to give
    knowledge = dict(pretrain_corpus_path=corpus.corpus, mixed_training_corpus_path=corpus.train, recipe="knowledge")
    with pytest.raises(ValueError, match="block_size 64 cannot hold the knowledge recipe's recitation"):
        workflows.pretrain(tmp_path / "reciting", **knowledge, **TINY_OVERRIDES, max_epochs=1)
    workflows.pretrain(
        tmp_path / "knowledge", **knowledge, **TINY_OVERRIDES, recitation_length=0, max_epochs=1, batch_size=16
    )
    card = (tmp_path / "knowledge" / "README.md").read_text(encoding="utf-8")
    assert "truncated to at least 56 characters, at most 56" in card
    assert "cosine to 10% at the run's last step" in card  # the recipe's schedule ends with the run
    with pytest.raises(ValueError, match="min_truncation_length must lie in 4..56"):
        workflows.pretrain(
            tmp_path / "too-long", pretrain_corpus_path=corpus.corpus, **TINY_OVERRIDES,
            min_truncation_length=57, max_epochs=1,
        )  # fmt: skip


def test_per_device_batch_is_multiplied_by_the_processes(corpus, tmp_path):
    """transformers' --per_device_train_batch_size: the global batch is that many rows per process."""
    _, metrics = workflows.pretrain(
        tmp_path / "run",
        pretrain_corpus_path=corpus.corpus,
        **TINY_OVERRIDES,
        max_epochs=1,
        per_device_train_batch_size=8,
    )
    recorded = json.loads((tmp_path / "run" / "training_args.json").read_text())["arguments"]
    assert recorded["batch_size"] == 8 and recorded["per_device_train_batch_size"] == 8
    assert metrics["global_step"] == -(-len(corpus.corpus.read_text().strip().split("\n")) // 8)


def test_repeated_documents_and_questions_fill_the_epoch(corpus, tmp_path):
    """Knowledge augmentation by repetition: each document K times per epoch (corrupted afresh each time),
    each mixed-in question R times."""
    documents = len(corpus.corpus.read_text().strip().split("\n"))
    questions = len(corpus.train.read_text().strip().split("\n"))
    _, metrics = workflows.pretrain(
        tmp_path / "run", pretrain_corpus_path=corpus.corpus, mixed_training_corpus_path=corpus.train,
        recipe="knowledge", **TINY_OVERRIDES, recitation_length=0, max_epochs=1, batch_size=16, document_repeats=3,
        question_repeats=2,
    )  # fmt: skip
    assert metrics["global_step"] == -(-(3 * documents + 2 * questions) // 16)
    card = (tmp_path / "run" / "README.md").read_text()
    assert "each 3 times per epoch" in card and "each 2 times per epoch" in card


def test_the_card_says_when_several_processes_summed_their_gradients_in_bf16(corpus, tmp_path):
    from hf_knowgpt.utils.model_card import read_card_facts, render_model_card

    workflows.pretrain(tmp_path / "run", pretrain_corpus_path=corpus.corpus, **TINY_OVERRIDES, max_epochs=1,
                       batch_size=16)  # fmt: skip
    facts = read_card_facts(tmp_path / "run")
    assert facts["gradient_reduce_dtype"] == "fp32"

    def processes_line(facts):
        return next(line for line in str(render_model_card(facts)).splitlines() if line.startswith("| precision"))

    assert processes_line(facts).endswith(" / 1 |")
    assert processes_line({**facts, "num_processes": 2}).endswith(" / 2 |")
    assert processes_line({**facts, "num_processes": 2, "gradient_reduce_dtype": "bf16"}).endswith(
        " / 2, gradients summed in bf16 |"
    )


def test_augmented_mixed_training_runs_and_is_described(corpus, tmp_path):
    """Knowledge augmentation by variation: documents as one of K versions, a share as plain text, questions
    in several phrasings; the epoch holds each document and question once, the card says what was read."""
    documents = len(corpus.corpus.read_text().strip().split("\n"))
    questions = len(corpus.train.read_text().strip().split("\n"))
    _, metrics = workflows.pretrain(
        tmp_path / "run", pretrain_corpus_path=corpus.corpus, mixed_training_corpus_path=corpus.train,
        recipe="knowledge", **TINY_OVERRIDES, recitation_length=0, max_epochs=2, batch_size=16, document_variants=4,
        plain_text_fraction=0.25, question_variants=3, document_repeats=2,
    )  # fmt: skip
    assert metrics["global_step"] == 2 * -(-(2 * documents + questions) // 16)
    assert metrics["final_loss"] is not None and math.isfinite(metrics["final_loss"])
    card = (tmp_path / "run" / "README.md").read_text()
    assert "one of up to 4 versions" in card and "0.25 of exposures as plain text" in card
    assert "in one of 3 phrasings" in card
    recorded = json.loads((tmp_path / "run" / "training_args.json").read_text())["run_config"]
    assert (recorded["document_variants"], recorded["plain_text_fraction"], recorded["question_variants"]) == (
        4,
        0.25,
        3,
    )


def test_a_reciting_model_trains_on_recitations_and_answers_after_them(corpus, tmp_path):
    """recitation_length: the mixed-in questions read `question⁇recitation⁇answer⁇` (the person's titled
    corpus line, cut to the length), documents are still read at most max_truncation_length characters, and
    the one command scores the answers that follow the model's recitations."""
    from data_loaders import read_corpus
    from hf_knowgpt.training.run_config import resolve_run_config

    settings = {"model.block_size": 128, "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32,
                "model.recitation_length": 40, "data.max_truncation_length": 56}  # fmt: skip
    config = resolve_run_config("knowledge", settings, output_dirs={"pretrain": tmp_path / "p"})
    assert (config.min_truncation_length, config.longest_truncation) == (56, 56)
    tokenizer = workflows.corpus_tokenizer(corpus.corpus)
    documents = read_corpus(corpus.corpus)
    data, description = workflows.pretraining_data(config, corpus, tokenizer, 128, documents)
    assert "recitation of the first 40 characters" in description and "at most 56" in description
    assert data.documents.documents.shape[1] == 56 and data.documents.static_length == 58
    first = tokenizer.decode(data.questions.input_ids[0][data.questions.input_ids[0] != 0].tolist())
    name = corpus.train.read_text().split("\t")[0][len("Where was ") : -len(" born?")]
    place = corpus.train.read_text().split("\t")[1].split("\n")[0]
    document = next(line for line in documents if line.startswith(name + ". "))
    assert first == f"Where was {name} born?⁇{document[:40]}⁇{place}⁇"

    result = run_script(
        SCRIPTS / "train.py", "--recipe", "knowledge", "--pretrain_corpus_path", corpus.corpus,
        "--train_corpus_path", corpus.train, "--eval_corpus_path", corpus.dev, "--pretrain_max_epochs", "2",
        "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--recitation_length", "40",
        "--max_truncation_length", "56", "--output_dir", tmp_path / "run",
    )  # fmt: skip
    assert "answers after reciting up to 40 characters" in result.stdout and "Correct: " in result.stdout
    card = json.loads((tmp_path / "run" / "pretrained" / "config.json").read_text())
    assert card["recitation_length"] == 40 and card["block_size"] == 192  # the recipe's block


def test_future_token_heads_train_through_the_command_and_are_saved(corpus, tmp_path):
    """--future_tokens / --future_token_spacing: the heads train in the one command, the run says so, the
    checkpoint keeps them, and the command still scores answers (with lm_head alone)."""
    result = run_script(
        SCRIPTS / "train.py", "--recipe", "quickstart", "--pretrain_corpus_path", corpus.corpus,
        "--train_corpus_path", corpus.train, "--eval_corpus_path", corpus.dev, "--pretrain_max_epochs", "1",
        "--n_layer", "1", "--n_embd", "32", "--future_tokens", "2", "--future_token_spacing", "4",
        "--output_dir", tmp_path / "run",
    )  # fmt: skip
    assert "2 heads for tokens further ahead (spacing 4)" in result.stdout and "Correct: " in result.stdout
    saved = tmp_path / "run" / "pretrained"
    config = json.loads((saved / "config.json").read_text())
    assert (config["future_tokens"], config["future_token_spacing"]) == (2, 4)
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert len(model.future_heads) == 2 and model.future_heads[1].weight.abs().sum() > 0


def test_stop_after_steps_runs_the_start_of_the_whole_schedule(corpus, tmp_path):
    _, whole = pretrain_in_process(corpus, tmp_path / "whole", log_every=1)
    _, start = pretrain_in_process(corpus, tmp_path / "start", log_every=1, stop_after_steps=5)
    assert start["global_step"] == 5 < whole["global_step"]
    # the same steps at the same learning rates as the whole run's first five, not a shorter schedule
    assert start["loss_curve"] == whole["loss_curve"][:5]


def test_resume_continues_exactly_where_an_interrupted_run_stopped(corpus, tmp_path, monkeypatch):
    """On the eager path, whose every step the test can interrupt; a GPU's graphed path is resumed by
    test_a_killed_run_leaves_the_last_checkpoint_loadable_and_resumable."""
    model, _ = pretrain_in_process(corpus, tmp_path / "straight", training_path="eager")
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    original_step = KnowGPTTrainer.optimizer_step
    calls = {"n": 0}

    def step_then_signal(self, *args):
        calls["n"] += 1
        if calls["n"] == 5:  # SIGTERM in the middle of the run: checkpoint at the step boundary, then stop
            signal.raise_signal(signal.SIGTERM)
        return original_step(self, *args)

    monkeypatch.setattr(KnowGPTTrainer, "optimizer_step", step_then_signal)  # the eager path's step
    with pytest.raises(workflows.TrainingInterrupted):
        pretrain_in_process(corpus, tmp_path / "resumed", training_path="eager")
    monkeypatch.setattr(KnowGPTTrainer, "optimizer_step", original_step)
    checkpoints = list_checkpoints(tmp_path / "resumed")
    assert [c.name for c in checkpoints] == ["checkpoint-5"]
    assert not (tmp_path / "resumed" / "config.json").exists()  # no final model from an interrupted run

    model, metrics = pretrain_in_process(
        corpus, tmp_path / "resumed", resume_from_checkpoint="latest", training_path="eager"
    )
    assert metrics["global_step"] == 12
    for name, value in model.state_dict().items():
        assert torch.equal(value, straight[name]), name


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),  # what the operating system says
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 165568 vs 165460"),  # torch.save
    ],
)
def test_a_full_disk_while_a_checkpoint_is_staged_is_a_user_error(corpus, tmp_path, monkeypatch, failure):
    """The disk fills while checkpoint-N is staged: an OutputError naming the folder and the incomplete copy,
    which stays aside (the last whole checkpoint is untouched); faults with space left keep their traceback."""

    def fill_the_disk(self, directory):
        (directory / "model.safetensors").write_bytes(b"part of the weights")
        raise failure

    monkeypatch.setattr(KnowGPTTrainer, "_save_model_files", fill_the_disk)
    free = {"bytes": 0}
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda folder: SimpleNamespace(free=free["bytes"]))
    with pytest.raises(OutputError) as raised:
        pretrain_in_process(corpus, tmp_path / "full", checkpointing_steps="epoch")
    assert raised.value.line() == (
        f"{tmp_path / 'full'}: no space left on its disk while writing checkpoint-4 (free some space there or "
        "give another --output_dir; the incomplete copy is left in .staging-checkpoint-4)"
    )
    assert (tmp_path / "full" / ".staging-checkpoint-4" / "model.safetensors").is_file()
    assert list_checkpoints(tmp_path / "full") == []
    if isinstance(failure, RuntimeError):  # the same failure with space left is a fault: its own traceback
        free["bytes"] = 10 * checkpoints.FULL_DISK_BYTES
        with pytest.raises(RuntimeError, match="unexpected pos"):
            pretrain_in_process(corpus, tmp_path / "fault", checkpointing_steps="epoch")


def test_a_killed_run_leaves_the_last_checkpoint_loadable_and_resumable(corpus, tmp_path):
    output_dir = tmp_path / "killed"
    args = [SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", output_dir,
            "--max_epochs", 40, "--batch_size", 16, *TINY_MODEL, "--checkpointing_steps", 2]  # fmt: skip
    process = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and len(list_checkpoints(output_dir)) < 2:
        time.sleep(0.05)
    process.kill()  # SIGKILL, possibly in the middle of writing a checkpoint
    process.wait()
    checkpoints = list_checkpoints(output_dir)
    assert checkpoints, "no checkpoint was written before the kill"
    latest = checkpoints[-1]
    state = validate_checkpoint(latest)
    assert state["global_step"] == int(latest.name.split("-")[1])
    model = AutoModelForCausalLM.from_pretrained(latest)
    assert model.config.n_embd == 32

    resumed = run_script(*args[:-1], 1000, "--resume_from_checkpoint", "latest")  # how often to save is not the run
    assert f"Resumed from {latest}" in resumed.stdout
    assert json.loads((output_dir / "train_results.json").read_text())["global_step"] == 160  # 40 epochs of 4
    other = [*args[:6], 100, *args[7:]]  # another --max_epochs is another run: refused
    refused = run_script(*other, "--resume_from_checkpoint", "latest", check=False)
    assert refused.returncode != 0 and "holds a different run" in refused.stderr


def test_corrupt_or_missing_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        validate_checkpoint(tmp_path / "nowhere")
    broken = tmp_path / "checkpoint-7"
    broken.mkdir()
    (broken / "trainer_state.json").write_text("{not json")
    (broken / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="checkpoint-7: incomplete or corrupt checkpoint: missing model.safetensors"):
        validate_checkpoint(broken)
    (broken / "model.safetensors").write_bytes(b"")
    (broken / "accelerate_state").mkdir()
    with pytest.raises(ValueError, match="checkpoint-7/model.safetensors: not a readable safetensors file"):
        validate_checkpoint(broken)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="trainer_state.json: unreadable"):
        validate_checkpoint(broken)


def test_an_output_dir_holding_a_run_is_not_overwritten(corpus, tmp_path):
    output_dir = tmp_path / "run"
    pretrain_in_process(corpus, output_dir, max_epochs=1)
    weights = (output_dir / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        pretrain_in_process(corpus, output_dir, max_epochs=1, learning_rate=1e-3)
    with pytest.raises(ValueError, match="holds a different run"):
        pretrain_in_process(corpus, output_dir, max_epochs=1, learning_rate=1e-3, resume_from_checkpoint="latest")
    assert (output_dir / "model.safetensors").read_bytes() == weights
    pretrain_in_process(corpus, output_dir, max_epochs=1, learning_rate=1e-3, overwrite_output_dir=True)
    assert (output_dir / "model.safetensors").read_bytes() != weights


# -- scoring -------------------------------------------------------------------------------------------------------


def handout_evaluate_places(filepath, predicted_places):
    """The handouts' utils.evaluate_places, restated."""
    with open(filepath, encoding="utf-8") as fin:
        lines = [x.strip().split("\t") for x in fin]
    true_places = [x[1] for x in lines]
    return len(true_places), sum(t == p for t, p in zip(true_places, predicted_places))


def test_metric_counts_exactly_like_the_handouts(tmp_path):
    tsv = tmp_path / "gold.tsv"
    tsv.write_text(
        "Where was A born?\tLondon\nWhere was B born?\tSão Paulo \nWhere was C born?\tParis\nWhere was D born?\tRome\n"
    )
    predictions = ["London", "São Paulo", "paris", "Rome "]
    total, correct = handout_evaluate_places(tsv, predictions)
    metric = load_metric().compute(predictions=predictions, references=["London", "São Paulo", "Paris", "Rome"])
    assert (metric["correct"], metric["total"]) == (correct, total) == (2, 4)
    assert metric["accuracy"] == 0.5
    assert handout_accuracy(["London", "Paris"], ["London", "Lyon"]) == (1, 2)


@needs_data
def test_london_baseline_on_dev_is_five_percent(tmp_path):
    result = run_script(
        SCRIPTS / "london_baseline.py", "--eval_corpus_path", DEV_TSV, "--outputs_path", tmp_path / "london.txt"
    )
    assert "Correct: 25 out of 500: 5.0%" in result.stdout
    assert (tmp_path / "london.txt").read_text().split("\n")[:2] == ["London", "London"]
    assert json.loads((tmp_path / "london.txt.metrics.json").read_text())["accuracy"] == 0.05


# -- the handouts' command line ---------------------------------------------------------------------------------------


def test_handout_run_py_commands(corpus, tmp_path):
    pre, fin = tmp_path / "vanilla.pretrain.params", tmp_path / "vanilla.finetune.params"
    run_script(
        SCRIPTS / "run.py", "pretrain", "vanilla", corpus.corpus, "--writing_params_path", pre, "--max_epochs", 1
    )
    run_script(SCRIPTS / "run.py", "finetune", "vanilla", corpus.corpus, "--reading_params_path", pre,
               "--writing_params_path", fin, "--finetune_corpus_path", corpus.train, "--max_epochs", 1)  # fmt: skip
    result = run_script(SCRIPTS / "run.py", "evaluate", "vanilla", corpus.corpus, "--reading_params_path", fin,
                        "--eval_corpus_path", corpus.dev, "--outputs_path", tmp_path / "dev.predictions")  # fmt: skip
    assert "Correct:" in result.stdout and "out of 12:" in result.stdout
    assert json.loads((fin / "config.json").read_text())["n_embd"] == 256  # the handouts' model
    assert json.loads((fin / "train_results.json").read_text())["global_step"] == 1  # 1 epoch of 36 at batch 256


# -- the Hub ----------------------------------------------------------------------------------------------------------


class HubStandIn(BaseHTTPRequestHandler):
    """Just enough of the Hub API for create_repo and upload_folder; records what arrives."""

    received: dict = {}
    requests: list = []

    def _reply(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).requests.append(self.path)
        endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            request = json.loads(body)
            return self._reply(200, {"url": f"{endpoint}/{request.get('organization', 'user')}/{request['name']}"})
        if self.path == "/api/validate-yaml":
            return self._reply(200, {"warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self._reply(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    type(self).received[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self._reply(200, {"commitUrl": f"{endpoint}/user/model/commit/abc", "commitOid": "a" * 40})
        return self._reply(404, {"error": f"not in the stand-in: {self.path}"})

    def log_message(self, *args):
        pass


def test_push_to_hub_uploads_config_weights_tokenizer_and_card(corpus, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        run_script(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", tmp_path / "model",
                   "--max_epochs", 1, *TINY_MODEL, "--checkpointing_steps", "epoch", "--push_to_hub",
                   "--hub_model_id", "user/knowgpt-tiny", "--hub_token", "hf_test",
                   env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"})  # fmt: skip
    finally:
        server.shutdown()
    received = HubStandIn.received
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
                 "modeling_knowgpt.py"):  # fmt: skip
        assert name in received, f"{name} not uploaded; got {sorted(received)}"
    assert received["model.safetensors"] == (tmp_path / "model" / "model.safetensors").read_bytes()
    assert not any(path.startswith("checkpoint-") for path in received)
    assert "/api/repos/create" in HubStandIn.requests


def test_a_plain_progress_log_prints_the_last_line_once(capsys):
    """Loss readings reach the host after their steps (asynchronously on a GPU): those still arriving after the
    last step update the final line instead of each printing one."""
    from hf_knowgpt.training.progress import progress_bar

    progress = progress_bar(10, 0, disable=False)  # pytest's captured stderr is no terminal: plain lines
    progress.update(10)
    for loss in ("0.3000", "0.2000", "0.1000"):
        progress.set_postfix(loss=loss)
    progress.close()
    assert capsys.readouterr().out.splitlines() == ["training: step 10/10, loss 0.1000"]


def test_the_quickstart_recipe_recites_and_its_comparison_trains_without_pretraining(corpus, tmp_path):
    """The README's main job (`scripts/quickstart.py`, one process), one epoch each: the quickstart recipe mixes
    questions (with recitations) into pretraining and answers from its pretrained checkpoint; without
    pretraining it trains on the questions alone, from scratch; then the pipeline answers dev questions."""
    files = ("--pretrain_corpus_path", corpus.corpus, "--train_corpus_path", corpus.train, "--eval_corpus_path",
             corpus.dev)  # fmt: skip
    out = tmp_path / "quickstart"
    result = run_script(SCRIPTS / "quickstart.py", *files, "--pretrain_max_epochs", 1, "--finetune_max_epochs", 1,
                        "--output_dir", out)  # fmt: skip
    mixed, rest = result.stdout.split("== without pretraining")
    scratch, asked = rest.split('== asking the pretrained model through pipeline("birthplace-qa")')
    assert "answers after reciting up to 96 characters" in mixed and "Correct: " in mixed
    assert (out / "pretrained").is_dir() and not (out / "finetuned").exists()
    assert "Correct: " in scratch and not (tmp_path / "quickstart-scratch" / "pretrained").exists()
    config = json.loads((tmp_path / "quickstart-scratch" / "finetuned" / "config.json").read_text())
    assert config["recitation_length"] == 96 and config["attention_type"] == "rope"
    dev_questions = [line.split("\t")[0] for line in Path(corpus.dev).read_text().splitlines()[:5]]
    answers = [line for line in asked.splitlines() if "→" in line]
    assert [line.split(" → ")[0] for line in answers] == dev_questions
