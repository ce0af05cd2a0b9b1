#!/usr/bin/env python3
"""Regenerate modeling/ (the remote code shipped inside a Hub repo) from src/eagle31_mla/model/.

The library is the one source of truth (:mod:`eagle31_mla.hub.remote_code`); tests/unit/test_remote_code.py
fails when modeling/ drifts. Run: python scripts/sync_modeling.py
"""

from eagle31_mla.hub.remote_code import MODELING, generate


def main() -> None:
    for path in generate():
        print(f"wrote {path.relative_to(MODELING.parent)}")


if __name__ == "__main__":
    main()
