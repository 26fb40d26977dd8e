#!/usr/bin/env bash
# Idempotent set-up of the peer tier's own virtual environment, .venv-peer, holding
# llm-compressor (the independent implementation the harness's quantizers are checked
# against). It is a separate venv because llm-compressor 0.14 pins compressed-tensors
# ==0.19.0 and transformers<=5.17, while the harness needs compressed-tensors>=0.20
# (and runs transformers 5.24): the two cannot share one environment.
#
# The harness is NOT installed here. The peer side runs only a small worker
# (benchmarks/peer_worker.py, stdlib + torch + transformers + llmcompressor) that
# reads a saved HF checkpoint and writes its quantized weights as safetensors; the
# harness side reads them in .venv. The package spec comes from the `peer` extra of
# pyproject.toml, the one place its version is pinned.
#
# torch is pinned in the same pip command: an unpinned torch would let llm-compressor
# pull a multi-GB CUDA build. Re-running is cheap (a stamp records the inputs' hash).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${PEER_VENV:-.venv-peer}
TORCH_SPEC=${HARNESS_TORCH_SPEC:-torch==2.13.0}
stamp="$VENV/.peer-installed"
want=$(cat pyproject.toml scripts/peer_venv.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
# The `peer` extra's requirement strings, read with the standard library.
mapfile -t PEER_SPECS < <("$PYTHON" -c '
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"].get("optional-dependencies", {})
if "peer" not in extras:
    sys.exit("pyproject.toml has no [project.optional-dependencies] peer list")
print("\n".join(extras["peer"]))')
if [[ ! -x "$VENV/bin/python" ]]; then
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "[peer] found a CUDA torch in $PYTHON: the venv will inherit it" >&2
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
echo "[peer] installing $TORCH_SPEC ${PEER_SPECS[*]} into $VENV" >&2
start=$(date +%s)
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC" "${PEER_SPECS[@]}"
echo "[peer] pip install took $(( $(date +%s) - start )) s" >&2
echo "$want" > "$stamp"
echo "[peer] done" >&2
