"""Turning documents and birthplace questions into model inputs, and the `datasets` transforms built on it.

Finetuning examples follow the handouts' NameDataset: the string `question⁇answer⁇` padded with "□"; the
model is trained on everything after the question (the first ⁇, the answer, the closing ⁇), never on
the question itself. Evaluation prompts are `question⁇`.
"""

import logging
from pathlib import Path

import torch

from hf_knowgpt.utils.errors import InputError

from .augmentation import all_document_variants, question_variants
from .span_corruption import MASK_ID, MIN_DOCUMENT_LENGTH, PAD_ID, pack_documents, span_corrupt

logger = logging.getLogger(__name__)


def encode_texts(tokenizer, texts: list[str], source: str = "input") -> list[list[int]]:
    """Character ids of each text. Characters outside the vocabulary become the unknown id, and a warning
    names each of them with the first place it occurs: `file:line` when `source` is a file, else the item."""
    texts = list(texts)
    # whole documents, longer than the model's block (model_max_length) and cut later: no warning about length
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    unk_id = tokenizer.unk_token_id
    if unk_id is None or not any(unk_id in row for row in ids):
        return ids
    first_item, count = {}, 0
    for index, (text, row) in enumerate(zip(texts, ids)):
        for character, token in zip(text, row):  # one id per character
            if token == unk_id:
                count += 1
                first_item.setdefault(character, index)
    places = _first_lines(source, first_item)
    logger.warning(
        "%s: %d characters outside the vocabulary were mapped to the unknown id: %s",
        source, count, "; ".join(f"{c!r} (U+{ord(c):04X}) first at {places[c]}" for c in first_item),
    )  # fmt: skip
    return ids


def _first_lines(source: str, first_item: dict) -> dict:
    """Where each character first occurs: `file:line` when `source` names a file, else `source item N`."""
    path = Path(source)
    lines = path.read_text(encoding="utf-8").split("\n") if path.is_file() else None
    places = {}
    for character, index in first_item.items():
        number = next((n for n, line in enumerate(lines, start=1) if character in line), None) if lines else None
        places[character] = f"{source}:{number}" if number else f"{source} item {index + 1}"
    return places


def encode_documents(tokenizer, documents: list[str], block_size: int, source: str = "corpus", width=None):
    """Documents as the (N, width) id matrix and lengths that `span_corrupt` reads (width ⌊7B/8⌋ unless
    given: how much of a document is ever read)."""
    return pack_documents(encode_texts(tokenizer, documents, source), block_size, width)


def encode_document_variants(
    tokenizer, documents: list[str], block_size: int, count: int, seed: int = 0, source: str = "corpus", width=None
):
    """Every document's variants (`augmentation.document_variants`: the original first, then reorderings of
    its phrases) as one id matrix, with the number of variants of each document: (ids, lengths, counts).
    Variants are drawn before truncation, so a reordering can bring a document's later phrases into view."""
    variants = all_document_variants(documents, count, seed)
    flat = [text for texts in variants for text in texts]
    ids, lengths = pack_documents(encode_texts(tokenizer, flat, source), block_size, width)
    return ids, lengths, torch.tensor([len(texts) for texts in variants])


def encode_question_variants(
    tokenizer, names, answers, count: int, block_size: int, source: str = "questions", recitations=None
):
    """`encode_birthplace_examples` over `count` phrasings of each person's question (`augmentation.
    question_variants`, the evaluation's form first), one after another: (input_ids, labels, counts)."""
    questions = [question for name in names for question in question_variants(name, count)]

    def repeated(values):
        return None if values is None else [value for value in values for _ in range(count)]

    input_ids, labels = encode_birthplace_examples(
        tokenizer, questions, repeated(answers), block_size, source, repeated(recitations)
    )
    return input_ids, labels, torch.full((len(names),), count)


