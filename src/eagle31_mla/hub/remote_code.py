"""modeling/ -- the remote code a Hub repo carries for ``trust_remote_code=True`` -- generated from eagle31_mla.model.

The library is the one source of truth: each file of :data:`REMOTE_CODE_FILES` is copied under a banner
into the checkout's ``modeling/`` folder. :func:`generate` writes them (``python scripts/sync_modeling.py``),
:func:`drift` says which differ (tests/unit/test_remote_code.py fails on any).
"""

from __future__ import annotations

from pathlib import Path

from ..model.configuration_eagle31_mla import REMOTE_CODE_FILES

__all__ = ["REMOTE_CODE_FILES", "PACKAGE", "MODELING", "banner", "generated", "generate", "drift"]

#: Where the sources are (the model package) and where the generated copies go (a source checkout's modeling/).
PACKAGE = Path(__file__).resolve().parents[1] / "model"
MODELING = PACKAGE.parents[2] / "modeling"


def banner(name: str) -> str:
    return (
        f"# Generated from src/eagle31_mla/model/{name} by scripts/sync_modeling.py: do not edit.\n"
        "# Remote code for `trust_remote_code=True`; needs only torch and transformers.\n"
    )


def generated(name: str) -> str:
    """What ``modeling/<name>`` must hold: the banner, then the package's file unchanged."""
    return banner(name) + (PACKAGE / name).read_text()


def generate(folder: Path = MODELING) -> list[Path]:
    """Write every remote-code file into ``folder``, and remove any other ``.py`` there (a file dropped
    from :data:`REMOTE_CODE_FILES` must not linger in the copies); returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in sorted(folder.glob("*.py")):
        if stale.name not in REMOTE_CODE_FILES:
            stale.unlink()
    written = []
    for name in REMOTE_CODE_FILES:
        (folder / name).write_text(generated(name))
        written.append(folder / name)
    return written


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
