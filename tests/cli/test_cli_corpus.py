"""Every argument of every subcommand, enumerated from the real click commands, refuses bad values of each
class its rule names (0, negative, nan, inf, text for numbers; missing file, folder for file, unwritable
path, ...): exit 2, exactly one line on stderr naming the argument and what was expected, no traceback,
before any work starts. A new argument without a bad-value rule (a type from eagle31_mla.cli.params or a
click.Choice) fails test_every_argument_has_a_bad_value_rule. Most cases run main() in-process; a sample
runs the real console entry point in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from eagle31_mla.cli import cli, main


def subcommands() -> dict[str, click.Command]:
    return dict(cli.commands)


def value_arguments(command: click.Command) -> list[click.Parameter]:
    """The parameters that take a value: every click.Argument, every click.Option but flags and counts
    (click adds --help itself, outside ``params``)."""
    return [p for p in command.params if not (isinstance(p, click.Option) and (p.is_flag or p.count))]


def name_of(param: click.Parameter) -> str:
    """How the messages name the argument (as argparse did): its option strings, or a positional's metavar."""
    return "/".join(param.opts) if isinstance(param, click.Option) else (param.metavar or param.name)


def option_strings(param: click.Parameter) -> list[str]:
    return list(param.opts) if isinstance(param, click.Option) else []


def bad_classes(param: click.Parameter) -> list[str]:
    classes = list(getattr(param.type, "bad", ()))
    if isinstance(param.type, click.Choice):
        classes.append("choice")
    return classes


CASES = [
    (command, action.name, cls)
    for command, sub in subcommands().items()
    for action in value_arguments(sub)
    for cls in bad_classes(action)
]


