"""KnowGPT held to the contracts of transformers' own common tests, for all four attention types:
`tests/test_modeling_common.py` (test_attention_outputs, test_hidden_states_output,
test_training_gradient_checkpointing*, test_can_set_attention_dynamically, test_cpu_offload,
test_disk_offload_* and test_model_parallelism (on two GPUs), the batching, outputs, embeddings,
retained-gradient, resizing, missing-weights, half-precision and meta-device tests, test_torch_export, check
config defaults); `tests/generation/test_utils.py` (attentions from generate, assisted and prompt-lookup
decoding); the causal-LM loss of `transformers.loss.loss_utils`; `tests/test_tokenization_common.py` (every
constructor path gives the same tokenizer, a vocabulary given as (token, score) pairs included). And PEFT's
LoRA adapters. `tests/test_modeling.py` holds the causality and cache-format contracts
(test_past_key_values_format: keys and values per head).

Where a contract cannot apply as written, the test says why: the perceiver's latent layers work on
bottleneck_dim positions, so their attention weights and hidden states are not (T, T) and (T, C)."""

import warnings

import pytest
import torch
from conftest import (
    ATTENTION_TYPES,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    perturbed_model,
    tiny_config,
)
from transformers import pipeline
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_knowgpt import KnowGPTForCausalLM, KnowGPTTokenizerFast
from hf_knowgpt.tokenization_knowgpt import MASK_CHAR

CACHE_RENAMED = "cache" in CausalLMOutputWithPast.__dataclass_fields__
BATCH, LENGTH = 2, 10


make_model = perturbed_model


