"""Drop-in replacements for the handouts' `CharCorruptionDataset` and `NameDataset`.

Same constructor arguments and (x, y) pairs as the handouts (x = s[:-1], y = s[1:] with "□" where nothing
is trained), over the KnowGPT tokenizer's vocabulary, which is theirs plus one unknown-character id. Two
differences, both deliberate: non-ASCII characters are kept (the original NameDataset dropped them, so
names like "José" never matched their wiki.txt line), and blank lines are not documents.

    from data_loaders import CharCorruptionDataset, NameDataset, collate_handout_pairs
    pretrain = CharCorruptionDataset(open("wiki.txt", encoding="utf-8").read(), 128)
    finetune = NameDataset(pretrain, open("birth_places_train.tsv", encoding="utf-8").read())
    loader = DataLoader(finetune, batch_size=256, collate_fn=collate_handout_pairs)  # input_ids / labels
"""

import torch
from torch.utils.data import Dataset

from hf_knowgpt.tokenization_knowgpt import MASK_CHAR, PAD_CHAR, KnowGPTTokenizerFast

from .corpus import parse_birthplaces, split_documents
from .encoding import encode_birthplace_examples, encode_documents, handout_xy
from .span_corruption import span_corrupt


class CharCorruptionDataset(Dataset):
    """One span-corrupted example per document, freshly corrupted at every access.

    Randomness comes from `generator`, or from torch's global generator when it is None (then each
    DataLoader worker, which torch seeds separately, draws different spans).
    """

    MASK_CHAR = MASK_CHAR
    PAD_CHAR = PAD_CHAR

    def __init__(self, data: str, block_size: int, generator: torch.Generator | None = None):
        self.block_size = block_size
        self.tokenizer = KnowGPTTokenizerFast.from_corpus(data)
        self.stoi = self.tokenizer.stoi
        self.itos = self.tokenizer.itos
        self.vocab_size = len(self.tokenizer)
        self.data = split_documents(data, source="CharCorruptionDataset data")
        self.documents, self.lengths = encode_documents(self.tokenizer, self.data, block_size)
        self.generator = generator

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        corrupted = span_corrupt(
            self.documents[index : index + 1], self.lengths[index : index + 1], self.block_size, self.generator
        )
        x, y = corrupted.handout_xy()
        return x[0], y[0]


class NameDataset(Dataset):
    """Birthplace questions for finetuning: x = `question⁇answer⁇□…`[:-1], y = "□" over the question, then the rest."""

    def __init__(self, pretraining_dataset: CharCorruptionDataset, data: str):
        self.MASK_CHAR = pretraining_dataset.MASK_CHAR
        self.PAD_CHAR = pretraining_dataset.PAD_CHAR
        self.tokenizer = pretraining_dataset.tokenizer
        self.stoi, self.itos = pretraining_dataset.stoi, pretraining_dataset.itos
        self.block_size = pretraining_dataset.block_size
        self.records = parse_birthplaces(data, source="NameDataset data")
        if any(record.answer is None for record in self.records):
            raise ValueError("NameDataset data has questions without places: finetuning needs question TAB place")
        input_ids, labels = encode_birthplace_examples(
            self.tokenizer,
            [r.question for r in self.records],
            [r.answer for r in self.records],
            self.block_size,
            source="NameDataset data",
        )
        self.x, self.y = handout_xy(input_ids, labels)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


__all__ = ["CharCorruptionDataset", "NameDataset"]
