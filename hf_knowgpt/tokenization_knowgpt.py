"""Character-level tokenizer with the CS224N vocabulary: "□" (pad) = 0, "⁇" (mask) = 1, then the sorted
distinct characters of the corpus, then one unknown-character id."""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_CHAR = "\u25a1"  # □
MASK_CHAR = "\u2047"  # ⁇
UNK_CHAR = "\ufffd"  # the Unicode replacement character stands for characters the corpus lacks


def character_backend(vocab: dict[str, int], unk_token: str) -> Tokenizer:
    """The backend of every KnowGPT tokenizer: one token per code point, unknown characters to `unk_token`."""
    backend = Tokenizer(models.WordLevel(vocab=dict(vocab), unk_token=unk_token))
    # Any single code point is one token, newlines included; the decoder joins them back unchanged.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return backend


class KnowGPTTokenizerFast(PreTrainedTokenizerFast):
    """One token per Unicode character; `decode(encode(s)) == s` for text in the vocabulary.

    Build one from a corpus with `KnowGPTTokenizerFast.from_corpus(text)`: for the same corpus its ids are
    the handouts' (`CharCorruptionDataset.stoi`), with one more id after them for unknown characters. Or
    from a vocabulary, `KnowGPTTokenizerFast(vocab={character: id})` (or its tokens in id order, alone or as
    (token, score) pairs), as transformers 5 rebuilds tokenizers: every way in (vocabulary, `tokenizer.json`,
    `from_corpus`, `from_pretrained`) builds the same per-character backend with the unknown id. Nothing is
    added around the text (no BOS/EOS); ⁇ is also the end-of-sequence token, so generation stops after an
    answer's closing ⁇.
    """

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"
    model = models.WordLevel  # what transformers 5 reads from tokenizer.json before calling __init__(vocab=...)

    def __init__(
        self,
        vocab: dict[str, int] | list[str] | list[tuple[str, float]] | None = None,
        unk_token: str | None = None,
        pad_token: str = PAD_CHAR,
        mask_token: str = MASK_CHAR,
        eos_token: str = MASK_CHAR,
        **kwargs,
    ):
        if vocab is not None and not isinstance(vocab, dict):
            # tokens in id order, alone or with scores (as transformers' extractors list a vocabulary)
            vocab = {entry if isinstance(entry, str) else entry[0]: index for index, entry in enumerate(vocab)}
        if vocab is not None and kwargs.get("tokenizer_object") is None:
            if unk_token is None:
                unk_token = UNK_CHAR if UNK_CHAR in vocab else "<unk>"
            if str(unk_token) not in vocab:
                raise ValueError(f"KnowGPTTokenizerFast: the vocabulary lacks the unknown token {str(unk_token)!r}")
            kwargs.pop("tokenizer_file", None)  # the vocabulary is the whole of the backend
            kwargs["tokenizer_object"] = character_backend(vocab, str(unk_token))
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(
            unk_token=unk_token or UNK_CHAR, pad_token=pad_token, mask_token=mask_token, eos_token=eos_token, **kwargs
        )

    @classmethod
    def from_corpus(cls, text: str, extra_characters: str = "", **kwargs) -> "KnowGPTTokenizerFast":
        """The handouts' vocabulary for `text` (plus any `extra_characters` it lacks), then the unknown id."""
        if not text:
            raise ValueError("KnowGPTTokenizerFast.from_corpus needs a non-empty corpus")
        characters = sorted((set(text) | set(extra_characters)) - {PAD_CHAR, MASK_CHAR})
        unk_token = UNK_CHAR if UNK_CHAR not in characters else "<unk>"
        vocabulary = {token: i for i, token in enumerate([PAD_CHAR, MASK_CHAR, *characters, unk_token])}
        return cls(vocab=vocabulary, unk_token=unk_token, **kwargs)

    @property
    def stoi(self) -> dict[str, int]:
        """Character → id, as the handouts' datasets name it."""
        return self.get_vocab()

    @property
    def itos(self) -> dict[int, str]:
        """Id → character, as the handouts' datasets name it."""
        return {index: token for token, index in self.get_vocab().items()}


KnowGPTTokenizerFast.register_for_auto_class("AutoTokenizer")

__all__ = ["KnowGPTTokenizerFast", "PAD_CHAR", "MASK_CHAR", "UNK_CHAR"]
