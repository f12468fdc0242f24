"""Does the model know when it does not know? Calibration, selective accuracy and seen/unseen people.

Every answer has a score: the model's probability of the whole answer with its closing ⁇, for a reciting
model of its recitation and answer together (`qa.Prediction`).
This module turns scores and correctness into the quantities a user of a QA system needs:
- accuracy against coverage (answer only the most confident fraction) and the area under that curve;
- a reliability diagram and its expected calibration error (ECE);
- the threshold that reaches a target accuracy, chosen on calibration questions (never on the evaluation set);
- how well the score separates people the model read about from made-up people (AUROC).
"""

from collections import Counter
from dataclasses import dataclass

import numpy as np

from data_loaders.corpus import person_documents


def selective_accuracy(scores, correct):
    """Coverage (fraction answered, most confident first) and the accuracy among those answered."""
    scores, correct = np.asarray(scores, dtype=float), np.asarray(correct, dtype=float)
    order = np.argsort(-scores, kind="stable")
    answered = np.arange(1, len(scores) + 1)
    return answered / len(scores), np.cumsum(correct[order]) / answered


def area_under_accuracy_coverage(scores, correct) -> float:
    """Mean accuracy over all coverage levels: 1.0 when every correct answer outranks every wrong one;
    the plain accuracy when scores carry no information."""
    _, accuracy = selective_accuracy(scores, correct)
    return float(accuracy.mean())


@dataclass
class ReliabilityBin:
    low: float
    high: float
    count: int
    confidence: float
    accuracy: float


def reliability(scores, correct, bins: int = 10):
    """Equal-width bins of the score; (bins, expected calibration error)."""
    scores, correct = np.asarray(scores, dtype=float), np.asarray(correct, dtype=float)
    edges = np.linspace(0.0, 1.0, bins + 1)
    table, error = [], 0.0
    for index, (low, high) in enumerate(zip(edges[:-1], edges[1:])):
        members = (scores >= low) & ((scores < high) if index < bins - 1 else (scores <= high))
        if not members.any():
            table.append(ReliabilityBin(low, high, 0, float("nan"), float("nan")))
            continue
        confidence, accuracy = scores[members].mean(), correct[members].mean()
        error += members.mean() * abs(accuracy - confidence)
        table.append(ReliabilityBin(low, high, int(members.sum()), float(confidence), float(accuracy)))
    return table, float(error)


@dataclass
class Threshold:
    value: float  # answer when score >= value
    coverage: float
    accuracy: float
    reached: bool  # whether any threshold reached the target


def threshold_for_accuracy(scores, correct, target: float) -> Threshold:
    """The lowest score threshold whose answered questions are at least `target` accurate (most coverage)."""
    scores, correct = np.asarray(scores, dtype=float), np.asarray(correct, dtype=float)
    order = np.argsort(-scores, kind="stable")
    sorted_scores = scores[order]
    coverage, accuracy = selective_accuracy(scores, correct)
    # A threshold can only cut between distinct scores: keep the last position of each run of ties.
    cut = np.r_[sorted_scores[1:] < sorted_scores[:-1], True]
    good = np.nonzero(cut & (accuracy >= target))[0]
    if len(good) == 0:
        best = int(np.argmax(np.where(cut, accuracy, -1)))
        return Threshold(float(sorted_scores[best]), float(coverage[best]), float(accuracy[best]), False)
    last = good[-1]
    return Threshold(float(sorted_scores[last]), float(coverage[last]), float(accuracy[last]), True)


def apply_threshold(scores, correct, threshold: float):
    """(coverage, accuracy among answered) when answering only scores >= threshold."""
    scores, correct = np.asarray(scores, dtype=float), np.asarray(correct, dtype=float)
    answered = scores >= threshold
    accuracy = float(correct[answered].mean()) if answered.any() else float("nan")
    return float(answered.mean()), accuracy


def auroc(positive_scores, negative_scores) -> float:
    """Probability that a positive outranks a negative (ties count half): the Mann–Whitney statistic."""
    positive, negative = np.asarray(positive_scores, dtype=float), np.asarray(negative_scores, dtype=float)
    if len(positive) == 0 or len(negative) == 0:
        return float("nan")
    greater = (positive[:, None] > negative[None, :]).sum()
    ties = (positive[:, None] == negative[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(positive) * len(negative)))


