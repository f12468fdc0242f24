#!/usr/bin/env python
"""Are coordinate-descent-tuned kernels less accurate? One packed training step of the knowledge recipe's
model, computed several ways on the same weights and batches, each against the same step in float64
(uncompiled, no autocast); the table of relative gradient errors ‖g − g₆₄‖ / ‖g₆₄‖ per parameter group, and
of the loss, printed last.

    python benchmarks/diagnostics/tuned_gradients.py --data_dir .data --batches 3

Ways (`--ways`): `eager-bf16`, the model uncompiled under bf16 autocast; `compiled`, `model_loss` compiled as
the graphed step compiles it (GraphedStepper's inductor options, bf16 autocast); `compiled-tuned`, the same
with `--tune_kernels`'s options (coordinate-descent tuning, Triton's launcher); its halves alone,
`coordinate-descent` (with inductor's static launcher) and `dynamic-launch` (Triton's launcher, untuned);
`float64`, the reference again (its error is 0: a check of the comparison). On a GPU with Triton the model's
attention is the fused kernel, as training runs it. The weights are `--checkpoint`'s, or fresh from `--seed`.
The batches are the corpus's span-corrupted documents, read as the knowledge recipe reads them (its model,
112-character documents, a batch of 128, packed into the largest batch's token count rounded up to 256);
dropout is off so that every way computes the same function. Only the loss and its gradients are compared, not
the clipping, which training compiles too. The knowledge recipe answered about 0.6 points less with tuned
kernels (benchmarks/RESULTS.md): a way whose gradients are further from float64 than `compiled`'s would say
why (none was, on an H200). With `--dropout` the recipe's dropout stays on and each way is measured against
`compiled` instead, every way's random number generators seeded alike: a way whose kernels drew other masks
from the same seeds differs by far more than rounding.

    python benchmarks/diagnostics/tuned_gradients.py --data_dir .data --dropout --ways compiled,compiled-tuned
"""

import argparse
import copy
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data_loaders import encode_documents, read_corpus  # noqa: E402
from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM  # noqa: E402
from hf_knowgpt.training.data import PretrainingData, packed_size, packed_token_index  # noqa: E402
from hf_knowgpt.training.fast_path import GraphedStepper, known_inductor_options, model_loss  # noqa: E402
from hf_knowgpt.training.recipes import KNOWLEDGE  # noqa: E402
from hf_knowgpt.training.workflows import corpus_tokenizer  # noqa: E402
from hf_knowgpt.utils.model_card import describe_device  # noqa: E402

WAYS = ("eager-bf16", "compiled", "compiled-tuned", "coordinate-descent", "dynamic-launch", "float64")
GROUPS = ("tok_emb", "ln", "attn", "mlp.fc", "mlp.proj", "lm_head")
BATCH_SIZE, BUCKET = 128, 256
NO_DROPOUT = {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}


def group_of(name: str) -> str:
    """The parameter group a gradient's error is summed into."""
    if "tok_emb" in name or "pos_emb" in name:
        return "tok_emb"
    if ".ln" in name or "ln_f" in name:
        return "ln"
    for group in ("attn", "mlp.fc", "mlp.proj", "lm_head"):
        if group in name:
            return group
    raise ValueError(f"no group for parameter {name}")


def make_batches(data_dir: Path, count: int, seed: int, device, model_overrides: dict, dropout: bool = False):
    """The model's configuration (the recipe's dropout, or none) and `count` packed batches: (input_ids, labels,
    token_index, trained targets)."""
    corpus = data_dir / "wiki.txt"
    tokenizer = corpus_tokenizer(corpus)
    model_settings = {**KNOWLEDGE.model, **model_overrides}
    if not dropout:
        model_settings.update(NO_DROPOUT)
    config = KnowGPTConfig(
        vocab_size=len(tokenizer), unk_token_id=tokenizer.unk_token_id, attention_type=KNOWLEDGE.attention_type,
        **model_settings,
    )  # fmt: skip
    block = config.block_size
    data = PretrainingData(
        *encode_documents(tokenizer, read_corpus(corpus), block), block,
        min_truncation_length=min(KNOWLEDGE.min_truncation_length, block - 2),
        max_truncation_length=min(KNOWLEDGE.max_truncation_length, block - 2),
    ).to(device)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    plans = []
    for _ in range(count):
        indices = torch.randperm(data.num_examples, generator=generator)[:BATCH_SIZE]
        plans.append((indices, *data.plan(indices, generator)))
    # one token count for all batches (the largest bucket), so that each compiled way compiles once
    size = max(
        (packed_size(int(lengths.sum()), BUCKET, len(indices) * block) for indices, lengths, _ in plans), default=0
    )
    batches = []
    for indices, lengths, uniforms in plans:
        token_index = packed_token_index(lengths, block, size=size).to(device)
        valid = torch.ones(len(indices), dtype=torch.bool, device=device)
        input_ids, labels = data.device_batch(indices.to(device), valid, block, uniforms=uniforms.to(device))
        trained = data.trained_targets(indices, lengths).sum().float().to(device)
        batches.append((input_ids, labels, token_index, trained))
    return config, batches


