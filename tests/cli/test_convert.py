"""`eagle31-mla convert`: every accepted layout becomes a Hub-ready folder that loads with identical logits (through
the library and through Transformers' remote code alone); pruning maps draft ids back; output is byte-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle31_mla import Eagle31MLAForCausalLM
from eagle31_mla.cli import main
from eagle31_mla.hub.convert import choose_vocabulary, convert, parse_size, read_token_counts
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP, REMOTE_CODE_FILES
from eagle31_mla.serving.engines import InputError
from tests.support.paths import ROOT
from tests.support.tiny import aux_inputs, published_style_config, same_logits, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers

IDS = [2, 5, 9]  # one-based = zero-based [1, 4, 8]


def training_checkpoint(folder: Path, model) -> Path:
    """The training framework's export: `midlayer.*`, nested zero-based ids, no convention label."""
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    return write_checkpoint(folder, published_style_config(model, ids_form="training"), tensors)


def published(folder: Path, model) -> Path:
    return write_checkpoint(folder, published_style_config(model), model.state_dict())


def nemo_checkpoint(folder: Path, model) -> Path:
    tensors = {(k if k.startswith("lm_head") else "model." + k): v for k, v in model.state_dict().items()}
    return write_checkpoint(folder, published_style_config(model), tensors)


@pytest.mark.parametrize("layout", ["training", "nemo", "published", "eagle3"])
def test_layouts_convert_to_a_hub_folder_with_identical_logits(tmp_path, layout):
    extra = {"fc_norm": False, "norm_output": False} if layout == "eagle3" else {}
    model = tiny_drafter(seed=3, eagle_aux_hidden_state_layer_ids=IDS, **extra)
    src = {"training": training_checkpoint, "nemo": nemo_checkpoint}.get(layout, published)(tmp_path / "src", model)
    dst = convert(src, tmp_path / "hub", progress=False).folder
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(dst), model)
    names = [k for file in dst.glob("*.safetensors") for k in safe_open(file, "pt").keys()]
    assert sorted(names) == sorted(model.state_dict())  # the published names
    config = json.loads((dst / "config.json").read_text())
    ids = config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == (IDS, IDS) and config["aux_layer_ids_convention"] == "one_based"
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert config["auto_map"] == AUTO_MAP and AUTO_MAP["AutoModelForCausalLM"].startswith("modeling_eagle31_mla.")
    assert config["fc_norm"] is (layout != "eagle3") and config["norm_output"] is (layout != "eagle3")
    assert "_name_or_path" not in config and "id2label" not in config  # save_pretrained's form, no local paths
    for name in REMOTE_CODE_FILES:
        assert (dst / name).read_bytes() == (ROOT / "src" / "eagle31_mla" / "model" / name).read_bytes()
    card = (dst / "README.md").read_text()
    assert "vllm serve" in card and "sglang serve" in card and "tokenspeed serve" in card
    assert "--eagle3-layers-to-capture 2,5,9" in card


REMOTE = """
import sys, torch
sys.modules["eagle31_mla"] = None  # importing the library fails: only the folder's own code can run
from transformers import AutoConfig, AutoModelForCausalLM
folder, inputs, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(
    folder, trust_remote_code=True, device_map="auto", dtype="auto", force_download=False, proxies=None
)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert model.fc.weight.device.type == "cpu" and model.dtype == torch.float32  # config.json's dtype
assert AutoConfig.from_pretrained(folder, trust_remote_code=True).fc_norm is True
ids, aux = torch.load(inputs)
output = model(ids, aux_hidden_states=aux)
torch.save((output.logits, output.hidden_states), out)
assert sys.modules["eagle31_mla"] is None
"""


