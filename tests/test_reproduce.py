"""CPU smoke test of the reproduction script: each row is the one documented command (tiny sizes, one epoch)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, write_cs224n_named_synthetic

from hf_knowgpt.training import workflows

# block 64 cannot hold the knowledge recipe's 112-character recitation: tiny models answer at once
TINY = (
    "--pretrain_max_epochs 1 --finetune_max_epochs 1 --n_layer 2 --n_head 2 --n_embd 32 --block_size 64 "
    "--recitation_length 0"
)


def test_reproduction_script_runs_the_one_command_for_every_kind_of_variant(tmp_path):
    data = write_cs224n_named_synthetic(tmp_path, num_people=40)
    results = tmp_path / "results.json"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reproduce.py"), "--data_dir", str(data),
               "--variants", "vanilla-nopretrain,vanilla,knowledge", "--seeds", "0", "--flags", TINY,
               "--curve_every", "1", "--output_dir", str(tmp_path / "runs"), "--results", str(results)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(results.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["vanilla-nopretrain", "vanilla", "knowledge"]
    assert all(r["total"] == 8 and r["process_s"] > 0 for r in rows)  # the dev questions, scored once each
    assert all("scripts/train.py" in r["command"] and "--mixed_precision no" in r["command"] for r in rows)
    # each command was printed before it ran, and it printed the run's configuration and the handouts' line
    assert result.stdout.count("+ ") >= 3 and result.stdout.count("run configuration: recipe") >= 3
    assert "Correct: " in result.stdout
    knowledge = rows[2]
    assert knowledge["attention_type"] == "rope"
    run = tmp_path / "runs" / "knowledge-seed0" / "run"
    card = (run / "pretrained" / "README.md").read_text()
    assert "mixed with the 24 questions of `birth_places_train.tsv`" in card
    assert "truncated to at least 56 characters" in card  # the recipe's 112, capped at ⌊7·64/8⌋
    # the knowledge recipe has no finetuning stage: its pretrained checkpoint answers
    assert knowledge["finetune_s"] == 0.0 and not (run / "finetuned").exists()
    assert [p["epoch"] for p in rows[1]["accuracy_by_epoch"]] == [1]
    test_predictions = (tmp_path / "runs" / "vanilla-seed0" / "run" / "test.predictions").read_text().split("\n")
    assert len(test_predictions) - 1 == 8
    assert "vanilla-nopretrain" in result.stdout.split("exact match on birth_dev.tsv")[1]

    variant = "knowledge+min_truncation_length=40+do_finetune=on+finetune_recipe=handout"
    heldout = subprocess.run(
        command[: command.index("--variants")]
        + ["--variants", variant, "--seeds", "0", "--flags", TINY, "--heldout", "6", "--output_dir", str(tmp_path / "held")],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    assert heldout.returncode == 0, heldout.stdout[-3000:] + heldout.stderr[-3000:]
    assert "the last 6 training questions (held out)" in heldout.stdout
    assert '"total": 6' in heldout.stdout
    assert '"pretrained_accuracy"' in heldout.stdout  # the finetuning stage's worth, on held-out questions
    assert "--min_truncation_length 40 --do_finetune --finetune_recipe handout" in heldout.stdout
    card = (tmp_path / "held" / f"{variant}-seed0" / "run" / "pretrained" / "README.md").read_text()
    assert "truncated to at least 40 characters" in card


def test_finetuning_a_recipe_without_a_finetuning_stage_is_refused(tmp_path):
    with pytest.raises(ValueError, match="recipe 'knowledge' has no finetuning stage"):
        workflows.finetune(tmp_path / "out", model_name_or_path=tmp_path, recipe="knowledge")


def test_rows_run_side_by_side_on_listed_gpus_with_every_augmentation(tmp_path):
    """--gpus: the rows' one-GPU commands run concurrently, each worker naming its GPU; the table keeps the
    rows' order. The variants go through every knowledge-augmentation flag of the one command."""
    data = write_cs224n_named_synthetic(tmp_path, num_people=40)
    results = tmp_path / "results.json"
    variants = "knowledge+document_variants=3+plain_text_fraction=0.2,knowledge+question_variants=4+question_repeats=2"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reproduce.py"), "--data_dir", str(data),
               "--variants", variants, "--seeds", "0", "--flags", TINY, "--heldout", "6", "--gpus", "0,1",
               "--output_dir", str(tmp_path / "runs"), "--results", str(results)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(results.read_text())["rows"]
    assert [r["variant"] for r in rows] == variants.split(",")
    assert all(r["total"] == 6 for r in rows)
    assert "[GPU 0] + " in result.stdout and "[GPU 1] + " in result.stdout
    assert "--document_variants 3 --plain_text_fraction 0.2" in rows[0]["command"]
    first = (tmp_path / "runs" / f"{rows[0]['variant']}-seed0" / "run" / "pretrained" / "README.md").read_text()
    second = (tmp_path / "runs" / f"{rows[1]['variant']}-seed0" / "run" / "pretrained" / "README.md").read_text()
    assert "one of up to 3 versions" in first and "0.2 of exposures as plain text" in first
    assert "in one of 4 phrasings" in second and "each 2 times per epoch" in second


def test_a_setting_given_by_a_variant_and_by_the_shared_flags_is_refused(tmp_path):
    """`--flags` come after a variant's options, so a setting in both would silently take the shared value:
    the row would run something else than its name says."""
    data = write_cs224n_named_synthetic(tmp_path, num_people=40)
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reproduce.py"), "--data_dir", str(data),
               "--variants", "knowledge+n_layer=4+mixed_training=off", "--flags", "--n_layer 2 --mixed_training",
               "--output_dir", str(tmp_path / "runs")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode != 0 and not (tmp_path / "runs").exists()
    assert "'knowledge+n_layer=4+mixed_training=off' and --flags both set mixed_training, n_layer" in result.stderr
