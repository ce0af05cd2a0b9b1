#!/usr/bin/env bash
# Run the test suite (creates the environments it needs first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
VENV=${EAGLE31_VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}"
exec "$VENV/bin/python" -m pytest "$@"
