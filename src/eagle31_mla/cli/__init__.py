"""The ``eagle31-mla`` command: parsing and printing, one click module per subcommand; the work is done by
eagle31_mla.hub, .serving, .training and .decoding. Heavy imports happen inside the subcommands (fast ``--help``).

Whatever goes wrong is one line on stderr, ``eagle31-mla: error: ...``, and an exit code (EXIT_CODES): click
parses with ``standalone_mode=False``, its refusals worded as argparse worded them; the subcommand runs outside click.
"""

from __future__ import annotations

import os
import sys

import click
from huggingface_hub.errors import StrictDataclassError

from . import acceptance, capture, convert, demo, doctor, inspect, roster, serve_command, train
from .common import EXIT_CODES, TRACEBACK_ENV, broken_pipe, error, name_of, shown


class Group(click.Group):
    """The subcommands, listed as declared; an unknown one refused in argparse's words."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and self.get_command(ctx, args[0]) is None and not args[0].startswith("-"):
            choices = ", ".join(map(repr, self.commands))
            raise click.UsageError(f"argument command: invalid choice: {shown(args[0])} (choose from {choices})", ctx)
        return super().resolve_command(ctx, args)


cli = Group(
    "eagle31-mla",
    help="The EAGLE-3.1 MLA drafter for Kimi-K3: demo, roster, acceptance, train, capture, inspect, convert, "
    "doctor, serve-command.",
    epilog=EXIT_CODES,
    subcommand_metavar="COMMAND [ARGS]...",
    context_settings={"help_option_names": ["-h", "--help"]},
    commands=[
        demo.demo,
        roster.roster,
        acceptance.acceptance,
        train.train,
        capture.capture,
        inspect.inspect,
        convert.convert,
        doctor.doctor,
        serve_command.serve_command,
    ],
)


def _usage(err: click.ClickException) -> str:
    """click's refusal of a command line, as argparse worded it."""
    if isinstance(err, click.exceptions.NoArgsIsHelpError):  # not the help text: one line
        return "the following arguments are required: command"
    if isinstance(err, click.MissingParameter) and err.param is not None:
        return f"the following arguments are required: {name_of(err.param)}"
    if isinstance(err, click.BadParameter) and err.param is not None:
        return f"argument {name_of(err.param)}: {err.message}"
    if isinstance(err, click.NoSuchOption):
        maybe = f" (did you mean {', '.join(err.possibilities)}?)" if err.possibilities else ""
        return f"unrecognized arguments: {err.option_name}{maybe}"
    return err.format_message()


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; set EAGLE31_MLA_TRACEBACK=1 to see the traceback of an unexpected failure."""
    from ..serving.engines import InputError

    try:
        parsed = cli.main(args=argv, prog_name="eagle31-mla", standalone_mode=False)
    except click.ClickException as err:
        return error(_usage(err), err.exit_code)
    except click.Abort:  # Ctrl-C while a value was checked
        print("eagle31-mla: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return broken_pipe()
    except SystemExit as exit:  # click still exits by itself on a closed pipe (status 1: `--help | head -1`)
        return broken_pipe() if exit.code == 1 else exit.code if isinstance(exit.code, int) else 0  # or completion
    if not callable(parsed):  # --help: click printed what was asked
        return parsed if isinstance(parsed, int) else 0
    try:
        return parsed()
    except BrokenPipeError:
        return broken_pipe()
    except KeyboardInterrupt:
        print(f"eagle31-mla {parsed.args[0].command}: interrupted", file=sys.stderr)
        return 130
    except (InputError, OSError, UnicodeDecodeError) as err:  # unreadable input
        return error(err if str(err) else type(err).__name__)
    except ValueError as err:  # a refused drafter (ConfigError, CheckpointError) or an unusable value
        refused = type(err).__name__ in ("ConfigError", "CheckpointError", "ConvertError")
        return error(err, 1 if refused else 2)
    except StrictDataclassError as err:  # a config field of the wrong type (huggingface_hub's strict check)
        return error(" ".join(str(err).split()), 1)
    except Exception as err:  # a bug, most likely: still one line, with the way to see more
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        return error(f"unexpected {type(err).__name__}: {err} (set {TRACEBACK_ENV}=1 for the traceback)", 1)
