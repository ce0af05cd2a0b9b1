"""The command line's parameter types: click's own (IntRange, FloatRange, Path, Choice) where they do the job,
extended only by what click lacks, each extension said where it is made.

Every type declares what it expects (the words of its error: ``argument --flag: expected ..., got 'value'[:
reason]``), ``bad``: the classes of bad value it refuses (tests/cli/test_cli_corpus.py feeds one value of each
class to every parameter of every subcommand; a parameter whose type declares none fails that test), and
``role``: "input" (a path read) or "output" (a path written), for the rule that no output path is an input
path (:func:`.common.check_paths`). Bad values are refused while parsing, before any model is loaded. Light
at import: the library modules a check needs are imported when a value is checked, so ``--help`` loads no
torch.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import click

from ..locations import is_hub_repo_id
from .common import one_line, shown


class Refused(Exception):
    """A value a :class:`Checked` type refuses; ``reason``, if any, follows 'expected ..., got ...'."""

    def __init__(self, reason: str | None = None):
        super().__init__(reason)
        self.reason = reason


class Checked(click.ParamType):
    """Mixed in before a click type: ``check(text)`` refuses a value with :class:`Refused`; ``base(text)`` is
    the click type's own conversion and checks, its refusal made this CLI's. Any other exception a check
    raises (OSError for a name too long, a library's ValueError, ...) refuses the value too, with its reason."""

    bad: tuple[str, ...] = ()
    role: str | None = None

    def __init__(self, expected: str | None, bad: tuple[str, ...], role: str | None = None, **click_args):
        super().__init__(**click_args)
        if expected is not None:
            self.expected = expected
        self.bad, self.role = bad, role

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value  # a default given typed (click converts defaults too; argparse converted only strings)
        try:
            return self.check(value)
        except click.BadParameter:
            raise
        except Refused as refused:
            reason = refused.reason
        except Exception as err:  # noqa: BLE001 - whatever it is, the value is unusable
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        self.fail(
            f"expected {self.expected}, got {shown(value)}" + (f": {one_line(reason)}" if reason else ""), param, ctx
        )

    def check(self, text: str):
        return self.base(text)

    def base(self, text: str):
        try:
            return super().convert(text, None, None)
        except click.BadParameter as err:
            raise Refused(self.click_reason(err, text)) from None

    def click_reason(self, err: click.BadParameter, text: str) -> str | None:
        return None  # a number out of range: 'expected ..., got ...' says it all


# ---- numbers ----------------------------------------------------------------------------------------------

# numbers as people type them, in ASCII only: click's INT and FLOAT convert with int() and float(), which also
# take "1_0" and full-width digits
_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


class Int(Checked, click.IntRange):
    """click.IntRange, reading ASCII digits only."""

    def check(self, text: str) -> int:
        if not _INT.fullmatch(text.strip()):
            raise Refused
        return self.base(text.strip())


class Float(Checked, click.FloatRange):
    """click.FloatRange, reading ASCII digits only, and finite: '1e999' reads as inf, which click's range lets
    through without an upper bound (as it lets NaN through any bound: comparisons with NaN are false)."""

    def check(self, text: str) -> float:
        if not _FLOAT.fullmatch(text.strip()):
            raise Refused
        value = self.base(text.strip())
        if not math.isfinite(value):
            raise Refused
        return value


class DraftingLimit(Int):
    """A positive int up to the reference loop's own bound, speculative.DRAFTING_LIMITS[name], read when a
    value is checked (that module imports torch: ``--help`` must not)."""

    def __init__(self, name: str, what: str):
        super().__init__(None, BAD_BOUNDED, min=1)
        self.limit_name, self.what = name, what

    @property
    def limit(self) -> int:
        from ..decoding.speculative import DRAFTING_LIMITS

        return DRAFTING_LIMITS[self.limit_name]

    @property
    def expected(self) -> str:
        return f"a positive integer <= {self.limit:,} ({self.what})"

    def check(self, text: str) -> int:
        value = super().check(text)
        if value > self.limit:
            raise Refused
        return value


class Sampling(Float):
    """A sampling setting, by the library's one rule (check_sampling_settings, imported when a value is
    checked: it imports torch)."""

    def __init__(self, which: str, expected: str, bad: tuple[str, ...], **bounds):
        super().__init__(expected, bad, **bounds)
        self.which = which

    def check(self, text: str) -> float:
        value = super().check(text)
        from ..model.modeling_eagle31_mla import check_sampling_settings

        try:
            check_sampling_settings(value, 1.0) if self.which == "temperature" else check_sampling_settings(0.0, value)
        except ValueError:
            raise Refused from None
        return value


_NUMBER = ("negative", "nan", "inf", "text", "empty", "fullwidth", "underscore")
BAD_BOUNDED = ("zero", *_NUMBER, "fraction", "huge")

POSITIVE_INT = Int("a positive integer (>= 1)", ("zero", *_NUMBER, "fraction"), min=1)
COUNT = Int("an integer >= 0", (*_NUMBER, "fraction", "huge"), min=0, max=2**31, max_open=True)
SEED = Int("an integer in [0, 2**63)", (*_NUMBER, "fraction"), min=0, max=2**63, max_open=True)
CONCURRENCY = Int("an integer in [1, 1024] (requests in flight)", BAD_BOUNDED, min=1, max=1024)
NUM_STEPS = DraftingLimit("num_steps", "draft steps")
TOPK = DraftingLimit("topk", "draft branches")
NUM_DRAFT_TOKENS = DraftingLimit("num_draft_tokens", "tree size")
MAX_NEW_TOKENS = DraftingLimit("max_new_tokens", "new tokens")
POSITIVE_FLOAT = Float("a finite number > 0", ("zero", *_NUMBER), min=0, min_open=True)
ACCEPT_LENGTH = Float(
    "an accept length: a finite number >= 1 (tokens per verification round, bonus included)", ("zero", *_NUMBER), min=1
)
TEMPERATURE = Sampling("temperature", "a finite number >= 0 (0 = greedy)", _NUMBER, min=0)
TOP_P = Sampling(
    "top_p", "a probability in (0, 1] (1 = no truncation)", ("zero", *_NUMBER, "above_one"), min=0, max=1, min_open=True
)


# ---- text -------------------------------------------------------------------------------------------------


class Text(Checked):
    """A string ``accept`` says yes to (click has no pattern type)."""

    name = "text"

    def __init__(self, expected: str, bad: tuple[str, ...], accept: Callable[[str], object]):
        super().__init__(expected, bad)
        self.accept = accept

    def check(self, text: str) -> str:
        if not self.accept(text):
            raise Refused
        return text


NONEMPTY = Text("a non-empty value", ("empty",), lambda text: text.strip())
REPO_ID = Text("a Hub repo id like org/name", ("slashes", "empty"), is_hub_repo_id)
VERSION = Text(
    "a release like 0.30 or 0.22.1",
    ("negative", "nan", "text", "empty"),
    re.compile(r"[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?", re.ASCII).fullmatch,
)
ENV_ASSIGNMENT = Text(
    "NAME=VALUE with NAME an environment variable name",
    ("text", "empty"),
    re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.ASCII | re.DOTALL).fullmatch,
)
DEVICE = Text(
    "auto, cpu, cuda, cuda:N, mps or xpu:N",
    ("text", "negative", "empty"),
    re.compile(r"(auto|cpu|mps|(cuda|xpu|npu|hpu)(:[0-9]+)?)", re.ASCII).fullmatch,
)


