"""Character-level tokenizer with the CS224N vocabulary: "□" (pad) = 0, "⁇" (mask) = 1, then the sorted
distinct characters of the corpus, then one unknown-character id."""

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_CHAR = "\u25a1"  # □
MASK_CHAR = "\u2047"  # ⁇
UNK_CHAR = "\ufffd"  # the Unicode replacement character stands for characters the corpus lacks


class KnowGPTTokenizerFast(PreTrainedTokenizerFast):
    """One token per Unicode character; `decode(encode(s)) == s` for text in the vocabulary.

    Build one from a corpus with `KnowGPTTokenizerFast.from_corpus(text)`: for the same corpus its ids are
    the handouts' (`CharCorruptionDataset.stoi`), with one more id after them for unknown characters.
    Nothing is added around the text (no BOS/EOS).
    """

    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "right"

    @classmethod
    def from_corpus(cls, text: str, extra_characters: str = "", **kwargs) -> "KnowGPTTokenizerFast":
        """The handouts' vocabulary for `text` (plus any `extra_characters` it lacks), then the unknown id."""
        if not text:
            raise ValueError("KnowGPTTokenizerFast.from_corpus needs a non-empty corpus")
        characters = sorted((set(text) | set(extra_characters)) - {PAD_CHAR, MASK_CHAR})
        unk_token = UNK_CHAR if UNK_CHAR not in characters else "<unk>"
        vocabulary = {token: i for i, token in enumerate([PAD_CHAR, MASK_CHAR, *characters, unk_token])}
        backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=unk_token))
        # Any single code point is one token, newlines included; the decoder joins them back unchanged.
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return cls(
            tokenizer_object=backend,
            pad_token=PAD_CHAR,
            mask_token=MASK_CHAR,
            unk_token=unk_token,
            clean_up_tokenization_spaces=False,
            **kwargs,
        )

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
