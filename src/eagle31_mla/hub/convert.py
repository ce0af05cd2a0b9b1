"""``eagle31-mla convert``: any drafter checkpoint the library loads -> a Hub-ready folder.

Sources: the published layout, the training framework's (``midlayer.*``, nested zero-based ids),
NeMo's (``model.`` prefix), EAGLE-3 checkpoints (no ``fc_norm``), pruned vocabularies (``d2t``). The
source is checked by the library's own loader rules (:func:`validate_checkpoint`, headers only)
before anything is written. The folder gets:

* safetensors with the published tensor names (:func:`canonical_tensor_name`); one
  ``model.safetensors``, or shards plus ``model.safetensors.index.json`` above ``max_shard_size``;
* ``config.json`` in the library's written form (:meth:`Eagle31MLAConfig.to_dict`: one-based aux ids
  at the top level and in ``eagle_config``, labelled; ``Eagle3DeepseekV2ForCausalLM``) plus ``auto_map``;
* the remote-code files (:data:`~eagle31_mla.model.configuration_eagle31_mla.REMOTE_CODE_FILES`), copied from this
  installed package;
* ``README.md``, a model card with the serving commands (:mod:`eagle31_mla.serving.command`).

Optionally the vocabulary is pruned to the N most frequent target tokens of a token-count file
(:func:`read_token_counts`): ``d2t`` (int64 offsets, target = draft + d2t[draft]), ``t2d`` (bool
over the target vocabulary) and the matching ``lm_head`` rows are written.

Streaming: each shard's header is computed from the source headers first; then every tensor is
copied in chunks of at most ``CHUNK_BYTES`` (cast or row-selected on the way), read with plain file
reads (no memory map, whose pages would stay resident) and written straight into the open shard. So
memory holds one chunk, never a tensor, let alone a second copy of the model (the 6 GB Kimi-K3
drafter converts in well under 1 GB of RSS). Output is deterministic: fixed tensor order, no
timestamps, sorted JSON keys; converting twice gives byte-identical folders.

Safety: nothing is written into the destination itself; the new folder is built beside it and swapped
in whole at the end (see "the destination" below), so a convert stopped at any moment -- an error,
Ctrl-C, SIGKILL -- leaves the destination as it was or complete and new, and ``--force`` replaces only
the files an earlier convert listed in its manifest.
"""

from __future__ import annotations

import errno
import functools
import glob
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..prompts import eos_token_ids
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from ..serving.engines import KIMI_K3_TARGET, InputError

__all__ = [
    "convert",
    "ConvertError",
    "ConvertResult",
    "parse_size",
    "read_token_counts",
    "choose_vocabulary",
    "DEFAULT_MAX_SHARD_SIZE",
]

logger = logging.getLogger(__name__)

#: Shard above 10 GB: the 6.03 GB Kimi-K3 drafter stays one ``model.safetensors``, as published.
DEFAULT_MAX_SHARD_SIZE = 10 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ConvertError(ValueError):
    """The source is not a drafter checkpoint the library accepts (the message lists every problem)."""


@dataclass
class ConvertResult:
    folder: Path
    files: list[str]
    num_tensors: int
    total_bytes: int
    source_layout: str
    vocab_size: int
    draft_vocab_size: int
    notes: list[str] = field(default_factory=list)


