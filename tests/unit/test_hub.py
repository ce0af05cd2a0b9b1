"""Loading by Hub id from an offline cache built by the test (HF_HUB_OFFLINE=1, no network)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle31_mla import Eagle31MLAForCausalLM
from tests.support.tiny import aux_inputs, published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

REPO = "lightseekorg/kimi-k3-eagle3.1-mla"


def add_snapshot(cache: Path, repo: str, commit: str, source: Path, ref: str | None = "main") -> None:
    """The huggingface_hub cache layout: models--org--name/{snapshots/<commit>/, refs/<ref>}."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(source, repo_dir / "snapshots" / commit)
    if ref:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)


def test_load_by_repo_id_offline(tmp_path):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    cache = Path(os.environ["HF_HUB_CACHE"])
    model = tiny_drafter(seed=21)
    older = tiny_drafter(seed=22)
    add_snapshot(
        cache, REPO, "a" * 40, write_checkpoint(tmp_path / "v2", published_style_config(model), model.state_dict())
    )
    add_snapshot(
        cache,
        REPO,
        "b" * 40,
        write_checkpoint(tmp_path / "v1", published_style_config(older), older.state_dict()),
        ref="v1",
    )

    ids, aux = aux_inputs(model.config, 1, 5)
    # Exact on purpose: the same weights (a copy through the file), the same kernels on the same shapes.
    latest = Eagle31MLAForCausalLM.from_pretrained(REPO)
    assert torch.equal(latest(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)
    pinned = Eagle31MLAForCausalLM.from_pretrained(REPO, revision="b" * 40)
    assert torch.equal(pinned(ids, aux_hidden_states=aux).logits, older(ids, aux_hidden_states=aux).logits)
    by_tag = Eagle31MLAForCausalLM.from_pretrained(REPO, revision="v1")
    assert torch.equal(by_tag(ids, aux_hidden_states=aux).logits, older(ids, aux_hidden_states=aux).logits)


def test_unknown_repo_offline_fails_clearly():
    with pytest.raises(Exception, match="(?i)offline|cannot find|local"):
        Eagle31MLAForCausalLM.from_pretrained("lightseekorg/not-in-the-cache")
