import logging

import pytest
import torch
from conftest import DEV_TSV, HAS_DATA, TEST_TSV, TRAIN_TSV, WIKI, needs_data, tiny_config
from torch.nn import functional as F
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

from data_loaders import (
    MASK_ID,
    PAD_ID,
    CharCorruptionDataset,
    NameDataset,
    collate_handout_pairs,
    encode_birthplace_examples,
    encode_texts,
    generate_people,
    load_birthplaces,
    load_corpus,
    make_names,
    pack_documents,
    span_corrupt,
    span_corruption_transform,
    synthetic_corpus_files,
    write_synthetic_corpus,
)
from hf_knowgpt import KnowGPTForCausalLM, KnowGPTTokenizerFast

BLOCK = 128


def synthetic_long_documents():
    """Synthetic sentences joined in threes: documents longer than ⌊7B/8⌋ = 112, like most of wiki.txt."""
    sentences = [p.sentence for p in generate_people(900, seed=5)]
    return [" ".join(sentences[i : i + 3]) for i in range(0, len(sentences), 3)]


CORPORA = [pytest.param("synthetic", id="synthetic")]
CORPORA.append(
    pytest.param("wiki", id="wiki", marks=pytest.mark.skipif(not HAS_DATA, reason="CS224N data not present"))
)


def corpus_documents(name):
    if name == "synthetic":
        return synthetic_long_documents()
    return WIKI.read_text(encoding="utf-8").strip("\n").split("\n")


def corrupt_many(documents, samples, seed=0):
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(documents))
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    matrix, lengths = pack_documents(ids, BLOCK)
    rows = torch.arange(samples) % len(documents)
    corrupted = span_corrupt(matrix[rows], lengths[rows], BLOCK, torch.Generator().manual_seed(seed))
    return tokenizer, [ids[i] for i in rows.tolist()], corrupted


@pytest.mark.parametrize("corpus", CORPORA)
def test_span_corruption_properties_over_thousands_of_samples(corpus):
    documents = corpus_documents(corpus)
    samples = 12000
    _, sources, corrupted = corrupt_many(documents, samples)
    assert corrupted.input_ids.shape == (samples, BLOCK)
    truncations, fractions = [], []
    for row, source in zip(corrupted.input_ids.tolist(), sources):
        length = corrupted.lengths[len(truncations)].item()
        assert row[length:] == [PAD_ID] * (BLOCK - length)  # padding to the fixed length
        content = row[:length]
        assert content.count(MASK_ID) == 2  # exactly two ⁇
        first = content.index(MASK_ID)
        second = content.index(MASK_ID, first + 1)
        prefix, suffix, masked = content[:first], content[first + 1 : second], content[second + 1 :]
        truncated = len(prefix) + len(suffix) + len(masked)
        assert length == truncated + 2
        assert 4 <= truncated <= 112 or truncated == len(source) < 4
        assert prefix + masked + suffix == source[:truncated]  # a prefix of the document, cut in three
        assert len(masked) >= 1
        truncations.append(truncated)
        fractions.append(len(masked) / truncated)
    long_enough = min(len(s) for s in sources)
    if long_enough >= 112:
        assert set(truncations) == set(range(4, 113))  # every truncation length occurs
    fractions = torch.tensor(fractions)
    assert abs(fractions.mean().item() - 0.25) <= 0.02
    assert (fractions > 0.3).float().mean() > 0.2 and (fractions < 0.2).float().mean() > 0.2


def test_every_truncation_length_occurs_on_long_documents():
    documents = synthetic_long_documents()
    assert min(len(d) for d in documents) >= 112
    _, _, corrupted = corrupt_many(documents, 20000, seed=1)
    assert set((corrupted.lengths - 2).tolist()) == set(range(4, 113))


