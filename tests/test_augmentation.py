"""Knowledge augmentation: document and question variants, drawn afresh at every exposure, and plain-text
exposures; the host's plan and the device's batch agree on every example."""

import random
from collections import Counter

import pytest
import torch
from conftest import WIKI, needs_data

from data_loaders import (
    MASK_ID,
    PAD_ID,
    QUESTION_PHRASINGS,
    document_variants,
    encode_birthplace_examples,
    encode_document_variants,
    encode_question_variants,
    generate_people,
    question_variants,
    read_corpus,
    split_phrases,
    split_title,
)
from hf_knowgpt import KnowGPTTokenizerFast
from hf_knowgpt.training.data import FinetuningData, MixedData, PretrainingData, VariantRows

BLOCK = 128
STUDER = (
    "Jacob Henry Studer. Jacob Henry Studer (26 February 1840 Columbus, Ohio - 2 August 1904 New York City) was a "
    "printer, lithographer, painter, and popular ornithologist active in Columbus, Ohio from the 1860s to the 1880s ."
)


def words(text: str) -> Counter:
    return Counter(text.split())


def test_a_titled_document_keeps_its_title_in_front_and_its_words():
    title, body = split_title(STUDER)
    assert title == "Jacob Henry Studer. "
    phrases = split_phrases(body)
    assert phrases[0] == "Jacob Henry Studer" and phrases[1].startswith("(26 February")
    assert " ".join(phrases) == body
    variants = document_variants(STUDER, 6, random.Random(0))
    assert variants[0] == STUDER and len(set(variants)) == 6
    for variant in variants[1:]:
        assert variant.startswith(title)
        assert words(variant) == words(STUDER)  # reordered, nothing added or lost


def test_documents_with_few_orders_get_fewer_variants():
    one_phrase = "Ada Smith. Ada Smith was born in Leeds ."
    assert document_variants(one_phrase, 8, random.Random(0)) == [one_phrase]
    two_phrases = "Born in Berlin, Friedolf Bauhauser was an architect."  # untitled: the phrases move
    assert document_variants(two_phrases, 8, random.Random(0)) == [
        two_phrases,
        "Friedolf Bauhauser was an architect. Born in Berlin,",
    ]


@needs_data
def test_most_wiki_documents_have_a_title_and_several_phrases():
    documents = read_corpus(WIKI)
    titled = sum(bool(split_title(document)[0]) for document in documents)
    several = sum(len(split_phrases(split_title(document)[1])) > 1 for document in documents)
    assert titled / len(documents) > 0.95 and several / len(documents) > 0.9


def test_question_variants_ask_for_the_same_person_in_the_evaluation_form_first():
    questions = question_variants("Ada Smith", len(QUESTION_PHRASINGS))
    assert questions[0] == "Where was Ada Smith born?"
    assert len(set(questions)) == len(QUESTION_PHRASINGS) and all("Ada Smith" in q for q in questions)
    with pytest.raises(ValueError, match="1..8"):
        question_variants("Ada Smith", 9)


@pytest.fixture
def people():
    return generate_people(24, seed=3)


@pytest.fixture
def tokenizer(people):
    return KnowGPTTokenizerFast.from_corpus("\n".join(p.sentence for p in people) + "".join(QUESTION_PHRASINGS))


def test_variant_rows_pick_each_variant_by_its_uniform():
    rows = VariantRows.consecutive([1, 3, 2]).repeat(2)
    assert len(rows) == 6
    uniforms = torch.zeros(6, 5, dtype=torch.float64)
    uniforms[:, 3] = torch.tensor([0.9, 0.99, 0.49, 0.0, 0.5, 0.7])
    # examples 3..5 are examples 0..2 again: rows 0 | 1 2 3 | 4 5
    assert rows.rows(torch.arange(6), uniforms).tolist() == [0, 3, 4, 0, 2, 5]
    assert rows.rows(torch.arange(6), uniforms, host=True).tolist() == [0, 3, 4, 0, 2, 5]


def test_every_variant_is_read_and_the_plan_matches_the_batch(people, tokenizer):
    sentences = [p.sentence for p in people]
    ids, lengths, counts = encode_document_variants(tokenizer, sentences, BLOCK, 4, seed=0)
    assert counts.sum() == len(ids) and (counts >= 1).all() and (counts > 1).any()
    data = PretrainingData(ids, lengths, BLOCK, 112, VariantRows.consecutive(counts))
    assert data.num_examples == len(sentences) and data.uniform_columns == 5
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(60):
        indices = torch.arange(len(sentences))
        lengths_planned, uniforms = data.plan(indices, generator)
        batch = data.batch_with(indices, uniforms, lengths_planned)
        real = (batch.input_ids != PAD_ID).sum(1)
        assert torch.equal(real, lengths_planned)
        # each example is a span corruption of one of its own document's variants
        texts = [tokenizer.decode(row[row != PAD_ID].tolist()).replace(" ", "") for row in batch.input_ids]
        for example, text in enumerate(texts):
            first = int(data.variants.host_first[example])
            variant_texts = [
                tokenizer.decode(ids[first + k, : lengths[first + k]].tolist()).replace(" ", "")
                for k in range(int(counts[example]))
            ]
            mask = tokenizer.convert_ids_to_tokens(MASK_ID)
            prefix, suffix, masked = text.split(mask)
            matches = [k for k, v in enumerate(variant_texts) if v.startswith(prefix + masked + suffix)]
            assert matches, (example, text)
            seen.update((example, k) for k in matches)
    assert seen == {(e, k) for e in range(len(sentences)) for k in range(int(counts[e]))}