def test_every_argument_has_a_bad_value_rule():
    missing = [
        f"{command} {name_of(a)}"
        for command, sub in subcommands().items()
        for a in value_arguments(sub)
        if not bad_classes(a)
    ]
    assert not missing, (
        f"arguments without a bad-value rule (a type from eagle31_mla.cli.params, or choices): {missing}"
    )
    assert set(subcommands()) <= set(BASELINE), (
        f"add a valid baseline command line for {set(subcommands()) - set(BASELINE)}"
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 4,
                "hidden_size": 64,
                "vocab_size": 300,
                "intermediate_size": 128,
                "num_attention_heads": 4,
            }
        )
    )
    (root / "prompts.txt").write_text("Once upon a time\n")
    (root / "conversations.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    (root / "a-file.txt").write_text("x")
    (root / "empty.txt").write_text("")
    (root / "a-folder").mkdir()
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00\x01garbage\n")
    (root / "loop").symlink_to(root / "loop")
    (root / "offline.json").write_text(json.dumps({"settings": {}, "total": {"mean_accept_length": 2.5}}))
    (root / "server.log").write_text("[2026-10-06 12:00:00 TP0] Req: r1 Finish! Accept_num_tokens_avg: 2.5\n")
    (root / "captured").mkdir()
    (root / "captured" / "manifest.json").write_text("{}")  # only its presence is checked while parsing
    return root


def class_value(cls: str, root: Path) -> str:
    return {
        "zero": "0",
        "negative": "-1",
        "nan": "nan",
        "inf": "inf",
        "text": "abc!",
        "fraction": "2.5",
        "above_one": "1.5",
        "empty": "",
        "slashes": "a/b/c",
        "choice": "not-a-choice",
        "missing": str(root / "no-such" / "thing.txt"),
        "folder": str(root / "a-folder"),
        "file": str(root / "a-file.txt"),
        "unwritable": str(root / "a-file.txt" / "out"),  # its parent is a file: nothing can be written there
        "missing_parent": str(root / "no-such-folder" / "report.json"),
        "empty_file": str(root / "empty.txt"),
        "binary": str(root / "binary.txt"),  # not UTF-8 text: every file argument is read as text
        "huge": "99999999999",  # a drafting count past its bound (speculative.DRAFTING_LIMITS)
        "proc": "/proc/x/out",  # passes os.access (as root), yet no folder can be created there
        "fullwidth": "\uff18",  # a full-width 8: int() and float() take it; the CLI reads ASCII digits only
        "underscore": "1_0",  # int() and float() read 10
        "toolong": str(root / ("n" * 300)),  # ENAMETOOLONG from the file system, not a traceback
        "loop": str(root / "loop"),  # a symlink to itself
        "scheme": "ftp://127.0.0.1/",  # --server: not http(s)
        "nohost": "http://",  # --server: no host
        "not_json": str(root / "a-file.txt"),  # --reference: a text file that is not an acceptance report
    }[cls]


#: a valid command line per subcommand (dest -> value; "{root}" is the fixture folder)
BASELINE = {
    "demo": {},
    "roster": {},
    "acceptance": {"target": "{root}/model", "draft": "{root}/model", "prompts": "{root}/prompts.txt"},
    "train": {"target": "{root}/model", "text": "{root}/prompts.txt", "out": "{root}/out"},
    "capture": {"target": "{root}/model", "text": "{root}/prompts.txt", "out": "{root}/out"},
    "inspect": {"path": "{root}/model"},
    "convert": {"src": "{root}/model", "dst": "{root}/dst"},
    "doctor": {"draft": "{root}/model", "target": "{root}/model", "engine": "vllm"},
    "serve-command": {"engine": "vllm"},
}


def command_line(
    command: str, root: Path, dest: str | None = None, value: str | None = None, drop: tuple[str, ...] = ()
) -> list[str]:
    """``command`` with its baseline (less ``drop``), the argument ``dest`` set to ``value``."""
    values = {k: v.format(root=root) for k, v in BASELINE[command].items() if k not in drop}
    if dest is not None:
        values[dest] = value
    argv = [command]
    for action in value_arguments(subcommands()[command]):
        if action.name in values:
            argv += (
                [values[action.name]]
                if not option_strings(action)
                else [option_strings(action)[0], values[action.name]]
            )
    return argv


def check_one_line(code: int, err: str, out: str, action: click.Parameter) -> str:
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
    (action,) = [a for a in value_arguments(subcommands()[command]) if a.name == dest]
    argv = command_line(command, files, dest, class_value(cls, files))
    code = main(argv)
    captured = capsys.readouterr()
    check_one_line(code, captured.err, captured.out, action)


def test_baselines_parse(files):
    """The baselines themselves are valid (so a refusal above is the bad value's)."""
    for command, sub in subcommands().items():
        sub.make_context(command, command_line(command, files)[1:])  # parsed and checked, not run


# one bad value per subcommand through the real entry point, in a fresh process
SUBPROCESS = [
    ("demo", "prompts", "zero"),
    ("acceptance", "json", "missing_parent"),
    ("acceptance", "top_p", "nan"),
    ("acceptance", "server", "scheme"),
    ("train", "lr", "inf"),
    ("inspect", "path", "missing"),
    ("convert", "dst", "unwritable"),
    ("doctor", "env", "text"),
    ("serve-command", "num_steps", "negative"),
]


@pytest.mark.parametrize("command, dest, cls", SUBPROCESS, ids=[f"{c}-{d}-{k}" for c, d, k in SUBPROCESS])
def test_bad_value_in_a_real_process(command, dest, cls, files):
    (action,) = [a for a in value_arguments(subcommands()[command]) if a.name == dest]
    argv = command_line(command, files, dest, class_value(cls, files))
    result = subprocess.run(
        [sys.executable, "-m", "eagle31_mla.cli", *argv], capture_output=True, text=True, timeout=120
    )
    check_one_line(result.returncode, result.stderr, result.stdout, action)


# ---- rules between arguments, or needing a file's content: still before any long work ----------------


@pytest.mark.parametrize(
    "command, changes, message",
    [
        ("demo", {"prompts": "9999"}, "argument --prompts: expected at most"),
        ("acceptance", {"prompts": "{root}/blank.txt"}, "argument --prompts: expected at least one prompt"),
        ("acceptance", {"topk": "1", "num_draft_tokens": "9"}, "chain drafting verifies num_steps + 1"),
        ("acceptance", {"topk": "4"}, "tree drafting (topk 4) needs num_draft_tokens"),
        ("acceptance", {"server": "http://127.0.0.1:9"}, "--target is for the offline measurement"),
        ("acceptance", {"expect": "2.5"}, "--expect measures a running server: it needs --server URL"),
        ("acceptance", {"expect": "2", "reference": "{root}/offline.json"}, "not allowed with argument --expect"),
        ("train", {"seq_len": "4", "depth": "4"}, "argument --seq-len: expected more than --depth 4"),
        ("train", {"aux_layers": "1,2,9"}, "argument --aux-layers: expected one-based ids <= 4"),
        ("train", {"text": "{root}/blank.txt"}, "argument --text: expected at least one non-empty document"),
        ("train", {"init": "{root}/model", "draft_config": "{root}/model"}, "not allowed with argument --init"),
        ("train", {"draft_config": "{root}/model"}, "argument --draft-config: "),  # a llama config.json
        ("convert", {"prune_vocab": "10"}, "--prune-vocab N and --token-counts FILE go together"),
        ("serve-command", {"engine": "tokenspeed", "topk": "2", "num_draft_tokens": "4"}, "topk"),
    ],
)
def test_rules_between_arguments_are_checked_first(command, changes, message, files, capsys):
    (files / "blank.txt").write_text("\n   \n\n")
    argv = command_line(command, files)
    for dest, value in changes.items():
        (action,) = [a for a in value_arguments(subcommands()[command]) if a.name == dest]
        argv += [option_strings(action)[0], value.format(root=files)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not (files / "out").exists() and not (files / "dst").exists()  # nothing was written


def test_an_unexpected_failure_is_one_line_unless_asked(monkeypatch, capsys):
    import eagle31_mla.serving.command

    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(eagle31_mla.serving.command, "serve_command", boom)
    assert main(["serve-command", "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "eagle31-mla: error: unexpected RuntimeError: boom; second line (set EAGLE31_MLA_TRACEBACK=1 for the traceback)"
    ]
    monkeypatch.setenv("EAGLE31_MLA_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["serve-command", "--engine", "vllm"])


def test_help_still_works(capsys):
    assert main(["--help"]) == 0
    assert "serve-command" in capsys.readouterr().out


# ---- no output path may be, contain or lie inside an input path (generated: outputs x inputs) ----------


def _role_arguments(command: str, role: str) -> list[click.Parameter]:
    return [a for a in value_arguments(subcommands()[command]) if getattr(a.type, "role", None) == role]


#: a value for an input argument the baseline leaves out
OPTIONAL_INPUTS = {
    "token_counts": "{root}/counts.txt",
    "reference": "{root}/offline.json",
    "log": "{root}/server.log",
    "data": "{root}/captured",
    "draft": "{root}/model",
    "prompts": "{root}/prompts.txt",
    "init": "{root}/model",
    "conversations": "{root}/conversations.jsonl",
    "draft_config": "{root}/model",
}
#: an optional input or output that excludes a baseline argument (the commands' OneOf groups)
EXCLUDES = {
    ("train", "data"): "text",
    ("capture", "prompts"): "text",
    ("train", "conversations"): "text",
    ("capture", "conversations"): "text",
    ("capture", "spool"): "out",  # one of them
}


def _input_value(command: str, action: click.Parameter, root: Path) -> str:
    value = BASELINE[command].get(action.name) or OPTIONAL_INPUTS[action.name]
    return value.format(root=root)


COLLISIONS = [
    (command, out.name, inp.name, how)
    for command in subcommands()
    for out in _role_arguments(command, "output")
    for inp in _role_arguments(command, "input")
    for how in ("same", "contains", "inside", "inside-dotdot")
]


def test_every_output_is_checked_against_every_input():
    assert {c for c, *_ in COLLISIONS} == {"acceptance", "train", "convert", "capture"}, COLLISIONS
    for command in subcommands():
        for inp in _role_arguments(command, "input"):
            if _role_arguments(command, "output"):
                assert inp.name in BASELINE[command] or inp.name in OPTIONAL_INPUTS, (
                    f"{command} {name_of(inp)}: no value"
                )


@pytest.mark.parametrize("command, out_dest, in_dest, how", COLLISIONS, ids=["-".join(c) for c in COLLISIONS])
def test_an_output_path_never_overwrites_an_input(command, out_dest, in_dest, how, files, capsys):
    (files / "counts.txt").write_text("5 3\n")
    (out_action,) = [a for a in value_arguments(subcommands()[command]) if a.name == out_dest]
    (in_action,) = [a for a in value_arguments(subcommands()[command]) if a.name == in_dest]
    in_text = _input_value(command, in_action, files)
    given = Path(in_text)
    out = {
        "same": given,
        "contains": given.parent,
        "inside": given / "x",
        "inside-dotdot": given / ".." / given.name / "x",
    }[how]
    drop = (EXCLUDES.get((command, in_dest)), EXCLUDES.get((command, out_dest)))
    argv = command_line(command, files, out_dest, str(out), drop=drop)
    if in_dest not in BASELINE[command]:
        argv += [option_strings(in_action)[0], in_text]
    before = {p: p.read_bytes() for p in files.rglob("*") if p.is_file() and not p.is_symlink()}
    code = main(argv)
    captured = capsys.readouterr()
    check_one_line(code, captured.err, captured.out, out_action)
    after = {p: p.read_bytes() for p in files.rglob("*") if p.is_file() and not p.is_symlink()}
    assert after == before  # nothing read was overwritten, nothing written


def test_prompts_file_is_never_overwritten_by_the_report(files, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    link = tmp_path / "hard.jsonl"
    link.hardlink_to(prompts)
    for out in (prompts, link, tmp_path / ".." / tmp_path.name / "p.jsonl"):
        argv = [
            "acceptance",
            "--target",
            str(files / "model"),
            "--draft",
            str(files / "model"),
            "--prompts",
            str(prompts),
            "--json",
            str(out),
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "argument --json" in err and "--prompts" in err and len(err.strip().splitlines()) == 1, err
    assert prompts.read_text() == '{"prompt": "hello"}\n'


@pytest.mark.parametrize("flag", ["--revision", "--draft-revision"])
def test_a_revision_with_a_local_folder_is_refused(flag, files, capsys):
    argv = command_line("acceptance", files) + [flag, "v9"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"argument {flag}" in err and "Hub" in err, err


def test_a_closed_pipe_is_quiet(tmp_path):
    """`eagle31-mla doctor --list-checks | head -1`: no 'Broken pipe' message, exit 0 or 141."""
    script = f"{sys.executable} -m eagle31_mla.cli doctor --list-checks | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stderr == "", result.stderr
    assert result.stdout.strip() in ("0", "141"), result.stdout


def test_an_exception_in_a_type_function_is_one_line(monkeypatch, capsys):
    import eagle31_mla.cli as cli

    group = cli.cli  # the command line is declared before Path.exists is broken
    monkeypatch.setattr(Path, "exists", lambda self: (_ for _ in ()).throw(OSError(36, "File name too long")))
    code = cli.main(["inspect", "/tmp/" + "x" * 300])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "argument PATH_OR_ID" in err and "File name too long" in err, err
    del group
