"""Checkpoints saved by an earlier version of the package load with this one, and with their own code
(`trust_remote_code`) in an environment without the package, and give the logits they gave when saved."""

import pytest
import torch
from conftest import ATTENTION_TYPES, REPO_ROOT, run_checkpoint_code_without_the_package
from safetensors.torch import load_file

FIXTURES = REPO_ROOT / "tests" / "fixtures"
SAVED_BY = {"0.1.0": FIXTURES / "knowgpt-0.1.0"}


def probe(folder):
    saved = load_file(folder / "probe.safetensors")
    return saved["input_ids"], saved["logits"]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("version", sorted(SAVED_BY))
def test_an_earlier_checkpoint_loads_into_this_package(version, attention_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_knowgpt  # noqa: F401  (registers the Auto classes)

    folder = SAVED_BY[version] / attention_type
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__module__.startswith("hf_knowgpt.")
    input_ids, logits = probe(folder)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, logits, rtol=0, atol=1e-5)
    assert tokenizer.decode(tokenizer("abc")["input_ids"]) == "abc"


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("version", sorted(SAVED_BY))
def test_an_earlier_checkpoint_runs_its_own_code_without_the_package(version, attention_type):
    folder = SAVED_BY[version] / attention_type
    run_checkpoint_code_without_the_package(
        folder,
        """
        from safetensors.torch import load_file
        probe = load_file(folder / "probe.safetensors")
        with torch.no_grad():
            torch.testing.assert_close(model(probe["input_ids"]).logits, probe["logits"], rtol=0, atol=1e-5)
        """,
    )