def gradients(model, loss_function, batches, autocast_dtype, seed=0):
    """Per batch: (loss, {parameter name: float64 gradient}); the random number generators seeded alike for
    every way, so that with dropout each way draws its masks from the same seeds."""
    results = []
    for number, (input_ids, labels, token_index, trained) in enumerate(batches):
        torch.manual_seed(seed + number)
        model.zero_grad(set_to_none=True)
        loss = loss_function(model, input_ids, labels, token_index, trained, autocast_dtype)
        loss.backward()
        grads = {name: parameter.grad.detach().double().clone() for name, parameter in model.named_parameters()}
        results.append((loss.detach().double(), grads))
    return results


def compiled_loss(options: dict):
    torch._dynamo.reset()  # each way compiles afresh, with its own options
    return torch.compile(model_loss, dynamic=False, options=known_inductor_options(options))


def way_loss(way: str):
    """The loss function of a way and its autocast dtype."""
    if way == "float64":
        return model_loss, None
    if way == "eager-bf16":
        return model_loss, torch.bfloat16
    base = GraphedStepper.inductor_options(tune_kernels=way == "compiled-tuned")
    if way == "coordinate-descent":  # tuning alone, with inductor's static launcher
        base = {**base, "coordinate_descent_tuning": True}
    if way == "dynamic-launch":
        base = {**base, "use_static_cuda_launcher": False}
    return compiled_loss(base), torch.bfloat16


def relative_errors(results, reference) -> dict:
    """Per group (and the loss): ‖g − g₆₄‖ / ‖g₆₄‖ over all batches."""
    squared_error, squared_norm = dict.fromkeys(GROUPS, 0.0), dict.fromkeys(GROUPS, 0.0)
    loss_error = 0.0
    for (loss, grads), (loss64, grads64) in zip(results, reference, strict=True):
        loss_error = max(loss_error, abs(loss.item() - loss64.item()) / abs(loss64.item()))
        for name, grad64 in grads64.items():
            group = group_of(name)
            squared_error[group] += (grads[name] - grad64).pow(2).sum().item()
            squared_norm[group] += grad64.pow(2).sum().item()
    errors = {group: (squared_error[group] / squared_norm[group]) ** 0.5 for group in GROUPS if squared_norm[group]}
    return {"loss": loss_error, **errors}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="folder with wiki.txt")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="a trained model (its vocabulary the corpus's); default: a fresh one")
    parser.add_argument("--model", nargs="*", default=[], metavar="FIELD=INT", help="model settings overridden")
    parser.add_argument(
        "--dropout",
        action="store_true",
        help="keep the recipe's dropout and measure each way against `compiled` (run first, with the same seeds)"
        " instead of float64: a way whose kernels drew other dropout masks differs by far more than rounding",
    )
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    if unknown := sorted(set(ways) - set(WAYS)):
        parser.error(f"unknown --ways {unknown}; choose from {list(WAYS)}")
    overrides = {}
    for item in args.model:
        field, _, value = item.partition("=")
        if not value.isdigit():
            parser.error(f"--model takes FIELD=INT, got {item!r}")
        overrides[field] = int(value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # as training sets them (KnowGPTTrainer)
        from hf_knowgpt.kernels import pin_triton_ptxas, use_training_matmul_settings

        pin_triton_ptxas()
        use_training_matmul_settings()
    config, batches = make_batches(Path(args.data_dir), args.batches, args.seed, device, overrides, args.dropout)
    torch.manual_seed(args.seed)
    if args.checkpoint:  # trained weights (errors at initialization need not be those late in training)
        dropout_settings = {field: getattr(config, field) for field in NO_DROPOUT}
        trained = KnowGPTConfig.from_pretrained(args.checkpoint, **dropout_settings)
        if (trained.vocab_size, trained.block_size) != (config.vocab_size, config.block_size):
            parser.error(f"--checkpoint {args.checkpoint}: vocabulary and block {trained.vocab_size}, "
                         f"{trained.block_size}; the batches' are {config.vocab_size}, {config.block_size}")  # fmt: skip
        model = KnowGPTForCausalLM.from_pretrained(args.checkpoint, config=trained)
    else:
        model = KnowGPTForCausalLM(config)
    model = model.to(device, torch.float32).train()
    reference_model = copy.deepcopy(model).double()
    if device.type == "cuda":
        from hf_knowgpt.kernels.fused_attention import fused_attention_available

        if fused_attention_available():
            model.set_attn_implementation("triton")
    reference_way = "compiled" if args.dropout else "float64"
    loss_function, dtype = way_loss(reference_way)
    reference_of = {"float64": reference_model, "compiled": model}[reference_way]
    reference = gradients(reference_of, loss_function, batches, dtype, args.seed)
    rows = {}
    for way in ways:
        loss_function, dtype = way_loss(way)
        way_model = reference_model if way == "float64" else model
        rows[way] = relative_errors(gradients(way_model, loss_function, batches, dtype, args.seed), reference)
        print(f"{way}: done", flush=True)

    dropout = ", the recipe's dropout" if args.dropout else ""
    print(f"\n{describe_device()}; {args.batches} batches of {BATCH_SIZE}, seed {args.seed}{dropout}; "
          f"relative difference from {reference_way}")  # fmt: skip
    print(f"{'way':<20}{'loss':>10}" + "".join(f"{group:>10}" for group in GROUPS))
    for way, errors in rows.items():
        print(f"{way:<20}{errors['loss']:>10.2e}" + "".join(f"{errors.get(g, 0.0):>10.2e}" for g in GROUPS))
    return rows


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # as a command only: a caller's logging stays as it was
    main()