def test_converted_folder_loads_through_auto_model_with_remote_code(tmp_path):
    """In a process where eagle31_mla cannot be imported (Transformers, the folder, and its remote code only), with
    the keywords a Hub user passes (device_map needs accelerate, in [test]): the library's logits and states."""
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    dst = convert(training_checkpoint(tmp_path / "src", model), tmp_path / "hub", progress=False).folder
    ids, aux = aux_inputs(model.config, 1, 5)
    torch.save((ids, aux), tmp_path / "inputs.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [sys.executable, "-c", REMOTE, str(dst), str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    # exact: the remote code is the same source (modeling/ is src/ under a banner), same weights, shapes and CPU
    logits, state = torch.load(tmp_path / "logits.pt")
    expected = model(ids, aux_hidden_states=aux)
    assert torch.equal(logits, expected.logits) and torch.equal(state, expected.hidden_states)


def test_converting_twice_gives_byte_identical_folders_sharded_above_the_threshold(tmp_path):
    model = tiny_drafter(seed=5, eagle_aux_hidden_state_layer_ids=IDS)
    src = training_checkpoint(tmp_path / "src", model)
    sizes = {k: t.numel() * t.element_size() for k, t in model.state_dict().items()}
    total = sum(sizes.values())
    one = convert(src, tmp_path / "one", max_shard_size=total, progress=False).folder
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()
    a, b = (convert(src, tmp_path / run / "hub", max_shard_size=total // 3, progress=False).folder for run in "ab")
    assert [(p.name, p.read_bytes()) for p in sorted(a.iterdir())] == [
        (p.name, p.read_bytes()) for p in sorted(b.iterdir())
    ]
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(sizes) and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == total
    for shard in shards:  # each shard within the limit unless a single tensor exceeds it
        assert sum(n for k, n in sizes.items() if index["weight_map"][k] == shard) <= max(total // 3, *sizes.values())
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(a), model)


def test_dtype_option_and_float16_underflow(tmp_path):
    model = tiny_drafter(seed=8, eagle_aux_hidden_state_layer_ids=IDS)
    src = training_checkpoint(tmp_path / "src", model)
    dst = convert(src, tmp_path / "bf16", dtype="bfloat16", max_shard_size="30KB", progress=False).folder
    headers = [safe_open(file, "pt") for file in dst.glob("*.safetensors")]
    assert {h.get_slice(k).get_dtype() for h in headers for k in h.keys()} == {"BF16"}
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = Eagle31MLAForCausalLM.from_pretrained(dst)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16()), name
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e-9, -1e-10, 1e-4])  # two below float16's smallest subnormal
    src = published(tmp_path / "tiny", model)
    result = convert(src, tmp_path / "f16", dtype="float16", progress=False)
    (note,) = [n for n in result.notes if "became 0" in n]  # a one-line note with its count
    assert "2 nonzero value(s) in 1 tensor(s)" in note and "fc.weight" in note and "\n" not in note
    assert Eagle31MLAForCausalLM.from_pretrained(result.folder).fc.weight.dtype == torch.float16


def test_pruned_vocabulary_maps_draft_ids_back_to_target_ids(tmp_path):
    model = tiny_drafter(seed=9, eagle_aux_hidden_state_layer_ids=IDS)  # vocab 300; bos 1, eos 2, pad 0
    src = training_checkpoint(tmp_path / "src", model)
    counts_file = tmp_path / "counts.json"
    counts_file.write_text(json.dumps({str(t): 10 * t for t in range(100, 300)}))  # the 40 most frequent: 260..299
    result = convert(src, tmp_path / "pruned", prune_vocab=43, token_counts=counts_file, progress=False)
    kept = [0, 1, 2] + list(range(260, 300))  # bos/eos/pad always, then by count
    assert result.draft_vocab_size == 43 and result.vocab_size == 300
    pruned = Eagle31MLAForCausalLM.from_pretrained(result.folder)
    assert pruned.config.draft_vocab_size == 43
    assert pruned.d2t.dtype == torch.int64 and torch.equal(torch.arange(43) + pruned.d2t, torch.tensor(kept))
    assert pruned.t2d.dtype == torch.bool and pruned.t2d.sum() == 43 and pruned.t2d[kept].all()
    assert torch.equal(pruned.draft_to_target_ids(torch.arange(43)), torch.tensor(kept))
    assert torch.equal(pruned.lm_head.weight, model.lm_head.weight[kept])
    ids, aux = aux_inputs(model.config, 2, 5)
    out = model(ids, aux_hidden_states=aux)
    full = out.logits
    normed = out.hidden_states if model.config.norm_output else model.norm(out.hidden_states)  # lm_head's input
    # draft id i scores target kept[i]: the same dot products, but a 43-row lm_head may be blocked differently
    # (summed in another order) from the 300-row one, so allow the bound on a K-term dot product's rounding,
    # K·eps·Σ|x·w|
    bound = model.config.hidden_size * torch.finfo(full.dtype).eps * (normed.abs() @ model.lm_head.weight[kept].abs().T)
    assert ((pruned(ids, aux_hidden_states=aux).logits - full[..., kept]).abs() <= bound).all()
    greedy = pruned.draft(ids, aux, num_tokens=2).tokens
    assert set(greedy.flatten().tolist()) <= set(kept)  # drafted tokens come back as target ids


