"""Answering "Where was X born?": batched greedy decoding with the KV cache, answer scores, scoring.

A prediction is what the model writes after `question⁇`, up to the next ⁇ (at most 32 characters), as
the handouts' `evaluate` computes it. Its score is the model's probability of the whole answer including
the closing ⁇: the product of the greedy characters' softmax probabilities. A model that recites before
answering (`config.recitation_length`) writes `recitation⁇answer⁇`: the answer is what follows its
recitation, and its score is the probability of everything written, recitation and answer together. The
answer's probability given the recitation would not tell known people from made-up ones: the model
answers a biography it has just invented as surely as one it read.
"""

import math
import re
from dataclasses import dataclass

import torch

from data_loaders.encoding import encode_questions
from data_loaders.span_corruption import MASK_ID, PAD_ID

from .options import HANDOUT_MAX_NEW_TOKENS

QUESTION_TEMPLATE = "Where was {} born?"


def as_question(text: str) -> str:
    """A bare name ("Khatchig Mouradian") becomes the question; a question stays as it is."""
    text = text.strip()
    if re.match(r"^Where was .+ born\?$", text):
        return text
    return QUESTION_TEMPLATE.format(text)


@dataclass
class Prediction:
    question: str
    answer: str  # the text up to the closing ⁇ (or all generated text when none came)
    log_probability: float  # of the answer's characters and its closing ⁇ (after a recitation: of all written)
    closed: bool  # whether the model wrote the closing ⁇
    # the question left fewer than max_new_tokens positions of the block and the answer ran out of them
    # unclosed: what came out is a fragment, not an answer
    truncated: bool = False
    recitation: str | None = None  # what a reciting model wrote about the person before its answer

    @property
    def score(self) -> float:
        return math.exp(self.log_probability)


@torch.no_grad()
def predict_birthplaces(
    model,
    tokenizer,
    questions: list[str],
    batch_size: int = 512,
    max_new_tokens: int = HANDOUT_MAX_NEW_TOKENS,
    source: str = "questions",
    lines: list[int] | None = None,
) -> list[Prediction]:
    """Greedy answers for `questions` in input order, decoded in left-padded batches with the KV cache.
    `source` and `lines` (the questions' file and line numbers) make errors and warnings name them."""
    block_size = model.config.block_size
    prompts = encode_questions(tokenizer, questions, block_size, source=source, lines=lines)
    recitation_length = getattr(model.config, "recitation_length", 0)
    predictions = []
    was_training = model.training
    model.eval()
    suppressed = list(getattr(model.generation_config, "suppress_tokens", None) or [])
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        input_ids, attention_mask = _left_padded(chunk, model.device)
        width = input_ids.shape[1]
        wanted = max_new_tokens + (recitation_length + 1 if recitation_length else 0)
        new_tokens = max(1, min(wanted, block_size - width))
        stopping = dict(eos_token_id=MASK_ID)
        if recitation_length:  # ⁇ closes the recitation first: stop at the second one, not at eos
            stopping = dict(eos_token_id=None, stopping_criteria=_after_marks(2, width))
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            suppress_tokens=suppressed or None,
            output_logits=True,
            return_dict_in_generate=True,
            **stopping,
        )
        generated = output.sequences[:, width:].cpu()
        log_probs = torch.stack(output.logits, dim=1).float().log_softmax(-1).cpu()
        token_log_probs = log_probs.gather(-1, generated[..., None])[..., 0]
        for row, question in enumerate(questions[start : start + batch_size]):
            ids = generated[row].tolist()
            first, recitation = 0, None
            if recitation_length:  # the answer starts after the recitation's ⁇ (or never, when none came)
                first = ids.index(MASK_ID) + 1 if MASK_ID in ids else len(ids)
                recitation = tokenizer.decode(ids[: max(first - 1, 0)])
            closed = MASK_ID in ids[first:]
            end = ids.index(MASK_ID, first) if closed else len(ids)
            answer = tokenizer.decode(ids[first:end])
            scored = end + 1 if closed else end
            truncated = not closed and new_tokens < wanted
            log_probability = float(token_log_probs[row, :scored].sum())  # first is 0 without a recitation
            predictions.append(Prediction(question, answer, log_probability, closed, truncated, recitation))
    model.train(was_training)
    return predictions


def _after_marks(count: int, prompt_width: int):
    """Stops each row once it has written `count` ⁇ after the prompt."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterMarks(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, prompt_width:] == MASK_ID).sum(dim=1) >= count

    return StoppingCriteriaList([AfterMarks()])


def _left_padded(prompts: list[list[int]], device):
    """(input_ids, attention_mask) of id lists, left-padded to the longest, on `device`."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def greedy_continuations(
    model, tokenizer, prompts: list[str], max_new_tokens: int | list[int], batch_size: int = 512
) -> list[str]:
    """What the model writes after each prompt, greedily and without stopping at ⁇: `max_new_tokens`
    characters (one number, or one per prompt), within the model's block. Prompts of one length are decoded
    together, so no prompt's room in the block is cut by a longer one's."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    wanted = [max_new_tokens] * len(ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    by_length = {}
    for index, prompt in enumerate(ids):
        by_length.setdefault(len(prompt), []).append(index)
    was_training = model.training
    model.eval()
    texts = [""] * len(ids)
    for width, members in sorted(by_length.items()):
        for start in range(0, len(members), batch_size):
            rows = members[start : start + batch_size]
            input_ids = torch.tensor([ids[i] for i in rows], device=model.device)
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max(1, min(max(wanted[i] for i in rows), model.config.block_size - width)),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_ID,
            )
            for i, generated in zip(rows, output[:, width:].cpu()):
                texts[i] = "".join(tokenizer.convert_ids_to_tokens(generated[: wanted[i]].tolist()))
    model.train(was_training)
    return texts


def handout_accuracy(gold_places: list[str], predicted_places: list[str]) -> tuple[int, int]:
    """(correct, total) as the handouts' `evaluate_places` counts: exact string equality, in order."""
    if len(gold_places) != len(predicted_places):
        raise ValueError(f"{len(predicted_places)} predictions for {len(gold_places)} gold places")
    return sum(g == p for g, p in zip(gold_places, predicted_places)), len(gold_places)


def format_accuracy(correct: int, total: int) -> str:
    return f"Correct: {correct} out of {total}: {100.0 * correct / total}%"


__all__ = [
    "HANDOUT_MAX_NEW_TOKENS",
    "Prediction",
    "as_question",
    "format_accuracy",
    "greedy_continuations",
    "handout_accuracy",
    "predict_birthplaces",
]
