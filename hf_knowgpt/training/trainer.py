"""Training KnowGPT exactly as the handouts' trainer does, through accelerate.

What the handout trainer does, and this loop reproduces (`../shared/notes/REPRODUCING.md` explains why
each detail decides whether the model memorizes the corpus):
- batches in file order, the same batches every epoch (its DataLoader does not shuffle);
- AdamW, betas (0.9, 0.95), weight decay on every parameter whose name lacks "bias" (its no-decay list
  also names "LayerNorm.weight", which matches nothing in minGPT, so embeddings and LayerNorm weights
  decay too), gradient norm clipped to 1.0;
- the learning rate set after each step from the tokens seen so far, counting every target position
  (127 per example): linear warmup over 512·20 tokens, then a cosine to 10% of the peak at
  `final_tokens`; the first step runs at the full rate.

Batches are built on the training device: a whole batch of documents is span-corrupted at once from a
generator seeded by (seed, step), so a run is reproducible, a resumed run continues exactly, and every
process of a multi-process run corrupts the same global batch and trains on its own slice. Examples
fill about half of their block, so by default only real positions are computed (`token_index`); the loss
is normalized by the global number of trained targets, so the gradient equals the single-process one.
"""

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed

from ..utils.checkpoints import (
    ACCELERATE_STATE,
    CHECKPOINT_PREFIX,
    STAGING_PREFIX,
    TRAINER_STATE,
    full_disk_as_output_error,
    latest_valid_checkpoint,
    list_checkpoints,
    quiet_progress_bars,
    validate_checkpoint,
    write_json_atomic,
)
from ..utils.errors import InputError
from .arguments import TrainingArguments
from .data import TrainingBatch, packed_token_index
from .fast_path import EagerStepper, GraphedStepper, PlainStepper, resolve_training_path, reuse_freed_memory
from .optimization import handout_lr_multipliers, handout_parameter_groups, rows_per_step, share_device_learning_rate
from .progress import progress_bar

logger = logging.getLogger(__name__)


def make_accelerator(args: TrainingArguments, cpu: bool | None = None) -> Accelerator:
    """One global batch of `batch_size` is split across processes, as one device would see it.

    Without a GPU the processes of `accelerate launch --multi_gpu --num_processes N` (torchrun) train
    together on CPUs through gloo; accelerate's own `--cpu` launcher starts several processes only with MPI.
    """
    kwargs = {"cpu": cpu if cpu is not None else not torch.cuda.is_available()}
    if args.mixed_precision is not None:  # else accelerate's own configuration (accelerate launch --mixed_precision)
        kwargs["mixed_precision"] = args.mixed_precision
    if args.report_to:
        kwargs.update(log_with=args.report_to, project_dir=str(tracking_dir(args)))
    if args.gradient_reduce_dtype == "bf16":  # the eager path's DDP; the graphed path casts its own all-reduce
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)]
    return Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True), **kwargs)


def check_output_dir(args: TrainingArguments):
    """An InputError when output_dir holds a run that this one would replace without --overwrite_output_dir, or
    a different run that --resume_from_checkpoint would continue; nothing is read but training_args.json."""
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise InputError(output_dir, "is a file", "--output_dir names a folder")
    held = output_dir.is_dir() and any(not p.name.startswith(STAGING_PREFIX) for p in output_dir.iterdir())
    if not held or args.overwrite_output_dir:
        return
    if not args.resume_from_checkpoint:
        raise InputError(
            output_dir,
            "already holds a run",
            "resume it with --resume_from_checkpoint latest, replace it with --overwrite_output_dir, "
            "or choose another --output_dir",
        )
    recorded = output_dir / "training_args.json"
    if recorded.is_file():
        try:
            previous = json.loads(recorded.read_text()).get("fingerprint") or {}
        except json.JSONDecodeError as error:
            raise InputError(recorded, f"unreadable ({error})", "--overwrite_output_dir replaces the run") from error
        current = args.fingerprint()
        changed = [
            f"{key} {previous[key]} → {current[key]}"
            for key in current
            if key in previous and previous[key] != current[key]
        ]
        if changed:
            raise InputError(
                output_dir,
                f"holds a different run: {', '.join(changed)}",
                "resume with the run's own settings, or --overwrite_output_dir to replace it",
            )


