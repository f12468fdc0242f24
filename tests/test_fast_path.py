"""The fast paths compute the same function as the plain (handout-style) path."""

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing
from conftest import KERNEL_SKIP, TRITON_INTERPRETED, tiny_config
from torch._dynamo.utils import counters

from data_loaders import (
    encode_birthplace_examples,
    encode_document_variants,
    encode_documents,
    encode_question_variants,
    generate_people,
)
from hf_knowgpt import KnowGPTForCausalLM, KnowGPTTokenizerFast, attention_knowgpt
from hf_knowgpt.kernels.fused_attention import fused_attention_available
from hf_knowgpt.kernels.multi_tensor_adamw import MultiTensorAdamW, multi_tensor_adamw_applies
from hf_knowgpt.training import fast_path
from hf_knowgpt.training.arguments import TrainingArguments
from hf_knowgpt.training.data import (
    FinetuningData,
    MixedData,
    PretrainingData,
    VariantRows,
    packed_size,
    packed_token_index,
)
from hf_knowgpt.training.fast_path import GraphedStepper, known_inductor_options, resolve_training_path
from hf_knowgpt.training.trainer import KnowGPTTrainer, make_accelerator

BLOCK = 64
TOLERANCE = 1e-5  # fp32: only the summation order differs (fused vs unfused attention, packed vs padded)


def _pretraining_data():
    sentences = [p.sentence for p in generate_people(40, seed=2)]
    tokenizer = KnowGPTTokenizerFast.from_corpus("\n".join(sentences))
    return tokenizer, PretrainingData(*encode_documents(tokenizer, sentences, BLOCK), BLOCK)


@pytest.fixture
def pretraining_data():  # per test: trainers move their data to their device
    return _pretraining_data()


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


def make_trainer(tmp_path, data, model, graphed, mixed_precision=None, gradient_reduce_dtype="fp32"):
    args = TrainingArguments(output_dir=str(tmp_path), max_epochs=2, batch_size=16, learning_rate=3e-3,
                             training_path="eager", mixed_precision=mixed_precision,
                             gradient_reduce_dtype=gradient_reduce_dtype)  # fmt: skip
    trainer = KnowGPTTrainer(model, data, args, make_accelerator(args, cpu=True))
    device = trainer.accelerator.device
    lr = torch.tensor(args.learning_rate) if graphed else args.learning_rate
    from hf_knowgpt.training.optimization import handout_parameter_groups

    trainer.optimizer = torch.optim.AdamW(
        handout_parameter_groups(model, args.weight_decay), lr=lr, betas=args.betas, fused=graphed
    )
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: trainer.lr_multipliers[s])
    data.to(device)
    return trainer


@pytest.mark.parametrize("groups", [2, 4, 16])
def test_length_groups_take_the_same_optimizer_step(pretraining_data, tmp_path, groups):
    tokenizer, data = pretraining_data
    batch = data.batch(torch.arange(16), torch.Generator().manual_seed(3))
    results = []
    for length_groups in (1, groups):
        trainer = make_trainer(tmp_path / str(length_groups), data, fresh_model(len(tokenizer)), graphed=False)
        trainer.args.length_groups = length_groups
        gradients = []  # what the optimizer is handed: the groups' accumulated gradients
        trainer.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, into=gradients: into.extend(
                p.grad.clone() for group in optimizer.param_groups for p in group["params"]
            )
        )
        loss = trainer.optimizer_step(batch, rank=0, world=1)
        results.append((loss.item(), gradients, [p.detach().clone() for p in trainer.model.parameters()]))
    (loss_one, gradients_one, params_one), (loss_groups, gradients_groups, params_groups) = results
    assert abs(loss_one - loss_groups) < TOLERANCE
    moved = [not torch.equal(a, b) for a, b in zip(params_one, fresh_model(len(tokenizer)).parameters())]
    assert all(moved)  # the step did change every parameter
    # Gradients, not parameters: Adam's first step divides each gradient by its own magnitude, so an entry
    # near zero (~1e-9) moves by up to the learning rate on summation-order noise alone.
    for a, b in zip(gradients_one, gradients_groups):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    for a, b in zip(params_one, params_groups):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("mixed_precision, multiple", [("no", 1), ("bf16", 64)])
def test_packed_token_counts_repeat_under_bf16_on_a_cpu(pretraining_data, tmp_path, mixed_precision, multiple):
    """oneDNN builds bf16 kernels for each new shape, so on a CPU under bf16 the packed token count is rounded
    up to a multiple of 64 (padding positions without targets); in fp32 only real tokens are computed."""
    tokenizer, data = pretraining_data
    batch = data.batch(torch.arange(16), torch.Generator().manual_seed(3))
    trainer = make_trainer(tmp_path, data, fresh_model(len(tokenizer)), graphed=False, mixed_precision=mixed_precision)
    counts = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: counts.append(len(kwargs["token_index"])), with_kwargs=True
    )
    trainer.optimizer_step(batch, rank=0, world=1)
    real = int(batch.lengths.sum())
    assert len(counts) == 1 and counts[0] >= real
    assert counts[0] % multiple == 0 and counts[0] - real < multiple
    assert (counts[0] == real) == (multiple == 1 or real % multiple == 0)


def question_data(tokenizer):
    people = generate_people(40, seed=2)
    questions = [f"Where was {p.name} born?" for p in people]
    return FinetuningData(*encode_birthplace_examples(tokenizer, questions, [p.place for p in people], BLOCK))


def augmented_mixed_data(tokenizer):
    """Mixed data with every augmentation: document variants, plain-text exposures, question phrasings."""
    people = generate_people(40, seed=2)
    ids, lengths, counts = encode_document_variants(tokenizer, [p.sentence for p in people], BLOCK, 3)
    documents = PretrainingData(ids, lengths, BLOCK, variants=VariantRows.consecutive(counts), plain_text_fraction=0.3)
    names, places = [p.name for p in people], [p.place for p in people]
    q_ids, q_labels, q_counts = encode_question_variants(tokenizer, names, places, 3, BLOCK)
    return MixedData(documents, FinetuningData(q_ids, q_labels, VariantRows.consecutive(q_counts)))


