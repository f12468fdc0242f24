"""Bad input, interruptions and side effects, as a user meets them: each script run as a process, its one-line
error (`error: <where>: <what is wrong> (<what to do>)`, exit status 2, no traceback) checked, and every
file of the folders it must not touch compared byte for byte afterwards."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU_ONLY, REPO_ROOT

from data_loaders import write_synthetic_corpus

SCRIPTS = REPO_ROOT / "scripts"
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--batch_size", "16"]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]  # fmt: skip


def run(*args, launcher=(sys.executable,), env=None, timeout=600):
    command = [*launcher, *[str(a) for a in args]]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env={**os.environ, **(env or {})}
    )


def assert_one_line_error(result, *fragments):
    """Exit status 2 and exactly one `error:` line, naming every fragment; no traceback."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert str(fragment) in lines[0], lines[0]
    return lines[0]


def snapshot(folder) -> dict:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(tmp_path_factory.mktemp("synthetic"), num_people=60, seed=0)


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    """A small finished pretraining run (with a checkpoint-N folder)."""
    folder = tmp_path_factory.mktemp("runs") / "pretrained"
    result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", folder,
                 "--max_epochs", 2, *TINY, "--checkpointing_steps", "epoch")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def test_a_missing_corpus_is_one_line_and_leaves_nothing(tmp_path):
    result = run(
        SCRIPTS / "pretrain.py", "--pretrain_corpus_path", tmp_path / "missing.txt", "--output_dir", tmp_path / "out"
    )
    assert_one_line_error(result, tmp_path / "missing.txt", "no such file")
    assert not (tmp_path / "out").exists()
    debug = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", tmp_path / "missing.txt", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # --debug shows where it came from


def test_a_user_error_is_reported_once_under_accelerate_launch(tmp_path):
    args = [
        SCRIPTS / "pretrain.py",
        "--pretrain_corpus_path",
        tmp_path / "missing.txt",
        "--output_dir",
        tmp_path / "o",
    ]
    one = run(*args, launcher=[*LAUNCH, "--num_processes", "1", "--quiet"])
    assert sum(line.startswith("error: ") for line in one.stderr.splitlines()) == 1 and "Traceback" not in one.stderr
    # two processes: the line comes from the first only (torchrun adds its own report of the failed processes)
    two = run(*args, launcher=[*LAUNCH, "--multi_gpu", "--num_processes", "2"], env=CPU_ONLY)
    assert two.returncode != 0
    assert sum(line.startswith("error: ") for line in two.stderr.splitlines()) == 1, two.stderr[-3000:]


def test_bf16_gradient_sums_are_refused_on_cpu_processes_before_anything_is_written(corpus, tmp_path):
    """torch's bf16 hook for DDP runs with NCCL only: two CPU processes (gloo) are told so, and write nothing."""
    result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", tmp_path / "out",
                 "--max_epochs", 1, *TINY, "--gradient_reduce_dtype", "bf16",
                 launcher=[*LAUNCH, "--multi_gpu", "--num_processes", "2"], env=CPU_ONLY)  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "gradient_reduce_dtype" in lines[0] and "NCCL" in lines[0], result.stderr[-3000:]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_line_without_a_tab_is_named(corpus, tmp_path):
    bad = tmp_path / "train.tsv"
    lines = corpus.train.read_text(encoding="utf-8").split("\n")
    lines[2] = lines[2].split("\t")[0]  # the place and its tab gone
    bad.write_text("\n".join(lines), encoding="utf-8")
    result = run(SCRIPTS / "finetune.py", "--pretrain_corpus_path", corpus.corpus, "--finetune_corpus_path", bad,
                 "--output_dir", tmp_path / "out", *TINY)  # fmt: skip
    assert_one_line_error(result, f"{bad}:3", "no tab")
    questions_only = tmp_path / "questions.tsv"
    questions_only.write_text("".join(line.split("\t")[0] + "\n" for line in lines if line), encoding="utf-8")
    result = run(SCRIPTS / "finetune.py", "--pretrain_corpus_path", corpus.corpus, "--finetune_corpus_path",
                 questions_only, "--output_dir", tmp_path / "out", *TINY)  # fmt: skip
    assert_one_line_error(result, questions_only, "no line has a tab and a place")