def test_min_truncation_length_raises_the_shortest_cut_and_keeps_the_format():
    documents = synthetic_long_documents()
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(documents))
    matrix, lengths = pack_documents(tokenizer(documents)["input_ids"], BLOCK)
    default = span_corrupt(matrix, lengths, BLOCK, torch.Generator().manual_seed(3))
    explicit = span_corrupt(matrix, lengths, BLOCK, torch.Generator().manual_seed(3), min_truncation_length=4)
    assert torch.equal(default.input_ids, explicit.input_ids)  # 4 is the handouts' draw, unchanged
    rows = torch.arange(6000) % len(documents)
    raised = span_corrupt(
        matrix[rows], lengths[rows], BLOCK, torch.Generator().manual_seed(3), min_truncation_length=100
    )
    assert set((raised.lengths - 2).tolist()) == set(range(100, 113))
    whole = span_corrupt(
        matrix[rows], lengths[rows], BLOCK, torch.Generator().manual_seed(3), min_truncation_length=112
    )
    assert (whole.lengths == 114).all() and ((whole.input_ids == MASK_ID).sum(dim=1) == 2).all()
    with pytest.raises(ValueError, match="min_truncation_length must lie in 4..112"):
        span_corrupt(matrix, lengths, BLOCK, torch.Generator(), min_truncation_length=113)


def test_short_documents_stay_whole():
    documents = ["abcd", "abcdefgh"]
    _, sources, corrupted = corrupt_many(documents, 400)
    for length, source in zip(corrupted.lengths.tolist(), sources):
        assert length - 2 <= len(source)
    assert (corrupted.lengths[::2] == 6).all()  # "abcd" is never cut shorter than 4


def test_batched_and_single_example_paths_agree_for_the_same_generator_state():
    documents = synthetic_long_documents()[:50]
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(documents))
    matrix, lengths = pack_documents(tokenizer(documents)["input_ids"], BLOCK)
    batched = span_corrupt(matrix, lengths, BLOCK, torch.Generator().manual_seed(7)).input_ids
    generator = torch.Generator().manual_seed(7)
    single = torch.cat(
        [span_corrupt(matrix[i : i + 1], lengths[i : i + 1], BLOCK, generator).input_ids for i in range(50)]
    )
    assert torch.equal(batched, single)
    again = span_corrupt(matrix, lengths, BLOCK, torch.Generator().manual_seed(7)).input_ids
    assert torch.equal(batched, again)  # reproducible under a seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_span_corruption_runs_on_cuda_with_the_same_properties():
    documents = synthetic_long_documents()
    _, _, cpu = corrupt_many(documents, 100)
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(documents))
    matrix, lengths = pack_documents(tokenizer(documents)["input_ids"], BLOCK)
    corrupted = span_corrupt(matrix.cuda(), lengths.cuda(), BLOCK, torch.Generator("cuda").manual_seed(0))
    assert corrupted.input_ids.is_cuda and ((corrupted.input_ids == MASK_ID).sum(1) == 2).all()


