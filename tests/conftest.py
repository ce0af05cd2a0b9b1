import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Before anything imports huggingface_hub/transformers (they read these at import time): no network,
# and a private, empty HF home whose hub cache the tests fill themselves.
_HF_HOME = Path(tempfile.mkdtemp(prefix="eagle31-hf-home-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_HF_HOME)
os.environ["HF_HUB_CACHE"] = str(_HF_HOME / "hub")
os.environ["HF_MODULES_CACHE"] = str(_HF_HOME / "modules")

# Golden vectors from an independent implementation (copied from ../shared/golden; see its README).
GOLDEN = Path(__file__).parent / "golden"
