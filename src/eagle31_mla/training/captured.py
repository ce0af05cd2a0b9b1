"""Captured target states on disk: what ``eagle31-mla capture`` writes and ``eagle31-mla train --data`` reads.

A capture folder holds safetensors shards and a ``manifest.json``. Each shard holds whole sequences,
concatenated along the token axis:

* ``token_ids`` [T] int64, ``offsets`` [n + 1] int64 (sequence i is ``offsets[i]:offsets[i + 1]``),
  ``input_index`` [n] int64 (the sequence's position in the capture's input, for resuming);
* ``aux`` [T, n, H]: the residual stream after each aux layer, in ascending layer order (one-based ids,
  :mod:`eagle31_mla.model.aux_layers`; for Kimi-K3 the prefix-only stream);
* ``topk_logprobs`` [T, K] float32 and ``topk_ids`` [T, K] int32: the target's K most likely next tokens
  after position t and their log-probabilities, as the engine computed them: the loss input;
* ``loss_mask`` [T] uint8: 1 where the token is trained on (every token of a text capture; the assistant
  content of a conversation, :func:`eagle31_mla.prompts.conversation_tokens`), as the manifest's
  ``loss_mask`` says ("all", "assistant" or "last-turn").

Why log-probabilities and not the target's last hidden state: the engine's own numbers hold for every
target, while a last state needs the target's whole output path at training time, which for Kimi-K3 is
not norm + ``lm_head`` alone (its output mixes the AttnRes blocks first). K is the trade-off: K x 8 bytes
per token (Kimi-K3's aux states are 3 x 7168 x 2 = 43 KB per token in bf16; K = 64 adds 0.5 KB), and the
drafter is trained towards the target's distribution renormalised over those K tokens (the README
measures what that changes); K = the vocabulary size keeps it whole.

Every file is written under a temporary name and renamed into place, shard first, manifest last, so
an interrupted capture leaves the previous manifest and complete shards; a resumed capture skips the
sequences the manifest lists and never writes one twice. :class:`CapturedStates` checks every shard
against the manifest before anything trains, and names the shard and the field that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "CapturedDataError",
    "CaptureManifest",
    "CapturedStates",
    "inputs_digest",
    "write_shard",
    "write_manifest",
    "read_manifest",
    "bytes_per_token",
    "shard_bytes",
    "check_shard",
    "LOSS_MASKS",
]

FORMAT = "eagle31-mla-captured-states"
VERSION = 2  # 2: a loss mask per token
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
LOSS_MASKS = ("all", "assistant", "last-turn")


class CapturedDataError(ValueError):
    """A capture folder, manifest or shard that cannot be trained on: the message names the file and field."""


def inputs_digest(sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]] | None = None) -> str:
    """The identity of a capture's input sequences (and their loss masks): a resumed capture must be given
    the same ones."""
    digest = hashlib.sha256()
    for ids in sequences:
        digest.update(json.dumps(list(map(int, ids))).encode())
        digest.update(b"\n")
    for mask in loss_masks or ():
        digest.update(json.dumps(list(map(int, mask))).encode())
        digest.update(b"\n")
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
    # a capture streamed through a spool (training.spool.SpoolSettings): its part, the whole capture's size, the cap
    spool: dict[str, Any] | None = None
    format: str = FORMAT
    version: int = VERSION

    @property
    def done(self) -> set[int]:
        return {i for shard in self.shards for i in shard["input_index"]}

    @property
    def tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _atomic_write(path: Path, write) -> None:
    """``write(temporary_path)``, then rename over ``path``: readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_manifest(folder: str | Path, manifest: CaptureManifest) -> None:
    _atomic_write(Path(folder) / MANIFEST, lambda tmp: Path(tmp).write_text(manifest.to_json()))


def write_shard(
    folder: str | Path,
    number: int,
    sequences: Sequence[tuple],
) -> dict[str, Any]:
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
    _atomic_write(Path(folder) / name, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    return {
        "file": name,
        "sequences": len(sequences),
        "tokens": sum(lengths),
        "input_index": [seq[0] for seq in sequences],
    }


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
    ids = manifest.aux_layer_ids
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 1 for i in ids) and ids == sorted(ids)):
        raise CapturedDataError(f"{path}: aux_layer_ids must be ascending one-based ints, got {ids!r}")
    if manifest.dtype not in ("float32", "bfloat16", "float16"):
        raise CapturedDataError(f"{path}: dtype must be float32, bfloat16 or float16, got {manifest.dtype!r}")
    if manifest.loss_mask not in LOSS_MASKS:
        raise CapturedDataError(f"{path}: loss_mask must be one of {LOSS_MASKS}, got {manifest.loss_mask!r}")
    return manifest