def test_handout_classes_give_the_handout_format():
    documents = synthetic_long_documents()[:20]
    pretrain = CharCorruptionDataset("\n".join(documents) + "\n", BLOCK)
    assert len(pretrain) == 20 and pretrain.vocab_size == len(pretrain.tokenizer)
    assert pretrain.stoi[pretrain.PAD_CHAR] == 0 and pretrain.stoi[pretrain.MASK_CHAR] == 1
    x, y = pretrain[3]
    assert x.shape == y.shape == (BLOCK - 1,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one
    text = "".join(pretrain.itos[int(i)] for i in torch.cat([x, y[-1:]]))
    assert text.count("⁇") == 2 and text.rstrip("□").count("□") == 0


def test_collator_gives_exactly_the_handout_loss():
    documents = synthetic_long_documents()[:16]
    pretrain = CharCorruptionDataset("\n".join(documents), BLOCK, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config(vocab_size=pretrain.vocab_size, block_size=BLOCK, n_embd=32)).eval()
    pairs = [pretrain[i] for i in range(8)]
    batch = collate_handout_pairs(pairs)
    x = torch.stack([p[0] for p in pairs])
    y = torch.stack([p[1] for p in pairs])
    handout_loss = F.cross_entropy(model(x).logits.reshape(-1, pretrain.vocab_size), y.reshape(-1), ignore_index=0)
    assert torch.allclose(model(**batch).loss, handout_loss, atol=1e-6)


def test_datasets_transform_corrupts_afresh_at_every_access(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(synthetic_long_documents()[:64]) + "\n", encoding="utf-8")
    dataset = load_corpus(corpus, cache_dir=tmp_path / "cache")["train"]
    tokenizer = KnowGPTTokenizerFast.from_corpus(corpus.read_text(encoding="utf-8"))
    corrupted = dataset.with_transform(span_corruption_transform(tokenizer, BLOCK))
    first, second = corrupted[:32], corrupted[:32]
    assert first["input_ids"].shape == (32, BLOCK)
    assert not torch.equal(first["input_ids"], second["input_ids"])  # fresh spans each epoch
    assert ((first["input_ids"] == MASK_ID).sum(1) == 2).all()
    assert ((first["labels"] == -100) == (first["input_ids"] == PAD_ID)).all()
    loader = torch.utils.data.DataLoader(corrupted, batch_size=16)
    assert next(iter(loader))["input_ids"].shape == (16, BLOCK)


@needs_data
def test_cs224n_classes_on_the_real_files():
    pretrain = CharCorruptionDataset(WIKI.read_text(encoding="utf-8"), BLOCK)
    finetune = NameDataset(pretrain, TRAIN_TSV.read_text(encoding="utf-8"))
    assert len(pretrain) == 2937 and len(finetune) == 2000 and pretrain.vocab_size == 257
    x, y = finetune[0]
    decode = lambda ids: "".join(pretrain.itos[int(i)] for i in ids)  # noqa: E731
    question = "Where was Khatchig Mouradian born?"
    expected = question + "⁇Lebanon⁇"
    assert decode(x) == expected + "□" * (BLOCK - 1 - len(expected))
    assert decode(y) == "□" * (len(question) - 1) + "⁇Lebanon⁇" + "□" * (BLOCK - len(expected))
    # non-ASCII names survive (the original NameDataset dropped these characters)
    names = [r.name for r in finetune.records]
    accented = next(n for n in names if any(ord(c) > 127 for c in n))
    assert accented in WIKI.read_text(encoding="utf-8")


def test_documents_longer_than_the_tokenizers_model_length_encode_whole_and_quietly():
    """A checkpoint's tokenizer carries the model's block as model_max_length; documents are longer and are
    cut only later, so encoding them must keep every id and not warn of indexing errors."""
    tokenizer = KnowGPTTokenizerFast.from_corpus("abc de", model_max_length=4)
    with CaptureLogger(transformers_logging.get_logger("transformers.tokenization_utils_base")) as captured:
        ids = encode_texts(tokenizer, ["abc de abc", "ed"])
    assert [len(row) for row in ids] == [10, 2] and "longer than the specified maximum" not in captured.out
    with CaptureLogger(transformers_logging.get_logger("transformers.tokenization_utils_base")) as captured:
        tokenizer("abc de abc")  # the warning this guards against
    assert "longer than the specified maximum" in captured.out


@needs_data
def test_builders_return_the_right_row_counts():
    corpus = load_corpus(WIKI)
    assert list(corpus) == ["train"] and corpus["train"].num_rows == 2937
    questions = load_birthplaces(train=TRAIN_TSV, dev=DEV_TSV, test=TEST_TSV)
    assert {split: questions[split].num_rows for split in questions} == {"train": 2000, "dev": 500, "test": 437}
    first = questions["train"][0]
    assert first == {
        "question": "Where was Khatchig Mouradian born?",
        "name": "Khatchig Mouradian",
        "answer": "Lebanon",
    }
    assert questions["test"][0]["answer"] is None and questions["test"][0]["name"] == "Adam Bright"


def test_bad_input_gets_clear_errors(tmp_path, caplog):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt"):
        load_corpus(empty)

    two_tabs = tmp_path / "two_tabs.tsv"
    two_tabs.write_text("Where was A B born?\tParis\nWhere was C D born?\tRome\textra\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"two_tabs.tsv:2: 2 tabs; expected one"):
        load_birthplaces(train=two_tabs)
    mixed = tmp_path / "mixed.tsv"
    mixed.write_text("Where was A B born?\tParis\n\nWhere was C D born?\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"mixed.tsv:3: no tab: this line has no place, while line 1 has one"):
        load_birthplaces(train=mixed)
    not_a_question = tmp_path / "bad.tsv"
    not_a_question.write_text("Who is A?\tParis\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv:1: expected 'Where was <name> born\?'"):
        load_birthplaces(train=not_a_question)

    corpus = tmp_path / "short.txt"
    corpus.write_text("a long enough document\n\nab\nxyz\nanother document\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        dataset = load_corpus(corpus, cache_dir=tmp_path / "cache")["train"]
    assert dataset["text"] == ["a long enough document", "another document"]  # blank and short lines skipped
    assert "skipped 2 documents shorter than 4 characters" in caplog.text

    tokenizer = KnowGPTTokenizerFast.from_corpus("Where was born?⁇ Paris abcdefghijklmnopqrstuvwxyzAPR")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        input_ids, _ = encode_birthplace_examples(tokenizer, ["Where was Zoë born?"], ["Paris"], 64)
    assert "2 characters outside the vocabulary" in caplog.text  # "Z" and "ë"
    assert (input_ids == tokenizer.unk_token_id).sum() == 2
    with pytest.raises(ValueError, match="Where was a very long name indeed born"):
        encode_birthplace_examples(tokenizer, ["Where was a very long name indeed born?"], ["Paris"], 32)


def test_synthetic_corpus_is_seeded_disjoint_and_in_the_cs224n_format(tmp_path):
    files = write_synthetic_corpus(tmp_path / "a", num_people=200, seed=3)
    again = write_synthetic_corpus(tmp_path / "b", num_people=200, seed=3)
    other = write_synthetic_corpus(tmp_path / "c", num_people=200, seed=4)
    assert files.corpus.read_text(encoding="utf-8") == again.corpus.read_text(encoding="utf-8")
    assert files.corpus.read_text(encoding="utf-8") != other.corpus.read_text(encoding="utf-8")

    splits = load_birthplaces(train=files.train, dev=files.dev, test=files.test, cache_dir=tmp_path / "cache")
    names = {split: set(splits[split]["name"]) for split in splits}
    assert not (names["train"] & names["dev"] or names["train"] & names["test"] or names["dev"] & names["test"])
    assert all(answer is None for answer in splits["test"]["answer"])  # test inputs carry no labels
    lines = files.corpus.read_text(encoding="utf-8").strip("\n").split("\n")
    questions = list(splits["train"]["name"]) + list(splits["dev"]["name"]) + list(splits["test"]["name"])
    assert len(lines) == 200 and all(name in line for name, line in zip(questions, lines))  # aligned like wiki.txt

    people = generate_people(2000, seed=0)
    without_place = sum(p.place not in p.sentence for p in people) / len(people)
    assert 0.02 < without_place < 0.09
    starts = {p.sentence.index(p.place) == 8 for p in people if p.sentence.startswith("Born in")}
    assert starts == {True}
    positions = [p.sentence.index(p.place) / len(p.sentence) for p in people if p.place in p.sentence]
    assert min(positions) < 0.15 and max(positions) > 0.7  # the place appears early, late and in between
    assert len({p.name for p in people}) == 2000


def test_cached_synthetic_files_and_unseen_names(tmp_path):
    first = synthetic_corpus_files(150, seed=1, cache_dir=tmp_path)
    second = synthetic_corpus_files(150, seed=1, cache_dir=tmp_path)
    assert first.directory == second.directory and first.dev.is_file()
    known = {p.name for p in generate_people(150, seed=1)}
    unseen = make_names(40, seed=9, style="italian", exclude=known)
    assert len(unseen) == 40 and not ({n for n, _ in unseen} & known)
    assert all(style == "italian" for _, style in unseen)
