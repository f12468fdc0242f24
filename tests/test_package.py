"""What `import hf_knowgpt` costs and gives: nothing heavy is loaded, yet transformers' Auto classes and the
"birthplace-qa" pipeline know KnowGPT once their modules load, whichever is imported first."""

import ast
import gc
import importlib
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT


def run_python(code: str):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_importing_the_package_loads_neither_torch_nor_transformers():
    out = run_python(
        "import sys, hf_knowgpt, data_loaders\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'evaluate', 'triton', 'accelerate') if m in sys.modules))"
    )
    assert out.strip() == "[]"


@pytest.mark.parametrize("package_name", ["hf_knowgpt", "data_loaders"])
def test_each_lazily_exported_name_is_its_modules_public_object(package_name):
    # the export table is written by hand beside each module's `__all__`: a renamed or dropped name must fail
    # here, not when a user's `from hf_knowgpt import ...` first reaches it
    package = importlib.import_module(package_name)
    for module_name, names in package._EXPORTS.items():
        module = importlib.import_module(f"{package_name}.{module_name}")
        for name in names:
            assert name in module.__all__, f"{package_name}.{module_name} does not export {name}"
            assert getattr(package, name) is getattr(module, name)
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match=f"module '{package_name}' has no attribute 'no_such_name'"):
        _ = package.no_such_name


