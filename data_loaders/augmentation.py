"""Generic knowledge augmentation: more than one surface form of each document and question, so that a
model stores a fact on the person rather than on the words that happen to precede it.

Nothing here looks for a birthplace. A document's variants reorder its phrases (the pieces between
commas, semicolons and parentheses) behind its title, whatever the phrases say; a question's variants ask
for the same attribute in other words and keep the answer format. Allen-Zhu & Li (Physics of Language
Models 3.1) found that fresh variation per exposure (shuffled biography sentences, several paraphrases) is
what lets mixed training extract facts of people never asked about, while a single fixed reordering does
not help; the training data draws one variant per exposure (`training_data.VariantRows`).

Plain Python: no torch (the encoders in `encoding.py` turn the texts into ids).
"""

import random
import re

# `Name. Sentence ...`: wiki.txt's documents open with the person's name as a title sentence. A title is
# short, without commas or parentheses, and ends at the first ". ".
_TITLE = re.compile(r"^(?P<title>[^,;()]{1,80}?\. )(?P<body>.+)$", re.DOTALL)
# Phrase boundaries: after ", " or "; ", before " (" and after ") ".
_BREAKS = re.compile(r"(?<=[,;]) | (?=\()|(?<=\)) ")


def split_title(text: str) -> tuple[str, str]:
    """(title, body): the leading `Name. ` of a titled document (kept in front by every variant, so each
    variant still says whom it is about), and the rest; ("", text) for an untitled one."""
    match = _TITLE.match(text)
    return (match["title"], match["body"]) if match else ("", text)


def split_phrases(body: str) -> list[str]:
    """The body's phrases: the pieces between commas, semicolons and parentheses, punctuation kept."""
    return [phrase for phrase in _BREAKS.split(body) if phrase]


def document_variants(text: str, count: int, rng: random.Random) -> list[str]:
    """`text` first, then up to `count - 1` distinct reorderings of its phrases behind its title (fewer when
    the document has fewer distinct orders: one phrase has none)."""
    title, body = split_title(text)
    phrases = split_phrases(body)
    variants = [text]
    seen = {tuple(range(len(phrases)))}
    # Distinct orders, drawn at random; the attempt bound ends the search when few orders exist.
    for _ in range(20 * count):
        if len(variants) >= count:
            break
        order = list(range(len(phrases)))
        rng.shuffle(order)
        if tuple(order) in seen:
            continue
        seen.add(tuple(order))
        variants.append(title + " ".join(phrases[i] for i in order))
    return variants


def all_document_variants(documents: list[str], count: int, seed: int = 0) -> list[list[str]]:
    """Each document's variants (`document_variants`), from one seeded generator in document order."""
    rng = random.Random(seed)
    return [document_variants(document, count, rng) for document in documents]


# Other ways to ask for the birthplace; the first is the form every evaluation asks (`Where was <name>
# born?`, as the CS224N files do), the others only vary the training questions. Every character is one
# wiki.txt has, so the handouts' vocabulary stays as it is.
QUESTION_PHRASINGS = (
    "Where was {name} born?",
    "What is the birthplace of {name}?",
    "In which place was {name} born?",
    "{name} was born where?",
    "What is the place of birth of {name}?",
    "Which place is the birthplace of {name}?",
    "Where is {name} originally from?",
    "Name the place where {name} was born.",
)


def question_variants(name: str, count: int) -> list[str]:
    """The first `count` phrasings of the birthplace question about `name` (the evaluation's form first)."""
    if not 1 <= count <= len(QUESTION_PHRASINGS):
        raise ValueError(f"question variants must lie in 1..{len(QUESTION_PHRASINGS)}, got {count}")
    return [phrasing.format(name=name) for phrasing in QUESTION_PHRASINGS[:count]]


__all__ = [
    "QUESTION_PHRASINGS",
    "all_document_variants",
    "document_variants",
    "question_variants",
    "split_phrases",
    "split_title",
]
