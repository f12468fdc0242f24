"""hf_knowgpt: the CS224N knowledge-access GPT as a Hugging Face model and tokenizer.

Importing the package registers the config, the models, the tokenizer and the "birthplace-qa" pipeline
with transformers' Auto classes; a saved checkpoint also carries this code (auto_map), so
`trust_remote_code=True` loads it without the package. Nothing heavy is imported here: names load from
their modules on first use, and each registration runs when the transformers module it extends is first
imported (`hf_knowgpt.auto_registration`), so `import hf_knowgpt` takes milliseconds.
"""

import importlib

from . import auto_registration

__version__ = "0.1.0"

_EXPORTS = {
    "options": ["ATTENTION_TYPES"],
    "configuration_knowgpt": ["KnowGPTConfig"],
    "modeling_knowgpt": ["KnowGPTForCausalLM", "KnowGPTModel", "KnowGPTPreTrainedModel"],
    "pipeline_birthplace_qa": ["BirthplaceQAPipeline"],
    "tokenization_knowgpt": ["MASK_CHAR", "PAD_CHAR", "UNK_CHAR", "KnowGPTTokenizerFast"],
    "auto_registration": ["register_auto_classes"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_MODULE_OF])


auto_registration.install()

__all__ = sorted(_MODULE_OF)
