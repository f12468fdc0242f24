"""Uploading a checkpoint to the Hugging Face Hub (or any server that speaks its API, set by HF_ENDPOINT)."""

from pathlib import Path

from huggingface_hub import HfApi

from .checkpoints import CHECKPOINT_PREFIX, STAGING_PREFIX


def push_checkpoint(folder, repo_id: str, token: str | None = None, private: bool | None = None, commit_message=None):
    """Create the model repo if needed and upload the checkpoint folder: config, weights, tokenizer, card and
    code. Intermediate checkpoints and TensorBoard logs stay local."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a saved checkpoint (no config.json)")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message or f"Upload KnowGPT checkpoint from {folder.name}",
        ignore_patterns=[f"{CHECKPOINT_PREFIX}*/**", f"{STAGING_PREFIX}*", "runs/**", "*.tfevents.*"],
    )


__all__ = ["push_checkpoint"]
