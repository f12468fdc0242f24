"""How one optimizer step runs: three implementations of the same step, chosen by `training_path`.

- `plain`: the handouts' way, kept as the baseline: a DataLoader corrupts one document per `__getitem__`,
  the model runs over every padded position with unfused attention.
- `eager`: batches are built on the device (the whole batch corrupted at once), only real positions are
  computed (`token_index`), attention goes through `scaled_dot_product_attention`; works with any
  number of processes (DDP through accelerate).
- `graphed` (CUDA, one process or several): the entire step — span corruption, forward, backward, the sum
  of the processes' gradients (one NCCL all-reduce), gradient clipping, the learning rate of this step and
  fused AdamW — is captured as CUDA graphs and replayed, so the host launches one graph per step and never
  waits for the device. Packed (the default), only real positions are computed, one graph per bucket of
  token counts; dense (one process only), every position up to the longest possible example.

All three see the same examples per step (file order, same batch boundaries, the last batch of an epoch
smaller), normalize the loss by the number of trained targets and follow the same per-step learning rates.
"""

import ctypes
import functools
import time

import torch
from torch.utils.data import DataLoader, Dataset

from data_loaders.encoding import collate_handout_pairs

from ..options import TRAINING_PATHS
from .compile_cache import (
    PrecompiledFunction,
    artifacts_file,
    code_digest,
    functions_file,
    load_artifacts,
    load_functions,
    save_artifacts,
    save_functions,
    wait_for_compiler_keys,
)
from .data import TrainingBatch
from .packed_steps import plan_packed_steps


def known_inductor_options(options: dict) -> dict:
    """`options` less those this torch's inductor does not have (each of the graphed step's options only
    changes its speed): an older torch refuses an option it does not know, and compiles without it here."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {name: value for name, value in options.items() if name in known}


def reuse_freed_memory() -> int | None:
    """Keep the memory a CPU training step frees inside the process, for the next step to reuse (glibc).

    glibc's malloc serves blocks above a threshold with fresh mmap()s and returns freed memory at the heap's
    top to the system; a step's activations (megabytes each, their sizes changing with every batch's token
    count) then fault in and zero new pages at every step: 0.88–1.13 M page faults in 10 quickstart epochs
    against 0.12 M with both thresholds raised, and 5–11% more time, the same losses (benchmarks/RESULTS.md).
    The process keeps its peak memory instead (the quick start's: 0.6 GB either way). Returns the size from
    which blocks still get their own mmap(), or None where glibc took no setting (elsewhere nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
    # 1 GiB; older glibc caps the mmap threshold at 32 MiB (64-bit) and refuses more
    taken = next((size for size in (1 << 30, 32 << 20) if mallopt(mmap_threshold, size)), None)
    return taken if taken and mallopt(trim_threshold, 1 << 30) else None


def resolve_training_path(requested: str, device: torch.device) -> str:
    if requested not in TRAINING_PATHS:
        raise ValueError(f"training_path must be one of {list(TRAINING_PATHS)}, got {requested!r}")
    if requested == "graphed" and device.type != "cuda":
        raise ValueError("training_path 'graphed' needs CUDA devices (CUDA graphs); use 'eager' elsewhere")
    if requested == "auto":
        return "graphed" if device.type == "cuda" else "eager"
    return requested


class EagerStepper:
    """Host-driven steps on device-built batches; DDP-safe through accelerate."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.generator = torch.Generator()  # host generator: corruption uniforms
        self.loss_sum = torch.zeros((), device=trainer.accelerator.device)
        self.loss_count = 0

    def run(self, first_step: int, count: int, should_stop) -> int:
        trainer, args = self.trainer, self.trainer.args
        accelerator = trainer.accelerator
        rank, world = accelerator.process_index, accelerator.num_processes
        done = 0
        for global_step in range(first_step, first_step + count):
            indices = trainer.batch_indices(global_step)
            self.generator.manual_seed(args.seed * 1_000_003 + global_step)
            batch = trainer.data.batch(indices, self.generator)
            self.loss_sum += trainer.optimizer_step(batch, rank, world)
            self.loss_count += 1
            done += 1
            if should_stop():
                break
        return done

    def take_loss(self):
        mean = self.loss_sum / max(self.loss_count, 1)
        self.loss_sum = torch.zeros_like(self.loss_sum)
        self.loss_count = 0
        return mean


class _OneExampleAtATime(Dataset):
    """The handouts' data path: `__getitem__` corrupts (or fetches) one example, a DataLoader collates."""

    def __init__(self, data, generator_seed: int):
        self.data = data
        self.generator = torch.Generator().manual_seed(generator_seed)

    def __len__(self):
        return self.data.num_examples

    def __getitem__(self, index):
        batch = self.data.batch(torch.tensor([index]), self.generator)
        return batch.input_ids[0, :-1], batch.labels[0, 1:].masked_fill(batch.labels[0, 1:] == -100, 0)


class PlainStepper(EagerStepper):
    """The handouts' way: per-example corruption through a DataLoader, every position computed, unfused
    attention; the step itself (loss normalization, clipping, AdamW, learning rate) is the shared one."""

    def __init__(self, trainer):
        super().__init__(trainer)
        trainer.data.to(torch.device("cpu"))  # examples are made on the host, as there
        self.loader = DataLoader(
            _OneExampleAtATime(trainer.data, trainer.args.seed),
            batch_size=trainer.args.batch_size,
            shuffle=False,
            num_workers=0,
            collate_fn=collate_handout_pairs,
        )
        self.iterator = None

    def run(self, first_step: int, count: int, should_stop) -> int:
        trainer = self.trainer
        device = trainer.accelerator.device
        done = 0
        for _ in range(count):
            if self.iterator is None:
                self.iterator = iter(self.loader)
            try:
                collated = next(self.iterator)
            except StopIteration:
                self.iterator = iter(self.loader)
                collated = next(self.iterator)
            input_ids, labels = collated["input_ids"].to(device), collated["labels"].to(device)
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1])
            trained = (collated["labels"][:, 1:] != -100).sum(1)
            batch = TrainingBatch(input_ids, labels, lengths, trained)
            self.loss_sum += trainer.optimizer_step(
                batch, trainer.accelerator.process_index, trainer.accelerator.num_processes, packed=False
            )
            self.loss_count += 1
            done += 1
            if should_stop():
                break
        return done


