#!/usr/bin/env python
"""How long the host takes to make ready the packed steps of the handout's pretraining (indices, corruption
draws, example lengths, token bucket, token index, copies to the device): `GraphedStepper._prepare_packed`
over the first steps of the recipe, with no step run, so what is timed is the host's part alone. A replayed
step on the device takes about 1.5 ms on an H200 (docs/speed.md): where the host needs as long, the steps are
bound by it.

    python benchmarks/diagnostics/host_step_plan.py --data_dir ../shared/data [--device cuda] [--each_alone]
"""

import argparse
import time
from pathlib import Path

import torch

from data_loaders import encode_documents
from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM
from hf_knowgpt.training.arguments import TrainingArguments
from hf_knowgpt.training.data import PretrainingData, packed_size, packed_token_index
from hf_knowgpt.training.fast_path import GraphedStepper
from hf_knowgpt.training.trainer import KnowGPTTrainer, make_accelerator
from hf_knowgpt.training.workflows import corpus_tokenizer


def prepare_each_step_alone(stepper, global_step: int, planned=None):
    """`GraphedStepper._prepare_packed` as it was before steps were made ready together: each step's own
    tensor operations and five freshly pinned copies (the baseline of `step_variants.py --variants
    steps-made-ready-each-alone`)."""
    trainer = stepper.trainer
    indices = trainer.batch_indices(global_step)
    stepper.generator.manual_seed(trainer.args.seed * 1_000_003 + global_step)
    lengths, uniforms = trainer.data.plan(indices, stepper.generator)
    trained_targets = trainer.data.trained_targets(indices, lengths).sum()
    slices = torch.tensor_split(torch.arange(len(indices)), stepper.world)
    grid = stepper.rows * stepper.seq_len
    capacity = max(packed_size(int(lengths[rows].sum()), stepper.bucket, grid) for rows in slices)
    mine = slices[stepper.rank]
    pad = stepper.rows - len(mine)
    indices = torch.cat([indices[mine], indices.new_zeros(pad)])
    lengths = torch.cat([lengths[mine], lengths.new_zeros(pad)])
    uniforms = torch.cat([uniforms[mine], uniforms.new_zeros(pad, uniforms.shape[1])])
    valid = torch.arange(stepper.rows) < len(mine)
    token_index = packed_token_index(lengths, stepper.seq_len, size=capacity)
    if capacity not in stepper.token_indices:
        stepper.token_indices[capacity] = torch.zeros(capacity, dtype=torch.long, device=stepper.device)
    pinned = stepper.device.type == "cuda"
    for target, source in (
        (stepper.indices, indices),
        (stepper.valid, valid),
        (stepper.uniforms, uniforms),
        (stepper.token_indices[capacity], token_index),
        (stepper.trained_targets, trained_targets.float()),
    ):
        target.copy_(source.pin_memory() if pinned else source, non_blocking=pinned)
    return capacity


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="folder with wiki.txt")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (copies to the device are then pinned)")
    parser.add_argument("--steps", type=int, default=2000, help="steps made ready, from the first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--planned", type=int, default=None, help="steps made ready together (default: GraphedStepper.PLANNED_STEPS)"
    )
    parser.add_argument("--each_alone", action="store_true", help="each step made ready alone, as before")
    args = parser.parse_args(argv)
    wiki = Path(args.data_dir) / "wiki.txt"
    tokenizer = corpus_tokenizer(wiki)
    documents = [line for line in wiki.read_text(encoding="utf-8").split("\n") if line]
    block_size = 128
    data = PretrainingData(*encode_documents(tokenizer, documents, block_size, source=str(wiki)), block_size)
    model = KnowGPTForCausalLM(KnowGPTConfig(vocab_size=len(tokenizer), block_size=block_size))
    training = TrainingArguments(output_dir="/tmp/host-step-plan", max_epochs=650, batch_size=128, learning_rate=6e-3)
    trainer = KnowGPTTrainer(model, data, training, make_accelerator(training, cpu=args.device == "cpu"))
    device = trainer.accelerator.device
    model.to(device)
    data.to(device)
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(6e-3, device=device))
    stepper = GraphedStepper(trainer, packed=True)
    planned = args.planned or GraphedStepper.PLANNED_STEPS
    prepare = prepare_each_step_alone if args.each_alone else GraphedStepper._prepare_packed
    way = "each alone" if args.each_alone else f"{planned} at a time"
    for repeat in range(args.repeats):
        stepper.plan = None
        started = time.perf_counter()
        for step in range(args.steps):
            prepare(stepper, step, planned)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        print(
            f"{way}, repeat {repeat}: {args.steps} steps made ready in {seconds:.3f} s, "
            f"{1e3 * seconds / args.steps:.3f} ms a step"
        )


if __name__ == "__main__":
    main()
