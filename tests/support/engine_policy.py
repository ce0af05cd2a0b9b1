"""The one kind of skip a run that requires an engine accepts (see the engine policy in tests/conftest.py)."""

import importlib

import pytest

ENGINE_VERSION_SKIP = "inapplicable to this engine version: "


def engine_version_skip(engine: str, reason: str):
    """Skip a test that cannot apply to the installed release of ``engine`` (named in the reason, with
    its version): the one kind of skip a run that requires the engine accepts."""
    version = getattr(importlib.import_module(engine), "__version__", "?")
    pytest.skip(f"{ENGINE_VERSION_SKIP}{engine} {version}: {reason}")