@pytest.mark.parametrize("kind", ["pretraining", "finetuning", "mixed", "augmented"])
@pytest.mark.parametrize("packed", [True, False])
def test_the_graphed_step_body_matches_the_eager_step(pretraining_data, tmp_path, kind, packed):
    """The body the CUDA graph captures (run uncaptured here) against the eager step, step by step."""
    tokenizer, pretraining = pretraining_data
    data = {
        "pretraining": lambda: pretraining,
        "finetuning": lambda: question_data(tokenizer),
        "mixed": lambda: MixedData(pretraining, question_data(tokenizer)),
        "augmented": lambda: augmented_mixed_data(tokenizer),
    }[kind]()
    if kind in ("mixed", "augmented") and not packed:
        pytest.skip("the dense body draws its spans on the device; the mixed batch is covered packed")
    eager_model = fresh_model(len(tokenizer))
    graphed_model = copy.deepcopy(eager_model)
    eager = make_trainer(tmp_path / "eager", data, eager_model, graphed=False)
    graphed = make_trainer(tmp_path / "graphed", data, graphed_model, graphed=True)
    stepper = GraphedStepper(graphed, packed=packed, bucket=64)

    batches = {}
    if not packed:  # the dense body makes its own randomness on the device: feed it the eager step's batch
        original_device_batch = data.device_batch

        def recorded_device_batch(indices, valid, seq_len, uniforms=None):
            batch = batches[int(stepper.step_counter)]
            rows = len(batch.labels)
            input_ids = torch.cat([batch.input_ids, batch.input_ids[: 16 - rows]])[:, :seq_len]
            labels = torch.cat([batch.labels, torch.full_like(batch.labels[: 16 - rows], -100)])[:, :seq_len]
            return input_ids, labels.masked_fill(~valid[:, None], -100)

        data.device_batch = recorded_device_batch
    generator = torch.Generator()
    for step in range(eager.steps_per_epoch + 1):  # crosses an epoch boundary and its smaller last batch
        generator.manual_seed(graphed.args.seed * 1_000_003 + step)  # the eager path's per-step seed
        batch = data.batch(eager.batch_indices(step), generator)
        batches[step] = batch
        eager_loss = eager.optimizer_step(batch, 0, 1, packed=True)
        graphed.optimizer.zero_grad(set_to_none=True)
        capacity = stepper._prepare_packed(step) if packed else None
        stepper._body(capacity)
        graphed_loss = stepper.take_loss()
        assert abs(eager_loss.item() - graphed_loss.item()) < TOLERANCE, step
        # the rate this step used, set inside the body, is the handouts' rate for the step
        assert graphed.optimizer.param_groups[0]["lr"].item() == pytest.approx(3e-3 * eager.lr_multipliers[step])
    if not packed:
        data.device_batch = original_device_batch
    # On a CPU the eager step orders rows longest first (attention group by group), the body keeps batch
    # order: the same sums in another order, which AdamW's normalization magnifies where gradients are near 0
    for (name, a), (_, b) in zip(eager_model.named_parameters(), graphed_model.named_parameters()):
        assert torch.allclose(a, b, atol=5e-5), name


@pytest.mark.parametrize("kind", ["pretraining", "augmented"])
@pytest.mark.parametrize("world, rank", [(1, 0), (2, 1), (3, 0), (3, 2)])
def test_packed_steps_made_ready_together_are_each_steps_own(pretraining_data, tmp_path, kind, world, rank):
    """The host makes packed steps ready many at a time (`packed_steps.plan_packed_steps`): what each copies
    to the device is what the step alone gives (the eager path's seed per step, this process's slice of the
    batch padded, the largest slice's bucket), however many are made ready together, across epochs and their
    smaller last batches, with the examples shuffled."""
    tokenizer, pretraining = pretraining_data
    data = pretraining if kind == "pretraining" else augmented_mixed_data(tokenizer)
    trainer = make_trainer(tmp_path, data, fresh_model(len(tokenizer)), graphed=True)
    trainer.args.shuffle = True
    stepper = GraphedStepper(trainer, packed=True, bucket=8)
    rows = stepper.rows = -(-trainer.args.batch_size // world)  # as `world` processes would have it
    stepper.world, stepper.rank = world, rank
    stepper.indices, stepper.valid = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool)
    stepper.uniforms = torch.zeros(rows, data.uniform_columns, dtype=torch.float64)
    steps, generator, expected = 2 * trainer.steps_per_epoch + 1, torch.Generator(), []
    for step in range(steps):
        indices = trainer.batch_indices(step)
        generator.manual_seed(trainer.args.seed * 1_000_003 + step)
        lengths, uniforms = data.plan(indices, generator)
        slices = torch.tensor_split(torch.arange(len(indices)), world)
        capacity = max(packed_size(int(lengths[part].sum()), 8, rows * stepper.seq_len) for part in slices)
        mine, pad = slices[rank], rows - len(slices[rank])
        padded_lengths = torch.cat([lengths[mine], lengths.new_zeros(pad)])
        expected.append({
            "capacity": capacity,
            "indices": torch.cat([indices[mine], indices.new_zeros(pad)]),
            "valid": torch.arange(rows) < len(mine),
            "uniforms": torch.cat([uniforms[mine], uniforms.new_zeros(pad, uniforms.shape[1])]),
            "token_index": packed_token_index(padded_lengths, stepper.seq_len, size=capacity),
            "trained_targets": data.trained_targets(indices, lengths).sum().float(),
        })  # fmt: skip
    for planned in (1, 4, 64):
        stepper.plan = None
        for step, wanted in enumerate(expected):
            capacity = stepper._prepare_packed(step, planned)
            made = {name: getattr(stepper, name) for name in ("indices", "valid", "uniforms", "trained_targets")}
            made |= {"capacity": capacity, "token_index": stepper.token_indices[capacity]}
            for name, value in wanted.items():
                assert torch.equal(torch.as_tensor(made[name]), torch.as_tensor(value)), (planned, step, name)


