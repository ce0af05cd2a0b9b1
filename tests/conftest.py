import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netguard  # noqa: E402

# Before anything imports huggingface_hub/transformers (they read these at import time): no network,
# and a private, empty HF home whose hub cache the tests fill themselves.
_HF_HOME = Path(tempfile.mkdtemp(prefix="eagle31-hf-home-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_HF_HOME)
os.environ["HF_HUB_CACHE"] = str(_HF_HOME / "hub")
os.environ["HF_MODULES_CACHE"] = str(_HF_HOME / "modules")
for _key in ("HF_HUB_DISABLE_TELEMETRY", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
    os.environ.setdefault(_key, "1")
# vLLM's engine processes otherwise find their own address by a UDP connect to 8.8.8.8 (no packet is
# sent, but it is a connect to another host, and the guard below counts it).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

# No network, in this process and in every Python subprocess a test starts (tests/netguard.py): a
# connection to another host or a DNS lookup raises and is recorded; `no_network` fails the session
# if any was attempted. Installed here, before test modules import any library.
_NETGUARD_LOG = _HF_HOME / "netguard.log"
os.environ[netguard.LOG_ENV] = str(_NETGUARD_LOG)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).parent / "netguard_site")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)
netguard.install()

# Golden vectors from an independent implementation (copied from ../shared/golden; see its README).
GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="session", autouse=True)
def no_network():
    yield  # netguard is installed at import, above
    # the log has every process's attempts, this one's included
    attempts = _NETGUARD_LOG.read_text().splitlines() if _NETGUARD_LOG.exists() else list(netguard.ATTEMPTS)
    assert not attempts, "the test suite tried to reach the network:\n  " + "\n  ".join(attempts)
