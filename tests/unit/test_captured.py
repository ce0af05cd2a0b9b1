"""Captured target states on disk (eagle31_mla.training.captured) and training from them, without an engine:
the demo target's states from Transformers (tests/support/spool_writer.py), every log-probability kept. The vLLM
side: tests/engines/test_vllm_capture.py."""

from __future__ import annotations

import copy

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
    write_manifest,
    write_shard,
)
from eagle31_mla.training.trainer import (
    CapturedTarget,
    TrainingConfig,
    drafter_for_target,
    drafter_from_files,
    train_drafter,
    train_on,
)
from tests.support.spool_writer import assert_same_training, capture_folder, demo_target, edit_manifest, edit_tensors
from tests.support.tiny import demo_layer

pytestmark = pytest.mark.transformers

IDS = AuxLayerIds((1, 2, 4))
SEQUENCES = torch.randint(3, 500, (6, 24), generator=torch.Generator().manual_seed(0))


def test_a_capture_reads_back_what_was_captured(tmp_path):
    data = CapturedStates(capture_folder(tmp_path / "c", SEQUENCES))
    assert len(data) == data.manifest.num_inputs == 6 and data.longest == 24
    assert data.manifest.aux_layer_ids == [1, 2, 4]
    for i in (0, 5):
        ids, aux, logprobs, top = data.sequence(i)
        reference_aux, reference_probs = capture_target_states(demo_target(), SEQUENCES[i][None], IDS)
        assert torch.equal(ids, SEQUENCES[i]) and torch.equal(aux, reference_aux[0])  # stored as computed
        # exp(log p) renormalised: equal to the softmax within float32 rounding of the log and exp
        assert torch.allclose(data.target_probs(i, 512), reference_probs[0], rtol=1e-5, atol=1e-7)
        assert torch.equal(data.loss_mask(i), torch.ones(24))  # a text capture trains on every token
    # aux in bf16, top-k log-probabilities (f32) and ids (i32), the token id (i64), the mask byte
    assert bytes_per_token(3, 7168, torch.bfloat16, 64) == 3 * 7168 * 2 + 64 * 8 + 8 + 1


def test_training_from_a_capture_gives_the_drafter_live_training_gives(tmp_path):
    """Same sequences, same steps: the only difference is exp(log p) instead of p (float32 rounding, about
    1e-7 relative). AdamW carries it into the weights: each trained tensor of the two drafters differs by
    under 5% of how far training moved it (measured with the demo drafter's layer: 0.2% on torch 2.13; more than
    1% once on torch 2.14 in a full-suite process); frozen ones are equal. The control below, a capture one
    layer off, is far outside."""
    target = demo_target()
    start = drafter_for_target(target, eagle_aux_hidden_state_layer_ids=list(IDS.one_based), **demo_layer())
    config = dict(steps=4, batch_size=2, seq_len=24, depth=3, lr=3e-3, warmup=1, save_every=100)
    live = train_drafter(target, copy.deepcopy(start), SEQUENCES, tmp_path / "live", TrainingConfig(**config), False)

    def from_capture(layers):
        folder = capture_folder(tmp_path / f"c{layers[-1]}", SEQUENCES, layers=layers)
        out, config_ = tmp_path / f"d{layers[-1]}", TrainingConfig(**config)
        return train_on(CapturedTarget(CapturedStates(folder), 512), copy.deepcopy(start), out, config_, progress=False)

    assert_same_training(start, live, from_capture([1, 2, 4]), share=0.05)
    # control: the same capture one layer off at its last aux id trains a drafter the check tells apart
    with pytest.raises(AssertionError):
        assert_same_training(start, live, from_capture([1, 2, 3]), share=0.05)