# ---- inputs ----------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes from "5GB" (10⁹), "512MiB" (2²⁰), or a plain number of bytes."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise InputError(f"cannot read a size from {text!r} (e.g. 5GB, 512MiB, 1000000)")
        value = int(float(match[1]) * _UNITS[(match[2] or "B").lower()])
    if value <= 0:
        raise InputError(f"a shard size must be positive, got {text!r}")
    return value


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def read_token_counts(path: str | Path) -> dict[int, int]:
    """Token frequencies over the TARGET vocabulary, from either

    * a JSON file: an object ``{"token_id": count, ...}`` or a list whose index is the token id; or
    * a text file: one ``token_id count`` pair per line (whitespace-separated; ``#`` starts a comment).

    Counts must be non-negative integers; a token listed twice in a text file has its counts added.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read token counts from {path} ({err})") from None
    counts: dict[int, int] = {}
    canonical = re.compile(r"0|[1-9][0-9]*", re.ASCII)  # a token id as written: no sign, no leading zero, ASCII

    def put(token, count, where: str, *, add: bool = True) -> None:
        if isinstance(token, str):
            if not canonical.fullmatch(token.strip()):
                raise InputError(
                    f"{path}: {where}: expected a token id written as a non-negative integer "
                    f"(no sign, no leading zero), got {token!r}"
                )
            token = int(token.strip())
        if isinstance(count, str):  # text lines: the count as written
            if not canonical.fullmatch(count.strip()):
                raise InputError(f"{path}: {where}: expected a count written as a non-negative integer, got {count!r}")
            count = int(count.strip())
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InputError(f"{path}: {where}: expected a non-negative integer token id, got {token!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InputError(f"{path}: {where}: expected a finite non-negative integer count, got {count!r}")
        if not add and token in counts:
            raise InputError(f"{path}: {where}: token id {token} is listed twice; expected each id once")
        counts[token] = counts.get(token, 0) + count

    def no_duplicate_keys(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise InputError(f"{path}: key {key!r} appears twice; expected each token id once")
            seen[key] = value
        return seen

    def no_constants(name):
        raise InputError(f"{path}: {name} is not a count; expected finite non-negative integer counts")

    def finite_float(text):
        value = float(text)
        if not math.isfinite(value):
            raise InputError(f"{path}: {text} overflows; expected finite non-negative integer counts")
        return value

    if path.suffix == ".json":
        try:
            data = json.loads(
                text, object_pairs_hook=no_duplicate_keys, parse_constant=no_constants, parse_float=finite_float
            )
        except (json.JSONDecodeError, RecursionError) as err:
            raise InputError(f"{path}: not valid JSON ({_first_line(err)})") from None
        if isinstance(data, dict):
            for token, count in data.items():
                put(token, count, f"key {token!r}", add=False)
        elif isinstance(data, list):
            for token, count in enumerate(data):
                put(token, count, f"index {token}", add=False)
        else:
            raise InputError(f"{path}: expected a JSON object {{token_id: count}} or a list of counts")
    else:
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2:
                raise InputError(f"{path}:{number}: expected 'token_id count', got {line.strip()!r}")
            put(fields[0], fields[1], f"line {number}")
    return counts


def choose_vocabulary(
    counts: Mapping[int, int], size: int, candidates: Sequence[int], always: Iterable[int] = ()
) -> tuple[list[int], list[str]]:
    """The ``size`` target ids to keep, ascending: ``always`` (special tokens) first, then the most
    frequent candidates (ties: smaller id). Returns the ids and notes about anything unusual."""
    available = set(candidates)
    notes = []
    keep = set()
    for token in always:
        if token in available:
            keep.add(token)
        else:
            notes.append(f"special token {token} is not in the source's vocabulary; not kept")
    if size < len(keep):
        raise InputError(f"--prune-vocab {size} is smaller than the {len(keep)} special tokens that are always kept")
    if size > len(available):
        raise InputError(f"--prune-vocab {size} exceeds the source's {len(available)} draft tokens")
    unknown = sorted(t for t in counts if t not in available)
    if unknown:
        notes.append(
            f"{len(unknown)} counted token id(s) are not in the source's vocabulary and were ignored "
            f"(first: {unknown[:5]})"
        )
    ranked = sorted((t for t in available if t not in keep), key=lambda t: (-counts.get(t, 0), t))
    chosen = ranked[: size - len(keep)]
    unseen = sum(1 for t in chosen if counts.get(t, 0) == 0)
    if unseen:
        notes.append(f"{unseen} of the kept tokens never occur in the counts (filled in ascending id order)")
    return sorted(keep | set(chosen)), notes


# ---- safetensors, written as a stream -------------------------------------------------------------------


#: Bytes read (and written) at a time: memory stays bounded by this, whatever the tensor sizes.
CHUNK_BYTES = 64 * 2**20


@dataclass
class _Planned:
    """One output tensor: its header entry, and the byte chunks that make it, produced when its turn comes."""

    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[Any]]  # buffers, in order
    source_dtype: Any = None  # torch.dtype of the source tensor (None: made here)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _data_offsets(file: Path) -> dict[str, tuple[int, int]]:
    """name -> (start, end) of each tensor's bytes in a safetensors file (already validated by safetensors)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    return {
        name: (base + v["data_offsets"][0], base + v["data_offsets"][1])
        for name, v in header.items()
        if name != "__metadata__"
    }


def _read_bytes(f, start: int, length: int) -> bytes:
    """The one place tensor data is read (so a test can watch every read): ``length`` bytes at ``start``."""
    f.seek(start)
    data = f.read(length)
    if len(data) != length:
        raise ConvertError(f"{f.name} is truncated: {length} bytes expected at offset {start}")
    return data


def _cast(data: bytes, src, out):
    """A chunk of ``src`` elements as ``out`` (the bytes themselves when the dtype does not change)."""
    import torch

    if src == out:
        return data
    return torch.frombuffer(bytearray(data), dtype=src).to(out).view(torch.uint8).numpy()


def _ranges(start: int, length: int, step: int) -> Iterator[tuple[int, int]]:
    for offset in range(0, length, step):
        yield start + offset, min(step, length - offset)