def _graphed_bodies_in_one_of_two_processes(rank, directory, steps, gradient_reduce_dtype="fp32", update="torch"):
    """One process of two (gloo on CPU): the packed graphed body, uncaptured, for `steps` steps, updating through
    torch's optimizer or the multi-tensor kernels (Triton's interpreter; a GPU's process takes them by itself).
    The processes meet through a file, not a TCP port that another process could take between choosing and
    binding it, and compute with one thread each, as the reference does (summation order follows the thread
    count)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{directory / 'rendezvous'}", rank=rank, world_size=2
    )  # accelerate takes the initialized group as it is
    try:
        tokenizer, data = _pretraining_data()
        trainer = make_trainer(
            directory / f"rank{rank}", data, fresh_model(len(tokenizer)), graphed=True,
            gradient_reduce_dtype=gradient_reduce_dtype,
        )  # fmt: skip
        assert trainer.accelerator.num_processes == 2 and trainer.accelerator.process_index == rank
        stepper = GraphedStepper(trainer, packed=True, bucket=64)
        if update == "multi-tensor":
            assert multi_tensor_adamw_applies(stepper.optimizer, stepper.parameters)
            stepper.update = MultiTensorAdamW(
                stepper.optimizer, stepper.parameters, trainer.args.grad_norm_clip, stepper.learning_rates,
                stepper.learning_rate,
            )  # fmt: skip
        capacities, losses = [], []
        for step in range(steps):
            trainer.optimizer.zero_grad(set_to_none=True)
            capacities.append(stepper._prepare_packed(step))
            stepper._body(capacities[-1])
            losses.append(trainer.accelerator.reduce(stepper.take_loss(), reduction="mean").item())
        torch.save(
            {
                "capacities": capacities,
                "losses": losses,
                "parameters": [p.detach() for p in trainer.model.parameters()],
            },
            directory / f"rank{rank}.pt",
        )
        torch.distributed.barrier()  # neither process leaves while the other may still be in a collective
    finally:  # as scripts do (run_training): a group left for the interpreter's exit can abort gloo's threads
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("gradient_reduce_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "update",
    [
        "torch",
        pytest.param(
            "multi-tensor",
            marks=pytest.mark.skipif(
                not TRITON_INTERPRETED or KERNEL_SKIP is not None,
                reason="the processes train on CPUs: the multi-tensor update needs Triton's interpreter there "
                "(TRITON_INTERPRET=1)",
            ),
        ),
    ],
)
def test_graphed_bodies_on_two_processes_take_the_single_process_steps(
    pretraining_data, tmp_path, gradient_reduce_dtype, update
):
    """Each process trains its slice of the global batch and the body sums their gradients (the all-reduce the
    CUDA graph captures on GPUs): the parameters follow the one-process eager steps, whether torch's optimizer
    or the multi-tensor update (reading the sum's buffer) takes the step. Summed in bf16, each
    gradient is rounded to bf16 first: the losses follow as closely, the parameters within what that rounding
    moves through Adam (a step of the learning rate where a gradient element near 0 changes its sign)."""
    tokenizer, data = pretraining_data
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the two processes computes
    try:
        reference = make_trainer(tmp_path / "one", data, fresh_model(len(tokenizer)), graphed=False)
        steps = reference.steps_per_epoch + 1  # crosses an epoch boundary and its smaller last batch
        generator, reference_losses = torch.Generator(), []
        for step in range(steps):
            generator.manual_seed(reference.args.seed * 1_000_003 + step)
            batch = data.batch(reference.batch_indices(step), generator)
            reference_losses.append(reference.optimizer_step(batch, 0, 1).item())
    finally:
        torch.set_num_threads(threads)
    torch.multiprocessing.spawn(
        _graphed_bodies_in_one_of_two_processes, args=(tmp_path, steps, gradient_reduce_dtype, update), nprocs=2
    )
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    # Both processes replay the same graph (token capacity) at every step, or their collectives would not match.
    assert first["capacities"] == second["capacities"]
    assert first["losses"] == pytest.approx(
        reference_losses, abs=TOLERANCE if gradient_reduce_dtype == "fp32" else 1e-3
    )
    differences = []
    for name, a, b, c in zip(
        [n for n, _ in reference.model.named_parameters()], first["parameters"], second["parameters"],
        reference.model.parameters(),
    ):  # fmt: skip
        assert torch.equal(a, b), name  # the same summed gradients: the same parameters
        differences.append((a - c).abs().flatten())
    differences = torch.cat(differences)
    if gradient_reduce_dtype == "fp32":
        assert differences.max() <= 1e-5
    else:  # a few elements one learning-rate step (3e-3) apart per step at most; nearly all as in fp32
        assert differences.max() <= 2 * 3e-3 and differences.mean() <= 2e-5
        assert differences.max() > 1e-5  # the sums were rounded: the bf16 path ran


def test_training_path_selection():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_training_path("auto", cpu) == "eager"
    assert resolve_training_path("auto", gpu) == "graphed"  # one process or several
    assert resolve_training_path("plain", gpu) == "plain"
    with pytest.raises(ValueError, match="needs CUDA devices"):
        resolve_training_path("graphed", cpu)
    with pytest.raises(ValueError, match="training_path must be one of"):
        resolve_training_path("turbo", cpu)


def test_inductor_options_unknown_to_the_installed_torch_are_left_out():
    """The graphed step's options reach inductor where this torch has them (nested ones by their dotted
    name), and an option of a newer torch is dropped rather than refused."""
    options = {**GraphedStepper.INDUCTOR_OPTIONS, "triton.enable_pdl": True, "an_option_of_a_later_torch": 1}
    kept = known_inductor_options(options)
    assert kept == {name: value for name, value in options.items() if name != "an_option_of_a_later_torch"}
    assert known_inductor_options({}) == {}


@pytest.mark.parametrize("kind", ["pretraining", "augmented"])
def test_the_compiled_step_builds_the_same_batches(pretraining_data, tmp_path, kind):
    """Compiled, the packed step builds its batch (span corruption, variants, plain-text exposures) through
    torch.compile: token for token the uncompiled batch, from one graph for every step."""
    tokenizer, pretraining = pretraining_data
    data = pretraining if kind == "pretraining" else augmented_mixed_data(tokenizer)
    trainer = make_trainer(tmp_path, data, fresh_model(len(tokenizer)), graphed=True)
    stepper = GraphedStepper(trainer, compile_model=True, bucket=64)
    torch._dynamo.reset()
    counters.clear()
    for step in range(trainer.steps_per_epoch + 1):  # the last batch of an epoch is smaller: padded, not valid
        stepper._prepare_packed(step)
        arguments = (stepper.indices, stepper.valid, stepper.seq_len)
        compiled = stepper.compiled_device_batch(*arguments, uniforms=stepper.uniforms)
        eager = data.device_batch(*arguments, uniforms=stepper.uniforms)
        for built, expected in zip(compiled, eager):
            assert torch.equal(built, expected), step
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


def test_the_compiled_step_clips_and_sets_the_rate_as_the_uncompiled_one(pretraining_data, tmp_path, monkeypatch):
    """Compiled, the step's gradient clipping and learning rate run through torch.compile: the same gradients
    and rate as the uncompiled function, at every step of the schedule. (On a GPU the multi-tensor update clips
    and sets the rate itself; this is the path it replaces.)"""
    monkeypatch.setattr(GraphedStepper, "MULTI_TENSOR_UPDATE", False)
    tokenizer, data = pretraining_data
    trainer = make_trainer(tmp_path, data, fresh_model(len(tokenizer)), graphed=True)
    stepper = GraphedStepper(trainer, compile_model=True, bucket=64)
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    for step in (0, 3, trainer.steps_per_epoch * 2 + 5):  # the last one is past the schedule's end
        gradients = [torch.randn(p.shape, generator=generator) * 10 for p in stepper.parameters]
        results = []
        for clip_and_rate in (stepper._clip_and_rate, stepper.compiled_clip_and_rate):
            for parameter, gradient in zip(stepper.parameters, gradients):
                parameter.grad = gradient.clone()
            stepper.step_counter.fill_(step)
            stepper.learning_rate.fill_(-1.0)
            clip_and_rate()
            results.append(([p.grad.clone() for p in stepper.parameters], stepper.learning_rate.item()))
        (plain_gradients, plain_rate), (compiled_gradients, compiled_rate) = results
        last = len(trainer.lr_multipliers) - 1
        assert compiled_rate == plain_rate == pytest.approx(3e-3 * trainer.lr_multipliers[min(step, last)])
        assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in plain_gradients])) == pytest.approx(1.0)
        for plain, compiled in zip(plain_gradients, compiled_gradients):
            torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-7)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


@pytest.mark.parametrize("attention_type", ["vanilla", "rope"])
def test_the_compiled_packed_step_through_sdpa_is_one_trace(pretraining_data, tmp_path, attention_type):
    """Packed training where the fused kernel does not run (`--no_fused_attention`; SDPA) compiles without graph
    breaks, its token count dynamic: one trace of the model serves every bucket. A break in the projection into
    the (B, T) grid (torch 2.11's dynamo could not take the truth of a bound method) specialized the token count
    that the step marks dynamic, and the compiled run stopped with a ConstraintViolationError on a GPU."""
    tokenizer, data = pretraining_data
    trainer = make_trainer(tmp_path, data, fresh_model(len(tokenizer), attention_type), graphed=True)
    assert trainer.model.config._attn_implementation == "sdpa"
    stepper = GraphedStepper(trainer, compile_model=True, bucket=64)
    torch._dynamo.reset()
    counters.clear()
    capacities = set()
    for step in range(trainer.steps_per_epoch + 1):
        trainer.optimizer.zero_grad(set_to_none=True)
        capacity = stepper._prepare_packed(step)
        capacities.add(capacity)
        stepper._body(capacity)
    assert len(capacities) > 1, capacities  # several buckets: the token count varied
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the model, the step's batch and its clipping: one graph each
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def test_a_later_compiled_step_loads_what_an_earlier_one_traced(pretraining_data, tmp_path, monkeypatch):
    """The compiled step's three parts are compiled whole and saved beside the compiled artifacts
    (`compile_cache.functions_file`): a later stepper for the same model and step loads them, traces nothing,
    and computes the same losses over every bucket of token counts. Under bf16 autocast, as the recipes train:
    entered around a loaded entry's call, autocast changed the tensors' dispatch keys that its guards check, and
    the model was traced again in every process."""
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path / "compiled"))
    tokenizer, data = pretraining_data
    runs = []
    for name in ("first", "later"):
        torch._dynamo.reset()
        counters.clear()
        model = fresh_model(len(tokenizer))
        trainer = make_trainer(tmp_path / name, data, model, graphed=True, mixed_precision="bf16")
        stepper = GraphedStepper(trainer, compile_model=True, bucket=64)
        losses, capacities = [], set()
        for step in range(trainer.steps_per_epoch + 1):
            trainer.optimizer.zero_grad(set_to_none=True)
            capacity = stepper._prepare_packed(step)
            capacities.add(capacity)
            stepper._body(capacity)
            losses.append(stepper.take_loss().item())
        stepper.save_compiled()
        runs.append((losses, dict(counters["stats"]), [len(part.entries) for part in stepper.precompiled]))
    (first_losses, first_stats, first_entries), (later_losses, later_stats, later_entries) = runs
    assert len(capacities) > 1, capacities  # several buckets, one graph
    assert first_stats["unique_graphs"] == 3 and first_entries == later_entries == [1, 1, 1]
    assert later_stats.get("calls_captured", 0) == 0, later_stats
    # Not bit for bit: bf16 sums on CPU threads; on a GPU, run after the file's other tests, one loss of the two
    # steppers differed by 1.2e-5 of itself (H100, 2026-12-05), run alone by less than 1e-5: the algorithms that
    # cuBLAS picks for the products may differ. A wrong or stale step moves them by far more.
    assert later_losses == pytest.approx(first_losses, rel=1e-4)


def test_the_compiled_artifacts_file_depends_on_the_model_not_its_path(pretraining_data, tmp_path, monkeypatch):
    """The package's file of compiled artifacts (`compile_cache`) is keyed by the model, the step and the code:
    the same for a model loaded from any checkpoint path, another for another width, attention implementation
    or version of the code it traces."""
    tokenizer, data = pretraining_data
    files = []
    cases = [("", 32, "sdpa"), ("/runs/a/pretrained", 32, "sdpa"), ("/runs/b/pretrained", 32, "sdpa")]
    cases += [("", 64, "sdpa"), ("", 32, "eager")]  # another width; another attention implementation
    for name_or_path, width, attention in cases:
        config = tiny_config("vanilla", vocab_size=len(tokenizer), block_size=BLOCK, n_embd=width, n_head=4)
        model = KnowGPTForCausalLM(config)
        model.config._name_or_path = name_or_path
        model.set_attn_implementation(attention)
        trainer = make_trainer(tmp_path / str(len(files)), data, model, graphed=True)
        files.append(GraphedStepper(trainer, compile_model=True, bucket=64).artifacts)
    assert files[0] == files[1] == files[2] and len({files[0], files[3], files[4]}) == 3
    # another version of the code: what was compiled for the package's own model is not loaded for it
    monkeypatch.setattr(fast_path, "code_digest", lambda model: "edited")
    model = KnowGPTForCausalLM(
        tiny_config("vanilla", vocab_size=len(tokenizer), block_size=BLOCK, n_embd=32, n_head=4)
    )
    trainer = make_trainer(tmp_path / "edited", data, model, graphed=True)
    assert GraphedStepper(trainer, compile_model=True, bucket=64).artifacts not in files


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(
    "packed, later_graphs_after_their_step",
    [(True, True), (True, False), (False, True)],
    ids=["packed", "packed-later-graphs-restored", "dense"],
)
def test_captured_graphs_replay_the_uncaptured_step_exactly(
    pretraining_data, tmp_path, monkeypatch, packed, later_graphs_after_their_step
):
    """Steps over an epoch boundary and several graphs (packed: one per token count; a later graph captured after
    its first step ran uncaptured as the step it is, or after a warm-up step restored) end on the parameters of
    the same steps run uncaptured: no step taken twice or left out."""
    monkeypatch.setattr(GraphedStepper, "LATER_GRAPHS_AFTER_THEIR_STEP", later_graphs_after_their_step)
    tokenizer, data = pretraining_data
    model = fresh_model(len(tokenizer)).cuda()  # no dropout: both runs are deterministic
    reference = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_epochs=2, batch_size=16, training_path="graphed")
    steppers = []
    for module in (model, reference):
        trainer = KnowGPTTrainer(module, data, args)
        trainer.data.to("cuda")
        trainer.optimizer = trainer._make_optimizer(graphed=True)
        steppers.append(GraphedStepper(trainer, packed=packed, bucket=64))
    graphed, uncaptured = steppers
    if not packed:  # the dense body draws its spans on the device: give both the same fixed batch
        fixed = data.device_batch(torch.arange(16, device="cuda"), torch.ones(16, dtype=torch.bool, device="cuda"), 58)
        data.device_batch = lambda indices, valid, seq_len, uniforms=None: fixed
    steps = graphed.steps_per_epoch + 2
    graphed.run(0, steps, lambda: False)
    for step in range(steps):
        uncaptured.optimizer.zero_grad(set_to_none=True)
        uncaptured._body(uncaptured._prepare_packed(step) if packed else None)
    torch.cuda.synchronize()
    assert len(graphed.graphs) >= (3 if packed else 1) and graphed.capture_seconds > 0
    assert graphed.step_counter.item() == uncaptured.step_counter.item() == steps
    # one record per graph, in the order captured, their seconds adding up to the capture time
    assert [capture["tokens"] for capture in graphed.captures] == list(graphed.graphs)
    assert sum(capture["seconds"] for capture in graphed.captures) == pytest.approx(graphed.capture_seconds)
    uncaptured.loss_count = steps  # its bodies ran without `run`, which counts them
    assert abs(graphed.take_loss().item() - uncaptured.take_loss().item()) < 1e-4
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_compiled_step_whose_first_call_fails_trains_uncompiled(pretraining_data, tmp_path, monkeypatch, caplog):
    """The model's compiled step raising on its first call (as torch 2.11's did for the synthesizer, IndexError in
    inductor's `copy_misaligned_inputs`): the stepper captures the uncompiled step instead, trains as the
    uncompiled stepper does, and reports itself uncompiled."""
    from hf_knowgpt.training import compile_cache

    class FailingEntry:
        def guard_check(self, *args, **kwargs):
            return True

        def __call__(self, *args, **kwargs):
            raise IndexError("list index out of range")

    compile_whole = compile_cache.PrecompiledFunction._compile
    monkeypatch.setattr(
        compile_cache.PrecompiledFunction, "_compile",
        lambda self, args, kwargs: FailingEntry() if self.name == "model" else compile_whole(self, args, kwargs),
    )  # fmt: skip
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path / "compiled"))
    tokenizer, data = pretraining_data
    model = fresh_model(len(tokenizer)).cuda()  # no dropout: both runs are deterministic
    reference = copy.deepcopy(model)
    steppers = []
    for module, compiled in ((model, True), (reference, False)):
        args = TrainingArguments(output_dir=str(tmp_path / str(compiled)), max_epochs=2, batch_size=16,
                                 training_path="graphed", compile=compiled)  # fmt: skip
        trainer = KnowGPTTrainer(module, data, args)
        trainer.data.to("cuda")
        trainer.optimizer = trainer._make_optimizer(graphed=True)
        steppers.append(GraphedStepper(trainer, compile_model=compiled, packed=True, bucket=64))
    fallen_back, uncompiled = steppers
    steps = fallen_back.steps_per_epoch + 2
    for stepper in steppers:
        stepper.run(0, steps, lambda: False)
    torch.cuda.synchronize()
    assert "model's compiled code failed on its first call (IndexError" in caplog.text
    assert fallen_back.compile_requested and not fallen_back.compiled and len(fallen_back.graphs) >= 2
    assert abs(fallen_back.take_loss().item() - uncompiled.take_loss().item()) < 1e-4
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name


@pytest.mark.skipif(not fused_attention_available(), reason="the multi-tensor update needs Triton and a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["uncompiled", "compiled"])
def test_captured_steps_update_with_the_multi_tensor_kernels_as_with_torchs_adamw(
    pretraining_data, tmp_path, monkeypatch, compiled
):
    """The captured step's update in three launches (`kernels.multi_tensor_adamw`) against the clipping and
    torch's fused AdamW it replaces: fp32, no dropout, the same parameters and optimizer state after steps over
    an epoch boundary and several graphs, and the same learning rate written into the optimizer."""
    tokenizer, data = pretraining_data
    model = fresh_model(len(tokenizer)).cuda()
    reference = copy.deepcopy(model)
    steppers = []
    for module, multi_tensor in ((model, True), (reference, False)):
        monkeypatch.setattr(GraphedStepper, "MULTI_TENSOR_UPDATE", multi_tensor)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(multi_tensor)), max_epochs=3, batch_size=16, training_path="graphed",
            grad_norm_clip=0.5, compile=compiled,
        )  # fmt: skip
        trainer = KnowGPTTrainer(module, data, args)
        trainer.data.to("cuda")
        trainer.optimizer = trainer._make_optimizer(graphed=True)
        steppers.append(GraphedStepper(trainer, compile_model=compiled, packed=True, bucket=64))
    kernels, torch_adamw = steppers
    assert kernels.update is not None and torch_adamw.update is None
    steps = 2 * kernels.steps_per_epoch + 1
    for stepper in steppers:
        stepper.run(0, steps, lambda: False)
    torch.cuda.synchronize()
    assert len(kernels.graphs) >= 2, "several token counts: several graphs, each with its own gradients"
    assert kernels.learning_rate.item() == pytest.approx(torch_adamw.learning_rate.item(), rel=1e-6)
    # The moments are judged against each moment's largest value over the model: some gradients are 0 up to
    # rounding (the attention keys' bias: softmax ignores a constant added to every score), and their moments
    # are rounding noise in either way (seen on an H200: 1e-12, with every parameter equal).
    scales = {
        key: max(torch_adamw.optimizer.state[p][key].abs().max().item() for p in reference.parameters())
        for key in ("exp_avg", "exp_avg_sq")
    }
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")
        state, reference_state = kernels.optimizer.state[a], torch_adamw.optimizer.state[b]
        assert float(state["step"]) == float(reference_state["step"]) == steps, name
        for key, scale in scales.items():
            torch.testing.assert_close(
                state[key], reference_state[key], rtol=1e-3, atol=1e-4 * scale,
                msg=lambda text, name=name, key=key: f"{name} {key}: {text}",
            )  # fmt: skip


@pytest.mark.skipif(not fused_attention_available(), reason="the fused kernel needs Triton and a CUDA device")
@pytest.mark.parametrize(
    "attention_type, fused_layers, stacked_inputs, residual_in_fp32",
    [("vanilla", False, False, True), ("rope", False, False, True), ("synthesizer", False, False, True),
     ("perceiver", False, False, True), ("vanilla", True, False, True), ("vanilla", False, True, True),
     ("rope", False, True, True), ("vanilla", False, False, False), ("vanilla", True, False, False)],
)  # fmt: skip
def test_compiled_bf16_steps_follow_the_uncompiled_ones(
    pretraining_data, tmp_path, attention_type, fused_layers, stacked_inputs, residual_in_fp32, monkeypatch
):
    """torch.compile changes rounding, not the function: under bf16 with the fused kernel, the compiled body's
    losses follow the uncompiled body's step by step, with the residual LayerNorm kernels too (`fused_layers`:
    one trace for every token count all the same), with the attention's three inputs handed over as one
    (`STACKED_ATTENTION_INPUTS`), and with the residual stream in bf16 (`residual_in_fp32` off). (At these small
    sizes it passed on an H100 while the handouts' perceiver trained wrongly when compiled, because two kernel
    arguments shared memory: it does not catch that fault; `test_no_written_kernel_argument_shares_memory_with_another`
    does.)"""
    monkeypatch.setattr(attention_knowgpt, "STACKED_ATTENTION_INPUTS", stacked_inputs)
    tokenizer, data = pretraining_data
    torch.manual_seed(0)
    config = tiny_config(attention_type, vocab_size=len(tokenizer), block_size=BLOCK, n_layer=4, n_head=2,
                         n_embd=64, bottleneck_dim=16, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
                         residual_in_fp32=residual_in_fp32)  # fmt: skip
    reference = KnowGPTForCausalLM(config).cuda()
    losses = {}
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        model.set_attn_implementation("triton")
        model.transformer.fused_layers = fused_layers
        args = TrainingArguments(output_dir=str(tmp_path), max_epochs=2, batch_size=16, training_path="graphed")
        trainer = KnowGPTTrainer(model, data, args)
        trainer.data.to("cuda")
        trainer.optimizer = trainer._make_optimizer(graphed=True)
        stepper = GraphedStepper(trainer, compile_model=compiled, bucket=64)
        stepper.autocast_dtype = torch.bfloat16
        losses[compiled], capacities = [], set()
        torch._dynamo.reset()
        counters.clear()
        for step in range(6):
            trainer.optimizer.zero_grad(set_to_none=True)
            capacity = stepper._prepare_packed(step)
            capacities.add(capacity)
            stepper._body(capacity)
            losses[compiled].append(stepper.take_loss().item())
    assert losses[True] == pytest.approx(losses[False], rel=2e-2), losses
    # Traced and lowered once for every token count: no recompilation per bucket, and no lowering thrown
    # away (compiling with dynamic=True made float attributes symbolic, and dynamo started over).
    assert len(capacities) > 1
    assert counters["aot_autograd"]["total"] == counters["stats"]["unique_graphs"], dict(counters)
    if attention_type != "perceiver":  # the perceiver's step breaks into several graphs (data-dependent branches)
        # the batch's, the model's, and the clipping's unless the multi-tensor update clips (one CUDA process)
        expected = 2 if stepper.update is not None else 3
        assert counters["stats"]["unique_graphs"] == expected, dict(counters)
    assert losses[False][-1] < losses[False][0]  # it trains


class _NoHostReads:
    """Fail on any read of a tensor's value by the host: inside a CUDA graph capture it would abort it."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(name):
            def method(tensor, *args, **kwargs):
                raise AssertionError(f"host read of a tensor value ({name}) inside the captured step")

            return method

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))
        return self

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("attention_type", ["vanilla", "rope", "synthesizer", "perceiver"])
@pytest.mark.parametrize("packed, shuffle", [(True, False), (False, False), (False, True)])
def test_the_captured_body_never_reads_device_values_on_the_host(
    pretraining_data, tmp_path, attention_type, packed, shuffle
):
    tokenizer, data = pretraining_data
    model = fresh_model(len(tokenizer), attention_type, dropout=0.1)
    trainer = make_trainer(tmp_path, data, model, graphed=True)
    trainer.args.shuffle = shuffle
    stepper = GraphedStepper(trainer, packed=packed, bucket=64)
    capacity = stepper._prepare_packed(0) if packed else None  # host work, outside the graph
    stepper._body(capacity)  # the first step creates the optimizer state (allowed to look at things once)
    # The optimizer's own capture safety is torch's (capturable=True on CUDA, checked by the GPU test below);
    # on the CPU its fused kernel may read the step count, so it runs outside the guard here.
    guard = _NoHostReads()
    optimizer_step = stepper.optimizer.step

    def unguarded_optimizer_step():
        guard.__exit__(None, None, None)
        optimizer_step()
        guard.__enter__()

    stepper.optimizer.step = unguarded_optimizer_step
    capacity = stepper._prepare_packed(1) if packed else None
    with guard:
        stepper._body(capacity)
    assert int(stepper.step_counter) == 2