def inputs():
    return torch.randint(2, 22, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def expected_attention_shapes(config):
    """(heads, queries, keys) of each layer's weights. Self-attention types: (H, T, T). The perceiver: the
    down-projection's latents over the input, the latent blocks, the input over the latents."""
    heads, latents = config.n_head, config.bottleneck_dim
    if config.attention_type != "perceiver":
        return [(heads, LENGTH, LENGTH)] * config.n_layer
    middle = [(heads, latents, latents)] * (config.n_layer - 2)
    return [(heads, latents, LENGTH), *middle, (heads, LENGTH, latents)]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_attention_outputs_by_keyword_and_by_config(attention_type):
    model = make_model(attention_type)
    model.set_attn_implementation("eager")
    ids = inputs()
    with torch.no_grad():
        by_keyword = model(ids, output_attentions=True)
        model.config.output_attentions = True
        by_config = model(ids)
        model.config.output_attentions = False
        neither = model(ids)
        # attentions come last, after the hidden states (test_attention_outputs' order check)
        both = model(ids, output_attentions=True, output_hidden_states=True)
    shapes = expected_attention_shapes(model.config)
    for outputs in (by_keyword, by_config):
        assert len(outputs.attentions) == model.config.n_layer
        assert [tuple(a.shape[1:]) for a in outputs.attentions] == shapes
        assert all(a.shape[0] == BATCH for a in outputs.attentions)
    assert neither.attentions is None
    assert len(both) == len(by_keyword) + 1 and list(both.keys())[-2:] == ["hidden_states", "attentions"]
    for weights in by_keyword.attentions:  # probabilities over the keys (eval: no dropout)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    if attention_type != "perceiver":  # causal: no query sees a later key
        future = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
        assert all(float(w[..., future].abs().max()) == 0.0 for w in by_keyword.attentions)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_attentions_from_a_fused_implementation_come_from_eager_with_one_warning(attention_type, caplog):
    model = make_model(attention_type)
    ids = inputs()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids, output_attentions=True)
        model.set_attn_implementation("sdpa")
        with caplog.at_level("WARNING"):
            fused = model(ids, output_attentions=True)
            model(ids, output_attentions=True)
    assert sum("eager implementation" in record.message for record in caplog.records) <= 1
    for a, b in zip(eager.attentions, fused.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(eager.logits, fused.logits)
    assert model.config._attn_implementation == "sdpa"  # the call used eager; the model keeps its own


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_generate_returns_attentions(attention_type):
    model = make_model(attention_type)
    prompt = inputs()[:, :5]
    output = model.generate(
        prompt, max_new_tokens=3, do_sample=False, eos_token_id=None, output_attentions=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert len(output.attentions) == 3  # one tuple per generated token
    assert all(len(step) == model.config.n_layer for step in output.attentions)
    first_layer_keys = [step[0].shape[-1] for step in output.attentions]
    if attention_type == "perceiver":  # the down-projection reads the cached input: 5, 6, 7 positions
        assert first_layer_keys == [5, 6, 7]
    else:
        assert first_layer_keys == [5, 6, 7] and [step[0].shape[-2] for step in output.attentions] == [5, 1, 1]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_hidden_states_output_by_keyword_and_by_config(attention_type):
    """n_layer + 1 states (test_hidden_states_output): the embeddings, each block's output, the last after
    the final LayerNorm. The perceiver's latent states have bottleneck_dim positions, not T."""
    model = make_model(attention_type)
    ids = inputs()
    with torch.no_grad():
        by_keyword = model(ids, output_hidden_states=True)
        model.config.output_hidden_states = True
        by_config = model(ids)
        base = model.transformer(ids)
    for outputs in (by_keyword, by_config):
        states = outputs.hidden_states
        assert len(states) == model.config.n_layer + 1
        assert tuple(states[0].shape) == (BATCH, LENGTH, model.config.n_embd)
        torch.testing.assert_close(states[-1], base.last_hidden_state)
        if attention_type == "perceiver":
            latent = (BATCH, model.config.bottleneck_dim, model.config.n_embd)
            assert [tuple(s.shape) for s in states[1:-1]] == [latent] * (model.config.n_layer - 1)
        else:
            assert all(tuple(s.shape) == (BATCH, LENGTH, model.config.n_embd) for s in states)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_config_return_dict_and_use_cache_are_the_defaults_keywords_override(attention_type):
    model = make_model(attention_type)
    ids = inputs()
    cache_field = "cache" if CACHE_RENAMED else "past_key_values"
    with torch.no_grad():
        assert getattr(model(ids), cache_field) is not None  # config.use_cache is True
        model.config.use_cache = False
        assert getattr(model(ids), cache_field) is None
        assert getattr(model(ids, use_cache=True), cache_field) is not None
        model.config.return_dict = False
        as_tuple = model(ids)
        assert isinstance(as_tuple, tuple)
        assert isinstance(model(ids, return_dict=True), CausalLMOutputWithPast)
        torch.testing.assert_close(as_tuple[0], model(ids, return_dict=True).logits)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_loss_follows_transformers_causal_lm_loss(attention_type):
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = make_model(attention_type)
    ids = inputs()
    labels = ids.clone()
    labels[0, :4] = -100
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        by_labels = model(ids, labels=labels)
        by_shift_labels = model(ids, shift_labels=shifted)
        summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(40))
        reference = ForCausalLMLoss(by_labels.logits, labels, model.config.vocab_size)
        reference_summed = ForCausalLMLoss(
            by_labels.logits, labels, model.config.vocab_size, num_items_in_batch=torch.tensor(40)
        )
    torch.testing.assert_close(by_labels.loss, reference)
    torch.testing.assert_close(by_shift_labels.loss, reference)
    torch.testing.assert_close(summed.loss, reference_summed)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_the_old_cache_keyword_works_and_warns_where_transformers_renamed_it(attention_type):
    model = make_model(attention_type)
    prompt, step = inputs()[:, :6], inputs()[:, 6:7]
    with torch.no_grad():
        first = model(prompt, use_cache=True)
        cache = first.cache if CACHE_RENAMED else first.past_key_values
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = model(step, past_key_values=cache, use_cache=True).logits
        cache = model(prompt, use_cache=True)
        cache = cache.cache if CACHE_RENAMED else cache.past_key_values
        new = model(step, **{"cache" if CACHE_RENAMED else "past_key_values": cache}, use_cache=True).logits
    torch.testing.assert_close(old, new)
    future = [w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]
    assert bool(future) == CACHE_RENAMED  # transformers' own deprecation notice where it renamed the keyword


CHECKPOINTING_OPTIONS = [
    pytest.param({}, id="every-layer"),
    pytest.param({"every_n_layers": 2}, id="every-second-layer"),
    pytest.param(  # transformers pins the host copies, which a torch without an accelerator refuses
        {"offload": True},
        id="offloaded",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading pins host memory: needs CUDA"),
    ),
]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("options", CHECKPOINTING_OPTIONS)
def test_gradient_checkpointing_gives_the_plain_gradients(attention_type, use_reentrant, options):
    """check_training_gradient_checkpointing: every checkpointed layer's forward runs again in the backward
    pass (every `every_n_layers`-th layer where given), and the gradients equal the plain ones (dropout included:
    checkpointing replays its RNG state), with the saved activations offloaded to the host or not."""
    device = "cuda" if options.get("offload") else "cpu"
    model = make_model(attention_type).to(device)
    assert model.supports_gradient_checkpointing
    model.train()
    ids = inputs().to(device)

    def gradients():
        model.zero_grad()
        torch.manual_seed(7)
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == model.config.n_layer >= 2  # every block, the perceiver's projections included
    calls = []
    # Each layer's first LayerNorm runs once a forward pass, and again where the backward pass recomputes it.
    for index, layer in enumerate(layers):
        layer.ln1.register_forward_pre_hook(lambda *_, index=index: calls.append(index))
    plain = gradients()
    assert calls == list(range(len(layers))) and not any(layer.gradient_checkpointing for layer in layers)
    every = options.get("every_n_layers", 1)
    enable_activation_checkpointing(model, {"use_reentrant": use_reentrant}, **options)
    assert [layer.gradient_checkpointing for layer in layers] == [i % every == 0 for i in range(len(layers))]
    calls.clear()
    checkpointed = gradients()
    recomputed = sorted(calls[len(layers) :])
    assert calls[: len(layers)] == list(range(len(layers))) and recomputed == list(range(0, len(layers), every))
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)
    disable_activation_checkpointing(model)
    assert not any(layer.gradient_checkpointing for layer in layers)


