"""hf_knowgpt: the CS224N knowledge-access GPT as a Hugging Face model and tokenizer.

The model's own files sit here, flat, as a checkpoint carries them (`configuration_knowgpt`,
`modeling_knowgpt`, `attention_knowgpt`, `layers_knowgpt`, `tokenization_knowgpt`, `options`), beside the
"birthplace-qa" pipeline; the machinery around the model lives in packages named for their concept: `kernels`,
`training`, `analysis`, `commands`, `utils` (the README's layout table).

Importing the package registers the config, the models, the tokenizer and the pipeline with transformers'
Auto classes; a saved checkpoint also carries the model's code (auto_map), so `trust_remote_code=True`
loads it without the package. Nothing heavy is imported here: names load from their modules on first use,
and each registration runs when the transformers module it extends is first imported
(`hf_knowgpt.auto_registration`), so `import hf_knowgpt` takes milliseconds.
"""

from . import auto_registration
from .utils.lazy import lazy_exports

__version__ = "0.2.0"

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