def encode_birthplace_examples(
    tokenizer, questions, answers, block_size: int, source: str = "questions", recitations=None
):
    """(input_ids, labels), each (N, block_size): `question⁇answer⁇□…`, labels -100 over the question and
    padding; with `recitations` (one text per question), `question⁇recitation⁇answer⁇□…`, the recitation
    trained like the answer (the model recites what it read about the person, then answers)."""
    mask_char = tokenizer.convert_ids_to_tokens(MASK_ID)
    recited = [""] * len(questions) if recitations is None else [text + mask_char for text in recitations]
    texts = [
        question + mask_char + recitation + answer + mask_char
        for question, recitation, answer in zip(questions, recited, answers)
    ]
    ids = encode_texts(tokenizer, texts, source)
    question_lengths = [len(q) for q in encode_texts(tokenizer, list(questions), source)] if ids else []
    input_ids = torch.full((len(ids), block_size), PAD_ID, dtype=torch.long)
    labels = torch.full((len(ids), block_size), -100, dtype=torch.long)
    for row, (example, question_length) in enumerate(zip(ids, question_lengths)):
        if len(example) > block_size:
            what = "its answer" if recitations is None else "its recitation and answer"
            raise InputError(
                source,
                f"{questions[row]!r} with {what} takes {len(example)} characters, more than block_size={block_size}",
                "shorten it, or train a model with a larger --block_size"
                + ("" if recitations is None else " or a smaller --recitation_length"),
            )
        input_ids[row, : len(example)] = torch.as_tensor(example)
        labels[row, question_length : len(example)] = input_ids[row, question_length : len(example)]
    return input_ids, labels


def encode_questions(
    tokenizer, questions, block_size: int, max_new_tokens: int = 0, source: str = "questions", lines=None
):
    """Evaluation prompts `question⁇` as id lists; each must leave room for at least one answer character.
    `lines` (the questions' line numbers in `source`) make an error name its line."""
    mask_char = tokenizer.convert_ids_to_tokens(MASK_ID)
    prompts = encode_texts(tokenizer, [question + mask_char for question in questions], source)
    for index, (question, prompt) in enumerate(zip(questions, prompts)):
        if len(prompt) >= block_size:
            raise InputError(
                f"{source}:{lines[index]}" if lines else f"{source} item {index + 1}",
                f"question {question!r} takes {len(prompt)} characters with its ⁇: the model's block of "
                f"{block_size} leaves no room for an answer",
                "shorten the question",
            )
    return prompts


def handout_xy(input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The handouts' (x, y) for a (…, B) example: x = s[:-1], y = targets with "□" where nothing is trained."""
    return input_ids[..., :-1], labels[..., 1:].masked_fill(labels[..., 1:] == -100, PAD_ID)


def collate_handout_pairs(pairs):
    """Collate the handouts' (x, y) pairs into `input_ids`/`labels` (-100) with exactly the same loss."""
    x = torch.stack([pair[0] for pair in pairs])
    y = torch.stack([pair[1] for pair in pairs])
    input_ids = torch.cat([x, y[:, -1:]], dim=1)
    labels = torch.cat([torch.full_like(y[:, :1], -100), y.masked_fill(y == PAD_ID, -100)], dim=1)
    return {"input_ids": input_ids, "labels": labels}


def span_corruption_transform(
    tokenizer,
    block_size: int,
    generator: torch.Generator | None = None,
    min_truncation_length: int = MIN_DOCUMENT_LENGTH,
):
    """A `Dataset.with_transform` function: each access corrupts the `text` rows afresh (new spans every epoch)."""

    def transform(batch):
        documents, lengths = encode_documents(tokenizer, batch["text"], block_size)
        corrupted = span_corrupt(
            documents, lengths, block_size, generator=generator, min_truncation_length=min_truncation_length
        )
        return {"input_ids": corrupted.input_ids, "labels": corrupted.labels()}

    return transform


def birthplace_transform(tokenizer, block_size: int):
    """A `Dataset.with_transform` function over `question`/`answer` rows: finetuning inputs and labels."""

    def transform(batch):
        input_ids, labels = encode_birthplace_examples(tokenizer, batch["question"], batch["answer"], block_size)
        return {"input_ids": input_ids, "labels": labels}

    return transform


__all__ = [
    "birthplace_transform",
    "collate_handout_pairs",
    "encode_birthplace_examples",
    "encode_document_variants",
    "encode_documents",
    "encode_question_variants",
    "encode_questions",
    "encode_texts",
    "handout_xy",
    "span_corruption_transform",
]