SAMPLE = "Ada Lovelace was born in London.\nJosé Martí was born in Havana.\n"


def test_every_tokenizer_constructor_gives_the_same_backend(tmp_path):
    """test_tokenization_common's rebuild contracts: from a vocabulary, from tokenizer.json, from a corpus
    and from_pretrained, the same per-character splitting, unknown id and decoding."""
    from transformers import AutoTokenizer

    import hf_knowgpt  # noqa: F401

    from_corpus = KnowGPTTokenizerFast.from_corpus(SAMPLE)
    from_corpus.save_pretrained(tmp_path)
    tokenizers = {
        "from_corpus": from_corpus,
        "vocab": KnowGPTTokenizerFast(vocab=from_corpus.get_vocab()),
        # tokens in id order, as (token, score) pairs: how transformers' TokenizersExtractor lists a vocabulary
        "vocab_scores": KnowGPTTokenizerFast(
            vocab=[(token, 0.0) for token in from_corpus.convert_ids_to_tokens(list(range(len(from_corpus))))]
        ),
        "tokenizer_file": KnowGPTTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json")),
        "from_pretrained": KnowGPTTokenizerFast.from_pretrained(tmp_path),
        "AutoTokenizer": AutoTokenizer.from_pretrained(tmp_path),
    }
    text = "José 中 ⁇\nLondon"  # "中" is outside the vocabulary
    expected = from_corpus(text)["input_ids"]
    assert expected[5] == from_corpus.unk_token_id and len(expected) == len(text)
    for name, tokenizer in tokenizers.items():
        assert type(tokenizer) is KnowGPTTokenizerFast, name
        assert tokenizer(text)["input_ids"] == expected, name
        assert tokenizer.decode(tokenizer("José ⁇\nLondon")["input_ids"]) == "José ⁇\nLondon", name
        assert (tokenizer.pad_token_id, tokenizer.mask_token_id, tokenizer.eos_token_id) == (0, 1, 1), name
        assert tokenizer.unk_token_id == len(tokenizer) - 1, name


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_assisted_and_prompt_lookup_decoding_give_greedy_tokens(attention_type):
    """tests/generation/test_utils.py's test_assisted_decoding_matches_greedy_search and
    test_prompt_lookup_decoding_matches_greedy_search: candidates are checked against the model and the
    cache is cropped back where they are rejected, so the tokens are greedy decoding's."""
    model = make_model(attention_type)
    assistant = make_model(attention_type)  # another model, whose candidates are often rejected
    with torch.no_grad():
        for parameter in assistant.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])  # repeats, so that prompt lookup finds candidates
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    greedy = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **kwargs), greedy)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **kwargs), greedy)


