#!/usr/bin/env bash
# Idempotent set-up of the llama.cpp tier's own virtual environment, .venv-llamacpp, holding
# llama-cpp-python with its OpenAI-compatible server, so that the tests and benchmarks can
# serve a GGUF candidate with llama.cpp (`python -m llama_cpp.server`) over loopback, and
# quantize an exported GGUF with llama.cpp's own quantizer (llama_cpp.llama_model_quantize).
#
# Why a separate venv: the package compiles llama.cpp from source (minutes on 2 cores) and
# pins its own fastapi/uvicorn/pydantic stack; most runs never need it. The harness is NOT
# installed here: it talks to the server over HTTP (harness.engines.openai_http) and runs
# the quantizer as a subprocess (harness.checkpoint.export_gguf).
#
# Pin: llama-cpp-python[server]==0.3.36 (the newest on the index on 2026-12-06), built for
# the CPU only: no CUDA/Metal/Vulkan/BLAS backends, no llama.cpp examples or tests (the pip
# build ships the shared libraries; llama-quantize/llama-perplexity are not installed).
#
# Re-running is cheap: a stamp records the hash of this script's inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
SPEC=${HARNESS_LLAMACPP_SPEC:-llama-cpp-python[server]==0.3.36}
CMAKE_FLAGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF"
stamp="$VENV/.llamacpp-installed"
want=$(printf '%s\n%s\n' "$SPEC" "$CMAKE_FLAGS" | cat - scripts/llamacpp_venv.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
echo "[llamacpp] building $SPEC into $VENV (compiles llama.cpp; minutes)" >&2
start=$(date +%s)
CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-cache-dir "$SPEC"
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('[llamacpp] llama_cpp', llama_cpp.__version__)" >&2
echo "[llamacpp] pip install took $(( $(date +%s) - start )) s" >&2
echo "$want" > "$stamp"
echo "[llamacpp] done" >&2
