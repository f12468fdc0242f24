"""Data for KnowGPT: 🤗 datasets builders for the CS224N files, span corruption, CS224N drop-in classes and
the synthetic biography corpus that is the embedded default.

    from data_loaders import load_corpus, load_birthplaces
    corpus = load_corpus("wiki.txt")                                   # DatasetDict: train / text
    questions = load_birthplaces(train="birth_places_train.tsv", dev="birth_dev.tsv")
"""

from .corpus import (
    BirthplaceBuilder,
    BirthplaceRecord,
    CorpusBuilder,
    load_birthplaces,
    load_corpus,
    parse_birthplaces,
    read_birthplaces,
    read_corpus,
    split_documents,
)
from .cs224n import CharCorruptionDataset, NameDataset
from .encoding import (
    birthplace_transform,
    collate_handout_pairs,
    encode_birthplace_examples,
    encode_documents,
    encode_questions,
    encode_texts,
    handout_xy,
    span_corruption_transform,
)
from .span_corruption import (
    MASK_ID,
    PAD_ID,
    CorruptedBatch,
    max_truncation_length,
    pack_documents,
    span_corrupt,
)
from .synthetic import (
    DEFAULT_NUM_PEOPLE,
    SyntheticFiles,
    generate_people,
    make_names,
    synthetic_corpus_files,
    write_synthetic_corpus,
)

__all__ = [
    "BirthplaceBuilder",
    "BirthplaceRecord",
    "CharCorruptionDataset",
    "CorpusBuilder",
    "CorruptedBatch",
    "DEFAULT_NUM_PEOPLE",
    "MASK_ID",
    "NameDataset",
    "PAD_ID",
    "SyntheticFiles",
    "birthplace_transform",
    "collate_handout_pairs",
    "encode_birthplace_examples",
    "encode_documents",
    "encode_questions",
    "encode_texts",
    "generate_people",
    "handout_xy",
    "load_birthplaces",
    "load_corpus",
    "make_names",
    "max_truncation_length",
    "pack_documents",
    "parse_birthplaces",
    "read_birthplaces",
    "read_corpus",
    "span_corrupt",
    "span_corruption_transform",
    "split_documents",
    "synthetic_corpus_files",
    "write_synthetic_corpus",
]
