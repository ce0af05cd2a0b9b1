"""Online training through a spool (docs/training.md): ``capture --spool DIR --max-spool-gb N`` and ``train --data
DIR --follow`` at once, a shared folder the whole protocol. The spool holds one capture folder per capture process,
``part-I-of-N`` (the ``capture --out`` format, its manifest's ``spool`` entry planned by :func:`plan_part`); part I
captures input sequences I-1, I-1+N, ... The trainer reads the shards in one fixed order (shard 0 of each part in
turn, then shard 1, ...), a function of the spool's content, not its timing: a resumed trainer sees the batches an
uninterrupted one does.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .captured import (
    MANIFEST,
    SHARD_NAME,
    CapturedDataError,
    CapturedStates,
    CaptureManifest,
    check_shard,
    read_manifest,
    shard_bytes,
    write_manifest,
    write_shard,
)
from .trainer import CapturedTarget, TrainingConfig

logger = logging.getLogger(__name__)

_PART = re.compile(r"part-([0-9]+)-of-([0-9]+)")
#: Seconds between looks at the spool while waiting (both sides).
POLL_S = float(os.environ.get("EAGLE31_SPOOL_POLL_S", "0.2"))


def part_folder(spool: str | Path, part: int, parts: int) -> Path:
    return Path(spool) / f"part-{part}-of-{parts}"


def part_sequences(count: int, part: int, parts: int) -> list[int]:
    """The input indices part ``part`` (one-based) of ``parts`` captures."""
    return list(range(part - 1, count, parts))


def plan_part(lengths: list[int], max_bytes: int, bytes_of: Callable[[int, int], int], **entry: int) -> dict[str, int]:
    """A part's ``spool`` manifest entry (``entry``: part, parts, inputs, sequences_per_shard) from its sequences'
    lengths, known before the target runs: its share of the cap (``max_bytes`` / parts), upper bounds of the bytes
    of its largest shard and of all its shards (``bytes_of(tokens, sequences)``). Refused when a shard cannot fit."""
    share, per_shard = max_bytes // entry["parts"], entry["sequences_per_shard"]
    chunks = (lengths[i : i + per_shard] for i in range(0, len(lengths), per_shard))
    sizes = [bytes_of(sum(chunk), len(chunk)) for chunk in chunks]
    largest = max(sizes, default=0)
    if largest > share:
        raise CapturedDataError(
            f"argument --max-spool-gb: a shard of {per_shard} sequences takes up to {largest / 1e6:.4g} MB, "
            f"more than this part's share of the spool ({share / 1e6:.4g} MB of {max_bytes / 1e6:.4g} MB for "
            f"{entry['parts']} parts): raise --max-spool-gb or lower --sequences-per-shard"
        )
    return entry | dict(max_bytes=share, shard_bytes=largest, bytes=sum(sizes))


def write_shards(
    out: Path,
    manifest: CaptureManifest,
    sequences,
    run_target: Callable[[list[int]], list[tuple]],
    *,
    sequences_per_shard: int,
    say: Callable[[str], None] = print,
) -> Iterator[tuple[int, int]]:
    """Capture the sequences ``out``'s manifest does not list yet, ``sequences_per_shard`` at a time: each shard
    is written (atomically), then the manifest naming it. ``run_target(indices)`` gives the shard's sequences
    (:func:`~eagle31_mla.training.captured.write_shard`'s tuples). For a spool part (``manifest.spool``), each
    shard first waits for room. Yields (sequences, tokens) per shard written."""
    if manifest.spool is not None:  # what an interrupted run left: temporary files, a shard written but not listed
        listed = {entry["file"] for entry in manifest.shards}
        for path in out.iterdir():
            unlisted_shard = SHARD_NAME.fullmatch(path.name) and path.name not in listed
            if path.is_file() and (unlisted_shard or (path.name.startswith(".") and path.name.endswith(".tmp"))):
                path.unlink(missing_ok=True)  # (the resumed run writes it again, under the same name)
    pending = [i for i in range(len(sequences)) if i not in manifest.done]
    num_aux, hidden, dtype = len(manifest.aux_layer_ids), manifest.target["hidden_size"], getattr(torch, manifest.dtype)
    for start in range(0, len(pending), sequences_per_shard):
        chunk = pending[start : start + sequences_per_shard]
        tokens = sum(len(sequences[i]) for i in chunk)
        if manifest.spool is not None:  # back-pressure: the shard is sized before the target runs on it
            _wait_for_room(out, manifest, shard_bytes(tokens, len(chunk), num_aux, hidden, dtype, manifest.top_k), say)
        manifest.shards.append(write_shard(out, len(manifest.shards), run_target(chunk)))
        write_manifest(out, manifest)
        yield len(chunk), tokens


def _listed_bytes(folder: Path, manifest: CaptureManifest) -> int:
    total = 0
    for entry in manifest.shards:
        with contextlib.suppress(FileNotFoundError):  # taken by the trainer
            total += (folder / entry["file"]).stat().st_size
    return total


def _wait_for_room(folder: Path, manifest: CaptureManifest, need: int, say: Callable[[str], None]) -> None:
    """Return once a shard of ``need`` bytes fits in the part's share beside the shards the trainer has not taken."""
    said, cap = False, manifest.spool["max_bytes"]
    while (used := _listed_bytes(folder, manifest)) + need > cap:
        if not said:
            say(f"spool full ({used / 1e6:.3f} of {cap / 1e6:.3f} MB for {folder.name}): waiting for the trainer")
            said = True
        time.sleep(POLL_S)


@dataclass
class _Shard:
    folder: Path
    entry: dict[str, Any]
    start: int  # its first sequence's position in the stream
    offsets: list[int] | None = None  # token offsets, once opened and checked
    removed: bool = False

    @property
    def path(self) -> Path:
        return self.folder / self.entry["file"]

    @property
    def end(self) -> int:
        return self.start + self.entry["sequences"]


class FollowedCapture(CapturedStates):
    """The trainer's side: the sequences of a spool (or of a stored capture folder) in the stream order, read
    as they are written. Sequence i is the stream's i-th; :meth:`wait_for` blocks until it is captured."""

    def __init__(self, folder: str | Path, *, say: Callable[[str], None] = print):
        self.folder, self.say = Path(folder), say
        self.parts = self._wait_for_parts()
        for part in self.parts:  # the trainer removes shards from the parts: they lie inside the spool
            if part != self.folder and (part.is_symlink() or part.resolve().parent != self.folder.resolve()):
                raise CapturedDataError(f"{part}: a link out of the spool; a capture writes its part as a folder")
        self.manifests = [read_manifest(p) for p in self.parts]  # the parts agree, checked once
        self.manifest = first = self.manifests[0]
        for i, (p, m) in enumerate(zip(self.parts, self.manifests)):
            for key in ("target", "aux_layer_ids", "dtype", "top_k", "loss_mask"):
                if getattr(m, key) != getattr(first, key):
                    raise CapturedDataError(f"{p}: another {key} ({getattr(m, key)!r}) than {self.parts[0].name}")
            entry = [(m.spool or {}).get(key) for key in ("part", "parts", "inputs")]
            if len(self.parts) > 1 and entry != [i + 1, len(self.parts), first.spool["inputs"]]:
                raise CapturedDataError(f"{p}: its manifest's spool entry disagrees with its folder's part")
        self.spool = self.manifest.spool is not None
        self.total = self.manifest.spool["inputs"] if self.spool else self.manifest.num_inputs
        self._shards: list[_Shard] = []
        self._next = [0] * len(self.parts)  # per part: the number of its next shard in the stream
        self._turn = 0  # the part whose shard comes next
        self._open: dict[Path, Any] = {}

    def _wait_for_parts(self) -> list[Path]:
        said = False
        while True:
            if (self.folder / MANIFEST).is_file():
                return [self.folder]  # a stored capture (or one part given directly)
            listed = self.folder.iterdir() if self.folder.is_dir() else ()  # the trainer may start first
            found = [p for p in listed if _PART.fullmatch(p.name) and (p / MANIFEST).is_file()]
            if found:
                parts = int(_PART.fullmatch(found[0].name).group(2))
                folders = [part_folder(self.folder, i, parts) for i in range(1, parts + 1)]
                odd = [p.name for p in found if p not in folders]
                if odd:
                    raise CapturedDataError(f"{self.folder}: parts of different splits ({', '.join(sorted(odd))})")
                if all((p / MANIFEST).is_file() for p in folders):
                    return folders
            if not said:
                self.say(f"waiting for the capture to start writing {self.folder}")
                said = True
            time.sleep(POLL_S)

    def check_plan(self, batch_size: int, epochs: int) -> None:
        """Refuse a run the spool's cap cannot carry: with ``epochs`` > 1 every shard is kept to the end; and
        each part's share must hold the shards one step reads while the next ones are written."""
        if not self.spool:
            return
        manifests, parts = self.manifests, len(self.manifests)
        per_shard = min(m.spool["sequences_per_shard"] for m in manifests)
        window = math.ceil(batch_size / per_shard) + 1  # shards one step's batch can touch, in stream order
        need = window if parts == 1 else math.ceil(window / parts) + 1
        for p, m in zip(self.parts, manifests):
            s = m.spool
            if epochs > 1 and s["bytes"] > s["max_bytes"]:
                raise CapturedDataError(
                    f"argument --epochs: {epochs} epochs keep every shard until the last one, but {p.name} needs "
                    f"{s['bytes'] / 1e9:.4g} GB and its share of the spool is {s['max_bytes'] / 1e9:.4g} GB; "
                    "capture with a larger --max-spool-gb, or store the capture (capture --out) and train on it"
                )
            if s["max_bytes"] < need * s["shard_bytes"]:
                raise CapturedDataError(
                    f"argument --batch-size: a step of {batch_size} sequences reads up to {need} shards of "
                    f"{p.name} ({s['shard_bytes'] / 1e6:.4g} MB each), more than its share of the spool "
                    f"({s['max_bytes'] / 1e6:.4g} MB): lower --batch-size, or capture with a larger "
                    "--max-spool-gb or a smaller --sequences-per-shard"
                )

    def __len__(self) -> int:
        return self.total

    @property
    def captured(self) -> int:
        """Sequences of the stream listed so far."""
        return self._shards[-1].end if self._shards else 0

    def _extend(self) -> bool:
        """Add the shards now listed, in the stream order; False when the next one is not listed yet."""
        manifests = [read_manifest(p) for p in self.parts]
        progressed = False
        while self.captured < self.total:
            part = self._turn
            m = manifests[part]
            n = self._next[part]
            if n < len(m.shards):
                self._shards.append(_Shard(self.parts[part], m.shards[n], self.captured))
                self._next[part] += 1
                progressed = True
            elif not len(m.done) == m.num_inputs:
                return progressed  # the next shard in the order is still being captured
            elif all(self._next[i] >= len(x.shards) and len(x.done) == x.num_inputs for i, x in enumerate(manifests)):
                raise CapturedDataError(
                    f"{self.folder}: every part's manifest is complete, but they hold {self.captured} of the "
                    f"{self.total} sequences"
                )
            self._turn = (self._turn + 1) % len(self.parts)
        return True

    def ready(self, count: int) -> bool:
        """Whether the stream's first ``count`` sequences are captured (looks at the spool once)."""
        if self.captured < count:
            self._extend()
        return self.captured >= min(count, self.total)

    def wait_for(self, count: int) -> None:
        said = False
        while not self.ready(count):
            if not said:
                self.say(f"waiting for the capture: {self.captured} of the {min(count, self.total)} sequences needed")
                said = True
            time.sleep(POLL_S)

    def _where(self, i: int) -> tuple[Path, int, int]:
        shard = self._shards[bisect.bisect_right(self._shards, i, key=lambda s: s.start) - 1]  # (waited for)
        if shard.offsets is None:
            if shard.removed or not shard.path.is_file():
                raise CapturedDataError(
                    f"{shard.path}: needed for training but removed (another trainer on this spool?)"
                )
            _, offsets = check_shard(shard.path, shard.entry, self.manifest)  # the parts agree on what it checks
            shard.offsets = offsets.tolist()
        j = i - shard.start
        return shard.path, shard.offsets[j], shard.offsets[j + 1]

    def release(self, trained: int, remove: bool = True) -> list[Path]:
        """Close the shards whose sequences all lie before stream position ``trained``, and (``remove``, one rank)
        remove them from the spool: call once every rank has trained on them and a checkpoint covering them is
        written. A stored capture keeps its files. (An open file's disk space is freed only when every process
        has closed it: every rank closes.)"""
        removed = []
        for shard in self._shards:
            if shard.end > trained:
                break
            self._open.pop(shard.path, None)
            if self.spool and remove and not shard.removed:
                if shard.path.is_symlink() or (shard.offsets is None and shard.path.exists()):
                    check_shard(shard.path, shard.entry, self.manifest)  # a link is refused; so is a foreign file
                shard.path.unlink(missing_ok=True)
                shard.removed = True
                removed.append(shard.path)
        return removed

    def releasable(self, trained: int) -> bool:
        return self.spool and any(not s.removed and s.end <= trained for s in self._shards)


class FollowTarget(CapturedTarget):
    """Training batches from a followed capture: step k takes the stream's positions [k·B, (k+1)·B) of
    ``epochs`` passes, the first in the order written, each later one in a shuffle of it (by the seed and the
    epoch, as :meth:`~eagle31_mla.training.trainer._Batches.step_indices` shuffles)."""

    def __init__(self, data: FollowedCapture, vocab_size: int, device="cpu", epochs: int = 1):
        super().__init__(data, vocab_size, device)
        self.epochs = epochs

    def _window(self, step: int, config: TrainingConfig) -> range:
        return range(step * config.batch_size, min((step + 1) * config.batch_size, len(self.data) * self.epochs))

    def step_indices(self, step: int, config: TrainingConfig) -> torch.Tensor:
        window, n = self._window(step, config), len(self.data)
        self.data.wait_for(n if window.stop > n else window.stop)  # later epochs: everything is captured
        shuffles = {  # each later epoch's order, drawn once per step
            epoch: torch.randperm(n, generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch))
            for epoch in {q // n for q in window} - {0}
        }
        return torch.tensor([shuffles[q // n][q % n] if q >= n else q for q in window], dtype=torch.long)

    def stalled(self, step: int, config: TrainingConfig) -> bool:
        window = self._window(step, config)
        return not self.data.ready(min(window.stop, len(self.data))) and self.data.releasable(
            self._trained(step, config)
        )

    def _trained(self, step: int, config: TrainingConfig) -> int:
        """Stream positions every later step is done with (their shards can go)."""
        done, n = min(step * config.batch_size, len(self.data) * self.epochs), len(self.data)
        return done if self.epochs == 1 else (n if done == n * self.epochs else 0)

    def checkpointed(self, step: int, config: TrainingConfig, remove: bool = True) -> None:
        self.data.ready(self._trained(step, config))  # a resumed trainer learns the shards before its step
        for path in self.data.release(self._trained(step, config), remove):
            logger.info("trained and checkpointed: removed %s", path)
