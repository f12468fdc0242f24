"""The host's part of packed training steps, made ready many at a time.

Before each replay of a packed step's CUDA graph (`fast_path.GraphedStepper`) the host copies in what the step
reads: its examples, their uniforms (drawn from the step's own seed, as the eager path draws them), its token
bucket (the largest of the processes' slices of the batch), its token index and the batch's trained-target
count. Step by step that was about a hundred small tensor operations, 0.30 ms of a handout step's 1.5 ms on the
device (an H200's host); `plan_packed_steps` makes 64 steps ready in one pass, 0.06-0.08 ms a step
(benchmarks/diagnostics/host_step_plan.py), so that a shorter step on the device would not wait on the host.
"""

import itertools
from dataclasses import dataclass

import torch

from .data import packed_size, packed_token_indices


def tensor_split_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """(begin, end) of each part of `torch.tensor_split(torch.arange(count), parts)`: the first count % parts
    parts hold one more."""
    size, larger = divmod(count, parts)
    begins = [part * size + min(part, larger) for part in range(parts + 1)]
    return list(zip(begins[:-1], begins[1:]))


@dataclass
class PackedSteps:
    """What consecutive packed steps copy to the device before their replays: row s of each tensor is step
    first + s; step s's token index is token_index[token_offsets[s] : token_offsets[s + 1]], capacities[s]
    positions."""

    first: int
    capacities: list[int]
    indices: torch.Tensor  # (S, rows) examples of this process's slice, 0 where padding
    valid: torch.Tensor  # (S, rows)
    uniforms: torch.Tensor  # (S, rows, columns)
    token_index: torch.Tensor  # every step's, one after another
    token_offsets: list[int]
    trained_targets: torch.Tensor  # (S,) the global batch's
    pinned: bool = False

    def pin(self) -> "PackedSteps":
        """In page-locked memory, so that the copies to the device are asynchronous; torch keeps a freed block
        until the copies made from it are done."""
        for name in ("indices", "valid", "uniforms", "token_index", "trained_targets"):
            setattr(self, name, getattr(self, name).pin_memory())
        self.pinned = True
        return self


def plan_packed_steps(
    trainer, generator: torch.Generator, first_step: int, count: int, *, rows: int, seq_len: int, bucket: int,
    world: int = 1, rank: int = 0, pin: bool = False,
) -> PackedSteps:  # fmt: skip
    """Steps first_step .. first_step + count - 1 of `trainer`, each as the eager path makes it (its examples,
    its uniforms from its own seed), their lengths and token indices in one pass; each process's slice of a
    step padded to `rows`, its tokens rounded up to a multiple of `bucket` within the `rows` × `seq_len` grid."""
    data, seed = trainer.data, trainer.args.seed
    step_indices, step_uniforms = [], []
    for global_step in range(first_step, first_step + count):
        indices = trainer.batch_indices(global_step)
        generator.manual_seed(seed * 1_000_003 + global_step)  # as the eager path: same examples
        step_indices.append(indices)
        step_uniforms.append(data.draw(len(indices), generator))
    indices, uniforms = torch.cat(step_indices), torch.cat(step_uniforms)
    lengths = data.lengths_of(indices, uniforms)
    length_sums = [0, *itertools.accumulate(lengths.tolist())]
    target_sums = [0, *itertools.accumulate(data.trained_targets(indices, lengths).tolist())]
    # Each step's rows split over the processes as the eager path splits them (torch.tensor_split); every
    # process takes the largest slice's bucket, and pads its own slice to `rows` with invalid rows.
    grid = rows * seq_len
    picked = torch.full((count, rows), -1, dtype=torch.long)  # row of `indices` (-1: padding)
    capacities, trained_targets, start = [], [], 0
    for step, batch in enumerate(map(len, step_indices)):
        slices = tensor_split_bounds(batch, world)
        tokens = [length_sums[start + end] - length_sums[start + begin] for begin, end in slices]
        capacities.append(max(packed_size(slice_tokens, bucket, grid) for slice_tokens in tokens))
        trained_targets.append(target_sums[start + batch] - target_sums[start])
        begin, end = slices[rank]
        picked[step, : end - begin] = torch.arange(start + begin, start + end)
        start += batch
    valid = picked >= 0
    picked = picked.clamp(min=0)
    plan = PackedSteps(
        first=first_step,
        capacities=capacities,
        indices=torch.where(valid, indices[picked], 0),
        valid=valid,
        uniforms=torch.where(valid[..., None], uniforms[picked], 0.0),
        token_index=packed_token_indices(torch.where(valid, lengths[picked], 0), seq_len, capacities),
        token_offsets=[0, *itertools.accumulate(capacities)],
        trained_targets=torch.tensor(trained_targets, dtype=torch.float32),
    )
    return plan.pin() if pin else plan


__all__ = ["PackedSteps", "plan_packed_steps", "tensor_split_bounds"]
