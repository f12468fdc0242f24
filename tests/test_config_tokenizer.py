import pytest
import torch
from conftest import WIKI, needs_data
from transformers import AutoConfig, AutoTokenizer

from hf_knowgpt import MASK_CHAR, PAD_CHAR, UNK_CHAR, KnowGPTConfig, KnowGPTTokenizerFast


def test_config_defaults_are_the_handouts_model():
    config = KnowGPTConfig()
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == (4, 8, 256, 128)
    assert (config.embd_pdrop, config.resid_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.1)
    assert config.attention_type == "vanilla" and config.bottleneck_dim == 32 and config.rope_theta == 10000
    assert (config.pad_token_id, config.mask_token_id) == (0, 1)
    # transformers' standard names map onto the minGPT names
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 8)
    assert config.max_position_embeddings == 128


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (dict(attention_type="linear"), "attention_type", "['vanilla', 'rope', 'synthesizer', 'perceiver']"),
        (dict(n_embd=100, n_head=8), "n_embd", "allowed n_head"),
        (dict(attention_type="rope", n_embd=24, n_head=8), "head size", "even"),
        (dict(attention_type="perceiver", bottleneck_dim=None), "bottleneck_dim", "1..block_size=128"),
        (dict(attention_type="perceiver", bottleneck_dim=129), "bottleneck_dim", "1..block_size=128"),
        (dict(attention_type="perceiver", n_layer=1), "n_layer", ">= 2"),
        (dict(n_layer=0), "n_layer", ">= 1"),
        (dict(attn_pdrop=1.5), "attn_pdrop", "[0, 1)"),
        (dict(pad_token_id=300), "pad_token_id", "0..vocab_size-1"),
    ],
)
def test_config_rejects_invalid_values_naming_field_and_allowed_values(overrides, field, allowed):
    with pytest.raises(ValueError) as error:
        KnowGPTConfig(**overrides)
    assert field in str(error.value) and allowed in str(error.value)


def test_config_round_trip_and_auto_config(tmp_path):
    import hf_knowgpt  # noqa: F401  (registers the Auto classes)

    config = KnowGPTConfig(attention_type="perceiver", bottleneck_dim=16, n_embd=64, n_head=4)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KnowGPTConfig)
    assert (loaded.attention_type, loaded.bottleneck_dim, loaded.n_embd, loaded.n_head) == ("perceiver", 16, 64, 4)


def handout_vocabulary(text):
    """The handouts' CharCorruptionDataset vocabulary: pad, mask, then sorted distinct characters."""
    return [PAD_CHAR, MASK_CHAR, *sorted(set(text))]


SAMPLE = "Ada Lovelace was born in London.\nJosé Martí was born in Havana, Cuba.\n"


def test_tokenizer_ids_match_the_handout_vocabulary_plus_unknown():
    tokenizer = KnowGPTTokenizerFast.from_corpus(SAMPLE)
    itos = handout_vocabulary(SAMPLE)
    assert [tokenizer.convert_tokens_to_ids(c) for c in itos] == list(range(len(itos)))
    assert len(tokenizer) == len(itos) + 1
    assert tokenizer.unk_token == UNK_CHAR and tokenizer.unk_token_id == len(itos)
    assert (tokenizer.pad_token_id, tokenizer.mask_token_id) == (0, 1)
    assert tokenizer.stoi["a"] == itos.index("a") and tokenizer.itos[itos.index("é")] == "é"


@pytest.mark.parametrize("text", ["José Martí was born in Havana", "  two  cases\nand a newline ", "⁇x⁇□□", ""])
def test_tokenizer_round_trips_in_vocabulary_text_one_id_per_character(text):
    tokenizer = KnowGPTTokenizerFast.from_corpus(SAMPLE + "x")
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # no BOS/EOS, one id per character
    assert tokenizer.decode(ids) == text


def test_tokenizer_maps_unknown_characters_to_unk():
    tokenizer = KnowGPTTokenizerFast.from_corpus(SAMPLE)
    ids = tokenizer("a中b")["input_ids"]
    assert ids == [tokenizer.stoi["a"], tokenizer.unk_token_id, tokenizer.stoi["b"]]