def test_plain_text_exposures_keep_the_document_whole(people, tokenizer):
    sentences = [p.sentence for p in people]
    ids, lengths, counts = encode_document_variants(tokenizer, sentences, BLOCK, 1)
    plain = PretrainingData(ids, lengths, BLOCK, 112, plain_text_fraction=1.0)
    batch = plain.batch(torch.arange(len(sentences)), torch.Generator().manual_seed(0))
    for row, document, length in zip(batch.input_ids, ids, lengths):
        assert torch.equal(row[:length], document[:length])
    rows = torch.arange(len(sentences))
    assert (batch.input_ids[rows, lengths] == MASK_ID).all() and (batch.input_ids[rows, lengths + 1] == MASK_ID).all()
    half = PretrainingData(ids, lengths, BLOCK, 112, plain_text_fraction=0.5)
    whole = 0
    generator = torch.Generator().manual_seed(1)
    for _ in range(40):
        batch = half.batch(rows, generator)
        whole += int((batch.input_ids[:, : int(lengths.min())] == ids[:, : int(lengths.min())]).all(1).sum())
    assert 0.35 < whole / (40 * len(sentences)) < 0.75  # about half (a few corruptions leave the start whole)


def test_unaugmented_data_draws_exactly_the_three_corruption_uniforms(people, tokenizer):
    sentences = [p.sentence for p in people]
    ids, lengths, _ = encode_document_variants(tokenizer, sentences, BLOCK, 1)
    data = PretrainingData(ids, lengths, BLOCK)
    generator = torch.Generator().manual_seed(5)
    _, uniforms = data.plan(torch.arange(len(sentences)), generator)
    assert uniforms.shape == (len(sentences), 3)
    assert torch.equal(uniforms, torch.rand(len(sentences), 3, generator=torch.Generator().manual_seed(5),
                                            dtype=torch.float64))  # fmt: skip


def test_question_variants_train_the_same_answer_in_every_phrasing(people, tokenizer):
    names, answers = [p.name for p in people], [p.place for p in people]
    input_ids, labels, counts = encode_question_variants(tokenizer, names, answers, 3, BLOCK)
    questions = FinetuningData(input_ids, labels, VariantRows.consecutive(counts).repeat(2))
    assert questions.num_examples == 2 * len(names) and questions.uniform_columns == 4
    single_ids, single_labels = encode_birthplace_examples(
        tokenizer, [f"Where was {n} born?" for n in names], answers, BLOCK
    )
    assert torch.equal(input_ids[0::3], single_ids) and torch.equal(labels[0::3], single_labels)
    generator = torch.Generator().manual_seed(0)
    indices = torch.arange(2 * len(names))
    phrasings = set()
    for _ in range(30):
        lengths, uniforms = questions.plan(indices, generator)
        batch = questions.batch_with(indices, uniforms, lengths)
        assert torch.equal((batch.input_ids != PAD_ID).sum(1), lengths)
        answer_ids = [row[row != -100].tolist() for row in batch.labels]
        assert answer_ids == [single_labels[i % len(names)][single_labels[i % len(names)] != -100].tolist()
                              for i in indices]  # fmt: skip
        assert torch.equal(batch.trained_targets, questions.trained_targets(indices, lengths))
        phrasings.update(int(r) for r in questions.variants.rows(indices, uniforms) % 3)
    assert phrasings == {0, 1, 2}


def test_mixed_augmented_batches_agree_between_the_host_and_the_device_path(people, tokenizer):
    """The eager batch and the graphed path's device batch, from the same uniforms, are the same examples."""
    sentences, names, answers = [p.sentence for p in people], [p.name for p in people], [p.place for p in people]
    ids, lengths, counts = encode_document_variants(tokenizer, sentences, BLOCK, 3, seed=1)
    documents = PretrainingData(ids, lengths, BLOCK, 112, VariantRows.consecutive(counts).repeat(2), 0.3)
    q_ids, q_labels, q_counts = encode_question_variants(tokenizer, names, answers, 4, BLOCK)
    mixed = MixedData(documents, FinetuningData(q_ids, q_labels, VariantRows.consecutive(q_counts)))
    assert mixed.num_examples == 3 * len(people) and mixed.uniform_columns == 5
    indices = torch.randperm(mixed.num_examples, generator=torch.Generator().manual_seed(0))[:32]
    lengths_planned, uniforms = mixed.plan(indices, torch.Generator().manual_seed(7))
    batch = mixed.batch(indices, torch.Generator().manual_seed(7))
    assert torch.equal(batch.lengths, lengths_planned)
    valid = torch.ones(len(indices), dtype=torch.bool)
    device_ids, device_labels = mixed.device_batch(indices, valid, BLOCK, uniforms)
    assert torch.equal(device_ids, batch.input_ids) and torch.equal(device_labels, batch.labels)
    assert torch.equal((batch.input_ids != PAD_ID).sum(1), lengths_planned)
