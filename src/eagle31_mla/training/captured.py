"""Captured target states on disk: what ``eagle31-mla capture`` writes and ``eagle31-mla train --data`` reads.

A capture folder holds a ``manifest.json`` and safetensors shards of whole sequences, concatenated along the
token axis: ``token_ids`` [T] int64; ``offsets`` [n + 1] (sequence i is ``offsets[i]:offsets[i + 1]``);
``input_index`` [n] (each sequence's position in the input, for resuming); ``aux`` [T, n, H] (the residual
stream after each aux layer, ascending one-based ids; Kimi-K3's prefix-only stream); ``topk_logprobs`` [T, K]
float32 and ``topk_ids`` [T, K] int32 (the target's K most likely next tokens, as the engine computed them: the
loss input); ``loss_mask`` [T] uint8 (1 where trained on, as the manifest's ``loss_mask`` says: "all",
"assistant" or "last-turn"). Why log-probabilities, not the last hidden state: docs/training.md; the drafter is
trained towards the target's distribution renormalised over the K tokens.

Files are written under a temporary name and renamed, shard first, manifest last: an interrupted capture leaves
the previous manifest and complete shards, and a resumed one skips what the manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..locations import atomic_write

FORMAT = "eagle31-mla-captured-states"
VERSION = 2  # 2: a loss mask per token
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
#: Every name a capture gives a shard: a manifest naming anything else (a path, `..`) is refused.
SHARD_NAME = re.compile(r"shard-[0-9]+\.safetensors")
LOSS_MASKS = ("all", "assistant", "last-turn")


class CapturedDataError(ValueError):
    """A capture folder, manifest or shard that cannot be trained on: the message names the file and field."""


def inputs_digest(sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]] | None = None) -> str:
    """The identity of a capture's input sequences (and their loss masks): a resumed capture must be given
    the same ones."""
    digest = hashlib.sha256()
    for row in [*sequences, *(loss_masks or ())]:
        digest.update(json.dumps(list(map(int, row))).encode() + b"\n")
    return digest.hexdigest()


def shard_bytes(tokens: int, sequences: int, num_aux: int, hidden_size: int, dtype: torch.dtype, top_k: int) -> int:
    """At least the bytes of a shard of ``sequences`` holding ``tokens`` (what :func:`write_shard` writes): the
    tensors, and 4 KiB for the safetensors header (about 1 KiB: seven names, shapes and offsets)."""
    return bytes_per_token(num_aux, hidden_size, dtype, top_k) * tokens + 16 * sequences + 8 + 4096


def bytes_per_token(num_aux: int, hidden_size: int, dtype: torch.dtype, top_k: int) -> int:
    """Disk bytes per captured token: the aux states, the top-k log-probabilities and ids, the token id and
    its loss-mask byte."""
    return num_aux * hidden_size * torch.empty((), dtype=dtype).element_size() + top_k * 8 + 8 + 1


@dataclass
class CaptureManifest:
    target: dict[str, Any]  # name, architectures, num_hidden_layers, hidden_size, vocab_size
    aux_layer_ids: list[int]  # one-based, ascending
    dtype: str  # torch dtype name of aux
    top_k: int  # log-probabilities kept per position
    inputs_sha256: str
    num_inputs: int
    engine: str  # e.g. "vllm 0.32.0"
    draft: str | None = None
    loss_mask: str = "all"  # which tokens are trained on: "all", "assistant" or "last-turn" (conversations)
    shards: list[dict[str, Any]] = field(default_factory=list)  # {"file", "sequences", "tokens", "input_index"}
    # a capture streamed through a spool (training.spool.plan_part): its part, the whole capture's size, the cap
    spool: dict[str, Any] | None = None
    format: str = FORMAT
    version: int = VERSION

    @property
    def done(self) -> set[int]:
        return {i for shard in self.shards for i in shard["input_index"]}

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)


def write_manifest(folder: str | Path, manifest: CaptureManifest) -> None:
    atomic_write(Path(folder) / MANIFEST, lambda tmp: Path(tmp).write_text(json.dumps(asdict(manifest), indent=1)))


def write_shard(folder: str | Path, number: int, sequences: Sequence[tuple]) -> dict[str, Any]:
    """Write one shard (atomically) and return its manifest entry. Each sequence is (input index, token ids
    [S], aux [S, n, H], top-k log-probabilities [S, K], their token ids [S, K][, loss mask [S]: all ones
    when left out])."""
    from safetensors.torch import save_file

    lengths = [seq[1].shape[0] for seq in sequences]
    tensors = {
        "token_ids": torch.cat([seq[1].long() for seq in sequences]),
        "offsets": torch.tensor([0, *lengths]).cumsum(0),
        "input_index": torch.tensor([seq[0] for seq in sequences], dtype=torch.long),
        "aux": torch.cat([seq[2] for seq in sequences]).contiguous(),
        "topk_logprobs": torch.cat([seq[3].float() for seq in sequences]).contiguous(),
        "topk_ids": torch.cat([seq[4].int() for seq in sequences]).contiguous(),
        "loss_mask": torch.cat(
            [torch.as_tensor(seq[5]) if len(seq) > 5 else torch.ones(seq[1].shape[0]) for seq in sequences]
        ).to(torch.uint8),
    }
    name = SHARD_PATTERN.format(number)
    atomic_write(Path(folder) / name, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    return {"file": name, "sequences": len(sequences), "tokens": sum(lengths), "input_index": [s[0] for s in sequences]}


def read_manifest(folder: str | Path) -> CaptureManifest:
    path = Path(folder) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CapturedDataError(
            f"{folder}: no {MANIFEST}; expected a folder written by `eagle31-mla capture`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CapturedDataError(f"{path}: not a readable manifest ({err})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CapturedDataError(f"{path}: not a capture manifest (expected format {FORMAT!r})")
    if raw.get("version") != VERSION:
        raise CapturedDataError(f"{path}: format version {raw.get('version')!r}; this library reads {VERSION}")
    try:
        manifest = CaptureManifest(**raw)
    except TypeError as err:
        raise CapturedDataError(f"{path}: unexpected manifest fields ({err})") from None
    _check_manifest(path, manifest)
    return manifest


def _is_count(value, least: int = 0) -> bool:
    return type(value) is int and value >= least


def _check_manifest(path: Path, m: CaptureManifest) -> None:
    """A manifest is data from whoever could write the folder: every field the trainer uses, by type and range,
    before anything is read, trained on or removed. Shard entries are plain names of this folder."""

    def need(field: str, value, ok: bool, expected: str) -> None:
        if not ok:
            raise CapturedDataError(f"{path}: `{field}` must be {expected}, got {value!r}")

    ids, target = m.aux_layer_ids, m.target
    need(
        "aux_layer_ids",
        ids,
        isinstance(ids, list) and ids and all(_is_count(i, 1) for i in ids) and ids == sorted(ids),
        "ascending one-based ints",
    )
    need("dtype", m.dtype, m.dtype in ("float32", "bfloat16", "float16"), "float32, bfloat16 or float16")
    need("loss_mask", m.loss_mask, m.loss_mask in LOSS_MASKS, f"one of {LOSS_MASKS}")
    need("target", target, isinstance(target, dict), "an object")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        need(f"target.{key}", target.get(key), _is_count(target.get(key), 1), "a positive integer")
    depth = target["num_hidden_layers"]
    need("aux_layer_ids", ids, ids[-1] <= depth, f"ids of the target's layers, at most num_hidden_layers ({depth})")
    need("top_k", m.top_k, _is_count(m.top_k, 1), "a positive integer")
    need("num_inputs", m.num_inputs, _is_count(m.num_inputs), "a non-negative integer")
    need("shards", m.shards, isinstance(m.shards, list), "a list")
    for n, entry in enumerate(m.shards):
        where = f"shards[{n}]"
        keys = {"file", "sequences", "tokens", "input_index"}
        need(where, entry, isinstance(entry, dict) and entry.keys() == keys, f"an object with keys {sorted(keys)}")
        file, count, index = entry["file"], entry["sequences"], entry["input_index"]
        need(
            f"{where}.file",
            file,
            isinstance(file, str) and SHARD_NAME.fullmatch(file),
            "a shard name of this folder (shard-NNNNN.safetensors)",
        )
        need(f"{where}.sequences", count, _is_count(count, 1), "a positive integer")
        need(f"{where}.tokens", entry["tokens"], _is_count(entry["tokens"], count), f"an integer >= {count}")
        need(
            f"{where}.input_index",
            index,
            isinstance(index, list) and len(index) == count and all(_is_count(i) for i in index),
            f"a list of {count} non-negative integers",
        )
    if m.spool is not None:
        keys = ("part", "parts", "inputs", "max_bytes", "shard_bytes", "bytes", "sequences_per_shard")
        need("spool", m.spool, isinstance(m.spool, dict) and set(keys) <= m.spool.keys(), f"an object with {keys}")
        for key in keys:
            least = int(key in ("part", "parts", "sequences_per_shard"))
            need(f"spool.{key}", m.spool[key], _is_count(m.spool[key], least), f"an integer >= {least}")
        need("spool.part", m.spool["part"], m.spool["part"] <= m.spool["parts"], f"at most parts ({m.spool['parts']})")


def check_shard(path: Path, entry: dict[str, Any], manifest: CaptureManifest) -> tuple[list[int], torch.Tensor]:
    """A shard's tensors, shapes, dtypes and index against its manifest entry: (its input indices, its offsets).
    Raises :class:`CapturedDataError` naming the shard and the field that is wrong."""
    from safetensors import safe_open

    if path.is_symlink():
        raise CapturedDataError(f"{path}: a link; a capture writes its shards as regular files in its folder")
    tokens, n = entry["tokens"], entry["sequences"]
    k, hidden = len(manifest.aux_layer_ids), manifest.target["hidden_size"]
    want = {
        "token_ids": ("I64", [tokens]),
        "offsets": ("I64", [n + 1]),
        "input_index": ("I64", [n]),
        "aux": ({"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[manifest.dtype], [tokens, k, hidden]),
        "topk_logprobs": ("F32", [tokens, manifest.top_k]),
        "topk_ids": ("I32", [tokens, manifest.top_k]),
        "loss_mask": ("U8", [tokens]),
    }
    try:
        with safe_open(str(path), framework="pt") as f:
            found = {name: (f.get_slice(name).get_dtype(), list(f.get_slice(name).get_shape())) for name in f.keys()}
            if found == want:
                offsets, input_index = f.get_tensor("offsets"), f.get_tensor("input_index").tolist()
                mask_values = f.get_tensor("loss_mask").unique().tolist()
    except FileNotFoundError:
        raise CapturedDataError(f"{path}: listed in the manifest but missing") from None
    except Exception as err:  # a truncated or damaged file: safetensors' own message says how
        raise CapturedDataError(f"{path}: not a readable safetensors shard ({err})") from None
    if found.keys() != want.keys():
        raise CapturedDataError(f"{path}: tensors {sorted(found)}; expected {sorted(want)}")
    for name, (dtype, shape) in want.items():
        if found[name] != (dtype, shape):
            raise CapturedDataError(
                f"{path}: `{name}` is {found[name][0]} {found[name][1]}; the manifest ({k} aux layers, hidden size "
                f"{hidden}, top-{manifest.top_k}, {n} sequences, {tokens} tokens) needs {dtype} {shape}"
            )
    if not set(mask_values) <= {0, 1}:
        raise CapturedDataError(f"{path}: `loss_mask` holds {sorted(mask_values)}; expected only 0 and 1")
    if input_index != entry["input_index"] or int(offsets[-1]) != tokens or bool((offsets.diff() < 1).any()):
        raise CapturedDataError(f"{path}: its sequence index or offsets disagree with the manifest")
    return input_index, offsets


class CapturedStates:
    """The sequences of a capture folder, every shard checked against the manifest when opened."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = manifest = read_manifest(folder)
        entries = []
        for entry in manifest.shards:
            path = self.folder / entry["file"]
            input_index, offsets = check_shard(path, entry, manifest)
            entries.extend((i, path, int(offsets[j]), int(offsets[j + 1])) for j, i in enumerate(input_index))
        entries.sort()
        if len({i for i, *_ in entries}) != len(entries):
            raise CapturedDataError(f"{self.folder}: a sequence is captured twice")
        self._index = [(path, start, end) for _, path, start, end in entries]  # per sequence, in input order
        self._open: dict[Path, Any] = {}

    def __len__(self) -> int:
        return len(self._index)

    @property
    def longest(self) -> int:
        """Tokens in the longest captured sequence."""
        return max((end - start for _, start, end in self._index), default=0)

    def _where(self, i: int) -> tuple[Path, int, int]:
        """(shard, start, end) of the i-th sequence."""
        return self._index[i]

    def length(self, i: int) -> int:
        """Tokens in the i-th sequence."""
        _, start, end = self._where(i)
        return end - start

    def _file(self, path: Path):
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [S], aux [S, n·H], top-k log-probabilities [S, K], their token ids [S, K]) of the
        i-th captured sequence: position t's are the target's next-token distribution after x[..t]."""
        path, start, end = self._where(i)
        f = self._file(path)
        tokens, aux, logprobs, ids = (
            f.get_slice(name)[start:end] for name in ("token_ids", "aux", "topk_logprobs", "topk_ids")
        )
        # The values, checked as they are read (a shard is read once per epoch; reading it to check it first
        # would read a capture twice): a bad one stops the run before the step that would train on it.
        vocab = self.manifest.target["vocab_size"]
        for name, bad, expected in (
            ("token_ids", (tokens < 0) | (tokens >= vocab), f"token ids in [0, {vocab})"),
            ("topk_ids", (ids < 0) | (ids >= vocab), f"token ids in [0, {vocab})"),
            ("aux", ~aux.isfinite(), "finite values"),
            ("topk_logprobs", logprobs.isnan() | (logprobs > 0.01), "log-probabilities (at most 0; -inf: p = 0)"),
        ):
            if bad.any():
                raise CapturedDataError(f"{path}: `{name}` of sequence {i} holds values other than {expected}")
        return tokens, aux.reshape(end - start, -1), logprobs, ids.long()

    def loss_mask(self, i: int) -> torch.Tensor:
        """[S] float: 1 where the i-th sequence's token is trained on (the manifest's ``loss_mask``)."""
        path, start, end = self._where(i)
        return self._file(path).get_slice("loss_mask")[start:end].float()

    def target_probs(self, i: int, vocab_size: int) -> torch.Tensor:
        """[S, V]: the target's next-token distributions of sequence i, renormalised over its top-k."""
        _, _, logprobs, ids = self.sequence(i)
        probs = torch.zeros(ids.shape[0], vocab_size).scatter_(1, ids, logprobs.exp())
        return probs / probs.sum(-1, keepdim=True)
