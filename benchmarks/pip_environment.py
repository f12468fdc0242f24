#!/usr/bin/env python
"""Make a Python environment that holds what `pip install -e .` installs and nothing else of this machine's.

    python benchmarks/pip_environment.py /tmp/pip-env      # prints the new environment's python
    /tmp/pip-env/bin/python benchmarks/bench_user_path.py ...

Why: a machine image with more packages than the package needs times slower than a user's own install.
transformers imports scipy's optimizers and torchvision when they are there (its object-detection losses,
loaded with `modeling_utils`), which `pip install -e .` does not bring. The environment is a virtual
environment without the machine's site-packages, given links to this machine's copies of the package's
requirements (setup.cfg's `install_requires`) and of theirs, followed through markers and requested extras,
torch's CUDA libraries and Triton among them: the versions are the machine's, the set is what pip installs.
The project itself is found as an editable install finds it (its root on the path). A requirement this
machine does not have is printed, not invented.
"""

import argparse
import configparser
import os
import re
import subprocess
import sys
import venv
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_requires(setup_cfg: Path = REPO_ROOT / "setup.cfg") -> list[Requirement]:
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = parser["options"]["install_requires"].strip().splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip()]


def requirement_closure(roots: list[Requirement]) -> tuple[dict, list[str]]:
    """{normalized name: Distribution} of the roots and everything they require on this platform, and the
    requirements this machine has no distribution for."""
    found, missing, extras_seen = {}, [], set()
    pending = [(requirement, "") for requirement in roots]
    while pending:
        requirement, parent_extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": parent_extra}):
            continue
        name = normalized(requirement.name)
        if name not in found:
            try:
                found[name] = distribution(name)
            except PackageNotFoundError:
                missing.append(str(requirement))
                continue
        for extra in ("", *sorted(requirement.extras)):
            if (name, extra) in extras_seen:
                continue
            extras_seen.add((name, extra))
            for line in found[name].requires or []:
                child = Requirement(line)
                # a child guarded by an extra belongs to that extra only
                if extra == "" and child.marker and "extra" in str(child.marker):
                    continue
                pending.append((child, extra))
    return found, sorted(set(missing))


def installed_entries(dist) -> list[Path]:
    """The paths, relative to its site-packages, that a distribution installed there: its modules and
    packages at the top level, or inside a namespace package (a folder without `__init__.py`, such as
    `nvidia/`, shared by several distributions) one level down, and its metadata folder."""
    site = Path(dist.locate_file(""))
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if not parts or parts[0] == ".." or parts[0] == "__pycache__":
            continue  # scripts and data outside site-packages; bytecode of a top-level module
        top = site / parts[0]
        if top.is_dir() and not (top / "__init__.py").exists() and len(parts) > 2:
            entries.add(Path(parts[0], parts[1]))
        else:
            entries.add(Path(parts[0]))
    return sorted(entries)


def console_scripts(dist) -> dict[str, str]:
    return {entry.name: entry.value for entry in dist.entry_points if entry.group == "console_scripts"}


def create(target: Path) -> tuple[Path, list[str]]:
    """The environment at `target` (made anew); its python, and the requirements this machine lacks."""
    if target.exists():
        raise SystemExit(f"{target} exists: give a new folder")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    closure, missing = requirement_closure(install_requires())
    for dist in closure.values():
        source_site = Path(dist.locate_file(""))
        for entry in installed_entries(dist):
            link = site / entry
            if link.exists() or link.is_symlink():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source_site / entry)
        for name, value in console_scripts(dist).items():
            module, _, attribute = value.partition(":")
            script = target / "bin" / name
            script.write_text(
                f"#!{python}\nimport sys\nfrom {module} import {attribute.split('.')[0]}\nsys.exit({attribute}())\n"
            )
            script.chmod(0o755)
    # the project as `pip install -e .` leaves it: importable from anywhere
    (site / "hf_knowgpt_editable.pth").write_text(f"{REPO_ROOT}\n")
    return python, missing


def torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a new folder for the environment")
    args = parser.parse_args(argv)
    python, missing = create(Path(args.target).resolve())
    for requirement in missing:
        print(f"not on this machine, left out: {requirement}", file=sys.stderr)
    # what the scripts import, once: the check, and the bytecode that `pip install` would have written
    check = "import torch, transformers, accelerate, datasets, evaluate, hf_knowgpt.training.workflows"
    if torch_has_cuda():
        check += ", triton, torch._inductor, torch._dynamo, hf_knowgpt.kernels.fused_attention"
    if subprocess.run([python, "-c", check], env={**os.environ, "PYTHONPATH": ""}).returncode != 0:
        raise SystemExit(f"{python} cannot import what the package needs ({check})")
    print(python)


if __name__ == "__main__":
    main()
