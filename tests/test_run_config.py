"""One resolution of a run's settings: every script's documented command resolves to the recipe's values, and
each flag given changes its own field and nothing else (`hf_knowgpt.training.run_config`, `hf_knowgpt.commands.cli`).

The expected values are written from the recipe presets and the dataclass defaults, not from the resolver."""

import shlex
import sys
from dataclasses import asdict, replace

import pytest
from conftest import DATA_DIR, HAS_DATA, REPO_ROOT, write_cs224n_named_synthetic

from hf_knowgpt.commands import finetune as FINETUNE
from hf_knowgpt.commands import pretrain as PRETRAIN
from hf_knowgpt.commands import run as RUN
from hf_knowgpt.commands import train as TRAIN
from hf_knowgpt.configuration_knowgpt import KnowGPTConfig
from hf_knowgpt.training.arguments import TrainingArguments
from hf_knowgpt.training.recipes import RECIPES
from hf_knowgpt.training.run_config import DATA_FIELDS, MODEL_FIELDS, STAGES, resolve_run_config

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import reproduce  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = write_cs224n_named_synthetic(tmp_path_factory.mktemp("cs224n"), num_people=40)
    documents = len((directory / "wiki.txt").read_text(encoding="utf-8").strip("\n").split("\n"))
    return {
        "dir": directory,
        "corpus": directory / "wiki.txt",
        "train": directory / "birth_places_train.tsv",
        "dev": directory / "birth_dev.tsv",
        "test": directory / "birth_test_inputs.tsv",
        "documents": documents,
    }


@pytest.fixture(scope="module", autouse=True)
def checkpoint(tmp_path_factory):
    """A saved model to finetune from (only its folder is read when a run is resolved)."""
    from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM

    folder = tmp_path_factory.mktemp("checkpoint") / "pretrained"
    KnowGPTForCausalLM(KnowGPTConfig(vocab_size=30, n_layer=1, n_head=2, n_embd=8, block_size=16)).save_pretrained(
        folder
    )
    CHECKPOINT["folder"] = folder
    return folder


def resolve(script, argv):
    args = script.parse_args([str(a) for a in argv])
    config, _ = script.run_config(args)
    return config


def flatten(config) -> dict:
    flat = {f"model.{name}": value for name, value in config.model.items()}
    flat.update({f"data.{name}": getattr(config, name) for name in DATA_FIELDS})
    flat["finetune_from"] = config.finetune_from
    for stage in STAGES:
        args = getattr(config, stage)
        if args is not None:
            flat.update({f"{stage}.{name}": value for name, value in asdict(args).items()})
    return flat


def expected_model(recipe) -> dict:
    defaults = {name: getattr(KnowGPTConfig, name) for name in MODEL_FIELDS}
    return {**defaults, "attention_type": recipe.attention_type, **recipe.model}


def expected_stage(stage, documents, block_size, output_dir) -> dict:
    final_tokens = None if stage.final_tokens_epochs is None else stage.final_tokens_epochs * documents * block_size
    arguments = TrainingArguments(
        output_dir=str(output_dir),
        max_epochs=stage.max_epochs,
        batch_size=stage.batch_size,
        learning_rate=stage.learning_rate,
        final_tokens=final_tokens,
        **stage.extra,
    )
    return asdict(arguments)


def pretrain_argv(recipe, data, output_dir):
    return ["--recipe", recipe, "--pretrain_corpus_path", data["corpus"],
            "--mixed_training_corpus_path", data["train"], "--output_dir", output_dir]  # fmt: skip


CHECKPOINT = {}


def finetune_argv(recipe, data, output_dir, from_checkpoint=True):
    checkpoint = ["--model_name_or_path", CHECKPOINT["folder"]] if from_checkpoint else []
    return ["--recipe", recipe, *checkpoint, "--finetune_corpus_path", data["train"],
            "--pretrain_corpus_path", data["corpus"], "--output_dir", output_dir]  # fmt: skip


