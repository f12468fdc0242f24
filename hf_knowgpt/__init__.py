"""hf_knowgpt: the CS224N knowledge-access GPT as a Hugging Face model and tokenizer.

Importing the package registers the config, the models, the tokenizer and the "birthplace-qa" pipeline
with transformers' Auto classes; a saved checkpoint also carries this code (auto_map), so
`trust_remote_code=True` loads it without the package. Nothing heavy is imported here: names load from
their modules on first use, and each registration runs when the transformers module it extends is first
imported (`hf_knowgpt.auto_registration`), so `import hf_knowgpt` takes milliseconds.
"""

from . import auto_registration
from .utils.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "options": ["ATTENTION_TYPES"],
    "configuration_knowgpt": ["KnowGPTConfig"],
    "modeling_knowgpt": ["KnowGPTForCausalLM", "KnowGPTModel", "KnowGPTPreTrainedModel"],
    "pipeline_birthplace_qa": ["BirthplaceQAPipeline"],
    "tokenization_knowgpt": ["MASK_CHAR", "PAD_CHAR", "UNK_CHAR", "KnowGPTTokenizerFast"],
    "auto_registration": ["register_auto_classes"],
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

auto_registration.install()
