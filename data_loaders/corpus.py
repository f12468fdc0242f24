"""Reading the CS224N files, and the 🤗 `datasets` builders over them.

`datasets` ≥ 4 no longer runs loading scripts through `load_dataset`, so the builders are imported and
prepared directly behind `load_corpus` / `load_birthplaces`, which return a `DatasetDict`.

Formats:
- corpus: UTF-8 text, one document per line (`wiki.txt`); blank lines and documents shorter than
  4 characters are skipped (counted in the log);
- birthplaces: `Where was <name> born?` TAB `<place>` per line, or the question alone for the unlabeled
  test inputs; a file is either all labeled or all unlabeled.
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import datasets

from .span_corruption import MIN_DOCUMENT_LENGTH

logger = logging.getLogger(__name__)

QUESTION_PATTERN = re.compile(r"^Where was (?P<name>.+) born\?$")


def _read_text(path) -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text: {error}") from error


def split_documents(text: str, source: str = "<text>") -> list[str]:
    """One document per line; blank lines skipped, documents under 4 characters skipped and counted."""
    documents, too_short = [], 0
    for line in text.split("\n"):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        if len(line) < MIN_DOCUMENT_LENGTH:
            too_short += 1
            continue
        documents.append(line)
    if too_short:
        logger.warning("%s: skipped %d documents shorter than %d characters", source, too_short, MIN_DOCUMENT_LENGTH)
    if not documents:
        raise ValueError(f"{source}: the corpus holds no document of at least {MIN_DOCUMENT_LENGTH} characters")
    return documents


def read_corpus(path) -> list[str]:
    return split_documents(_read_text(path), source=str(path))


@dataclass
class BirthplaceRecord:
    question: str
    name: str
    answer: str | None


def parse_birthplaces(text: str, source: str = "<text>") -> list[BirthplaceRecord]:
    """Parse birthplace TSV text; every error names the source and the line number."""
    records, labeled_lines, unlabeled_lines = [], [], []
    for line_number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) > 2:
            raise ValueError(
                f"{source}, line {line_number}: expected one tab (question TAB place), found {len(fields) - 1}"
            )
        question = fields[0].strip()
        answer = fields[1].strip() if len(fields) == 2 else None
        if answer == "":
            raise ValueError(f"{source}, line {line_number}: the place after the tab is empty")
        (labeled_lines if answer is not None else unlabeled_lines).append(line_number)
        match = QUESTION_PATTERN.match(question)
        if match is None:
            raise ValueError(f"{source}, line {line_number}: expected 'Where was <name> born?', got {question!r}")
        records.append(BirthplaceRecord(question, match["name"], answer))
    if labeled_lines and unlabeled_lines:
        raise ValueError(
            f"{source} mixes labeled and unlabeled lines: line {labeled_lines[0]} has a place, "
            f"line {unlabeled_lines[0]} has none"
        )
    if not records:
        raise ValueError(f"{source}: no questions found")
    return records


def read_birthplaces(path) -> list[BirthplaceRecord]:
    return parse_birthplaces(_read_text(path), source=str(path))


def _single_paths(data_files) -> dict[str, str]:
    resolved = {}
    for split, paths in data_files.items():
        paths = list(paths) if not isinstance(paths, (str, Path)) else [paths]
        if len(paths) != 1:
            raise ValueError(f"split {split!r} needs exactly one file, got {paths}")
        resolved[split] = str(paths[0])
    return resolved


class CorpusBuilder(datasets.GeneratorBasedBuilder):
    """A text corpus, one document per line → column `text`."""

    VERSION = datasets.Version("1.0.0")

    def _info(self):
        return datasets.DatasetInfo(
            description="Pretraining corpus, one document per line (the CS224N wiki.txt format).",
            features=datasets.Features({"text": datasets.Value("string")}),
        )

    def _split_generators(self, dl_manager):
        return [
            datasets.SplitGenerator(name=split, gen_kwargs={"path": path})
            for split, path in _single_paths(self.config.data_files).items()
        ]

    def _generate_examples(self, path):
        for index, document in enumerate(read_corpus(path)):
            yield index, {"text": document}


class BirthplaceBuilder(datasets.GeneratorBasedBuilder):
    """Birthplace questions → columns `question`, `name`, `answer` (None for the questions-only test file)."""

    VERSION = datasets.Version("1.0.0")

    def _info(self):
        return datasets.DatasetInfo(
            description="'Where was <name> born?' TAB '<place>' (CS224N birth_places_*.tsv format).",
            features=datasets.Features(
                {
                    "question": datasets.Value("string"),
                    "name": datasets.Value("string"),
                    "answer": datasets.Value("string"),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return [
            datasets.SplitGenerator(name=split, gen_kwargs={"path": path})
            for split, path in _single_paths(self.config.data_files).items()
        ]

    def _generate_examples(self, path):
        for index, record in enumerate(read_birthplaces(path)):
            yield index, {"question": record.question, "name": record.name, "answer": record.answer}


def _prepare(builder_class, data_files: dict, cache_dir=None) -> datasets.DatasetDict:
    files = {}
    for split, path in data_files.items():
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"file not found: {path}")
        files[split] = str(path.resolve())
    builder = builder_class(data_files=files, cache_dir=cache_dir)
    try:
        builder.download_and_prepare()
    except datasets.exceptions.DatasetGenerationError as error:
        # datasets wraps what _generate_examples raised; the original names the file and line.
        if isinstance(error.__cause__, ValueError):
            raise error.__cause__ from None
        raise
    return builder.as_dataset()


def load_corpus(path, split: str = "train", cache_dir=None) -> datasets.DatasetDict:
    """`wiki.txt` (or any one-document-per-line file) as a DatasetDict with one split of column `text`."""
    return _prepare(CorpusBuilder, {split: path}, cache_dir)


def load_birthplaces(cache_dir=None, **splits) -> datasets.DatasetDict:
    """Birthplace TSVs as a DatasetDict, one split per keyword: `load_birthplaces(train=..., dev=..., test=...)`."""
    if not splits:
        raise ValueError("load_birthplaces needs at least one split, e.g. train='birth_places_train.tsv'")
    return _prepare(BirthplaceBuilder, splits, cache_dir)


__all__ = [
    "BirthplaceBuilder",
    "BirthplaceRecord",
    "CorpusBuilder",
    "load_birthplaces",
    "load_corpus",
    "parse_birthplaces",
    "read_birthplaces",
    "read_corpus",
    "split_documents",
]