def tracking_dir(args: TrainingArguments) -> Path:
    """Where TensorBoard logs go: output_dir/runs/<run_name>, as transformers' Trainer puts them."""
    return Path(args.output_dir) / "runs"


class _StopRequested:
    """SIGINT/SIGTERM ask the loop to save a checkpoint at the next step boundary and stop."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Timeline:
    """Moments of a run without waiting for the device: CUDA events on a GPU, read once they have passed (a
    host synchronization every few steps would leave the GPU idle while the host prepares the next one);
    the host's clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def passed(self, mark) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, mark, since=None) -> float:
        """Seconds from `since` (the start) to `mark`, waiting for the device to reach it."""
        since = self.start if since is None else since
        if not self.cuda:
            return mark - since
        mark.synchronize()
        return since.elapsed_time(mark) / 1000


class _LossLog:
    """The loss every `log_every` steps, read from the device once it is there rather than when asked for:
    each reading is copied to the host asynchronously and logged (curve, progress bar, trackers) at a later
    log point, or when the run waits for the device anyway (checkpoints, the end)."""

    def __init__(self, trainer: "KnowGPTTrainer", timeline: _Timeline, progress, start_step: int):
        self.trainer, self.timeline, self.progress = trainer, timeline, progress
        self.pending = []  # (step, host loss, timeline mark)
        self.last_step, self.last_mark = start_step, timeline.start

    def record(self, step: int, loss: torch.Tensor):
        if loss.is_cuda:
            host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            host.copy_(loss.detach(), non_blocking=True)
            loss = host
        self.pending.append((step, loss, self.timeline.mark()))
        self.flush(wait=False)

    def flush(self, wait: bool):
        trainer = self.trainer
        args = trainer.args
        while self.pending and (wait or self.timeline.passed(self.pending[0][2])):
            step, loss, mark = self.pending.pop(0)
            seconds = self.timeline.seconds(mark, since=self.last_mark)
            positions = (step - self.last_step) * args.batch_size * (trainer.block_size - 1)
            self.last_step, self.last_mark = step, mark
            mean_loss = loss.item()
            lr = args.learning_rate * trainer.lr_multipliers[min(step, len(trainer.lr_multipliers) - 1)]
            trainer.loss_curve.append({"step": step, "loss": mean_loss, "lr": lr})
            tokens_per_second = f"{positions / max(seconds, 1e-9):,.0f}"
            self.progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=tokens_per_second)
            if args.report_to:
                trainer.accelerator.log({"train/loss": mean_loss, "train/lr": lr}, step=step)


@dataclass
class TrainingResult:
    global_step: int
    epochs: int
    final_loss: float | None
    train_seconds: float
    examples_per_second: float
    loss_curve: list = field(default_factory=list)
    interrupted: int = 0  # the signal that stopped the run, 0 when it ran to the end
    epoch_seconds: list = field(default_factory=list)  # seconds from the start (or resumption) to each epoch end
    warmup_seconds: float = 0.0  # graph capture and its warm-up steps, inside train_seconds
    load_seconds: float = 0.0  # loading what earlier processes compiled for the step, before train_seconds
    # from train()'s call to its first step: the optimizer, accelerate's preparation, the stepper (its loading
    # included), before train_seconds
    setup_seconds: float = 0.0
    captures: list = field(default_factory=list)  # {"tokens", "seconds"} of each CUDA graph captured
    compiled: bool = False  # whether the step ran compiled (with compile="auto": whether it was saved before)


