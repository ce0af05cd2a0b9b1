"""modeling/ is the remote code shipped in a Hub repo: generated from src/, self-contained, exact."""

import ast
import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle31_mla.hub.remote_code import drift
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP, REMOTE_CODE_FILES
from tests.support.paths import ROOT
from tests.support.tiny import aux_inputs, published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

MODELING = ROOT / "modeling"

# The remote code may import torch, transformers and the standard library, and nothing a user of
# `trust_remote_code=True` would have to install besides: safetensors and huggingface_hub qualify
# because transformers itself requires them (checked below against the installed metadata).
CORE_IMPORTS = {"torch", "transformers", "__future__"}
INSTALLED_BY_TRANSFORMERS = {"safetensors", "huggingface_hub"}
ALLOWED_IMPORTS = CORE_IMPORTS | INSTALLED_BY_TRANSFORMERS  # + stdlib


def test_modeling_is_generated_from_src_without_drift():
    """One source of truth: run `python scripts/sync_modeling.py` after editing src/eagle31_mla/model/."""
    assert drift(MODELING) == []  # each file present, no other, each equal to its source under the banner


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


def hub_folder(tmp_path: Path, model) -> Path:
    config = published_style_config(model)
    config["auto_map"] = dict(AUTO_MAP)
    folder = write_checkpoint(tmp_path / "kimi-k3-eagle3.1-mla", config, model.state_dict())
    for path in MODELING.glob("*.py"):
        shutil.copy(path, folder / path.name)
    return folder


def test_auto_model_with_remote_code_without_the_library(tmp_path):
    """Loaded in a fresh process where `eagle31_mla` cannot be imported: only torch + transformers, with the
    keywords a Hub user passes (device_map needs accelerate, in [test]); the library's logits."""
    model = tiny_drafter(seed=12)
    folder = hub_folder(tmp_path, model)
    ids, aux = aux_inputs(model.config, 2, 7)
    torch.save({"ids": ids, "aux": aux}, tmp_path / "inputs.pt")
    script = f"""
import sys, torch
sys.modules["eagle31_mla"] = None  # any import of the library now fails
from transformers import AutoConfig, AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(
    {str(folder)!r}, trust_remote_code=True, device_map="auto", dtype="auto", force_download=False, proxies=None
)
assert model.fc.weight.device.type == "cpu" and model.dtype == torch.float32  # config.json's torch_dtype
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert AutoConfig.from_pretrained({str(folder)!r}, trust_remote_code=True).fc_norm is True
x = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=True)
out = model(x["ids"], aux_hidden_states=x["aux"])
torch.save({{"logits": out.logits, "state": out.hidden_states}}, {str(tmp_path / "out.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    remote = torch.load(tmp_path / "out.pt", weights_only=True)
    out = model(ids, aux_hidden_states=aux)
    # Same code and weights, but another process: its thread count (and so the blocking of fp32
    # reductions) may differ, so compare to fp32 rounding: eps x reduction width (<= 192) at the output's
    # scale, with a 10x margin. A wrong layer or norm moves the outputs by O(1).
    for got, want in ((remote["logits"], out.logits), (remote["state"], out.hidden_states)):
        tolerance = 10 * 192 * torch.finfo(torch.float32).eps * want.abs().max()
        assert (got - want).abs().max() <= tolerance


def test_remote_code_refuses_a_missing_tensor_too(tmp_path):
    """The remote path runs the same loader: no silently random weights through AutoModel either."""
    from transformers import AutoModelForCausalLM

    model = tiny_drafter()
    folder = hub_folder(tmp_path, model)
    save_file({k: v for k, v in model.state_dict().items() if k != "norm.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    error = type(err.value)
    assert error.__name__ == "CheckpointError" and error.__module__.startswith("transformers_modules"), err.value
    assert str(err.value) == f"{folder}: the checkpoint does not match its config: missing tensor 'norm.weight'"


def test_saved_folder_carries_its_remote_code(tmp_path):
    model = tiny_drafter(seed=2)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for module in config["auto_map"].values():
        assert (tmp_path / (module.split(".")[0] + ".py")).is_file()
    for name in REMOTE_CODE_FILES:  # the files auto_map's modules import relatively too
        assert (tmp_path / name).is_file(), name
