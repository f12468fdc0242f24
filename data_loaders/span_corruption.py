"""Span corruption, the handouts' pretraining objective, vectorized over a batch of documents.

For a document d and block size B:
  1. truncate d to a random length L drawn uniformly from 4..⌊7B/8⌋ (a shorter document stays whole);
     `min_truncation_length` raises the 4 (the knowledge recipe reads every document's first ⌊7B/8⌋
     characters each epoch: the handouts' draw shows a place at character 100 in only 1 epoch of 9);
  2. cut the truncated text into prefix + masked + suffix; the masked length is 1 + ⌊u·(L/2 − 1)⌋,
     which averages L/4 and ranges from 1 to about L/2, and the prefix length is uniform over the rest;
  3. write `prefix ⁇ suffix ⁇ masked` and pad with "□" to B characters;
  4. the model reads the string and predicts it shifted by one; pad targets are not trained.
A `plain` document (a knowledge-augmentation option) keeps its text whole, nothing masked:
`text ⁇ ⁇`, next-character prediction over the truncated document.

This is the only implementation in the project: the CS224N drop-in dataset, the 🤗 datasets transform and
the GPU training loop all call `span_corrupt`. It works on CPU or CUDA tensors and draws all randomness
from one `torch.Generator` (three uniforms per document, in document order), so a batch of n documents
gives the same examples as n single-document calls from the same generator state.
"""

from dataclasses import dataclass

import torch

from .truncation import (
    MIN_DOCUMENT_LENGTH,
    check_min_truncation_length,
    check_truncation_lengths,
    max_truncation_length,
)

PAD_ID = 0  # "□" in every KnowGPT vocabulary
MASK_ID = 1  # "⁇"


@dataclass
class CorruptedBatch:
    input_ids: torch.LongTensor  # (N, block_size): prefix ⁇ suffix ⁇ masked □□…
    lengths: torch.LongTensor  # (N,): characters before the padding (L + 2)

    def labels(self) -> torch.LongTensor:
        """transformers-style labels: the string itself, -100 over the padding (never trained)."""
        positions = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        return self.input_ids.masked_fill(positions[None] >= self.lengths[:, None], -100)

    def handout_xy(self) -> tuple[torch.LongTensor, torch.LongTensor]:
        """The handouts' (x, y): x = s[:-1], y = s[1:], pad targets left as pad (their loss ignores id 0)."""
        return self.input_ids[:, :-1], self.input_ids[:, 1:]


def pack_documents(
    token_ids: list[list[int]], block_size: int, width: int | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Right-pad tokenized documents into an (N, width) matrix, width ⌊7B/8⌋ unless given: no more of a
    document is ever read."""
    width = max_truncation_length(block_size) if width is None else width
    documents = torch.full((len(token_ids), width), PAD_ID, dtype=torch.long)
    lengths = torch.zeros(len(token_ids), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        ids = ids[:width]
        documents[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        lengths[row] = len(ids)
    return documents, lengths


def draw_uniforms(
    n_docs: int, generator: torch.Generator | None = None, device=None, columns: int = 3
) -> torch.Tensor:
    """The uniforms per document that decide its example (drawn where the generator lives): the first three
    decide its corruption; augmented data reads further columns (`training_data`)."""
    device = generator.device if generator is not None else device
    return torch.rand(n_docs, columns, generator=generator, device=device, dtype=torch.float64)


def corruption_plan(
    lengths: torch.Tensor,
    uniforms: torch.Tensor,
    block_size: int,
    min_truncation_length: int = MIN_DOCUMENT_LENGTH,
    plain: torch.Tensor | None = None,
    longest: int | None = None,
):
    """(truncated, masked, prefix) lengths per document; the example then holds truncated + 2 characters.
    Documents where `plain` is true keep their text whole: nothing masked, the prefix is all of it. The
    truncation is drawn from min_truncation_length..`longest` (None: ⌊7B/8⌋)."""
    shortest, max_length = check_truncation_lengths(min_truncation_length, longest, block_size)
    lengths = lengths.to(device=uniforms.device, dtype=torch.long)
    drawn = shortest + (uniforms[:, 0] * (max_length - shortest + 1)).long()
    truncated = torch.minimum(lengths, drawn.clamp(max=max_length))
    masked = 1 + (uniforms[:, 1] * (truncated.double() / 2 - 1).clamp(min=0)).long()
    masked = torch.minimum(masked, truncated.clamp(min=1))
    prefix = (uniforms[:, 2] * (truncated - masked + 1).double()).long()
    if plain is not None:
        plain = plain.to(truncated.device)
        masked, prefix = torch.where(plain, 0, masked), torch.where(plain, truncated, prefix)
    return truncated, masked, prefix


def span_corrupt(
    documents: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    generator: torch.Generator | None = None,
    mask_id: int = MASK_ID,
    pad_id: int = PAD_ID,
    uniforms: torch.Tensor | None = None,
    min_truncation_length: int = MIN_DOCUMENT_LENGTH,
    plain: torch.Tensor | None = None,
    longest: int | None = None,
) -> CorruptedBatch:
    """Corrupt each row of `documents` (N, W ≥ ⌊7B/8⌋ or the longest length) into one training string.

    The randomness is `uniforms` when given (see `draw_uniforms`), else drawn from `generator`; rows where
    `plain` (N,) is true are kept whole (`text ⁇ ⁇`); `longest` caps the truncation below ⌊7B/8⌋.
    """
    n_docs, width = documents.shape
    device = documents.device
    if n_docs == 0:
        return CorruptedBatch(documents.new_empty((0, block_size)), lengths.new_empty(0))
    if uniforms is None:
        uniforms = draw_uniforms(n_docs, generator, device)
    truncated, masked, prefix = corruption_plan(
        lengths, uniforms.to(device, non_blocking=True), block_size, min_truncation_length, plain, longest
    )
    suffix = truncated - prefix - masked

    position = torch.arange(block_size, device=device)[None]
    prefix, masked, truncated, suffix = prefix[:, None], masked[:, None], truncated[:, None], suffix[:, None]
    first_mask = prefix
    second_mask = prefix + suffix + 1
    end = truncated + 2
    # Where each output character comes from in the document: prefix, then suffix, then the masked span.
    source = torch.where(
        position < first_mask,
        position,
        torch.where(position < second_mask, position - 1 + masked, prefix + position - second_mask - 1),
    )
    corrupted = documents.gather(1, source.clamp(0, width - 1)).to(torch.long)
    corrupted = torch.where((position == first_mask) | (position == second_mask), mask_id, corrupted)
    corrupted = torch.where(position >= end, pad_id, corrupted)
    return CorruptedBatch(corrupted, end[:, 0])


__all__ = [
    "CorruptedBatch",
    "MASK_ID",
    "MIN_DOCUMENT_LENGTH",
    "PAD_ID",
    "check_min_truncation_length",
    "check_truncation_lengths",
    "corruption_plan",
    "draw_uniforms",
    "max_truncation_length",
    "pack_documents",
    "span_corrupt",
]
