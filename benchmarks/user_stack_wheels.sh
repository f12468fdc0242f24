#!/usr/bin/env bash
# Fetch into .whl_user/ the Hugging Face stack exactly as `pip install -e .` resolved it in this machine's
# virtual environment (transformers, accelerate and what they need, at the installed versions), for the GPU
# machine, whose image has older ones (transformers 5.17): benchmarks that time the user's path then run
# on what a user installs. torch, numpy and other packages the image already has in a compatible version
# stay the image's. Run from the project root with the project's virtual environment active; carry
# ".whl_user" in the device call (benchmarks/gpu_machine.sh installs it when present).
set -euo pipefail
grep -qx '/.whl_user/' .git/info/exclude 2>/dev/null || echo '/.whl_user/' >> .git/info/exclude
rm -rf .whl_user && mkdir -p .whl_user
pins=$(python3 - <<'PY'
import re
from importlib.metadata import PackageNotFoundError, requires, version

KEPT_FROM_IMAGE = {"torch", "numpy", "pyyaml", "packaging", "tqdm", "psutil", "colorama", "tomli", "exceptiongroup"}
seen, pins = set(), []


def walk(name):
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen or key in KEPT_FROM_IMAGE:
        return
    seen.add(key)
    try:
        pins.append(f"{key}=={version(key)}")
    except PackageNotFoundError:  # an optional platform dependency this machine did not install
        return
    for requirement in requires(key) or []:
        if "extra ==" not in requirement:
            walk(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


for root in ("transformers", "accelerate", "huggingface-hub", "safetensors"):
    walk(root)
print(" ".join(pins))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl_user $pins
ls -1 .whl_user
