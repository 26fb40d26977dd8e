#!/usr/bin/env bash
# The GPU check in one line, offline, bounded: bash benchmarks/gpu_check.sh [key=value ...]
# (see benchmarks/gpu_check.py for the options and what each printed line means).
# Exit status: 0 all checks passed, 1 some check failed, 124 the 9-minute hard limit was hit.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 540 "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
