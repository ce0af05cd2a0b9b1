"""The drafts both engine plugins' tests serve: one tiny MLA drafter, its aux ids in every config form."""

from __future__ import annotations

from pathlib import Path

from tests.support.engine_configs import K3_IDS
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

K3_LAYERS = 93
FORMS = ["published", "training", "top_level", "both", "exported"]


def write_draft(folder: Path, form: str, ids=K3_IDS) -> Path:
    sizes = dict(hidden_size=128, target_hidden_size=128, target_num_hidden_layers=None)
    model = tiny_drafter(eagle_aux_hidden_state_layer_ids=ids, **sizes)
    if form == "exported":
        model.save_pretrained(folder)  # this library's own files: labelled one-based ids, auto_map, remote code
        return folder
    return write_checkpoint(folder, published_style_config(model, ids_form=form), model.state_dict())


def write_drafts(root: Path) -> dict[str, Path]:
    return {form: write_draft(root / f"draft-{form}", form) for form in FORMS}
