"""CPU smoke tests of the speed benchmark's parts: the handouts' loop it compares with, and the timeline that
accounts for every second of a train.py process; and of the GPU test-suite runner."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import CPU_ONLY, REPO_ROOT, write_cs224n_named_synthetic
from cs224n_reference import GPT, Config

from hf_knowgpt.utils.timeline import phase_seconds

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
sys.path.insert(0, str(REPO_ROOT / "benchmarks" / "diagnostics"))
import bench_user_path  # noqa: E402
import compare_accuracy  # noqa: E402
import profile_step  # noqa: E402
import sampled_stacks  # noqa: E402
import step_variants  # noqa: E402
import tuned_gradients  # noqa: E402


def test_the_handouts_loop_trains_and_answers_as_one_process(tmp_path):
    data = write_cs224n_named_synthetic(tmp_path, num_people=40)
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "handout_loop.py"), "--data_dir", str(data),
               "--pretrain_epochs", "2", "--finetune_epochs", "1", "--questions", "3",
               "--output_dir", str(tmp_path / "loop")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().split("\n")[-1])
    assert len(measured["pretrain_epoch_s"]) == 2 and len(measured["finetune_epoch_s"]) == 1
    assert measured["questions"] == 3 and 0 <= measured["correct"] <= 3 and measured["question_s"] > 0
    assert list(measured["phases_s"]) == ["imports", "data and model", "pretraining", "finetuning", "evaluation"]
    assert all(seconds >= 0 for seconds in measured["phases_s"].values())
    # their torch.save of each stage's parameters, loadable into their model
    state = torch.load(tmp_path / "loop" / "finetuned.params")
    assert "blocks.0.attn.key.weight" in state and "pos_emb" in state


def test_the_reference_model_drops_out_only_in_training_and_starts_from_the_handouts_values():
    torch.manual_seed(0)
    model = GPT(Config(20, 16, n_layer=2, n_head=2, n_embd=16, pdrop=0.1)).handout_init()
    assert torch.count_nonzero(model.pos_emb) == 0 and torch.count_nonzero(model.blocks[0].attn.key.bias) == 0
    ids = torch.randint(0, 20, (2, 16))
    model.eval()
    assert torch.equal(model(ids), model(ids))
    model.train()
    assert not torch.equal(model(ids), model(ids))


def test_the_timeline_accounts_for_every_second_of_a_train_run_and_an_evaluation(tmp_path):
    data = write_cs224n_named_synthetic(tmp_path, num_people=40)
    output_dir = tmp_path / "run"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), "--recipe", "handout", "--data_dir", str(data),
               "--pretrain_max_epochs", "1", "--finetune_max_epochs", "1", "--n_layer", "1", "--n_head", "2",
               "--n_embd", "16", "--output_dir", str(output_dir)]  # fmt: skip
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    ended = time.time()
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((output_dir / "results.json").read_text())
    stamps = [stamp for _, stamp in summary["timeline"]]
    assert stamps == sorted(stamps) and started <= stamps[0] and stamps[-1] <= ended
    rows = bench_user_path.breakdown(started, ended, summary)
    labels = [label for label, _ in rows]
    for expected in ("libraries imported", "pretrain: steps", "pretrain: compilation and graph capture",
                     "pretrain: compiled step loaded", "pretrain: training loop set up (optimizer, accelerate, stepper)",
                     "finetune: steps", "dev questions answered and written", "exit"):  # fmt: skip
        assert expected in labels
    pretrain, phases = summary["stages"]["pretrain"], dict(rows)
    assert pretrain["setup_seconds"] > 0 and pretrain["setup_seconds"] >= pretrain["load_seconds"]
    # the steps are the loop's own time: train_seconds less the warm-up, give or take the marks' own instants
    assert abs(phases["pretrain: steps"] - (pretrain["train_seconds"] - pretrain["warmup_seconds"])) < 0.05
    assert abs(sum(seconds for _, seconds in rows) - (ended - started)) < 1e-6
    assert all(seconds >= 0 for _, seconds in rows)

    # scripts/evaluate_checkpoint.py on its checkpoint writes its marks where $KNOWGPT_TIMELINE_FILE says
    marks_file = tmp_path / "evaluate.timeline.json"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "evaluate_checkpoint.py"), "--model_name_or_path",
               str(output_dir / "finetuned"), "--eval_corpus_path", str(data / "birth_dev.tsv")]  # fmt: skip
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                            env={**os.environ, **CPU_ONLY, "KNOWGPT_TIMELINE_FILE": str(marks_file)})  # fmt: skip
    ended = time.time()
    assert result.returncode == 0, result.stderr[-3000:]
    marks = json.loads(marks_file.read_text())
    assert [label for label, _ in marks] == [
        "interpreter and command start-up",
        "flags read, libraries imported (torch, transformers)",
        "questions read, checkpoint loaded",
        "questions answered, predictions written",
    ]
    stamps = [stamp for _, stamp in marks]
    assert stamps == sorted(stamps) and started <= stamps[0] and stamps[-1] <= ended
    # without the variable, no file
    marks_file.unlink()
    assert subprocess.run(command, capture_output=True, cwd=REPO_ROOT, env={**os.environ, **CPU_ONLY}).returncode == 0
    assert not marks_file.exists()


def test_phases_run_from_the_launch_to_the_exit():
    assert phase_seconds(10.0, [("a", 11.0), ("b", 14.0)], 15.5) == [("a", 1.0), ("b", 3.0), ("exit", 1.5)]


def test_the_handout_loop_is_timed_over_at_least_two_epochs_of_each_stage(capsys):
    """Rates come from the epochs after the first (which holds the loader's and CUDA's warm-up): one epoch of a
    stage leaves no rate, and used to make the recipe's figure from the warm-up epoch."""
    for value in ("1,2,5", "2,1,5", "2,2,0", "2,2", "two"):
        with pytest.raises(SystemExit):
            bench_user_path.main(["--startup_only", "--handout_epochs", value])
        assert "--handout_epochs takes 'all' or P,F,Q" in capsys.readouterr().err


