"""What a training step reads: span-corrupted documents, question–answer examples, or both mixed, built a
batch at a time on the training device; and the packed token index that leaves out right padding.

Every data class offers the same operations: `plan` (the host side of a step: example lengths and
corruption uniforms, drawn without waiting for the device), made of `draw` (a step's uniforms) and
`lengths_of` (row by row, so the rows of many steps can be given at once), `trained_targets`, `batch` (a
`TrainingBatch` for the eager paths) and `device_batch` (tensors only, for captured CUDA graphs).
"""

from dataclasses import dataclass

import torch

from data_loaders.span_corruption import corruption_plan, draw_uniforms, span_corrupt
from data_loaders.truncation import MIN_DOCUMENT_LENGTH, check_truncation_lengths


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # (R, T)
    labels: torch.Tensor  # (R, T), -100 where nothing is trained
    lengths: torch.Tensor  # (R,) real characters of each row (the rest is right padding), on the host
    trained_targets: torch.Tensor  # (R,) targets each row trains (labels[1:] != -100), on the host


# Columns of a step's uniforms (`draw_uniforms`, one row per example): 0-2 decide a document's span
# corruption; augmented data also reads these.
VARIANT_COLUMN = 3  # which of an example's variants this exposure reads
PLAIN_COLUMN = 4  # whether a document is read as plain text this time


class VariantRows:
    """Where each example's variants lie in a data matrix: rows first[i] .. first[i] + count[i] - 1. Every
    exposure reads one of them, picked by its uniform in the VARIANT_COLUMN, so the variation is fresh at
    each exposure and identical on the host (lengths) and on the device (the ids)."""

    def __init__(self, first: torch.Tensor, count: torch.Tensor):
        self.first, self.count = first.to(torch.long), count.to(torch.long)
        self.host_first, self.host_count = self.first.cpu(), self.count.cpu()

    @classmethod
    def consecutive(cls, counts) -> "VariantRows":
        """Examples whose variants lie one after another: `counts[i]` rows for example i."""
        count = torch.as_tensor(counts, dtype=torch.long)
        return cls(torch.cumsum(count, 0) - count, count)

    def __len__(self) -> int:
        return len(self.first)

    def repeat(self, times: int) -> "VariantRows":
        """The same examples `times` over (each exposure draws its variant afresh)."""
        return VariantRows(self.host_first.repeat(times), self.host_count.repeat(times))

    def to(self, device):
        self.first, self.count = self.first.to(device), self.count.to(device)
        return self

    def rows(self, indices: torch.Tensor, uniforms: torch.Tensor, host: bool = False) -> torch.Tensor:
        first, count = (self.host_first, self.host_count) if host else (self.first, self.count)
        count, first = count[indices], first[indices]
        pick = (uniforms[:, VARIANT_COLUMN].to(first.device) * count).long()
        return first + torch.minimum(pick, count - 1)


def _example_rows(variants: VariantRows | None, indices, uniforms, host: bool = False):
    return indices if variants is None else variants.rows(indices, uniforms, host)


