"""Python in a fresh process from the repository root: engines and torchrun jobs that must not share the
test process (in-process vLLM engines keep memory the CPU build does not give back; a test process that ran
other engines may hold other global settings)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT


def run_python(args: list[str], *, env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` (this interpreter) with ``env`` added to the environment; output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