def test_the_user_path_on_several_gpus_runs_the_readmes_several_gpu_command(capsys):
    """`--processes N` times the README's `accelerate launch --multi_gpu` command (bf16 from the launcher, not
    train.py), every run of it; one process runs `python scripts/train.py ... --mixed_precision bf16`."""
    readme = (REPO_ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("accelerate launch --multi_gpu"))
    readme_launcher = line.split(" scripts/train.py")[0].split()
    recipe = ["--recipe", "handout", "--attention_type", "vanilla", "--data_dir", "data"]
    readme_options = readme_launcher[2:]  # after "accelerate launch" (or "python -m accelerate.commands.launch")
    for run, command in bench_user_path.train_commands(recipe, processes=2).items():
        launcher = command[: command.index(str(bench_user_path.SCRIPTS / "train.py"))]
        assert launcher[-len(readme_options) :] == readme_options, run
        assert "--mixed_precision" not in command[len(launcher) :], run
    one = bench_user_path.train_commands(recipe)["auto-cold"]
    assert one[0] == sys.executable and one[-4:] == ["--mixed_precision", "bf16", "--torch_compile", "auto"]
    with pytest.raises(SystemExit):
        bench_user_path.main(["--startup_only", "--processes", "0"])
    assert "--processes takes a count of GPUs" in capsys.readouterr().err


def test_step_variants_gives_each_run_its_own_seed():
    """`--seed N`, added to each run's train.py flags, reaches train.py: not read as the script's `--seeds`."""
    _, args, train_args = step_variants.parse_args(
        ["--run_one", "as-is", "--recipe", "handout", "--seed", "3", "--output_dir", "o"]
    )
    assert args.run_one == "as-is" and args.seeds == "0,1,2"
    assert train_args == ["--recipe", "handout", "--seed", "3", "--output_dir", "o"]