def test_captured_batches_are_padded_and_carry_the_loss_masks(tmp_path):
    """Sequences of different lengths are padded at the end and masked out; a conversation's stored loss mask
    (its non-assistant tokens 0) is carried into the batch; resuming checks the masks (the digest)."""
    masks = [[0, 0, 1, 1, 1], [0, 1, 1]]
    target = dict(name="t", architectures=[], num_hidden_layers=4, hidden_size=8, vocab_size=16)
    digest = inputs_digest([[7] * 5, [7] * 3], masks)
    manifest = CaptureManifest(target, [1, 2], "float32", 2, digest, 2, "test", loss_mask="assistant")
    items = [
        (i, torch.full((n,), 7), torch.ones(n, 2, 8), torch.zeros(n, 2), torch.ones(n, 2), m)
        for i, (n, m) in enumerate(zip((5, 3), masks))
    ]
    manifest.shards.append(write_shard(tmp_path, 0, items))
    write_manifest(tmp_path, manifest)
    ids, aux, probs, mask = CapturedTarget(CapturedStates(tmp_path), 16).batch(torch.tensor([1, 0]), IDS)
    assert mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]] and ids.tolist() == [[7] * 3 + [0] * 2, [7] * 5]
    assert aux[0, :3].eq(1).all() and aux[0, 3:].eq(0).all() and probs[0, :3, 1].eq(1).all()
    assert probs[0, 3:].eq(0).all()
    assert digest != inputs_digest([[7] * 5, [7] * 3])  # a resumed capture must be given the same masks


def test_drafter_from_files_is_drafter_for_target():
    """The drafter a capture trains starts from the target's embeddings and head read from its checkpoint."""
    from eagle31_mla.demo import DEMO_DIR

    a = drafter_from_files(DEMO_DIR / "target", eagle_aux_hidden_state_layer_ids=[1, 2, 4], **demo_layer())
    b = drafter_for_target(demo_target(), eagle_aux_hidden_state_layer_ids=[1, 2, 4], **demo_layer())
    assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight) and torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert a.config.to_dict() == b.config.to_dict() and not a.embed_tokens.weight.requires_grad


# ---- what is refused, by class ---------------------------------------------------------------------


def _shard(folder):
    return folder / "shard-00000.safetensors"


def _tensors(change):
    return lambda folder: edit_tensors(_shard(folder), change)


def _manifest(**changes):
    return lambda folder: edit_manifest(folder, lambda raw: raw.update(changes))


# the damage users actually meet: a copy cut short or partial, another capture's files, another library version
CORRUPTIONS = {
    "truncated": (lambda f: _shard(f).write_bytes(_shard(f).read_bytes()[:500]), "not a readable safetensors shard"),
    "missing shard": (lambda f: (f / "shard-00001.safetensors").unlink(), "listed in the manifest but missing"),
    "another hidden size": (
        _tensors(lambda t: t.update(aux=t["aux"][..., :64].contiguous())),
        "`aux` is F32 [96, 3, 64]; the manifest (3 aux layers, hidden size 128, top-16, 4 sequences, 96 tokens) "
        "needs F32 [96, 3, 128]",
    ),
    "another dtype": (_tensors(lambda t: t.update(aux=t["aux"].double())), "`aux` is F64"),
    "a tensor missing": (_tensors(lambda t: t.pop("topk_ids")), "tensors ["),
    "loss mask values": (_tensors(lambda t: t["loss_mask"].fill_(2)), "holds [2]"),
    "offsets disagree": (_tensors(lambda t: t.update(offsets=t["offsets"].flip(0))), "disagree with the manifest"),
    "manifest not json": (lambda f: (f / MANIFEST).write_text("{"), "not a readable manifest"),
    "manifest of another format": (lambda f: (f / MANIFEST).write_text('{"format": "x"}'), "not a capture manifest"),
    "manifest version": (_manifest(version=1), "format version 1"),
    "manifest field": (_manifest(surprise=1), "unexpected manifest fields"),
    "twice": (lambda f: edit_manifest(f, lambda raw: raw["shards"].append(raw["shards"][0])), "captured twice"),
    "no manifest": (lambda f: (f / MANIFEST).unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_capture_is_refused_by_name_before_training(tmp_path, corruption):
    folder = capture_folder(tmp_path / "c", SEQUENCES, top_k=16)
    damage, message = CORRUPTIONS[corruption]
    damage(folder)
    with pytest.raises(CapturedDataError) as err:
        CapturedStates(folder)
    assert message in str(err.value) and str(folder) in str(err.value)


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    """Written under a temporary name and renamed: a failure mid-write leaves the previous manifest and
    no temporary file behind."""
    import safetensors.torch

    folder = capture_folder(tmp_path / "c", SEQUENCES[:4], top_k=16)
    before = (folder / MANIFEST).read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_shard(folder, 1, [(4, SEQUENCES[4], torch.zeros(24, 3, 128), torch.zeros(24, 16), torch.zeros(24, 16))])
    assert (folder / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "shard-00000.safetensors"]