def train_argv(recipe, data, output_dir):
    return ["--recipe", recipe, "--data_dir", data["dir"], "--output_dir", output_dir]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_documented_commands_resolve_to_the_recipe(name, data, tmp_path):
    recipe = RECIPES[name]
    block, documents = recipe.model["block_size"], data["documents"]
    # the knowledge recipe's whole documents: ⌊7B/8⌋ at most
    truncation = min(recipe.min_truncation_length, 7 * block // 8)

    config = resolve(PRETRAIN, pretrain_argv(name, data, tmp_path / "p"))
    assert config.model == expected_model(recipe)
    assert asdict(config.pretrain) == expected_stage(recipe.pretrain, documents, block, tmp_path / "p")
    assert (config.min_truncation_length, config.mixed_training) == (truncation, recipe.mixed_training)
    assert (config.document_repeats, config.question_repeats) == (recipe.document_repeats, recipe.question_repeats)
    assert config.finetune is None and config.given == {}

    scratch = resolve(FINETUNE, finetune_argv(name, data, tmp_path / "s", from_checkpoint=False))
    assert scratch.model == expected_model(recipe) and scratch.finetune_from == "scratch"
    assert asdict(scratch.finetune) == expected_stage(recipe.finetune_scratch, documents, block, tmp_path / "s")

    whole = resolve(TRAIN, train_argv(name, data, tmp_path / "run"))
    assert whole.model == expected_model(recipe)
    assert asdict(whole.pretrain) == expected_stage(recipe.pretrain, documents, block, tmp_path / "run" / "pretrained")
    if recipe.finetune_pretrained is None:
        assert whole.finetune is None
        with pytest.raises(ValueError, match=f"recipe '{name}' has no finetuning stage"):
            resolve(FINETUNE, finetune_argv(name, data, tmp_path / "f"))
    else:
        finetuned = resolve(FINETUNE, finetune_argv(name, data, tmp_path / "f"))
        assert finetuned.finetune_from == "pretrained"
        assert asdict(finetuned.finetune) == expected_stage(
            recipe.finetune_pretrained, documents, block, tmp_path / "f"
        )
        expected = expected_stage(recipe.finetune_pretrained, documents, block, tmp_path / "run" / "finetuned")
        assert asdict(whole.finetune) == expected


def test_the_knowledge_recipe_keeps_its_shuffling_when_no_flag_is_given(data, tmp_path):
    """The defect behind 30% against 68%: a store-true flag's default (shuffle=False) overrode the recipe."""
    assert RECIPES["knowledge"].pretrain.extra == {"shuffle": True}
    assert resolve(TRAIN, train_argv("knowledge", data, tmp_path)).pretrain.shuffle is True
    assert resolve(PRETRAIN, pretrain_argv("knowledge", data, tmp_path)).pretrain.shuffle is True
    assert (
        resolve(TRAIN, [*train_argv("knowledge", data, tmp_path), "--no_pretrain_shuffle"]).pretrain.shuffle is False
    )


# (recipe, flags, {field: value}) for the one-stage scripts; `S` stands for the script's stage
SINGLE_STAGE_FLAGS = [
    ("handout", ["--attention_type", "rope"], {"model.attention_type": "rope"}),
    ("handout", ["--n_layer", "3"], {"model.n_layer": 3}),
    ("handout", ["--n_head", "4"], {"model.n_head": 4}),
    ("handout", ["--n_embd", "128"], {"model.n_embd": 128}),
    ("handout", ["--bottleneck_dim", "16"], {"model.bottleneck_dim": 16}),
    ("handout", ["--rope_theta", "500"], {"model.rope_theta": 500.0}),
    ("handout", ["--embd_pdrop", "0"], {"model.embd_pdrop": 0.0}),
    ("handout", ["--resid_pdrop", "0.2"], {"model.resid_pdrop": 0.2}),
    ("handout", ["--attn_pdrop", "0"], {"model.attn_pdrop": 0.0}),
    ("handout", ["--attention_kernel_dtype", "bfloat16"], {"model.attention_kernel_dtype": "bfloat16"}),
    ("handout", ["--no_residual_in_fp32"], {"model.residual_in_fp32": False}),
    ("handout", ["--recitation_length", "20"], {"model.recitation_length": 20}),
    ("handout", ["--max_epochs", "3"], {"S.max_epochs": 3}),
    ("handout", ["--num_train_epochs", "3"], {"S.max_epochs": 3}),
    ("handout", ["--batch_size", "32"], {"S.batch_size": 32}),
    ("handout", ["--learning_rate", "1e-3"], {"S.learning_rate": 1e-3}),
    ("handout", ["--final_tokens", "1000"], {"S.final_tokens": 1000}),
    ("handout", ["--shuffle"], {"S.shuffle": True}),
    ("knowledge", ["--no_shuffle"], {"S.shuffle": False}),
    ("handout", ["--seed", "3"], {"S.seed": 3}),
    ("handout", ["--weight_decay", "0"], {"S.weight_decay": 0.0}),
    ("handout", ["--max_grad_norm", "0.5"], {"S.grad_norm_clip": 0.5}),
    ("handout", ["--grad_norm_clip", "0.5"], {"S.grad_norm_clip": 0.5}),
    ("handout", ["--warmup_tokens", "0"], {"S.warmup_tokens": 0}),
    ("handout", ["--no_packing"], {"S.packed": False}),
    ("handout", ["--length_groups", "2"], {"S.length_groups": 2}),
    ("handout", ["--training_path", "plain"], {"S.training_path": "plain"}),
    ("handout", ["--torch_compile"], {"S.compile": True}),
    ("handout", ["--torch_compile", "auto"], {"S.compile": "auto"}),
    ("handout", ["--torch_compile", "--tune_kernels"], {"S.compile": True, "S.tune_kernels": True}),
    ("handout", ["--mixed_precision", "bf16"], {"S.mixed_precision": "bf16"}),
    ("handout", ["--per_device_train_batch_size", "32"], {"S.per_device_train_batch_size": 32}),
    ("handout", ["--with_tracking"], {"S.report_to": "tensorboard"}),
    ("handout", ["--report_to", "all"], {"S.report_to": "tensorboard"}),
    ("handout", ["--no_fused_attention"], {"S.fused_attention": False}),
    ("handout", ["--gradient_reduce_dtype", "bf16"], {"S.gradient_reduce_dtype": "bf16"}),
    ("handout", ["--logging_steps", "7"], {"S.log_every": 7}),
    ("handout", ["--log_every", "7"], {"S.log_every": 7}),
    ("handout", ["--report_to", "tensorboard"], {"S.report_to": "tensorboard"}),
    ("handout", ["--checkpointing_steps", "epoch"], {"S.checkpointing_steps": "epoch"}),
    ("handout", ["--save_total_limit", "5"], {"S.save_total_limit": 5}),
    ("handout", ["--resume_from_checkpoint", "latest"], {"S.resume_from_checkpoint": "latest"}),
    ("handout", ["--overwrite_output_dir"], {"S.overwrite_output_dir": True}),
]
PRETRAIN_ONLY_FLAGS = [
    ("handout", ["--min_truncation_length", "8"], {"data.min_truncation_length": 8}),
    ("handout", ["--mixed_training"], {"data.mixed_training": True}),
    ("knowledge", ["--no_mixed_training"], {"data.mixed_training": False}),
    ("handout", ["--document_repeats", "3"], {"data.document_repeats": 3}),
    ("knowledge", ["--question_repeats", "2"], {"data.question_repeats": 2}),
    ("knowledge", ["--document_variants", "4"], {"data.document_variants": 4}),
    ("knowledge", ["--plain_text_fraction", "0.25"], {"data.plain_text_fraction": 0.25}),
    ("knowledge", ["--question_variants", "3"], {"data.question_variants": 3}),
    ("knowledge", ["--max_truncation_length", "140"], {"data.max_truncation_length": 140}),
]


def assert_changes_exactly(base, changed, expected):
    before, after = flatten(base), flatten(changed)
    differing = {key: after[key] for key in after if after[key] != before.get(key)}
    assert differing == expected


@pytest.mark.parametrize("recipe, flags, expected", SINGLE_STAGE_FLAGS + PRETRAIN_ONLY_FLAGS)
def test_each_pretraining_flag_changes_its_field_only(recipe, flags, expected, data, tmp_path):
    expected = {key.replace("S.", "pretrain."): value for key, value in expected.items()}
    base = pretrain_argv(recipe, data, tmp_path)
    assert_changes_exactly(resolve(PRETRAIN, base), resolve(PRETRAIN, base + flags), expected)


@pytest.mark.parametrize("recipe, flags, expected", [(r, f, e) for r, f, e in SINGLE_STAGE_FLAGS if r == "handout"])
def test_each_finetuning_flag_changes_its_field_only(recipe, flags, expected, data, tmp_path):
    expected = {key.replace("S.", "finetune."): value for key, value in expected.items()}
    base = finetune_argv(recipe, data, tmp_path, from_checkpoint=False)
    assert_changes_exactly(resolve(FINETUNE, base), resolve(FINETUNE, base + flags), expected)


def test_model_flags_are_refused_for_a_pretrained_checkpoint(data, tmp_path):
    with pytest.raises(ValueError, match="--n_embd: the model of --model_name_or_path"):
        resolve(FINETUNE, finetune_argv("handout", data, tmp_path) + ["--n_embd", "64"])


STAGE_FLAGS = [  # train.py: the fields that differ between the stages take the stage's prefix
    (["--pretrain_max_epochs", "3"], {"pretrain.max_epochs": 3}),
    (["--finetune_max_epochs", "3"], {"finetune.max_epochs": 3}),
    (["--pretrain_batch_size", "32"], {"pretrain.batch_size": 32}),
    (["--finetune_batch_size", "32"], {"finetune.batch_size": 32}),
    (["--pretrain_per_device_train_batch_size", "32"], {"pretrain.per_device_train_batch_size": 32}),
    (["--pretrain_learning_rate", "1e-3"], {"pretrain.learning_rate": 1e-3}),
    (["--pretrain_lr", "1e-3"], {"pretrain.learning_rate": 1e-3}),
    (["--finetune_learning_rate", "1e-3"], {"finetune.learning_rate": 1e-3}),
    (["--finetune_lr", "1e-3"], {"finetune.learning_rate": 1e-3}),
    (["--pretrain_final_tokens", "1000"], {"pretrain.final_tokens": 1000}),
    (["--finetune_final_tokens", "1000"], {"finetune.final_tokens": 1000}),
    (["--pretrain_shuffle"], {"pretrain.shuffle": True}),
    (["--finetune_shuffle"], {"finetune.shuffle": True}),
]
STAGE_FIELD_NAMES = (
    "max_epochs",
    "batch_size",
    "per_device_train_batch_size",
    "learning_rate",
    "final_tokens",
    "shuffle",
)


def train_flag_cases():
    cases = [("handout", flags, expected) for flags, expected in STAGE_FLAGS]
    cases.append(("knowledge", ["--no_pretrain_shuffle"], {"pretrain.shuffle": False}))
    # finetuning's 80 steps would not repay a compilation: train.py compiles the pretraining stage
    cases.append(("handout", ["--torch_compile"], {"pretrain.compile": True}))
    cases.append(("handout", ["--torch_compile", "auto"], {"pretrain.compile": "auto"}))
    cases.append(
        ("handout", ["--torch_compile", "--tune_kernels"], {"pretrain.compile": True, "pretrain.tune_kernels": True})
    )
    for recipe, flags, expected in SINGLE_STAGE_FLAGS + PRETRAIN_ONLY_FLAGS:
        if "S.tune_kernels" in expected:  # tuning goes with compiling: pretraining's, as above
            continue
        ((field, value),) = expected.items()
        if not field.startswith("S."):
            cases.append((recipe, flags, expected))
        elif field[2:] not in (*STAGE_FIELD_NAMES, "compile") and recipe == "handout":  # every stage's field
            cases.append((recipe, flags, {f"{stage}.{field[2:]}": value for stage in STAGES}))
    return cases


@pytest.mark.parametrize("recipe, flags, expected", train_flag_cases())
def test_each_flag_of_the_one_command_changes_its_field_only(recipe, flags, expected, data, tmp_path):
    base = train_argv(recipe, data, tmp_path)
    assert_changes_exactly(resolve(TRAIN, base), resolve(TRAIN, base + flags), expected)


def test_block_size_also_rescales_the_handout_schedule(data, tmp_path):
    """final_tokens is counted in block_size positions per document, as the handouts count it."""
    base = train_argv("handout", data, tmp_path)
    documents = data["documents"]
    assert_changes_exactly(
        resolve(TRAIN, base),
        resolve(TRAIN, base + ["--block_size", "64"]),
        {
            "model.block_size": 64,
            "pretrain.final_tokens": 650 * documents * 64,
            "finetune.final_tokens": 200 * documents * 64,
        },
    )


def test_no_flag_default_reaches_the_settings(data, tmp_path):
    for script, argv in ((PRETRAIN, pretrain_argv("handout", data, tmp_path)),
                         (FINETUNE, finetune_argv("handout", data, tmp_path)),
                         (TRAIN, train_argv("handout", data, tmp_path))):  # fmt: skip
        args = script.parse_args([str(a) for a in argv])
        assert not any("." in name for name in vars(args)), vars(args)


def test_handout_run_py_resolves_to_the_handout_recipe(data, tmp_path):
    handout = RECIPES["handout"]
    documents, block = data["documents"], handout.model["block_size"]
    config = resolve(RUN, ["pretrain", "rope", data["corpus"], "--writing_params_path", tmp_path / "w"])
    assert config.model == {**expected_model(handout), "attention_type": "rope"}
    expected = expected_stage(handout.pretrain, documents, block, tmp_path / "w")
    assert asdict(config.pretrain) == expected  # an output folder holding a run is never replaced unasked
    lr = resolve(
        RUN, ["pretrain", "rope", data["corpus"], "--writing_params_path", tmp_path / "w", "--pretrain_lr", "1e-3"]
    )
    assert_changes_exactly(config, lr, {"pretrain.learning_rate": 1e-3})
    finetuned = resolve(RUN, ["finetune", "rope", data["corpus"], "--reading_params_path", tmp_path / "w",
                              "--writing_params_path", tmp_path / "f", "--finetune_corpus_path", data["train"]])  # fmt: skip
    expected = expected_stage(handout.finetune_pretrained, documents, block, tmp_path / "f")
    assert asdict(finetuned.finetune) == expected


def readme_command(marker: str, script: str = "scripts/train.py") -> list[str]:
    """The README's command line containing `marker`, as argv for `script` (what comes before it dropped)."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(line for line in text.split("\n") if marker in line)
    argv = shlex.split(line.split("#")[0])
    return argv[argv.index(script) + 1 :]


def test_reproduce_runs_the_readme_knowledge_command(data, tmp_path):
    argv = readme_command("scripts/train.py --recipe knowledge")
    # The README's --data_dir is ../shared/data: here, wherever the CS224N files are (KNOWGPT_DATA on the GPU
    # machine), or the synthetic stand-in with the same file names.
    argv[argv.index("--data_dir") + 1] = str(DATA_DIR if HAS_DATA else data["dir"])
    readme = resolve(TRAIN, argv)
    # the results table's knowledge row, as the README's reproduction command builds it
    reproduction = readme_command("benchmarks/reproduce.py", script="benchmarks/reproduce.py")
    reproduction[reproduction.index("--data_dir") + 1] = argv[argv.index("--data_dir") + 1]
    files, launch, launch_flags, extra_flags = reproduce.command_parts(reproduce.parse_args(reproduction))
    command = reproduce.train_command(
        "knowledge", 0, files, tmp_path / "reproduced", [*launch_flags, *extra_flags], launch
    )
    reproduced = resolve(TRAIN, command[command.index(str(REPO_ROOT / "scripts" / "train.py")) + 1 :])

    def settings(config):
        same_dirs = {stage: replace(getattr(config, stage), output_dir="-") for stage in config.stages}
        return replace(config, **same_dirs, given={}).to_dict()

    assert settings(readme) == settings(reproduced)
    assert readme.pretrain.shuffle and readme.mixed_training and readme.min_truncation_length == 112


@pytest.mark.parametrize("script", [PRETRAIN, TRAIN])
def test_transformers_flag_names_are_shown_and_the_old_ones_still_accepted(script, capsys):
    """transformers' example scripts' names in --help, one entry each; the handouts' names as aliases."""
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for name in ("--max_grad_norm", "--logging_steps", "--seed", "--output_dir", "--report_to", "--with_tracking"):
        assert name in help_text
    assert "--grad_norm_clip GRAD" not in help_text and "(also --grad_norm_clip)" in help_text
    assert "--log_every LOG" not in help_text and "(also --log_every)" in help_text
    if script is PRETRAIN:
        assert "--num_train_epochs NUM_TRAIN_EPOCHS" in help_text and "(also --max_epochs)" in help_text
        assert "--max_epochs MAX" not in help_text and "--per_device_train_batch_size" in help_text


def test_a_global_and_a_per_device_batch_together_are_refused(data, tmp_path):
    with pytest.raises(
        ValueError, match="pretrain.batch_size, pretrain.per_device_train_batch_size: contradictory settings"
    ):
        resolve(
            PRETRAIN,
            pretrain_argv("handout", data, tmp_path) + ["--batch_size", "64", "--per_device_train_batch_size", "32"],
        )


def test_resolution_refuses_unknown_settings():
    with pytest.raises(ValueError, match="pretrain.max_epoch: unknown setting"):
        resolve_run_config("handout", {"pretrain.max_epoch": 3})
    with pytest.raises(ValueError, match="model.width: unknown setting"):
        resolve_run_config("handout", {"model.width": 3})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--document_variants", "0"], "--document_variants: must be a positive integer"),
        (["--question_variants", "9"], "--question_variants: there are 8 phrasings"),
        (["--plain_text_fraction", "1.5"], "--plain_text_fraction: must lie between 0 and 1"),
        (["--min_truncation_length", "100", "--max_truncation_length", "64"], "100 exceeds max_truncation_length 64"),
        (["--max_truncation_length", "200"], "max_truncation_length must lie in 4..168"),
    ],
)
def test_augmentation_settings_out_of_range_are_refused(flags, message, data, tmp_path):
    with pytest.raises(ValueError, match=message):
        resolve(TRAIN, train_argv("knowledge", data, tmp_path) + flags)