def test_step_variants_keeps_caches_where_told_and_apart_per_variant(tmp_path):
    """`--caches DIR` is the script's, not train.py's; each variant's three caches lie under DIR and apart from
    another variant's, so that a later call's runs find the tuned or compiled step of their own variant."""
    _, args, train_args = step_variants.parse_args(["--caches", str(tmp_path), "--", "--recipe", "handout"])
    assert args.caches == str(tmp_path) and train_args == ["--recipe", "handout"]
    as_is, splits1 = (step_variants.variant_caches(tmp_path, v) for v in ("as-is", "splits1"))
    assert set(as_is) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KNOWGPT_COMPILE_CACHE"}
    assert all(Path(folder).is_relative_to(tmp_path) for folder in [*as_is.values(), *splits1.values()])
    assert len({*as_is.values(), *splits1.values()}) == 6


def test_step_variants_writes_each_run_as_it_ends_and_starts_none_past_its_deadline(tmp_path, monkeypatch, capsys):
    """`--output` holds every finished run as soon as it ends (a machine lent for a fixed time may stop the
    script), and `--start_by` starts no run past its deadline, naming the runs it skipped."""
    written = []

    def fake_run(command, check, env):  # one run of train.py: its results.json, after a while
        output_dir = Path(command[command.index("--output_dir") + 1])
        output_dir.mkdir(parents=True)
        time.sleep(0.2)
        pretrain = {"train_seconds": 3.0, "warmup_seconds": 1.0, "captures": [], "final_loss": 0.5}
        summary = {"stages": {"pretrain": pretrain}, "timeline": [], "dev": {"accuracy": 0.25}}
        (output_dir / "results.json").write_text(json.dumps(summary))
        if output.is_file():
            written.append(len(json.loads(output.read_text())))

    output = tmp_path / "runs.json"
    monkeypatch.setattr(step_variants.subprocess, "run", fake_run)
    arguments = ["--variants", "as-is,splits1", "--seeds", "0,1", "--output", str(output), "--", "--recipe", "handout"]
    step_variants.main(arguments)
    assert written == [1, 2, 3] and len(json.loads(output.read_text())) == 4
    assert [path.name for path in tmp_path.iterdir()] == ["runs.json"]  # no staging file left beside it
    step_variants.main([*arguments[:6], "--start_by", "0.1", *arguments[6:]])
    runs = json.loads(output.read_text())
    assert [(run["variant"], run["seed"]) for run in runs] == [("as-is", 0)] and runs[0]["pretrain_steps_s"] == 2.0
    assert "not started: splits1 seed 0, as-is seed 1, splits1 seed 1" in capsys.readouterr().out


