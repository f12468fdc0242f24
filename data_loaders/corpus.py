"""Reading the CS224N files (plain Python: no torch, no `datasets`; the builders in `builders.py` wrap these).

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

from hf_knowgpt.utils.errors import InputError, MissingInputError

from .truncation import MIN_DOCUMENT_LENGTH

logger = logging.getLogger(__name__)

QUESTION_PATTERN = re.compile(r"^Where was (?P<name>.+) born\?$")


def _read_text(path) -> str:
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a folder, not a file", "give the file itself")
    if not path.is_file():
        raise MissingInputError(path, "no such file", "check the path")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}", f"not UTF-8 text ({error.reason} at byte {error.start})",
                         "save the file as UTF-8") from error  # fmt: skip
    except OSError as error:
        raise InputError(path, f"cannot be read ({error.strerror})") from error


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
        raise InputError(
            source, f"holds no document of at least {MIN_DOCUMENT_LENGTH} characters", "one document per line"
        )
    return documents


def read_corpus(path) -> list[str]:
    return split_documents(_read_text(path), source=str(path))


@dataclass
class BirthplaceRecord:
    question: str
    name: str
    answer: str | None
    line: int | None = None  # where it stands in its file


def parse_birthplaces(text: str, source: str = "<text>") -> list[BirthplaceRecord]:
    """Parse birthplace TSV text; every error names the source and the line number (`file:line`)."""
    records, labeled_lines, unlabeled_lines = [], [], []
    for line_number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        where = f"{source}:{line_number}"
        fields = line.split("\t")
        if len(fields) > 2:
            raise InputError(
                where, f"{len(fields) - 1} tabs; expected one, between question and place", "question TAB place"
            )
        question = fields[0].strip()
        answer = fields[1].strip() if len(fields) == 2 else None
        if answer == "":
            raise InputError(where, "the place after the tab is empty", "question TAB place")
        (labeled_lines if answer is not None else unlabeled_lines).append(line_number)
        match = QUESTION_PATTERN.match(question)
        if match is None:
            raise InputError(where, f"expected 'Where was <name> born?', got {question!r}")
        records.append(BirthplaceRecord(question, match["name"], answer, line_number))
    if labeled_lines and unlabeled_lines:
        raise InputError(
            f"{source}:{unlabeled_lines[0]}",
            f"no tab: this line has no place, while line {labeled_lines[0]} has one",
            "every line 'question TAB place', or every line a question alone",
        )
    if not records:
        raise InputError(source, "holds no questions", "'Where was <name> born?' TAB place, one per line")
    return records


def read_birthplaces(path) -> list[BirthplaceRecord]:
    return parse_birthplaces(_read_text(path), source=str(path))


def person_documents(names, corpus_lines) -> list:
    """Each person's biography: the line titled with their name (`Name. ...`, as wiki.txt's lines open),
    else the first corpus line naming them (None when no line does)."""
    titled, found = {}, {}
    wanted = set(names)
    for line in corpus_lines:
        title = line.split(". ", 1)[0]
        if title in wanted:
            titled.setdefault(title, line)
    untitled = [name for name in dict.fromkeys(names) if name not in titled]  # only these need a search
    for line in corpus_lines:
        for name in untitled:
            if name not in found and name in line:
                found[name] = line
    return [titled.get(name, found.get(name)) for name in names]


# The CS224N files by role, as `--data_dir` finds them.
CS224N_FILE_NAMES = {
    "corpus": "wiki.txt",
    "train": "birth_places_train.tsv",
    "dev": "birth_dev.tsv",
    "test": "birth_test_inputs.tsv",
}


@dataclass
class DataFiles:
    """The files of a run, by role: the pretraining corpus, the training questions (finetuning and mixed
    training), the dev questions (scored after training) and the test questions (answered, not scored)."""

    corpus: Path | None = None
    train: Path | None = None
    dev: Path | None = None
    test: Path | None = None

    @classmethod
    def from_data_dir(cls, data_dir) -> "DataFiles":
        """The four CS224N files of a folder (`wiki.txt`, `birth_places_train.tsv`, `birth_dev.tsv`,
        `birth_test_inputs.tsv`); a missing one is named."""
        data_dir = Path(data_dir)
        if not data_dir.is_dir():
            raise MissingInputError(data_dir, "no such folder", "--data_dir names the folder of the CS224N files")
        paths = {role: data_dir / name for role, name in CS224N_FILE_NAMES.items()}
        missing = [path.name for path in paths.values() if not path.is_file()]
        if missing:
            raise MissingInputError(
                data_dir,
                f"lacks {', '.join(missing)}",
                f"--data_dir expects {', '.join(CS224N_FILE_NAMES.values())}; give other files with their own flags",
            )
        return cls(**paths)

    @classmethod
    def synthetic(cls, num_people: int | None = None) -> "DataFiles":
        from .synthetic import DEFAULT_NUM_PEOPLE, synthetic_corpus_files

        files = synthetic_corpus_files(num_people or DEFAULT_NUM_PEOPLE)
        return cls(files.corpus, files.train, files.dev, files.test)

    def replaced(self, **paths) -> "DataFiles":
        """These files with the given roles replaced (None leaves a role as it is)."""
        values = {role: getattr(self, role) for role in CS224N_FILE_NAMES}
        values.update({role: Path(path) for role, path in paths.items() if path is not None})
        return DataFiles(**values)

    @property
    def is_synthetic(self) -> bool:
        return self.corpus is not None and "synthetic-" in str(self.corpus)


__all__ = [
    "BirthplaceRecord",
    "CS224N_FILE_NAMES",
    "DataFiles",
    "parse_birthplaces",
    "person_documents",
    "read_birthplaces",
    "read_corpus",
    "split_documents",
]
