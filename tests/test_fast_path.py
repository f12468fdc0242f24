"""The fast paths compute the same function as the plain (handout-style) path."""

import copy

import pytest
import torch
from conftest import tiny_config

from data_loaders import encode_birthplace_examples, encode_documents, generate_people
from hf_knowgpt import KnowGPTForCausalLM, KnowGPTTokenizerFast
from hf_knowgpt.fast_path import GraphedStepper, resolve_training_path
from hf_knowgpt.training import FinetuningData, KnowGPTTrainer, PretrainingData, TrainingArguments

BLOCK = 64
TOLERANCE = 1e-5  # fp32: only the summation order differs (fused vs unfused attention, packed vs padded)


@pytest.fixture(scope="module")
def pretraining_data():
    sentences = [p.sentence for p in generate_people(40, seed=2)]
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(sentences))
    return tokenizer, PretrainingData(*encode_documents(tokenizer, sentences, BLOCK), BLOCK)


def fresh_model(vocab_size, attention_type="vanilla", dropout=0.0):
    torch.manual_seed(0)
    config = tiny_config(attention_type, vocab_size=vocab_size, block_size=BLOCK, n_embd=32, n_head=4,
                         embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    return KnowGPTForCausalLM(config)


@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer", "perceiver"])
def test_plain_and_fast_paths_give_the_same_loss_and_gradients(pretraining_data, attention_type):
    tokenizer, data = pretraining_data
    batch = data.batch(torch.arange(16), torch.Generator().manual_seed(0))
    plain = fresh_model(len(tokenizer), attention_type)
    fast = copy.deepcopy(plain)
    plain.set_attn_implementation("eager")  # the handouts' unfused attention over every padded position
    plain_loss = plain(input_ids=batch.input_ids, labels=batch.labels).loss
    from hf_knowgpt.training import packed_token_index

    index = packed_token_index(batch.lengths, batch.input_ids.shape[1])
    fast_loss = fast(input_ids=batch.input_ids, labels=batch.labels, token_index=index, use_cache=False).loss
    assert abs(plain_loss.item() - fast_loss.item()) < TOLERANCE
    plain_loss.backward()
    fast_loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fast.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=TOLERANCE), name


def test_static_length_trimming_keeps_the_loss(pretraining_data):
    tokenizer, data = pretraining_data
    batch = data.batch(torch.arange(16), torch.Generator().manual_seed(1))
    model = fresh_model(len(tokenizer))
    full = model(input_ids=batch.input_ids, labels=batch.labels).loss
    cut = data.static_length
    assert cut == 58 and int(batch.lengths.max()) <= cut  # ⌊7·64/8⌋ + 2
    trimmed = model(input_ids=batch.input_ids[:, :cut], labels=batch.labels[:, :cut]).loss
    assert abs(full.item() - trimmed.item()) < TOLERANCE


def make_trainer(tmp_path, data, model, graphed):
    args = TrainingArguments(output_dir=str(tmp_path), max_epochs=2, batch_size=16, learning_rate=3e-3,
                             training_path="eager")  # fmt: skip
    trainer = KnowGPTTrainer(model, data, args)
    device = trainer.accelerator.device
    lr = torch.tensor(args.learning_rate) if graphed else args.learning_rate
    from hf_knowgpt.training import handout_parameter_groups

    trainer.optimizer = torch.optim.AdamW(
        handout_parameter_groups(model, args.weight_decay), lr=lr, betas=args.betas, fused=graphed
    )
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: trainer.lr_multipliers[s])
    data.to(device)
    return trainer