@pytest.mark.parametrize("way", ["config", "from_pretrained", "set_attn_implementation"])
def test_every_way_of_choosing_attention_takes_knowgpts_implementations_and_refuses_others(way, tmp_path):
    """test_modeling_common's test_can_set_attention_dynamically: the config, `from_pretrained` and
    `set_attn_implementation` (by name or as {"": name}) take "eager", "sdpa" and "triton" (SDPA off a GPU,
    so the logits agree) and refuse the rest with transformers' own message."""
    model = make_model("vanilla")
    model.save_pretrained(tmp_path)
    ids = inputs()
    expected = model(ids).logits

    def build(implementation):
        if way == "config":
            built = KnowGPTForCausalLM(tiny_config("vanilla", attn_implementation=implementation))
            built.load_state_dict(model.state_dict())
            return built.eval()
        if way == "from_pretrained":
            return KnowGPTForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation).eval()
        model.set_attn_implementation(implementation if implementation != "eager" else {"": "eager"})
        return model

    for implementation in ("eager", "triton", "sdpa"):
        built = build(implementation)
        assert built.config._attn_implementation == implementation
        assert torch.allclose(built(ids).logits, expected, atol=1e-5)
    for refused in ("foo", "flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match=f'Specified `attn_implementation="{refused}"` is not supported'):
            build(refused)
    if way == "set_attn_implementation":
        assert model.config._attn_implementation == "sdpa"  # a refused name changes nothing


class Scripted:
    """A forward hook whose logits write `script` after the prompt (the input of a generation's first call),
    then its last character forever: a model whose generations are known."""

    def __init__(self, script, vocab_size):
        self.script, self.vocab_size, self.prompt_length = script, vocab_size, 0

    def __call__(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() - ids.shape[1] if cache is not None else 0  # the forward added ids
        if past == 0:
            self.prompt_length = ids.shape[1]
        logits = torch.full((*ids.shape, self.vocab_size), -10.0)
        for t in range(ids.shape[1]):
            written = past + t + 1 - self.prompt_length  # characters generated after position t
            logits[:, t, self.script[min(max(written, 0), len(self.script) - 1)]] = 10.0
        output.logits = logits
        return output


def test_generation_stops_at_the_closing_mark_and_the_pipeline_reads_well():
    tokenizer = KnowGPTTokenizerFast.from_corpus("Where was Ada born?\tWarsaw Paris\n")
    prompt = "Where was Ada born?" + MASK_CHAR
    config = tiny_config("vanilla", vocab_size=len(tokenizer), unk_token_id=tokenizer.unk_token_id, block_size=64)
    model = KnowGPTForCausalLM(config).eval()
    assert (model.config.eos_token_id, model.generation_config.eos_token_id) == (1, 1)
    assert model.generation_config.pad_token_id == 0
    script = tokenizer("Warsaw" + MASK_CHAR + "Paris")["input_ids"]
    model.register_forward_hook(Scripted(script, len(tokenizer)), with_kwargs=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert tokenizer.decode(generated[0]) == prompt + "Warsaw" + MASK_CHAR  # stops after the answer
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)(prompt, max_new_tokens=20)
    assert text[0]["generated_text"] == prompt + "Warsaw"


def test_a_question_without_room_for_its_answer_is_flagged_not_answered():
    """A question that leaves fewer positions of the block than an answer needs (here 4 of 64) gets no
    answer: the fragment the model wrote before running out is kept apart as best_guess."""
    short, long = "Where was Ada born?", "Where was Ada " + "L" * 39 + " born?"
    tokenizer = KnowGPTTokenizerFast.from_corpus(short + long + "London")
    config = tiny_config("vanilla", vocab_size=len(tokenizer), unk_token_id=tokenizer.unk_token_id, block_size=64)
    model = KnowGPTForCausalLM(config).eval()
    model.register_forward_hook(
        Scripted(tokenizer("London" + MASK_CHAR)["input_ids"], len(tokenizer)), with_kwargs=True
    )
    assert 64 - (len(long) + 1) == 4
    answers = pipeline("birthplace-qa", model=model, tokenizer=tokenizer)([short, long], batch_size=1)
    assert answers[0]["answer"] == "London" and answers[0]["truncated"] is False
    flagged = answers[1]
    assert flagged["truncated"] is True and flagged["answer"] is None and flagged["abstained"] is True
    assert flagged["best_guess"] == "Lond"


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_generation_modes_keep_transformers_generation_contracts(attention_type):
    """tests/generation/test_utils.py's contracts beyond greedy decoding: greedy scores are the logits the
    tokens were chosen from; beam search returns num_return_sequences rows whose sequences_scores are the
    model's own length-normalized log-probabilities; sampling repeats with the seed; generation from
    inputs_embeds and generation continued from a returned cache give the one-shot tokens."""
    model = make_model(attention_type)
    prompt = inputs()[:, :5]
    fixed_length = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=0, eos_token_id=None)

    greedy = model.generate(prompt, do_sample=False, return_dict_in_generate=True, output_scores=True, **fixed_length)
    chosen = torch.stack(greedy.scores, dim=1).argmax(-1)
    assert torch.equal(chosen, greedy.sequences[:, 5:])

    beams = model.generate(
        prompt, num_beams=3, num_return_sequences=2, do_sample=False, length_penalty=1.0,
        return_dict_in_generate=True, output_scores=True, **fixed_length,
    )  # fmt: skip
    assert beams.sequences.shape == (2 * BATCH, 11) and beams.sequences_scores.shape == (2 * BATCH,)
    with torch.no_grad():
        log_probs = model(beams.sequences).logits[:, 4:-1].float().log_softmax(-1)
    own = log_probs.gather(-1, beams.sequences[:, 5:, None]).squeeze(-1).sum(-1) / 6
    torch.testing.assert_close(beams.sequences_scores, own, atol=1e-4, rtol=0)
    assert (beams.sequences_scores[0::2] >= beams.sequences_scores[1::2]).all()  # best beam first

    def sampled(seed):
        torch.manual_seed(seed)
        return model.generate(prompt, do_sample=True, temperature=2.0, **fixed_length)

    assert torch.equal(sampled(3), sampled(3)) and not torch.equal(sampled(3), sampled(4))

    one_shot = greedy.sequences
    embedded = model.generate(inputs_embeds=model.get_input_embeddings()(prompt), do_sample=False, **fixed_length)
    assert torch.equal(embedded, one_shot[:, 5:])  # as transformers returns it: the new tokens only
    three_tokens = {**fixed_length, "max_new_tokens": 3, "min_new_tokens": 3}
    first = model.generate(prompt, do_sample=False, return_dict_in_generate=True, **three_tokens)
    # the mask given: generated pad ids (0) would otherwise be read as padding
    continued = model.generate(
        first.sequences, attention_mask=torch.ones_like(first.sequences), cache=first.cache, do_sample=False,
        **three_tokens,
    )  # fmt: skip
    assert torch.equal(continued, one_shot)


def left_padded_generation(ids):
    """generate()'s arguments for the first 6 tokens of `ids`, the first row left-padded by 3, so that
    generation's positions and visibility are both exercised."""
    mask = torch.ones_like(ids[:, :6])
    mask[0, :3] = 0
    return dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_weights_offloaded_by_a_device_map_give_the_same_logits_and_tokens(attention_type, tmp_path):
    """test_cpu_offload / test_disk_offload_safetensors: loaded with `device_map="auto"` and too little memory,
    part of the model stays in memory and the rest is read from disk at each call (accelerate's hooks), and
    the logits and generated tokens are the model's own."""
    from accelerate.utils import compute_module_sizes

    model = make_model(attention_type)
    model.save_pretrained(tmp_path / "model")
    ids = inputs()
    generation = left_padded_generation(ids)
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids[:, :6], **generation)
    for share in (0.0, 0.6):  # every weight on disk; the embeddings in memory, the blocks and head on disk
        offloaded = KnowGPTForCausalLM.from_pretrained(
            tmp_path / "model", device_map="auto", offload_folder=tmp_path / f"offload{share}",
            max_memory={"cpu": int(share * compute_module_sizes(model)[""])},
        )  # fmt: skip
        places = set(offloaded.hf_device_map.values())
        assert "disk" in places and (share == 0) == (places == {"disk"})
        with torch.no_grad():
            torch.testing.assert_close(offloaded(ids).logits, logits, atol=0, rtol=0)
        assert torch.equal(offloaded.generate(ids[:, :6], **generation), tokens)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a device map over two GPUs needs two CUDA devices")
