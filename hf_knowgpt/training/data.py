"""What a training step reads: span-corrupted documents, question–answer examples, or both mixed, built a
batch at a time on the training device; and the packed token index that leaves out right padding.

Every data class offers the same four operations: `plan` (the host side of a step: example lengths and
corruption uniforms, drawn without waiting for the device), `trained_targets`, `batch` (a `TrainingBatch`
for the eager paths) and `device_batch` (tensors only, for captured CUDA graphs).
"""

from dataclasses import dataclass

import torch

from data_loaders.span_corruption import corruption_plan, draw_uniforms, span_corrupt
from data_loaders.truncation import MIN_DOCUMENT_LENGTH, check_min_truncation_length, max_truncation_length


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # (R, T)
    labels: torch.Tensor  # (R, T), -100 where nothing is trained
    lengths: torch.Tensor  # (R,) real characters of each row (the rest is right padding), on the host
    trained_targets: torch.Tensor  # (R,) targets each row trains (labels[1:] != -100), on the host


class PretrainingData:
    """Span-corrupted documents, generated a batch at a time on the data's device."""

    def __init__(
        self,
        documents: torch.Tensor,
        lengths: torch.Tensor,
        block_size: int,
        min_truncation_length: int = MIN_DOCUMENT_LENGTH,
    ):
        self.documents, self.lengths, self.block_size = documents, lengths, block_size
        self.min_truncation_length = check_min_truncation_length(min_truncation_length, block_size)
        self.host_lengths = lengths.cpu()

    @property
    def num_examples(self) -> int:
        return self.documents.shape[0]

    @property
    def static_length(self) -> int:
        """The longest example there can be: ⌊7B/8⌋ + 2 characters (the rest of the block is always padding)."""
        return min(self.block_size, max_truncation_length(self.block_size) + 2)

    def to(self, device):
        self.documents, self.lengths = self.documents.to(device), self.lengths.to(device)
        return self

    def plan(self, indices: torch.Tensor, generator: torch.Generator):
        """Host side of a step: (example lengths, uniforms), drawn exactly as `batch` draws them."""
        uniforms = draw_uniforms(len(indices), generator)
        truncated, _, _ = corruption_plan(
            self.host_lengths[indices], uniforms, self.block_size, self.min_truncation_length
        )
        return truncated + 2, uniforms

    def trained_targets(self, indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Targets each example trains, from its `plan` length: every position after the first."""
        return (lengths - 1).clamp(min=0)

    def _corrupt(self, indices: torch.Tensor, uniforms: torch.Tensor | None):
        return span_corrupt(
            self.documents[indices],
            self.lengths[indices],
            self.block_size,
            uniforms=uniforms,
            min_truncation_length=self.min_truncation_length,
        )

    def device_batch(self, indices: torch.Tensor, valid: torch.Tensor, seq_len: int, uniforms=None):
        """(input_ids, labels) built on the device, for captured steps; without `uniforms` the randomness
        comes from the device's default generator."""
        corrupted = self._corrupt(indices, uniforms)
        labels = corrupted.labels()[:, :seq_len].masked_fill(~valid[:, None], -100)
        return corrupted.input_ids[:, :seq_len], labels

    def batch(self, indices: torch.Tensor, generator: torch.Generator) -> TrainingBatch:
        # The uniforms are drawn on the host, so the example lengths are known without waiting for the device.
        lengths, uniforms = self.plan(indices, generator)
        corrupted = self._corrupt(indices.to(self.documents.device), uniforms)
        return TrainingBatch(corrupted.input_ids, corrupted.labels(), lengths, self.trained_targets(indices, lengths))


class FinetuningData:
    """Fixed `question⁇answer⁇` examples (see `data_loaders.encode_birthplace_examples`)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.labels = input_ids, labels
        trained = labels.cpu() != -100
        last_trained = torch.where(trained, torch.arange(labels.shape[1]), -1).max(dim=1).values
        self.host_lengths = last_trained + 1
        self.host_trained_targets = trained[:, 1:].sum(dim=1)

    @property
    def num_examples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def static_length(self) -> int:
        return int(self.host_lengths.max())

    def to(self, device):
        self.input_ids, self.labels = self.input_ids.to(device), self.labels.to(device)
        return self

    def plan(self, indices: torch.Tensor, generator: torch.Generator):
        return self.host_lengths[indices], torch.zeros(len(indices), 3, dtype=torch.float64)

    def trained_targets(self, indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.host_trained_targets[indices]

    def device_batch(self, indices: torch.Tensor, valid: torch.Tensor, seq_len: int, uniforms=None):
        labels = self.labels[indices, :seq_len].masked_fill(~valid[:, None], -100)
        return self.input_ids[indices, :seq_len], labels

    def batch(self, indices: torch.Tensor, generator: torch.Generator) -> TrainingBatch:
        device_indices = indices.to(self.input_ids.device)
        return TrainingBatch(
            self.input_ids[device_indices],
            self.labels[device_indices],
            self.host_lengths[indices],
            self.trained_targets(indices, None),
        )


class MixedData:
    """Pretraining documents and question–answer examples in one epoch ("mixed training", Allen-Zhu & Li,
    Physics of Language Models 3.1): examples 0..D-1 are span-corrupted documents, D.. are questions."""

    def __init__(self, documents: PretrainingData, questions: FinetuningData):
        self.documents, self.questions = documents, questions
        self.block_size = documents.block_size

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

    def plan(self, indices, generator):
        is_document, document_rows, question_rows = self._split(indices)
        document_lengths, uniforms = self.documents.plan(document_rows, generator)
        lengths = torch.where(is_document, document_lengths, self.questions.host_lengths[question_rows])
        return lengths, uniforms

    def trained_targets(self, indices, lengths):
        is_document, document_rows, question_rows = self._split(indices)
        return torch.where(
            is_document,
            self.documents.trained_targets(document_rows, lengths),
            self.questions.trained_targets(question_rows, lengths),
        )

    def batch(self, indices, generator) -> TrainingBatch:
        is_document, document_rows, question_rows = self._split(indices)
        documents = self.documents.batch(document_rows, generator)
        questions = self.questions.batch(question_rows, generator)
        rows = is_document.to(documents.input_ids.device)[:, None]
        return TrainingBatch(
            torch.where(rows, documents.input_ids, questions.input_ids),
            torch.where(rows, documents.labels, questions.labels),
            torch.where(is_document, documents.lengths, questions.lengths),
            torch.where(is_document, documents.trained_targets, questions.trained_targets),
        )

    def device_batch(self, indices, valid, seq_len, uniforms=None):
        is_document, document_rows, question_rows = self._split(indices)
        document_ids, document_labels = self.documents.device_batch(document_rows, valid, seq_len, uniforms)
        question_ids, question_labels = self.questions.device_batch(question_rows, valid, seq_len)
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
    positions = torch.arange(seq_len)
    real = positions[None] < lengths[:, None]
    count = int(lengths.clamp(max=seq_len).sum())
    target = packed_size(count, multiple, real.numel()) if size is None else size
    if not count <= target <= real.numel():
        raise ValueError(f"size must lie between the {count} real tokens and the grid's {real.numel()}, got {target}")
    if target > count:
        real = real | _earliest_padding(lengths.clamp(max=seq_len), seq_len, target - count)
    return real.flatten().nonzero().squeeze(1)


def _earliest_padding(lengths: torch.Tensor, seq_len: int, extra: int) -> torch.Tensor:
    """(B, T) mask of `extra` padding positions taken in rounds: round k takes position lengths[b] + k of
    every row that has one, rows in order. Counting instead of sorting the grid: this runs on the host
    before every packed step (an argsort of the grid cost 0.5 ms of a 1.8 ms step)."""
    padding = seq_len - lengths  # padding positions of each row
    # available[k]: rows with a padding position at round k; taken[k]: positions taken by rounds 0..k
    available = torch.bincount(padding, minlength=seq_len + 1).flip(0).cumsum(0).flip(0)[1:]
    taken = available.cumsum(0)
    full_rounds = int(torch.searchsorted(taken, torch.tensor(extra), right=True))
    left = extra - (int(taken[full_rounds - 1]) if full_rounds else 0)
    rank = torch.arange(seq_len)[None] - lengths[:, None]  # round of each padding position (< 0: real)
    eligible = padding > full_rounds
    last_round_rows = eligible & (eligible.cumsum(0) <= left)
    return ((rank >= 0) & (rank < full_rounds)) | ((rank == full_rounds) & last_round_rows[:, None])


__all__ = [
    "FinetuningData",
    "MixedData",
    "PretrainingData",
    "TrainingBatch",
    "packed_size",
    "packed_token_index",
]