@pytest.mark.parametrize("kind", ["pretraining", "finetuning"])
def test_the_graphed_step_body_matches_the_eager_step(pretraining_data, tmp_path, kind):
    """The body the CUDA graph captures (run uncaptured here) against the eager step, on the same batches."""
    tokenizer, pretraining = pretraining_data
    if kind == "finetuning":
        people = generate_people(40, seed=2)
        data = FinetuningData(*encode_birthplace_examples(
            tokenizer, [f"Where was {p.name} born?" for p in people], [p.place for p in people], BLOCK))  # fmt: skip
    else:
        data = pretraining
    eager_model = fresh_model(len(tokenizer))
    graphed_model = copy.deepcopy(eager_model)
    eager = make_trainer(tmp_path / "eager", data, eager_model, graphed=False)
    graphed = make_trainer(tmp_path / "graphed", data, graphed_model, graphed=True)
    stepper = GraphedStepper(graphed)

    batches = {}

    def recorded_device_batch(indices, valid, seq_len):  # feed the graphed body the eager step's batch
        batch = batches[int(stepper.step_counter)]
        labels = batch.labels[:, :seq_len].masked_fill(~valid[: len(batch.labels), None], -100)
        return batch.input_ids[:, :seq_len], labels

    data.device_batch = recorded_device_batch
    generator = torch.Generator()
    for step in range(eager.steps_per_epoch + 1):  # crosses an epoch boundary and its smaller last batch
        generator.manual_seed(step)
        batch = data.batch(eager.batch_indices(step), generator)
        batches[step] = batch
        eager_loss = eager.optimizer_step(batch, 0, 1, packed=True)
        graphed.optimizer.zero_grad(set_to_none=True)
        if len(batch.labels) < 16:  # the graphed body always takes 16 rows; the missing ones are invalid
            pad = 16 - len(batch.labels)
            batches[step] = type(batch)(
                torch.cat([batch.input_ids, batch.input_ids[:pad]]),
                torch.cat([batch.labels, torch.full_like(batch.labels[:pad], -100)]),
                batch.lengths, batch.trained_targets)  # fmt: skip
        stepper._body()
        graphed_loss = stepper.take_loss()
        assert abs(eager_loss.item() - graphed_loss.item()) < TOLERANCE, step
        # the rate this step used, set inside the body, is the handouts' rate for the step
        assert graphed.optimizer.param_groups[0]["lr"].item() == pytest.approx(3e-3 * eager.lr_multipliers[step])
    for (name, a), (_, b) in zip(eager_model.named_parameters(), graphed_model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_training_path_selection():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_training_path("auto", cpu, 1) == "eager"
    assert resolve_training_path("auto", gpu, 1) == "graphed"
    assert resolve_training_path("auto", gpu, 2) == "eager"
    with pytest.raises(ValueError, match="one CUDA device"):
        resolve_training_path("graphed", cpu, 1)
    with pytest.raises(ValueError, match="training_path must be one of"):
        resolve_training_path("turbo", cpu, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_captured_graph_replays_the_uncaptured_step_exactly(pretraining_data, tmp_path):
    tokenizer, data = pretraining_data
    model = fresh_model(len(tokenizer)).cuda()
    reference = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_epochs=2, batch_size=16, training_path="graphed")
    trainer = KnowGPTTrainer(model, data, args)
    trainer.data.to("cuda")
    trainer.optimizer = trainer._make_optimizer(graphed=True)
    stepper = GraphedStepper(trainer)
    reference_trainer = KnowGPTTrainer(reference, data, args)
    reference_trainer.optimizer = reference_trainer._make_optimizer(graphed=True)
    reference_stepper = GraphedStepper(reference_trainer)
    fixed = data.device_batch(
        torch.arange(16, device="cuda"), torch.ones(16, dtype=torch.bool, device="cuda"), data.static_length
    )
    data.device_batch = lambda indices, valid, seq_len: fixed  # the same batch every step: no randomness
    stepper.capture(first_step=0)
    for _ in range(3):
        stepper.run(0, 1, lambda: False)
        reference_trainer.optimizer.zero_grad(set_to_none=True)
        reference_stepper._body()
    torch.cuda.synchronize()
    assert abs(stepper.take_loss().item() - reference_stepper.take_loss().item()) < 1e-4
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name