def test_mixed_data_holds_documents_and_questions(pretraining_data):
    tokenizer, pretraining = pretraining_data
    questions = question_data(tokenizer)
    mixed = MixedData(pretraining, questions)
    assert mixed.num_examples == 80 and mixed.static_length == max(58, questions.static_length)
    indices = torch.tensor([0, 39, 40, 79])
    batch = mixed.batch(indices, torch.Generator().manual_seed(0))
    assert ((batch.input_ids[:2] == 1).sum(1) == 2).all()  # documents: span-corrupted, two ⁇
    assert torch.equal(batch.input_ids[2], questions.input_ids[0]) and torch.equal(
        batch.labels[3], questions.labels[39]
    )
    lengths, _ = mixed.plan(indices, torch.Generator().manual_seed(0))
    assert torch.equal(lengths, batch.lengths)


def test_triton_is_pointed_at_torchs_ptxas_unless_the_user_chose_one(tmp_path, monkeypatch):
    """inductor sets TRITON_PTXAS_PATH when it first compiles and Triton keys its cache on it: a CUDA run sets
    the same value first, so every kernel build of every process sees one value."""
    from hf_knowgpt.kernels import pin_triton_ptxas

    ptxas = tmp_path / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "__init__.py"))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    pin_triton_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/my/ptxas")
    pin_triton_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/my/ptxas"
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    ptxas.unlink()  # a torch without its own ptxas: Triton keeps its own
    pin_triton_ptxas()
    assert "TRITON_PTXAS_PATH" not in os.environ