class LayerIds(Checked):
    """Comma-separated ints, ascending, each >= ``minimum``."""

    name = "ids"

    def __init__(self, expected: str, bad: tuple[str, ...], minimum: int):
        super().__init__(expected, bad)
        self.minimum = minimum

    def check(self, text: str) -> list[int]:
        parts = [part.strip() for part in text.split(",")]
        if not all(_INT.fullmatch(part) for part in parts):
            raise Refused
        ids = [int(part) for part in parts]
        if not ids or min(ids) < self.minimum or ids != sorted(set(ids)):
            raise Refused
        return ids


ONE_BASED_IDS = LayerIds(
    "comma-separated ints: one-based layer ids, ascending, each >= 1 (e.g. 2,46,90)",
    ("zero", "negative", "nan", "text", "fraction", "empty", "fullwidth", "underscore"),
    1,
)
LAYER_IDS = LayerIds(
    "comma-separated ints: layer ids in the target's convention, ascending, each >= 0 (e.g. 2,46,90)",
    ("negative", "nan", "text", "fraction", "empty", "fullwidth", "underscore"),
    0,
)


class PartOf(Checked):
    """'I/N': one of N capture processes writing one spool."""

    name = "part"

    def check(self, text: str) -> tuple[int, int]:
        part, slash, parts = text.strip().partition("/")
        if not (slash and _INT.fullmatch(part) and _INT.fullmatch(parts)):
            raise Refused
        i, n = int(part), int(parts)
        if not 1 <= i <= n <= 1024:
            raise Refused
        return i, n


