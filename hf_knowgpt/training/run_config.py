"""One resolution of a run's settings: the recipe's values, then the values the user gave, and nothing else.

Every script (pretrain, finetune, train, the handouts' run.py) and every benchmark builds its runs here.
What the user gave arrives as a dict of qualified names, only for flags actually given (the scripts'
argparse defaults are `SUPPRESS`):

- `model.<field>`: a `KnowGPTConfig` field (`model.attention_type`, `model.n_embd`, ...);
- `data.<field>`: `data.min_truncation_length`, `data.max_truncation_length`, `data.mixed_training`,
  `data.document_repeats`, `data.question_repeats`, `data.document_variants`, `data.plain_text_fraction`,
  `data.question_variants`;
- `pretrain.<field>` / `finetune.<field>`: a `TrainingArguments` field of that stage only;
- `run.<field>`: a `TrainingArguments` field of every stage (seed, training path, logging, ...).

A value given for a stage wins over the same field given for the run. `resolve_run_config` is torch-free
apart from reading `KnowGPTConfig`'s defaults, so tests can resolve every documented command cheaply.
"""

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from data_loaders.augmentation import QUESTION_PHRASINGS
from data_loaders.corpus import DataFiles, read_corpus
from data_loaders.truncation import check_truncation_lengths, max_truncation_length

from ..utils.errors import InputError
from .arguments import TrainingArguments
from .recipes import Recipe, StageRecipe, get_recipe

MODEL_FIELDS = (
    "attention_type",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "bottleneck_dim",
    "rope_theta",
    "embd_pdrop",
    "resid_pdrop",
    "attn_pdrop",
    "attention_kernel_dtype",
    "residual_in_fp32",
    "recitation_length",
    "future_tokens",
    "future_token_spacing",
)
DATA_FIELDS = (
    "min_truncation_length",
    "max_truncation_length",
    "mixed_training",
    "document_repeats",
    "question_repeats",
    "document_variants",
    "plain_text_fraction",
    "question_variants",
)
TRAINING_FIELDS = tuple(f.name for f in fields(TrainingArguments) if f.name != "output_dir")
STAGES = ("pretrain", "finetune")
# How the configuration summary names each `compile` setting.
_COMPILED = {
    True: ", compiled",
    "auto": ", compiled if saved before (else compiled in the background for the next run)",
}
SECTIONS = ("model", "data", "run", *STAGES)


@dataclass
class RunConfig:
    """Everything a run uses, resolved: the model's configuration, the data options and the
    `TrainingArguments` of each stage that runs (None for a stage that does not)."""

    recipe: str
    model: dict
    min_truncation_length: int
    mixed_training: bool
    max_truncation_length: int | None = None  # None: ⌊7·block_size/8⌋
    document_repeats: int = 1  # each pretraining document this many times per epoch, corrupted afresh each time
    question_repeats: int = 1  # each mixed-in question–answer example this many times per epoch
    document_variants: int = 1  # versions of each document (phrases reordered), one drawn per exposure
    plain_text_fraction: float = 0.0  # share of document exposures read whole, with no masked span
    question_variants: int = 1  # phrasings of each mixed-in question, one drawn per exposure
    pretrain: TrainingArguments | None = None
    finetune: TrainingArguments | None = None
    finetune_from: str | None = None  # "pretrained" or "scratch" when there is a finetuning stage
    given: dict = field(default_factory=dict)  # what the user gave, qualified names

    @property
    def stages(self) -> list[str]:
        return [stage for stage in STAGES if getattr(self, stage) is not None]

    @property
    def longest_truncation(self) -> int:
        longest = self.max_truncation_length
        return max_truncation_length(self.model["block_size"]) if longest is None else longest

    def to_dict(self) -> dict:
        record = asdict(self)
        for stage in STAGES:  # tuples (betas) as lists: the JSON record reads back equal
            if record[stage] is not None:
                record[stage] = {k: list(v) if isinstance(v, tuple) else v for k, v in record[stage].items()}
        return record

    def describe(self) -> str:
        """The compact block every run prints once at its start."""
        model = self.model
        lines = [
            f"run configuration: recipe {self.recipe!r}"
            + (f"; given: {', '.join(f'{k}={v}' for k, v in self.given.items())}" if self.given else "; no overrides"),
            f"  model     {model['attention_type']}, {model['n_layer']} layers × {model['n_head']} heads × "
            f"{model['n_embd']}, block {model['block_size']}, dropout {model['embd_pdrop']}/{model['resid_pdrop']}/"
            f"{model['attn_pdrop']}"
            + (f", bottleneck {model['bottleneck_dim']}" if model["attention_type"] == "perceiver" else "")
            + (f", rope_theta {model['rope_theta']:g}" if model["attention_type"] == "rope" else "")
            + (
                f", answers after reciting up to {model['recitation_length']} characters"
                if model.get("recitation_length")
                else ""
            )
            + (
                f", {model['future_tokens']} head{'s' if model['future_tokens'] > 1 else ''} for tokens further "
                f"ahead (spacing {model.get('future_token_spacing', 1)})"
                if model.get("future_tokens")
                else ""
            ),
            f"  data      truncation {self.min_truncation_length}..{self.longest_truncation}, "
            f"mixed training {'on' if self.mixed_training else 'off'}"
            + (f", documents ×{self.document_repeats}" if self.document_repeats != 1 else "")
            + (f", {self.document_variants} document variants" if self.document_variants != 1 else "")
            + (f", {self.plain_text_fraction:g} plain text" if self.plain_text_fraction else "")
            + (f", questions ×{self.question_repeats}" if self.mixed_training and self.question_repeats != 1 else "")
            + (
                f", {self.question_variants} question phrasings"
                if self.mixed_training and self.question_variants != 1
                else ""
            ),
        ]
        for stage in self.stages:
            args = getattr(self, stage)
            origin = f" (from {self.finetune_from})" if stage == "finetune" else ""
            lines.append(
                f"  {stage:<9} {args.max_epochs} epoch{'s' * (args.max_epochs != 1)}{origin}, batch {args.batch_size}, lr {args.learning_rate:g}, "
                f"final_tokens {args.final_tokens if args.final_tokens is not None else 'the run’s end'}, "
                f"{'shuffled' if args.shuffle else 'file order'}, seed {args.seed}, path {args.training_path}"
                f"{_COMPILED.get(args.compile, '')}{', kernels tuned' * args.tune_kernels} → {args.output_dir}"
            )
        return "\n".join(lines)


