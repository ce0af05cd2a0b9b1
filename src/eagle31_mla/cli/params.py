"""The command line's parameter types (click's own, and the few the domain needs; no torch at import): a bad value is
refused while parsing, before any model is loaded. A path type's ``role`` ("input", "output"): for ``check_rules``."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import click

from ..decoding.limits import DRAFTING_LIMITS
from ..hub.convert import parse_size
from ..locations import is_hub_repo_id
from ..prompts import HUB_PREFIX, HUB_SPEC
from ..serving.engines import InputError, probe_output_folder
from ..serving.live import redacted_url
from .common import one_line, shown

Choice = click.Choice


class Float(click.FloatRange):
    """click.FloatRange, finite: click's range lets NaN through any bound, and inf through a missing one."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{shown(value)} is not a finite number.", param, ctx)
        return number


POSITIVE_INT = click.IntRange(min=1)
COUNT = click.IntRange(min=0)
SEED = click.IntRange(0, 2**63 - 1)
CONCURRENCY = click.IntRange(1, 1024)
NUM_STEPS = click.IntRange(1, DRAFTING_LIMITS["num_steps"])  # the reference loop's bounds (check_settings)
TOPK = click.IntRange(1, DRAFTING_LIMITS["topk"])
NUM_DRAFT_TOKENS = click.IntRange(1, DRAFTING_LIMITS["num_draft_tokens"])
MAX_NEW_TOKENS = click.IntRange(1, DRAFTING_LIMITS["max_new_tokens"])
POSITIVE_FLOAT = Float(min=0, min_open=True)
ACCEPT_LENGTH = Float(min=1)  # tokens per verification round, bonus included
TEMPERATURE = Float(min=0)  # 0 = greedy
TOP_P = Float(0, 1, min_open=True)  # 1 = no truncation


class Checked(click.ParamType):
    """A value ``accept`` says yes to, ``read`` into what the command gets; else "expected WHAT, got 'value'"."""

    name = "text"

    def __init__(
        self, expected: str, read: Callable | None = None, accept: Callable | None = None, role=None, show=None
    ):
        self.expected, self.read, self.accept, self.role, self.show = expected, read, accept, role, show or shown

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value  # a default given typed
        try:
            if self.accept is not None and not self.accept(value):
                raise ValueError
            return value if self.read is None else self.read(value)
        except Exception as err:  # noqa: BLE001 - whatever it is (a library's InputError, ...), the value is unusable
            reason = getattr(err, "strerror", None) or str(err)
        self.fail(
            f"expected {self.expected}, got {self.show(value)}" + f": {one_line(reason)}" * bool(reason), param, ctx
        )


def _re(pattern: str) -> Callable:
    return re.compile(pattern, re.ASCII | re.DOTALL).fullmatch


NONEMPTY = Checked("a non-empty value", accept=str.strip)
REPO_ID = Checked("a Hub repo id like org/name", accept=is_hub_repo_id)
VERSION = Checked("a release like 0.30 or 0.22.1", accept=_re(r"[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?"))
ENV_ASSIGNMENT = Checked("NAME=VALUE with NAME an environment variable name", accept=_re(r"[A-Za-z_][A-Za-z0-9_]*=.*"))
DEVICE = Checked("auto, cpu, cuda, cuda:N, mps or xpu:N", accept=_re(r"auto|cpu|mps|(cuda|xpu|npu|hpu)(:[0-9]+)?"))
# read as the engine's own parser reads it (serving.pd.parse_launch) once the engine is known
LAUNCH_COMMAND = Checked("an engine's launch command line, like 'vllm serve MODEL ...'", accept=str.strip)


def _layer_ids(minimum: int) -> Callable[[str], list[int]]:
    def read(text: str) -> list[int]:
        ids = [int(part) for part in text.split(",")]
        if min(ids) < minimum or ids != sorted(set(ids)):
            raise ValueError
        return ids

    return read


def _part(text: str) -> tuple[int, int]:
    i, n = map(int, text.split("/"))
    if not 1 <= i <= n <= 1024:
        raise ValueError
    return i, n


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _server_url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError
    parts.port  # noqa: B018 - ValueError for a port out of range
    return text.strip()


