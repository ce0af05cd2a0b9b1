#!/usr/bin/env bash
# The GPU check of the FlashInfer path (README, "GPU path"), for one bare CUDA machine (sized for one H200: under
# 10 minutes once flashinfer-python is installed; every stage has a timeout). Not run yet: no GPU was lent to the
# sessions that wrote it.
#   scripts/gpu_check.sh [OUT]     OUT: where logs and tables go (default gpu-check-out)
# Expects a CUDA build of torch (2.11) and transformers (5.17) already installed; pytest too, or a network to
# install it. Installs the project without dependencies, and flashinfer-python only if it is missing (the
# installed torch pinned by a constraint: flashinfer-python itself asks for an unpinned torch). FlashInfer
# compiles its kernels on first use (JIT, with nvcc: CUDA_HOME or nvcc on PATH); the tests run first and leave
# them in ~/.cache/flashinfer for the benchmark.
# Stages: 1. setup  2. the `gpu` tests with EAGLE31_REQUIRE_GPU=1 (a skip is a failure)  3. decode step at full
# Kimi-K3 drafter size: torch eager, torch compile with CUDA graphs, FlashInfer; OUT/decode_step_comparison.md.
# 4. a TTT training step at 4k and 32k tokens (benchmarks/train_step.py on cuda); OUT/train_step.md.
# Every stage runs even when an earlier one failed; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${1:-gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MAX_JOBS=${MAX_JOBS:-16}  # FlashInfer's JIT builds with ninja
START=$(date +%s)
FAILED=()
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

note() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }
stage() {  # name, timeout seconds, command...: runs it, logs to OUT/name.log, records the outcome
  local name=$1 limit=$2 rc t0=$SECONDS
  shift 2
  note "start $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  if [ "$rc" -eq 0 ]; then
    note "ok    $name ($((SECONDS - t0))s)"
  elif [ "$rc" -eq 124 ]; then
    note "TIMEOUT $name after ${limit}s"
    FAILED+=("$name")
  else
    note "FAILED $name (exit $rc)"
    FAILED+=("$name")
  fi
  return "$rc"
}

# ---- 1. setup -----------------------------------------------------------------------------------------------
note "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note "nvcc: $(command -v nvcc || echo "not on PATH (CUDA_HOME=${CUDA_HOME:-unset})") $(nvcc --version 2>/dev/null | tail -1)"
TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) || {
  note "FAILED: torch does not import with $PY"
  exit 1
}
note "torch $TORCH (cuda $("$PY" -c "import torch; print(torch.version.cuda, torch.cuda.is_available())")), transformers $("$PY" -c "import transformers; print(transformers.__version__)" 2>&1)"
echo "torch==$TORCH" >"$OUT/constraints.txt"
setup() {  # run by `bash -c` under the stage's timeout (exported with PY, OUT, TORCH)
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "editable install failed (no setuptools/wheel?): the later stages use PYTHONPATH=src"
  "$PY" -c "import pytest" 2>/dev/null || "$PY" -m pip install -q "pytest>=8" -c "$OUT/constraints.txt"
  "$PY" -c "import flashinfer" 2>/dev/null \
    || "$PY" -m pip install -q "flashinfer-python>=0.7.2.post1,<0.8" -c "$OUT/constraints.txt"
  "$PY" -c "import flashinfer, torch, pytest; print('flashinfer', flashinfer.__version__, flashinfer.__git_commit__)
assert torch.__version__ == '$TORCH', 'torch changed: ' + torch.__version__"
}
export -f setup
export PY OUT TORCH
stage setup 240 bash -c setup
"$PY" -c "import eagle31_mla" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# ---- 2. the gpu tests ---------------------------------------------------------------------------------------
stage gpu_tests 180 env EAGLE31_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA \
  tests/unit/test_flashinfer.py tests/unit/test_training.py

# ---- 3. decode step at full size: torch eager, torch compile + CUDA graphs, FlashInfer ------------------------
BENCH=(benchmarks/decode_step.py --device cuda --contexts 4096 32768 --steps 20 --naive-context 0)
stage decode_eager 60 "$PY" "${BENCH[@]}" --json "$OUT/decode_eager.json"
stage decode_compile 120 "$PY" "${BENCH[@]}" --compile reduce-overhead --json "$OUT/decode_compile.json"
stage decode_flashinfer 60 "$PY" "${BENCH[@]}" --attn flashinfer --json "$OUT/decode_flashinfer.json"

# ---- 4. a long-context training step: TTT at 4k and 32k tokens, the demo and the mid-size layer --------------
# (the linear-memory attention's CUDA kernels; the gpu tests above checked it against the dense mask on CUDA)
stage train_long 180 "$PY" -m benchmarks.train_step --device cuda --lengths 4096 32768 --layers demo mid \
  --dtypes bfloat16 --modes dense anchored --repeats 2
cp "$OUT/train_long.log" "$OUT/train_step.md" 2>/dev/null

"$PY" - "$OUT" <<'EOF' | tee "$OUT/decode_step_comparison.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {"torch eager": "decode_eager", "torch compile, CUDA graphs": "decode_compile", "FlashInfer": "decode_flashinfer"}
found = {name: json.loads((out / f"{f}.json").read_text()) for name, f in runs.items() if (out / f"{f}.json").exists()}
if not found:
    sys.exit("no decode-step results to compare")
any_run = next(iter(found.values()))
print(f"# decode step, Kimi-K3 drafter size, bf16, batch 1 ({any_run['device']}, torch {any_run['torch']})\n")
print("Each cell: median step time, and step / floor, the floor being the bytes a step reads over the best")
print("streaming-read rate measured in the same run (benchmarks/decode_step.py).\n")
print("| context | bytes read | " + " | ".join(found) + " |")
print("|--:|--:|" + "--:|" * len(found))
for context in sorted({row["context"] for run in found.values() for row in run["rows"]}):
    cells, nbytes = [], None
    for run in found.values():
        row = next((r for r in run["rows"] if r["context"] == context), None)
        nbytes = row["bytes"] if row else nbytes
        cells.append(f"{row['step_s'] * 1e3:.2f} ms ({row['step_s'] / row['floor_s']:.2f}x)" if row else "-")
    print(f"| {context} | {nbytes / 1e9:.3f} GB | " + " | ".join(cells) + " |")
missing = [name for name in runs if name not in found]
if missing:
    print(f"\nmissing (failed or timed out, see the logs): {', '.join(missing)}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || FAILED+=("comparison")

note "total $(($(date +%s) - START))s; logs and tables in $OUT/"
if [ "${#FAILED[@]}" -gt 0 ]; then
  note "FAILED: ${FAILED[*]}"
  exit 1
fi
note "all stages passed"