def model_loss(model, input_ids, labels, token_index, trained_targets, autocast_dtype=None):
    """The step's loss: `model` over the batch (`token_index`: its real positions, packed), normalized by the
    batch's number of trained targets, under autocast to `autocast_dtype` where one is given. Autocast is
    entered here, not around the call: a compiled entry loaded from a file rebuilds its guards on the
    tensors' dispatch keys outside any autocast, so a call from inside one would never match them."""
    with torch.autocast(
        input_ids.device.type,
        dtype=autocast_dtype or torch.float32,
        enabled=autocast_dtype is not None,
        cache_enabled=False,
    ):
        return model(
            input_ids=input_ids,
            labels=labels,
            token_index=token_index,
            num_items_in_batch=trained_targets,
            use_cache=False,
        ).loss


def clip_and_set_rate(parameters, max_norm, step_counter, learning_rates, learning_rate):
    """The gradients clipped to `max_norm` (none where it is 0 or None), and the step's learning rate set from
    the step counter (the schedule's last rate past its end)."""
    if max_norm:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    step = step_counter.clamp(max=len(learning_rates) - 1)
    learning_rate.copy_(learning_rates.index_select(0, step.view(1))[0])


class GraphedStepper:
    """The whole optimizer step as CUDA graphs, replayed once per step.

    The step counter, the learning rates of all steps and the corpus live on the device; the graph
    computes this step's learning rate itself. Capturing needs a few warm-up steps; the model and
    optimizer are restored afterwards, so the run continues from exactly the state it had.

    Packed (the default): the host draws the step's corruption randomness from the same per-step seeded
    generator as the eager path (so both see the same examples), works out which positions are real,
    and sends the batch indices, the uniforms, the packed token index and the batch's number of trained
    targets to the device (pinned, async); the number of real tokens is rounded up to a multiple of
    `bucket`, and each such size gets its own graph, captured the first time it occurs. Dense (one process
    only): everything, randomness included (the device's default generator), is built inside the graph from
    the step counter, over ⌊7B/8⌋ + 2 positions.

    Several processes (`accelerate launch --num_processes N`): each trains its slice of the global batch
    (the eager path's slices), its loss normalized by the whole batch's trained targets, and the graph
    sums the gradients over processes with one all-reduce of them all, flattened (NCCL collectives can be
    captured); the model is not wrapped in DDP, whose hooks break the capture of the backward pass. Every
    process takes the largest of the processes' token buckets for the step, known to all from the host-side
    plan, so all capture and replay the same graphs in the same order and their collectives match.
    """

    # Steps run before capturing a graph. The first graph's compile the step, create the optimizer's state and
    # settle the allocator; a later graph (another token count) finds all that done: one step meets its shapes
    # (about 0.2 s less of a warm run's capture on an H200, benchmarks/RESULTS.md).
    WARMUP_STEPS = 3
    LATER_WARMUP_STEPS = 1
    # One process: a later graph's warm-up is its first step itself, run uncaptured, and its capture waits for
    # nothing, where torch.cuda.graph synchronizes the device and empties the device's and the pinned host
    # memory's caches first, and the warm-up's state had to be restored: the device goes on with the steps
    # queued before it while the host captures. (Several processes keep the restored warm-up: not measured there.)
    LATER_GRAPHS_AFTER_THEIR_STEP = True
    # Real tokens of a packed step rounded up to a multiple of this: each multiple met gets its own graph (12
    # over the handout recipe's 14950 steps, 7 with 512), and the rounding adds 1.7% of a step's 7515 real
    # tokens on average (3.4% with 512).
    BUCKET = 256
    # combo_kernels launches independent small kernels (weight casts, bias-gradient sums) as one: the step
    # is bound by ~200 kernels of a few µs (23.2–23.6 s of the handout recipe's steps against 25.8–26.3 s
    # without, H200). combo_kernel_per_subkernel_blocks gives each kernel of a combo its own block sizes: with
    # one size for all, the LayerNorm's column sums at width 1024 took 120–177 µs each (four processes' steps
    # 12.3 s against 9.2–9.3 s; at the handout size 23.3–23.7 s against 23.5–23.9 s). force_shape_pad pads
    # every matrix product to multiples of 8, the vocabulary's 257 logits too, which inductor otherwise leaves
    # to a slow unaligned kernel (28 µs a step): 0.55 s less of the handout recipe's steps on an H100, 6 runs
    # of 6. All in benchmarks/RESULTS.md. Options the installed torch lacks are left out (`known_inductor_options`).
    INDUCTOR_OPTIONS = {"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True, "force_shape_pad": True}
    # `tune_kernels`: coordinate-descent tuning of every kernel's block sizes and warps, kept in inductor's cache
    # and the package's file. Kernels loaded back through inductor's static launcher were tuned again in every
    # run on torch 2.11 (10–20 s of a warm run, pytorch#172819); through Triton's launcher a later run finds
    # the tuned configurations, for 0.3–0.6 s more of loading (benchmarks/RESULTS.md, "Coordinate-descent
    # tuning kept between runs"). Not the default: a warm handout run gains nothing, the first takes ~50 s more.
    TUNING_OPTIONS = {"coordinate_descent_tuning": True, "use_static_cuda_launcher": False}
    # The update (clipping, the step's learning rate, AdamW) in three launches for all parameters
    # (`kernels.multi_tensor_adamw`) where it applies (torch's AdamW as the trainer makes it); else the clipping
    # compiled with the step and torch's fused AdamW. The handout recipe's steps: 22.5-22.9 s against 23.1-23.5 s
    # (H200); 100 epochs at width 1024 (51M parameters), 15.20-15.48 s against 15.57-15.95 s (H100). Both in
    # benchmarks/RESULTS.md.
    MULTI_TENSOR_UPDATE = True
    # A compiled step's weight-gradient products, and the wide layers' bias gradients, taken together at the end of
    # its backward pass, in one launch (`kernels.grouped_products.WeightGradientsTogether`, a pass over inductor's
    # backward graph): the handout recipe's steps 19.8-20.1 s against 22.0-22.4 s, three pairs side by side on an
    # H100 (benchmarks/RESULTS.md, step_variants.py's `weight-gradients-together`).
    WEIGHT_GRADIENTS_TOGETHER = True
    # Packed steps made ready on the host this many at a time (`packed_steps.plan_packed_steps`).
    PLANNED_STEPS = 64

    def __init__(
        self, trainer, compile_model: bool | str = False, packed: bool | None = None, bucket: int | None = None
    ):
        self.trainer = trainer
        args, accelerator = trainer.args, trainer.accelerator
        device = accelerator.device
        self.device = device
        self.packed = args.packed if packed is None else packed
        self.bucket = bucket or self.BUCKET
        model = accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)  # autocast is done here
        options = self.inductor_options(args.tune_kernels) if device.type == "cuda" else None
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.rows = -(-args.batch_size // self.world)  # this process's slice of a full batch, at most
        self.seq_len = trainer.data.static_length
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.parameter_sizes = [p.numel() for p in self.parameters]
        self.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        self.learning_rates = torch.tensor(
            [args.learning_rate * m for m in trainer.lr_multipliers], device=device, dtype=torch.float32
        )
        self.learning_rate = self.optimizer.param_groups[0]["lr"]
        if not torch.is_tensor(self.learning_rate):
            raise ValueError("the graphed path needs an optimizer whose learning rate is a device tensor")
        self.update = self._multi_tensor_update(args.grad_norm_clip)
        # The package's file of what an earlier process compiled for this model and these step shapes.
        described = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}  # any checkpoint
        self.artifacts = artifacts_file(
            model=described, attention=model.config._attn_implementation, code=code_digest(model),
            fused_layers=bool(getattr(model.transformer, "fused_layers", False)),
            packed=self.packed, seq_len=self.seq_len, rows=self.rows,
            bucket=self.bucket, world=self.world, autocast=str(self.autocast_dtype), inductor=options,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            update="multi-tensor" if self.update else "torch",
        )  # fmt: skip
        if compile_model == "auto":  # compile where an earlier run saved what it compiled (several processes: always)
            compile_model = self.world > 1 or self.artifacts.is_file()
        self.step_counter = torch.zeros((), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count = 0
        if self.world > 1 and not self.packed:
            raise ValueError("the graphed path on several processes needs packed batches (packed=True)")
        self.gradient_reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.gradient_reduce_dtype]
        if self.world > 1:  # every process starts from the first one's parameters, as DDP's construction ensures
            with torch.no_grad():
                for parameter in self.parameters:
                    torch.distributed.broadcast(parameter, src=0)
        data = trainer.data
        self.num_examples = data.num_examples
        self.batch_size = args.batch_size
        self.steps_per_epoch = trainer.steps_per_epoch
        self.orders = None if self.packed else trainer.device_orders()  # (epochs, N) when shuffling
        # Inputs of packed graphs, written before each replay.
        self.generator = torch.Generator()
        self.plan = None  # the steps made ready ahead (`plan_packed_steps`)
        self.indices = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.valid = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(self.rows, data.uniform_columns, dtype=torch.float64, device=device)
        self.trained_targets = torch.ones((), dtype=torch.float32, device=device)  # the global batch's
        self.token_indices = {}  # capacity -> device buffer
        self.graphs = {}  # capacity (None when dense) -> CUDA graph
        self.pool = None
        self.capture_stream = None  # later graphs' (`LATER_GRAPHS_AFTER_THEIR_STEP`)
        self.captures = []  # {"tokens", "seconds"} of each graph captured, in order (the first compiles)
        self.compile_requested = compile_model
        self.model = model
        self.model_loss = functools.partial(model_loss, model)
        self.compiled_device_batch = self.compiled_clip_and_rate = None
        self.precompiled = []
        self.load_seconds = 0.0  # loading what earlier processes compiled (`_compile`)
        if compile_model:
            started = time.perf_counter()
            self._compile(options)
            self.load_seconds = time.perf_counter() - started

    def _multi_tensor_update(self, max_norm):
        """The update in three launches (`MULTI_TENSOR_UPDATE`), where it applies; None where it does not."""
        if not self.MULTI_TENSOR_UPDATE or self.device.type != "cuda":
            return None
        from ..kernels.multi_tensor_adamw import MultiTensorAdamW, multi_tensor_adamw_applies

        if not multi_tensor_adamw_applies(self.optimizer, self.parameters):
            return None
        return MultiTensorAdamW(self.optimizer, self.parameters, max_norm, self.learning_rates, self.learning_rate)

    @classmethod
    def inductor_options(cls, tune_kernels: bool = False) -> dict:
        """What the step compiles with on a GPU; part of its artifacts file's key."""
        options = {**cls.INDUCTOR_OPTIONS, **(cls.TUNING_OPTIONS if tune_kernels else {})}
        if cls.WEIGHT_GRADIENTS_TOGETHER:
            from ..kernels.grouped_products import WeightGradientsTogether

            options["post_grad_custom_post_pass"] = WeightGradientsTogether()  # its repr names its code, for the key
        return known_inductor_options(options)

    def _compile(self, options):
        """The step's three parts compiled, each whole, from what an earlier process saved where it did."""
        wait_for_compiler_keys()  # computed while the data and model were made ready (`prefetch_compiler_keys`)
        load_artifacts(self.artifacts)  # back into the compiler's caches, where these are empty
        # Packed, only the token count varies (one graph for every bucket): the token index is compiled with its
        # size a symbol. `dynamic=True` would make every float attribute symbolic too (LayerNorm eps, dropout p,
        # the embeddings' norm_type), which inductor cannot keep, so dynamo traced and lowered everything twice:
        # 8 of a warm run's 10 s of compilation (benchmarks/RESULTS.md).
        compiled_model_loss = PrecompiledFunction(
            model_loss, "model", dynamic=None if self.packed else False, options=options,
            dynamic_arguments={3: 0} if self.packed else None,  # model_loss's token_index: one graph, every bucket
        )  # fmt: skip
        self.model_loss = functools.partial(compiled_model_loss, self.model)
        self.precompiled.append(compiled_model_loss)
        # Packed, the step's batch (span corruption from the host's uniforms) has the same shapes at every step;
        # compiled, its ~50 small index and comparison kernels become a few fused ones.
        if self.packed:
            data = self.trainer.data
            compiled_device_batch = PrecompiledFunction(
                type(data).device_batch, "batch", dynamic=False, options=options
            )
            self.compiled_device_batch = functools.partial(compiled_device_batch, data)
            self.precompiled.append(compiled_device_batch)
        # Likewise the clipping (a norm per parameter, their norm, a scale per parameter) and the step's rate, where
        # the multi-tensor update does not do them itself.
        if self.update is None:
            compiled_clip_and_rate = PrecompiledFunction(clip_and_set_rate, "clip", dynamic=False, options=options)
            self.compiled_clip_and_rate = functools.partial(compiled_clip_and_rate, *self._clip_and_rate_arguments())
            self.precompiled.append(compiled_clip_and_rate)
        load_functions(functions_file(self.artifacts), self.precompiled)

    # -- what a step computes (captured; no host synchronization inside) -----------------------------------------
    def _body(self, capacity=None):
        trainer = self.trainer
        step = self.step_counter
        if self.packed:
            indices, valid, token_index = self.indices, self.valid, self.token_indices[capacity]
            device_batch = self.compiled_device_batch or trainer.data.device_batch
            input_ids, labels = device_batch(indices, valid, self.seq_len, uniforms=self.uniforms)
            trained_targets = self.trained_targets
        else:
            epoch, offset = step // self.steps_per_epoch, step % self.steps_per_epoch
            positions = offset * self.batch_size + torch.arange(self.batch_size, device=self.device)
            valid = positions < self.num_examples
            positions = positions.clamp(max=self.num_examples - 1)
            if self.orders is None:
                indices = positions
            else:  # tensors only as indices: a 0-d tensor used as a Python index is read on the host
                indices = self.orders[epoch.clamp(max=self.orders.shape[0] - 1).expand_as(positions), positions]
            input_ids, labels = trainer.data.device_batch(indices, valid, self.seq_len)
            token_index = None
            trained_targets = (labels[:, 1:] != -100).sum()
        loss = self.model_loss(input_ids, labels, token_index, trained_targets, self.autocast_dtype)
        loss.backward()
        if self.update is not None:  # with several processes, it reads the sum's buffer; `.grad` stays this one's
            self.update.step(self.step_counter, self._sum_gradients_over_processes() if self.world > 1 else None)
        else:
            if self.world > 1:
                self._copy_back_gradients(self._sum_gradients_over_processes())
            (self.compiled_clip_and_rate or self._clip_and_rate)()
            self.optimizer.step()
        # Each process's loss is its share of the batch's mean; the log averages over processes.
        self.loss_sum.add_(loss.detach(), alpha=self.world)
        self.step_counter.add_(1)

    def _tables_captured(self):
        """After a capture: the update's tables of what the captured step reads (its gradients' addresses) filled
        before the graph first replays."""
        if self.update is not None:
            self.update.tables_captured()

    def _clip_and_rate_arguments(self):
        return (
            self.parameters,
            self.trainer.args.grad_norm_clip,
            self.step_counter,
            self.learning_rates,
            self.learning_rate,
        )

    def _clip_and_rate(self):
        clip_and_set_rate(*self._clip_and_rate_arguments())

    def _sum_gradients_over_processes(self) -> torch.Tensor:
        """One all-reduce for all gradients, flattened into one fp32 buffer (returned), where one collective per
        parameter would cost a launch and a rendezvous each. Summed in bf16 (`gradient_reduce_dtype`), the buffer
        is cast before the sum and back after it (two more kernels)."""
        flat = torch.cat([p.grad.reshape(-1) for p in self.parameters])
        summed = flat.to(self.gradient_reduce_dtype)  # fp32: the buffer itself
        torch.distributed.all_reduce(summed)
        if summed is not flat:
            flat.copy_(summed)
        return flat

    def _copy_back_gradients(self, flat: torch.Tensor) -> None:
        """The summed gradients into `.grad`, for torch's clipping and optimizer (not the multi-tensor update's)."""
        gradients = [p.grad for p in self.parameters]
        parts = [part.view_as(gradient) for part, gradient in zip(flat.split(self.parameter_sizes), gradients)]
        torch._foreach_copy_(gradients, parts)

    # -- host side of packed steps ------------------------------------------------------------------------------
    def _prepare_packed(self, global_step: int, planned: int | None = None):
        """Send this step's indices, uniforms, token index and trained-target count to the device; return
        the graph's capacity (tokens). Steps are made ready `planned` (PLANNED_STEPS) at a time, ahead."""
        plan = self.plan
        if plan is None or not plan.first <= global_step < plan.first + len(plan.capacities):
            plan = self.plan = plan_packed_steps(
                self.trainer, self.generator, global_step, planned or self.PLANNED_STEPS, rows=self.rows,
                seq_len=self.seq_len, bucket=self.bucket, world=self.world, rank=self.rank,
                pin=self.device.type == "cuda",
            )  # fmt: skip
        step = global_step - plan.first
        capacity = plan.capacities[step]
        if capacity not in self.token_indices:
            self.token_indices[capacity] = torch.zeros(capacity, dtype=torch.long, device=self.device)
        token_index = plan.token_index[plan.token_offsets[step] : plan.token_offsets[step + 1]]
        for target, source in (
            (self.indices, plan.indices[step]),
            (self.valid, plan.valid[step]),
            (self.uniforms, plan.uniforms[step]),
            (self.token_indices[capacity], token_index),
            (self.trained_targets, plan.trained_targets[step]),
        ):
            target.copy_(source, non_blocking=plan.pinned)
        return capacity

    # -- capture and replay ----------------------------------------------------------------------------------------
    def _snapshot(self):
        state = [p.detach().clone() for p in self.parameters]
        optimizer_state = {
            id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in self.optimizer.state[p].items()}
            for p in self.parameters
            if p in self.optimizer.state
        }
        return state, optimizer_state, self.step_counter.clone(), self.loss_sum.clone()

    def _restore(self, snapshot):
        state, optimizer_state, step_counter, loss_sum = snapshot
        with torch.no_grad():
            for parameter, saved in zip(self.parameters, state):
                parameter.copy_(saved)
            for parameter in self.parameters:
                for key, value in self.optimizer.state[parameter].items():
                    saved = optimizer_state.get(id(parameter), {}).get(key)
                    if torch.is_tensor(value):
                        value.copy_(saved) if saved is not None else value.zero_()
            self.step_counter.copy_(step_counter)
            self.loss_sum.copy_(loss_sum)

    def capture(self, first_step: int, capacity=None) -> bool:
        """Capture the graph of `capacity` tokens (None: dense) before step `first_step`; True where that step
        was taken meanwhile (`LATER_GRAPHS_AFTER_THEIR_STEP`), False where the graph has yet to take it."""
        started = time.perf_counter()
        if self.graphs and self.world == 1 and self.LATER_GRAPHS_AFTER_THEIR_STEP:
            self.optimizer.zero_grad(set_to_none=True)
            self._body(capacity)  # the step itself, uncaptured: the new token count's warm-up
            self.optimizer.zero_grad(set_to_none=True)  # the graph's gradients come from its own memory
            graph = torch.cuda.CUDAGraph()
            self.capture_stream = self.capture_stream or torch.cuda.Stream()
            with torch.cuda.stream(self.capture_stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="global")
                try:
                    self._body(capacity)
                finally:
                    graph.capture_end()
            self._tables_captured()
            self.graphs[capacity] = graph
            self.captures.append({"tokens": capacity, "seconds": time.perf_counter() - started})
            return True
        self.step_counter.fill_(first_step)
        snapshot = self._snapshot()
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(self.LATER_WARMUP_STEPS if self.graphs else self.WARMUP_STEPS):
                self.optimizer.zero_grad(set_to_none=True)
                self._body(capacity)
        torch.cuda.current_stream().wait_stream(side_stream)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        # With several processes NCCL's watchdog thread queries events while this one captures; "thread_local"
        # checks this thread's calls only.
        mode = "thread_local" if self.world > 1 else "global"
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
            self._body(capacity)
        self._tables_captured()
        self.pool = self.pool or graph.pool()  # every graph shares one memory pool: they replay in turn
        self.graphs[capacity] = graph
        self._restore(snapshot)
        torch.cuda.synchronize()
        self.captures.append({"tokens": capacity, "seconds": time.perf_counter() - started})
        return False

    @property
    def compiled(self) -> bool:
        """Whether the step runs compiled: asked for, and no compiled part fell back to running uncompiled
        (`PrecompiledFunction.runs_uncompiled`)."""
        return self.compile_requested and not any(function.runs_uncompiled for function in self.precompiled)

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing graphs (their warm-up steps and the first one's compilation included)."""
        return sum(capture["seconds"] for capture in self.captures)

    def run(self, first_step: int, count: int, should_stop) -> int:
        end = first_step + count
        for global_step in range(first_step, end):
            capacity = (
                self._prepare_packed(global_step, min(self.PLANNED_STEPS, end - global_step)) if self.packed else None
            )
            if capacity not in self.graphs and self.capture(global_step, capacity):
                continue  # the new graph's warm-up was this step
            self.graphs[capacity].replay()
        self.loss_count += count
        return count

    def take_loss(self):
        mean = self.loss_sum / max(self.loss_count, 1)
        self.loss_sum.zero_()
        self.loss_count = 0
        return mean

    def save_compiled(self) -> None:
        """Keep what this run compiled for later processes (`compile_cache`); the first process only."""
        if self.compile_requested and self.rank == 0:
            save_artifacts(self.artifacts)
            save_functions(functions_file(self.artifacts), self.precompiled)


__all__ = [
    "EagerStepper",
    "GraphedStepper",
    "PlainStepper",
    "TRAINING_PATHS",
    "resolve_training_path",
    "reuse_freed_memory",
]