@pytest.mark.parametrize("script", ["pretrain", "finetune", "train", "evaluate_checkpoint", "run"])
def test_script_help_needs_no_torch(script):
    # as its own process: a script leaves at once when done (`cli.run_script`), so it is asked which modules
    # it imported (`-X importtime` lists each on stderr)
    result = subprocess.run(
        [sys.executable, "-X", "importtime", f"scripts/{script}.py", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0 and "--help" in result.stdout, result.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "hf_knowgpt.commands.cli" in imported  # the list is the script's
    assert "torch" not in imported and "transformers" not in imported


def test_the_console_script_runs_the_commands_as_the_scripts_do():
    out = run_python(
        "import sys\n"
        "from hf_knowgpt.commands import knowgpt\n"
        "try:\n"
        "    knowgpt.main(['evaluate', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)"
    )
    assert out.startswith("usage: knowgpt evaluate") and "--eval_corpus_path" in out and out.strip().endswith("False")
    listing = run_python("from hf_knowgpt.commands import knowgpt\nknowgpt.main(['--help'])")
    scripts = {p.stem for p in (REPO_ROOT / "scripts").glob("*.py")} - {"evaluate_checkpoint"} | {"evaluate"}
    assert {line.split()[0] for line in listing.split("commands:\n")[1].splitlines()} == scripts


def test_the_console_script_ends_with_its_commands_status(tmp_path):
    # `knowgpt` as installed runs `console`, which `python -m hf_knowgpt.commands.knowgpt` runs too
    def console(*flags):
        command = [sys.executable, "-m", "hf_knowgpt.commands.knowgpt", *flags]
        return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)

    assert console().returncode == 2 and console("nosuch").returncode == 2
    questions = tmp_path / "dev.tsv"
    questions.write_text("Where was Ada born?\tParis\n", encoding="utf-8")
    scored = console("london_baseline", "--eval_corpus_path", questions, "--outputs_path", tmp_path / "out.txt")
    assert scored.returncode == 0 and "Correct: 0 out of 1: 0.0%" in scored.stdout, scored.stderr[-2000:]
    refused = console("london_baseline", "--eval_corpus_path", tmp_path / "missing.tsv")
    assert refused.returncode == 2 and "missing.tsv" in refused.stderr


REGISTERED = (
    "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer\n"
    "config = AutoConfig.for_model('knowgpt', n_layer=2, n_embd=16, n_head=2, vocab_size=20)\n"
    "model = AutoModelForCausalLM.from_config(config)\n"
    "from transformers.models.auto.tokenization_auto import tokenizer_class_from_name\n"
    "from transformers.pipelines import PIPELINE_REGISTRY\n"
    "print(type(model).__name__, 'birthplace-qa' in PIPELINE_REGISTRY.get_supported_tasks())\n"
)


@pytest.mark.parametrize("order", ["package first", "transformers first"])
def test_auto_classes_and_pipeline_know_knowgpt_whichever_comes_first(order):
    if order == "package first":
        code = "import hf_knowgpt\n" + REGISTERED
    else:  # transformers' Auto modules already loaded: the package registers at import
        code = "import transformers.pipelines\nfrom transformers import AutoConfig, AutoModel\nimport hf_knowgpt\n"
        code += REGISTERED
    assert run_python(code).strip().endswith("KnowGPTForCausalLM True")


def test_a_saved_checkpoint_loads_through_the_auto_classes_after_a_bare_import(tmp_path):
    run_python(
        "from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM, KnowGPTTokenizerFast\n"
        "model = KnowGPTForCausalLM(KnowGPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=20))\n"
        f"model.save_pretrained(r'{tmp_path}')\n"
        f"KnowGPTTokenizerFast.from_corpus('abc de').save_pretrained(r'{tmp_path}')\n"
    )
    out = run_python(
        "import hf_knowgpt\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained(r'{tmp_path}')\n"
        f"tokenizer = AutoTokenizer.from_pretrained(r'{tmp_path}')\n"
        "print(type(model).__name__, type(tokenizer).__name__)"
    )
    assert out.strip().endswith("KnowGPTForCausalLM KnowGPTTokenizerFast")


def test_a_scripts_process_collects_no_garbage_until_its_libraries_are_loaded(tmp_path):
    # what a command's process sees: `run_script` holds the collector; the command, once it has imported what
    # it runs, lets it resume with everything loaded so far left out of later collections
    questions = tmp_path / "dev.tsv"
    questions.write_text("Where was Ada born?\tLondon\n", encoding="utf-8")
    out = run_python(
        "import gc\n"
        "import hf_knowgpt.analysis.evaluation as evaluation\n"
        "from hf_knowgpt.commands import cli, london_baseline\n"
        "plain = evaluation.london_baseline\n"
        "def seen(*args, **kwargs):\n"
        "    print('scored', gc.isenabled(), gc.get_freeze_count() > frozen + 1000)\n"
        "    return plain(*args, **kwargs)\n"
        "evaluation.london_baseline = seen\n"
        "def main():\n"
        "    global frozen\n"
        "    frozen = gc.get_freeze_count()  # what the interpreter's start froze, if anything\n"
        "    print('started', gc.isenabled())\n"
        f"    london_baseline.main(['--eval_corpus_path', r'{questions}', '--outputs_path', r'{tmp_path / 'out.txt'}'])\n"
        "cli.run_script(main)\n"
    )
    assert out.splitlines()[0] == "started False"
    assert "scored True True" in out.splitlines() and "Correct: 1 out of 1: 100.0%" in out


def test_outside_a_scripts_process_the_collector_is_left_alone():
    from hf_knowgpt.commands import cli

    frozen = gc.get_freeze_count()
    cli.libraries_loaded()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_every_script_resumes_collection_once_its_command_has_loaded_its_libraries():
    # `run_script` holds the collector until `cli.libraries_loaded`; a command that never called it would train
    # with no collection of cyclic garbage at all. Its `main` calls it, or `cli.run_training` (which does), or
    # the `main` of commands that do.
    resuming = {"libraries_loaded", "run_training"}
    commands = {}
    for path in (REPO_ROOT / "hf_knowgpt" / "commands").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        main = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"), None)
        if main is not None:
            calls = [node.func for node in ast.walk(main) if isinstance(node, ast.Call)]
            commands[path.stem] = {
                (call.value.id if isinstance(call.value, ast.Name) else "", call.attr)
                for call in calls
                if isinstance(call, ast.Attribute)
            }

    def resumes(name, seen=()):
        called = commands[name]
        if any(attribute in resuming for _, attribute in called):
            return True
        return any(
            attribute == "main" and owner in commands and owner not in seen and resumes(owner, (*seen, name))
            for owner, attribute in called
        )

    scripts = sorted((REPO_ROOT / "scripts").glob("*.py"))
    run = {re.search(r"run_script\((\w+)\.main\)", p.read_text(encoding="utf-8")).group(1) for p in scripts}
    assert len(run) == len(scripts) and run <= set(commands)
    assert {name for name in run if not resumes(name)} == set()
