"""`eagle31-mla serve-command`: the launch command per engine, with the aux ids in that engine's form."""

from __future__ import annotations

import json
import shlex
from functools import partial

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving.command import serve_command
from eagle31_mla.serving.engines import KIMI_K3_TARGET, Target
from tests.support.engine_configs import deepseek_target, draft, kimi_k3_target, nested_only, write_config

DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    """Other tests put a tiny drafter under the published id into the shared offline cache."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def command(capsys, *args) -> tuple[int, dict]:
    code = main(["serve-command", *args, "--json"])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out else {})


def test_vllm_kimi_k3_defaults_offline(capsys):
    """The defaults need no network: the published drafter's and Kimi-K3's configs are known."""
    code, result = command(capsys, "--engine", "vllm")
    assert code == 0
    cmd = result["command"]
    assert cmd["env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "0"}
    assert cmd["argv"][:4] == ["vllm", "serve", "moonshotai/Kimi-K3", "--speculative-config"]
    assert json.loads(cmd["argv"][4]) == {"model": DRAFT, "method": "eagle3", "num_speculative_tokens": 3}
    assert shlex.split(cmd["shell"].replace("\\\n", " ")) == [f"{k}={v}" for k, v in cmd["env"].items()] + cmd["argv"]
    assert any("one-based [2, 46, 90] = zero-based [1, 45, 89]" in c for c in cmd["comments"])
    assert result["doctor"]["ok"] and result["doctor"]["versions"] == ["0.33"]


def test_sglang_command(capsys):
    code, result = command(capsys, "--engine", "sglang", "--tp", "16")
    spec = f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {DRAFT} --speculative-num-steps 3"
    spec += " --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --tp-size 16"
    assert code == 0 and result["command"]["env"] == {}
    assert result["command"]["argv"] == ["sglang", "serve", "--model-path", "moonshotai/Kimi-K3", *spec.split()]
    assert [h["id"] for h in result["doctor"]["handled_by_plugin"]] == ["sglang-k3-no-capture"]


def test_tokenspeed_flag_is_in_the_targets_convention(tmp_path, capsys):
    code, result = command(capsys, "--engine", "tokenspeed", "--num-steps", "5")
    argv = result["command"]["argv"]
    assert code == 0 and argv[argv.index("--eagle3-layers-to-capture") + 1] == "2,46,90"  # Kimi-K3: one-based
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "6" and "--trust-remote-code" in argv
    k2 = write_config(tmp_path / "Kimi-K2", deepseek_target(layers=61))
    k2_draft = write_config(tmp_path / "k2-draft", draft([2, 30, 58]))
    code, result = command(capsys, "--engine", "tokenspeed", "--target", str(k2), "--draft", str(k2_draft))
    argv = result["command"]["argv"]
    assert code == 0 and argv[argv.index("--eagle3-layers-to-capture") + 1] == "1,29,57"  # DeepSeek adds 1
    assert "--trust-remote-code" not in argv


def test_every_command_passes_doctor_for_the_canonical_and_the_training_form(tmp_path):
    from eagle31_mla.serving.doctor import diagnose

    for config in (draft(), nested_only([1, 45, 89])):
        for engine in ("vllm", "sglang", "tokenspeed"):
            cmd = serve_command(engine, "moonshotai/Kimi-K3", DRAFT, KIMI_K3_TARGET, config)
            version = {"vllm": "0.33", "sglang": "0.5.23"}.get(engine)
            options = dict(environ=cmd.env, with_plugin=engine != "tokenspeed", layers_to_capture=cmd.layers_to_capture)
            report = diagnose(config, KIMI_K3_TARGET, engine, version, **options)
            assert report.ok, report.format()


def test_remaining_problems_are_printed_with_the_command(tmp_path, capsys):
    """(The usage errors, exact: tests/cli/test_cli_corpus.py; the library's numbers: tests/unit/test_bad_inputs.py.)"""
    k3 = write_config(tmp_path / "k3", kimi_k3_target())
    assert main(["serve-command", "--engine", "vllm", "--target", str(k3), "--engine-version", "0.26"]) == 1
    captured = capsys.readouterr()
    assert "vllm serve" in captured.out and "vllm-kimi-k3-version" in captured.err


def test_shell_text_quotes_and_continues_lines():
    cmd = serve_command("vllm", "my target", "org/draft", Target.from_config(kimi_k3_target(), "t"), draft())
    text = cmd.text()
    assert text.splitlines()[-2].endswith("'my target' \\")
    assert text.splitlines()[-1].startswith("  --speculative-config '{")


@pytest.mark.parametrize("topk, steps", [(2, 3), (4, 2), (8, 6)])
def test_a_tree_larger_than_topk_and_steps_allow_is_refused(topk, steps):
    """The tree size rule of the reference loop (decoding.limits.max_tree_draft_tokens) bounds --num-draft-tokens
    (through the CLI: tests/cli/test_cli_corpus.py)."""
    from eagle31_mla.decoding.limits import max_tree_draft_tokens

    most = max_tree_draft_tokens(topk, steps)
    assert most == 1 + topk + (steps - 1) * topk * topk  # written out: root, first step, later steps
    tree = partial(serve_command, "sglang", "t", "d", KIMI_K3_TARGET, draft(), num_steps=steps, topk=topk)
    tree(num_draft_tokens=most)
    with pytest.raises(ValueError, match=f"holds 2 to {most} tokens"):
        tree(num_draft_tokens=most + 1)
