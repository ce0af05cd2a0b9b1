"""Captured target states on disk (eagle31_mla.training.captured) and training from them, without an engine.

The states here come from a Transformers target (the library's own capture), written in the capture
format with every token's log-probability kept (top-k = the vocabulary): training from the folder must
then give the drafter that training against the live target gives. The vLLM side is in
tests/engines/test_vllm_capture.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from eagle31_mla.decoding.target import capture_target_states
from eagle31_mla.model.aux_layers import AuxLayerIds
from eagle31_mla.training.captured import (
    MANIFEST,
    CapturedDataError,
    CapturedStates,
    CaptureManifest,
    bytes_per_token,
    inputs_digest,
    read_manifest,
    write_manifest,
    write_shard,
)
from eagle31_mla.training.trainer import CapturedTarget, TrainingConfig, drafter_for_target, train_drafter, train_on
from tests.support.tiny import demo_layer

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

IDS = AuxLayerIds((1, 2, 4))


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    from eagle31_mla.demo import DEMO_DIR

    return AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sequences():
    return torch.randint(3, 500, (6, 24), generator=torch.Generator().manual_seed(0))


def capture_folder(folder, target, sequences, *, top_k=None, per_shard=4, dtype=torch.float32, layers=IDS):
    """What `eagle31-mla capture` writes, from the Transformers target (every log-probability kept);
    ``layers``: the layers really captured, labelled as IDS (a control: a capture one layer off)."""
    vocab = target.config.vocab_size
    top_k = top_k or vocab
    manifest = CaptureManifest(
        target={
            "name": "demo",
            "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": 4,
            "hidden_size": 128,
            "vocab_size": vocab,
        },
        aux_layer_ids=list(IDS.one_based),
        dtype=str(dtype).removeprefix("torch."),
        top_k=top_k,
        inputs_sha256=inputs_digest(sequences.tolist()),
        num_inputs=len(sequences),
        engine="transformers",
    )
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for i, seq in enumerate(sequences):
        aux, probs = capture_target_states(target, seq[None], layers)
        logprobs, ids = torch.log(probs[0]).topk(top_k, dim=-1)
        items.append((i, seq, aux[0].view(len(seq), len(IDS), -1).to(dtype), logprobs, ids))
    for start in range(0, len(items), per_shard):
        manifest.shards.append(write_shard(folder, len(manifest.shards), items[start : start + per_shard]))
    write_manifest(folder, manifest)
    return folder


def test_a_capture_reads_back_what_was_captured(tmp_path, target, sequences):
    folder = capture_folder(tmp_path / "c", target, sequences)
    data = CapturedStates(folder, aux_layer_ids=IDS.one_based)
    assert len(data) == 6 and data.complete and data.longest == 24
    for i in (0, 5):
        ids, aux, logprobs, top = data.sequence(i)
        reference_aux, reference_probs = capture_target_states(target, sequences[i][None], IDS)
        assert torch.equal(ids, sequences[i]) and torch.equal(aux, reference_aux[0])  # stored as computed
        # exp(log p) renormalised: equal to the softmax within float32 rounding of the log and exp
        assert torch.allclose(data.target_probs(i, 512), reference_probs[0], rtol=1e-5, atol=1e-7)
        assert torch.equal(data.loss_mask(i), torch.ones(24))  # a text capture trains on every token
    # aux in bf16, top-k log-probabilities (f32) and ids (i32), the token id (i64), the mask byte
    assert bytes_per_token(3, 7168, torch.bfloat16, 64) == 3 * 7168 * 2 + 64 * 8 + 8 + 1


def test_training_from_a_capture_gives_the_drafter_live_training_gives(tmp_path, target, sequences):
    """Same sequences, same steps: the only difference is exp(log p) instead of p (float32 rounding, about
    1e-7 relative). AdamW carries it into the weights: each trained tensor of the two drafters differs by
    under 5% of how far training moved it (measured with the demo drafter's layer: 0.2% on torch 2.13; more than
    1% once on torch 2.14 in a full-suite process); frozen ones are equal. The control below, a capture one
    layer off, is far outside."""
    folder = capture_folder(tmp_path / "c", target, sequences)
    start = drafter_for_target(target, eagle_aux_hidden_state_layer_ids=list(IDS.one_based), **demo_layer())
    config = dict(steps=4, batch_size=2, seq_len=24, depth=3, lr=3e-3, warmup=1, save_every=100)
    live = train_drafter(target, copy.deepcopy(start), sequences, tmp_path / "live", TrainingConfig(**config), False)
    captured = train_on(
        CapturedTarget(CapturedStates(folder), 512),
        copy.deepcopy(start),
        tmp_path / "cap",
        TrainingConfig(**config),
        progress=False,
    )
    assert_same_training(start, live, captured, share=0.05)
    # control: the same capture one layer off at its last aux id trains a drafter the check tells apart
    shifted = capture_folder(tmp_path / "shifted", target, sequences, layers=AuxLayerIds((1, 2, 3)))
    wrong = train_on(
        CapturedTarget(CapturedStates(shifted), 512),
        copy.deepcopy(start),
        tmp_path / "w",
        TrainingConfig(**config),
        progress=False,
    )
    with pytest.raises(AssertionError):
        assert_same_training(start, live, wrong, share=0.05)


def assert_same_training(start, a, b, share: float = 0.01) -> None:
    for (name, x), (_, y), (_, s) in zip(a.named_parameters(), b.named_parameters(), start.named_parameters()):
        if not s.requires_grad:
            assert torch.equal(x, y) and torch.equal(x, s), name
            continue
        moved = (x - s).abs().max()
        assert moved > 1e-3, name  # training moved it: the comparison is not of two untouched copies
        assert (x - y).abs().max() <= share * moved, (name, float((x - y).abs().max() / moved))


def test_sequences_of_different_lengths_are_padded_and_masked(tmp_path, target, sequences):
    folder = tmp_path / "c"
    capture_folder(folder, target, sequences[:2])
    short = sequences[2, :10]
    aux, probs = capture_target_states(target, short[None], IDS)
    logprobs, ids = torch.log(probs[0]).topk(512, dim=-1)
    manifest = read_manifest(folder)
    manifest.shards.append(write_shard(folder, 1, [(2, short, aux[0].view(10, 3, -1), logprobs, ids)]))
    manifest.num_inputs = 3
    write_manifest(folder, manifest)
    batch, aux_b, probs_b, mask = CapturedTarget(CapturedStates(folder), 512).batch(torch.tensor([2, 0]), IDS)
    assert batch.shape == (2, 24) and mask[0].tolist() == [1] * 10 + [0] * 14 and mask[1].eq(1).all()
    assert torch.equal(batch[0, :10], short) and aux_b[0, 10:].eq(0).all() and probs_b[0, 10:].eq(0).all()


# ---- what is refused, by class ---------------------------------------------------------------------


def _corrupt_tensor(folder, name, make):
    from safetensors.torch import load_file, save_file

    tensors = load_file(_shard(folder))
    make(tensors, name)
    save_file(tensors, _shard(folder))


def _shard(folder):
    return folder / "shard-00000.safetensors"


# the damage users actually meet: a copy cut short or partial, another capture's files, another library version
CORRUPTIONS = {
    "truncated": (lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:500]), "not a readable safetensors shard"),
    "missing shard": (lambda f: (f / "shard-00001.safetensors").unlink(), "listed in the manifest but missing"),
    "another hidden size": (
        lambda f: _corrupt_tensor(f, "aux", lambda t, n: t.update({n: t[n][..., :64].contiguous()})),
        "`aux` is F32 [96, 3, 64]; the manifest (3 aux layers, hidden size 128, top-16, 4 sequences, 96 tokens) "
        "needs F32 [96, 3, 128]",
    ),
    "another dtype": (lambda f: _corrupt_tensor(f, "aux", lambda t, n: t.update({n: t[n].double()})), "`aux` is F64"),
    "a tensor missing": (lambda f: _corrupt_tensor(f, "topk_ids", lambda t, n: t.pop(n)), "tensors ["),
    "loss mask values": (lambda f: _corrupt_tensor(f, "loss_mask", lambda t, n: t[n].fill_(2)), "holds [2]"),
    "offsets disagree": (
        lambda f: _corrupt_tensor(f, "offsets", lambda t, n: t.update({n: t[n].flip(0)})),
        "disagree with the manifest",
    ),
    "manifest not json": (lambda f: (f / MANIFEST).write_text("{"), "not a readable manifest"),
    "manifest of another format": (lambda f: (f / MANIFEST).write_text('{"format": "x"}'), "not a capture manifest"),
    "manifest version": (lambda f: _edit_manifest(f, version=1), "format version 1"),
    "manifest field": (lambda f: _edit_manifest(f, surprise=1), "unexpected manifest fields"),
    "twice": (lambda f: _edit_manifest(f, shards=lambda s: s + s[:1]), "captured twice"),
    "no manifest": (lambda f: (f / MANIFEST).unlink(), "no manifest.json"),
}


def _edit_manifest(folder, **changes):
    raw = json.loads((folder / MANIFEST).read_text())
    for key, value in changes.items():
        raw[key] = value(raw[key]) if callable(value) else value
    (folder / MANIFEST).write_text(json.dumps(raw))


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_capture_is_refused_by_name_before_training(tmp_path, target, sequences, corruption):
    folder = capture_folder(tmp_path / "c", target, sequences, top_k=16)
    damage, message = CORRUPTIONS[corruption]
    damage(folder)
    with pytest.raises(CapturedDataError) as err:
        CapturedStates(folder)
    assert message in str(err.value) and str(folder) in str(err.value)


def test_other_aux_layers_than_the_drafters_are_refused(tmp_path, target, sequences):
    folder = capture_folder(tmp_path / "c", target, sequences, top_k=16)
    with pytest.raises(CapturedDataError, match=r"captured at aux layers \[1, 2, 4\].*reads \[2, 3, 4\]"):
        CapturedStates(folder, aux_layer_ids=[2, 3, 4])


def test_an_interrupted_write_leaves_the_old_file(tmp_path, target, sequences, monkeypatch):
    """Written under a temporary name and renamed: a failure mid-write leaves the previous manifest and
    no temporary file behind."""
    import safetensors.torch

    folder = capture_folder(tmp_path / "c", target, sequences[:4], top_k=16)
    before = (folder / MANIFEST).read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_shard(folder, 1, [(4, sequences[4], torch.zeros(24, 3, 128), torch.zeros(24, 16), torch.zeros(24, 16))])
    assert (folder / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "shard-00000.safetensors"]
