"""The main job: the embedded pair, speculative decoding on it, and agreement between engines."""

import json

import pytest

from eagle31_mla.demo import DEMO_DIR, demo_prompts, run_demo
from tests.support.paths import ROOT
from tests.support.subprocesses import run_python

pytestmark = pytest.mark.transformers


def test_embedded_pair_is_small_and_complete():
    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    for part in ("target", "draft"):
        assert (DEMO_DIR / part / "config.json").is_file() and (DEMO_DIR / part / "model.safetensors").is_file()
    assert (DEMO_DIR / "target" / "tokenizer.json").is_file() and (DEMO_DIR / "prompts.jsonl").is_file()
    config = json.loads((DEMO_DIR / "target" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # what vLLM's CPU MLA kernels take


def test_prompts_are_held_out_from_the_training_corpus():
    from eagle31_mla.testing import demo_corpus

    _, seen = demo_corpus(seed=0, n=6000)
    for prompt in demo_prompts():
        name, _, _, color, animal = prompt.split(".")[0].split(" ")
        assert (name, animal, color) not in seen, prompt


@pytest.fixture(scope="module")
def hf_result():
    return run_demo("hf", num_prompts=8, max_new_tokens=48)


def test_demo_keeps_its_accept_length(hf_result, capsys):
    """The embedded pair, greedy, its first 8 held-out prompts, 48 tokens: the numbers the docs and engines cite."""
    assert abs(hf_result.accept_length - 3.40) < 0.02, hf_result.accept_length
    per_position = zip(hf_result.acceptance_per_position, [0.90, 0.80, 0.70], strict=True)
    assert all(abs(a - b) < 0.02 for a, b in per_position), hf_result.acceptance_per_position
    assert hf_result.num_generated_tokens == 8 * 48
    with capsys.disabled():
        print("\n" + hf_result.report(show=1))


@pytest.mark.vllm
def test_vllm_and_the_reference_agree(hf_result):
    pytest.importorskip("vllm", reason="needs the vLLM extra")
    vllm_result = run_demo("vllm", num_prompts=8, max_new_tokens=48)
    assert vllm_result.outputs == hf_result.outputs  # greedy: the same text
    assert abs(vllm_result.accept_length - hf_result.accept_length) <= 0.02
    for a, b in zip(vllm_result.acceptance_per_position, hf_result.acceptance_per_position):
        assert abs(a - b) <= 0.03


@pytest.mark.slow
def test_rebuild_script_is_deterministic(tmp_path):
    """scripts/build_demo_pair.py (in --quick mode: the same code, tiny step counts), run twice, writes
    byte-identical folders, and its configs are those of the shipped pair (only the step count differs)."""
    script = ROOT / "scripts" / "build_demo_pair.py"
    folders = [tmp_path / "a", tmp_path / "b"]
    for out in folders:  # one thread: float sums in one fixed order
        run = run_python([str(script), "--quick", "--out", str(out)], env={"OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
    a, b = ({str(p.relative_to(f)): p.read_bytes() for p in f.rglob("*") if p.is_file()} for f in folders)
    assert {"target/model.safetensors", "draft/model.safetensors", "prompts.jsonl"} <= set(a)
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == [], "files differ between builds"

    def config(path):
        return {k: v for k, v in json.loads(path.read_text()).items() if k != "transformers_version"}

    for part in ("target", "draft"):
        built, shipped = config(folders[0] / part / "config.json"), config(DEMO_DIR / part / "config.json")
        if part == "target":  # keys a newer transformers writes by default and this one does not know
            from transformers import AutoConfig

            known = set(AutoConfig.for_model(shipped["model_type"]).to_dict())
            shipped = {key: value for key, value in shipped.items() if key in built or key in known}
        assert built == shipped, part
    shipped = json.loads((DEMO_DIR / "draft" / "training.json").read_text())
    assert {**json.loads((folders[0] / "draft" / "training.json").read_text()), "steps": shipped["steps"]} == shipped


def test_demo_command_past_the_context_limit_stops_there_with_a_note(capsys):
    """--max-new-tokens beyond the pair's 512 positions: generation stops at the limit, said in one note."""
    from eagle31_mla.cli import main

    assert main(["demo", "--prompts", "1", "--max-new-tokens", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "mean accept length" in out and "acceptance by draft position: 1:" in out and "output:" in out
    assert "note: 1 prompt(s) stopped at the context limit of 512 positions" in out