@pytest.mark.parametrize("script", ["evaluate_checkpoint", "finetune", "ask"])
def test_a_folder_that_is_not_a_checkpoint_is_named(script, corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    arguments = {
        "evaluate_checkpoint": ["--model_name_or_path", empty, "--eval_corpus_path", corpus.dev],
        "finetune": [
            "--model_name_or_path",
            empty,
            "--finetune_corpus_path",
            corpus.train,
            "--output_dir",
            tmp_path / "o",
        ],
        "ask": ["--model_name_or_path", empty, "Ada Lovelace"],
    }[script]
    result = run(SCRIPTS / f"{script}.py", *arguments)
    assert_one_line_error(result, empty, "not a checkpoint: no config.json")
    assert list(empty.iterdir()) == [] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("script", ["evaluate_checkpoint", "finetune"])
def test_corrupt_weights_are_named_with_the_file(script, checkpoint, corpus, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged, ignore=shutil.ignore_patterns("checkpoint-*"))
    (damaged / "model.safetensors").write_text("this is not a safetensors file\n")
    before = snapshot(damaged)
    arguments = {
        "evaluate_checkpoint": ["--eval_corpus_path", corpus.dev],
        "finetune": ["--finetune_corpus_path", corpus.train, "--output_dir", tmp_path / "o"],
    }[script]
    result = run(SCRIPTS / f"{script}.py", "--model_name_or_path", damaged, *arguments)
    assert_one_line_error(result, damaged / "model.safetensors", "not a readable safetensors file")
    assert snapshot(damaged) == before


def test_the_output_dir_of_an_interrupted_run_names_its_checkpoints(checkpoint, corpus, tmp_path):
    interrupted = tmp_path / "interrupted"
    shutil.copytree(checkpoint / "checkpoint-8", interrupted / "checkpoint-8")
    result = run(
        SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", interrupted, "--eval_corpus_path", corpus.dev
    )
    assert_one_line_error(result, interrupted, "its checkpoints are checkpoint-8", f"{interrupted}/checkpoint-8")


def test_resuming_skips_a_damaged_newest_checkpoint(corpus, tmp_path):
    output_dir = tmp_path / "run"
    common = [SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", output_dir,
              "--max_epochs", 3, *TINY, "--checkpointing_steps", "epoch", "--save_total_limit", 3]  # fmt: skip
    assert run(*common).returncode == 0
    (output_dir / "config.json").unlink()  # as if stopped before its final save
    newest = output_dir / "checkpoint-12"
    (newest / "accelerate_state" / "model.safetensors").write_bytes(b"\0" * 10)  # killed while writing
    resumed = run(*common, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "skipping checkpoint-12" in resumed.stderr and f"Resumed from {output_dir / 'checkpoint-8'}" in resumed.stdout
    )


def test_an_occupied_output_dir_is_left_byte_for_byte(checkpoint, corpus):
    before = snapshot(checkpoint)
    result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", checkpoint,
                 "--max_epochs", 2, *TINY)  # fmt: skip
    assert_one_line_error(result, checkpoint, "already holds a run", "--overwrite_output_dir")
    different = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", checkpoint,
                    "--max_epochs", 5, *TINY, "--resume_from_checkpoint", "latest")  # fmt: skip
    assert_one_line_error(different, checkpoint, "holds a different run: max_epochs 2 → 5")
    assert snapshot(checkpoint) == before


def test_contradictory_flags_are_one_line(corpus, tmp_path):
    result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", tmp_path / "o",
                 "--batch_size", 64, "--per_device_train_batch_size", 32)  # fmt: skip
    assert_one_line_error(result, "pretrain.batch_size, pretrain.per_device_train_batch_size", "contradictory")
    bad_width = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--n_head", 7)
    assert_one_line_error(bad_width, "--n_head 7", "divisible by n_head")


def test_run_py_never_replaces_a_run_unasked_and_resumes_after_ctrl_c(corpus, tmp_path):
    """On the CPU wherever the test runs: the interruption lands 3 s into the training, which a GPU finishes sooner."""
    params = tmp_path / "vanilla.pretrain.params"
    command = [sys.executable, str(SCRIPTS / "run.py"), "pretrain", "vanilla", str(corpus.corpus),
               "--writing_params_path", str(params), "--max_epochs", "30"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **CPU_ONLY})  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not (params / "training_args.json").exists():
        time.sleep(0.2)
    time.sleep(3)  # into the training steps
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-3000:]
    assert "resume with the same command and --resume_from_checkpoint latest" in stdout and "Traceback" not in stderr
    before = snapshot(params)

    occupied = run(*command[1:], env=CPU_ONLY)
    assert_one_line_error(occupied, params, "already holds a run", "--overwrite_output_dir")
    assert snapshot(params) == before
    resumed = run(*command[1:], "--resume_from_checkpoint", "latest", env=CPU_ONLY)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout
    assert json.loads((params / "train_results.json").read_text())["global_step"] == 30  # 30 epochs of 1 batch
    replaced = run(*command[1:], "--max_epochs", "1", "--overwrite_output_dir", env=CPU_ONLY)
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert json.loads((params / "train_results.json").read_text())["global_step"] == 1


def test_evaluation_reads_its_checkpoint_and_writes_only_predictions(checkpoint, corpus, tmp_path):
    before = snapshot(checkpoint)
    result = run(SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint, "--eval_corpus_path", corpus.dev,
                 "--outputs_path", tmp_path / "dev.predictions")  # fmt: skip
    assert result.returncode == 0 and "Correct:" in result.stdout
    assert snapshot(checkpoint) == before  # read-only
    recorded = run(SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint, "--eval_corpus_path", corpus.dev,
                   "--update_model_card")  # fmt: skip
    assert recorded.returncode == 0
    facts = json.loads((checkpoint / "knowgpt_card.json").read_text())
    assert [e["eval_file"] for e in facts["evaluations"]] == ["dev.tsv"]


