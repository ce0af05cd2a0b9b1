"""The engine policy of tests/conftest.py can fail. In a run that requires an engine, a plain skip of one
of its tests, a skip at collection that names it, a wrong version, an engine that does not import, and a
run that selects none of its tests each fail the run; a skip through ``engine_version_skip`` does not. The
GPU policy likewise: with EAGLE31_REQUIRE_GPU=1 a skipped ``gpu`` test, or a run selecting none, fails.

Each case runs pytest in a subprocess on a scratch folder holding a copy of this project's conftest.py
(which imports the network guard from the repository's tests.support) and a stand-in ``vllm`` package
that only has a version, so the policy is exercised in every environment, the engine-free one included,
in a few seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

STAND_IN_VERSION = "9.9.9"

TESTS = """
import pytest
from tests.support.engine_policy import engine_version_skip

@pytest.mark.vllm
def test_runs():
    pass

@pytest.mark.vllm
def test_skips_plainly():
    pytest.skip("needs a newer release")

@pytest.mark.vllm
def test_skips_by_version():
    engine_version_skip("vllm", "does not apply to this release")

def test_unmarked_skip_naming_no_engine():
    pytest.skip("nothing to do with engines")
"""

GPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_gpu_skips():
    pytest.skip("needs a CUDA GPU")

def test_cpu_runs():
    pass
"""

COLLECTION_SKIP = """
import pytest
pytest.importorskip("vllm.not_a_module", reason="needs vllm's extra module")

def test_never_runs():
    pass
"""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    shutil.copy(ROOT / "tests" / "conftest.py", root / "conftest.py")  # it imports tests.support from ROOT
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: engine\n    sglang: engine\n    gpu: gpu\n")
    (root / "test_cases.py").write_text(TESTS)
    (root / "test_gpu_cases.py").write_text(GPU_TESTS)
    stand_in = root / "stand_in" / "vllm"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(f"__version__ = {STAND_IN_VERSION!r}\n")
    return root


def run(root: Path, require: str | None, *args: str, require_gpu: str | None = None) -> tuple[int, str]:
    env = dict(os.environ)
    env.pop("EAGLE31_REQUIRE_ENGINES", None)
    env.pop("EAGLE31_REQUIRE_GPU", None)
    if require is not None:
        env["EAGLE31_REQUIRE_ENGINES"] = require
    if require_gpu is not None:
        env["EAGLE31_REQUIRE_GPU"] = require_gpu
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "stand_in"), *filter(None, [os.environ.get("PYTHONPATH")]), str(ROOT)]
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


def test_without_a_requirement_skips_stay_skips(scratch):
    rc, out = run(scratch, None, "test_cases.py")
    assert rc == 0, out
    assert "1 passed, 3 skipped" in out, out


def test_a_plain_skip_of_a_required_engine_fails(scratch):
    rc, out = run(scratch, f"vllm=={STAND_IN_VERSION}", "test_cases.py")
    assert rc == 1, out
    assert "FAILED test_cases.py::test_skips_plainly" in out, out
    assert "1 failed, 1 passed, 2 skipped" in out, out  # the version skip and the unmarked one stay skips


def test_a_collection_skip_naming_a_required_engine_fails(scratch):
    (scratch / "test_collection_skip.py").write_text(COLLECTION_SKIP)
    try:
        rc, out = run(scratch, f"vllm=={STAND_IN_VERSION}", "test_collection_skip.py", "test_cases.py::test_runs")
    finally:
        (scratch / "test_collection_skip.py").unlink()
    assert rc != 0 and "was skipped at collection" in out, out


def test_a_wrong_version_stops_the_run(scratch):
    rc, out = run(scratch, "vllm==1.0.0", "test_cases.py")
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert f"requires vllm==1.0.0, but vllm {STAND_IN_VERSION} is installed" in out, out


def test_an_engine_that_does_not_import_stops_the_run(scratch):
    rc, out = run(scratch, "sglang==0.5.23", "test_cases.py")
    assert rc == pytest.ExitCode.USAGE_ERROR, out
    assert "requires sglang, which cannot be imported here" in out, out


def test_a_run_that_selects_no_test_of_a_required_engine_fails(scratch):
    rc, out = run(scratch, f"vllm=={STAND_IN_VERSION}", "test_cases.py", "-k", "unmarked")
    assert rc != 0, out
    assert "no test marked with it was selected" in out, out


def test_gpu_skips_stay_skips_unless_the_gpu_is_required(scratch):
    rc, out = run(scratch, None, "test_gpu_cases.py")
    assert rc == 0 and "1 passed, 1 skipped" in out, out
    rc, out = run(scratch, None, "test_gpu_cases.py", require_gpu="1")
    assert rc == 1 and "FAILED test_gpu_cases.py::test_gpu_skips" in out, out
    assert "this run requires the GPU tests (EAGLE31_REQUIRE_GPU=1)" in out, out


def test_a_gpu_run_that_selects_no_gpu_test_fails(scratch):
    rc, out = run(scratch, None, "test_gpu_cases.py", "-k", "cpu", require_gpu="1")
    assert rc != 0 and "requires gpu (EAGLE31_REQUIRE_GPU=1), but no test marked with it was selected" in out, out


def test_a_bad_gpu_requirement_stops_the_run(scratch):
    rc, out = run(scratch, None, "test_gpu_cases.py", require_gpu="yes")
    assert rc == pytest.ExitCode.USAGE_ERROR and "EAGLE31_REQUIRE_GPU='yes'" in out, out