def model_defaults() -> dict:
    """`KnowGPTConfig`'s own defaults for the fields a recipe may leave out."""
    from ..configuration_knowgpt import KnowGPTConfig

    return {name: getattr(KnowGPTConfig, name) for name in MODEL_FIELDS}


def check_given(given: dict):
    """Every qualified name must name a real field: a typo must not be dropped silently."""
    allowed = {
        "model": MODEL_FIELDS,
        "data": DATA_FIELDS,
        "run": TRAINING_FIELDS,
        "pretrain": TRAINING_FIELDS,
        "finetune": TRAINING_FIELDS,
    }
    for stage in STAGES:
        both = [
            f"{section}.{name}" for section in ("run", stage) for name in ("batch_size", "per_device_train_batch_size")
        ]
        given_batches = [name for name in both if name in given]
        if any("per_device" in name for name in given_batches) and any(
            "per_device" not in name for name in given_batches
        ):
            raise InputError(
                ", ".join(given_batches),
                "contradictory settings",
                "give the global batch (batch_size) or the batch per process (per_device_train_batch_size), not both",
            )
    for name in given:
        section, _, field_name = name.partition(".")
        if section not in allowed or field_name not in allowed[section]:
            raise InputError(
                name,
                "unknown setting",
                "expected model.<field>, data.<field>, run.<field>, pretrain.<field> or finetune.<field>, fields "
                f"being those of KnowGPTConfig ({', '.join(MODEL_FIELDS)}), the data options "
                f"({', '.join(DATA_FIELDS)}) and TrainingArguments",
            )


def qualify(values: dict, stage: str) -> dict:
    """Plain field names (as the library's `pretrain(..., n_embd=512, max_epochs=3)` takes them) qualified
    for one stage: model and data fields by their section, every other field for that stage."""
    qualified = {}
    for name, value in values.items():
        if "." in name:
            qualified[name] = value
        elif name in MODEL_FIELDS:
            qualified[f"model.{name}"] = value
        elif name in DATA_FIELDS:
            qualified[f"data.{name}"] = value
        else:
            qualified[f"{stage}.{name}"] = value
    check_given(qualified)
    return qualified


def stage_arguments(
    stage: StageRecipe, stage_name: str, given: dict, output_dir, corpus_documents: int | None, block_size: int
) -> TrainingArguments:
    """A stage's `TrainingArguments`: the recipe stage's epochs, batch and learning rate, final_tokens counted
    on the pretraining corpus as the handouts count it, then the run's and the stage's given values."""
    final_tokens = None  # None: the run's own end (the trainer counts it)
    if stage.final_tokens_epochs is not None and corpus_documents is not None:
        final_tokens = stage.final_tokens_epochs * corpus_documents * block_size
    values = dict(
        max_epochs=stage.max_epochs,
        batch_size=stage.batch_size,
        learning_rate=stage.learning_rate,
        final_tokens=final_tokens,
        **stage.extra,
    )
    for section in ("run", stage_name):  # the stage's own value wins over the run's
        values.update({name.split(".", 1)[1]: value for name, value in given.items() if name.split(".")[0] == section})
    if (
        stage.final_tokens_epochs is not None
        and corpus_documents is None
        and f"{stage_name}.final_tokens" not in given
    ):
        raise InputError(
            f"the {stage_name} stage",
            f"its schedule needs the pretraining corpus size (final_tokens = {stage.final_tokens_epochs} · "
            "documents · block_size)",
            "pass the pretraining corpus (--pretrain_corpus_path)",
        )
    return TrainingArguments(output_dir=str(output_dir), **values)