def test_compile_workers_are_released_on_a_thread_once_training_ends(monkeypatch):
    import types

    from hf_knowgpt.kernels import release_compile_workers

    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    assert release_compile_workers() is None  # inductor never ran: nothing to release
    calls = []
    fake = types.SimpleNamespace(shutdown_compile_workers=lambda: calls.append(threading.current_thread().name))
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    thread = release_compile_workers()
    thread.join(timeout=10)
    assert not thread.daemon and calls == ["release-compile-workers"]


# Allocates and frees 40–60 MiB blocks (above glibc's largest automatic mmap threshold, 32 MiB), touching
# every page, and prints the mmap threshold set ("reuse") and the page faults taken.
PAGE_FAULT_PROBE = """
import resource, sys, torch
from hf_knowgpt.training.fast_path import reuse_freed_memory
threshold = reuse_freed_memory() if sys.argv[1] == "reuse" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(30):
    block = torch.empty((40 + step % 20) << 20, dtype=torch.uint8).fill_(1)
    del block
print(threshold, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_cpu_training_reuses_freed_memory_instead_of_faulting_in_fresh_pages():
    faults = {}
    for mode in ("default", "reuse"):
        done = subprocess.run([sys.executable, "-c", PAGE_FAULT_PROBE, mode], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        threshold, faults[mode] = done.stdout.split()
    if threshold == "None" or int(threshold) < 64 << 20:
        pytest.skip(f"this libc took an mmap threshold of {threshold}, below the probe's blocks")
    # by default every block is a fresh mapping (about 12,000 page faults each); kept, the heap is reused
    # (367,434 against 50,705 faults on the project's CPU)
    assert int(faults["reuse"]) * 4 < int(faults["default"])


def test_compile_is_true_false_or_auto():
    assert TrainingArguments(output_dir="o", compile="auto").compile == "auto"
    with pytest.raises(ValueError, match="compile: must be True, False or 'auto', got 'sometimes'"):
        TrainingArguments(output_dir="o", compile="sometimes")


def test_tuning_kernels_needs_compiling():
    assert TrainingArguments(output_dir="o", compile="auto", tune_kernels=True).tune_kernels is True
    with pytest.raises(ValueError, match="tune_kernels: tunes the compiled step's kernels \\(give --torch_compile"):
        TrainingArguments(output_dir="o", tune_kernels=True)


def test_tuned_kernels_compile_with_coordinate_descent_through_tritons_launcher():
    """`tune_kernels` adds inductor's coordinate-descent tuning and leaves its static launcher, whose kernels
    torch 2.11 tuned again in every process; the options are part of the artifacts file's key."""
    plain, tuned = GraphedStepper.inductor_options(False), GraphedStepper.inductor_options(True)
    assert "coordinate_descent_tuning" not in plain and "use_static_cuda_launcher" not in plain
    assert tuned == {**plain, "coordinate_descent_tuning": True, "use_static_cuda_launcher": False}