def test_step_variants_stops_where_the_installed_torch_lacks_a_variants_option(monkeypatch):
    """A variant whose inductor option this torch does not have would otherwise run as the code is (the
    graphed step leaves unknown options out) and be reported as if it had been measured."""
    monkeypatch.setitem(step_variants.VARIANTS, "from-the-future", {"inductor": {"an_option_of_a_later_torch": 1}})
    with pytest.raises(SystemExit, match="no option an_option_of_a_later_torch"):
        step_variants.run_one("from-the-future", ["--recipe", "quickstart"])
    # and the script refuses it before its first run, not after the runs planned before it
    monkeypatch.setattr(step_variants.subprocess, "run", lambda *args, **kwargs: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        step_variants.main(["--variants", "as-is,from-the-future", "--seeds", "0", "--", "--recipe", "quickstart"])


def test_step_variants_sets_the_attention_kernels_launch_settings_before_the_run(monkeypatch):
    """`attention-forward-1-warp` runs train.py with the fused kernel's forward programs on one warp and its
    backward's on two: set in the process before the command starts, as the kernel reads them at each launch."""
    from hf_knowgpt.commands import cli
    from hf_knowgpt.kernels import fused_attention

    for name in ("NUM_WARPS", "BACKWARD_NUM_WARPS", "DEFAULT_SPLITS"):
        monkeypatch.setattr(fused_attention, name, getattr(fused_attention, name))  # restored after the test
    seen = {}
    monkeypatch.setattr(
        cli,
        "run_script",
        lambda main: seen.update(
            argv=sys.argv, forward=fused_attention.NUM_WARPS, backward=fused_attention.BACKWARD_NUM_WARPS
        ),
    )
    monkeypatch.setattr(sys, "argv", sys.argv)
    splits = fused_attention.DEFAULT_SPLITS
    step_variants.run_one("attention-forward-1-warp", ["--recipe", "quickstart"])
    assert seen == {"argv": ["train.py", "--recipe", "quickstart"], "forward": {16: 1}, "backward": {16: 2}}
    step_variants.run_one("splits1", ["--recipe", "quickstart"])  # a variant sets only what it names
    assert fused_attention.DEFAULT_SPLITS == 1 != splits and seen["forward"] == {16: 1}
    step_variants.run_one("coordinate-descent-dynamic-launch", ["--recipe", "quickstart", "--torch_compile"])
    assert seen["argv"] == ["train.py", "--recipe", "quickstart", "--torch_compile", "--tune_kernels"]
    from hf_knowgpt.training.fast_path import GraphedStepper

    monkeypatch.setattr(GraphedStepper, "INDUCTOR_OPTIONS", GraphedStepper.INDUCTOR_OPTIONS)
    step_variants.run_one("dynamic-launch", ["--recipe", "quickstart", "--torch_compile"])  # half of --tune_kernels
    options = GraphedStepper.inductor_options(tune_kernels=False)
    assert options["use_static_cuda_launcher"] is False and "coordinate_descent_tuning" not in options
    assert seen["argv"] == ["train.py", "--recipe", "quickstart", "--torch_compile"]


def test_step_variants_module_settings_name_what_the_modules_have():
    """A variant sets module settings by name (setattr), so a misspelt one would be a new attribute that nothing
    reads, and the variant would be timed as the code is: every name must be one the module already has."""
    named = 0
    for variant, settings in step_variants.VARIANTS.items():
        for module_name, module in step_variants.setting_modules().items():
            for name in settings.get(module_name, {}):
                assert hasattr(module, name), (variant, module_name, name)
                named += 1
    assert named >= 3 and step_variants.VARIANTS["fused-layers-sums-at-end-1024-2"]["fused_layers"] == {
        "COLUMN_SUMS_AT_END": True, "TILE_ELEMENTS": 1024, "PROGRAMS_PER_SM": 2
    }  # fmt: skip


def test_step_variants_combine_with_a_plus():
    """`a+b` sets both variants' settings; parts that set one thing two ways, or a part that is no variant, are
    errors (a silent choice would time something else than the name says)."""
    both = step_variants.variant_settings("weight-gradients-together-splits2+stacked-attention-inputs")
    assert both["weight_gradients_together"] is True and both["grouped_products"] == {"SPLITS": 2}
    assert both["attention_knowgpt"] == {"STACKED_ATTENTION_INPUTS": True}
    assert step_variants.variant_settings("eager-batch+eager-clip")["uncompiled"] == (
        "compiled_device_batch", "compiled_clip_and_rate"
    )  # fmt: skip
    assert step_variants.variant_settings("as-is") == {}
    with pytest.raises(ValueError, match="set fused_attention DEFAULT_SPLITS differently"):
        step_variants.variant_settings("splits1+splits3")
    with pytest.raises(ValueError, match="unknown variant no-such"):
        step_variants.variant_settings("as-is+no-such")


def test_step_variants_can_leave_the_compiler_keys_to_the_loading(monkeypatch):
    """`compiler-keys-when-loaded`: no stage starts the thread that computes torch's and Triton's digests."""
    from hf_knowgpt.commands import cli
    from hf_knowgpt.training import workflows

    monkeypatch.setattr(workflows, "prefetch_compiler_keys", workflows.prefetch_compiler_keys)  # restored after
    monkeypatch.setattr(cli, "run_script", lambda main: None)
    monkeypatch.setattr(sys, "argv", sys.argv)
    started = []
    monkeypatch.setattr(workflows, "saved_steps", lambda: True)
    monkeypatch.setattr(workflows, "prefetch_compiler_keys", lambda: started.append(True))
    step_variants.run_one("as-is", ["--recipe", "quickstart"])
    workflows._prefetch_compiler_keys(types.SimpleNamespace(compile=True))
    assert started == [True]
    step_variants.run_one("compiler-keys-when-loaded", ["--recipe", "quickstart"])
    workflows._prefetch_compiler_keys(types.SimpleNamespace(compile=True))
    assert started == [True]


def test_profile_step_describes_a_generated_kernel_with_its_bytes_and_bandwidth():
    """From a module as inductor writes it: the kernel's source nodes, launch heuristics, the bytes inductor
    estimated (written under TORCHINDUCTOR_BENCHMARK_KERNEL=1) against the profiled time, and its call sites;
    nothing for a kernel the module does not define."""
    quote = "'" * 3
    module = f"""
# Topologically Sorted Source Nodes: [gelu], Original ATen: [aten.gelu]
triton_poi_fused_gelu_8 = async_compile.triton('triton_poi_fused_gelu_8', {quote}
@triton_heuristics.pointwise(
    size_hints={{'x': 8388608}},
    inductor_meta={{'grid_type': 'Grid1D', 'kernel_num_gb': 0.031457, 'kernel_name': 'triton_poi_fused_gelu_8'}},
)
def triton_poi_fused_gelu_8(in_ptr0, out_ptr0, xnumel, XBLOCK): pass
{quote}, device_str='cuda')
    triton_poi_fused_gelu_8.run(buf120, buf121, xnumel, stream=stream0)
"""
    lines = profile_step.describe_generated_kernel(module, "triton_poi_fused_gelu_8", 12.0)
    assert lines[0] == "# Topologically Sorted Source Nodes: [gelu], Original ATen: [aten.gelu]"
    assert "moves about 31.5 MB (inductor's estimate): 2621 GB/s at 12.0 µs" in lines
    assert "triton_poi_fused_gelu_8.run(buf120, buf121, xnumel, stream=stream0)" in lines
    assert profile_step.describe_generated_kernel(module, "triton_red_fused_sum_8", 12.0) == []
    no_estimate = module.replace("'kernel_num_gb': 0.031457, ", "")
    assert not any(
        "moves about" in line
        for line in profile_step.describe_generated_kernel(no_estimate, "triton_poi_fused_gelu_8", 12.0)
    )


def test_step_variants_reports_the_kernel_configurations_a_run_tuned(monkeypatch, tmp_path):
    """A run writes inductor's counters into its output directory when it ends (through the exit handlers that
    `run_script` runs), so that the table can say whether a warm run tuned its kernels again; a process that
    never compiled writes nothing and imports no dynamo."""
    import atexit

    from hf_knowgpt.commands import cli

    handlers = []
    monkeypatch.setattr(atexit, "register", lambda function, *args: handlers.append((function, args)))
    monkeypatch.setattr(cli, "run_script", lambda main: None)
    monkeypatch.setattr(sys, "argv", sys.argv)
    step_variants.run_one("as-is", ["--recipe", "quickstart", "--output_dir", str(tmp_path / "run")])
    [(function, args)] = handlers
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters["inductor"], "coordesc_tuning_bench", 7)
    function(*args)
    written = json.loads((tmp_path / "run" / step_variants.COUNTERS_FILE).read_text())
    assert written["coordesc_tuning_bench"] == 7

    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")
    step_variants.write_inductor_counters(tmp_path / "uncompiled")
    assert not (tmp_path / "uncompiled").exists()


