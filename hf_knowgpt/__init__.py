"""hf_knowgpt: the CS224N knowledge-access GPT as a Hugging Face model and tokenizer.

Importing the package registers the config, the models and the tokenizer with the Auto classes; a
saved checkpoint also carries this code (auto_map), so `trust_remote_code=True` loads it without
the package.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers.pipelines import PIPELINE_REGISTRY

from .configuration_knowgpt import ATTENTION_TYPES, KnowGPTConfig
from .modeling_knowgpt import KnowGPTForCausalLM, KnowGPTModel, KnowGPTPreTrainedModel
from .pipeline_birthplace_qa import BirthplaceQAPipeline
from .tokenization_knowgpt import MASK_CHAR, PAD_CHAR, UNK_CHAR, KnowGPTTokenizerFast

__version__ = "0.1.0"

AutoConfig.register(KnowGPTConfig.model_type, KnowGPTConfig, exist_ok=True)
AutoModel.register(KnowGPTConfig, KnowGPTModel, exist_ok=True)
AutoModelForCausalLM.register(KnowGPTConfig, KnowGPTForCausalLM, exist_ok=True)
AutoTokenizer.register(KnowGPTConfig, fast_tokenizer_class=KnowGPTTokenizerFast, exist_ok=True)

# Saved checkpoints get the modeling code beside the weights and an auto_map pointing at it.
KnowGPTConfig.register_for_auto_class()
KnowGPTModel.register_for_auto_class("AutoModel")
KnowGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
KnowGPTTokenizerFast.register_for_auto_class("AutoTokenizer")

if "birthplace-qa" not in PIPELINE_REGISTRY.get_supported_tasks():
    PIPELINE_REGISTRY.register_pipeline(
        "birthplace-qa", pipeline_class=BirthplaceQAPipeline, pt_model=AutoModelForCausalLM, type="text"
    )

__all__ = [
    "ATTENTION_TYPES",
    "BirthplaceQAPipeline",
    "KnowGPTConfig",
    "KnowGPTModel",
    "KnowGPTForCausalLM",
    "KnowGPTPreTrainedModel",
    "KnowGPTTokenizerFast",
    "PAD_CHAR",
    "MASK_CHAR",
    "UNK_CHAR",
]