def test_gradients_are_summed_in_fp32_or_bf16_only():
    assert TrainingArguments(output_dir="o", gradient_reduce_dtype="bf16").gradient_reduce_dtype == "bf16"
    with pytest.raises(ValueError, match="gradient_reduce_dtype: must be one of \\['fp32', 'bf16'\\], got 'fp16'"):
        TrainingArguments(output_dir="o", gradient_reduce_dtype="fp16")


def test_bf16_sums_register_ddps_bf16_hook_for_the_eager_path():
    from accelerate.utils import DDPCommunicationHookType

    fp32 = make_accelerator(TrainingArguments(output_dir="o"), cpu=True)
    bf16 = make_accelerator(TrainingArguments(output_dir="o", gradient_reduce_dtype="bf16"), cpu=True)
    assert fp32.ddp_handler is None
    assert bf16.ddp_handler.comm_hook == DDPCommunicationHookType.BF16


def test_a_resumed_optimizer_gets_one_learning_rate_tensor_again(tmp_path):
    """The graphed step writes one learning-rate tensor that every parameter group reads. A checkpoint's optimizer
    state, loaded as accelerate loads it (onto the CPU), gives the groups the saved rate instead, a CPU tensor:
    on a GPU the capture then failed ("Cannot copy between CPU and CUDA tensors during CUDA graph capture")."""
    import io

    from hf_knowgpt.training.optimization import handout_parameter_groups, share_device_learning_rate

    def optimizer():
        model = fresh_model(30)
        rate = torch.tensor(3e-3)
        made = torch.optim.AdamW(handout_parameter_groups(model, 0.1), lr=rate, capturable=True)
        share_device_learning_rate(made, torch.device("cpu"))
        return made

    saved = optimizer()
    saved.param_groups[0]["lr"].fill_(1e-3)  # as the graph leaves it mid-run
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    resumed = optimizer()
    captured = resumed.param_groups[0]["lr"]  # the tensor a graph captured before the state was loaded
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu"))
    loaded = [group["lr"] for group in resumed.param_groups]
    assert len(loaded) == 2 and all(rate is not captured for rate in loaded)  # the loaded state replaced it
    shared = share_device_learning_rate(resumed, torch.device("cpu"))
    assert all(group["lr"] is shared for group in resumed.param_groups)
    assert shared.item() == pytest.approx(1e-3) and shared.dtype == torch.float32
    shared.fill_(5e-4)  # what the captured step does: every group follows
    assert all(group["lr"].item() == pytest.approx(5e-4) for group in resumed.param_groups)


