#!/usr/bin/env bash
# Lint and check the formatting of the whole tree with the [lint] extra's pinned ruff (settings: pyproject.toml's
# [tool.ruff]), in .venv-lint, which holds ruff alone. Both checks run; either failing fails the script.
# To fix: .venv-lint/bin/ruff check --fix . && .venv-lint/bin/ruff format .   (then scripts/sync_modeling.py)
set -uo pipefail
cd "$(dirname "$0")/.."
EAGLE31_VENV=.venv-lint scripts/setup.sh --lint >/dev/null || exit 1
status=0
.venv-lint/bin/ruff check . || status=1
.venv-lint/bin/ruff format --check . || status=1
exit $status
