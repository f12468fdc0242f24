"""Answer scores, abstention, and the knowledge report."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, tiny_config
from transformers import pipeline

import hf_knowgpt  # noqa: F401
from hf_knowgpt import KnowGPTForCausalLM, KnowGPTTokenizerFast
from hf_knowgpt.analysis.knowledge_metrics import (
    apply_threshold,
    area_under_accuracy_coverage,
    auroc,
    reliability,
    selective_accuracy,
    threshold_for_accuracy,
)
from hf_knowgpt.qa import predict_birthplaces

CORPUS = "Where was born?⁇ Ada Lovelace Alan Turing London Paris Rome abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = KnowGPTTokenizerFast.from_corpus(CORPUS)
    torch.manual_seed(3)
    model = KnowGPTForCausalLM(tiny_config(vocab_size=len(tokenizer), block_size=64, n_embd=32, n_head=4)).eval()
    with torch.no_grad():  # raise the closing ⁇'s logit by about 1.6, so answers end at different lengths
        model.transformer.ln_f.bias.fill_(0.5)
        model.lm_head.weight[1] += 0.1
    return model, tokenizer


@torch.no_grad()
def independent_score(model, tokenizer, question, max_new_tokens):
    """Greedy decoding without the cache, one full forward per character; product of softmax probabilities."""
    ids = tokenizer(question + "⁇")["input_ids"]
    probability, generated = 1.0, []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids + generated]), use_cache=False).logits[0, -1]
        probabilities = torch.softmax(logits.double(), dim=-1)
        token = int(probabilities.argmax())
        probability *= float(probabilities[token])
        generated.append(token)
        if token == 1:  # the closing ⁇ is part of the scored answer
            break
    return probability, generated


@pytest.mark.parametrize("max_new_tokens", [4, 12])
def test_score_is_the_product_of_the_greedy_characters_probabilities(model_and_tokenizer, max_new_tokens):
    model, tokenizer = model_and_tokenizer
    questions = ["Where was Ada Lovelace born?", "Where was Alan Turing born?", "Where was Ada born?"]
    predictions = predict_birthplaces(model, tokenizer, questions, batch_size=2, max_new_tokens=max_new_tokens)
    for question, prediction in zip(questions, predictions):
        expected, generated = independent_score(model, tokenizer, question, max_new_tokens)
        closed = 1 in generated
        assert prediction.closed == closed
        assert prediction.answer == tokenizer.decode(generated[: generated.index(1)] if closed else generated)
        assert math.isclose(prediction.score, expected, rel_tol=1e-4)
        assert math.isclose(prediction.log_probability, math.log(expected), rel_tol=1e-4, abs_tol=1e-6)


def test_pipeline_abstains_below_the_threshold_and_keeps_the_best_guess(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    qa = pipeline("birthplace-qa", model=str(tmp_path))
    questions = ["Ada Lovelace", "Alan Turing", "Where was Ada born?"]
    plain = qa(questions)
    scores = sorted(r["score"] for r in plain)
    threshold = (scores[0] + scores[1]) / 2
    results = qa(questions, threshold=threshold)
    for before, after in zip(plain, results):
        assert after["score"] == before["score"]
        if before["score"] < threshold:
            assert after["abstained"] and after["answer"] is None and after["best_guess"] == before["answer"]
        else:
            assert not after["abstained"] and after["answer"] == before["answer"]
    assert sum(r["abstained"] for r in results) == 1
    with pytest.raises(ValueError, match="threshold"):
        qa("Ada Lovelace", threshold=1.5)


def test_selective_accuracy_threshold_calibration_and_auroc_on_known_cases():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    correct = np.array([1, 1, 0, 1, 0, 0])
    coverage, accuracy = selective_accuracy(scores, correct)
    assert np.allclose(coverage, [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1])
    assert np.allclose(accuracy, [1, 1, 2 / 3, 3 / 4, 3 / 5, 1 / 2])
    assert area_under_accuracy_coverage(scores, correct) == pytest.approx(np.mean(accuracy))
    threshold = threshold_for_accuracy(scores, correct, 0.75)
    assert threshold.reached and threshold.value == 0.6 and threshold.coverage == pytest.approx(4 / 6)
    assert apply_threshold(scores, correct, 0.6) == (pytest.approx(4 / 6), 0.75)
    assert not threshold_for_accuracy(scores, np.zeros(6), 0.5).reached
    bins, ece = reliability(np.array([0.95, 0.95, 0.15, 0.15]), np.array([1, 1, 0, 0]))
    assert ece == pytest.approx(0.5 * 0.05 + 0.5 * 0.15)
    assert [b.count for b in bins if b.count] == [2, 2]
    assert auroc([0.9, 0.8], [0.1, 0.2]) == 1.0 and auroc([0.5], [0.5]) == 0.5 and auroc([0.1], [0.9]) == 0.0


def test_knowledge_report_end_to_end_on_the_synthetic_corpus(tmp_path):
    from data_loaders import write_synthetic_corpus

    files = write_synthetic_corpus(tmp_path / "synthetic", num_people=60, seed=0)
    model_dir = tmp_path / "model"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "finetune.py"), "--pretrain_corpus_path", str(files.corpus),
         "--finetune_corpus_path", str(files.train), "--output_dir", str(model_dir), "--max_epochs", "2",
         "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64"],
        check=True, capture_output=True, cwd=REPO_ROOT,
    )  # fmt: skip
    calibration = tmp_path / "calibration.tsv"
    calibration.write_text("".join(files.train.read_text().splitlines(keepends=True)[-10:]))
    report = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "analyze_knowledge.py"), "--model_name_or_path", str(model_dir),
         "--eval_corpus_path", str(files.dev), "--calibration_corpus_path", str(calibration),
         "--pretrain_corpus_path", str(files.corpus), "--train_corpus_path", str(files.train),
         "--output_dir", str(report), "--num_unseen", "40"],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["eval_questions"] == 12 and summary["unseen_people"] == 40
    assert 0.0 <= summary["auroc_seen_vs_unseen"] <= 1.0 and 0.0 <= summary["expected_calibration_error"] <= 1.0
    text = (report / "report.md").read_text()
    for plot in ("accuracy_coverage.png", "reliability.png", "seen_unseen_scores.png", "accuracy_breakdowns.png"):
        assert (report / plot).stat().st_size > 1000 and plot in text
    offsets = summary["breakdowns"]["character offset of the place in the biography"]
    assert sum(count for _, count, _ in offsets) == 12  # every dev person in one bucket
    assert "made up" in text and "| name style |" in text
    corpus_text = files.corpus.read_text()
    unseen_names = [line.split("Where was ")[1].split(" born?")[0] for line in text.splitlines() if "made up" in line]
    assert unseen_names and not any(name in corpus_text for name in unseen_names)
    probe = summary["recitation_probe"]
    assert probe["window"] == 64 and 0 < probe["people"] <= 12 and "## Stored, and given back?" in text
    assert sum(probe[k] for k in ("stored_and_answered", "stored_not_answered", "not_stored_answered",
                                  "not_stored_not_answered")) == probe["people"]  # fmt: skip


def test_breakdowns_bucket_people_by_offset_shared_place_and_length():
    from hf_knowgpt.analysis.knowledge_metrics import knowledge_breakdowns

    corpus = [
        "Ann Lee was born in Paris and lived in Rome.",  # Paris at 20
        "Bob Ray, a painter, grew up far away in the city of Lyon, where he studied until 1900 and later taught.",
        "Cal Doe is a writer.",  # the place is absent
    ]
    names, places, correct = ["Ann Lee", "Bob Ray", "Cal Doe"], ["Paris", "Lyon", "Oslo"], [1, 0, 1]
    train_places = ["Paris"] * 7 + ["Lyon"]
    offset, shared, length = knowledge_breakdowns(names, places, correct, corpus, train_places)
    assert dict((label, (n, a)) for label, n, a in offset.buckets if n) == {
        "absent": (1, 1.0), "0–24": (1, 1.0), "50–74": (1, 0.0),
    }  # fmt: skip
    assert dict((label, n) for label, n, _ in shared.buckets if n) == {"0": 1, "1": 1, "6–20": 1}
    assert dict((label, n) for label, n, _ in length.buckets if n) == {"<75": 2, "100–124": 1}


def test_recitation_probe_counts_stored_and_answered_people():
    from hf_knowgpt.analysis.knowledge_metrics import recitation_probe, recitation_prompts

    corpus = [
        "Ann Lee. Ann Lee was born in Paris and lived in Rome.",
        "Bob Ray. Bob Ray, a painter, was born in Lyon.",
        "Cal Doe. Cal Doe is a writer.",  # the place is absent: not probed
        "Dan Fox. Dan Fox was born in Oslo.",
    ]
    names, places = ["Ann Lee", "Bob Ray", "Cal Doe", "Dan Fox"], ["Paris", "Lyon", "Oslo", "Oslo"]
    probes = recitation_prompts(names, places, corpus, window=50)
    assert [(index, prompt) for index, prompt, _, _ in probes] == [(0, "Ann Lee"), (1, "Bob Ray"), (3, "Dan Fox")]
    assert probes[0][2] == corpus[0][:50]
    recitations = [
        corpus[0][len("Ann Lee") :],  # recited exactly (beyond the window too)
        ". Bob Ray was born in Lyon.",  # the place, not the words
        ". Dan Fox was born in Bergen.",  # not stored
    ]
    probe = recitation_probe(probes, recitations, correct=[0, 1, 1, 1], window=50)
    assert (probe.people, probe.stored, probe.recited_exactly) == (3, 2, 1)
    assert probe.table == {(True, False): 1, (True, True): 1, (False, True): 1}


def test_a_line_titled_with_the_name_is_the_persons_biography():
    from data_loaders import person_documents

    corpus = [
        "Ann Lee Smith. Ann Lee Smith met Ann Lee in Paris.",
        "Ann Lee. Ann Lee was born in Rome.",
        "Bo was here.",
    ]
    assert person_documents(["Ann Lee", "Bo", "Cy"], corpus) == [corpus[1], corpus[2], None]


def test_continuations_have_their_own_length_and_match_one_at_a_time(model_and_tokenizer):
    """Each prompt gets the characters it asked for, whatever the other prompts' lengths (a long prompt must
    not cut a short one's room in the block), and the batch gives what one prompt alone gives."""
    from hf_knowgpt.qa import greedy_continuations

    model, tokenizer = model_and_tokenizer
    prompts = ["Wh", "Where was Alford Bradington", "Where", "Wh"]
    wanted = [60, 20, 55, 5]
    together = greedy_continuations(model, tokenizer, prompts, wanted, batch_size=3)
    assert [len(text) for text in together] == [min(w, 64 - len(p)) for p, w in zip(prompts, wanted)]
    for prompt, count, text in zip(prompts, wanted, together):
        assert greedy_continuations(model, tokenizer, [prompt], count) == [text]


