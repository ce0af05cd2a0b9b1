"""Every argument of every subcommand, enumerated from the real argparse parser, refuses bad values of each
class its rule names (0, negative, nan, inf, text for numbers; missing file, folder for file, unwritable
path, ...): exit 2, exactly one line on stderr naming the argument and what was expected, no traceback,
before any work starts. A new argument without a bad-value rule (a type from eagle31_mla.cli or choices)
fails test_every_argument_has_a_bad_value_rule. Most cases run main() in-process; a sample runs the
real console entry point in a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle31_mla.cli import build_parser, main

NO_VALUE = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction, argparse._HelpAction,
            argparse._VersionAction, argparse._CountAction)  # fmt: skip


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def value_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, NO_VALUE)]


def name_of(action: argparse.Action) -> str:
    """How argparse names the argument in its messages."""
    return "/".join(action.option_strings) if action.option_strings else (action.metavar or action.dest)


def bad_classes(action: argparse.Action) -> list[str]:
    classes = list(getattr(action.type, "bad", ()))
    if action.choices is not None:
        classes.append("choice")
    return classes


CASES = [(command, action.dest, cls) for command, sub in subcommands().items() for action in value_arguments(sub)
         for cls in bad_classes(action)]  # fmt: skip


def test_every_argument_has_a_bad_value_rule():
    missing = [f"{command} {name_of(a)}" for command, sub in subcommands().items() for a in value_arguments(sub)
               if not bad_classes(a)]  # fmt: skip
    assert not missing, f"arguments without a bad-value rule (a type from eagle31_mla.cli, or choices): {missing}"
    assert set(subcommands()) <= set(BASELINE), f"add a valid baseline command line for {set(subcommands()) - set(BASELINE)}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
                                                   "vocab_size": 300, "intermediate_size": 128,
                                                   "num_attention_heads": 4}))  # fmt: skip
    (root / "prompts.txt").write_text("Once upon a time\n")
    (root / "a-file.txt").write_text("x")
    (root / "empty.txt").write_text("")
    (root / "a-folder").mkdir()
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00\x01garbage\n")
    return root


def class_value(cls: str, root: Path) -> str:
    return {
        "zero": "0", "negative": "-1", "nan": "nan", "inf": "inf", "text": "abc!", "fraction": "2.5",
        "above_one": "1.5", "empty": "", "slashes": "a/b/c", "choice": "not-a-choice",
        "missing": str(root / "no-such" / "thing.txt"),
        "folder": str(root / "a-folder"),
        "file": str(root / "a-file.txt"),
        "unwritable": str(root / "a-file.txt" / "out"),  # its parent is a file: nothing can be written there
        "missing_parent": str(root / "no-such-folder" / "report.json"),
        "empty_file": str(root / "empty.txt"),
        "binary": str(root / "binary.txt"),  # not UTF-8 text: every file argument is read as text
        "huge": "99999999999",  # a drafting count past its bound (speculative.DRAFTING_LIMITS)
        "proc": "/proc/x/out",  # passes os.access (as root), yet no folder can be created there
    }[cls]  # fmt: skip


#: a valid command line per subcommand (dest -> value; "{root}" is the fixture folder)
BASELINE = {
    "demo": {},
    "roster": {},
    "acceptance": {"target": "{root}/model", "draft": "{root}/model", "prompts": "{root}/prompts.txt"},
    "train": {"target": "{root}/model", "text": "{root}/prompts.txt", "out": "{root}/out"},
    "inspect": {"path": "{root}/model"},
    "convert": {"src": "{root}/model", "dst": "{root}/dst"},
    "doctor": {"draft": "{root}/model", "target": "{root}/model", "engine": "vllm"},
    "serve-command": {"engine": "vllm"},
}


def command_line(command: str, root: Path, dest: str | None = None, value: str | None = None) -> list[str]:
    """``command`` with its baseline, the argument ``dest`` set to ``value``."""
    values = {k: v.format(root=root) for k, v in BASELINE[command].items()}
    if dest is not None:
        values[dest] = value
    argv = [command]
    for action in value_arguments(subcommands()[command]):
        if action.dest in values:
            argv += [values[action.dest]] if not action.option_strings else [action.option_strings[0], values[action.dest]]
    return argv


def check_one_line(code: int, err: str, out: str, action: argparse.Action) -> str:
    assert "Traceback" not in err, err
    lines = err.strip("\n").splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    line = lines[0]
    assert line.startswith("eagle31-mla: error: "), line
    assert name_of(action).split("/")[0] in line, f"the message does not name {name_of(action)}: {line}"
    assert "expected" in line or "choose from" in line, f"the message does not say what was expected: {line}"
    assert not out, out
    return line


@pytest.mark.parametrize("command, dest, cls", CASES, ids=[f"{c}-{d}-{k}" for c, d, k in CASES])
def test_bad_value_is_one_line_and_exit_2(command, dest, cls, files, capsys):
    (action,) = [a for a in value_arguments(subcommands()[command]) if a.dest == dest]
    argv = command_line(command, files, dest, class_value(cls, files))
    code = main(argv)
    captured = capsys.readouterr()
    check_one_line(code, captured.err, captured.out, action)


def test_baselines_parse(files):
    """The baselines themselves are valid (so a refusal above is the bad value's)."""
    for command in subcommands():
        build_parser().parse_args(command_line(command, files))


# one bad value per subcommand through the real entry point, in a fresh process
SUBPROCESS = [("demo", "prompts", "zero"), ("acceptance", "json", "missing_parent"), ("acceptance", "top_p", "nan"),
              ("train", "lr", "inf"), ("inspect", "path", "missing"), ("convert", "dst", "unwritable"),
              ("doctor", "env", "text"), ("serve-command", "num_steps", "negative")]  # fmt: skip


@pytest.mark.parametrize("command, dest, cls", SUBPROCESS, ids=[f"{c}-{d}-{k}" for c, d, k in SUBPROCESS])
def test_bad_value_in_a_real_process(command, dest, cls, files):
    (action,) = [a for a in value_arguments(subcommands()[command]) if a.dest == dest]
    argv = command_line(command, files, dest, class_value(cls, files))
    result = subprocess.run([sys.executable, "-m", "eagle31_mla.cli", *argv], capture_output=True, text=True, timeout=120)
    check_one_line(result.returncode, result.stderr, result.stdout, action)


# ---- rules between arguments, or needing a file's content: still before any long work ----------------


@pytest.mark.parametrize("command, changes, message", [
    ("demo", {"prompts": "9999"}, "argument --prompts: expected at most"),
    ("acceptance", {"prompts": "{root}/blank.txt"}, "argument --prompts: expected at least one prompt"),
    ("acceptance", {"topk": "1", "num_draft_tokens": "9"}, "chain drafting verifies num_steps + 1"),
    ("acceptance", {"topk": "4"}, "tree drafting (topk 4) needs num_draft_tokens"),
    ("train", {"seq_len": "4", "depth": "4"}, "argument --seq-len: expected more than --depth 4"),
    ("train", {"aux_layers": "1,2,9"}, "argument --aux-layers: expected one-based ids <= 4"),
    ("train", {"text": "{root}/blank.txt"}, "argument --text: expected at least one non-empty document"),
    ("convert", {"prune_vocab": "10"}, "--prune-vocab N and --token-counts FILE go together"),
    ("serve-command", {"engine": "tokenspeed", "topk": "2", "num_draft_tokens": "4"}, "topk"),
])  # fmt: skip
def test_rules_between_arguments_are_checked_first(command, changes, message, files, capsys):
    (files / "blank.txt").write_text("\n   \n\n")
    argv = command_line(command, files)
    for dest, value in changes.items():
        (action,) = [a for a in value_arguments(subcommands()[command]) if a.dest == dest]
        argv += [action.option_strings[0], value.format(root=files)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not (files / "out").exists() and not (files / "dst").exists()  # nothing was written


def test_an_unexpected_failure_is_one_line_unless_asked(monkeypatch, capsys):
    import eagle31_mla.serving

    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(eagle31_mla.serving, "serve_command", boom)
    assert main(["serve-command", "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["eagle31-mla: error: unexpected RuntimeError: boom; second line "
                                        "(set EAGLE31_MLA_TRACEBACK=1 for the traceback)"]  # fmt: skip
    monkeypatch.setenv("EAGLE31_MLA_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["serve-command", "--engine", "vllm"])


def test_help_still_works(capsys):
    assert main(["--help"]) == 0
    assert "serve-command" in capsys.readouterr().out
