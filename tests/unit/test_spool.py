"""Online training through a spool (eagle31_mla.training.spool), without an engine: the capture side is
tests/support/spool_writer.py; the trainer is the real CLI, alone and under torchrun. Killing either side, then
rerunning the same commands, ends with the uninterrupted run's weights exactly: the stream's order and every step
are functions of the spool's content, and resuming from a checkpoint is exact. (The vLLM capture through a
spool: tests/engines/test_vllm_capture.py.)"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.training.captured import MANIFEST, CapturedDataError, CaptureManifest
from eagle31_mla.training.spool import FollowedCapture, FollowTarget, part_folder
from eagle31_mla.training.trainer import TrainingConfig
from tests.support import spool_writer
from tests.support.paths import ROOT
from tests.support.spool_writer import input_sequences, trained_weights as weights

TARGET = str(DEMO_DIR / "target")
FAST_POLL = {"EAGLE31_SPOOL_POLL_S": "0.02"}
TRAIN = ["--target", TARGET, "--draft-config", str(DEMO_DIR / "draft"), "--batch-size", "4", "--depth", "2"]
TRAIN += ["--lr", "0.05", "--save-every", "2", "--seed", "1", "--quiet"]
SHARD = 3 * 128 * 4 + 64 * 8 + 9  # bytes per token of the writer's shards (float32 aux, top-64)


# ---- the protocol, in one process --------------------------------------------------------------------------


# 2 aux of 8, top-4
TINY = CaptureManifest(dict(num_hidden_layers=2, hidden_size=8, vocab_size=512), [1, 2], "float32", 4, "", 0, "test")


def fake_states(sequences):
    """run_target for write_shards: token ids as given, zero states."""
    n = [len(s) for s in sequences]
    return lambda chunk: [
        (i, torch.tensor(sequences[i]), torch.zeros(n[i], 2, 8), torch.zeros(n[i], 4), torch.zeros(n[i], 4))
        for i in chunk
    ]


def write_part(spool: Path, sequences, part: int, parts: int, max_bytes: int, limit=None):
    """Part ``part`` of ``parts`` of ``sequences`` into ``spool`` in shards of 2; ``limit`` shards at most."""
    manifest = copy.deepcopy(TINY)
    kw = dict(part=part, parts=parts, limit=limit, say=lambda _: None)
    return spool_writer.write_part(spool, sequences, fake_states, manifest, max_bytes, **kw)


def test_the_stream_order_is_the_spools_content_not_its_timing(tmp_path):
    """Two parts, shards of 2: part 1 holds inputs 0, 2, 4, ...; the stream takes shard 0 of each part, then
    shard 1 of each, ... A part that has written ahead waits for the other's shard: what is ready depends only
    on what is written, in that order."""
    sequences = [[3 + i] * (5 + i % 3) for i in range(9)]  # input i's tokens: 3 + i; part 1 has 5, part 2 has 4
    spool = tmp_path / "spool"
    write_part(spool, sequences, 1, 2, 10**9, limit=2)  # part 1 ahead: shards 0, 1 (inputs 0, 2 and 4, 6)
    write_part(spool, sequences, 2, 2, 10**9, limit=0)  # part 2 has only its manifest
    data = FollowedCapture(spool, say=lambda _: None)
    assert len(data) == 9 and data.ready(2) and not data.ready(3)  # part 2's shard 0 comes third
    write_part(spool, sequences, 2, 2, 10**9)  # part 2 complete (shards 0, 1)
    assert data.ready(8) and not data.ready(9)  # part 1's last shard (input 8) is not written
    write_part(spool, sequences, 1, 2, 10**9)
    assert data.ready(9)
    assert [data.sequence(i)[0].tolist() for i in range(9)] == [sequences[i] for i in (0, 2, 1, 3, 4, 6, 5, 7, 8)]


def test_a_full_spool_stops_the_capture_until_the_trainer_takes_shards(tmp_path):
    """A cap of two shards: the capture writes two and waits, holding the cap; once the trainer releases the
    first shard (trained and checkpointed), the capture writes the next. The sizes it plans are upper bounds
    of the files written."""
    sequences = [[5] * 200 for _ in range(8)]  # shards of 42 KB: the header's allowance (4 KB) is small beside them
    one = spool_writer.plan([200, 200], TINY)["shard_bytes"]
    spool = tmp_path / "spool"
    writer = threading.Thread(target=write_part, args=(spool, sequences, 1, 1, 2 * one + 10))
    writer.start()
    folder = part_folder(spool, 1, 1)
    deadline = time.monotonic() + 30
    while len(list(folder.glob("shard-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the writer has had time to write a third shard, were it not waiting
    shards = sorted(folder.glob("shard-*"))
    assert len(shards) == 2 and writer.is_alive()
    assert all(one >= p.stat().st_size > one - 4096 - 64 for p in shards)  # the plan bounds each file from above
    data = FollowedCapture(spool, say=lambda _: None)
    assert data.ready(4) and data.release(3) == [shards[0]]  # shard 1 (positions 2, 3) is not wholly trained
    deadline = time.monotonic() + 30
    while not (folder / "shard-00002.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (folder / "shard-00002.safetensors").exists() and not shards[0].exists()
    data.release(8)  # frees the spool
    data.wait_for(8)
    data.release(8)
    writer.join(30)
    assert not writer.is_alive() and not list(folder.glob("shard-*")) and (folder / MANIFEST).is_file()


def test_more_epochs_keep_every_shard_to_the_end(tmp_path):
    """--epochs 2: the first pass in the order written, the second a shuffle of it; every sequence trained
    twice; nothing is removed before the last step's checkpoint, everything after it."""
    sequences = [[4] * 6 for _ in range(7)]
    spool = tmp_path / "spool"
    write_part(spool, sequences, 1, 1, 10**9)
    data = FollowedCapture(spool, say=lambda _: None)
    states, config = FollowTarget(data, 16, epochs=2), TrainingConfig(batch_size=3, seed=0)
    steps = 5  # 7 sequences twice, 3 per step
    order = [int(i) for step in range(steps) for i in states.step_indices(step, config)]
    assert order[:7] == list(range(7)) and sorted(order[7:]) == list(range(7))
    assert order[7:] != list(range(7))
    folder = part_folder(spool, 1, 1)
    for step in range(1, steps):
        states.checkpointed(step, config)
        assert len(list(folder.glob("shard-*"))) == 4, step
    states.checkpointed(steps, config)
    assert not list(folder.glob("shard-*"))