def test_compare_accuracy_groups_runs_by_file_and_variant_and_measures_the_gap(tmp_path, capsys):
    """Groups read step_variants' JSON runs (one variant's where named, a file matched twice, by any spelling of
    its path, counted once); the gap is Welch's: the difference of means over the root of the summed squared
    standard errors."""

    def write(name, runs):
        (tmp_path / name).write_text(
            json.dumps([dict(variant=v, seed=0, dev_accuracy=a, final_loss=0.1) for v, a in runs])
        )

    write("pair_seed0.json", [("as-is", 0.88), ("splits1", 0.86)])
    write("pair_seed1.json", [("as-is", 0.90), ("splits1", 0.87)])
    write("alone.json", [("as-is", 0.89)])
    groups = compare_accuracy.main(
        ["--group", f"base={tmp_path}/pair_*.json:as-is,{tmp_path}/alone.json,{tmp_path}/../{tmp_path.name}/pair_seed0.json:as-is",
         "--group", f"other={tmp_path}/pair_*.json:splits1"]
    )  # fmt: skip
    base, other = groups["base"], groups["other"]
    assert base["accuracies"] == [88.0, 90.0, 89.0] and other["accuracies"] == [86.0, 87.0]
    assert base["mean"] == 89.0 and base["std"] == 1.0 and (other["low"], other["high"]) == (86.0, 87.0)
    expected = (86.5 - 89.0) / (1.0**2 / 3 + 0.5 / 2) ** 0.5  # other's variance: 0.5
    assert abs(compare_accuracy.standard_errors_apart(base, other) - expected) < 1e-12
    assert f"{expected:+.1f} se" in capsys.readouterr().out
    for bad in ("no-equals-sign", "=x.json", "name="):
        with pytest.raises(SystemExit):
            compare_accuracy.main(["--group", bad])
    with pytest.raises(SystemExit, match="no file matches"):
        compare_accuracy.main(["--group", f"none={tmp_path}/missing*.json"])


