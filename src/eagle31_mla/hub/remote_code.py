"""modeling/, the remote code a Hub repo carries for ``trust_remote_code=True``: each file of
:data:`REMOTE_CODE_FILES` under a banner (``python scripts/sync_modeling.py``); tests fail when it drifts.
"""

from __future__ import annotations

from pathlib import Path

from ..model.configuration_eagle31_mla import REMOTE_CODE_FILES

PACKAGE = Path(__file__).resolve().parents[1] / "model"
MODELING = PACKAGE.parents[2] / "modeling"  # a source checkout's modeling/


def generate(folder: Path = MODELING) -> list[Path]:
    """Write every remote-code file into ``folder`` under its banner and remove any other ``.py`` there (a dropped
    file must not linger); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in sorted(folder.glob("*.py")):
        if stale.name not in REMOTE_CODE_FILES:
            stale.unlink()
    for name in REMOTE_CODE_FILES:
        banner = f"# Generated from src/eagle31_mla/model/{name} by scripts/sync_modeling.py: do not edit.\n"
        banner += "# Remote code for `trust_remote_code=True`; needs only torch and transformers.\n"
        (folder / name).write_text(banner + (PACKAGE / name).read_text())
    return [folder / name for name in REMOTE_CODE_FILES]
