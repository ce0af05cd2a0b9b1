"""Loading by Hub id from an offline cache built by the test (HF_HUB_OFFLINE=1, no network)."""

import pytest

from eagle31_mla import Eagle31MLAForCausalLM
from tests.support.tiny import add_to_hub_cache, published_style_config, same_logits, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers

REPO = "someone/tiny-drafter"  # not the published id: serve-command and doctor would find it in the cache


def test_load_by_repo_id_offline(tmp_path):
    model, older = tiny_drafter(seed=21), tiny_drafter(seed=22)
    for commit, drafter, ref in (("a" * 40, model, "main"), ("b" * 40, older, "v1")):
        folder = write_checkpoint(tmp_path / ref, published_style_config(drafter), drafter.state_dict())
        add_to_hub_cache(REPO, commit, [folder / "config.json", folder / "model.safetensors"], ref)
    for revision, expected in ((None, model), ("b" * 40, older), ("v1", older)):
        assert same_logits(Eagle31MLAForCausalLM.from_pretrained(REPO, revision=revision), expected)