def test_tokenizer_save_load_and_auto_tokenizer(tmp_path):
    import hf_knowgpt  # noqa: F401

    tokenizer = KnowGPTTokenizerFast.from_corpus(SAMPLE)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(loaded, KnowGPTTokenizerFast)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded("José\nMartí")["input_ids"] == tokenizer("José\nMartí")["input_ids"]
    batch = loaded(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist()[2:] == [0, 0] and batch["attention_mask"][0].tolist() == [1, 1, 0, 0]


def test_tokenizer_keeps_transformers_tokenizer_contracts(tmp_path):
    """What tests/test_tokenization_common.py asks of any tokenizer, for one id per character and nothing
    added around the text: padding and truncation on either side, pairs, offsets, special tokens skipped in
    decoding, added tokens kept by save/load, and pickling."""
    import copy
    import pickle

    tokenizer = KnowGPTTokenizerFast.from_corpus(SAMPLE, padding_side="left")  # saved as an init argument
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "Ada London"}

    assert tokenizer("London", max_length=3, truncation=True)["input_ids"] == [ids[c] for c in "Lon"]
    tokenizer.truncation_side = "left"
    assert tokenizer("London", max_length=3, truncation=True)["input_ids"] == [ids[c] for c in "don"]
    tokenizer.truncation_side = "right"
    pair = tokenizer("Ada", "Lo")
    assert pair["input_ids"] == [ids[c] for c in "AdaLo"] and pair["attention_mask"] == [1] * 5
    assert tokenizer("Ada", return_offsets_mapping=True)["offset_mapping"] == [(0, 1), (1, 2), (2, 3)]

    batch = tokenizer(["Ada", "London"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == [0, 0, 0, *(ids[c] for c in "Ada")]
    assert batch["attention_mask"][0].tolist() == [0, 0, 0, 1, 1, 1]
    padded = tokenizer.pad({"input_ids": [[ids["A"]], [ids["A"], ids["d"]]]}, return_tensors="pt")
    assert padded["input_ids"].tolist() == [[0, ids["A"]], [ids["A"], ids["d"]]]
    assert tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True) == ["Ada", "London"]
    assert tokenizer.decode(tokenizer("Ada⁇London⁇")["input_ids"], skip_special_tokens=True) == "AdaLondon"

    assert tokenizer.add_tokens(["<fact>"]) == 1
    added = tokenizer.convert_tokens_to_ids("<fact>")
    assert added == len(tokenizer) - 1 and tokenizer("a<fact>d")["input_ids"] == [ids["a"], added, ids["d"]]
    tokenizer.save_pretrained(tmp_path)
    for copied in (KnowGPTTokenizerFast.from_pretrained(tmp_path), pickle.loads(pickle.dumps(tokenizer)),
                   copy.deepcopy(tokenizer)):  # fmt: skip
        assert copied.padding_side == "left" and len(copied) == len(tokenizer)
        assert copied("a<fact>d London")["input_ids"] == tokenizer("a<fact>d London")["input_ids"]
        assert copied.decode(copied("a<fact>d")["input_ids"]) == "a<fact>d"


def test_empty_corpus_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        KnowGPTTokenizerFast.from_corpus("")


@needs_data
def test_tokenizer_on_wiki_matches_the_original_256_ids():
    text = WIKI.read_text(encoding="utf-8")
    tokenizer = KnowGPTTokenizerFast.from_corpus(text)
    itos = handout_vocabulary(text)
    assert len(itos) == 256 and len(tokenizer) == 257
    assert all(tokenizer.convert_tokens_to_ids(c) == i for i, c in enumerate(itos))
    first_line = text.split("\n")[0]
    ids = tokenizer(first_line, return_tensors="pt")["input_ids"][0]
    assert torch.equal(ids, torch.tensor([itos.index(c) for c in first_line]))
    assert tokenizer.decode(ids) == first_line