def test_what_a_spool_cannot_carry_is_refused_before_anything_runs(tmp_path):
    """A shard larger than a part's share; --epochs 2 on a capture larger than the cap; a step reading more
    shards than the share holds. (The options that only mean something together: tests/unit/test_training.py.)"""
    with pytest.raises(CapturedDataError, match=r"argument --max-spool-gb: a shard of 4 sequences .* 2 parts"):
        spool_writer.plan([10] * 8, TINY, parts=2, max_bytes=2000, sequences_per_shard=4)
    sequences = [[4] * 6 for _ in range(12)]
    spool = tmp_path / "spool"
    size = spool_writer.plan([6, 6], TINY)["shard_bytes"]
    write_part(spool, sequences, 1, 1, 3 * size, limit=1)  # room for 3 of its 6 shards
    data = FollowedCapture(spool, say=lambda _: None)
    data.check_plan(4, 1)  # 4 sequences touch at most 3 shards of 2
    with pytest.raises(CapturedDataError, match="argument --epochs: 2 epochs keep every shard"):
        data.check_plan(4, 2)
    with pytest.raises(CapturedDataError, match="argument --batch-size: a step of 6 sequences reads up to 4 shards"):
        data.check_plan(6, 1)


# ---- real processes ----------------------------------------------------------------------------------------


def launch(command: list[str], env: dict) -> subprocess.Popen:
    """A process whose output goes to a file (``process.log``): a pipe would be held open by whatever outlives
    it (torchrun's ranks run in sessions of their own)."""
    log = tempfile.NamedTemporaryFile("w+", prefix="spool-test-", suffix=".log", delete=False)
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    process.log = log.name
    log.close()
    return process


def writer(out: Path, *extra: str) -> subprocess.Popen:
    return launch([sys.executable, "-m", "tests.support.spool_writer", str(out), *extra], FAST_POLL)


def trainer(data: Path, out: Path, *extra: str, ranks: int = 0, env=None) -> subprocess.Popen:
    """`eagle31-mla train --data DATA --follow` (under torchrun with ``ranks`` ranks)."""
    module = ["-m", "eagle31_mla.cli", "train"]
    if ranks:
        module = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "eagle31_mla.train"]
    command = [sys.executable, *module, *TRAIN, "--data", str(data), "--out", str(out), "--follow", *extra]
    return launch(command, {**FAST_POLL, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})})


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    """Its output, once it has ended well."""
    process.wait(timeout=timeout)
    printed = Path(process.log).read_text()
    assert process.returncode == 0, printed[-3000:]
    return printed


def kill(process: subprocess.Popen) -> None:
    """SIGKILL to the process and everything it started (torchrun's ranks are in sessions of their own), as a
    job's end kills a job: nothing runs a handler. Returns once the orphans are dead (or zombies: init may not reap)."""
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while any(running(p) for p in tree[1:]) and time.monotonic() < deadline:
        time.sleep(0.05)