def finetuning_stage(recipe: Recipe, finetune_from: str, finetune_recipe=None) -> StageRecipe:
    """The recipe stage a finetuning run follows: after pretraining ("pretrained") or from "scratch"."""
    source = get_recipe(finetune_recipe) if isinstance(finetune_recipe, str) else (finetune_recipe or recipe)
    if finetune_from not in ("pretrained", "scratch"):
        raise ValueError(f"finetune_from must be 'pretrained' or 'scratch', got {finetune_from!r}")
    stage = source.finetune_pretrained if finetune_from == "pretrained" else source.finetune_scratch
    if stage is None:
        raise InputError(
            f"--recipe {source.name}",
            f"recipe {source.name!r} has no finetuning stage after pretraining: its pretrained model answers "
            "the questions as it is",
            "to finetune anyway, take the stage of another recipe: --finetune_recipe handout",
        )
    return stage


def resolve_run_config(
    recipe: str | Recipe,
    given: dict | None = None,
    *,
    stages=("pretrain",),
    output_dirs: dict | None = None,
    corpus_documents: int | None = None,
    finetune_from: str = "pretrained",
    finetune_recipe: str | Recipe | None = None,
) -> RunConfig:
    """The run's settings: `recipe`'s values, then `given` (qualified names; only what the user gave).

    `stages` are the stages that run; `finetune_from` is "pretrained" (after pretraining, or from a
    pretrained checkpoint: the recipe's `finetune_pretrained` stage) or "scratch" (`finetune_scratch`);
    `finetune_recipe` takes the finetuning stage from another recipe (the knowledge recipe has none);
    `corpus_documents` is the pretraining corpus size, which the handouts' schedules count in."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    given = dict(given or {})
    check_given(given)
    output_dirs = output_dirs or {}
    model = {**model_defaults(), "attention_type": recipe.attention_type, **recipe.model}
    model.update({name.split(".", 1)[1]: value for name, value in given.items() if name.startswith("model.")})
    block_size = model["block_size"]
    if "model.recitation_length" not in given and model.get("recitation_length", 0) >= block_size:
        raise InputError(
            "--block_size",
            f"block_size {block_size} cannot hold the {recipe.name} recipe's recitation "
            f"({model['recitation_length']} characters before each answer)",
            "give --recitation_length below it (0: answer at once) or a larger --block_size",
        )
    if "data.max_truncation_length" in given:
        longest = given["data.max_truncation_length"]
    elif recipe.max_truncation_length is not None:  # the recipe's, within what a smaller block_size can hold
        longest = min(recipe.max_truncation_length, max_truncation_length(block_size))
    else:
        longest = None
    if "data.min_truncation_length" in given:
        min_truncation_length = given["data.min_truncation_length"]
    else:  # the recipe's, within what a smaller block_size (or a lower longest truncation) can hold
        min_truncation_length = min(
            recipe.min_truncation_length, max_truncation_length(block_size) if longest is None else longest
        )
    try:
        check_truncation_lengths(min_truncation_length, longest, block_size)
    except ValueError as error:
        raise InputError("--min_truncation_length/--max_truncation_length", str(error)) from None
    config = RunConfig(
        recipe=recipe.name,
        model=model,
        min_truncation_length=min_truncation_length,
        max_truncation_length=longest,
        mixed_training=given.get("data.mixed_training", recipe.mixed_training),
        **{
            name: given.get(f"data.{name}", getattr(recipe, name))
            for name in (
                "document_repeats",
                "question_repeats",
                "document_variants",
                "plain_text_fraction",
                "question_variants",
            )
        },
        given=given,
    )
    for name in ("document_repeats", "question_repeats", "document_variants", "question_variants"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"--{name}", f"must be a positive integer, got {value!r}")
    if not 0.0 <= config.plain_text_fraction <= 1.0:
        raise InputError("--plain_text_fraction", f"must lie between 0 and 1, got {config.plain_text_fraction!r}")
    if config.question_variants > len(QUESTION_PHRASINGS):
        raise InputError(
            "--question_variants", f"there are {len(QUESTION_PHRASINGS)} phrasings, got {config.question_variants}"
        )
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {list(STAGES)}")
    if "pretrain" in stages:
        config.pretrain = stage_arguments(
            recipe.pretrain, "pretrain", given, output_dirs.get("pretrain", "pretrained"), corpus_documents, block_size
        )
    if "finetune" in stages:
        stage = finetuning_stage(recipe, finetune_from, finetune_recipe)
        config.finetune = stage_arguments(
            stage, "finetune", given, output_dirs.get("finetune", "finetuned"), corpus_documents, block_size
        )
        config.finetune_from = finetune_from
    return config


def count_documents(corpus_path) -> int:
    return len(read_corpus(corpus_path))


def _recorded_corpus_documents(model_name_or_path) -> int | None:
    """The pretraining corpus size a local checkpoint's card records (the handouts' finetuning schedule
    counts in it)."""
    from ..utils.model_card import read_card_facts

    return (read_card_facts(model_name_or_path) or {}).get("corpus_documents")


def _check_mixed_training(config: RunConfig, files: DataFiles):
    if config.pretrain is not None and config.mixed_training and files.train is None:
        raise InputError(
            f"--recipe {config.recipe}",
            "mixes question–answer examples into pretraining, and no training questions were given",
            "pass --mixed_training_corpus_path (or --data_dir), or --no_mixed_training",
        )


def plan_pretraining(recipe, given: dict, files: DataFiles, output_dir) -> RunConfig:
    """The settings of a pretraining run (`scripts/pretrain.py`)."""
    config = resolve_run_config(
        recipe,
        given,
        stages=("pretrain",),
        output_dirs={"pretrain": output_dir},
        corpus_documents=count_documents(files.corpus),
    )
    _check_mixed_training(config, files)
    return config


def plan_finetuning(
    recipe, given: dict, files: DataFiles, output_dir, model_name_or_path=None, finetune_recipe=None
) -> RunConfig:
    """The settings of a finetuning run (`scripts/finetune.py`): from `model_name_or_path`, or from scratch."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    finetuning_stage(recipe, "pretrained" if model_name_or_path else "scratch", finetune_recipe)  # one exists
    if files.corpus is not None:
        corpus_documents = count_documents(files.corpus)
    elif model_name_or_path is not None and Path(model_name_or_path).is_dir():
        corpus_documents = _recorded_corpus_documents(model_name_or_path)
    else:
        corpus_documents = None
    if corpus_documents is None and "finetune.final_tokens" not in given:
        raise InputError(
            model_name_or_path,
            "does not record its pretraining corpus size, which the handouts' schedule needs "
            "(final_tokens = 200 · documents · block_size)",
            "pass --pretrain_corpus_path",
        )
    return resolve_run_config(
        recipe,
        given,
        stages=("finetune",),
        output_dirs={"finetune": output_dir},
        corpus_documents=corpus_documents,
        finetune_from="pretrained" if model_name_or_path else "scratch",
        finetune_recipe=finetune_recipe,
    )


