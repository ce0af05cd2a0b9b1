"""modeling/ is the remote code shipped in a Hub repo: generated from src/, self-contained."""

import ast
import re
import shutil
import sys
from importlib.metadata import requires

import pytest

from eagle31_mla.hub.remote_code import generate
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP
from tests.support.paths import ROOT
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers

MODELING = ROOT / "modeling"

# The remote code may import torch, transformers and the standard library, and nothing a user of
# `trust_remote_code=True` would have to install besides: safetensors and huggingface_hub qualify
# because transformers itself requires them (checked below against the installed metadata).
CORE_IMPORTS = {"torch", "transformers", "__future__"}
INSTALLED_BY_TRANSFORMERS = {"safetensors", "huggingface_hub"}
ALLOWED_IMPORTS = CORE_IMPORTS | INSTALLED_BY_TRANSFORMERS  # + stdlib


def test_modeling_is_generated_from_src_without_drift(tmp_path):
    """One source of truth: run `python scripts/sync_modeling.py` after editing src/eagle31_mla/model/."""
    expected = {path.name: path.read_text() for path in generate(tmp_path)}
    assert {path.name: path.read_text() for path in MODELING.glob("*.py")} == expected  # each file, no other


def test_modeling_imports_only_torch_transformers_and_stdlib():
    """Parsed, not imported: every import statement of modeling/ (module level and inside functions)
    names torch, transformers, the standard library, or a package transformers itself depends on."""
    transformers_deps = {
        re.split(r"[<>=!~; \[]", r)[0].lower().replace("-", "_")
        for r in requires("transformers")
        if "extra ==" not in r
    }
    assert INSTALLED_BY_TRANSFORMERS <= transformers_deps, transformers_deps
    for path in MODELING.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            foreign = {r for r in roots if r not in ALLOWED_IMPORTS and r not in sys.stdlib_module_names}
            assert not foreign, f"modeling/{path.name} imports {foreign}"


def test_remote_code_refuses_a_missing_tensor_too(tmp_path):
    """modeling/ as a Hub repo carries it runs the same loader: no silently random weights through AutoModel either
    (its logits, exact, through a converted folder's remote code: tests/cli/test_convert.py)."""
    from transformers import AutoModelForCausalLM

    model = tiny_drafter()
    state = {k: v for k, v in model.state_dict().items() if k != "norm.weight"}
    folder = write_checkpoint(
        tmp_path / "kimi-k3-eagle3.1-mla", {**published_style_config(model), "auto_map": AUTO_MAP}, state
    )
    for path in MODELING.glob("*.py"):
        shutil.copy(path, folder / path.name)
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    error = type(err.value)
    assert error.__name__ == "CheckpointError" and error.__module__.startswith("transformers_modules"), err.value
    assert str(err.value) == f"{folder}: the checkpoint does not match its config: missing tensor 'norm.weight'"