def running(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return p.status() != psutil.STATUS_ZOMBIE
    return False


def spool_bytes(spool: Path) -> int:
    return sum(p.stat().st_size for p in spool.glob("part-*/shard-*") if p.is_file())


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """The capture stored whole first (no spool): what capture-then-train trains on."""
    folder = tmp_path_factory.mktemp("stored") / "capture"
    finish(writer(folder))
    return folder


def cap_below_the_capture(parts: int) -> int:
    """Room for 3 shards of 2 of the longest sequences per part: a step of 4 sequences (up to 3 shards of one
    part, 2 of each of two) fits; the whole capture (21 sequences of 10-24 tokens) does not."""
    total = sum(len(s) for s in input_sequences()) * SHARD
    cap = parts * 3 * (48 * SHARD + 2 * 16 + 8 + 4096)
    assert cap < total
    return cap


@pytest.mark.slow
def test_two_captures_and_a_trainer_at_once_train_what_capture_then_train_does(tmp_path, stored):
    """Two capture processes (parts 1/2 and 2/2, one slower) and `train --follow` at once, through a spool capped
    below the capture's size: the capture waits for room (and says so), the spool never holds more than the cap,
    and the drafter is capture-then-train's: the same two parts stored whole first, then `train --follow`
    (bit for bit: the same batches in the same order, the same ops). A stored capture (`capture --out`) trains
    in another order (the input order): a different drafter, the control."""
    spool, cap = tmp_path / "spool", cap_below_the_capture(2)
    parts = [
        writer(spool, "--spool-bytes", str(cap), "--part", f"{p}/2", "--shard-delay", d)
        for p, d in ((1, "0"), (2, "0.1"))
    ]
    deadline = time.monotonic() + 120
    while len(list(spool.glob("part-*/shard-*"))) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)  # both captures fill their shares (3 shards each) and wait
    train = trainer(spool, tmp_path / "online")
    peak = 0
    while train.poll() is None:
        peak = max(peak, spool_bytes(spool))
        time.sleep(0.01)
    finish(train)
    outputs = [finish(p) for p in parts]
    assert peak <= cap and any("spool full" in err for err in outputs), (peak, cap)
    assert not list(spool.glob("part-*/shard-*"))  # every shard trained, checkpointed, removed
    assert all((spool / f"part-{p}-of-2" / MANIFEST).is_file() for p in (1, 2))  # the capture's record stays

    whole = tmp_path / "whole"  # capture-then-train: the same two parts, written whole, then trained on
    for p in (1, 2):
        finish(writer(whole, "--spool-bytes", str(10**9), "--part", f"{p}/2"))
    finish(trainer(whole, tmp_path / "after"))
    online, after = weights(tmp_path / "online"), weights(tmp_path / "after")
    log = json.loads((tmp_path / "online" / "training.json").read_text())
    assert log["steps"] == 6  # 21 sequences, 4 per step
    for name, p in after.items():
        assert torch.equal(online[name], p), name
    finish(trainer(stored, tmp_path / "input-order"))
    other = weights(tmp_path / "input-order")
    assert any(not torch.equal(other[name], p) for name, p in after.items())


@pytest.mark.slow
def test_killing_either_side_at_any_moment_then_rerunning_gives_the_uninterrupted_weights(tmp_path, stored):
    """A capture process and a 2-rank torchrun trainer through a capped spool. The capture is killed (SIGKILL) at
    random moments twice and rerun; the trainer's rank 1 dies at step 3, then the rerun trainer is killed at a
    random moment, and rerun again. The dead rank leaves the step-2 checkpoint named and no export; the end: the
    weights of the trainer run once, uninterrupted, on the stored capture (bit for bit), every shard removed, one
    checkpoint kept. The last step has one sequence: rank 1 runs it without a loss."""
    from eagle31_mla.training.distributed import KILL_ENV, LATEST

    rng = random.Random(os.getpid())
    spool, cap, out = tmp_path / "spool", cap_below_the_capture(1), tmp_path / "out"
    capture = ["--spool-bytes", str(cap), "--shard-delay", "0.05"]
    first = trainer(spool, out, ranks=2, env={KILL_ENV: "1:3"})  # before the spool folder exists
    for _ in range(2):  # the capture killed at a random moment: starting, computing, writing or waiting
        process = writer(spool, *capture)
        time.sleep(rng.uniform(2.0, 6.0))
        kill(process)
    capturing = writer(spool, *capture)
    first.wait(timeout=300)
    assert first.returncode != 0  # rank 1 died at step 3
    assert (out / "checkpoint" / LATEST).read_text() == "step-00000002" and not (out / "config.json").exists()
    second = trainer(spool, out, ranks=2)
    time.sleep(rng.uniform(5.0, 12.0))
    kill(second)
    finish(trainer(spool, out, ranks=2))
    finish(capturing)
    uninterrupted = tmp_path / "uninterrupted"
    finish(trainer(stored, uninterrupted, ranks=2))
    finished, reference = weights(out), weights(uninterrupted)
    for name, p in reference.items():
        assert torch.equal(finished[name], p), name
    assert not list(spool.glob("part-*/shard-*"))
    log = json.loads((out / "training_log.json").read_text())
    assert [entry["step"] for entry in log["log"]] == list(range(1, 7)) and log["world_size"] == 2
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [LATEST, "step-00000006"]