def _row_ranges(start: int, row_bytes: int, rows: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Byte ranges of the given rows, in order: consecutive rows merged, at most CHUNK_BYTES each."""
    per_chunk = max(1, CHUNK_BYTES // row_bytes)
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and j - i < per_chunk and rows[j] == rows[j - 1] + 1:
            j += 1
        yield start + rows[i] * row_bytes, (j - i) * row_bytes
        i = j


def _write_safetensors(path: Path, planned: list[_Planned], st_names: Mapping[Any, str], advance) -> None:
    """A safetensors file written front to back: the header from the plan, then each tensor's chunks."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in planned:
        header[p.name] = {
            "dtype": st_names[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p in planned:
            written = 0
            for chunk in p.chunks():
                written += f.write(chunk)
                advance(len(chunk) if isinstance(chunk, bytes) else chunk.nbytes)
            if written != p.nbytes:
                raise AssertionError(f"{p.name}: wrote {written} bytes, planned {p.nbytes}")


def _shards(planned: list[_Planned], max_shard_size: int) -> list[list[_Planned]]:
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


# ---- the conversion --------------------------------------------------------------------------------------


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


# ---- the destination: written beside it, swapped in whole ------------------------------------------------
#
# Nothing is written into DST itself. The new folder is built in a temporary sibling
# (``.<DST>.eagle31-convert-new-<pid>-<token>``, with a MARKER file naming its writer and the files it plans)
# and moved into place at the end in one step: a rename when DST does not exist, an atomic exchange of the
# two folders (Linux ``renameat2(RENAME_EXCHANGE)``) when it does. So a convert killed at any moment, even
# by SIGKILL, leaves DST as it was or complete and new; a leftover temporary folder has a hidden name and no
# config.json until its last step, so nothing loads it by mistake, and the next convert into the same DST
# removes it (only its own: the MARKER must name a dead process, and only files it lists, or hard links of
# files still in DST, are deleted). ``MANIFEST`` in DST lists the files convert wrote: ``--force`` replaces
# those; anything else in DST (a user's notes, another *.safetensors, .git) is carried into the new folder
# as hard links and kept.

#: In a converted folder: the files convert wrote there (what a later ``--force`` may replace).
MANIFEST = ".eagle31-convert-manifest.json"
#: In a temporary folder: who is writing it (pid, host) and the files it plans.
MARKER = ".eagle31-convert-partial.json"
_MARKER_TMP = MARKER + ".tmp"  # the marker before its atomic rename
_TMP = ".eagle31-convert-"
_WRITER = "eagle31-mla convert"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _listed(folder: Path) -> set[str]:
    """The names convert wrote in ``folder`` (its manifest, its marker), plus those two files."""
    names: set[str] = set()
    for file in (MANIFEST, MARKER):
        data = _read_json(folder / file)
        if isinstance(data, dict) and data.get("written_by") == _WRITER and isinstance(data.get("files"), list):
            names |= {n for n in data["files"] if isinstance(n, str) and n and "/" not in n and n not in (".", "..")}
            names.add(file)
    return names


def _same_tree(a: Path, b: Path) -> bool:
    """``a`` is a hard-linked copy of ``b`` (same inodes; symlinks with the same target)."""
    try:
        if a.is_symlink() or b.is_symlink():
            return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
        if a.is_dir():
            return b.is_dir() and all(_same_tree(entry, b / entry.name) for entry in a.iterdir())
        return a.is_file() and b.is_file() and os.path.samefile(a, b)
    except OSError:
        return False


def _remove_ours(folder: Path, dst: Path) -> list[str]:
    """Delete what convert wrote in ``folder`` (listed in its manifest or marker) and hard-linked copies of
    what is in ``dst``; then the folder, if empty. Returns the names kept (anything else)."""
    ours = _listed(folder)
    kept = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name in (MANIFEST, MARKER)):  # the lists go last
        if entry.name in ours and entry.is_file() and not entry.is_symlink():
            entry.unlink()
        elif _same_tree(entry, dst / entry.name):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        else:
            kept.append(entry.name)
    if not kept:
        folder.rmdir()
    return kept


def _alive(marker: Any) -> bool:
    """Whether the convert that wrote ``marker`` may still be running (then its folder is left alone)."""
    if (
        not isinstance(marker, dict)
        or not isinstance(marker.get("pid"), int)
        or marker.get("host") != socket.gethostname()
    ):
        return True  # not ours to judge
    if marker["pid"] == os.getpid():
        return False
    try:
        os.kill(marker["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _swap_record(old: Path) -> Path:
    """The record convert writes beside DST before a non-atomic swap, naming the ``old`` folder it makes."""
    return old.with_name(old.name.replace(f"{_TMP}old-", f"{_TMP}swap-", 1) + ".json")


def _interrupted_at_start(folder: Path, dst: Path) -> bool:
    """A temporary folder whose convert was killed between creating it and renaming its marker into place:
    named ``.<DST>.eagle31-convert-new-<pid>-<token>`` for a process no longer running here, and holding
    nothing but (at most) the marker's own temporary file, so removing it cannot lose anyone's data."""
    pid, _, token = folder.name.removeprefix(f".{dst.name}{_TMP}new-").partition("-")
    if not (pid.isdigit() and pid.isascii() and len(token) == 8 and all(c in "0123456789abcdef" for c in token)):
        return False
    if _alive({"pid": int(pid), "host": socket.gethostname()}):
        return False
    entries = list(folder.iterdir())
    return all(e.name == _MARKER_TMP and e.is_file() and not e.is_symlink() for e in entries)


def _clean_leftovers(dst: Path) -> list[str]:
    """Finish what an interrupted convert into ``dst`` left beside it; returns notes on what was done."""
    notes = []
    if not dst.parent.is_dir():
        return notes
    for leftover in sorted(dst.parent.glob(f".{glob.escape(dst.name)}{_TMP}*")):
        if not leftover.is_dir() or leftover.is_symlink():
            continue
        if leftover.name.startswith(f".{dst.name}{_TMP}old-"):
            # the DST of an interrupted non-atomic swap (filesystems without renameat2): restore it if
            # the new folder never arrived; remove it (its files are in DST) if it did. Only with the swap
            # record convert wrote beside it (its pid and host, this old folder and its new one): a folder
            # is never renamed or deleted by its name alone.
            record_path = _swap_record(leftover)
            record = _read_json(record_path)
            if not (
                isinstance(record, dict)
                and record.get("written_by") == _WRITER
                and record.get("old") == leftover.name
                and record.get("dst") == dst.name
                and isinstance(record.get("new"), str)
                and record.get("host") == socket.gethostname()
                and isinstance(record.get("pid"), int)
            ):
                continue  # not provably convert's: leave it alone
            if _alive(record):
                continue  # that convert is still swapping
            if not dst.exists():
                os.rename(leftover, dst)
                record_path.unlink(missing_ok=True)
                notes.append(f"restored {dst} from an interrupted conversion ({leftover.name})")
                continue
            kept = _remove_ours(leftover, dst)
            if not kept:
                record_path.unlink(missing_ok=True)
            notes.append(
                f"removed the leftovers of an interrupted conversion ({leftover.name})"
                + (f"; kept {leftover} for {', '.join(kept)}, which convert did not write" if kept else "")
            )
            continue
        elif _interrupted_at_start(leftover, dst):
            for entry in leftover.iterdir():  # at most the unfinished marker: nothing else was written yet
                entry.unlink()
            leftover.rmdir()
            notes.append(f"removed the empty folder of a conversion interrupted as it started ({leftover.name})")
            continue
        elif not _listed(leftover):
            continue  # no marker or manifest by convert: not provably its own, left alone
        elif (leftover / MARKER).is_file() and _alive(_read_json(leftover / MARKER)):
            continue  # another convert is writing it
        # without a marker: finished (its last step removes the marker) and never swapped in, or the old
        # DST after a swap; either way _remove_ours deletes only listed files and hard links of DST's
        kept = _remove_ours(leftover, dst)
        notes.append(
            f"removed the leftovers of an interrupted conversion ({leftover.name})"
            + (f"; kept {leftover} for {', '.join(kept)}, which convert did not write" if kept else "")
        )
    return notes


def _check_destination(dst: Path, src: Path, force: bool, outputs: Sequence[str]) -> list[str]:
    """Refuse a DST convert cannot write without losing data; return the entries of DST to keep."""
    if dst.exists() and dst.resolve() == src.resolve():
        raise InputError(f"the destination {dst} is the source folder; convert into a new folder")
    if dst.exists() and not dst.is_dir():
        raise InputError(f"the destination {dst} is a file")
    if not dst.exists():
        return []
    entries = sorted(p.name for p in dst.iterdir())
    if not entries:
        return []
    if not force:
        raise InputError(
            f"the destination {dst} is not empty; pass --force to replace what an earlier convert wrote there"
        )
    ours = _listed(dst) - {MARKER}
    foreign = [
        name for name in entries if name not in ours and _TMP not in name
    ]  # never carry a temp folder into itself
    clash = sorted(set(foreign) & {*outputs, MANIFEST, MARKER})
    if clash:
        raise InputError(
            f"the destination {dst} holds {', '.join(clash)}, which convert would write but did not "
            f"write there (no {MANIFEST} lists them); move them away or convert into a new folder"
        )
    return foreign


def _link_tree(src: Path, dst: Path) -> None:
    """``dst``: a copy of ``src`` made of hard links (same files, no data copied)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        dst.mkdir()
        for entry in src.iterdir():
            _link_tree(entry, dst / entry.name)
    elif src.is_file():
        os.link(src, dst)
    else:
        raise InputError(f"{src} is neither a file, a folder nor a link; move it out of the destination first")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


@contextmanager
def _sigint_deferred():
    """Ctrl-C waits until the block is done (the swap must not stop half way); then it is dropped, since
    the conversion has finished."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _commit(tmp: Path, dst: Path) -> list[str]:
    """Put the finished ``tmp`` at ``dst`` in one step; returns notes."""
    with _sigint_deferred():
        if not dst.exists():
            os.rename(tmp, dst)
            return []
        if _exchange(tmp, dst):  # tmp now holds the old DST
            kept = _remove_ours(tmp, dst)
        else:  # two renames; an interruption between them is repaired by the next convert (_clean_leftovers)
            old = tmp.with_name(tmp.name.replace(f"{_TMP}new-", f"{_TMP}old-"))
            record = _swap_record(old)
            record.write_bytes(
                _json_bytes(
                    {
                        "written_by": _WRITER,
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "dst": dst.name,
                        "old": old.name,
                        "new": tmp.name,
                    }
                )
            )
            _fsync(record)
            _fsync(dst.parent)
            os.rename(dst, old)
            os.rename(tmp, dst)
            kept, tmp = _remove_ours(old, dst), old
            if not kept:
                record.unlink(missing_ok=True)
    return [f"kept {tmp}: it holds {', '.join(kept)}, which appeared in {dst} during the conversion"] if kept else []


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)


def _source_layout(layout: str, config) -> str:
    """The source in words: EAGLE-3 or 3.1, how its tensors are named (``layout``), its vocabulary."""
    kind = (
        "EAGLE-3.1"
        if config.is_eagle31
        else "EAGLE-3"
        if not (config.fc_norm or config.norm_output)
        else "EAGLE-3 + fc_norm/norm_output"
    )
    vocab = (
        f", pruned vocabulary {config.draft_vocab_size}/{config.vocab_size}"
        if config.draft_vocab_size != config.vocab_size
        else ""
    )
    return f"{kind}, {layout}{vocab}"


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    prune_vocab: int | None = None,
    token_counts: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
    repo_id: str | None = None,
    target_name: str = KIMI_K3_TARGET.name,
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Convert the drafter at ``src`` (folder or Hub id) into a Hub-ready folder ``dst``.

    Every input (arguments, token counts, the source, the model card's inputs, what ``dst`` holds) is
    checked before anything is written; the folder is built beside ``dst`` and swapped in whole, so an
    error or an interruption leaves ``dst`` as it was. ``force``: replace what an earlier convert wrote
    in a non-empty ``dst`` (its manifest lists it); the user's other files there are kept.

    Raises :class:`ConvertError` when the source is refused and :class:`~eagle31_mla.serving.engines.InputError`
    for unusable arguments (including ``dtype="float16"`` on values float16 cannot hold); in both
    cases ``dst`` is untouched."""
    import torch

    from ..model.checkpoint_eagle31_mla import (
        SAFETENSORS_DTYPE_NAMES,
        TENSOR_LAYOUTS,
        CheckpointError,
        check_vocab_map,
        layout_of,
        resolve_model_folder,
        t2d_from_d2t,
        validate_checkpoint,
    )
    from ..model.configuration_eagle31_mla import AUTO_MAP, REMOTE_CODE_FILES, ConfigError, Eagle31MLAConfig
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    max_shard_size = parse_size(max_shard_size)
    if (prune_vocab is None) != (token_counts is None):
        raise InputError("--prune-vocab N and --token-counts FILE go together")
    if prune_vocab is not None and (
        isinstance(prune_vocab, bool) or not isinstance(prune_vocab, int) or prune_vocab < 1
    ):
        raise InputError(f"--prune-vocab: expected a positive integer, got {prune_vocab!r}")
    out_dtype = None
    if not (dtype is None or dtype == "keep"):
        from ..model.configuration_eagle31_mla import resolve_dtype

        try:
            out_dtype = resolve_dtype(dtype, "--dtype")
        except ConfigError as err:
            raise InputError(str(err)) from None
    for flag, value in (("--repo-id", repo_id), ("--target", target_name)):
        if value is not None and (not isinstance(value, str) or not value.strip() or "\n" in value):
            raise InputError(f"{flag}: expected a non-empty name on one line, got {value!r}")
    try:  # where the writes go: links followed (the link itself stays) and '..' resolved, so DST's name and
        # parent are real (a DST spelled 'work/..' would otherwise put the temporary folder inside DST)
        dst = Path(dst).expanduser().resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python < 3.13's "Symlink loop"
        raise InputError(
            f"DST {dst}: cannot follow its links ({'a symlink loop' if 'loop' in str(err).lower() else err})"
        ) from None
    if dst == dst.parent:
        raise InputError(f"DST {dst}: expected a folder to write, not the file-system root")
    from ..serving.engines import probe_output_folder

    probe_output_folder(dst, "DST")  # a destination that cannot be created fails before any work
    counts = read_token_counts(token_counts) if token_counts is not None else None  # read before the model
    try:
        folder = resolve_model_folder(src)
    except Exception as err:
        raise InputError(f"cannot find the source {src} ({err})") from None
    for what, given in (("the source", folder), ("--token-counts", token_counts)):
        if given is None:
            continue
        try:
            real = Path(given).expanduser().resolve()
        except (OSError, RuntimeError):
            continue
        if real == dst or dst in real.parents or real in dst.parents:
            how = "is" if real == dst else "contains" if dst in real.parents else "is inside"
            raise InputError(f"DST {dst} {how} {what} {given}; convert into a folder apart from its inputs")

    # 1. The source, checked by the loader's own rules before anything is written.
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json")
    try:
        config = Eagle31MLAConfig.from_pretrained(folder)
        model = Eagle31MLAForCausalLM.on_meta_device(config)
        entries, derive_t2d = validate_checkpoint(folder, model)
    except (ConfigError, CheckpointError, OSError, ValueError) as err:
        raise ConvertError(str(err)) from None
    layout = _source_layout(TENSOR_LAYOUTS[layout_of(e[1] for e in entries.values())].description, config)
    dtypes = {st: getattr(torch, name) for st, name in SAFETENSORS_DTYPE_NAMES.items() if hasattr(torch, name)}
    st_names = {v: k for k, v in dtypes.items()}

    offsets = {file: _data_offsets(file) for file in sorted({e[0] for e in entries.values()})}
    with ExitStack() as stack:
        handles = {file: stack.enter_context(open(file, "rb")) for file in offsets}

        def stored(name: str) -> tuple[Any, int, int, Any]:
            """(open file, start, length, dtype) of a source tensor, by canonical name."""
            file, original, _, st_dtype = entries[name]
            if st_dtype not in dtypes:
                raise ConvertError(f"tensor {original!r} has dtype {st_dtype}, which this torch cannot hold")
            begin, finish = offsets[file][original]
            return handles[file], begin, finish - begin, dtypes[st_dtype]

        def whole(name: str):  # small tensors only (the vocabulary map)
            f, begin, length, src = stored(name)
            return torch.frombuffer(bytearray(_read_bytes(f, begin, length)), dtype=src)

        # 2. The vocabulary: the source's map (if pruned), then the optional new pruning.
        source_targets = None  # target id of each source lm_head row; None = identity (full vocabulary)
        if "d2t" in entries:
            d2t = whole("d2t").to(torch.long)
            t2d = t2d_from_d2t(d2t, config.vocab_size) if derive_t2d else whole("t2d").to(torch.bool)
            try:
                check_vocab_map(d2t, t2d, config)
            except CheckpointError as err:
                raise ConvertError(str(err)) from None
            source_targets = (torch.arange(d2t.numel()) + d2t).tolist()
        notes: list[str] = []
        kept_targets = rows = None
        if prune_vocab is not None:
            specials = [t for t in (config.bos_token_id, config.pad_token_id) if t is not None]
            specials += list(eos_token_ids(config.eos_token_id))
            candidates = source_targets if source_targets is not None else range(config.vocab_size)
            kept_targets, notes = choose_vocabulary(counts, prune_vocab, candidates, specials)
            row_of = {t: r for r, t in enumerate(candidates)}
            rows = [row_of[t] for t in kept_targets]
            config = Eagle31MLAConfig.from_dict({**config.to_dict(), "draft_vocab_size": len(kept_targets)})
        if out_dtype is not None:
            config = Eagle31MLAConfig.from_dict({**config.to_dict(), "dtype": str(out_dtype).removeprefix("torch.")})

        # 3. The plan: every output tensor with its dtype and shape, in a fixed order.
        expected = {
            name: tuple(t.shape) for name, t in Eagle31MLAForCausalLM.on_meta_device(config).state_dict().items()
        }
        planned = []
        watch: dict[str, dict[str, int]] = {"nonfinite": {}, "overflow": {}, "underflow": {}}  # tensor -> count
        for name in expected:
            if name in ("d2t", "t2d"):
                continue
            f, begin, length, src = stored(name)
            out = out_dtype or src
            if name == "lm_head.weight" and rows is not None:
                ranges = functools.partial(_row_ranges, begin, length // entries["lm_head.weight"][2][0], rows)
            else:
                ranges = functools.partial(_ranges, begin, length, CHUNK_BYTES)
            chunks = functools.partial(_read_cast, name, f, ranges, src, out, watch)
            planned.append(_Planned(name, out, expected[name], chunks, src))
        if "d2t" in expected:
            targets = torch.tensor(kept_targets if kept_targets is not None else source_targets, dtype=torch.long)
            new_d2t = targets - torch.arange(targets.numel())
            new_t2d = t2d_from_d2t(new_d2t, config.vocab_size).numpy()
            new_d2t = new_d2t.numpy()
            planned.append(_Planned("d2t", torch.long, expected["d2t"], lambda: iter([new_d2t])))
            planned.append(_Planned("t2d", torch.bool, expected["t2d"], lambda: iter([new_t2d])))
        planned.sort(key=lambda p: (-p.dtype.itemsize, p.name))  # safetensors' own order: aligned, then by name

        # 4. Everything the folder will hold, worked out before a byte is written: shard names, index,
        #    config.json, model card (its inputs are checked here too), and what DST must keep.
        shards = _shards(planned, max_shard_size)
        names = (
            [SINGLE_FILE]
            if len(shards) == 1
            else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        )
        total = sum(p.nbytes for p in planned)
        small: dict[str, bytes] = {}  # everything but the weights, in the order it is written
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {p.name: f for f, s in zip(names, shards) for p in s},
            }
            small[INDEX_FILE] = _json_bytes(index)
        from importlib import resources

        for name in REMOTE_CODE_FILES:
            small[name] = resources.files("eagle31_mla.model").joinpath(name).read_bytes()
        config_dict = json.loads(config.to_json_string(use_diff=True))  # what save_pretrained writes
        config_dict.pop("_name_or_path", None)
        config_dict["auto_map"] = dict(AUTO_MAP)
        written = [*names, *([INDEX_FILE] if len(shards) > 1 else []), "config.json", *REMOTE_CODE_FILES, "README.md"]
        try:
            card = model_card(
                config_dict,
                repo_id=repo_id or dst.resolve().name,
                target_name=target_name,
                source_layout=layout,
                files=written,
                kept_targets=kept_targets,
            )
        except (ValueError, TypeError, KeyError) as err:
            raise ConvertError(f"cannot write the model card for this config ({type(err).__name__}: {err})") from None
        small["README.md"] = card.encode()
        small["config.json"] = _json_bytes(config_dict)  # last: a folder without it is not a model
        manifest = _json_bytes({"written_by": _WRITER, "files": sorted(written)})
        notes += _clean_leftovers(dst)
        keep = _check_destination(dst, folder, force, written)

        # 5. The new folder, beside DST; swapped in whole once complete and read back.
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".{dst.name}{_TMP}new-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as err:
            raise InputError(f"cannot write DST {dst}: {err.strerror or err}") from None
        committed = False
        try:
            marker = {"written_by": _WRITER, "pid": os.getpid(), "host": socket.gethostname()}
            (tmp / _MARKER_TMP).write_bytes(_json_bytes({**marker, "files": sorted({*written, MANIFEST})}))
            os.replace(tmp / _MARKER_TMP, tmp / MARKER)  # whole or absent: a kill never leaves half a marker
            bar = _progress(total, progress)
            try:
                for file, shard in zip(names, shards):
                    _write_safetensors(tmp / file, shard, st_names, bar.update)
            finally:
                bar.close()
            if watch["nonfinite"]:  # the loader's rule (it refuses NaN / inf weights by name): refused here too
                bad = watch["nonfinite"]
                raise ConvertError(
                    f"{sum(bad.values()):,} NaN or inf value(s) in {len(bad)} tensor(s) of the source: "
                    + ", ".join(f"{entries[n][1]!r} ({c:,})" for n, c in bad.items())
                    + f"; the converted drafter would not load. Nothing was written to {dst}"
                )
            overflow = watch["overflow"]
            if watch["underflow"]:
                under = watch["underflow"]
                notes.append(
                    f"--dtype {str(out_dtype).removeprefix('torch.')}: {sum(under.values()):,} nonzero value(s) in "
                    f"{len(under)} tensor(s) are below its smallest subnormal (~6e-8) and became 0 "
                    f"(first: {next(iter(under))})"
                )
            if overflow:
                count = sum(overflow.values())
                raise InputError(
                    f"--dtype float16: {count:,} value(s) in {len(overflow)} tensor(s) exceed float16's range "
                    f"(+-65504) and would become inf (first: {next(iter(overflow))}); keep the source "
                    "dtype or use bfloat16. Nothing was written"
                )
            for name, data in small.items():
                (tmp / name).write_bytes(data)
            # 6. Self-check: the folder reads back under the same rules (headers only).
            validate_checkpoint(tmp, Eagle31MLAForCausalLM.on_meta_device(Eagle31MLAConfig.from_pretrained(tmp)))
            (tmp / MANIFEST).write_bytes(manifest)
            for entry in keep:
                _link_tree(dst / entry, tmp / entry)
            for file in tmp.iterdir():
                if file.is_file() and not file.is_symlink() and file.name not in keep:
                    _fsync(file)
            (tmp / MARKER).unlink()
            _fsync(tmp)
            notes += _commit(tmp, dst)
            committed = True
        except BaseException:  # KeyboardInterrupt included: remove what this run wrote, then stop
            if not committed and tmp.exists():
                _remove_ours(tmp, dst)
            raise
        _fsync(dst.parent)
    return ConvertResult(dst, written, len(planned), total, layout, config.vocab_size, config.draft_vocab_size, notes)


def _read_cast(name: str, f, ranges, src, out, watch: dict[str, dict[str, int]]):
    """A tensor's bytes read chunk by chunk from its file, each cast to the output dtype."""
    return (_cast_watched(name, _read_bytes(f, a, n), src, out, watch) for a, n in ranges())


def _cast_watched(name: str, data: bytes, src, out, watch: dict[str, dict[str, int]]):
    """:func:`_cast`, counting into ``watch`` (by tensor) the source's NaN / inf values (the loader's
    finiteness probe, one fused min/max per chunk) and, casting to float16, values beyond its range
    (overflow: they become inf) and nonzero values below its smallest subnormal (underflow: they become 0)."""
    import torch

    from ..model.checkpoint_eagle31_mla import finite_probe

    if not src.is_floating_point:
        return _cast(data, src, out)
    values = torch.frombuffer(bytearray(data), dtype=src)
    if not bool(torch.isfinite(finite_probe(values)).all()):
        watch["nonfinite"][name] = watch["nonfinite"].get(name, 0) + int((~torch.isfinite(values)).sum())
    if src == out:
        return data
    cast = values.to(out)
    if out == torch.float16 and src != torch.float16:
        over = int((torch.isinf(cast) & torch.isfinite(values)).sum())
        under = int(((cast == 0) & (values != 0)).sum())
        for key, count in (("overflow", over), ("underflow", under)):
            if count:
                watch[key][name] = watch[key].get(name, 0) + count
    return cast.view(torch.uint8).numpy()


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="convert",
        disable=not enabled,
        file=sys.stderr,
        leave=False,
    )


# ---- the model card --------------------------------------------------------------------------------------


def model_card(
    config: Mapping[str, Any],
    *,
    repo_id: str,
    target_name: str,
    source_layout: str,
    files: Sequence[str],
    kept_targets: Sequence[int] | None = None,
) -> str:
    """README.md for the converted folder: what it is, how its aux ids are written, how to serve it."""
    from ..model.aux_layers import aux_layer_ids_from_config
    from ..model.configuration_eagle31_mla import describe_rope
    from ..serving.command import serve_command

    ids, _ = aux_layer_ids_from_config(config)
    target = replace(KIMI_K3_TARGET, name=target_name)
    eagle31 = bool(config.get("fc_norm")) and bool(config.get("norm_output"))
    vocab = config["vocab_size"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- speculative-decoding",
        "- eagle3",
        "- mla",
        "---",
        "",
        f"# {repo_id}",
        "",
        f"A one-layer {'EAGLE-3.1' if eagle31 else 'EAGLE-3'} draft model with Multi-head Latent Attention (MLA) for "
        f"speculative decoding of `{target_name}`: hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads, "
        f"q_lora {config['q_lora_rank']}, kv_lora {config['kv_lora_rank']} + rope {config['qk_rope_head_dim']}, "
        f"MLP {config['intermediate_size']}, RoPE ({describe_rope(config)}). Its KV cache holds "
        f"{config['kv_lora_rank'] + config['qk_rope_head_dim']} values per token.",
        "",
    ]
    if eagle31:
        lines += [
            "EAGLE-3.1: `fc_norm` (an RMSNorm per captured target state before `fc`) and `norm_output` (the next "
            "draft step is fed the post-norm state).",
            "",
        ]
    if draft_vocab != vocab:
        lines += [
            f"Pruned vocabulary: {draft_vocab} of the target's {vocab} tokens"
            + (
                " (the most frequent in a token-count file, plus the special tokens)"
                if kept_targets is not None
                else ""
            )
            + "; `d2t` maps a draft id to its target id (`target = draft + d2t[draft]`), `t2d` marks the kept "
            "target ids.",
            "",
        ]
    lines += [
        "## Aux layers",
        "",
        f"The drafter reads the target's residual stream after zero-based layers {', '.join(map(str, ids.zero_based))} "
        f"(Transformers' `hidden_states[{', '.join(map(str, ids.one_based))}]`). `config.json` names them one-based, "
        f"`{list(ids.one_based)}`, both at the top level and inside `eagle_config`, and says so "
        "(`aux_layer_ids_convention: one_based`):",
        "",
        "- vLLM reads the top-level key (both model runners, every release);",
        "- TokenSpeed and SGLang read `eagle_config`. SGLang's DeepSeek/Kimi-K2.x targets add 1 only when the first id "
        "is 1 and its Kimi-K3 reader takes one-based ids unchanged, so a one-based list whose first id is not 1 is "
        "captured right by both; TokenSpeed's Kimi-K3 target reads one-based ids too.",
        "",
    ]
    if min(ids.one_based) == 1:
        lines += [
            "**Warning:** these ids start at 1 (the embedding layer's output is not captured, layer 0's output "
            "is). SGLang's DeepSeek rule cannot express that list in any form; serve with vLLM or TokenSpeed. "
            "`eagle31-mla doctor` reports it.",
            "",
        ]
    lines += [
        "Check a deployment before serving (reads only the two `config.json` files):",
        "",
        "```bash",
        f"eagle31-mla doctor --draft {repo_id} --target {target_name} --engine vllm",
        "```",
        "",
        "## Serving",
        "",
        "Install this project's plugin in the engine's environment (`pip install \"eagle31-mla[vllm]\"` or "
        '`"eagle31-mla[sglang]"`): it makes every engine release capture exactly these layers, applies '
        "EAGLE-3.1 where the engine does not, and adds Kimi-K3 capture to SGLang 0.5.23.",
        "",
    ]
    for engine in ENGINES:
        command = serve_command(engine, target_name, repo_id, target, config)
        lines += [f"### {ENGINE_NAMES[engine]}", "", "```bash", command.text(), "```", ""]
    lines += [
        "## Transformers",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'drafter = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
        "step = drafter(input_ids, aux_hidden_states=aux)  # aux: the captured target states, concatenated",
        "```",
        "",
        "## Files",
        "",
        *[f"- `{name}`" for name in files],
        "",
        f"Converted by `eagle31-mla convert` from a checkpoint with {source_layout}.",
        "",
    ]
    return "\n".join(lines)