def test_the_one_level_loss_variant_sums_every_token_at_once(monkeypatch):
    """`loss-one-level` runs the whole command with the model's loss summed over all the tokens in one reduction
    (`LOSS_CHUNK` 0), to be timed beside the sum in two levels."""
    from hf_knowgpt import layers_knowgpt

    monkeypatch.setattr(layers_knowgpt, "LOSS_CHUNK", layers_knowgpt.LOSS_CHUNK)  # restored after the test
    monkeypatch.setattr("hf_knowgpt.commands.cli.run_script", lambda main: None)
    monkeypatch.setattr(sys, "argv", sys.argv)
    step_variants.run_one("as-is", ["--recipe", "quickstart"])
    assert layers_knowgpt.LOSS_CHUNK == 256
    step_variants.run_one("loss-one-level", ["--recipe", "quickstart"])
    assert layers_knowgpt.LOSS_CHUNK == 0
    logits, targets = torch.randn(512, 9), torch.randint(0, 9, (512,))
    with torch.no_grad():
        summed = layers_knowgpt.causal_lm_loss(logits, targets, 512)
    torch.testing.assert_close(summed, torch.nn.functional.cross_entropy(logits, targets))


def test_the_torch_adamw_variant_steps_with_the_clipping_and_torchs_fused_adamw(monkeypatch):
    """`torch-adamw` runs the whole command with the update the multi-tensor kernels replaced, to be timed
    beside them; `as-is` leaves the kernels on."""
    from hf_knowgpt.training.fast_path import GraphedStepper

    monkeypatch.setattr(GraphedStepper, "MULTI_TENSOR_UPDATE", GraphedStepper.MULTI_TENSOR_UPDATE)  # restored after
    monkeypatch.setattr("hf_knowgpt.commands.cli.run_script", lambda main: None)
    monkeypatch.setattr(sys, "argv", sys.argv)
    step_variants.run_one("as-is", ["--recipe", "quickstart"])
    assert GraphedStepper.MULTI_TENSOR_UPDATE is True
    step_variants.run_one("torch-adamw", ["--recipe", "quickstart"])
    assert GraphedStepper.MULTI_TENSOR_UPDATE is False


