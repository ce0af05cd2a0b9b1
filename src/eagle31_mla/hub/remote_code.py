"""modeling/, the remote code a Hub repo carries for ``trust_remote_code=True``: each file of
:data:`REMOTE_CODE_FILES` under a banner (``python scripts/sync_modeling.py``); tests fail on any :func:`drift`.
"""

from __future__ import annotations

from pathlib import Path

from ..model.configuration_eagle31_mla import REMOTE_CODE_FILES

PACKAGE = Path(__file__).resolve().parents[1] / "model"
MODELING = PACKAGE.parents[2] / "modeling"  # a source checkout's modeling/


def generated(name: str) -> str:
    """What ``modeling/<name>`` must hold: the banner, then the package's file unchanged."""
    return (
        f"# Generated from src/eagle31_mla/model/{name} by scripts/sync_modeling.py: do not edit.\n"
        "# Remote code for `trust_remote_code=True`; needs only torch and transformers.\n"
    ) + (PACKAGE / name).read_text()


def generate(folder: Path = MODELING) -> list[Path]:
    """Write every remote-code file into ``folder`` and remove any other ``.py`` there (a dropped file must not
    linger); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in sorted(folder.glob("*.py")):
        if stale.name not in REMOTE_CODE_FILES:
            stale.unlink()
    for name in REMOTE_CODE_FILES:
        (folder / name).write_text(generated(name))
    return [folder / name for name in REMOTE_CODE_FILES]


def drift(folder: Path = MODELING) -> list[str]:
    """Every way ``folder`` departs from what :func:`generate` would write; empty when in sync."""
    present = {p.name for p in folder.glob("*.py")}
    problems = [f"modeling/{name} is missing" for name in REMOTE_CODE_FILES if name not in present]
    problems += [f"modeling/{name} is not a remote-code file" for name in sorted(present - set(REMOTE_CODE_FILES))]
    problems += [
        f"modeling/{name} drifted from src/eagle31_mla/model/{name}"
        for name in REMOTE_CODE_FILES
        if name in present and (folder / name).read_text() != generated(name)
    ]
    return problems
