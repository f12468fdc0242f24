"""The handouts' optimizer groups and learning-rate schedule (minGPT's trainer), step by step, and the one
learning-rate tensor a captured step sets for all groups (`share_device_learning_rate`).

The handout trainer counts tokens after each step (every target position, padding included: 127 per
example) and sets the rate for the next step from them, so the first step runs at the full rate.
"""

import math

import torch


def handout_lr_multiplier(tokens: float, warmup_tokens: float, final_tokens: float) -> float:
    """minGPT's schedule: linear warmup, then cosine decay with a floor at 10% of the peak."""
    if tokens < warmup_tokens:
        return tokens / max(1.0, warmup_tokens)
    progress = (tokens - warmup_tokens) / max(1.0, final_tokens - warmup_tokens)
    return max(0.1, 0.5 * (1.0 + math.cos(math.pi * progress)))


def rows_per_step(num_examples: int, batch_size: int, epochs: int) -> list[int]:
    """Examples in each optimizer step: full batches, then the remainder (no drop_last), every epoch."""
    per_epoch = [batch_size] * (num_examples // batch_size)
    if num_examples % batch_size:
        per_epoch.append(num_examples % batch_size)
    return per_epoch * epochs


def handout_lr_multipliers(steps_rows, positions_per_example, warmup_tokens, final_tokens) -> list[float]:
    """The multiplier in force at each step: the handout updates the rate *after* a step, so step 0 runs at 1."""
    multipliers, tokens = [1.0], 0
    for rows in steps_rows[:-1]:
        tokens += rows * positions_per_example
        multipliers.append(handout_lr_multiplier(tokens, warmup_tokens, final_tokens))
    return multipliers


def handout_parameter_groups(model: torch.nn.Module, weight_decay: float):
    """Decay every parameter except biases, as the handout trainer's name filter ends up doing."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (no_decay if "bias" in name else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def share_device_learning_rate(optimizer, device) -> torch.Tensor:
    """Give every parameter group of `optimizer` one learning-rate tensor on `device`, holding the first group's
    rate, and return it: a captured step sets it in place for all groups. Loading an optimizer's state (a
    resumed run) replaces each group's rate with the saved one, a CPU tensor of its own, which a CUDA graph
    can neither write nor read."""
    shared = torch.tensor(float(optimizer.param_groups[0]["lr"]), device=device)
    for group in optimizer.param_groups:
        group["lr"] = shared
    return shared


__all__ = [
    "handout_lr_multiplier",
    "handout_lr_multipliers",
    "handout_parameter_groups",
    "rows_per_step",
    "share_device_learning_rate",
]
