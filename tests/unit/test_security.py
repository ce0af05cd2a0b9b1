"""No unsafe loading, no network: pickle is refused unless opted in (and then tensors only), and nothing opens a
network connection at import, in the CLI, or anywhere in the test suite. (Related: Hub loads pin a ``revision`` in
tests/unit/test_hub.py; modeling/ imports only torch, transformers and the stdlib in tests/unit/test_remote_code.py.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle31_mla import CheckpointError, Eagle31MLAForCausalLM
from tests.support import netguard
from tests.support.paths import ROOT, SUPPORT
from tests.support.tiny import published_style_config, same_logits, tiny_drafter


class Payload:
    """What a malicious pickle carries: unpickling it runs a shell command (here: creates a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pickle_folder(folder: Path, model, state=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published_style_config(model)))
    torch.save(model.state_dict() if state is None else state, folder / "pytorch_model.bin")
    return folder


# ---- pickle: safetensors only by default; `use_safetensors=False` is Transformers' own opt-in (weights_only) ----


def test_pickle_is_refused_by_default_checked_when_opted_in_and_never_opened_beside_safetensors(tmp_path):
    model = tiny_drafter(seed=4)
    folder = pickle_folder(tmp_path / "whole", model)
    with pytest.raises(OSError, match="model.safetensors"):
        Eagle31MLAForCausalLM.from_pretrained(folder)
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(folder, use_safetensors=False), model)
    state = {k: v for k, v in model.state_dict().items() if k != "norm.weight"}
    with pytest.raises(CheckpointError, match="missing tensor 'norm.weight'"):
        Eagle31MLAForCausalLM.from_pretrained(pickle_folder(tmp_path / "missing", model, state), use_safetensors=False)
    model.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"garbage: would fail if read")
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(folder), model)


def test_code_executing_pickle_is_refused_even_when_opted_in(tmp_path):
    model = tiny_drafter()
    marker = tmp_path / "payload-ran"
    state = dict(model.state_dict(), **{"norm.weight": Payload(marker)})  # a trojan among real tensors
    folder = pickle_folder(tmp_path / "draft", model, state=state)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl|GLOBAL"):
        Eagle31MLAForCausalLM.from_pretrained(folder, use_safetensors=False)
    assert not marker.exists(), "the pickle's payload ran"
    # Control: the payload is live, and a plain (unsafe) unpickle would have run it.
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_no_torch_load_without_weights_only_in_the_library():
    """Every torch.load in the library and the remote code passes weights_only=True."""
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "modeling").glob("*.py"), *(ROOT / "plugins").rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line and "`" not in line:
                assert "weights_only=True" in line, f"{path}:{number}: {line.strip()}"


# ---- network -----------------------------------------------------------------------------------

PRELUDE = f"""
import importlib.util, json, runpy, socket, sys
spec = importlib.util.spec_from_file_location("netguard", {str(SUPPORT / "netguard.py")!r})
netguard = sys.modules["netguard"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netguard)
netguard.install()
"""


def run_guarded(body: str) -> list[str]:
    """Run ``body`` in a fresh interpreter with the network guard installed first; returns the attempts."""
    env = {k: v for k, v in os.environ.items() if k != netguard.LOG_ENV}  # its attempts are reported here, not logged
    site = str(SUPPORT / "netguard_site")  # the prelude, not the suite's sitecustomize, installs the guard here
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site)
    script = PRELUDE + body + "\nprint('ATTEMPTS ' + json.dumps(netguard.ATTEMPTS))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("ATTEMPTS "))
    return json.loads(line.removeprefix("ATTEMPTS "))


def test_imports_and_cli_help_open_no_connection():
    body = """
import importlib, pkgutil
import eagle31_mla, eagle31_mla_vllm, eagle31_mla_sglang
eagle31_mla.Eagle31MLAForCausalLM, eagle31_mla.Eagle31MLAConfig
for module in pkgutil.iter_modules(eagle31_mla.__path__):  # every module of the library
    importlib.import_module(f"eagle31_mla.{module.name}")
sys.argv = ["eagle31-mla", "--help"]
try:
    runpy.run_module("eagle31_mla.cli", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
try:  # control: the guard is live in this process
    socket.create_connection(("192.0.2.1", 443), timeout=1)
except netguard.NetworkAccessBlocked:
    pass
"""
    assert run_guarded(body) == ["connect to 192.0.2.1:443"]  # the control, and nothing else


def test_vllm_plugin_registration_opens_no_connection():
    pytest.importorskip("vllm", reason="needs the vLLM extra")
    body = """
import vllm, eagle31_mla_vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
eagle31_mla_vllm.register()
"""
    assert run_guarded(body) == []


def test_the_suite_guard_refuses_other_hosts_and_keeps_loopback(monkeypatch):
    assert netguard.is_installed()
    monkeypatch.delenv(netguard.LOG_ENV)  # deliberate attempts: kept out of the session's log
    before = len(netguard.ATTEMPTS)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(netguard.NetworkAccessBlocked):
        s.connect(("192.0.2.1", 80))  # TEST-NET-1: never routed
    with pytest.raises(netguard.NetworkAccessBlocked):
        socket.getaddrinfo("huggingface.co", 443)
    assert netguard.ATTEMPTS[before:] == ["connect to 192.0.2.1:80", "DNS lookup of 'huggingface.co'"]
    del netguard.ATTEMPTS[before:]  # deliberate: not a leak for the session check

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:  # loopback still works
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            conn, _ = server.accept()
            conn.close()


def test_subprocesses_are_guarded_and_one_the_guard_cannot_enter_is_reported(tmp_path):
    """A subprocess of the suite installs the guard (sitecustomize); were the guard to fail to install, that
    subprocess would be unguarded: it says so in the guard's log, which fails the session (conftest.no_network)."""
    import shutil

    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(SUPPORT / "netguard_site" / "sitecustomize.py", site)
    (tmp_path / "netguard.py").write_text("raise ImportError('a broken guard')\n")  # what sitecustomize loads
    log, check = tmp_path / "log", "import socket; print(hasattr(socket.socket.connect, '_eagle31_netguard'))"
    for env, guarded in (({}, "True"), ({"PYTHONPATH": str(site), netguard.LOG_ENV: str(log)}, "False")):
        out = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
        )
        assert out.returncode == 0 and out.stdout.strip() == guarded, out.stderr
    assert "network guard NOT installed" in log.read_text() and "a broken guard" in log.read_text()