def test_tuned_gradients_measures_each_way_against_the_float64_step(tmp_path, capsys):
    """The diagnostic's comparison: float64 against itself is exact, bf16 autocast is off by about bf16's
    precision in every group, and a way it does not know is refused."""
    data = write_cs224n_named_synthetic(tmp_path)
    tiny = ["n_layer=1", "n_embd=16", "n_head=2"]
    rows = tuned_gradients.main(
        ["--data_dir", str(data), "--batches", "1", "--ways", "eager-bf16,float64", "--model", *tiny]
    )
    assert set(rows["float64"].values()) == {0.0}
    assert set(rows["eager-bf16"]) == {"loss", *tuned_gradients.GROUPS}
    assert all(1e-5 < rows["eager-bf16"][group] < 0.05 for group in tuned_gradients.GROUPS)
    assert capsys.readouterr().out.splitlines()[-1].startswith("float64")
    with pytest.raises(SystemExit):
        tuned_gradients.main(["--data_dir", str(data), "--ways", "float32"])

    from hf_knowgpt import KnowGPTForCausalLM

    config, _ = tuned_gradients.make_batches(
        data, 0, 0, torch.device("cpu"), {"n_layer": 1, "n_embd": 16, "n_head": 2}
    )
    config.attn_pdrop = 0.3  # the diagnostic turns a checkpoint's dropout off
    KnowGPTForCausalLM(config).save_pretrained(tmp_path / "trained")
    given = ["--data_dir", str(data), "--batches", "1", "--ways", "float64", "--checkpoint", str(tmp_path / "trained")]
    assert set(tuned_gradients.main([*given, "--model", *tiny])["float64"].values()) == {0.0}
    with pytest.raises(SystemExit):  # the batches of the recipe's width and block, not the checkpoint's
        tuned_gradients.main([*given, "--model", "n_layer=1", "n_embd=16", "n_head=2", "block_size=150"])
    assert "vocabulary and block" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no group"):
        tuned_gradients.group_of("transformer.some_new_layer.weight")


def test_tuned_gradients_with_dropout_draws_each_ways_masks_from_the_same_seeds(tmp_path):
    """`--dropout`: the recipe's dropout kept and each way measured against `compiled`, seeded alike, so that
    `compiled` run again draws the same masks and comes out at rounding (embedding gradients add atomically)."""
    data = write_cs224n_named_synthetic(tmp_path)
    tiny = {"n_layer": 1, "n_embd": 16, "n_head": 2}
    config, _ = tuned_gradients.make_batches(data, 0, 0, torch.device("cpu"), tiny, dropout=True)
    assert config.resid_pdrop == config.embd_pdrop == 0.1
    arguments = ["--data_dir", str(data), "--batches", "2", "--ways", "compiled", "--dropout", "--model"]
    rows = tuned_gradients.main([*arguments, *(f"{field}={value}" for field, value in tiny.items())])
    assert all(difference < 1e-5 for difference in rows["compiled"].values())


def test_the_collection_recorder_files_each_collection_under_its_phase(tmp_path):
    """`gc_collections.py` runs a script as its own process would and reports its collections by the timeline's
    phases: none falls in the imports (the script holds the collector there), some after them."""
    report = tmp_path / "gc.json"
    command = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "diagnostics" / "gc_collections.py"), "--report", str(report),
        "scripts/train.py", "--recipe", "handout", "--n_layer", "1", "--n_embd", "32", "--n_head", "2",
        "--pretrain_max_epochs", "1", "--no_do_finetune", "--output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, **CPU_ONLY})
    assert result.returncode == 0, result.stderr[-3000:]
    phases = {label.rsplit(" | gen", 1)[0] for label in json.loads(report.read_text())}
    importing = {
        "interpreter and command start-up",
        "flags read, recipe resolved (first imports of torch and transformers)",
    }
    assert phases and not phases & importing and phases - {"start"}
    assert "s in collections; written to" in result.stderr


