"""Model card templates for KnowGPT checkpoints (rendered by `hf_knowgpt.utils.model_card`)."""