def _template(text: str) -> tuple[str, str]:
    from ..sweep import RAW, TARGET

    name, _, path = text.partition("=")
    if name.strip() in (TARGET, RAW):
        raise ValueError(f"{name.strip()!r} names a built-in rendering; choose another name")
    if not name.strip() or not Path(path).expanduser().is_file():
        raise ValueError
    return name.strip(), path


def _override(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if not _re(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")(key) or not value:
        raise ValueError
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare word: a string


ONE_BASED_IDS = Checked("comma-separated one-based layer ids, ascending, each >= 1 (e.g. 2,46,90)", _layer_ids(1))
LAYER_IDS = Checked("comma-separated layer ids in the target's convention, ascending (e.g. 2,46,90)", _layer_ids(0))
CONTEXT_LENGTHS = Checked("comma-separated token counts, ascending, each >= 1 (e.g. 1024,2048,4096)", _layer_ids(1))
TEMPLATE = Checked("NAME=FILE: a name for the rendering and a Jinja chat template file", _template)
CONFIG_OVERRIDE = Checked(
    "KEY=VALUE: a drafter config field (dotted inside a dict: rope_parameters.rope_theta) and a JSON value", _override
)
PART = Checked("I/N with 1 <= I <= N <= 1024: this process's part of N capture processes (e.g. 2/4)", _part)
ENGINE_ARGUMENTS = Checked("a JSON object of vLLM engine arguments, e.g. '{\"tensor_parallel_size\": 8}'", _json_object)
SIZE = Checked("a size like 10GB or 500MB (powers of ten) or a number of bytes, > 0", parse_size)
SERVER_URL = Checked(
    "an http:// or https:// URL of a running server, like http://127.0.0.1:8000",
    _server_url,
    show=lambda url: shown(redacted_url(url)),
)


def _model(file_ok: bool) -> Callable[[str], str]:
    """A model folder with config.json (or, with ``file_ok``, a config.json file), or else a Hub repo id."""

    def read(text: str) -> str:
        path = Path(text)
        if not text.strip() or not path.exists() and not is_hub_repo_id(text):
            raise ValueError("no such folder or file")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError("the folder has no config.json")
        if path.exists() and not path.is_dir() and not file_ok:
            raise ValueError("a file, not a folder")
        return text

    return read


MODEL = Checked("a model folder (with config.json) or a Hub repo id like org/name", _model(False), role="input")
CONFIG = Checked("a model folder, its config.json, or a Hub repo id like org/name", _model(True), role="input")


class RolePath(click.Path):
    """click.Path with a ``role`` (:func:`.common.check_rules`), then ``check``-ed (a ValueError or OSError refuses)."""

    def __init__(self, role: str, check: Callable[[str], None] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.role, self.check = role, check

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("expected a path, got ''", param, ctx)
        path = super().convert(value, param, ctx)
        try:
            if self.check is not None and path != "-":
                self.check(path)
        except (ValueError, OSError) as err:
            self.fail(one_line(err), param, ctx)
        return path


def _in_a_writable_folder(path: str) -> None:
    parent = Path(path).absolute().parent  # checked now, not after the measurement that writes it
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise ValueError(f"expected a file path in an existing, writable folder, got {shown(path)}")


def _creatable(path: str) -> None:
    """Probed by creating a folder there: os.access says yes to /proc and read-only mounts."""
    try:
        probe_output_folder(path, "probe")
    except InputError as err:
        raise ValueError(str(err).removeprefix("probe: ")) from None


EXISTING_FILE = RolePath("input", exists=True, dir_okay=False)


class PromptsPath(RolePath):
    """A prompts file, or ``hf:NAME[:CONFIG][@SPLIT]``: a prompt set read by the datasets library when it is used."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.startswith(HUB_PREFIX):
            if not HUB_SPEC.fullmatch(value):
                self.fail(f"expected hf:NAME[:CONFIG][@SPLIT], got {shown(value)}", param, ctx)
            return value
        return super().convert(value, param, ctx)


PROMPTS = PromptsPath("input", exists=True, dir_okay=False)
# its manifest is read by `train` first thing; `train --follow` may start before the capture makes it (checked there)
CAPTURE_FOLDER = RolePath("input", file_okay=False)
OUTPUT_FILE = RolePath("output", _in_a_writable_folder, dir_okay=False, writable=True, allow_dash=True)
OUTPUT_FOLDER = RolePath("output", _creatable, file_okay=False, writable=True)
