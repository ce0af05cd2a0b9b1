import subprocess
import sys

import pytest

from eagle31_mla.cli import main

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers


def test_roster_matches_the_published_checkpoint(capsys):
    assert main(["roster"]) == 0
    out = capsys.readouterr().out
    assert "20 tensors, 3,015,625,728 parameters, dtype bfloat16" in out
    assert "roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly" in out
    assert "576 values = 1152 bytes per token" in out


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "eagle31_mla.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("demo", "roster", "acceptance", "train", "inspect", "convert", "doctor", "serve-command"):
        assert command in result.stdout


def test_acceptance_help_shows_both_measurements(capsys):
    """`acceptance --help` shows the offline pair and the running-server arguments (and exits 0)."""
    assert main(["acceptance", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--draft", "--server", "--engine", "--concurrency", "--expect", "--reference", "--log"):
        assert flag in out, flag
    assert "--max-new-tokens, --max-tokens MAX_NEW_TOKENS" in out  # click writes the metavar once