@dataclass
class Breakdown:
    """Accuracy of the questions falling in each bucket of one property of the person."""

    name: str
    buckets: list  # (label, questions, accuracy)


def _bucketed(name, values, correct, edges, labels, missing_label=None):
    correct = np.asarray(correct, dtype=float)
    rows = []
    if missing_label is not None:
        members = np.array([v is None for v in values])
        rows.append(
            (missing_label, int(members.sum()), float(correct[members].mean()) if members.any() else float("nan"))
        )
    numbers = np.array([-1 if v is None else v for v in values], dtype=float)
    for (low, high), label in zip(zip(edges[:-1], edges[1:]), labels):
        members = (numbers >= low) & (numbers < high)
        rows.append((label, int(members.sum()), float(correct[members].mean()) if members.any() else float("nan")))
    return Breakdown(name, rows)


def knowledge_breakdowns(names, gold_places, correct, corpus_lines, train_places) -> list[Breakdown]:
    """Accuracy by where the gold place first appears in the person's biography (character offset; absent
    when it does not), by how many training people share that place, and by the biography's length."""
    lines = person_documents(names, corpus_lines)
    offsets = [
        None if line is None or place not in line else line.index(place) for line, place in zip(lines, gold_places)
    ]
    counts = Counter(train_places)
    shared = [counts[place] for place in gold_places]
    lengths = [None if line is None else len(line) for line in lines]
    return [
        _bucketed(
            "character offset of the place in the biography", offsets, correct,
            [0, 25, 50, 75, 100, 10**6], ["0–24", "25–49", "50–74", "75–99", "100+"], missing_label="absent",
        ),
        _bucketed(
            "training people born in the same place", shared, correct,
            [0, 1, 2, 6, 21, 10**6], ["0", "1", "2–5", "6–20", "21+"],
        ),
        _bucketed(
            "length of the biography (characters)", lengths, correct,
            [0, 75, 100, 125, 150, 10**6], ["<75", "75–99", "100–124", "125–149", "150+"], missing_label="no line",
        ),
    ]  # fmt: skip


@dataclass
class RecitationProbe:
    """Does the model store what it read, and does it give it back when asked? For each evaluated person whose
    biography holds the gold place within the first `window` characters (what training reads): the model
    recites the biography from its opening up to the person's name (`prompt`), and the place is *stored* when
    the recitation holds it; *answered* is the question's exact match."""

    window: int
    people: int  # evaluated people probed (place within the window)
    stored: int
    recited_exactly: int  # the whole window recited character for character
    table: dict  # (stored, answered) -> people


def recitation_prompts(names, gold_places, corpus_lines, window: int = 112):
    """(index, prompt, biography window, place) of the people whose place lies in their biography's first
    `window` characters; the prompt is the biography up to the end of the first mention of the name (`Name`
    of a `Name. ...` title)."""
    probes = []
    for index, (name, place, line) in enumerate(zip(names, gold_places, person_documents(names, corpus_lines))):
        text = (line or "")[:window]
        if place in text and name in text:
            probes.append((index, text[: text.index(name) + len(name)], text, place))
    return probes


def recitation_probe(probes, recitations, correct, window: int = 112) -> RecitationProbe:
    """`probes` from `recitation_prompts`, `recitations` the model's continuation of each prompt, `correct`
    whether each evaluated question was answered right."""
    table, stored_count, exact = Counter(), 0, 0
    for (index, prompt, text, place), recitation in zip(probes, recitations):
        recited = (prompt + recitation)[: len(text)]
        stored = place in recited
        stored_count += stored
        exact += recited == text
        table[(stored, bool(correct[index]))] += 1
    return RecitationProbe(window, len(probes), stored_count, exact, dict(table))


def place_distribution(places, top: int = 10):
    counts = Counter(places)
    total = sum(counts.values())
    return [(place, count, count / total) for place, count in counts.most_common(top)]


__all__ = [
    "Breakdown",
    "RecitationProbe",
    "recitation_probe",
    "recitation_prompts",
    "knowledge_breakdowns",
    "ReliabilityBin",
    "Threshold",
    "apply_threshold",
    "area_under_accuracy_coverage",
    "auroc",
    "place_distribution",
    "reliability",
    "selective_accuracy",
    "threshold_for_accuracy",
]