def check_shard(path: Path, entry: dict[str, Any], manifest: CaptureManifest) -> tuple[list[int], torch.Tensor]:
    """A shard's tensors, shapes, dtypes and index against its manifest entry: (its input indices, its offsets).
    Raises :class:`CapturedDataError` naming the shard and the field that is wrong."""
    from safetensors import safe_open

    hidden, k, top_k = manifest.target["hidden_size"], len(manifest.aux_layer_ids), manifest.top_k
    where = f"{path}"
    if not path.is_file():
        raise CapturedDataError(f"{where}: listed in the manifest but missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            expected = {"token_ids", "offsets", "input_index", "aux", "topk_logprobs", "topk_ids", "loss_mask"}
            if names != expected:
                raise CapturedDataError(f"{where}: tensors {sorted(names)}; expected {sorted(expected)}")
            shapes = {name: list(f.get_slice(name).get_shape()) for name in expected}
            offsets = f.get_tensor("offsets")
            input_index = f.get_tensor("input_index").tolist()
            dtypes = {name: f.get_slice(name).get_dtype() for name in ("aux", "topk_logprobs", "topk_ids", "loss_mask")}
            mask_values = f.get_tensor("loss_mask").unique().tolist()
    except CapturedDataError:
        raise
    except Exception as err:  # a truncated or damaged file: safetensors' own message says how
        raise CapturedDataError(f"{where}: not a readable safetensors shard ({err})") from None
    tokens, n = entry["tokens"], entry["sequences"]
    want = {
        "token_ids": [tokens],
        "offsets": [n + 1],
        "input_index": [n],
        "aux": [tokens, k, hidden],
        "topk_logprobs": [tokens, top_k],
        "topk_ids": [tokens, top_k],
        "loss_mask": [tokens],
    }
    for name, shape in want.items():
        if shapes[name] != shape:
            raise CapturedDataError(
                f"{where}: `{name}` has shape {shapes[name]}; the manifest ({k} aux layers, hidden size "
                f"{hidden}, top-{top_k}, {n} sequences, {tokens} tokens) needs {shape}"
            )
    want_dtypes = {
        "aux": {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[manifest.dtype],
        "topk_logprobs": "F32",
        "topk_ids": "I32",
        "loss_mask": "U8",
    }
    for name, found in dtypes.items():
        if found != want_dtypes[name]:
            raise CapturedDataError(f"{where}: `{name}` is {found}; expected {want_dtypes[name]}")
    if not set(mask_values) <= {0, 1}:
        raise CapturedDataError(f"{where}: `loss_mask` holds {sorted(mask_values)}; expected only 0 and 1")
    if input_index != entry["input_index"] or int(offsets[-1]) != tokens or bool((offsets.diff() < 1).any()):
        raise CapturedDataError(f"{where}: its sequence index or offsets disagree with the manifest")
    return input_index, offsets


class CapturedStates:
    """The sequences of a capture folder, every shard checked against the manifest when opened."""

    def __init__(self, folder: str | Path, *, aux_layer_ids: Sequence[int] | None = None):
        self.folder = Path(folder)
        self.manifest = manifest = read_manifest(folder)
        if aux_layer_ids is not None and list(aux_layer_ids) != manifest.aux_layer_ids:
            raise CapturedDataError(
                f"{self.folder}: captured at aux layers {manifest.aux_layer_ids} (one-based), but the drafter reads "
                f"{list(aux_layer_ids)}; capture again with the drafter's ids"
            )
        dtype = getattr(torch, manifest.dtype)
        self._index: list[tuple[Path, int, int]] = []  # (shard, start, end) per sequence, in input order
        entries = []
        for entry in manifest.shards:
            path = self.folder / entry["file"]
            input_index, offsets = check_shard(path, entry, manifest)
            entries.extend((i, path, int(offsets[j]), int(offsets[j + 1])) for j, i in enumerate(input_index))
        entries.sort()
        if len({i for i, *_ in entries}) != len(entries):
            raise CapturedDataError(f"{self.folder}: a sequence is captured twice")
        self._index = [(path, start, end) for _, path, start, end in entries]
        self.dtype = dtype
        self._open: dict[Path, Any] = {}

    def __len__(self) -> int:
        return len(self._index)

    @property
    def longest(self) -> int:
        """Tokens in the longest captured sequence."""
        return max((end - start for _, start, end in self._index), default=0)

    @property
    def complete(self) -> bool:
        return len(self._index) == self.manifest.num_inputs

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
        aux = f.get_slice("aux")[start:end]
        return (
            f.get_slice("token_ids")[start:end],
            aux.reshape(end - start, -1),
            f.get_slice("topk_logprobs")[start:end],
            f.get_slice("topk_ids")[start:end].long(),
        )

    def loss_mask(self, i: int) -> torch.Tensor:
        """[S] float: 1 where the i-th sequence's token is trained on (the manifest's ``loss_mask``)."""
        path, start, end = self._where(i)
        return self._file(path).get_slice("loss_mask")[start:end].float()

    def target_probs(self, i: int, vocab_size: int) -> torch.Tensor:
        """[S, V]: the target's next-token distributions of sequence i, renormalised over its top-k."""
        _, _, logprobs, ids = self.sequence(i)
        probs = torch.zeros(ids.shape[0], vocab_size).scatter_(1, ids, logprobs.exp())
        return probs / probs.sum(-1, keepdim=True)
