"""Where the test suite's files are: one home for the paths tests used to derive from their own location."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUPPORT = ROOT / "tests" / "support"
# Golden vectors from an independent implementation (copied from ../shared/golden; see its README).
GOLDEN = ROOT / "tests" / "golden"
