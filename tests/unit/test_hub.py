"""Loading by Hub id from an offline cache built by the test (HF_HUB_OFFLINE=1, no network)."""

import os
from pathlib import Path

import pytest

from eagle31_mla import Eagle31MLAForCausalLM
from tests.support.tiny import published_style_config, same_logits, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

REPO = "lightseekorg/kimi-k3-eagle3.1-mla"


def add_snapshot(cache: Path, commit: str, model, ref: str) -> None:
    """The huggingface_hub cache layout: models--org--name/{snapshots/<commit>/, refs/<ref>}."""
    repo = cache / ("models--" + REPO.replace("/", "--"))
    write_checkpoint(repo / "snapshots" / commit, published_style_config(model), model.state_dict())
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


def test_load_by_repo_id_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model, older = tiny_drafter(seed=21), tiny_drafter(seed=22)
    add_snapshot(Path(os.environ["HF_HUB_CACHE"]), "a" * 40, model, ref="main")
    add_snapshot(Path(os.environ["HF_HUB_CACHE"]), "b" * 40, older, ref="v1")
    for revision, expected in ((None, model), ("b" * 40, older), ("v1", older)):
        assert same_logits(Eagle31MLAForCausalLM.from_pretrained(REPO, revision=revision), expected)
