"""CPU smoke test of the reproduction script and the knowledge preset (tiny corpus, one epoch)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from data_loaders import write_synthetic_corpus
from hf_knowgpt import workflows


def test_reproduction_script_runs_every_kind_of_variant(tmp_path):
    files = write_synthetic_corpus(tmp_path / "synthetic", num_people=40, seed=0)
    data = tmp_path / "data"
    data.mkdir()
    for source, name in ((files.corpus, "wiki.txt"), (files.train, "birth_places_train.tsv"),
                         (files.dev, "birth_dev.tsv"), (files.test, "birth_test_inputs.tsv")):  # fmt: skip
        (data / name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    results = tmp_path / "results.json"
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "reproduce.py"), "--data_dir", str(data),
               "--variants", "vanilla-nopretrain,vanilla,knowledge", "--seeds", "0", "--max_epochs", "1",
               "--curve_every", "1", "--output_dir", str(tmp_path / "runs"), "--results", str(results)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(results.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["vanilla-nopretrain", "vanilla", "knowledge"]
    assert all(r["total"] == 8 for r in rows)  # the dev questions, scored once each
    knowledge = rows[2]
    assert knowledge["attention_type"] == "rope"
    card = (tmp_path / "runs" / "knowledge-seed0" / "pretrained" / "README.md").read_text()
    assert "mixed with the 24 questions of `birth_places_train.tsv`" in card
    assert "truncated to at least 112 characters" in card
    # the knowledge recipe has no finetuning stage: its pretrained checkpoint answers
    assert knowledge["finetune_s"] == 0.0 and not (tmp_path / "runs" / "knowledge-seed0" / "finetuned").exists()
    assert [p["epoch"] for p in rows[1]["accuracy_by_epoch"]] == [1]
    test_predictions = (tmp_path / "runs" / "vanilla-seed0" / "test.predictions").read_text().split("\n")
    assert len(test_predictions) - 1 == 8
    assert "vanilla-nopretrain" in result.stdout.split("exact match on birth_dev.tsv")[1]

    heldout = subprocess.run(
        command[:command.index("--variants")] + ["--variants", "knowledge+min_trunc=100+finetune=handout", "--seeds", "0", "--max_epochs", "1",
                                                   "--heldout", "6", "--output_dir", str(tmp_path / "held")],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    assert heldout.returncode == 0, heldout.stderr[-3000:]
    assert "the last 6 training questions (held out)" in heldout.stdout
    assert '"total": 6' in heldout.stdout
    assert '"pretrained_accuracy"' in heldout.stdout  # the finetuning stage's worth, on held-out questions
    card = (
        tmp_path / "held" / "knowledge+min_trunc=100+finetune=handout-seed0" / "pretrained" / "README.md"
    ).read_text()
    assert "truncated to at least 100 characters" in card


def test_finetuning_a_recipe_without_a_finetuning_stage_is_refused(tmp_path):
    with pytest.raises(ValueError, match="recipe 'knowledge' has no finetuning stage"):
        workflows.finetune(
            tmp_path / "out", model_name_or_path=tmp_path, recipe="knowledge", pretrain_corpus_path=None
        )