@torch.no_grad()
def independent_recitation_and_answer(model, tokenizer, question, steps):
    """Greedy decoding without the cache up to the second ⁇: (recitation ids, answer ids, probability of all
    written up to the answer's closing ⁇)."""
    ids = tokenizer(question + "⁇")["input_ids"]
    generated, probabilities = [], []
    for _ in range(steps):
        logits = model(torch.tensor([ids + generated]), use_cache=False).logits[0, -1]
        distribution = torch.softmax(logits.double(), dim=-1)
        token = int(distribution.argmax())
        generated.append(token)
        probabilities.append(float(distribution[token]))
        if generated.count(1) == 2:
            break
    first = generated.index(1) + 1 if 1 in generated else len(generated)
    end = generated.index(1, first) + 1 if 1 in generated[first:] else len(generated)
    return generated[: max(first - 1, 0)], generated[first:end], math.prod(probabilities[:end])


def test_a_reciting_model_answers_after_its_recitation(model_and_tokenizer):
    """recitation_length > 0: the model writes recitation⁇answer⁇; the answer is what follows the recitation,
    scored with the recitation (the probability of all it wrote), and the recitation comes back beside it
    (also from the pipeline)."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(3)
    reciting = KnowGPTForCausalLM(tiny_config(vocab_size=len(tokenizer), block_size=64, n_embd=32, n_head=4,
                                              recitation_length=8)).eval()  # fmt: skip
    with torch.no_grad():  # a closing ⁇ just likely enough that the three questions end in three ways
        reciting.transformer.ln_f.bias.fill_(0.5)
        reciting.lm_head.weight[1] += 0.015
    questions = ["Where was Ada Lovelace born?", "Where was Alan Turing born?", "Where was Ada born?"]
    predictions = predict_birthplaces(reciting, tokenizer, questions, batch_size=2, max_new_tokens=12)
    for question, prediction in zip(questions, predictions):
        recited, answer, probability = independent_recitation_and_answer(reciting, tokenizer, question, 8 + 1 + 12)
        assert prediction.recitation == tokenizer.decode(recited)
        closed = bool(answer) and answer[-1] == 1
        assert prediction.closed == closed
        assert prediction.answer == tokenizer.decode(answer[:-1] if closed else answer)
        assert math.isclose(prediction.score, probability, rel_tol=1e-4)
    # a recitation and a closed answer; a recitation and an answer still open; a recitation never closed
    assert [(bool(p.recitation), p.closed) for p in predictions] == [(True, True), (True, False), (True, False)]
    assert predictions[0].answer and predictions[2].answer == ""
    qa = pipeline("birthplace-qa", model=reciting, tokenizer=tokenizer)
    result = qa(questions[0])
    assert result["recitation"] == predictions[0].recitation and result["answer"] == predictions[0].answer
    assert "recitation" not in pipeline("birthplace-qa", model=model, tokenizer=tokenizer)(questions[0])
