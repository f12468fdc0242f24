import subprocess
import sys

import pytest
import torch
from conftest import ATTENTION_TYPES, REPO_ROOT
from cs224n_reference import GPT, Config
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_knowgpt.convert_cs224n import convert_cs224n_checkpoint

CORPUS = "Ada Lovelace was born in London.\nJosé Martí was born in Havana, Cuba.\nAlan Turing, Maida Vale.\n"


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_converted_checkpoint_reproduces_the_handout_model_logits(attention_type, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    vocab_size = len(set(CORPUS)) + 2
    torch.manual_seed(0)
    n_head = 4
    original = GPT(
        Config(vocab_size, 32, n_layer=4, n_head=n_head, n_embd=32, variant=attention_type, bottleneck_dim=8)
    )
    original.eval()
    params = tmp_path / f"{attention_type}.params"
    torch.save(original.state_dict(), params)

    output_dir = tmp_path / "converted"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "convert_cs224n_checkpoint.py"),
            "--params_path",
            str(params),
            "--corpus_path",
            str(corpus),
            "--output_dir",
            str(output_dir),
            "--n_head",
            str(n_head),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"({attention_type}, 4 layers, 4 heads, width 32" in result.stdout

    import hf_knowgpt  # noqa: F401

    converted = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    assert converted.config.attention_type == attention_type
    ids = torch.randint(0, vocab_size, (3, 31), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(ids)
        logits = converted(ids).logits
    assert logits.shape[-1] == vocab_size + 1  # plus the unknown-character id
    assert (logits[..., :vocab_size] - expected).abs().max() <= 1e-5
    # generation never picks the unknown id whose head row is zero
    assert converted.generation_config.suppress_tokens == [vocab_size]
    assert AutoTokenizer.from_pretrained(output_dir).model_max_length == 32  # the handout model's block


def test_converter_infers_heads_from_rope_and_synthesizer_weights(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    for variant in ("rope", "synthesizer"):
        original = GPT(Config(len(set(CORPUS)) + 2, 32, n_layer=2, n_head=2, n_embd=32, variant=variant))
        torch.save(original.state_dict(), tmp_path / "p.params")
        model, _ = convert_cs224n_checkpoint(tmp_path / "p.params", corpus)
        assert model.config.n_head == 2 and model.config.attention_type == variant


def test_converter_errors_name_the_problem(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="missing.params"):
        convert_cs224n_checkpoint(tmp_path / "missing.params", corpus)
    (tmp_path / "junk.params").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.params"):
        convert_cs224n_checkpoint(tmp_path / "junk.params", corpus)
    other = GPT(Config(len(set(CORPUS)) + 5, 32, n_layer=2, n_head=2, n_embd=32))
    torch.save(other.state_dict(), tmp_path / "other.params")
    with pytest.raises(ValueError, match="corpus the model was trained on"):
        convert_cs224n_checkpoint(tmp_path / "other.params", corpus)
