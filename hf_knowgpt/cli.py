"""Command-line flags shared by the scripts; each one defaults to the selected --recipe (the handouts')."""

import argparse

from .configuration_knowgpt import ATTENTION_TYPES
from .recipes import RECIPES


def add_model_arguments(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("model (defaults: the recipe's)")
    group.add_argument(
        "--attention_type", choices=ATTENTION_TYPES, default=None, help="attention variant (default: the recipe's)"
    )
    group.add_argument("--n_layer", type=int, default=None, help="transformer blocks (handout: 4)")
    group.add_argument("--n_head", type=int, default=None, help="attention heads (handout: 8)")
    group.add_argument("--n_embd", type=int, default=None, help="width (handout: 256)")
    group.add_argument("--block_size", type=int, default=None, help="positions per example (handout: 128)")
    group.add_argument("--bottleneck_dim", type=int, default=None, help="perceiver latent positions (default 32)")
    group.add_argument("--rope_theta", type=float, default=None, help="RoPE base (default 10000)")
    for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
        group.add_argument(f"--{name}", type=float, default=None, help=f"dropout {name} (handout: 0.1)")


def model_overrides(args) -> dict:
    names = "n_layer n_head n_embd block_size bottleneck_dim rope_theta embd_pdrop resid_pdrop attn_pdrop".split()
    return {name: getattr(args, name) for name in names}


def add_training_arguments(parser: argparse.ArgumentParser):
    parser.add_argument(
        "--recipe", choices=sorted(RECIPES), default="handout", help="preset of sizes and hyperparameters"
    )
    parser.add_argument("--output_dir", default=None, help="where the checkpoint is saved")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, dropout and span corruption")
    group = parser.add_argument_group("training (defaults: the recipe's)")
    group.add_argument("--max_epochs", type=int, default=None, help="epochs")
    group.add_argument("--batch_size", type=int, default=None, help="global batch size (split across processes)")
    group.add_argument("--learning_rate", type=float, default=None, help="peak learning rate")
    group.add_argument("--weight_decay", type=float, default=None, help="AdamW weight decay on all but biases (0.1)")
    group.add_argument("--grad_norm_clip", type=float, default=None, help="gradient norm clipping (1.0)")
    group.add_argument("--warmup_tokens", type=int, default=None, help="linear warmup tokens (512·20)")
    group.add_argument("--final_tokens", type=int, default=None, help="tokens at which the cosine reaches 10%%")
    group.add_argument("--shuffle", action="store_true", help="shuffle examples each epoch (the handouts do not)")
    group.add_argument("--no_packing", action="store_true", help="compute padding positions too (slower, same loss)")
    group.add_argument(
        "--length_groups",
        type=int,
        default=None,
        help="eager path: run each batch as N length-sorted groups (default: up to 4 of ≥ 32 rows on CPU; 1 on GPU)",
    )
    group.add_argument(
        "--training_path",
        choices=["auto", "graphed", "eager", "plain"],
        default="auto",
        help="auto: CUDA graphs of whole steps on GPUs (one process or several), eager on CPU; plain: the handouts' DataLoader way",
    )
    group.add_argument("--torch_compile", action="store_true", help="compile the model inside the graphed step")
    group.add_argument("--log_every", type=int, default=50, help="steps between loss reports")
    group.add_argument("--report_to", choices=["tensorboard"], default=None, help="log scalars to TensorBoard")
    group.add_argument(
        "--checkpointing_steps", default=None, help="save a resumable checkpoint every N steps, 'epoch' or 'epochs:K'"
    )
    group.add_argument("--save_total_limit", type=int, default=2, help="checkpoints kept")
    group.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint folder, or 'latest' in output_dir")
    group.add_argument("--overwrite_output_dir", action="store_true", help="replace an output_dir holding another run")
    group.add_argument("--num_people", type=int, default=None, help="size of the synthetic corpus used without paths")
    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true", help="upload the final checkpoint")
    hub.add_argument("--hub_model_id", default=None, help="repository id (default: the output folder's name)")
    hub.add_argument("--hub_token", default=None, help="token (default: the logged-in one)")


def training_overrides(args) -> dict:
    names = "max_epochs batch_size learning_rate weight_decay grad_norm_clip warmup_tokens final_tokens".split()
    values = {name: getattr(args, name) for name in names}
    values.update(
        seed=args.seed,
        shuffle=args.shuffle,
        packed=not args.no_packing,
        length_groups=args.length_groups,
        training_path=args.training_path,
        compile=args.torch_compile,
        log_every=args.log_every,
        report_to=args.report_to,
        checkpointing_steps=args.checkpointing_steps,
        save_total_limit=args.save_total_limit,
        resume_from_checkpoint=args.resume_from_checkpoint,
        overwrite_output_dir=args.overwrite_output_dir,
    )
    return values


def synthetic_size(args) -> dict:
    return {"num_people": args.num_people} if args.num_people else {}


def workflow_arguments(args) -> dict:
    """The keyword arguments that `workflows.pretrain` and `workflows.finetune` both take from the flags."""
    return dict(
        recipe=args.recipe,
        model_overrides=model_overrides(args),
        training_overrides=training_overrides(args),
        push_to_hub=args.push_to_hub,
        hub_model_id=args.hub_model_id,
        hub_token=args.hub_token,
        **synthetic_size(args),
    )


def run_training(function, *args, **kwargs):
    """Run a training workflow; a run stopped by SIGINT/SIGTERM (checkpoint saved) exits with 128 + signal."""
    from .workflows import TrainingInterrupted

    try:
        return function(*args, **kwargs)
    except TrainingInterrupted as stopped:
        print(f"{stopped}: resume with --resume_from_checkpoint latest")
        raise SystemExit(128 + stopped.signal_number) from None
    finally:  # several processes (accelerate launch): leave the process group as torch asks, not at exit
        import torch.distributed

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
