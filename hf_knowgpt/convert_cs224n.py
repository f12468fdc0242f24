"""Bring a model trained with the CS224N handouts' code into the 🤗 format.

The handouts save `torch.save(model.state_dict(), path)` with minGPT's parameter names (`tok_emb`,
`pos_emb`, `blocks.N.attn.key`, `blocks.N.mlp.0`, `ln_f`, `head`, and `down_block`/`up_block`/`C` for
the perceiver, `w1`/`w2`/`b2` for the synthesizer). The vocabulary is not stored, so the corpus the model
was trained on (wiki.txt) rebuilds it. The converted model has one more vocabulary id than the original
(the unknown character): its embedding and head rows are zero and generation never picks it.
"""

import re
from pathlib import Path

import torch

from .configuration_knowgpt import KnowGPTConfig
from .modeling_knowgpt import KnowGPTForCausalLM
from .tokenization_knowgpt import KnowGPTTokenizerFast
from .utils.errors import InputError, MissingInputError

_BUFFERS = re.compile(r"(^|\.)attn\.(mask|rope_cache)$")
_RENAMES = [
    (re.compile(r"^tok_emb\.weight$"), "transformer.tok_emb.weight"),
    (re.compile(r"^ln_f\.(weight|bias)$"), r"transformer.ln_f.\1"),
    (re.compile(r"^head\.weight$"), "lm_head.weight"),
    (re.compile(r"^(blocks\.\d+|down_block|up_block)\.mlp\.0\.(weight|bias)$"), r"transformer.\1.mlp.fc.\2"),
    (re.compile(r"^(blocks\.\d+|down_block|up_block)\.mlp\.2\.(weight|bias)$"), r"transformer.\1.mlp.proj.\2"),
    (
        re.compile(r"^(blocks\.\d+|down_block|up_block)\.(ln1|ln2|attn\.\w+)\.(weight|bias)$"),
        r"transformer.\1.\2.\3",
    ),
    (re.compile(r"^(blocks\.\d+)\.attn\.(w2|b2)$"), r"transformer.\1.attn.\2"),
    (re.compile(r"^down_block\.C$"), "transformer.down_block.C"),
]


def load_cs224n_state_dict(path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(path, "no such file", "the params file the handouts' run.py wrote")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise InputError(path, f"not a readable torch state dict ({str(error).splitlines()[0]})") from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InputError(path, "holds no state dict of tensors", "torch.save(model.state_dict(), path) writes one")
    # nn.DataParallel prefixes every name with "module."
    return {name.removeprefix("module."): tensor for name, tensor in state.items()}


def infer_cs224n_config(state: dict[str, torch.Tensor], vocab_size: int, n_head: int | None = None) -> KnowGPTConfig:
    """Read the architecture off the tensors' names and shapes; n_head only where the weights cannot tell it."""
    if "tok_emb.weight" not in state or "head.weight" not in state:
        raise ValueError("not a CS224N GPT state dict: tok_emb.weight and head.weight are missing")
    original_vocab, n_embd = state["tok_emb.weight"].shape
    if original_vocab + 1 != vocab_size:
        raise ValueError(
            f"the checkpoint has {original_vocab} vocabulary ids but the corpus gives {vocab_size - 1}: "
            "convert with the corpus the model was trained on"
        )
    block_indices = {int(m.group(1)) for name in state if (m := re.match(r"blocks\.(\d+)\.", name))}
    n_blocks = max(block_indices) + 1 if block_indices else 0
    if "down_block.C" in state:
        attention_type, n_layer = "perceiver", n_blocks + 2
        bottleneck_dim = state["down_block.C"].shape[1]
    else:
        attention_type, n_layer, bottleneck_dim = "vanilla", n_blocks, 32
        if "blocks.0.attn.w2" in state:
            attention_type = "synthesizer"
            n_head = n_embd // state["blocks.0.attn.w2"].shape[0]
        elif "pos_emb" not in state:
            attention_type = "rope"
            if "blocks.0.attn.rope_cache" in state:
                n_head = n_embd // (2 * state["blocks.0.attn.rope_cache"].shape[1])
    if "pos_emb" in state:
        block_size = state["pos_emb"].shape[1]
    elif "blocks.0.attn.rope_cache" in state:
        block_size = state["blocks.0.attn.rope_cache"].shape[0]
    else:
        block_size = 128
    return KnowGPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head or 8,
        n_embd=n_embd,
        attention_type=attention_type,
        bottleneck_dim=bottleneck_dim,
        unk_token_id=vocab_size - 1,
    )


def convert_cs224n_state_dict(state: dict[str, torch.Tensor], config: KnowGPTConfig) -> dict[str, torch.Tensor]:
    """Rename the handouts' parameters to ours, dropping mask buffers and adding the unknown-character row."""
    converted = {}
    for name, tensor in state.items():
        if _BUFFERS.search(name):
            continue
        if name == "pos_emb":
            converted["transformer.pos_emb.weight"] = tensor.reshape(tensor.shape[-2], tensor.shape[-1])
            continue
        for pattern, replacement in _RENAMES:
            if pattern.match(name):
                converted[pattern.sub(replacement, name)] = tensor
                break
        else:
            raise ValueError(f"unexpected parameter {name!r} in the CS224N state dict")
    for name in ("transformer.tok_emb.weight", "lm_head.weight"):
        weight = converted[name]
        converted[name] = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
    # The synthesizer's B covers block_size - 1 key positions there (inputs are 127 long); ours covers
    # block_size. The extra position is never reached by inputs the original could take.
    for name in list(converted):
        if name.endswith("attn.w2") and converted[name].shape[1] == config.block_size - 1:
            converted[name] = torch.cat([converted[name], converted[name].new_zeros(converted[name].shape[0], 1)], 1)
        if name.endswith("attn.b2") and converted[name].shape[0] == config.block_size - 1:
            converted[name] = torch.cat([converted[name], converted[name].new_zeros(1)])
    return converted


def convert_cs224n_checkpoint(
    params_path, corpus_path, output_dir=None, n_head: int | None = None
) -> tuple[KnowGPTForCausalLM, KnowGPTTokenizerFast]:
    """Build (and save, when `output_dir` is given) the 🤗 model and tokenizer for a handout checkpoint."""
    corpus_path = Path(corpus_path)
    if not corpus_path.is_file():
        raise MissingInputError(corpus_path, "no such file", "the pretraining corpus the model was trained with")
    tokenizer = KnowGPTTokenizerFast.from_corpus(corpus_path.read_text(encoding="utf-8"))
    state = load_cs224n_state_dict(params_path)
    try:
        config = infer_cs224n_config(state, len(tokenizer), n_head=n_head)
        model = KnowGPTForCausalLM(config)
        converted = convert_cs224n_state_dict(state, config)
    except ValueError as error:  # the weights are not what the handouts' GPT saves, or not for this corpus
        raise InputError(params_path, str(error)) from error
    missing, unexpected = model.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise InputError(params_path, f"parameters missing {missing}, unexpected {unexpected}")
    model.generation_config.suppress_tokens = [tokenizer.unk_token_id]
    tokenizer.model_max_length = config.block_size
    model.eval()
    if output_dir is not None:
        model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    return model, tokenizer


__all__ = ["convert_cs224n_checkpoint", "convert_cs224n_state_dict", "infer_cs224n_config", "load_cs224n_state_dict"]