def plan_recipe(
    recipe, given: dict, files: DataFiles, output_dir, pretraining=True, finetuning=None, finetune_recipe=None
) -> RunConfig:
    """The settings of a whole recipe in one run (`scripts/train.py`): pretraining into
    `output_dir/pretrained` unless `pretraining` is False, then finetuning into `output_dir/finetuned`
    when the recipe has that stage (`finetuning` None) or when asked; without pretraining, finetuning
    starts from scratch."""
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if finetuning is None:
        source = get_recipe(finetune_recipe) if finetune_recipe else recipe
        finetuning = not pretraining or source.finetune_pretrained is not None
    stages = [stage for stage, runs in (("pretrain", pretraining), ("finetune", finetuning)) if runs]
    if not stages:
        raise InputError("--no_do_pretrain --no_do_finetune", "nothing to run", "keep at least one stage")
    output_dir = Path(output_dir)
    config = resolve_run_config(
        recipe,
        given,
        stages=stages,
        output_dirs={"pretrain": output_dir / "pretrained", "finetune": output_dir / "finetuned"},
        corpus_documents=count_documents(files.corpus),
        finetune_from="pretrained" if pretraining else "scratch",
        finetune_recipe=finetune_recipe,
    )
    _check_mixed_training(config, files)
    return config


__all__ = [
    "DATA_FIELDS",
    "MODEL_FIELDS",
    "RunConfig",
    "STAGES",
    "TRAINING_FIELDS",
    "check_given",
    "count_documents",
    "plan_finetuning",
    "plan_pretraining",
    "plan_recipe",
    "qualify",
    "resolve_run_config",
]