def test_auto_compiles_only_where_an_earlier_run_saved_its_artifacts(pretraining_data, tmp_path, monkeypatch):
    """`compile="auto"`: uncompiled while the package holds no artifacts for the model and step, compiled once it
    does (`GraphedStepper.artifacts`); several processes always compile (the background process is one)."""
    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path / "compiled"))
    tokenizer, data = pretraining_data
    trainer = make_trainer(tmp_path / "run", data, fresh_model(len(tokenizer)), graphed=True)
    first = GraphedStepper(trainer, compile_model="auto", bucket=64)
    assert first.compiled is False and first.compiled_clip_and_rate is None and not first.artifacts.exists()
    assert first.load_seconds == 0.0
    compiled = GraphedStepper(trainer, compile_model=True, bucket=64)
    compiled._body(compiled._prepare_packed(0))
    compiled.save_compiled()
    assert compiled.artifacts == first.artifacts and first.artifacts.is_file()
    again = GraphedStepper(trainer, compile_model="auto", bucket=64)
    assert again.compiled is True and again.compiled_clip_and_rate is not None and again.load_seconds > 0


def test_the_background_compile_rebuilds_the_same_step_and_releases_its_lock(
    pretraining_data, tmp_path, monkeypatch, caplog
):
    """`start_background_compile` hands the step to a process of its own: its trainer has the same model
    configuration, arguments (compiled, one step) and data, so its step has the same artifacts file; the
    process runs to the end (on a CPU the eager path: nothing to compile) and removes its lock and folder."""
    from hf_knowgpt.training import background_compile

    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path / "compiled"))
    tokenizer, data = pretraining_data
    trainer = make_trainer(tmp_path / "run", data, fresh_model(len(tokenizer)), graphed=True)
    artifacts = GraphedStepper(trainer, bucket=64).artifacts
    child = background_compile.start_background_compile(trainer, artifacts, "sdpa")
    lock = artifacts.with_suffix(".compiling")
    assert lock.read_text() == str(child.pid)
    assert background_compile.start_background_compile(trainer, artifacts, "sdpa") is None  # one at a time
    specification = Path(child.args[-3])
    rebuilt = background_compile.trainer_from_specification(specification)
    assert rebuilt.args.compile is True and rebuilt.args.stop_after_steps == 1
    assert rebuilt.args.output_dir != trainer.args.output_dir
    rebuilt.optimizer = torch.optim.AdamW(rebuilt.model.parameters(), lr=torch.tensor(1e-3))  # as train() makes it
    assert GraphedStepper(rebuilt, bucket=64).artifacts == artifacts
    assert child.wait(timeout=600) == 0, artifacts.with_suffix(".log").read_text()[-3000:]
    assert not lock.exists() and not specification.parent.exists()
    # on a CPU nothing was saved: the next attempt says the last one did not save the step, and where its log is
    with caplog.at_level(logging.WARNING, logger="hf_knowgpt.training.background_compile"):
        retry = background_compile.start_background_compile(trainer, artifacts, "sdpa")
    assert f"did not save {artifacts} (its log: {artifacts.with_suffix('.log')})" in caplog.text
    assert retry.wait(timeout=600) == 0
    lock.write_text("999999999")  # a process that no longer runs: its lock is taken over
    assert background_compile._claim(lock) and lock.read_text() == str(os.getpid())