PART = PartOf(
    "I/N with 1 <= I <= N <= 1024: this process's part of N capture processes (e.g. 2/4)",
    ("zero", "negative", "text", "fraction", "empty", "fullwidth", "slashes"),
)


class EngineArguments(Checked):
    name = "json"

    def check(self, text: str) -> dict:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise Refused from None
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            raise Refused
        return value


class Size(Checked):
    name = "size"

    def check(self, text: str) -> int:
        from ..hub.convert import parse_size
        from ..serving.engines import InputError

        try:
            return parse_size(text)
        except InputError:
            raise Refused from None


class ServerUrl(Checked):
    name = "url"

    def check(self, text: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(text.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise Refused
        parts.port  # noqa: B018 - raises ValueError for a port out of range: a refusal
        return text.strip()


class LaunchCommand(Checked):
    """A serving engine's launch command line, as a shell would split it (read by :func:`..serving.pd.parse_launch`
    once the engine is known)."""

    name = "command"

    def check(self, text: str) -> str:
        import shlex

        from ..serving.pd import LAUNCHERS

        try:
            words = shlex.split(text)
        except ValueError as err:
            raise Refused(str(err)) from None
        launchers = {launcher for engine in LAUNCHERS.values() for launcher in engine}
        if not any(tuple(words[i : i + len(x)]) == x for x in launchers for i in range(len(words))):
            raise Refused
        return text


ENGINE_ARGUMENTS = EngineArguments(
    "a JSON object of vLLM engine arguments, e.g. '{\"tensor_parallel_size\": 8}'", ("text", "empty", "nan")
)
SIZE = Size(
    "a size like 10GB, 512MiB or a number of bytes (> 0)",
    ("zero", "negative", "nan", "inf", "text", "empty", "fullwidth", "underscore"),
)
LAUNCH_COMMAND = LaunchCommand(
    "an engine's launch command line, like 'vllm serve MODEL --speculative-config ... --kv-transfer-config ...' "
    "(or sglang serve / tokenspeed serve / python -m ...)",
    ("empty", "text"),
)
SERVER_URL = ServerUrl(
    "an http:// or https:// URL of a running server, like http://127.0.0.1:8000", ("empty", "text", "scheme", "nohost")
)


# ---- paths ------------------------------------------------------------------------------------------------


class _Path(Checked, click.Path):
    """click.Path, with '~' expanded (click leaves that to the shell, which does not expand it after '='),
    and its refusal's reason in this CLI's message ("File 'x' does not exist." -> "does not exist")."""

    def base(self, text: str):
        return super().base(os.path.expanduser(text))

    def click_reason(self, err: click.BadParameter, text: str) -> str:
        named = f"{self.name.title()} {click.format_filename(os.path.expanduser(text))!r} "
        return err.message.removeprefix(named).rstrip(".")


def _nameable(path: Path) -> None:
    """click.Path takes any failure of os.stat for 'does not exist' and then checks nothing more: a name the
    file system refuses outright (a symlink loop, a name too long) is refused here."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as err:
        raise Refused("a symlink loop" if err.errno == errno.ELOOP else err.strerror or str(err)) from None


def _writable_ancestor(path: Path) -> None:
    """The nearest existing ancestor of ``path`` must be a folder this process can write into."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise Refused(f"{parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Refused(f"{parent} is not writable")


class File(_Path):
    """click.Path, also non-empty and UTF-8 text: every file argument is read as text."""

    def check(self, text: str) -> str:
        import codecs

        self.base(text)
        path = Path(text).expanduser()
        if path.stat().st_size == 0:
            raise Refused("the file is empty")
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    decoder.decode(chunk)
                    offset += len(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise Refused(f"byte {err.object[err.start]:#04x} at offset {offset + err.start} is not UTF-8") from None
        except OSError as err:
            raise Refused(f"unreadable ({err.strerror or err})") from None
        return text


class ReferenceReport(File):
    """A File that is an offline `acceptance --json` report (serving.live.read_reference's rule)."""

    def check(self, text: str) -> str:
        from ..serving.live import read_reference

        super().check(text)
        read_reference(text)  # a LiveError (ValueError) is the refusal's reason
        return text


class OutputFile(_Path):
    """click.Path, also in an existing folder this process can write into."""

    def check(self, text: str) -> str:
        if text == "-":
            return text
        if not text.strip():
            raise Refused
        self.base(text)
        path = Path(text).expanduser()
        _nameable(path)
        if not path.absolute().parent.is_dir():
            raise Refused(f"{path.absolute().parent} is not a folder")
        _writable_ancestor(path)
        return text


class OutputFolder(_Path):
    """click.Path, also under a folder this process can write into, probed by creating a folder there (os.access
    says yes to /proc and read-only mounts)."""

    def check(self, text: str) -> str:
        from ..serving.engines import InputError, probe_output_folder

        if not text.strip():
            raise Refused
        self.base(text)
        path = Path(text).expanduser()
        _nameable(path)
        _writable_ancestor(path)
        try:
            probe_output_folder(path, "probe")
        except InputError as err:
            raise Refused(str(err).removeprefix("probe: ")) from None
        return text


class ModelRef(_Path):
    """click.Path (when it exists locally: a model folder with config.json), or else a Hub repo id."""

    def check(self, text: str) -> str:
        if not text.strip():
            raise Refused
        self.base(text)
        path = Path(text).expanduser()
        if path.exists():
            if path.is_dir() and not (path / "config.json").is_file():
                dangling = (path / "config.json").is_symlink()
                raise Refused(
                    "its config.json is a symlink to nothing (a dangling link)"
                    if dangling
                    else "the folder has no config.json"
                )
            return text
        if not is_hub_repo_id(text):
            raise Refused("no such folder or file")
        return text


class CaptureFolder(_Path):
    """click.Path, also holding a capture's manifest."""

    def check(self, text: str) -> str:
        from ..training.captured import MANIFEST
        from ..training.spool import is_spool

        if not text.strip():
            raise Refused
        self.base(text)
        folder = Path(text).expanduser()
        if not (folder / MANIFEST).is_file() and not is_spool(folder):
            raise Refused(f"no {MANIFEST} there, and not a spool (`capture --spool`)")
        return text


# click.Path's own checks, declared: exists, file_okay / dir_okay (a folder where a file is expected, or the
# reverse), readable, writable (an existing output), allow_dash ('-' for stdout)
EXISTING_FILE = File(
    "an existing, non-empty UTF-8 text file",
    ("missing", "folder", "empty_file", "empty", "binary", "toolong"),
    "input",
    exists=True,
    dir_okay=False,
)
REFERENCE_REPORT = ReferenceReport(
    "an offline `eagle31-mla acceptance --json` report (JSON with total.mean_accept_length)",
    ("missing", "folder", "empty_file", "empty", "binary", "toolong", "not_json"),
    "input",
    exists=True,
    dir_okay=False,
)
OUTPUT_FILE = OutputFile(
    "a file path in an existing, writable folder ('-' for stdout)",
    ("folder", "unwritable", "missing_parent", "empty", "toolong", "loop"),
    "output",
    dir_okay=False,
    writable=True,
    allow_dash=True,
)
OUTPUT_FOLDER = OutputFolder(
    "a folder path (new, or an existing folder) under a writable folder",
    ("file", "unwritable", "empty", "proc", "toolong", "loop"),
    "output",
    file_okay=False,
    writable=True,
)
MODEL = ModelRef(
    "a model folder (with config.json) or a Hub repo id like org/name",
    ("missing", "file", "empty", "toolong"),
    "input",
    file_okay=False,
)
CONFIG = ModelRef(
    "a model folder, its config.json, or a Hub repo id like org/name", ("missing", "empty", "toolong"), "input"
)
CAPTURE_FOLDER = CaptureFolder(
    "a folder `eagle31-mla capture` wrote (with manifest.json), or its spool (`capture --spool`)",
    ("missing", "file", "empty", "toolong"),
    "input",
    exists=True,
    file_okay=False,
)


# ---- choices ----------------------------------------------------------------------------------------------


class Choice(click.Choice):
    """click.Choice, refusing in argparse's words, "invalid choice: 'x' (choose from 'a', 'b')": click's own
    message ("'x' is not one of 'a', 'b'.") does not say that a choice was expected."""

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            choices = ", ".join(map(repr, self.choices))
            self.fail(f"invalid choice: {shown(value)} (choose from {choices})", param, ctx)
