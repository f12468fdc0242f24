import copy

import pytest
import torch
from conftest import (
    ATTENTION_TYPES,
    enable_activation_checkpointing,
    perturbed_model,
    run_checkpoint_code_without_the_package,
    tiny_config,
)
from torch.nn import functional as F
from transformers import AutoModel, AutoModelForCausalLM

from hf_knowgpt import KnowGPTForCausalLM, KnowGPTModel, KnowGPTTokenizerFast, attention_knowgpt, layers_knowgpt
from hf_knowgpt.attention_knowgpt import TokenGrid

VOCAB = 23


make_model = perturbed_model


def random_ids(batch, length, seed=1):
    return torch.randint(2, VOCAB - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_output_shapes(attention_type):
    model = make_model(attention_type)
    ids = random_ids(3, 11)
    out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (3, 11, VOCAB)
    assert out.hidden_states[-1].shape == (3, 11, 16)
    base = model.transformer(ids)
    assert base.last_hidden_state.shape == (3, 11, 16)
    assert isinstance(model.transformer, KnowGPTModel)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_loss_equals_hand_computation_and_handout_xy_loss(attention_type):
    model = make_model(attention_type)
    sequence = random_ids(2, 12)
    sequence[0, 9:] = 0  # right padding "□"
    labels = sequence.masked_fill(sequence == 0, -100)
    out = model(sequence, labels=labels)

    log_probs = out.logits.log_softmax(-1)
    terms = [-log_probs[b, t, labels[b, t + 1]] for b in range(2) for t in range(11) if labels[b, t + 1] != -100]
    assert torch.allclose(out.loss, torch.stack(terms).mean(), atol=1e-6)

    # The handouts' (x, y) = (s[:-1], s[1:]) with cross_entropy(ignore_index=pad) gives the same number.
    x, y = sequence[:, :-1], sequence[:, 1:]
    handout_loss = F.cross_entropy(model(x).logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=0)
    assert torch.allclose(out.loss, handout_loss, atol=1e-6)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_save_load_round_trip_gives_identical_logits(attention_type, tmp_path):
    model = make_model(attention_type)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, KnowGPTForCausalLM)
    ids = random_ids(2, 9)
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    backbone = AutoModel.from_pretrained(tmp_path).eval()
    assert torch.equal(backbone(ids).last_hidden_state, model.transformer(ids).last_hidden_state)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_causality_later_tokens_never_change_earlier_logits(attention_type):
    model = make_model(attention_type)
    ids = random_ids(2, 15)
    for changed in (0, 6, 7, 14):  # inside and beyond the perceiver's 7 latents
        edited = ids.clone()
        edited[:, changed] = (edited[:, changed] + 3) % (VOCAB - 2) + 2
        before, after = model(ids).logits, model(edited).logits
        assert torch.allclose(before[:, :changed], after[:, :changed], atol=1e-6)
        assert not torch.allclose(before[:, changed], after[:, changed])


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("positions", ["zeros", "restarting"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_position_ids_place_tokens_but_never_let_them_see_later_ones(attention_type, positions, with_mask):
    """As in transformers' models, causality follows the tokens' order whatever `position_ids` say (all at
    position 0, or restarting as packed documents' do): they change how tokens are encoded only."""
    model = make_model(attention_type)
    ids = random_ids(2, 12)
    position_ids = torch.zeros(2, 12, dtype=torch.long)
    if positions == "restarting":
        position_ids = torch.arange(12).remainder(4).expand(2, -1)
    mask = torch.ones(2, 12, dtype=torch.long) if with_mask else None
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    for changed in (3, 8, 11):
        edited = ids.clone()
        edited[:, changed] = (edited[:, changed] + 3) % (VOCAB - 2) + 2
        after = model(edited, attention_mask=mask, position_ids=position_ids).logits
        assert torch.allclose(logits[:, :changed], after[:, :changed], atol=1e-6)
    # the default positions are the tokens' indices, and a query sees every earlier token under any positions
    assert torch.allclose(model(ids, position_ids=torch.arange(12)[None]).logits, model(ids).logits, atol=1e-6)
    edited = ids.clone()  # a token's change reaches every later one, whatever their positions
    edited[:, 5] = (edited[:, 5] + 3) % (VOCAB - 2) + 2
    after = model(edited, attention_mask=mask, position_ids=position_ids).logits
    assert not torch.isclose(logits[:, 5:], after[:, 5:], atol=1e-6).all(dim=-1).any()


@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer"])
def test_the_cache_holds_keys_and_values_per_head_as_transformers_caches_do(attention_type):
    """(batch, heads, time, head_dim) for keys and values of every layer: the synthesizer's keys, the same for
    every head, are held once per head too."""
    model = make_model(attention_type)
    config = model.config
    output = model(random_ids(3, 5), use_cache=True)
    cache = output["cache"] if "cache" in output else output["past_key_values"]  # renamed in transformers 5.2x
    expected = (3, config.n_head, 5, config.n_embd // config.n_head)
    assert len(cache.layers) == config.n_layer
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == expected and tuple(layer.values.shape) == expected


def test_a_static_cache_is_refused_by_name():
    """generate(cache_implementation="static") hands the model a StaticCache and 4-D masks: KnowGPT says which
    cache it runs with instead of failing on the mask's shape."""
    model = make_model("vanilla")
    with pytest.raises(ValueError, match="not StaticCache: leave out cache_implementation='static'"):
        model.generate(random_ids(2, 5), max_new_tokens=3, do_sample=False, cache_implementation="static")


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_cache_and_no_cache_generate_the_same_tokens(attention_type):
    model = make_model(attention_type)
    prompt = random_ids(3, 5)
    # eos_token_id=None: all 12 tokens, though a random model writes ⁇ (the eos) now and then
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (3, 17)
    assert torch.equal(with_cache, without_cache)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(attention_type):
    model = make_model(attention_type)
    prompts = [random_ids(1, n, seed=n)[0] for n in (3, 6, 9)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **kwargs)[0, len(prompt) :]
        assert torch.equal(batched[row, width:], alone)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_logits_equal_unpadded_logits(attention_type, side):
    model = make_model(attention_type)
    short, long = random_ids(1, 5, seed=3)[0], random_ids(1, 9, seed=4)[0]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[1], mask[1] = long, 1
    span = slice(4, 9) if side == "left" else slice(0, 5)
    ids[0, span], mask[0, span] = short, 1
    logits = model(ids, attention_mask=mask).logits
    assert torch.allclose(logits[0, span], model(short[None]).logits[0], atol=1e-5)
    assert torch.allclose(logits[1], model(long[None]).logits[0], atol=1e-5)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("lengths", [[12, 7, 3], [7, 12, 3]], ids=["longest-first", "unordered"])
def test_packed_training_equals_dense_in_loss_and_gradients(attention_type, lengths):
    ids = random_ids(3, 12)
    labels = ids.clone()
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
        labels[row, length - 1 :] = -100  # the last real token predicts padding: not trained
    token_index = torch.cat([row * 12 + torch.arange(n) for row, n in enumerate(lengths)])
    # rows longest first attend group by group of rows on a CPU; in another order, in one grid
    assert (TokenGrid(3, 12, token_index).length_groups is not None) == (lengths == sorted(lengths, reverse=True))

    results = []
    for packed in (False, True):
        model = make_model(attention_type)
        model.transformer.attention_by_length = True  # as the trainer sets it on a CPU
        out = model(ids, labels=labels, token_index=token_index if packed else None, use_cache=False)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        dense_logits = out.logits if not packed else None
        results.append((out.loss.detach(), grads, dense_logits, out.logits))
    (dense_loss, dense_grads, dense_logits, _), (packed_loss, packed_grads, _, packed_logits) = results
    assert torch.allclose(dense_loss, packed_loss, atol=1e-6)
    assert packed_logits.shape == (sum(lengths), VOCAB)
    assert torch.allclose(dense_logits.reshape(-1, VOCAB)[token_index], packed_logits, atol=1e-5)
    assert dense_grads.keys() == packed_grads.keys()
    for name in dense_grads:
        assert torch.allclose(dense_grads[name], packed_grads[name], atol=1e-6), name


def test_packed_rows_longest_first_attend_group_by_group_on_a_cpu():
    lengths = torch.tensor([12, 11, 7, 6, 3, 0])
    token_index = torch.cat([row * 12 + torch.arange(int(n)) for row, n in enumerate(lengths)])
    groups = TokenGrid(len(lengths), 12, token_index).length_groups
    assert groups.shapes == [(2, 12), (2, 7), (1, 3)]  # the row without tokens is left out
    states = torch.arange(len(token_index) * 2).view(-1, 2)
    grids = groups.grids(groups.to_buffer(states))
    assert [tuple(grid.shape) for grid in grids] == [(2, 12, 2), (2, 7, 2), (1, 3, 2)]
    assert torch.equal(grids[1][1, :6], states[12 + 11 + 7 : 12 + 11 + 7 + 6])  # the fourth row, in the second group
    assert (grids[1][1, 6:] == 0).all()  # its padding
    assert torch.equal(groups.from_grids(grids), states)
    assert TokenGrid(3, 12, torch.cat([torch.arange(7), 12 + torch.arange(12)])).length_groups is None  # unordered
    assert TokenGrid(4, 10, torch.arange(4 * 10)).length_groups is None  # rows as long as the grid: nothing to save


def test_packed_training_rejects_cache_and_mask():
    model = make_model("vanilla")
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match="token_index"):
        model(ids, token_index=torch.arange(4), attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_eager_and_sdpa_attention_agree(attention_type):
    model = make_model(attention_type)
    ids = random_ids(2, 10)
    fused = model(ids).logits
    model.set_attn_implementation("eager")
    assert torch.allclose(fused, model(ids).logits, atol=1e-5)
    with pytest.raises(ValueError, match="attn_implementation"):
        model.set_attn_implementation("flash_attention_2")


@pytest.mark.parametrize("attention_type", ["vanilla", "rope"])
def test_fused_projections_equal_the_three_layers_and_respect_hooks(attention_type):
    """Self-attention runs its query, key and value layers as one product; a hooked layer (an adapter's
    way in) is called as a module instead, with the same result."""
    model = make_model(attention_type)
    ids = random_ids(2, 10)
    fused = model(ids).logits
    calls = []
    layer = model.transformer.blocks[0].attn.value
    handle = layer.register_forward_hook(lambda module, inputs, output: calls.append(output.shape))
    hooked = model(ids).logits
    handle.remove()
    assert calls == [(2, 10, 16)]
    torch.testing.assert_close(fused, hooked, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer.weight.zero_()  # the fused product reads the layers' own parameters
    assert not torch.allclose(model(ids).logits, fused, atol=1e-4)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_attention_kernel_dtype_under_bf16_autocast(attention_type, monkeypatch):
    seen = []
    original = attention_knowgpt.ATTENTION_FUNCTIONS["sdpa"]

    def recording(query, key, value, mask, **options):
        seen.append({query.dtype, key.dtype, value.dtype} | ({mask.dtype} if mask is not None else set()))
        return original(query, key, value, mask, **options)

    monkeypatch.setitem(attention_knowgpt.ATTENTION_FUNCTIONS, "sdpa", recording)
    ids = random_ids(2, 10)
    fp32_logits = make_model(attention_type)(ids).logits
    for setting, kernel_dtype in (("float32", torch.float32), ("float16", torch.float16), (None, torch.bfloat16)):
        model = make_model(attention_type, attention_kernel_dtype=setting)
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
        assert seen and all(dtypes == {kernel_dtype} for dtypes in seen), (setting, seen)
        assert logits.dtype == torch.bfloat16  # the projections and head stay in bf16
        assert torch.allclose(logits.float(), fp32_logits, atol=0.1)
    # in fp32 the setting changes nothing
    for setting in ("float16", None):
        assert torch.equal(make_model(attention_type, attention_kernel_dtype=setting)(ids).logits, fp32_logits)
    with pytest.raises(ValueError, match="attention_kernel_dtype must be one of"):
        tiny_config(attention_type, attention_kernel_dtype="fp32")


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_residual_in_fp32_off_runs_the_stream_in_autocast_dtype(attention_type):
    ids = random_ids(2, 10)
    reference = make_model(attention_type)(ids, output_hidden_states=True)
    gradients = {}
    for residual_in_fp32, stream_dtype in ((True, torch.float32), (False, torch.bfloat16)):
        model = make_model(attention_type, residual_in_fp32=residual_in_fp32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(ids, output_hidden_states=True)
        # every state the blocks pass along (the last is the final LayerNorm's output)
        assert {states.dtype for states in output.hidden_states[:-1]} == {stream_dtype}, residual_in_fp32
        assert torch.allclose(output.logits.float(), reference.logits, atol=0.1)
        model.train()
        torch.manual_seed(3)  # the same dropout masks for both streams
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        gradients[residual_in_fp32] = torch.cat([parameter.grad.flatten() for parameter in model.parameters()])
    assert gradients[False].isfinite().all()
    torch.testing.assert_close(gradients[False], gradients[True], rtol=0.1, atol=2e-3)
    # without autocast the setting changes nothing
    logits = make_model(attention_type, residual_in_fp32=False)(ids).logits
    assert torch.equal(logits, reference.logits)
    with pytest.raises(ValueError, match="residual_in_fp32 must be true or false"):
        tiny_config(attention_type, residual_in_fp32="no")


def test_sequences_longer_than_block_size_are_rejected():
    model = make_model("vanilla")
    with pytest.raises(ValueError, match="block_size=24"):
        model(random_ids(1, 25))


def test_init_follows_the_handouts():
    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config("synthesizer", n_embd=64, vocab_size=400))
    assert model.transformer.pos_emb.weight.abs().max() == 0  # minGPT's pos_emb starts at zeros
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.002 and model.lm_head.bias is None
    assert abs(model.transformer.tok_emb.weight.std().item() - 0.02) < 0.002
    attention = model.transformer.blocks[0].attn
    assert attention.w2.abs().max() <= 0.001 and attention.b2.abs().max() == 0
    assert model.transformer.blocks[0].ln1.weight.eq(1).all() and attention.proj.bias.eq(0).all()
    perceiver = KnowGPTForCausalLM(tiny_config("perceiver", n_embd=64))
    basis = perceiver.transformer.down_block.C
    # Xavier-uniform as torch computes it for a (1, L, C) tensor: fan_in = L·C, fan_out = C
    bound = (6 / (basis.shape[1] * basis.shape[2] + basis.shape[2])) ** 0.5
    assert 0.5 * bound < basis.abs().max() <= bound


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_checkpoint_loads_with_trust_remote_code_without_the_package(attention_type, tmp_path):
    model = make_model(attention_type)
    tokenizer = KnowGPTTokenizerFast.from_corpus("abcdefghijklmnopqrst")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = random_ids(1, 6)
    expected = model(ids).logits
    torch.save({"ids": ids, "expected": expected}, tmp_path / "probe.pt")
    run_checkpoint_code_without_the_package(
        tmp_path,
        """
        from transformers import AutoModel
        AutoModel.from_pretrained(folder, trust_remote_code=True)
        probe = torch.load(folder / "probe.pt")
        assert torch.equal(model(probe["ids"]).logits, probe["expected"])
        model.set_attn_implementation("triton")  # the kernel is not in the checkpoint: SDPA
        assert torch.equal(model(probe["ids"]).logits, probe["expected"])
        """,
    )


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_cpu_dropout_drops_at_rate_p_scales_to_keep_the_mean_and_repeats_with_the_seed(p):
    dropout = layers_knowgpt.KnowGPTDropout(p).train()
    states = torch.ones(400, 1000, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    dropped = dropout(states)
    kept = dropped != 0
    assert abs(1 - kept.double().mean().item() - p) < 0.005  # 400k draws: 0.005 is > 10 standard deviations
    assert dropped.mean().item() == pytest.approx(1.0, abs=0.01)
    assert torch.allclose(dropped[kept], torch.full_like(dropped[kept], dropped[kept][0].item()))
    dropped.sum().backward()
    assert torch.equal(states.grad, dropped.detach())  # the gradient passes where the value did, equally scaled
    torch.manual_seed(3)
    assert torch.equal(dropout(states), dropped)
    assert not torch.equal(dropout(states), dropped)  # fresh draws on the next call
    assert torch.equal(dropout.eval()(states), states)


def test_the_sixteen_bit_dropout_rule_rounds_the_rate_to_levels_and_scales_by_the_rate_kept():
    """Every mask the package cuts from 16-bit uniforms keeps an element where its uniform is at least
    round(p·2¹⁶) and scales it by 2¹⁶ over the levels kept; the CPU dropout's kept elements carry that scale."""
    assert layers_knowgpt.dropped_levels(0.1) == 6554 and layers_knowgpt.dropped_levels(0.0) == 0
    assert layers_knowgpt.dropped_levels(2.5 / 2**16) == 2  # halfway: round() to even, as the kernels take it
    assert layers_knowgpt.kept_scale(0.1) == 2**16 / (2**16 - 6554) and layers_knowgpt.kept_scale(0.0) == 1.0
    assert layers_knowgpt.kept_scale(1 - 2**-20) == 0.0  # every level drops: nothing kept, nothing to scale
    torch.manual_seed(0)
    dropped = layers_knowgpt.KnowGPTDropout(0.1).train()(torch.ones(1000, dtype=torch.float64))
    assert set(dropped.unique().tolist()) == {0.0, layers_knowgpt.kept_scale(0.1)}
    # The attention kernels' launch restates the rule (the kernels cannot import the model's files): the same numbers.
    from hf_knowgpt.kernels import fused_attention

    halfway = [(level + 0.5) / 2**16 for level in (0, 1, 2, 6553, 6554, 2**16 - 1)]
    for p in [0.0, 0.1, 0.3, 0.5, 1 / 3, 1 - 2**-20, *halfway]:
        rule = (layers_knowgpt.dropped_levels(p), layers_knowgpt.kept_scale(p)) if p else (0, 1.0)
        assert fused_attention._dropout_rule(p, uniforms_per_draw=8) == rule, p


def test_cpu_dropout_keeps_shape_dtype_and_handles_sizes_not_divisible_by_four():
    dropout = layers_knowgpt.KnowGPTDropout(0.5).train()
    for shape in [(1,), (3, 7), (2, 5, 9)]:
        states = torch.randn(shape, dtype=torch.bfloat16)
        dropped = dropout(states)
        assert dropped.shape == states.shape and dropped.dtype == torch.bfloat16
        assert torch.all((dropped == 0) | torch.isclose(dropped, 2 * states))


@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer"])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_layers_train_as_the_plain_blocks(attention_type, packed, monkeypatch):
    """Without dropout, a training step through the fused residual + LayerNorm (the kernel under
    TRITON_INTERPRET=1 or on a GPU, its plain fallback elsewhere) gives the plain blocks' loss, gradients and
    hidden states: every residual sum goes through it, two per block, the last with ln_f, and adds the bias of
    each branch's last layer that is plain (a hooked layer runs whole, bias included). In evaluation, or with
    gradient checkpointing, the flag changes nothing."""
    from hf_knowgpt.kernels import fused_layers

    calls = []
    fused_function = fused_layers.fused_residual_layer_norm
    monkeypatch.setattr(
        fused_layers,
        "fused_residual_layer_norm",
        lambda *args, **kwargs: calls.append(args[2]) or fused_function(*args, **kwargs),
    )
    ids = random_ids(3, 12)
    token_index = torch.cat([row * 12 + torch.arange(n) for row, n in enumerate([12, 7, 3])]) if packed else None
    results = []
    for fused in (False, True):
        model = make_model(attention_type, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
        model.transformer.blocks[0].mlp.proj.register_forward_hook(lambda module, inputs, output: None)
        model.transformer.fused_layers = fused
        out = model(ids, labels=ids, token_index=token_index, use_cache=False, output_hidden_states=True)
        out.loss.backward()
        results.append(
            (out.loss.detach(), out.hidden_states, {name: p.grad.clone() for name, p in model.named_parameters()})
        )
        if fused:
            blocks = model.transformer.blocks
            norms = [norm for block, after in zip(blocks, [*(b.ln1 for b in blocks[1:]), model.transformer.ln_f])
                     for norm in (block.ln2, after)]  # fmt: skip
            assert [id(weight) for weight in calls] == [id(norm.weight) for norm in norms]
            enable_activation_checkpointing(model)
            calls.clear()
            model(ids, labels=ids, token_index=token_index, use_cache=False).loss.backward()
            assert not calls
        with torch.no_grad():
            assert torch.equal(model.eval()(ids).logits, make_model(attention_type)(ids).logits)
    (plain_loss, plain_states, plain_grads), (fused_loss, fused_states, fused_grads) = results
    assert torch.allclose(plain_loss, fused_loss, atol=1e-6)
    for plain, fused in zip(plain_states, fused_states, strict=True):
        assert torch.allclose(plain, fused, atol=1e-5)
    for name in plain_grads:
        assert torch.allclose(plain_grads[name], fused_grads[name], atol=1e-5), name


@pytest.mark.parametrize("packed", [False, True])
def test_future_token_heads_add_their_mean_cross_entropy_in_training_only(packed):
    """future_tokens=2, spacing 3: heads predict the 4th and 7th token ahead within each row; in training the
    loss is the next-token loss plus their mean, each normalized by the next-token targets' count."""
    lengths = [12, 9, 5]
    ids = random_ids(3, 12)
    labels = ids.clone()
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
        labels[row, length:] = -100
    token_index = torch.cat([row * 12 + torch.arange(n) for row, n in enumerate(lengths)])
    model = make_model(
        "rope", future_tokens=2, future_token_spacing=3, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0
    )
    assert len(model.future_heads) == 2
    eval_loss = model(ids, labels=labels).loss
    model.train()  # no dropout: the same numbers as in evaluation
    out = model(ids, labels=labels, token_index=token_index if packed else None, use_cache=False)
    hidden = model.transformer(ids).last_hidden_state

    count = sum(length - 1 for length in lengths)
    expected_future = []
    for head, ahead in zip(model.future_heads, (4, 7)):
        log_probs = head(hidden).log_softmax(-1)
        terms = [-log_probs[b, t, ids[b, t + ahead]] for b, n in enumerate(lengths) for t in range(n - ahead)]
        expected_future.append(torch.stack(terms).sum() / count)
    expected = eval_loss + torch.stack(expected_future).mean()
    assert torch.allclose(out.loss, expected, atol=1e-5)
    out.loss.backward()
    assert all(head.weight.grad is not None and head.weight.grad.abs().sum() > 0 for head in model.future_heads)


def test_future_token_heads_round_trip_and_leave_generation_alone(tmp_path):
    model = make_model("vanilla", future_tokens=1)
    model.save_pretrained(tmp_path)
    loaded = KnowGPTForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.future_tokens == 1
    assert torch.equal(loaded.future_heads[0].weight, model.future_heads[0].weight)
    prompt = random_ids(1, 5)
    plain = make_model("vanilla")  # the same trunk and lm_head, without the further head
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("future_heads")})
    settings = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(prompt, **settings), plain.generate(prompt, **settings))


@pytest.mark.parametrize(
    "overrides, field",
    [(dict(future_tokens=-1), "future_tokens"), (dict(future_token_spacing=0), "future_token_spacing"),
     (dict(future_tokens=8, future_token_spacing=3), "furthest future-token head")],
)  # fmt: skip
def test_future_token_settings_are_validated(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_resizing_the_vocabulary_resizes_the_further_heads():
    model = make_model("vanilla", future_tokens=2).train()
    model.resize_token_embeddings(VOCAB + 5, mean_resizing=False)
    assert model.config.vocab_size == VOCAB + 5
    assert all(head.weight.shape == (VOCAB + 5, 16) for head in model.future_heads)
    ids = torch.randint(2, VOCAB + 5, (2, 10), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()  # the new ids are targets of every head


def test_the_summed_loss_adds_chunks_of_tokens_then_their_sums_in_one_compiled_graph(monkeypatch):
    """The loss over `num_items_in_batch` sums `LOSS_CHUNK` tokens at a time (the last chunk padded), then those
    sums; compiled for a dynamic token count, one graph serves every count, multiple of the chunk or not. The
    model's loss is that function's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    loss = layers_knowgpt.causal_lm_loss
    generator = torch.Generator().manual_seed(0)
    for tokens in (512, 300):
        logits = torch.randn(2, tokens // 2, 257, generator=generator)
        targets = torch.randint(0, 257, (2, tokens // 2), generator=generator)
        targets[0, :7] = -100
        kept = (targets != -100).sum()
        in_float64 = F.cross_entropy(logits.reshape(tokens, 257).double(), targets.reshape(-1), reduction="sum")
        expected = (in_float64 / kept).float()
        torch.testing.assert_close(loss(logits, targets, kept), expected)
        torch.testing.assert_close(loss(logits, targets), expected)  # the mean over kept targets
    model = make_model("vanilla")
    ids = random_ids(16, 17)  # 256 targets once shifted
    chunked = model(ids, labels=ids, num_items_in_batch=torch.tensor(256.0)).loss
    monkeypatch.setattr(layers_knowgpt, "LOSS_CHUNK", 0)
    torch.testing.assert_close(model(ids, labels=ids, num_items_in_batch=torch.tensor(256.0)).loss, chunked)
    monkeypatch.setattr(layers_knowgpt, "LOSS_CHUNK", 256)

    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph

    counter = CompileCounterWithBackend(record)
    compiled = torch.compile(loss, backend=counter, dynamic=True, fullgraph=True)
    for tokens in (512, 320, 768, 1000):
        logits, targets = torch.randn(tokens, 257, generator=generator), torch.randint(0, 257, (tokens,))
        torch.testing.assert_close(compiled(logits, targets, 100.0), loss(logits, targets, 100.0))
    assert counter.frame_count == 1
    sums = [node for node in graphs[0].graph.nodes if node.target in (torch.sum, "sum")]
    assert len(sums) == 2, graphs[0].code  # per chunk, then over the chunks


def test_gelu_slope_is_the_exact_gelu_derivative():
    """One exponential and A&S 7.1.26's erf give GELU's derivative within 3e-7 over the range bf16 states take
    (aten's own fp32 gradient is 2.6e-7 from fp64's), on both sides of 0 and in the tails."""
    states = torch.linspace(-12, 12, 240_001, dtype=torch.float64, requires_grad=True)
    (exact,) = torch.autograd.grad(F.gelu(states).sum(), states)
    error = (layers_knowgpt.gelu_slope(states.detach()).double() - exact).abs()
    assert error.max() <= 3e-7


def test_gelu_from_one_exp_is_as_close_to_gelu_as_torchs_own_fp32():
    """x·Φ(x) from one exponential is within 1e-6 of fp64's GELU over the range bf16 states take, no further than
    torch's own fp32 GELU (whose 1 + erf loses digits in the negative tail, where this tail is computed directly)."""
    states = torch.linspace(-12, 12, 240_001, dtype=torch.float64)
    exact = F.gelu(states)
    error = (layers_knowgpt.gelu_from_one_exp(states.float()).double() - exact).abs().max()
    assert error <= 1e-6 and error <= (F.gelu(states.float()).double() - exact).abs().max()


def test_gelu_with_the_one_exp_gradient_is_gelu_in_bf16(monkeypatch):
    """The forward is torch's GELU bit for bit with GELU_FORWARD_ONE_EXP off; on, it is within a rounding of fp64's
    and rounds to fp64's rounded value at least as often as torch's does. The bf16 gradient, rounded once, is within
    a rounding of fp64's and the slope's 3e-7, uncompiled and compiled whole (dynamo traces the autograd.Function);
    nearly every element is fp64's rounded (aten's CPU gradient of bf16 states is 0 in the negative tail, where this
    one is not)."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(1 << 18, generator=generator).mul(3).bfloat16().requires_grad_()
    incoming = torch.randn(1 << 18, generator=generator).bfloat16()
    wide = states.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(F.gelu(wide), wide, incoming.double())
    exact_out = F.gelu(wide.detach())
    apply = layers_knowgpt._GeluOneExpGradient.apply
    for function, forward_one_exp in [
        (apply, False),
        (apply, True),
        (torch.compile(apply, backend="aot_eager", fullgraph=True), True),
    ]:
        monkeypatch.setattr(layers_knowgpt, "GELU_FORWARD_ONE_EXP", forward_one_exp)
        out = function(states)
        if forward_one_exp:
            assert ((out.double() - exact_out).abs() <= exact_out.abs() * 2**-8 + 1e-6).all()
            torch_rounded = (F.gelu(states) == exact_out.bfloat16()).float().mean()
            assert (out == exact_out.bfloat16()).float().mean() >= torch_rounded
        else:
            assert torch.equal(out, F.gelu(states))
        (got,) = torch.autograd.grad(out, states, incoming)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + incoming.double().abs() * 3e-7).all()
        assert (got == exact.bfloat16()).float().mean() >= 0.99


def test_the_one_exp_gelu_gradient_applies_only_where_it_is_asked_for(monkeypatch):
    """The MLP takes `_GeluOneExpGradient` only compiling on a listed device with GELU_GRADIENT_ONE_EXP on; its
    gradients are then as close to fp64's as the plain model's are (within twice their error, or 1e-7). On torch
    2.11 this is where fc's gradients, lost to dynamo's aliasing of the Function's output, showed (pytorch#180642)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch.manual_seed(0)
    model = KnowGPTForCausalLM(tiny_config("vanilla")).train()
    mlp = model.transformer.blocks[0].mlp
    mlp.dropout.p = 0.0
    states = torch.randn(2, 8, model.config.n_embd)
    backward_graphs = []

    def recorded(graph, example_inputs):
        backward_graphs.append(str(graph.graph))
        return make_boxed_func(graph.forward)

    def gradients(function):
        model.zero_grad(set_to_none=True)
        function(states).square().sum().backward()
        return [parameter.grad.clone() for parameter in mlp.parameters()]

    def compiled():
        torch._dynamo.reset()
        backward_graphs.clear()
        backend = aot_autograd(fw_compiler=lambda graph, _: make_boxed_func(graph.forward), bw_compiler=recorded)
        return torch.compile(mlp, backend=backend, fullgraph=True)

    plain = gradients(mlp)
    assert all(torch.equal(a, b) for a, b in zip(gradients(compiled()), plain))
    assert "gelu_backward" in backward_graphs[0]  # autograd's
    monkeypatch.setattr(layers_knowgpt, "GELU_GRADIENT_ONE_EXP", True)
    monkeypatch.setattr(layers_knowgpt, "GELU_GRADIENT_ONE_EXP_DEVICES", ("cpu",))
    assert all(torch.equal(a, b) for a, b in zip(gradients(mlp), plain))  # not compiling: torch's GELU
    one_exp = gradients(compiled())
    assert "gelu_backward" not in backward_graphs[0] and "exp2" in backward_graphs[0]
    exact_mlp = copy.deepcopy(mlp).double()
    exact_mlp(states.double()).square().sum().backward()
    for name, a, b, exact in zip(
        ("fc.weight", "fc.bias", "proj.weight", "proj.bias"), one_exp, plain, exact_mlp.parameters()
    ):
        one_exp_error, plain_error = ((gradient.double() - exact.grad).abs().max().item() for gradient in (a, b))
        assert one_exp_error <= max(2 * plain_error, 1e-7), (name, one_exp_error, plain_error)
    monkeypatch.setattr(layers_knowgpt, "GELU_GRADIENT_ONE_EXP_DEVICES", ("cuda",))
    gradients(compiled())
    assert "gelu_backward" in backward_graphs[0]


@pytest.mark.parametrize(
    "device, attention_type, dynamic",
    [pytest.param("cpu", "vanilla", None, id="cpu-vanilla")]
    + [pytest.param("cpu", kind, True, id=f"cpu-{kind}-dynamic") for kind in ATTENTION_TYPES]
    + [pytest.param("cuda", kind, None, id=f"cuda-{kind}") for kind in ATTENTION_TYPES]
    + [pytest.param("cuda", "vanilla", True, id="cuda-vanilla-dynamic")],
)
def test_a_compiled_fp32_model_has_the_uncompiled_gradients(device, attention_type, dynamic, monkeypatch):
    """Compiled in fp32, as `--torch_compile` without `--mixed_precision` trains, every parameter's gradient is
    the uncompiled model's to fp32 rounding, the one-exp GELU included (on CPU by dynamo's graphs run eagerly,
    on CUDA by inductor). A gradient the compiler loses is apart by its own size: torch 2.11's dynamo gave the
    MLP's first layer none (pytorch#180642). `dynamic`: compiled with `dynamic=True`, every size and float
    symbolic, which failed to compile while the GELU read its constants from module globals."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("inductor's CUDA code needs a CUDA device")
    monkeypatch.setattr(layers_knowgpt, "GELU_GRADIENT_ONE_EXP", True)
    monkeypatch.setattr(layers_knowgpt, "GELU_GRADIENT_ONE_EXP_DEVICES", (device,))
    torch.manual_seed(0)
    config = tiny_config(attention_type, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    model = KnowGPTForCausalLM(config).to(device).train()
    ids = torch.randint(0, config.vocab_size - 1, (4, config.block_size), device=device)

    def gradients(forward):
        model.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids).loss.backward()
        return {
            name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None
        }

    tf32 = torch.backends.cuda.matmul.allow_tf32  # fp32 products in full fp32, both ways
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        plain = gradients(model)
        torch._dynamo.reset()
        backend = "aot_eager" if device == "cpu" else "inductor"
        compiled = gradients(torch.compile(model, backend=backend, dynamic=dynamic))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert compiled.keys() == plain.keys()
    largest = max(grad.abs().max().item() for grad in plain.values())
    for name, grad in plain.items():
        torch.testing.assert_close(
            compiled[name], grad, rtol=1e-4, atol=1e-5 * largest, msg=lambda text, n=name: f"{n}: {text}"
        )