@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_a_device_map_over_two_gpus_gives_the_one_gpu_logits_and_tokens(attention_type, tmp_path):
    """test_model_parallelism / test_multi_gpu_data_parallel_forward's spirit: the embeddings and first block on
    one GPU, the other blocks and the head on another; the positions and masks every block shares move with
    the hidden states (`AttentionContext.to`), and the logits and generated tokens are the one-GPU model's."""
    model = make_model(attention_type).to("cuda:0")
    model.save_pretrained(tmp_path / "model")
    device_map, device = {}, 0
    for name, module in model.transformer.named_children():  # in order: the first block is the last on GPU 0
        if name != "blocks":
            device_map[f"transformer.{name}"] = device
            continue
        for index in range(len(module)):
            device_map[f"transformer.blocks.{index}"], device = device, 1
    device_map.update(lm_head=1, future_heads=1)
    split = KnowGPTForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map)
    assert set(split.hf_device_map.values()) == {0, 1}
    ids = inputs().to("cuda:0")
    generation = left_padded_generation(ids)
    with torch.no_grad():
        torch.testing.assert_close(split(ids).logits.to("cuda:0"), model(ids).logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(split.generate(ids[:, :6], **generation).cpu(), model.generate(ids[:, :6], **generation).cpu())


def test_the_attention_context_moves_with_its_block_to_another_device():
    """A `device_map` over several devices moves each block's arguments to the block's device (accelerate's
    `send_to_device`): the positions and masks that every block shares go with them."""
    from accelerate.utils import send_to_device

    from hf_knowgpt.attention_knowgpt import AttentionContext

    positions, valid = torch.arange(4)[None], torch.tensor([[False, True, True, True]])
    context = AttentionContext(positions, positions, valid, causal_only=False, implementation="eager", by_length=True)
    moved = send_to_device(context, "meta")
    assert isinstance(moved, AttentionContext) and moved is not context
    for name in ("query_positions", "key_positions", "key_valid", "query_order", "key_order"):
        assert getattr(moved, name).device.type == "meta" and getattr(context, name).device.type == "cpu"
    assert (moved.causal_only, moved.implementation, moved.by_length) == (False, "eager", True)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_modeling_keeps_transformers_common_contracts(attention_type, tmp_path):
    """test_batching_equivalence, test_model_outputs_equivalence (tuples and dicts),
    test_inputs_embeds_matches_input_ids, test_retain_grad_hidden_states_attentions,
    test_resize_tokens_embeddings, test_can_init_all_missing_weights, test_save_load of a half-precision
    model and test_can_load_with_meta_device_context_manager."""
    model = make_model(attention_type)
    ids = torch.randint(2, 22, (3, LENGTH), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batched = model(ids, output_hidden_states=True)
        for row in range(3):
            alone = model(ids[row : row + 1], output_hidden_states=True)
            torch.testing.assert_close(alone.logits[0], batched.logits[row], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                alone.hidden_states[-1][0], batched.hidden_states[-1][row], atol=1e-5, rtol=1e-5
            )
        as_dict = model(ids, output_hidden_states=True, output_attentions=True)
        as_tuple = model(ids, output_hidden_states=True, output_attentions=True, return_dict=False)
        torch.testing.assert_close(model(inputs_embeds=model.get_input_embeddings()(ids)).logits, batched.logits)
    assert len(as_tuple) == len(as_dict)
    for in_tuple, (name, in_dict) in zip(as_tuple, as_dict.items()):
        if name != "cache":  # the tuple holds the dict's fields in order, the same tensors
            pairs = [(in_tuple, in_dict)] if torch.is_tensor(in_dict) else list(zip(in_tuple, in_dict, strict=True))
            assert all(torch.equal(*pair) for pair in pairs), name

    model.train()
    out = model(ids, output_hidden_states=True, output_attentions=True)
    embeddings, first_attention = out.hidden_states[0], out.attentions[0]
    embeddings.retain_grad(), first_attention.retain_grad()
    out.logits.sum().backward()
    assert embeddings.grad is not None and first_attention.grad is not None
    model.eval()

    model.resize_token_embeddings(30, mean_resizing=False)
    assert model.config.vocab_size == 30 and model.get_output_embeddings().weight.shape[0] == 30
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :23], batched.logits)  # old ids score as before
    model.resize_token_embeddings(33, pad_to_multiple_of=8, mean_resizing=False)
    assert model.config.vocab_size == 40 and model(ids).logits.shape[-1] == 40

    model.transformer.save_pretrained(tmp_path / "backbone")  # no head: from_pretrained must initialise it
    with_new_head = KnowGPTForCausalLM.from_pretrained(tmp_path / "backbone")
    assert abs(with_new_head.lm_head.weight.std().item() - model.config.initializer_range) < 0.005

    half = make_model(attention_type).to(torch.bfloat16)
    half.save_pretrained(tmp_path / "half")
    reloaded = KnowGPTForCausalLM.from_pretrained(tmp_path / "half")
    assert reloaded.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits.float(), batched.logits, atol=0.05, rtol=0.05)
    assert torch.equal(reloaded.generate(ids[:, :4], max_new_tokens=3, do_sample=False)[:, :4], ids[:, :4])

    with torch.device("meta"):
        on_meta = KnowGPTForCausalLM(model.config)
    assert {parameter.device.type for parameter in on_meta.parameters()} == {"meta"}


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_lora_adapters_train_save_reload_and_merge(attention_type, tmp_path):
    """PEFT's LoRA on the attention's projections (the synthesizer's value and MLP input: it has no query):
    a fresh adapter leaves the logits as they were, training moves them, the saved adapter reloads onto a
    fresh copy of the model with the trained logits, and merging it into the weights keeps them."""
    from peft import LoraConfig, PeftModel, get_peft_model

    targets = ["value", "fc"] if attention_type == "synthesizer" else ["query", "value"]
    ids = inputs()
    with torch.no_grad():
        plain = make_model(attention_type)(ids).logits
    adapted = get_peft_model(make_model(attention_type), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, plain, atol=0, rtol=0)
    trainable = [parameter for parameter in adapted.parameters() if parameter.requires_grad]
    assert trainable and all("lora_" in name for name, p in adapted.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    adapted.train()
    for _ in range(3):
        adapted(input_ids=ids, labels=ids).loss.backward()
        optimizer.step(), optimizer.zero_grad()
    adapted.eval()
    with torch.no_grad():
        trained = adapted(ids).logits
    assert (trained - plain).abs().max() > 1e-3
    adapted.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(make_model(attention_type), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained, atol=0, rtol=0)
        torch.testing.assert_close(reloaded.merge_and_unload()(ids).logits, trained, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_torch_export_gives_the_models_logits(attention_type):
    """test_torch_export: the model exports with `torch.export` (no cache), and the exported program gives
    the model's logits on inputs other than those it was traced with."""
    model = make_model(attention_type)
    traced_with, other = inputs(), torch.randint(2, 22, (BATCH, LENGTH), generator=torch.Generator().manual_seed(5))
    exported = torch.export.export(model, args=(), kwargs={"input_ids": traced_with, "use_cache": False}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(
            exported.module()(input_ids=other, use_cache=False).logits, model(other).logits, atol=1e-6, rtol=1e-5
        )
