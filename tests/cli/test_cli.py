import subprocess
import sys

import pytest

from eagle31_mla.cli import cli, main

pytestmark = pytest.mark.transformers


def test_roster_matches_the_published_checkpoint(capsys):
    assert main(["roster"]) == 0
    out = capsys.readouterr().out
    assert "20 tensors, 3,015,625,728 parameters, dtype bfloat16" in out
    assert "roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly" in out
    assert "576 values = 1152 bytes per token" in out


def eagle31_mla(*argv: str) -> subprocess.CompletedProcess:
    """The console entry point, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "eagle31_mla.cli", *argv], capture_output=True, text=True, timeout=120)


def test_console_script_help_and_a_bad_value():
    result = eagle31_mla("--help")
    assert result.returncode == 0
    assert all(command in result.stdout for command in cli.commands)
    result = eagle31_mla("demo", "--engine", "tf")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "eagle31-mla: error: argument --engine: 'tf' is not one of 'hf', 'vllm'.\n"


@pytest.mark.parametrize("command", list(cli.commands))
def test_every_subcommand_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"Usage: eagle31-mla {command} [OPTIONS]" in out
    if command == "acceptance":  # both measurements: the offline pair, and a running server
        flags = "--target --draft --server --engine --concurrency --expect --reference --log".split()
        assert [flag for flag in flags if flag not in out] == []
        assert "--max-new-tokens, --max-tokens MAX_NEW_TOKENS" in out  # click writes the metavar once


def test_a_closed_pipe_is_quiet():
    """`eagle31-mla doctor --list-checks | head -c 1`: no 'Broken pipe' message, exit 0 or 141."""
    script = f"{sys.executable} -m eagle31_mla.cli doctor --list-checks | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stderr == "" and result.stdout.strip() in ("0", "141"), result


def test_an_unexpected_failure_is_one_line_unless_asked(monkeypatch, capsys):
    """(The bad command lines users make, each with its exact line: the CLI rows of tests/unit/test_bad_inputs.py.)"""
    boom = RuntimeError("boom\nsecond line")
    monkeypatch.setattr("eagle31_mla.serving.command.serve_command", lambda *a, **k: (_ for _ in ()).throw(boom))
    assert main(["serve-command", "--engine", "vllm"]) == 1
    err = "unexpected RuntimeError: boom; second line (set EAGLE31_MLA_TRACEBACK=1 for the traceback)"
    assert capsys.readouterr().err == f"eagle31-mla: error: {err}\n"
    monkeypatch.setenv("EAGLE31_MLA_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["serve-command", "--engine", "vllm"])