# ---- a spool is data, not instructions (issue 33) ----------------------------------------------------------


SHARD0 = "part-1-of-1/shard-00000.safetensors"


def _edit(spool: Path, change) -> None:
    spool_writer.edit_manifest(part_folder(spool, 1, 1), change)


def _entry(field, value):
    return lambda spool, victim: _edit(spool, lambda m: m["shards"][0].update({field: value(victim)}))


def _link_shard(spool: Path, victim: Path) -> None:
    shard = spool / SHARD0
    victim.write_bytes(shard.read_bytes())  # a real shard, elsewhere: trained on, then removed, were it followed
    shard.unlink()
    shard.symlink_to(victim)


def _link_part(spool: Path, victim: Path) -> None:
    part = part_folder(spool, 1, 1)
    elsewhere = victim.parent / "elsewhere"
    part.rename(elsewhere)
    part.symlink_to(elsewhere)


def _tensor(name, change):
    return lambda spool, victim: spool_writer.edit_tensors(spool / SHARD0, lambda tensors: change(tensors[name]))


HOSTILE = {  # what a manifest or shard may say, and the one line it must end in
    "a path out of the spool": (_entry("file", lambda v: "../../victim"), "`shards[0].file` must be a shard name"),
    "an absolute path": (_entry("file", str), "`shards[0].file` must be a shard name of this folder"),
    "a shard that is a link": (_link_shard, f"{SHARD0}: a link; a capture writes its shards as regular files"),
    "a part that is a link": (_link_part, "part-1-of-1: a link out of the spool"),
    "an entry without its file": (
        lambda spool, v: _edit(spool, lambda m: m["shards"][0].pop("file")),
        "`shards[0]` must be an object with keys ['file', 'input_index', 'sequences', 'tokens']",
    ),
    "a count of the wrong type": (_entry("tokens", lambda v: "96"), "`shards[0].tokens` must be an integer >= 2"),
    "a top-k that is not a count": (lambda s, v: _edit(s, lambda m: m.update(top_k=1.5)), "`top_k` must be a positive"),
    "a target without its depth": (
        lambda s, v: _edit(s, lambda m: m["target"].pop("num_hidden_layers")),
        "`target.num_hidden_layers` must be a positive integer, got None",
    ),
    "an aux id past the target": (
        lambda s, v: _edit(s, lambda m: m.update(aux_layer_ids=[1, 2, 99])),
        "`aux_layer_ids` must be ids of the target's layers, at most num_hidden_layers",
    ),
    "NaN log-probabilities": (
        _tensor("topk_logprobs", lambda t: t[0].fill_(float("nan"))),
        f"{SHARD0}: `topk_logprobs` of sequence 0 holds values other than log-probabilities",
    ),
    "a top-k id outside the vocabulary": (
        _tensor("topk_ids", lambda t: t[1].fill_(512)),
        f"{SHARD0}: `topk_ids` of sequence 0 holds values other than token ids in [0, 512)",
    ),
    "a negative token id": (_tensor("token_ids", lambda t: t[0].fill_(-1)), "`token_ids` of sequence 0 holds"),
    "infinite aux states": (_tensor("aux", lambda t: t[0].fill_(float("inf"))), "`aux` of sequence 0 holds values"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_spool_is_refused_by_name_and_every_file_stays(tmp_path, capsys, case):
    """`train --data SPOOL --follow` on a spool whose manifest or shard lies: exit 2 with one line naming the file
    and the field, before any step; no file in or outside the spool is removed or changed, nothing is written."""
    from eagle31_mla.cli import main

    spool, victim = tmp_path / "spool", tmp_path / "victim"
    victim.write_bytes(b"not yours")
    manifest = CaptureManifest(spool_writer.DEMO, spool_writer.IDS, "float32", spool_writer.TOP_K, "", 0, "t")
    spool_writer.write_part(spool, input_sequences()[:4], spool_writer.demo_states, manifest, 10**9, say=lambda _: None)
    damage, message = HOSTILE[case]
    damage(spool, victim)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["train", *TRAIN, "--data", str(spool), "--follow", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "out").exists()