class KnowGPTTrainer:
    """The training loop. `save_callback(directory, model)` writes the export files (tokenizer, model card)
    next to the weights of every checkpoint and of the final model."""

    def __init__(
        self,
        model,
        data,
        args: TrainingArguments,
        accelerator: Accelerator | None = None,
        save_callback=None,
        run_record: dict | None = None,
    ):
        self.accelerator = accelerator or make_accelerator(args)
        if args.per_device_train_batch_size is not None:  # the global batch of transformers' per-device flag
            args = replace(args, batch_size=args.per_device_train_batch_size * self.accelerator.num_processes)
        self.args = args
        self.run_record = run_record  # the run's whole resolved configuration, kept in training_args.json
        self.model = model
        self.data = data
        self.save_callback = save_callback
        self.block_size = model.config.block_size
        self.steps_rows = rows_per_step(data.num_examples, args.batch_size, args.max_epochs)
        self.steps_per_epoch = len(rows_per_step(data.num_examples, args.batch_size, 1))
        self._kept_order = None  # (epoch, its order): `_epoch_order`
        final_tokens = args.final_tokens or args.max_epochs * data.num_examples * self.block_size
        self.lr_multipliers = handout_lr_multipliers(
            self.steps_rows, self.block_size - 1, args.warmup_tokens, final_tokens
        )
        self.final_tokens = final_tokens

    # -- setup -----------------------------------------------------------------------------------------
    def _prepare_output_dir(self):
        args, output_dir = self.args, Path(self.args.output_dir)
        # Every process checks the folder as it is, before the first one changes it: all stop on the same
        # error (none waits at a barrier for one that stopped), or none does.
        check_output_dir(args)
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return
        if args.overwrite_output_dir and not args.resume_from_checkpoint and output_dir.is_dir():
            shutil.rmtree(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        for leftover in output_dir.glob(f"{STAGING_PREFIX}*"):  # from an interrupted save
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        record = {"fingerprint": args.fingerprint(), "arguments": asdict(args)}
        if self.run_record is not None:
            record["run_config"] = self.run_record
        write_json_atomic(output_dir / "training_args.json", record)

    def _resume_step(self) -> int:
        source = self.args.resume_from_checkpoint
        if not source:
            return 0
        if source == "latest":
            source, state = latest_valid_checkpoint(self.args.output_dir)
        else:
            state = validate_checkpoint(source)
        self.accelerator.load_state(str(Path(source) / ACCELERATE_STATE))
        self.loss_curve = state.get("loss_curve", [])
        self.accelerator.print(f"Resumed from {source} at step {state['global_step']}")
        return state["global_step"]

    # -- saving ------------------------------------------------------------------------------------------
    def _save_model_files(self, directory: Path):
        unwrapped = self.accelerator.unwrap_model(self.model)
        with quiet_progress_bars():
            unwrapped.save_pretrained(
                directory, is_main_process=self.accelerator.is_main_process, save_function=self.accelerator.save
            )
        if self.accelerator.is_main_process and self.save_callback is not None:
            self.save_callback(directory, unwrapped)

    def save_checkpoint(self, global_step: int):
        """Write checkpoint-N into a staging folder and rename it into place: a kill leaves the last one whole."""
        output_dir = Path(self.args.output_dir)
        final = output_dir / f"{CHECKPOINT_PREFIX}{global_step}"
        staging = output_dir / f"{STAGING_PREFIX}{CHECKPOINT_PREFIX}{global_step}"
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with full_disk_as_output_error(output_dir, final.name, left_in=staging):
            self.accelerator.save_state(str(staging / ACCELERATE_STATE))
            self._save_model_files(staging)
            if self.accelerator.is_main_process:
                write_json_atomic(
                    staging / TRAINER_STATE,
                    {
                        "global_step": global_step,
                        "epoch": global_step / self.steps_per_epoch,
                        "loss_curve": self.loss_curve,
                    },
                )
        if self.accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            for old in list_checkpoints(output_dir)[: -self.args.save_total_limit or None]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def save_final(self, metrics: dict):
        """The finished model in output_dir itself; files are staged and renamed in, config.json last."""
        output_dir = Path(self.args.output_dir)
        staging = output_dir / f"{STAGING_PREFIX}final"
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with full_disk_as_output_error(output_dir, "the final model", left_in=staging):
            self._save_model_files(staging)
            if self.accelerator.is_main_process:
                write_json_atomic(staging / "train_results.json", metrics)
        if self.accelerator.is_main_process:
            names = sorted((p.name for p in staging.iterdir()), key=lambda name: name == "config.json")
            for name in names:
                target = output_dir / name
                if target.is_dir():
                    shutil.rmtree(target)
                os.replace(staging / name, target)
            staging.rmdir()
        self.accelerator.wait_for_everyone()

    def _checkpoint_every(self) -> int:
        """Steps between checkpoints: --checkpointing_steps N, 'epoch', or 'epochs:K'."""
        every = str(self.args.checkpointing_steps)
        if every == "epoch":
            return self.steps_per_epoch
        if every.startswith("epochs:"):
            return int(every.split(":", 1)[1]) * self.steps_per_epoch
        try:
            return int(every)
        except ValueError:
            raise ValueError(f"checkpointing_steps must be an integer, 'epoch' or 'epochs:K', got {every!r}") from None

    def _should_checkpoint(self, global_step: int) -> bool:
        return bool(self.args.checkpointing_steps) and global_step % self._checkpoint_every() == 0

    # -- the loop ------------------------------------------------------------------------------------------
    def batch_indices(self, global_step: int) -> torch.Tensor:
        """The examples of a step: the handouts' batches in file order (or this epoch's shuffled order)."""
        epoch, step_in_epoch = divmod(global_step, self.steps_per_epoch)
        first = step_in_epoch * self.args.batch_size
        return self._epoch_order(epoch)[first : first + self.args.batch_size]

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """`epoch_order(epoch)`, kept for the epoch's other steps."""
        if self._kept_order is None or self._kept_order[0] != epoch:
            self._kept_order = (epoch, self.epoch_order(epoch))
        return self._kept_order[1]

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The examples of an epoch in the order its batches take them: file order, or shuffled by the seed."""
        if not self.args.shuffle:
            return torch.arange(self.data.num_examples)
        generator = torch.Generator().manual_seed(self.args.seed * 7919 + epoch)
        return torch.randperm(self.data.num_examples, generator=generator)

    def device_orders(self):
        if not self.args.shuffle:
            return None
        return torch.stack([self.epoch_order(e) for e in range(self.args.max_epochs)]).to(self.accelerator.device)

    def _make_optimizer(self, graphed: bool):
        args, device = self.args, self.accelerator.device
        optimizer = torch.optim.AdamW(
            handout_parameter_groups(self.model, args.weight_decay),
            lr=args.learning_rate,
            betas=args.betas,
            fused=device.type in ("cuda", "cpu"),  # on a CPU too: 0.35 ms a step, not 1.6, for the quickstart model
            capturable=graphed,
        )
        if graphed:  # a captured step reads its learning rate from a device tensor that the graph itself updates
            share_device_learning_rate(optimizer, device)
        return optimizer

    def train(self) -> TrainingResult:
        called = time.perf_counter()
        args, accelerator = self.args, self.accelerator
        # Each process its own dropout draws (seed + process index): with one seed, the processes' slices of a
        # batch would share their masks. One process: the seed itself.
        set_seed(args.seed, device_specific=True)
        if (
            args.gradient_reduce_dtype == "bf16"
            and accelerator.num_processes > 1
            and accelerator.device.type != "cuda"
        ):
            raise InputError(
                "gradient_reduce_dtype",
                "bf16 sums need GPUs: torch's bf16 hook for DDP runs with NCCL only, not on CPU processes (gloo)",
                "leave --gradient_reduce_dtype at fp32 on CPUs",
            )
        self._prepare_output_dir()
        accelerator.wait_for_everyone()
        device = accelerator.device
        path = resolve_training_path(args.training_path, device)
        self.training_path = path
        self.data.to(device)
        unwrapped = self.model
        attn_implementation = unwrapped.config._attn_implementation
        if device.type == "cpu":
            # Values that decay below 2⁻¹²⁶ (subnormal floats: optimizer moments of rarely used weights, their
            # products) take an x86 CPU many times longer per operation; flushed to zero, they cost nothing (a
            # from-scratch quickstart finetuning: 26 s instead of 32 s, the same loss to four digits).
            torch.set_flush_denormal(True)
            reuse_freed_memory()  # no fresh, zeroed pages for each step's activations
            # packed rows come longest first (optimizer_step) and attend group by group of similar length
            unwrapped.transformer.attention_by_length = path == "eager"
        if path == "plain":
            unwrapped.set_attn_implementation("eager")
        elif device.type == "cuda":
            from ..kernels import pin_triton_ptxas, use_training_matmul_settings
            from ..kernels.fused_attention import fused_attention_available

            pin_triton_ptxas()  # before any kernel is built: inductor would set it later, between builds
            if args.fused_attention and attn_implementation in (None, "sdpa") and fused_attention_available():
                unwrapped.set_attn_implementation("triton")
            if args.fused_layers and path == "graphed":
                from ..kernels.fused_layers import fused_layers_available

                unwrapped.transformer.fused_layers = fused_layers_available()
            use_training_matmul_settings()
        optimizer = self._make_optimizer(graphed=path == "graphed")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.lr_multipliers[min(step, len(self.lr_multipliers) - 1)]
        )
        if path == "graphed" and accelerator.num_processes > 1:
            # No DDP wrapper: the graph sums the gradients itself, and DDP's hooks break a CUDA graph capture of the
            # backward pass ("operation would make the legacy stream depend on a capturing blocking stream", seen on
            # two H200s); the stepper broadcasts the parameters as DDP would.
            self.model = accelerator.prepare_model(self.model, evaluation_mode=True)
            optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        else:
            self.model, optimizer, scheduler = accelerator.prepare(self.model, optimizer, scheduler)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.loss_curve = []
        start_step = self._resume_step()
        if path == "graphed" and start_step:  # the loaded state gave each group the saved rate, on the CPU
            share_device_learning_rate(optimizer, device)
        if args.report_to:  # each stage's logs in its own output_dir/runs, where transformers' Trainer puts them
            accelerator.project_configuration.logging_dir = str(tracking_dir(args))
            accelerator.init_trackers(args.run_name, config={k: str(v) for k, v in asdict(args).items()})
        stepper = {"plain": PlainStepper, "eager": EagerStepper}.get(path)
        stepper = stepper(self) if stepper else GraphedStepper(self, compile_model=args.compile)
        if args.compile == "auto" and isinstance(stepper, GraphedStepper) and not stepper.compiled:
            from .background_compile import log_file, start_background_compile

            started = start_background_compile(self, stepper.artifacts, attn_implementation)  # for the next run
            log = log_file(stepper.artifacts)
            when = ", once this run has ended (tuning times the kernels on the GPU)" if args.tune_kernels else ""
            where = (
                f"compiling it for the next run in the background{when} (log: {log})"
                if started
                else "another process compiles it"
            )
            accelerator.print(f"Training uncompiled: no compiled step is saved for this model yet; {where}")

        total_steps = len(self.steps_rows)
        progress = progress_bar(total_steps, start_step, disable=not accelerator.is_local_main_process)
        self.model.train()
        global_step, interrupted, epoch_marks = start_step, 0, []
        started = time.perf_counter()
        timeline = _Timeline(device)
        losses = _LossLog(self, timeline, progress, start_step)
        last_step = min(total_steps, args.stop_after_steps or total_steps)
        with _StopRequested() as stop:
            while global_step < last_step:
                boundary = min(last_step, (global_step // args.log_every + 1) * args.log_every)
                if args.checkpointing_steps:
                    every = self._checkpoint_every()
                    boundary = min(boundary, (global_step // every + 1) * every)
                # every epoch end is marked (a CUDA event: no waiting), so runs report their epoch times
                boundary = min(boundary, (global_step // self.steps_per_epoch + 1) * self.steps_per_epoch)
                done = stepper.run(global_step, boundary - global_step, lambda: stop.signal is not None)
                global_step += done
                progress.update(done)
                if global_step % self.steps_per_epoch == 0:
                    epoch_marks.append(timeline.mark())
                if path == "graphed":  # the graph sets the rates; keep the host scheduler's count for checkpoints
                    getattr(scheduler, "scheduler", scheduler).last_epoch = global_step
                if global_step % args.log_every == 0 or global_step == last_step or stop.signal is not None:
                    losses.record(global_step, accelerator.reduce(stepper.take_loss(), reduction="mean"))
                if self._should_checkpoint(global_step) or stop.signal is not None:
                    losses.flush(wait=True)  # the checkpoint holds the loss curve so far
                    self.save_checkpoint(global_step)
                if stop.signal is not None:
                    interrupted = int(stop.signal)
                    accelerator.print(f"Stopped by signal {stop.signal} at step {global_step}; checkpoint saved")
                    break
        if device.type == "cuda":
            torch.cuda.synchronize()
        if isinstance(stepper, GraphedStepper):
            stepper.save_compiled()
        losses.flush(wait=True)
        progress.close()
        seconds = time.perf_counter() - started
        unwrapped.config._attn_implementation = attn_implementation
        unwrapped.transformer.fused_layers = False
        unwrapped.transformer.attention_by_length = False
        if args.report_to:  # not end_training(): it also ends the process group, which a next stage needs
            for tracker in accelerator.trackers:
                tracker.finish()
            accelerator.trackers = []
        trained_examples = sum(self.steps_rows[start_step:global_step])
        return TrainingResult(
            global_step=global_step,
            epochs=global_step // self.steps_per_epoch,
            final_loss=self.loss_curve[-1]["loss"] if self.loss_curve else None,
            train_seconds=seconds,
            examples_per_second=trained_examples / max(seconds, 1e-9),
            loss_curve=self.loss_curve,
            interrupted=interrupted,
            epoch_seconds=[timeline.seconds(mark) for mark in epoch_marks],
            warmup_seconds=getattr(stepper, "capture_seconds", 0.0),
            load_seconds=getattr(stepper, "load_seconds", 0.0),
            setup_seconds=started - called,
            captures=getattr(stepper, "captures", []),
            compiled=getattr(stepper, "compiled", False),
        )

    def optimizer_step(self, batch: TrainingBatch, rank: int, world: int, packed: bool | None = None) -> torch.Tensor:
        """One optimizer step on this process's slice of the global batch; returns its loss (a device
        tensor: the mean of these over processes is the global mean loss)."""
        args, accelerator = self.args, self.accelerator
        packed = args.packed if packed is None else packed
        global_targets = int(batch.trained_targets.sum())  # host numbers: no device synchronization
        input_ids, labels, lengths = batch.input_ids, batch.labels, batch.lengths
        width = int(lengths.max())  # positions beyond every row's end are padding with no target
        input_ids, labels = input_ids[:, :width], labels[:, :width]
        if world > 1:
            rows = torch.tensor_split(torch.arange(input_ids.shape[0]), world)[rank]
            device_rows = rows.to(input_ids.device)
            input_ids, labels, lengths = input_ids[device_rows], labels[device_rows], lengths[rows]
        on_cpu = input_ids.device.type == "cpu"
        multiple = args.pack_multiple
        if multiple is None:
            multiple = 64 if on_cpu and accelerator.mixed_precision == "bf16" else 1
        groups = args.length_groups
        if groups is None:  # on CPU, groups of 32 rows or more (up to 4): smaller ones cost more than they save
            groups = min(4, max(1, input_ids.shape[0] // 32)) if on_cpu else 1
        if not packed or (groups == 1 and not on_cpu):
            row_groups = [None]
        else:  # host lengths: sorting costs no device synchronization. Longest first on a CPU also lets each
            # forward pass attend group by group of rows (TokenGrid.length_groups).
            order = lengths.argsort(descending=True, stable=True)
            row_groups = [g for g in torch.tensor_split(order, groups) if len(g)]
        loss = None
        for number, rows in enumerate(row_groups):
            group_ids, group_labels, group_lengths = input_ids, labels, lengths
            if rows is not None:
                group_width = int(lengths[rows].max())
                device_rows = rows.to(input_ids.device, non_blocking=True)
                group_ids, group_labels = input_ids[device_rows, :group_width], labels[device_rows, :group_width]
                group_lengths = lengths[rows]
            token_index = None
            if packed:
                token_index = packed_token_index(group_lengths, group_ids.shape[1], multiple)
                token_index = token_index.to(input_ids.device, non_blocking=True)
            last = number == len(row_groups) - 1
            with accelerator.no_sync(self.model) if not last else contextlib.nullcontext():
                with accelerator.autocast():
                    output = self.model(
                        input_ids=group_ids,
                        labels=group_labels,
                        token_index=token_index,
                        num_items_in_batch=global_targets / world,  # DDP averages over processes
                        use_cache=False,
                    )
                accelerator.backward(output.loss)  # group losses share one normalizer: they sum to the batch's
            loss = output.loss.detach() if loss is None else loss + output.loss.detach()
        if args.grad_norm_clip:
            accelerator.clip_grad_norm_(self.model.parameters(), args.grad_norm_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


__all__ = ["KnowGPTTrainer", "TrainingResult", "make_accelerator"]
