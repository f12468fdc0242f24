"""The "birthplace-qa" pipeline: `pipeline("birthplace-qa", model=path)("Where was X born?")`."""

from transformers import Pipeline

from .qa import HANDOUT_MAX_NEW_TOKENS, Prediction, as_question, predict_birthplaces


class BirthplaceQAPipeline(Pipeline):
    """Answers "Where was X born?" (or a bare name) with a KnowGPT checkpoint.

    Returns `{"question", "answer", "score", "log_probability", "abstained", "truncated"}` per question;
    `score` is the model's probability of the whole answer with its closing ⁇ (for a reciting model, of its
    recitation and answer together). With `threshold=t`, an answer scored below t is withheld: `answer` is
    None, `abstained` is True, and `best_guess` keeps what it would have said. A question so long that the
    model's block left too little room for its answer (it ran out of positions before the closing ⁇) is
    withheld the same way with `truncated` True: the fragment is never given as an answer. Lists are answered
    in batches of `batch_size` (greedy decoding with the KV cache). A model that recites before answering
    (`config.recitation_length`) also returns its `recitation`.
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, max_new_tokens=None, threshold=None, **kwargs):
        forward_params, postprocess_params = {}, {}
        if max_new_tokens is not None:
            forward_params["max_new_tokens"] = max_new_tokens
        if threshold is not None:
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"threshold must be a probability in [0, 1], got {threshold}")
            postprocess_params["threshold"] = threshold
        return {}, forward_params, postprocess_params

    def __call__(self, inputs, batch_size: int | None = None, **kwargs):
        single = isinstance(inputs, str)
        questions = [inputs] if single else list(inputs)
        _, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        predictions = self._forward(
            {"question": [as_question(q) for q in questions]},
            batch_size=batch_size or self._batch_size or 64,
            **forward_params,
        )
        results = [self.postprocess(p, **postprocess_params) for p in predictions]
        return results[0] if single else results

    def preprocess(self, inputs):
        return {"question": as_question(inputs)}

    def _forward(self, model_inputs, batch_size: int = 64, max_new_tokens: int = HANDOUT_MAX_NEW_TOKENS):
        questions = model_inputs["question"]
        questions = [questions] if isinstance(questions, str) else list(questions)
        return predict_birthplaces(self.model, self.tokenizer, questions, batch_size, max_new_tokens)

    def postprocess(self, prediction: Prediction | list, threshold: float | None = None):
        if isinstance(prediction, list):
            return [self.postprocess(p, threshold) for p in prediction]
        result = {
            "question": prediction.question,
            "answer": prediction.answer,
            "score": prediction.score,
            "log_probability": prediction.log_probability,
            "abstained": False,
            "truncated": prediction.truncated,
        }
        if prediction.recitation is not None:
            result["recitation"] = prediction.recitation
        if prediction.truncated or (threshold is not None and prediction.score < threshold):
            result.update(answer=None, abstained=True, best_guess=prediction.answer)
        return result


__all__ = ["BirthplaceQAPipeline"]