def test_evaluation_without_questions_is_refused_for_a_model_of_another_corpus(corpus, tmp_path):
    """The synthetic dev set is the default only for models trained on the synthetic corpus."""
    copy = tmp_path / "wiki.txt"
    copy.write_text(corpus.corpus.read_text(encoding="utf-8"), encoding="utf-8")  # not in the synthetic cache
    model = tmp_path / "model"
    assert run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", copy, "--output_dir", model, "--max_epochs", 1,
               *TINY).returncode == 0  # fmt: skip
    before = snapshot(model)
    result = run(SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", model)
    assert_one_line_error(result, model, "was trained on span corruption on `wiki.txt`", "--eval_corpus_path")
    assert snapshot(model) == before


def test_unknown_characters_are_named_with_their_first_line(corpus, tmp_path, checkpoint):
    questions = tmp_path / "questions.tsv"
    lines = corpus.dev.read_text(encoding="utf-8").strip().split("\n")
    lines[4] = lines[4].replace("Where was ", "Where was Ωmega ")
    questions.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run(
        SCRIPTS / "evaluate_checkpoint.py", "--model_name_or_path", checkpoint, "--eval_corpus_path", questions
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'Ω' (U+03A9) first at " + f"{questions}:5" in result.stderr


def test_a_training_log_in_a_file_holds_lines_not_progress_bars(corpus, tmp_path):
    result = run(SCRIPTS / "train.py", "--recipe", "handout", "--n_layer", 2, "--n_head", 4, "--n_embd", 128,
                 "--pretrain_batch_size", 16, "--finetune_batch_size", 16, "--pretrain_corpus_path", corpus.corpus,
                 "--train_corpus_path", corpus.train, "--eval_corpus_path", corpus.dev, "--output_dir", tmp_path / "run",
                 "--pretrain_max_epochs", 2, "--finetune_max_epochs", 1)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "\r" not in log
    assert "Writing model shards" not in log and "Loading weights" not in log
    assert result.stdout.count("training: step 8/8") == 1  # the last step's line, plain, once
    card = (tmp_path / "run" / "finetuned" / "README.md").read_text()
    assert "https://github.com/)" not in card and "base_model:" not in card


def test_a_script_ends_at_once_after_what_a_normal_exit_would_finish(tmp_path):
    """`cli.run_script` skips the interpreter's teardown, not what others registered for the exit: atexit
    handlers run, a non-daemon thread finishes, buffered output is written, and the status is the script's."""
    program = tmp_path / "script.py"
    program.write_text(
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "from hf_knowgpt.commands import cli\n"
        "from hf_knowgpt.utils.errors import InputError\n"
        "out = Path(sys.argv[2])\n"
        "def main():\n"
        "    atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "    threading.Thread(target=lambda: (time.sleep(0.5), (out / 'thread').write_text('done'))).start()\n"
        "    print('buffered', end='')\n"
        "    if sys.argv[1] == 'user-error':\n"
        "        raise InputError(out / 'input.txt', 'is unreadable', 'give another')\n"
        "    if sys.argv[1] == 'exit-message':\n"
        "        sys.exit('stopped')\n"
        "cli.run_script(main)\n"
    )
    for mode, status in (("ok", 0), ("user-error", 2), ("exit-message", 1)):
        out = tmp_path / mode
        out.mkdir()
        result = run(program, mode, out)
        assert result.returncode == status, result.stderr[-2000:]
        assert result.stdout == "buffered"
        assert (out / "atexit").read_text() == "ran"
        assert (out / "thread").read_text() == "done"
    assert_one_line_error(run(program, "user-error", tmp_path / "user-error"), "input.txt", "is unreadable")
    assert run(program, "exit-message", tmp_path / "exit-message").stderr.strip() == "stopped"


def test_torch_compile_takes_auto_or_nothing(corpus, tmp_path):
    """`--torch_compile` takes no value or `auto`; `--no_torch_compile` none; a misspelt value is refused at once."""
    for flag, value, message in (("--torch_compile", "sometimes", "takes no value or 'auto'"),
                                 ("--no_torch_compile", "auto", "takes no value")):  # fmt: skip
        result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", tmp_path / "o",
                     flag, value)  # fmt: skip
        assert result.returncode == 2 and f"{flag} {message}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr and not (tmp_path / "o").exists()


def test_tuning_kernels_needs_compiling(corpus, tmp_path):
    """`--tune_kernels` tunes the compiled step: alone it is refused at once, naming the flag to add."""
    result = run(SCRIPTS / "pretrain.py", "--pretrain_corpus_path", corpus.corpus, "--output_dir", tmp_path / "o",
                 "--tune_kernels")  # fmt: skip
    assert_one_line_error(result, "tune_kernels: tunes the compiled step's kernels (give --torch_compile too)")
    assert not (tmp_path / "o").exists()
