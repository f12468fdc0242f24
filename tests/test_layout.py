"""The package's layout as the README describes it: each concept in its own room, imports pointing only
downward through the layers, no import cycle, files a reader can hold, and checkpoints that carry only the
model's own files."""

import ast
import importlib.util
import re
from fnmatch import fnmatch

import pytest
from conftest import REPO_ROOT

PACKAGES = ("hf_knowgpt", "data_loaders")
# Bottom to top: a module imports from its own layer or the ones below, never from one above.
LAYERS = [
    ("foundations", ["hf_knowgpt.options", "hf_knowgpt.utils", "hf_knowgpt.utils.*"]),
    ("the model", ["hf_knowgpt.*_knowgpt", "hf_knowgpt.kernels", "hf_knowgpt.kernels.*"]),
    ("data", ["data_loaders", "data_loaders.*"]),
    (
        "using a model",
        [
            "hf_knowgpt",
            "hf_knowgpt.auto_registration",
            "hf_knowgpt.qa",
            "hf_knowgpt.pipeline_*",
            "hf_knowgpt.convert_cs224n",
        ],
    ),  # fmt: skip
    ("analysis", ["hf_knowgpt.analysis", "hf_knowgpt.analysis.*"]),
    ("training", ["hf_knowgpt.training", "hf_knowgpt.training.*"]),
    ("commands", ["hf_knowgpt.commands", "hf_knowgpt.commands.*"]),
]
# What a checkpoint carries beside its weights (`save_pretrained` copies a class's file and its relative imports).
MODEL_FILES = {
    "configuration_knowgpt.py",
    "attention_knowgpt.py",
    "layers_knowgpt.py",
    "modeling_knowgpt.py",
    "options.py",
}
TOKENIZER_FILES = {"tokenization_knowgpt.py"}
MAX_LINES = 600


def modules() -> dict[str, object]:
    """Our module names → their files (metric scripts, which `evaluate` loads by path, excepted)."""
    found = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if "metrics" in path.parts:
                continue
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports_of(name: str) -> set[str]:
    """Our modules that `name` imports anywhere in its file (lazy imports inside functions included)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` imports the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(name: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch(name, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_layout.py: give it a room")


def test_every_module_has_a_layer_and_imports_point_downward():
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name in sorted(MODULES)
        for target in sorted(imports_of(name))
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_no_import_cycle():
    graph = {name: imports_of(name) for name in MODULES}
    # a package's __init__ runs before any of its modules: that edge is not a cycle of ours
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    state, cycles = {}, []

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(" → ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_model_files_import_only_each_other_and_the_kernel_by_name():
    """A checkpoint's code runs without the package: its files import each other relatively, and the fused
    kernel only by its absolute name inside a `try` (transformers' check of a checkpoint's imports skips those)."""
    for file_name in MODEL_FILES | TOKENIZER_FILES:
        tree = ast.parse((REPO_ROOT / "hf_knowgpt" / file_name).read_text(encoding="utf-8"))
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for n in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in MODEL_FILES, f"{file_name}: from .{node.module}"
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for imported in names:
                    if imported.split(".")[0] in PACKAGES:
                        assert id(node) in guarded and imported.startswith("hf_knowgpt.kernels"), (file_name, imported)


def test_a_checkpoint_carries_only_the_model_files(tmp_path):
    from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM, KnowGPTTokenizerFast

    KnowGPTForCausalLM(KnowGPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=20)).save_pretrained(tmp_path)
    KnowGPTTokenizerFast.from_corpus("abc").save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.glob("*.py")} == MODEL_FILES | TOKENIZER_FILES


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_is_a_file_a_reader_can_hold(name):
    path = MODULES[name]
    text = path.read_text(encoding="utf-8")
    if text.count("\n") > MAX_LINES:  # allowed where the docstring says why one file reads better
        assert "One file" in (ast.get_docstring(ast.parse(text)) or ""), f"{path}: {text.count(chr(10))} lines"


def test_no_script_is_named_like_a_module_it_would_shadow():
    """Python puts a script's own folder first on sys.path, so `scripts/evaluate.py` would be imported in place
    of the `evaluate` library."""
    for script in (REPO_ROOT / "scripts").glob("*.py"):
        assert importlib.util.find_spec(script.stem) is None, f"{script.name} shadows the module {script.stem}"


def test_the_readme_layout_table_matches_the_tree():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    for path in paths:
        assert (REPO_ROOT / path).exists(), f"the README's layout names {path}, which does not exist"
    rooms = {p.rstrip("/") for p in paths}
    for folder in [*(REPO_ROOT / "hf_knowgpt").iterdir(), *REPO_ROOT.iterdir()]:
        if folder.is_dir() and not folder.name.startswith((".", "_")) and folder.name not in ("build", "dist"):
            relative = str(folder.relative_to(REPO_ROOT))
            if relative.endswith(".egg-info") or (folder / "pyvenv.cfg").exists() or relative == "outputs":
                continue
            assert relative in rooms, f"{relative}/ is not in the README's layout table"
