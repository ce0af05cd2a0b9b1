"""What every subcommand shares: how it is declared (click, plus the two rules click has no declaration for),
the one-line error, the device choice, the quiet exit on a closed pipe. No torch at import (``--help``)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from inspect import cleandoc
from pathlib import Path
from types import SimpleNamespace

import click

EXIT_CODES = """exit codes: 0 success (doctor: nothing is wrong); 1 problems found (doctor: misconfigurations;
inspect/convert: the drafter is refused; serve-command: the command cannot serve it right; acceptance
--expect/--reference: the measurement is not consistent with it); 2 usage error, unreadable input, or a
server that cannot be measured (unreachable, no speculative decoding); 130 interrupted (Ctrl-C)"""

#: Set to 1 to see the traceback of an unexpected failure (the CLI otherwise prints one line).
TRACEBACK_ENV = "EAGLE31_MLA_TRACEBACK"


def shown(text) -> str:
    """A value as quoted in a message: repr, cut to 120 characters."""
    quoted = repr(str(text))
    return quoted if len(quoted) <= 120 else f"{quoted[:100]}...' ({len(str(text))} characters)"


def one_line(message) -> str:
    """A message on one line: a multi-line library message (a list of problems) joined with '; '."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip()) or "failed"


def error(message, code: int = 2) -> int:
    print(f"eagle31-mla: error: {one_line(message)}", file=sys.stderr)
    return code


def name_of(param: click.Parameter) -> str:
    """How a message names a parameter, as argparse did: its option strings, or a positional's metavar."""
    return "/".join(param.opts) if isinstance(param, click.Option) else param.metavar or param.name


def resolve_device(name: str) -> str:
    """``name`` (params.DEVICE), if torch can place a tensor there; "auto": cuda when available, else cpu."""
    import torch

    name = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    try:
        torch.empty(0, device=name)
    except Exception:  # noqa: BLE001 - RuntimeError, AssertionError (not compiled with it), ...
        raise ValueError(f"argument --device: {name} is not available on this machine") from None
    return name


def broken_pipe() -> int:
    """The reader of stdout went away (``| head``): no message, exit 141 (128 + SIGPIPE), stdout to /dev/null."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


class Option(click.Option):
    """click.Option whose metavar is the name in capitals (``--seed SEED``), not the type's name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.metavar is None and not self.is_flag and not isinstance(self.type, click.Choice):
            self.metavar = self.name.upper()


def option(*decls: str, **attrs):
    return click.option(*decls, cls=Option, **attrs)


argument = click.argument


@dataclass(frozen=True)
class OneOf:
    """Options of which at most one may be given; with ``required``, exactly one."""

    names: tuple[str, ...]
    required: bool = False


def subcommand(name: str, summary: str, *, one_of: tuple[OneOf, ...] = (), needs: tuple[tuple[str, str], ...] = ()):
    """Declare ``run(args) -> int`` as subcommand ``name``: parsing returns ``run`` bound to checked values;
    ``needs``: (option, the option without which it means nothing)."""

    def declare(run: Callable[[SimpleNamespace], int]) -> click.Command:
        def parsed(**values) -> partial:
            check_rules(click.get_current_context(), one_of, needs)
            return partial(run, SimpleNamespace(command=name, **values))

        parsed.__click_params__ = getattr(run, "__click_params__", [])
        return click.command(name, help=cleandoc(run.__doc__ or ""), short_help=summary, epilog=EXIT_CODES)(parsed)

    return declare


def check_rules(ctx: click.Context, one_of: tuple[OneOf, ...], needs: tuple[tuple[str, str], ...] = ()) -> None:
    """The ``one_of`` groups, in argparse's words; and no output path (by its type's ``role``: --json, --out, DST)
    may be, contain or lie inside an input path (--prompts, --target, SRC, ...), resolved (links, '..'), by inode."""
    params = {p.name: p for p in ctx.command.params}
    for group in one_of:  # ctx.params: the values given, in the order given, then the defaults (None)
        given = [n for n in ctx.params if n in group.names and ctx.params[n] is not None]
        if len(given) > 1:
            raise click.BadParameter(f"not allowed with argument {name_of(params[given[0]])}", ctx, params[given[1]])
        if group.required and not given:
            flags = " ".join(name_of(params[n]) for n in group.names)
            raise click.UsageError(f"one of the arguments {flags} is required", ctx)
    for option, needed in needs:
        if ctx.params[option] not in (None, False, ()) and ctx.params[needed] in (None, False, ()):
            raise click.BadParameter(f"applies to {name_of(params[needed])} only", ctx, params[option])
    paths = [(getattr(params[n].type, "role", None), params[n], v) for n, v in ctx.params.items() if v != "-"]
    for out_param, out_text in [(p, v) for role, p, v in paths if role == "output" and v is not None]:
        for in_param, in_text in [(p, v) for role, p, v in paths if role == "input" and v and Path(v).exists()]:
            try:  # an input that does not exist is a Hub id: nothing local to overwrite
                out, inp = Path(out_text).resolve(), Path(in_text).resolve()
                same = out == inp or (out.exists() and os.path.samefile(out, inp))
            except (OSError, RuntimeError):
                continue  # a path its type refused, or the library will (a symlink loop)
            if same or out in inp.parents or inp in out.parents:
                how = "is the same file as" if same else "contains" if out in inp.parents else "is inside"
                message = f"{shown(out_text)} {how} {name_of(in_param)} {shown(in_text)}, which it would overwrite"
                raise click.BadParameter(f"expected a path apart from the inputs: {message}", ctx, out_param)
