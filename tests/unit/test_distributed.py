"""Data-parallel training with FSDP2 under a real torchrun, on CPU with the gloo backend (2 ranks).

The reference is the trainer in one process on the same capture folder and global batch: one rank under
torchrun gives its weights exactly; two ranks differ only by the order in which gloo adds the ranks' parts
of every gradient (float32 rounding, which AdamW carries into the weights: the bound is 1% of how far training
moved each tensor; measured: under 0.1%)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.training.trainer import drafter_from_files
from tests.support.spool_writer import IDS, assert_same_training, capture_folder, trained_weights as weights
from tests.support.subprocesses import run_python
from tests.support.tiny import demo_layer

pytestmark = pytest.mark.slow
TARGET = str(DEMO_DIR / "target")
ARGS = ["--steps", "4", "--batch-size", "4", "--depth", "3", "--lr", "0.1", "--save-every", "2", "--quiet"]
ARGS += ["--draft-config", str(DEMO_DIR / "draft")]  # the demo drafter's small layer, as LAYER gives it
LAYER = demo_layer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    sequences = torch.randint(3, 500, (8, 24), generator=torch.Generator().manual_seed(0))
    return capture_folder(tmp_path_factory.mktemp("dist") / "capture", sequences)


def torchrun(ranks: int, data, out, *extra, fails=False):
    """`torchrun -m eagle31_mla.train` that ends well (``fails``: that fails); its stderr."""
    command = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["-m", "eagle31_mla.train", "--target", TARGET, "--data", str(data), "--out", str(out), *ARGS, *extra]
    result = run_python(command, env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert (result.returncode != 0) == fails, result.stderr[-3000:]
    return result.stderr


def assert_trained_alike(one, two) -> None:
    """Two runs' weights (their folders), from the new drafter every run starts from (the CLI seeds it, --seed 0)."""
    torch.manual_seed(0)
    start = drafter_from_files(TARGET, eagle_aux_hidden_state_layer_ids=IDS, **LAYER)
    assert_same_training(start, weights(one), weights(two), share=0.01)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, data):
    """One rank under torchrun, dense: the baseline several tests compare against (run once)."""
    torchrun(1, data, out := tmp_path_factory.mktemp("one") / "out")
    return out


def test_one_rank_under_torchrun_is_the_in_process_trainer(tmp_path, data, one_rank):
    """The same command without torchrun runs the single-process trainer (``train_on``); with one rank the
    FSDP2 path gives its weights exactly. Both in fresh single-threaded processes (a test process that ran
    other engines may hold other global settings)."""
    command = ["-m", "eagle31_mla.train", "--target", TARGET, "--data", str(data)]
    plain = run_python([*command, "--out", str(tmp_path / "plain"), *ARGS], env={"OMP_NUM_THREADS": "1"})
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert not (tmp_path / "plain" / "training_log.json").exists()  # not the distributed path
    one, reference = weights(one_rank), weights(tmp_path / "plain")
    moved = 0
    for name, p in reference.items():
        assert torch.equal(one[name], p), name
        moved += p.requires_grad
    assert moved > 10


def test_two_ranks_train_what_one_rank_trains(tmp_path, data, one_rank):
    """Same global batch (4 sequences: 2 per rank), same steps. (In micro-batches: the anchored test below.)"""
    torchrun(2, data, two_ranks := tmp_path / "two")
    assert_trained_alike(one_rank, two_ranks)
    # Adam does not see a gradient's scale: the gradient norm does (a loss divided by a rank's own weights,
    # or FSDP's average left uncorrected, would change it by the number of ranks)
    logs = [json.loads((folder / "training_log.json").read_text()) for folder in (one_rank, two_ranks)]
    assert [log["world_size"] for log in logs] == [1, 2] and len(logs[1]["log"]) == 4
    first = [log["log"][0] for log in logs]  # the same weights still: only summation order differs
    assert first[0]["grad_norm"] == pytest.approx(first[1]["grad_norm"], rel=1e-5)
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], rel=1e-5) and first[0]["acc"] == first[1]["acc"]
    for a, b in zip(logs[0]["log"], logs[1]["log"]):  # later steps: after weights moved apart by rounding
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3) and a["loss"] == pytest.approx(b["loss"], 1e-3)


def test_anchored_training_on_two_ranks_in_micro_batches_is_one_ranks(tmp_path, data, one_rank):
    """Each sequence's anchors come from its own index (training.step_anchors), so two ranks holding one
    sequence per micro-batch train at the anchors one rank does: the first step's loss and gradient norm
    equal, the weights within float32 rounding (as above)."""
    anchored = ("--anchors", "5", "--anchor-max-gap", "1")
    torchrun(1, data, tmp_path / "one", *anchored)
    torchrun(2, data, tmp_path / "two", *anchored, "--micro-batch", "1")
    # control: the anchors change what is trained (the dense run is one_rank)
    folders = (tmp_path / "one", tmp_path / "two", one_rank)
    logs = [json.loads((folder / "training_log.json").read_text())["log"] for folder in folders]
    assert logs[0][0]["loss"] == pytest.approx(logs[1][0]["loss"], rel=1e-5)
    assert logs[0][0]["grad_norm"] == pytest.approx(logs[1][0]["grad_norm"], rel=1e-5)
    assert logs[0][0]["loss"] != pytest.approx(logs[2][0]["loss"], rel=1e-3)
    assert_trained_alike(tmp_path / "one", tmp_path / "two")


def test_a_bad_shard_stops_every_rank_before_training(tmp_path):
    sequences = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(1))
    folder = capture_folder(tmp_path / "bad", sequences, per_shard=2)
    shard = folder / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:300])
    assert f"{shard}: not a readable safetensors shard" in torchrun(2, folder, tmp_path / "out", fails=True)
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_a_batch_the_ranks_cannot_share_is_refused(tmp_path, data):
    stderr = torchrun(2, data, tmp_path / "out", "--batch-size", "3", fails=True)
    assert "--batch-size 3 must be a multiple of the number of ranks (2)" in stderr