class PretrainingData:
    """Span-corrupted documents, generated a batch at a time on the data's device.

    With `variants`, `documents` holds every variant of every document and each exposure reads one
    (`VariantRows`); with `plain_text_fraction`, that share of exposures reads its document whole, without
    a masked span; `max_truncation_length` (None: ⌊7B/8⌋) is the most of a document an example reads."""

    def __init__(
        self,
        documents: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
        min_truncation_length: int = MIN_DOCUMENT_LENGTH,
        variants: VariantRows | None = None,
        plain_text_fraction: float = 0.0,
        max_truncation_length: int | None = None,
    ):
        self.documents, self.lengths, self.block_size = documents, lengths, block_size
        self.min_truncation_length, self.max_truncation_length = check_truncation_lengths(
            min_truncation_length, max_truncation_length, block_size
        )
        self.host_lengths = lengths.cpu()
        if not 0.0 <= plain_text_fraction <= 1.0:
            raise ValueError(f"plain_text_fraction must lie in [0, 1], got {plain_text_fraction}")
        self.variants, self.plain_text_fraction = variants, plain_text_fraction
        # Unaugmented data draws exactly the three corruption uniforms, as it always has.
        self.uniform_columns = 3 if variants is None and not plain_text_fraction else PLAIN_COLUMN + 1

    @property
    def num_examples(self) -> int:
        return len(self.variants) if self.variants is not None else self.documents.shape[0]

    @property
    def static_length(self) -> int:
        """The longest example there can be: the longest truncation + 2 characters (the rest of the block is
        always padding)."""
        return min(self.block_size, self.max_truncation_length + 2)

    def to(self, device):
        self.documents, self.lengths = self.documents.to(device), self.lengths.to(device)
        if self.variants is not None:
            self.variants.to(device)
        return self

    def _plain(self, uniforms: torch.Tensor):
        return uniforms[:, PLAIN_COLUMN] < self.plain_text_fraction if self.plain_text_fraction else None

    def lengths_of(self, indices: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Host: the length of each example that `uniforms` make of the documents `indices`."""
        rows = _example_rows(self.variants, indices, uniforms, host=True)
        truncated, _, _ = corruption_plan(
            self.host_lengths[rows],
            uniforms,
            self.block_size,
            self.min_truncation_length,
            self._plain(uniforms),
            self.max_truncation_length,
        )
        return truncated + 2

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """The uniforms of a step of `count` examples, drawn from `generator` (on the host)."""
        return draw_uniforms(count, generator, columns=self.uniform_columns)

    def plan(self, indices: torch.Tensor, generator: torch.Generator):
        """Host side of a step: (example lengths, uniforms), drawn exactly as `batch` draws them."""
        uniforms = self.draw(len(indices), generator)
        return self.lengths_of(indices, uniforms), uniforms

    def trained_targets(self, indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Targets each example trains, from its `plan` length: every position after the first."""
        return (lengths - 1).clamp(min=0)

    def _corrupt(self, indices: torch.Tensor, uniforms: torch.Tensor | None):
        if uniforms is None:  # the device's own randomness (captured dense steps)
            uniforms = draw_uniforms(len(indices), device=self.documents.device, columns=self.uniform_columns)
        uniforms = uniforms.to(self.documents.device, non_blocking=True)
        rows = _example_rows(self.variants, indices, uniforms)
        return span_corrupt(
            self.documents[rows],
            self.lengths[rows],
            self.block_size,
            uniforms=uniforms,
            min_truncation_length=self.min_truncation_length,
            plain=self._plain(uniforms),
            longest=self.max_truncation_length,
        )

    def device_batch(self, indices: torch.Tensor, valid: torch.Tensor, seq_len: int, uniforms=None):
        """(input_ids, labels) built on the device, for captured steps; without `uniforms` the randomness
        comes from the device's default generator."""
        corrupted = self._corrupt(indices, uniforms)
        labels = corrupted.labels()[:, :seq_len].masked_fill(~valid[:, None], -100)
        return corrupted.input_ids[:, :seq_len], labels

    def batch_with(self, indices: torch.Tensor, uniforms: torch.Tensor, lengths: torch.Tensor) -> TrainingBatch:
        corrupted = self._corrupt(indices.to(self.documents.device), uniforms)
        return TrainingBatch(corrupted.input_ids, corrupted.labels(), lengths, self.trained_targets(indices, lengths))

    def batch(self, indices: torch.Tensor, generator: torch.Generator) -> TrainingBatch:
        # The uniforms are drawn on the host, so the example lengths are known without waiting for the device.
        lengths, uniforms = self.plan(indices, generator)
        return self.batch_with(indices, uniforms, lengths)


class FinetuningData:
    """Fixed `question⁇answer⁇` examples (see `data_loaders.encode_birthplace_examples`). With `variants`,
    the rows hold several phrasings of each question (same answer) and each exposure reads one."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, variants: VariantRows | None = None):
        self.input_ids, self.labels, self.variants = input_ids, labels, variants
        trained = labels.cpu() != -100
        last_trained = torch.where(trained, torch.arange(labels.shape[1]), -1).max(dim=1).values
        self.host_lengths = last_trained + 1
        # ⁇answer⁇ is trained, never the question: every phrasing of an example trains the same targets
        row_targets = trained[:, 1:].sum(dim=1)
        self.host_trained_targets = row_targets if variants is None else row_targets[variants.host_first]
        self.uniform_columns = 3 if variants is None else VARIANT_COLUMN + 1

    @property
    def num_examples(self) -> int:
        return len(self.variants) if self.variants is not None else self.input_ids.shape[0]

    @property
    def static_length(self) -> int:
        return int(self.host_lengths.max())

    def to(self, device):
        self.input_ids, self.labels = self.input_ids.to(device), self.labels.to(device)
        if self.variants is not None:
            self.variants.to(device)
        return self

    def lengths_of(self, indices: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return self.host_lengths[_example_rows(self.variants, indices, uniforms, host=True)]

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        if self.variants is None:  # nothing random: no draw, the generator untouched
            return torch.zeros(count, self.uniform_columns, dtype=torch.float64)
        return draw_uniforms(count, generator, columns=self.uniform_columns)

    def plan(self, indices: torch.Tensor, generator: torch.Generator):
        uniforms = self.draw(len(indices), generator)
        return self.lengths_of(indices, uniforms), uniforms

    def trained_targets(self, indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.host_trained_targets[indices]

    def device_batch(self, indices: torch.Tensor, valid: torch.Tensor, seq_len: int, uniforms=None):
        if self.variants is not None and uniforms is None:  # the device's own randomness (captured dense steps)
            uniforms = draw_uniforms(len(indices), device=self.input_ids.device, columns=self.uniform_columns)
        rows = _example_rows(self.variants, indices, uniforms)
        labels = self.labels[rows, :seq_len].masked_fill(~valid[:, None], -100)
        return self.input_ids[rows, :seq_len], labels

    def batch_with(self, indices: torch.Tensor, uniforms: torch.Tensor, lengths: torch.Tensor) -> TrainingBatch:
        device = self.input_ids.device
        rows = _example_rows(self.variants, indices.to(device), uniforms.to(device))
        return TrainingBatch(self.input_ids[rows], self.labels[rows], lengths, self.trained_targets(indices, None))

    def batch(self, indices: torch.Tensor, generator: torch.Generator) -> TrainingBatch:
        lengths, uniforms = self.plan(indices, generator)
        return self.batch_with(indices, uniforms, lengths)


class MixedData:
    """Pretraining documents and question–answer examples in one epoch ("mixed training", Allen-Zhu & Li,
    Physics of Language Models 3.1): examples 0..D-1 are span-corrupted documents, D.. are questions.
    Both parts read one draw of uniforms per step, so the host plan and the device batch agree."""

    def __init__(self, documents: PretrainingData, questions: FinetuningData):
        self.documents, self.questions = documents, questions
        self.block_size = documents.block_size
        self.uniform_columns = max(documents.uniform_columns, questions.uniform_columns)

    @property
    def num_examples(self) -> int:
        return self.documents.num_examples + self.questions.num_examples

    @property
    def static_length(self) -> int:
        return max(self.documents.static_length, self.questions.static_length)

    def to(self, device):
        self.documents.to(device), self.questions.to(device)
        return self

    def _split(self, indices):
        is_document = indices < self.documents.num_examples
        return (
            is_document,
            indices.clamp(max=self.documents.num_examples - 1),
            (indices - self.documents.num_examples).clamp(min=0),
        )

    def lengths_of(self, indices, uniforms):
        is_document, document_rows, question_rows = self._split(indices)
        return torch.where(
            is_document,
            self.documents.lengths_of(document_rows, uniforms),
            self.questions.lengths_of(question_rows, uniforms),
        )

    def draw(self, count, generator):
        return draw_uniforms(count, generator, columns=self.uniform_columns)

    def plan(self, indices, generator):
        uniforms = self.draw(len(indices), generator)
        return self.lengths_of(indices, uniforms), uniforms

    def trained_targets(self, indices, lengths):
        is_document, document_rows, question_rows = self._split(indices)
        return torch.where(
            is_document,
            self.documents.trained_targets(document_rows, lengths),
            self.questions.trained_targets(question_rows, lengths),
        )

    def batch(self, indices, generator) -> TrainingBatch:
        lengths, uniforms = self.plan(indices, generator)
        is_document, document_rows, question_rows = self._split(indices)
        documents = self.documents.batch_with(document_rows, uniforms, lengths)
        questions = self.questions.batch_with(question_rows, uniforms, lengths)
        rows = is_document.to(documents.input_ids.device)[:, None]
        return TrainingBatch(
            torch.where(rows, documents.input_ids, questions.input_ids),
            torch.where(rows, documents.labels, questions.labels),
            lengths,
            self.trained_targets(indices, lengths),
        )

    def device_batch(self, indices, valid, seq_len, uniforms=None):
        if uniforms is None:  # one draw for both parts (captured dense steps)
            uniforms = draw_uniforms(len(indices), device=indices.device, columns=self.uniform_columns)
        is_document, document_rows, question_rows = self._split(indices)
        document_ids, document_labels = self.documents.device_batch(document_rows, valid, seq_len, uniforms)
        question_ids, question_labels = self.questions.device_batch(question_rows, valid, seq_len, uniforms)
        rows = is_document[:, None]
        return torch.where(rows, document_ids, question_ids), torch.where(rows, document_labels, question_labels)


def packed_size(count: int, multiple: int, limit: int) -> int:
    """`count` tokens rounded up to a multiple of `multiple`, at most `limit` (the whole grid)."""
    return min(-(-count // multiple) * multiple, limit)


def packed_token_index(
    lengths: torch.Tensor, seq_len: int, multiple: int = 1, size: int | None = None
) -> torch.Tensor:
    """Flat indices (b·T + t) of the positions t < lengths[b]; with `multiple`, extended by padding
    positions (the earliest of each row first, which keeps each row a prefix) to a multiple of it, so
    shapes repeat and compiled code is reused; with `size`, extended to exactly that many."""
    count = int(lengths.clamp(max=seq_len).sum())
    target = packed_size(count, multiple, lengths.numel() * seq_len) if size is None else size
    return packed_token_indices(lengths[None], seq_len, [target])


def packed_token_indices(lengths: torch.Tensor, seq_len: int, sizes) -> torch.Tensor:
    """`packed_token_index` of several steps at once: `lengths` (S, B) holds each step's row lengths and
    `sizes` (S,) its token count; the steps' indices one after another, sizes[s] of them each."""
    lengths = lengths.clamp(max=seq_len)
    sizes = torch.as_tensor(sizes, dtype=torch.long)
    counts, grid = lengths.sum(dim=1), lengths.shape[1] * seq_len
    wrong = ((sizes < counts) | (sizes > grid)).nonzero()
    if len(wrong):
        step = int(wrong[0])
        raise ValueError(
            f"size must lie between the {int(counts[step])} real tokens and the grid's {grid}, got {int(sizes[step])}"
            + (f" (step {step} of {len(sizes)})" if len(sizes) > 1 else "")
        )
    kept = _kept_prefixes(lengths, seq_len, sizes - counts)
    taken = torch.arange(seq_len, dtype=torch.int32) < kept[..., None].int()  # (S, B, T)
    return taken.flatten(1).nonzero()[:, 1]  # ordered by step, then by flat position


def _kept_prefixes(lengths: torch.Tensor, seq_len: int, extra: torch.Tensor) -> torch.Tensor:
    """(S, B) positions each row keeps, its real ones and, to make up extra[s] more tokens of step s, padding
    positions taken in rounds: round k takes position lengths[s, b] + k of every row that has one, rows in
    order, so each row keeps a prefix. Counting instead of sorting the grid: this runs on the host before
    the packed steps (an argsort of the grid cost 0.5 ms of a 1.8 ms step)."""
    padding = seq_len - lengths  # padding positions of each row
    # available[s, k]: rows with a padding position at round k; taken[s, k]: positions taken by rounds 0..k
    rows_with = torch.zeros(len(lengths), seq_len + 1, dtype=torch.long)
    available = rows_with.scatter_add_(1, padding, torch.ones_like(padding)).flip(1).cumsum(1).flip(1)[:, 1:]
    taken = available.cumsum(1)
    full_rounds = torch.searchsorted(taken, extra[:, None], right=True)  # (S, 1)
    before = taken.gather(1, (full_rounds - 1).clamp(min=0))
    left = extra[:, None] - torch.where(full_rounds > 0, before, 0)
    eligible = padding > full_rounds  # rows with a position left after the full rounds
    last_round_rows = eligible & (eligible.cumsum(1) <= left)
    return (lengths + full_rounds).clamp(max=seq_len) + last_round_rows


__all__ = [
    "PLAIN_COLUMN",
    "VARIANT_COLUMN",
    "FinetuningData",
    "MixedData",
    "PretrainingData",
    "TrainingBatch",
    "VariantRows",
    "packed_size",
    "packed_token_index",
    "packed_token_indices",
]
