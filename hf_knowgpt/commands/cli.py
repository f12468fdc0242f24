"""Command-line flags shared by the scripts, and how they become a run's settings.

Every tuning flag defaults to `argparse.SUPPRESS`: a flag the user did not type is absent from the parsed
namespace, so it can never override the recipe. Flags that set a value carry its qualified name as their
`dest` (`model.n_embd`, `pretrain.max_epochs`, `run.seed`, ...), and `given_settings` hands exactly those
to `run_config.resolve_run_config`. Booleans come in pairs (`--shuffle` / `--no_shuffle`).

This module imports nothing heavy, so `--help` answers at once.
"""

import argparse
import gc
import os
import sys
import time

from ..options import ATTENTION_KERNEL_DTYPES, ATTENTION_TYPES, GRADIENT_REDUCE_DTYPES, TRAINING_PATHS
from ..training.recipes import RECIPES
from ..training.run_config import SECTIONS


class BooleanFlag(argparse.Action):
    """`--name` sets True, `--no_name` sets False; neither leaves the value to the recipe."""

    def __init__(self, option_strings, dest, default=argparse.SUPPRESS, help=None, **kwargs):
        strings = []
        for option in option_strings:
            strings += [option, "--no_" + option[2:]]
        super().__init__(strings, dest, nargs=0, default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no_"))

    def format_usage(self):
        return " | ".join(self.option_strings)


class CompileFlag(BooleanFlag):
    """`--torch_compile` sets True, `--torch_compile auto` sets "auto", `--no_torch_compile` sets False."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.nargs, self.metavar = "?", "auto"

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no_") and values is not None:
            parser.error(f"{option_string} takes no value, got {values!r}")
        if values not in (None, "auto"):
            parser.error(f"{option_string} takes no value or 'auto', got {values!r}")
        setattr(namespace, self.dest, False if option_string.startswith("--no_") else values or True)


def _value(group, name, dest, help, aliases=(), **kwargs):
    """A flag that sets the field `dest` (a qualified name) when given, and is absent otherwise. `aliases`
    are accepted too and named in the help text, not listed as flags of their own."""
    if "choices" not in kwargs and kwargs.get("action") is None:
        kwargs["metavar"] = name[2:].upper()
    if aliases:
        help = f"{help} (also {', '.join(aliases)})"
    group.add_argument(name, dest=dest, default=argparse.SUPPRESS, help=help, **kwargs)
    for alias in aliases:
        group.add_argument(alias, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def add_recipe_argument(parser):
    parser.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="handout",
        help="preset of sizes and hyperparameters; every other flag defaults to it (default: handout)",
    )


def add_model_arguments(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("model (defaults: the recipe's)")
    _value(group, "--attention_type", dest="model.attention_type", choices=ATTENTION_TYPES, help="attention variant")
    _value(group, "--n_layer", dest="model.n_layer", type=int, help="transformer blocks (handout: 4)")
    _value(group, "--n_head", dest="model.n_head", type=int, help="attention heads (handout: 8)")
    _value(group, "--n_embd", dest="model.n_embd", type=int, help="width (handout: 256)")
    _value(group, "--block_size", dest="model.block_size", type=int, help="positions per example (handout: 128)")
    _value(group, "--bottleneck_dim", dest="model.bottleneck_dim", type=int, help="perceiver latent positions (32)")
    _value(group, "--rope_theta", dest="model.rope_theta", type=float, help="RoPE base (10000)")
    for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
        _value(group, f"--{name}", dest=f"model.{name}", type=float, help=f"dropout {name} (handout: 0.1)")
    _value(
        group,
        "--attention_kernel_dtype",
        dest="model.attention_kernel_dtype",
        choices=[d for d in ATTENTION_KERNEL_DTYPES if d],
        help="precision of the attention kernel under bf16/fp16 autocast (float32)",
    )
    group.add_argument(
        "--residual_in_fp32",
        dest="model.residual_in_fp32",
        action=BooleanFlag,
        help="keep the residual stream in fp32 under bf16/fp16 autocast (on); --no_residual_in_fp32 runs it in "
        "autocast's dtype",
    )
    _value(
        group, "--recitation_length", "model.recitation_length", "answer after reciting up to this many characters "
        "of the person's document: question⁇recitation⁇answer⁇ (0: answer at once)", type=int,
    )  # fmt: skip
    _value(
        group, "--future_tokens", "model.future_tokens", "further heads predicting tokens beyond the next, their mean "
        "loss added in training (multi-token prediction; 0)", type=int,
    )  # fmt: skip
    _value(
        group, "--future_token_spacing", "model.future_token_spacing", "positions between the further heads' "
        "offsets: head j predicts the token 1 + j·spacing ahead (1)", type=int,
    )  # fmt: skip


def add_data_arguments(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("data (defaults: the recipe's)")
    _value(
        group,
        "--min_truncation_length",
        dest="data.min_truncation_length",
        type=int,
        help="shortest document prefix a pretraining example reads (handout: 4; knowledge recipe: 112)",
    )
    _value(
        group, "--max_truncation_length", "data.max_truncation_length", "longest document prefix a pretraining "
        "example reads (⌊7·block_size/8⌋)", type=int,
    )  # fmt: skip
    group.add_argument(
        "--mixed_training",
        dest="data.mixed_training",
        action=BooleanFlag,
        help="mix the training questions into every pretraining epoch (knowledge recipe: on)",
    )
    _value(
        group, "--document_repeats", "data.document_repeats", "each pretraining document this many times per "
        "epoch, corrupted afresh each time (1)", type=int,
    )  # fmt: skip
    _value(
        group, "--question_repeats", "data.question_repeats", "each mixed-in question this many times per epoch (1)",
        type=int,
    )  # fmt: skip
    _value(
        group, "--document_variants", "data.document_variants", "read each document as one of this many versions, "
        "drawn afresh at every exposure: the original and reorderings of its phrases behind its title (1)", type=int,
    )  # fmt: skip
    _value(
        group, "--plain_text_fraction", "data.plain_text_fraction", "share of document exposures read whole as "
        "plain text, without a masked span (0)", type=float,
    )  # fmt: skip
    _value(
        group, "--question_variants", "data.question_variants", "ask each mixed-in question in one of this many "
        "phrasings, drawn afresh at every exposure (1: only 'Where was <name> born?')", type=int,
    )  # fmt: skip


def _tracker(value: str):
    """--report_to's value: "tensorboard" (also "all", the only tracker installed), or "none" for None."""
    value = value.lower()
    if value == "none":
        return None
    return "tensorboard" if value == "all" else value


def add_stage_arguments(group, stage: str, prefix: str = ""):
    """The flags of the fields that differ between pretraining and finetuning, for one stage; `prefix` names
    the stage in train.py, which has both."""
    flag = f"--{prefix}"
    if prefix:
        _value(group, f"{flag}max_epochs", dest=f"{stage}.max_epochs", type=int, help=f"{stage} epochs")
    else:  # transformers' name, and the handouts'
        _value(group, "--num_train_epochs", f"{stage}.max_epochs", "epochs", aliases=["--max_epochs"], type=int)
    _value(
        group, f"{flag}batch_size", dest=f"{stage}.batch_size", type=int,
        help=f"{stage} global batch size, split across processes",
    )  # fmt: skip
    _value(
        group, f"{flag}per_device_train_batch_size", dest=f"{stage}.per_device_train_batch_size", type=int,
        help=f"{stage} batch size per process (the global batch is this × processes; instead of {flag}batch_size)",
    )  # fmt: skip
    lr_aliases = [f"--{prefix[:-1]}_lr"] if prefix else []
    _value(
        group, f"{flag}learning_rate", f"{stage}.learning_rate", f"{stage} peak learning rate",
        aliases=lr_aliases, type=float,
    )  # fmt: skip
    _value(
        group, f"{flag}final_tokens", dest=f"{stage}.final_tokens", type=int,
        help=f"{stage}: tokens at which the cosine reaches 10%% of the peak",
    )  # fmt: skip
    group.add_argument(
        f"{flag}shuffle",
        dest=f"{stage}.shuffle",
        action=BooleanFlag,
        help=f"{stage}: shuffle the examples every epoch (the handouts do not; knowledge pretraining does)",
    )


def add_training_arguments(parser: argparse.ArgumentParser, stage: str | None):
    """Training flags: for one stage (`pretrain.py`, `finetune.py`), or for both (`stage=None`: train.py,
    where the stage fields take a `--pretrain_` or `--finetune_` prefix and the rest apply to both)."""
    group = parser.add_argument_group("training (defaults: the recipe's)")
    section = stage or "run"
    if stage:
        add_stage_arguments(group, stage)
    else:
        for each in ("pretrain", "finetune"):
            add_stage_arguments(group, each, prefix=f"{each}_")
    _value(group, "--seed", dest=f"{section}.seed", type=int, help="seed for init, dropout and span corruption (0)")
    _value(
        group, "--weight_decay", dest=f"{section}.weight_decay", type=float, help="AdamW decay on all but biases (0.1)"
    )
    _value(
        group, "--max_grad_norm", f"{section}.grad_norm_clip", "gradient norm clipping (1.0)",
        aliases=["--grad_norm_clip"], type=float,
    )  # fmt: skip
    _value(group, "--warmup_tokens", dest=f"{section}.warmup_tokens", type=int, help="linear warmup tokens (512·20)")
    group.add_argument(
        "--packing", dest=f"{section}.packed", action=BooleanFlag,
        help="compute only real positions (default on; --no_packing computes the padding too: slower, same loss)",
    )  # fmt: skip
    _value(
        group, "--length_groups", dest=f"{section}.length_groups", type=int,
        help="eager path: run each batch as N length-sorted groups (default: up to 4 of ≥ 32 rows on CPU; 1 on GPU)",
    )  # fmt: skip
    _value(
        group, "--training_path", dest=f"{section}.training_path", choices=TRAINING_PATHS,
        help="auto (default): CUDA graphs of whole steps on GPUs, eager on CPU; plain: the handouts' DataLoader way",
    )  # fmt: skip
    if stage:
        compile_help = "compile the model inside the graphed step (faster steps; compilation is cached between runs)"
    else:  # finetuning's 80 steps would not repay a compilation
        compile_help = "compile the model for pretraining (faster steps; compilation is cached between runs)"
    compile_help += (
        "; 'auto': compile only where an earlier run saved what it compiled, else train uncompiled and compile "
        "for the next run in the background"
    )
    group.add_argument(
        "--torch_compile", dest=f"{stage or 'pretrain'}.compile", action=CompileFlag, help=compile_help
    )  # fmt: skip
    group.add_argument(
        "--tune_kernels", dest=f"{stage or 'pretrain'}.tune_kernels", action=BooleanFlag,
        help="with --torch_compile: time each compiled kernel's block sizes once and keep the fastest for later "
        "runs (slightly faster steps; the first compilation takes about a minute longer; on the knowledge recipe it "
        "answered about 0.6 points less, docs/training.md)",
    )  # fmt: skip
    _value(
        group, "--mixed_precision", dest=f"{section}.mixed_precision", choices=("no", "bf16", "fp16"),
        help="precision (default: accelerate's configuration, e.g. accelerate launch --mixed_precision bf16)",
    )  # fmt: skip
    _value(
        group, "--gradient_reduce_dtype", dest=f"{section}.gradient_reduce_dtype", choices=GRADIENT_REDUCE_DTYPES,
        help="several processes: sum the gradients in fp32 (default) or bf16 (half the traffic; on GPUs)",
    )  # fmt: skip
    group.add_argument(
        "--fused_attention", dest=f"{section}.fused_attention", action=BooleanFlag,
        help="bf16 on a GPU: the fused Triton attention kernel (default on)",
    )  # fmt: skip
    group.add_argument(
        "--fused_layers", dest=f"{section}.fused_layers", action=BooleanFlag,
        help="on a GPU: each residual sum with its dropout and the LayerNorm after it as one fused Triton kernel "
        "each way (default off)",
    )  # fmt: skip
    _value(
        group, "--logging_steps", f"{section}.log_every", "steps between loss reports (50)",
        aliases=["--log_every"], type=int,
    )  # fmt: skip
    _value(
        group, "--report_to", f"{section}.report_to", "log loss and learning rate to TensorBoard, in OUTPUT_DIR/runs "
        "(all: every tracker installed, here TensorBoard; none: no tracking)",
        type=_tracker, choices=["tensorboard", None],
    )  # fmt: skip
    group.add_argument(
        "--with_tracking", dest=f"{section}.report_to", action="store_const", const="tensorboard",
        default=argparse.SUPPRESS, help="track the run (as --report_to tensorboard)",
    )  # fmt: skip
    _value(
        group, "--checkpointing_steps", dest=f"{section}.checkpointing_steps",
        help="save a resumable checkpoint every N steps, 'epoch' or 'epochs:K'",
    )  # fmt: skip
    _value(group, "--save_total_limit", dest=f"{section}.save_total_limit", type=int, help="checkpoints kept (2)")
    _value(
        group, "--resume_from_checkpoint", dest=f"{section}.resume_from_checkpoint",
        help="a checkpoint folder, or 'latest' in output_dir",
    )  # fmt: skip
    group.add_argument(
        "--overwrite_output_dir", dest=f"{section}.overwrite_output_dir", action=BooleanFlag,
        help="replace an output_dir holding another run",
    )  # fmt: skip
    parser.add_argument("--output_dir", default=None, help="where the checkpoint is saved")
    parser.add_argument("--num_people", type=int, default=None, help="size of the synthetic corpus used without paths")
    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true", help="upload the final checkpoint")
    hub.add_argument("--hub_model_id", default=None, help="repository id (default: the output folder's name)")
    hub.add_argument("--hub_token", default=None, help="token (default: the logged-in one)")


def given_settings(args: argparse.Namespace) -> dict:
    """The settings the user gave: the parsed flags whose dest is a qualified name (absent when not given)."""
    return {name: value for name, value in vars(args).items() if name.split(".")[0] in SECTIONS and "." in name}


def _files(args, **paths):
    """The run's files: the flags' paths, the rest synthetic when no corpus is given (the embedded default)."""
    from data_loaders.corpus import DataFiles

    data_dir = getattr(args, "data_dir", None)
    base = DataFiles.from_data_dir(data_dir) if data_dir else DataFiles()
    files = base.replaced(**paths)
    if files.corpus is None and not data_dir and not getattr(args, "model_name_or_path", None):
        synthetic = DataFiles.synthetic(args.num_people)
        files = synthetic.replaced(**paths)
    return files


def _refuse_model_flags_for_a_checkpoint(args, given):
    from ..utils.errors import InputError

    model_flags = sorted(name.split(".", 1)[1] for name in given if name.startswith("model."))
    if getattr(args, "model_name_or_path", None) and model_flags:
        raise InputError(
            f"--{', --'.join(model_flags)}",
            f"the model of --model_name_or_path {args.model_name_or_path} is loaded with its own configuration",
            "model flags apply only to a new model: drop them",
        )


def checked_plan(config, given: dict):
    """The plan, checked before anything heavy runs: a new model's configuration and every stage's output
    folder (a checkpoint to start from is checked where it is read)."""
    from ..training.trainer import check_output_dir
    from ..utils.errors import InputError

    if config.finetune_from != "pretrained" or config.pretrain is not None:
        from ..configuration_knowgpt import KnowGPTConfig

        try:
            KnowGPTConfig(vocab_size=1024, **config.model)
        except ValueError as error:
            flags = " ".join(
                f"--{name.split('.', 1)[1]} {value}" for name, value in given.items() if name.startswith("model.")
            )
            raise InputError(flags or f"--recipe {config.recipe}", str(error)) from None
    for stage in config.stages:
        check_output_dir(getattr(config, stage))
    return config


def pretraining_plan(args):
    """(RunConfig, DataFiles) of `scripts/pretrain.py`."""
    from ..training.run_config import plan_pretraining

    given = given_settings(args)
    files = _files(args, corpus=args.pretrain_corpus_path, train=args.mixed_training_corpus_path)
    if args.output_dir is None:
        args.output_dir = f"outputs/pretrain-{given.get('model.attention_type', args.recipe)}"
    return checked_plan(plan_pretraining(args.recipe, given, files, args.output_dir), given), files


def finetuning_plan(args):
    """(RunConfig, DataFiles) of `scripts/finetune.py`."""
    from ..training.run_config import plan_finetuning
    from ..utils.checkpoints import check_model_folder, looks_like_hub_id

    given = given_settings(args)
    _refuse_model_flags_for_a_checkpoint(args, given)
    files = _files(args, corpus=args.pretrain_corpus_path, train=args.finetune_corpus_path)
    if files.train is None:  # a pretrained checkpoint and no questions given: the synthetic ones
        from data_loaders.corpus import DataFiles

        files = files.replaced(train=DataFiles.synthetic(args.num_people).train)
    if args.output_dir is None:
        kind = "pretrained" if args.model_name_or_path else f"scratch-{given.get('model.attention_type', args.recipe)}"
        args.output_dir = f"outputs/finetune-{kind}"
    if args.model_name_or_path and not looks_like_hub_id(args.model_name_or_path):
        check_model_folder(args.model_name_or_path)  # before its card is read for the corpus size
    config = plan_finetuning(
        args.recipe, given, files, args.output_dir, args.model_name_or_path, getattr(args, "finetune_recipe", None)
    )
    return checked_plan(config, given), files


def recipe_plan(args):
    """(RunConfig, DataFiles) of `scripts/train.py`: the whole recipe."""
    from data_loaders.corpus import read_birthplaces

    from ..training.run_config import plan_recipe

    given = given_settings(args)
    files = _files(
        args,
        corpus=args.pretrain_corpus_path,
        train=args.train_corpus_path,
        dev=args.eval_corpus_path,
        test=args.test_corpus_path,
    )
    for questions in (files.dev, files.test):  # read now: evaluation runs on the first process only, at the end
        if questions is not None:
            read_birthplaces(questions)
    if args.output_dir is None:
        attention_type = given.get("model.attention_type", RECIPES[args.recipe].attention_type)
        args.output_dir = f"outputs/{args.recipe}-{attention_type}"
    config = plan_recipe(
        args.recipe,
        given,
        files,
        args.output_dir,
        pretraining=args.do_pretrain,
        finetuning=args.do_finetune,
        finetune_recipe=args.finetune_recipe,
    )
    return checked_plan(config, given), files


def is_main_process() -> bool:
    """Before accelerate starts: the launcher's first process (or a plain run)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def print_run_config(config):
    if is_main_process():
        print(config.describe(), flush=True)


def hub_options(args) -> dict:
    return {"push_to_hub": args.push_to_hub, "hub_model_id": args.hub_model_id, "hub_token": args.hub_token}


def synthetic_size(args) -> dict:
    return {"num_people": args.num_people} if args.num_people else {}


def add_finetune_recipe_argument(parser):
    parser.add_argument(
        "--finetune_recipe",
        choices=sorted(RECIPES),
        default=None,
        help="take the finetuning stage from this recipe (the knowledge recipe has none after pretraining)",
    )


def add_debug_argument(parser):
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of input errors too (also KNOWGPT_DEBUG=1)"
    )


# How long a process other than the first waits before it exits on a user error. torchrun ends the others as soon
# as one process fails, so one that exited first could cut the first off before it reported the error (seen on
# two CPU processes under load). The launcher ends the wait once the first process has exited.
REPORTING_WAIT_SECONDS = 30


def main_guard(main):
    """Run a script's `main`: an error in what the user gave (`errors.UserError`) becomes one line on stderr,
    `error: <where>: <what is wrong> (<what to do>)`, printed by the first process only, and exit status 2;
    `--debug` or KNOWGPT_DEBUG=1 shows its traceback instead. Any other exception keeps its traceback."""
    from ..utils.errors import UserError

    debug = "--debug" in sys.argv[1:] or os.environ.get("KNOWGPT_DEBUG", "") not in ("", "0")
    try:
        return main()
    except Exception as error:
        if debug or not isinstance(error, UserError):
            raise
        if is_main_process():
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:  # the launcher stops every process once one has failed: the first must get to print its line
            time.sleep(REPORTING_WAIT_SECONDS)
        raise SystemExit(2) from None


# Whether `run_script` holds the cyclic garbage collector until the command's libraries are loaded.
_collection_held = False


def libraries_loaded() -> None:
    """Called by every command once it has imported what it runs: in a script's process (`run_script`) the
    garbage collector, held while the libraries loaded, resumes, and leaves what exists now (torch's,
    transformers' modules and the like, which live until the process ends) out of every later collection
    (`gc.freeze`). Each full collection while importing walked everything imported so far again (0.6 s of a
    `scripts/train.py` run's imports on a 2-core CPU), and each between a recipe's stages walked it once more
    (0.17 s each; on an H200 a 20-epoch run took 10.0 s against 12.1 s, benchmarks/RESULTS.md). Elsewhere (a
    notebook, a test calling `main`) nothing changes."""
    global _collection_held
    if _collection_held:
        _collection_held = False
        gc.freeze()
        gc.enable()


def run_script(main):
    """`main_guard(main)` for a script run as a process, which then ends at once: what a normal exit would do
    for others (atexit handlers: loggers, trackers, compile workers; unfinished non-daemon threads) is done,
    and the interpreter's teardown of torch's modules and thread pools, which nothing after the command
    needs, is skipped (1 s of a 5.5 s `evaluate_checkpoint.py` on a 2-core CPU, benchmarks/RESULTS.md). The
    garbage collector is held until the command's libraries are loaded (`libraries_loaded`)."""
    import atexit
    import threading

    global _collection_held
    if gc.isenabled():
        gc.disable()
        _collection_held = True
    try:
        returned = main_guard(main)
        code = returned if isinstance(returned, int) else 0  # the console script's dispatcher returns a status
    except SystemExit as stop:  # an argparse or user error, an interrupted run: its status, its message
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    from ..utils import timeline

    timeline.write_if_asked()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_training(function, *args, resume_hint: str = "--resume_from_checkpoint latest", **kwargs):
    """Run a training workflow; a run stopped by SIGINT/SIGTERM (checkpoint saved) exits with 128 + signal,
    saying how to resume."""
    from ..training.workflows import TrainingInterrupted

    libraries_loaded()
    try:
        return function(*args, **kwargs)
    except TrainingInterrupted as stopped:
        if is_main_process():
            print(f"{stopped}: resume with the same command and {resume_hint}", flush=True)
        raise SystemExit(128 + stopped.signal_number) from None
    finally:  # several processes (accelerate launch): leave the process group as torch asks, not at exit
        torch = sys.modules.get("torch")
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
