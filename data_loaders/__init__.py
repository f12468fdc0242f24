"""Data for KnowGPT: 🤗 datasets builders for the CS224N files, span corruption, CS224N drop-in classes and
the synthetic biography corpus that is the embedded default.

    from data_loaders import load_corpus, load_birthplaces
    corpus = load_corpus("wiki.txt")                                   # DatasetDict: train / text
    questions = load_birthplaces(train="birth_places_train.tsv", dev="birth_dev.tsv")

Names are imported from their modules on first use, so `import data_loaders` costs nothing and reading a
file does not load torch or `datasets` (the scripts start in a second instead of several).
"""

from hf_knowgpt.utils.lazy import lazy_exports

_EXPORTS = {
    "augmentation": [
        "QUESTION_PHRASINGS",
        "all_document_variants",
        "document_variants",
        "question_variants",
        "split_phrases",
        "split_title",
    ],
    "builders": ["BirthplaceBuilder", "CorpusBuilder", "load_birthplaces", "load_corpus"],
    "corpus": [
        "BirthplaceRecord",
        "CS224N_FILE_NAMES",
        "DataFiles",
        "parse_birthplaces",
        "person_documents",
        "read_birthplaces",
        "read_corpus",
        "split_documents",
    ],
    "cs224n": ["CharCorruptionDataset", "NameDataset"],
    "encoding": [
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
    ],
    "span_corruption": ["MASK_ID", "PAD_ID", "CorruptedBatch", "pack_documents", "span_corrupt"],
    "synthetic": [
        "DEFAULT_NUM_PEOPLE",
        "SyntheticFiles",
        "generate_people",
        "make_names",
        "synthetic_corpus_files",
        "write_synthetic_corpus",
    ],
    "truncation": ["MIN_DOCUMENT_LENGTH", "max_truncation_length"],
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
