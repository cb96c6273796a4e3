#!/usr/bin/env bash
# Creates bench/.venv (git-ignored) with PyTorch, numpy and safetensors from PyPI.
#   bash bench/setup.sh            # then: bench/.venv/bin/python bench/compare.py
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
if [ ! -x "$here/.venv/bin/python" ]; then
    "$python" -m venv "$here/.venv"
fi
"$here/.venv/bin/python" -m pip install --upgrade pip >/dev/null
"$here/.venv/bin/python" -m pip install -r "$here/requirements.txt"
"$here/.venv/bin/python" -c 'import torch, numpy, safetensors; print("torch", torch.__version__, "numpy", numpy.__version__, "safetensors", safetensors.__version__)'
