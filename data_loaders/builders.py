"""The 🤗 `datasets` builders over the CS224N files.

`datasets` ≥ 4 no longer runs loading scripts through `load_dataset`, so the builders are imported and
prepared directly behind `load_corpus` / `load_birthplaces`, which return a `DatasetDict`.
"""

from pathlib import Path

import datasets

from hf_knowgpt.utils.errors import MissingInputError

from .corpus import read_birthplaces, read_corpus


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
            raise MissingInputError(path, "no such file", "check the path")
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


__all__ = ["BirthplaceBuilder", "CorpusBuilder", "load_birthplaces", "load_corpus"]