def test_pruning_an_already_pruned_checkpoint(tmp_path):
    model = tiny_drafter(seed=10, draft_vocab_size=120, eagle_aux_hidden_state_layer_ids=IDS)
    src = published(tmp_path / "src", model)
    source_targets = (torch.arange(120) + model.d2t).tolist()
    counts = tmp_path / "counts.txt"
    counts.write_text("# token count\n" + "".join(f"{t} {t}\n" for t in source_targets))
    result = convert(src, tmp_path / "out", prune_vocab=30, token_counts=counts, progress=False)
    assert "pruned vocabulary 120/300" in result.source
    pruned = Eagle31MLAForCausalLM.from_pretrained(result.folder)
    targets = (torch.arange(30) + pruned.d2t).tolist()
    specials = [t for t in (0, 1, 2) if t in source_targets]
    assert targets == sorted(set(specials) | set(sorted(source_targets, reverse=True)[: 30 - len(specials)]))
    assert torch.equal(pruned.lm_head.weight, model.lm_head.weight[[source_targets.index(t) for t in targets]])


def test_token_counts_vocabulary_choice_and_shard_sizes(tmp_path):
    """Token counts: a JSON list or object, or text lines of "id count" (summed); the files refused: rows of
    tests/unit/test_bad_inputs.py."""
    (tmp_path / "l.json").write_text("[0, 5, 0, 7]")
    (tmp_path / "p.txt").write_text("3 4\n\n1 2  # comment\n3 1\n")
    assert read_token_counts(tmp_path / "l.json") == {0: 0, 1: 5, 2: 0, 3: 7}
    assert read_token_counts(tmp_path / "p.txt") == {3: 5, 1: 2}
    kept, notes = choose_vocabulary({5: 9, 6: 9, 7: 1, 99: 4}, 4, range(10), always=[0])
    assert kept == [0, 5, 6, 7] and any("not in the source" in n for n in notes)  # ties: smaller id first
    assert parse_size("5GB") == 5 * 10**9 and parse_size("40KB") == 40_000 and parse_size("1000") == 1000
    for bad in ("0", "-1GB", "nanGB", "infGB", "abc", "", "2MiB"):
        with pytest.raises(InputError, match="cannot read a size"):
            parse_size(bad)


def test_cli_convert_exit_codes(tmp_path, capsys):
    model = tiny_drafter(seed=12, eagle_aux_hidden_state_layer_ids=IDS)
    src = nemo_checkpoint(tmp_path / "src", model)
    assert main(["convert", str(src), str(tmp_path / "hub"), "--quiet"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "hub"), "--quiet", "--force", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == 20 and "NeMo" in summary["source"]
    state = {**model.state_dict(), "extra.weight": torch.zeros(2)}
    bad = write_checkpoint(tmp_path / "bad", published_style_config(model), state)
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "z"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "unexpected tensor 'extra.weight'" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
