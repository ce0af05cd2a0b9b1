"""What every subcommand shares: how a subcommand is declared (click, plus the two rules click has no
declaration for: options that exclude each other, and no output path being an input path), the one-line
error, the device choice and the quiet exit on a closed pipe. Standard library and click only: ``--help``
loads no torch."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from inspect import cleandoc
from pathlib import Path
from types import SimpleNamespace

import click
from click.core import ParameterSource

EXIT_CODES = """exit codes: 0 success (doctor: nothing is wrong); 1 problems found (doctor: misconfigurations;
inspect/convert: the drafter is refused; serve-command: the command cannot serve it right; acceptance
--expect/--reference: the measurement is not consistent with it); 2 usage error, unreadable input, or a
server that cannot be measured (unreachable, no speculative decoding); 130 interrupted (Ctrl-C)"""

#: Set to 1 to see the traceback of an unexpected failure (the CLI otherwise prints one line).
TRACEBACK_ENV = "EAGLE31_MLA_TRACEBACK"


def shown(text: str) -> str:
    """A value as quoted in a message: repr, cut to 120 characters."""
    text = str(text)
    quoted = repr(text)
    return quoted if len(quoted) <= 120 else f"{quoted[:100]}...' ({len(text)} characters)"


def one_line(message) -> str:
    """A message on one line: a multi-line library message (a list of problems) joined with '; '."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip()) or "failed"


def error(message, code: int = 2) -> int:
    print(f"eagle31-mla: error: {one_line(message)}", file=sys.stderr)
    return code


def name_of(param: click.Parameter) -> str:
    """How a message names a parameter, as argparse did: its option strings, or a positional's metavar."""
    if isinstance(param, click.Option):
        return "/".join(param.opts)
    return param.metavar or param.name


def flag_of(param: click.Parameter) -> str:
    return param.opts[0] if isinstance(param, click.Option) else name_of(param)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    backend = getattr(torch, kind, None)
    available = kind == "cpu" or bool(
        backend is not None and hasattr(backend, "is_available") and backend.is_available()
    )
    if available and index and hasattr(backend, "device_count") and int(index) >= backend.device_count():
        available = False
    if not available:
        raise ValueError(f"argument --device: {name} is not available on this machine")
    return name


def broken_pipe() -> int:
    """The reader of stdout went away (``| head``): no message, exit 141 (128 + SIGPIPE) as a shell tool
    does; stdout is pointed at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return 141


# ---- declaring a subcommand ------------------------------------------------------------------------------


class Option(click.Option):
    """click.Option whose metavar defaults to the name in capitals (``--seed SEED``), as argparse showed it,
    rather than the type's name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.metavar is None and not self.is_flag and not isinstance(self.type, click.Choice):
            self.metavar = self.name.upper()


def option(*decls: str, **attrs):
    return click.option(*decls, cls=Option, **attrs)


argument = click.argument


@dataclass(frozen=True)
class OneOf:
    """Options of which at most one may be given (argparse's mutually exclusive group); with ``required``,
    exactly one."""

    names: tuple[str, ...]
    required: bool = False


@dataclass(frozen=True)
class Invocation:
    """A parsed command line: the subcommand's body and its arguments. ``main`` runs it outside click, so
    that Ctrl-C and a closed pipe in the body get this CLI's handling (exit 130 / 141), not click's."""

    run: Callable[[SimpleNamespace], int]
    args: SimpleNamespace

    def __call__(self) -> int:
        return self.run(self.args)


class Command(click.Command):
    """A subcommand: click parses and checks each value (the types of :mod:`.params`), then the rules
    between values that click has no declaration for, before any work: :class:`OneOf` groups, and
    :func:`check_paths`."""

    def __init__(self, *args, one_of: tuple[OneOf, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.one_of = tuple(one_of)
        self.context_settings.setdefault("allow_extra_args", True)  # refused below, in argparse's words

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        if rest:
            raise click.UsageError(f"unrecognized arguments: {' '.join(rest)}", ctx)
        check_one_of(self, ctx)
        check_paths(self, ctx)
        return rest


def subcommand(name: str, summary: str, *, one_of: tuple[OneOf, ...] = ()):
    """Declare ``run(args) -> int`` (its options given with :func:`option` / :func:`argument`, its
    docstring the description) as the subcommand ``name``; parsing returns an :class:`Invocation`."""

    def declare(run: Callable[[SimpleNamespace], int]) -> Command:
        def parsed(**values) -> Invocation:
            return Invocation(run, SimpleNamespace(command=name, **values))

        parsed.__click_params__ = getattr(run, "__click_params__", [])
        return click.command(
            name, cls=Command, help=cleandoc(run.__doc__ or ""), short_help=summary, epilog=EXIT_CODES, one_of=one_of
        )(parsed)

    return declare


def check_one_of(command: Command, ctx: click.Context) -> None:
    """argparse's messages: 'argument --b: not allowed with argument --a' (the later one named first, in the
    order given), 'one of the arguments --a --b is required'."""
    params = {p.name: p for p in command.params}
    for group in command.one_of:
        # ctx.params holds the values given on the command line in the order given (click processes them so)
        given = [
            n for n in ctx.params if n in group.names and ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE
        ]
        if len(given) > 1:
            raise click.BadParameter(f"not allowed with argument {name_of(params[given[0]])}", ctx, params[given[1]])
        if group.required and not given:
            flags = " ".join(name_of(params[n]) for n in group.names)
            raise click.UsageError(f"one of the arguments {flags} is required", ctx)


def check_paths(command: Command, ctx: click.Context) -> None:
    """No output path (--json, --out, DST) may be, contain or lie inside an input path (--prompts, --text,
    --token-counts, --target / --draft folders, SRC): compared resolved (links and '..' followed) and by
    inode (hard links), before any work. A parameter's role is its type's ``role``."""
    paths: dict[str, list[tuple[click.Parameter, str]]] = {"input": [], "output": []}
    for param in command.params:
        role, value = getattr(param.type, "role", None), ctx.params.get(param.name)
        if role not in paths or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str) and item != "-":
                paths[role].append((param, item))
    for out_param, out_text in paths["output"]:
        try:
            out = Path(out_text).expanduser().resolve()
        except (OSError, RuntimeError):
            continue  # the type refused it already
        for in_param, in_text in paths["input"]:
            try:
                given = Path(in_text).expanduser()
                if not given.exists():
                    continue  # a Hub id: nothing local to overwrite
                inp = given.resolve()
                same = out == inp or (out.exists() and os.path.samefile(out, inp))
            except (OSError, RuntimeError):
                continue
            how = (
                "is the same file as"
                if same
                else "contains"
                if out in inp.parents
                else "is inside"
                if inp in out.parents
                else None
            )
            if how:
                raise click.BadParameter(
                    f"expected a path apart from the inputs, got {shown(out_text)}: "
                    f"it {how} {flag_of(in_param)} {shown(in_text)}, which it would overwrite",
                    ctx,
                    out_param,
                )
