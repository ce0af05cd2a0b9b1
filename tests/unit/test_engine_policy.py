"""The engine and GPU policies of tests/conftest.py can fail: each case runs pytest in a subprocess on a scratch
folder holding a copy of the conftest and a stand-in ``vllm`` package that only has a version, so the policy is
exercised in every environment, the engine-free one included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

CASES = """
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

VLLM = "vllm==9.9.9"  # the stand-in's version
USAGE, STOPPED = pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERRUPTED


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    shutil.copy(ROOT / "tests" / "conftest.py", root / "conftest.py")  # it imports tests.support from ROOT
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: engine\n    sglang: engine\n    gpu: gpu\n")
    (root / "test_cases.py").write_text(CASES)
    (root / "test_collection_skip.py").write_text(COLLECTION_SKIP)  # collected only where a run names it
    (root / "stand_in" / "vllm").mkdir(parents=True)
    (root / "stand_in" / "vllm" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    return root


@pytest.mark.parametrize(
    "engines, gpu, args, code, expected",
    [(None, None, ["test_cases.py"], 0, ["2 passed, 4 skipped"]),
     (VLLM, None, ["test_cases.py"], 1, ["FAILED test_cases.py::test_skips_plainly", "1 failed, 2 passed, 3 skipped"]),
     (VLLM, None, ["test_collection_skip.py", "test_cases.py::test_runs"], STOPPED, ["was skipped at collection"]),
     ("vllm==1.0.0", None, ["test_cases.py"], USAGE, ["requires vllm==1.0.0, but vllm 9.9.9 is installed"]),
     ("sglang==0.5.23", None, ["test_cases.py"], USAGE, ["requires sglang, which cannot be imported here"]),
     (VLLM, None, ["test_cases.py", "-k", "unmarked"], 1, ["no test marked with it was selected"]),
     (None, "1", ["test_cases.py"], 1,
      ["FAILED test_cases.py::test_gpu_skips", "this run requires the GPU tests (EAGLE31_REQUIRE_GPU=1)"]),
     (None, "1", ["test_cases.py", "-k", "cpu"], 1,
      ["requires gpu (EAGLE31_REQUIRE_GPU=1), but no test marked with it was selected"]),
     (None, "yes", ["test_cases.py"], USAGE, ["EAGLE31_REQUIRE_GPU='yes'"])],
    ids=["no requirement", "plain skip", "collection skip", "wrong version", "no import", "none selected",
         "gpu skip", "no gpu test", "bad gpu value"],
)  # fmt: skip
def test_the_policy(scratch, engines, gpu, args, code, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE31_REQUIRE_ENGINES", "EAGLE31_REQUIRE_GPU")}
    env.update({"EAGLE31_REQUIRE_ENGINES": engines or "", "EAGLE31_REQUIRE_GPU": gpu or ""})
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "stand_in"), *filter(None, [env.get("PYTHONPATH")]), str(ROOT)])
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args]
    run = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == code and all(text in out for text in expected), out