def test_sampled_stacks_counts_each_stack_once_toward_the_first_kind_it_matches(tmp_path, capsys):
    """py-spy's raw lines: only stacks through `--within` count; a stack matching two kinds counts toward the one
    named first; what matches none is "the rest"; a line that is not a stack names its line."""
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (a.py:1);_compile (b.py:2);triton_key (c.py:3) 30\n"
        "main (a.py:1);_compile (b.py:2);_find_and_load (x:1);triton_key (c.py:3) 10\n"
        "main (a.py:1);_compile (b.py:2);_find_and_load (x:1) 50\n"
        "main (a.py:1);_compile (b.py:2);deserialize (d.py:4) 10\n"
        "main (a.py:1);steps (e.py:5) 900\n\n",
        encoding="utf-8",
    )
    kinds = [("digest", "^triton_key "), ("imports", "_find_and_load ")]
    assert sampled_stacks.shares(sampled_stacks.read_stacks(raw), "_compile ", kinds) == {
        "digest": 40,
        "imports": 50,
        "the rest": 10,
    }
    sampled_stacks.main([str(raw), "--within", "_compile ", "--kind", "imports=_find_and_load ", "--rate", "100"])
    printed = capsys.readouterr().out
    assert "1.00 s sampled" in printed and "imports" in printed and " 60.0%       0.60" in printed
    raw.write_text("main (a.py:1) ten\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="line 1"):
        sampled_stacks.read_stacks(raw)


def test_the_gpu_test_suite_reports_each_process_and_what_failed_even_when_stopped(tmp_path):
    """Ids dealt in turn to two processes; the one still running at the limit is stopped by SIGINT and still
    reports its failure and error, its counts, and the ids that did not run, also where the runner itself was
    started with SIGINT ignored."""
    (tmp_path / "test_dealt.py").write_text(
        "import time\nimport pytest\n\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError('set-up')\n\n\n"
        "def test_broken(broken):\n    pass\n\n\ndef test_ok():\n    pass\n\n\ndef test_fails():\n    assert 1 == 2\n\n\n"
        "def test_ok2():\n    pass\n\n\ndef test_slow():\n    time.sleep(60)\n\n\ndef test_after_slow():\n    pass\n"
    )
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_test_suite.py"), "--processes", "2", "--limit", "6",
               "--output", str(tmp_path / "logs"), "--", "."]  # fmt: skip
    # started with SIGINT ignored, as a shell's background job is: the runner's processes must still take it
    ignoring_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, timeout=120, preexec_fn=ignoring_sigint
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "6 of 6 collected test ids (part 1/1) in 2 processes, 6 s each at most"
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    # group 0: test_broken, test_fails, test_slow (stopped in it); group 1: the three that pass
    assert rows["0"][1:7] == ["3", "0", "1", "0", "1", "0"] and lines[2].endswith("stopped at the limit")
    assert rows["1"][1:7] == ["3", "3", "0", "0", "0", "0"] and lines[3].endswith("exit 0")
    assert rows["all"][1:5] == ["6", "3", "1", "0"]
    assert "FAILED test_dealt.py::test_fails - assert 1 == 2" in lines
    assert any(line.startswith("ERROR test_dealt.py::test_broken") for line in lines)
    assert lines[-1].startswith("5 of 6 collected ids ran; 1 did not")
    assert (tmp_path / "logs" / "summary.txt").read_text().splitlines() == lines

    second_half = subprocess.run(command[:2] + ["--part", "2/2", "--processes", "1", "--", "."], capture_output=True,
                                 text=True, cwd=tmp_path, timeout=60)  # fmt: skip
    heading = second_half.stdout.splitlines()[0]  # ok, ok2, after_slow
    assert heading == "3 of 6 collected test ids (part 2/2) in 1 process, 480 s each at most"
    assert second_half.returncode == 0, second_half.stdout + second_half.stderr
