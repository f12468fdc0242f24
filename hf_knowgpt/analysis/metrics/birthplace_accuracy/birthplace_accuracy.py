"""Birthplace exact-match accuracy, counted as the CS224N handouts' `evaluate_places` counts it.

    import evaluate
    metric = evaluate.load("path/to/birthplace_accuracy.py")  # offline: a local module
    metric.compute(predictions=["London", "Paris"], references=["London", "Lyon"])
    # {'accuracy': 0.5, 'correct': 1, 'total': 2}

A prediction is correct when it equals the gold place exactly (the gold place is read from its TSV line with
surrounding whitespace stripped, as the handouts do; the prediction is compared as written).
"""

import datasets
import evaluate

_DESCRIPTION = "Exact-match accuracy of predicted birthplaces, as the CS224N handouts' evaluate_places counts it."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): predicted places, in question order.
    references (`list` of `str`): gold places, in the same order.
Returns:
    accuracy (`float`): correct / total; correct (`int`); total (`int`).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BirthplaceAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
        correct = sum(prediction == reference for prediction, reference in zip(predictions, references))
        total = len(references)
        return {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total}
