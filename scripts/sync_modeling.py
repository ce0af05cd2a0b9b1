#!/usr/bin/env python3
"""Regenerate modeling/ (the remote code shipped inside a Hub repo) from src/eagle31_mla/.

The library is the one source of truth; tests/test_remote_code.py fails when modeling/ drifts.
Run: python scripts/sync_modeling.py
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("aux_layers.py", "configuration_eagle31_mla.py", "modeling_eagle31_mla.py")


def banner(name: str) -> str:
    return (
        f"# Generated from src/eagle31_mla/{name} by scripts/sync_modeling.py: do not edit.\n"
        "# Remote code for `trust_remote_code=True`; needs only torch and transformers.\n"
    )


def generated(name: str) -> str:
    return banner(name) + (ROOT / "src" / "eagle31_mla" / name).read_text()


def main() -> None:
    for name in SOURCES:
        (ROOT / "modeling" / name).write_text(generated(name))
        print(f"wrote modeling/{name}")


if __name__ == "__main__":
    main()