def test_the_background_compile_of_tuned_kernels_waits_for_the_run_to_end(pretraining_data, tmp_path, monkeypatch):
    """With `tune_kernels` the background process is given the run's process id and starts once no process
    has it: tuning times kernels on the GPU, which the run's own kernels would share."""
    import dataclasses
    import signal
    import time

    from hf_knowgpt.training import background_compile

    monkeypatch.setenv("KNOWGPT_COMPILE_CACHE", str(tmp_path / "compiled"))
    tokenizer, data = pretraining_data
    trainer = make_trainer(tmp_path / "run", data, fresh_model(len(tokenizer)), graphed=True)
    trainer.args = dataclasses.replace(trainer.args, compile="auto", tune_kernels=True)
    artifacts = GraphedStepper(trainer, bucket=64).artifacts
    child = background_compile.start_background_compile(trainer, artifacts, "sdpa")
    try:
        assert child.args[-1] == str(os.getpid())
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # it would wait for this test's process
        child.wait()
        shutil.rmtree(Path(child.args[-3]).parent, ignore_errors=True)
    # the wait itself: a run that ends after a second, reaped as a shell reaps it
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    threading.Thread(target=run.wait).start()
    started = time.perf_counter()
    background_compile.wait_for_exit(run.pid, poll_seconds=0.05)
    assert time.perf_counter() - started > 0.5
    with pytest.raises(ProcessLookupError):
        os.kill(run.pid, 0)
    background_compile.wait_for_exit(0)  # no process to wait for: at once


TUNED_STEP_PROBE = """
import json, sys
import torch
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
from test_fast_path import _pretraining_data, fresh_model
from hf_knowgpt.training.arguments import TrainingArguments
from hf_knowgpt.training.fast_path import GraphedStepper
from hf_knowgpt.training.trainer import KnowGPTTrainer

tokenizer, data = _pretraining_data()
args = TrainingArguments(output_dir=sys.argv[2], max_epochs=2, batch_size=16, training_path="graphed",
                         compile=True, tune_kernels=True)
trainer = KnowGPTTrainer(fresh_model(len(tokenizer)).cuda(), data, args)
trainer.data.to("cuda")
trainer.optimizer = trainer._make_optimizer(graphed=True)
stepper = GraphedStepper(trainer, compile_model=True, bucket=64)
losses = []
for step in range(3):
    trainer.optimizer.zero_grad(set_to_none=True)
    stepper._body(stepper._prepare_packed(step))
    losses.append(stepper.take_loss().item())
stepper.save_compiled()
print(json.dumps({"tuned": counters["inductor"]["coordesc_tuning_bench"], "losses": losses}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tuning times Triton kernels on a CUDA device")
def test_tuned_kernels_are_kept_for_later_processes(tmp_path):
    """A compiled step with `tune_kernels` tunes its kernels once: a later process loads the tuned
    configurations from inductor's cache and tunes nothing, and so does one given only the package's file
    (inductor's and Triton's caches emptied, as after a reboot)."""
    caches = {name: str(tmp_path / name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env = {**os.environ, **caches, "KNOWGPT_COMPILE_CACHE": str(tmp_path / "compiled")}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)  # a count set there keeps workers that drop the tuning (warned of)
    runs = []
    for name in ("first", "later", "after-reboot"):
        if name == "after-reboot":
            for folder in caches.values():
                shutil.rmtree(folder)
        done = subprocess.run([sys.executable, "-c", TUNED_STEP_PROBE, str(Path(__file__).parent), str(tmp_path / name)],
                              capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, later, after_reboot = runs
    assert first["tuned"] > 0 and later["tuned"] == 0 and after_reboot["tuned"] == 0, runs
