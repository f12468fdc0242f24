"""Model card templates for KnowGPT checkpoints (rendered by `hf_knowgpt.model_card`)."""
