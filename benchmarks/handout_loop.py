#!/usr/bin/env python
"""The handouts' own training and evaluation loop, re-stated here as the speed anchor of bench_user_path.py.

    python benchmarks/handout_loop.py --data_dir ../shared/data                   # their whole recipe
    python benchmarks/handout_loop.py --data_dir ../shared/data --pretrain_epochs 3 --finetune_epochs 2 --questions 50

It keeps what costs time in the CS224N 2024 code: their GPT's arithmetic (`tests/cs224n_reference.py`:
separate q/k/v projections, unfused attention with masked_fill, dropout 0.1 on embeddings, attention
weights and both residual branches, their initial values), their trainer (the model in
`torch.nn.DataParallel` on a GPU, a `DataLoader` with 4 workers over a dataset that corrupts one
document per item, in file order; `model.zero_grad()`, gradient clipping at 1.0, AdamW with every
parameter decayed but biases, the learning rate set in Python after each step from a token count kept
on the GPU, `loss.item()` every step for a tqdm progress bar; their TensorBoard writer is left out), their
recipe (650 pretraining epochs at batch 128 and lr 6e-3, then 10 finetuning epochs at batch 256 and lr
6e-4, each followed by `torch.save`), and their evaluation (one question at a time, 32 greedy forward
passes without a cache, the completion read back one id at a time). The datasets are this package's
CS224N-compatible classes (`data_loaders.cs224n`), which hand out the same (x, y) pairs as theirs.

Prints one JSON line last: seconds per pretraining and finetuning epoch, per question, the phases
between, and the dev accuracy when every dev question was asked.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

STARTED = time.time()  # before the heavy imports, which are part of what the user waits for

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm import tqdm  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from cs224n_reference import GPT, Config  # noqa: E402

from data_loaders.cs224n import CharCorruptionDataset, NameDataset  # noqa: E402


def train(model, dataset, *, epochs, batch_size, learning_rate, final_tokens, device, warmup_tokens=512 * 20):
    """Their `Trainer.train`; returns the wall seconds of each epoch."""
    if device == "cuda":
        model = torch.nn.DataParallel(model)
    decayed = [p for n, p in model.named_parameters() if not any(nd in n for nd in ("bias", "LayerNorm.weight"))]
    exempt = [p for n, p in model.named_parameters() if any(nd in n for nd in ("bias", "LayerNorm.weight"))]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": exempt, "weight_decay": 0.0}],
        lr=learning_rate,
        betas=(0.9, 0.95),
    )
    tokens, epoch_seconds = 0, []
    for epoch in range(epochs):
        started = time.perf_counter()
        model.train()
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=4)
        progress_bar = tqdm(enumerate(loader), total=len(loader))
        losses = []
        for step, (x, y) in progress_bar:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=0).mean()
            losses.append(loss.item())
            model.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tokens += (y >= 0).sum()
            if tokens < warmup_tokens:
                multiplier = float(tokens) / float(max(1, warmup_tokens))
            else:
                progress = float(tokens - warmup_tokens) / float(max(1, final_tokens - warmup_tokens))
                multiplier = max(0.1, 0.5 * (1.0 + math.cos(math.pi * progress)))
            for group in optimizer.param_groups:
                group["lr"] = learning_rate * multiplier
            progress_bar.set_description(
                f"epoch {epoch + 1} iter {step}: train loss {loss.item():.5f}, lr {learning_rate * multiplier:e}"
            )
        epoch_seconds.append(time.perf_counter() - started)
    return epoch_seconds


@torch.no_grad()
def answer(model, question: str, stoi, itos, unknown_id, block_size, device, steps=32) -> str:
    """Their `utils.sample(model, x, 32, sample=False)` and the completion's second field (a character
    outside the corpus, which their dictionary lookup would fail on, reads as unknown)."""
    model.eval()
    x = torch.tensor([stoi.get(c, unknown_id) for c in question + "⁇"], dtype=torch.long)[None, ...].to(device)
    for _ in range(steps):
        logits = model(x if x.size(1) <= block_size else x[:, -block_size:])
        probabilities = F.softmax(logits[:, -1, :], dim=-1)
        _, next_id = torch.topk(probabilities, k=1, dim=-1)
        x = torch.cat((x, next_id), dim=1)
    completion = "".join(itos[int(i)] for i in x[0])
    return completion.split("⁇")[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data_dir", required=True, help="folder with wiki.txt, birth_places_train.tsv, birth_dev.tsv"
    )
    parser.add_argument("--attention_type", default="vanilla", choices=["vanilla", "rope", "synthesizer", "perceiver"])
    parser.add_argument("--pretrain_epochs", type=int, default=650)
    parser.add_argument("--finetune_epochs", type=int, default=10)
    parser.add_argument("--questions", type=int, default=None, help="dev questions asked (default: all)")
    parser.add_argument("--output_dir", default="outputs/handout-loop")
    args = parser.parse_args(argv)
    marks = {"imports": time.time()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    data_dir, output_dir = Path(args.data_dir), Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    block_size = 128
    pretraining = CharCorruptionDataset(open(data_dir / "wiki.txt", encoding="utf-8").read(), block_size)
    finetuning = NameDataset(pretraining, open(data_dir / "birth_places_train.tsv", encoding="utf-8").read())
    config = Config(pretraining.vocab_size, block_size, variant=args.attention_type, pdrop=0.1)
    model = GPT(config).handout_init().to(device)
    marks["data and model"] = time.time()
    pretrain_epochs = train(
        model, pretraining, epochs=args.pretrain_epochs, batch_size=128, learning_rate=6e-3,
        final_tokens=650 * len(pretraining) * block_size, device=device,
    )  # fmt: skip
    torch.save(model.state_dict(), output_dir / "pretrained.params")
    marks["pretraining"] = time.time()
    finetune_epochs = train(
        model, finetuning, epochs=args.finetune_epochs, batch_size=256, learning_rate=6e-4,
        final_tokens=200 * len(pretraining) * block_size, device=device,
    )  # fmt: skip
    torch.save(model.state_dict(), output_dir / "finetuned.params")
    marks["finetuning"] = time.time()
    lines = open(data_dir / "birth_dev.tsv", encoding="utf-8").read().strip("\n").split("\n")[: args.questions]
    unknown_id = pretraining.tokenizer.unk_token_id
    started, correct = time.perf_counter(), 0
    for line in lines:
        question, place = line.split("\t")
        correct += answer(model, question, pretraining.stoi, pretraining.itos, unknown_id, block_size, device) == place
    per_question = (time.perf_counter() - started) / len(lines)
    marks["evaluation"] = time.time()
    bounds = [STARTED, *marks.values()]
    print(
        json.dumps({
            "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
            "attention_type": args.attention_type,
            "started": STARTED,
            "phases_s": {name: bounds[i + 1] - bounds[i] for i, name in enumerate(marks)},
            "pretrain_epoch_s": pretrain_epochs,
            "finetune_epoch_s": finetune_epochs,
            "questions": len(lines),
            "question_s": per_question,
            "correct": correct,
        }),
        flush=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
