"""`eagle31-mla convert`: every accepted layout becomes a Hub-ready folder that loads with identical
logits (through the library and through Transformers' remote code alone); vocabulary pruning maps draft ids back
to target ids; converting twice gives byte-identical folders."""

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
from eagle31_mla.hub.convert import ConvertError, choose_vocabulary, convert, parse_size, read_token_counts
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP, REMOTE_CODE_FILES
from eagle31_mla.serving.engines import InputError
from tests.support.paths import ROOT
from tests.support.tiny import aux_inputs, published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

IDS = [2, 5, 9]  # one-based = zero-based [1, 4, 8]


def training_checkpoint(folder: Path, model) -> Path:
    """The training framework's export: `midlayer.*`, nested zero-based ids, no convention label."""
    config = published_style_config(model, ids_form="training")
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in IDS]
    return write_checkpoint(
        folder, config, {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    )


def nemo_checkpoint(folder: Path, model) -> Path:
    tensors = {(k if k.startswith("lm_head") else "model." + k): v for k, v in model.state_dict().items()}
    return write_checkpoint(folder, published_style_config(model), tensors)


def same_logits(folder: Path, model) -> None:
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder)
    ids, aux = aux_inputs(model.config, 2, 6)
    # exact on purpose: the same weights through the same ops at the same shapes, in one process (conversion
    # copies tensors); a float tolerance would hide a wrong copy of a tensor's last rows
    assert torch.equal(loaded(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


def tensor_names(folder: Path) -> list[str]:
    names = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    return sorted(names)


@pytest.mark.parametrize("layout", ["training", "nemo", "published", "eagle3"])
def test_layouts_convert_to_a_hub_folder_with_identical_logits(tmp_path, layout):
    extra = {"fc_norm": False, "norm_output": False} if layout == "eagle3" else {}
    model = tiny_drafter(seed=3, eagle_aux_hidden_state_layer_ids=IDS, **extra)
    if layout == "training":
        src = training_checkpoint(tmp_path / "src", model)
    elif layout == "nemo":
        src = nemo_checkpoint(tmp_path / "src", model)
    else:
        src = write_checkpoint(tmp_path / "src", published_style_config(model), model.state_dict())
    dst = convert(src, tmp_path / "hub", progress=False).folder
    same_logits(dst, model)
    assert tensor_names(dst) == sorted(model.state_dict())  # the published names
    config = json.loads((dst / "config.json").read_text())
    assert (
        config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS
    )
    assert config["aux_layer_ids_convention"] == "one_based"
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert (
        config["auto_map"]
        == AUTO_MAP
        == {
            "AutoConfig": "configuration_eagle31_mla.Eagle31MLAConfig",
            "AutoModelForCausalLM": "modeling_eagle31_mla.Eagle31MLAForCausalLM",
        }
    )
    assert config["fc_norm"] is (layout != "eagle3") and config["norm_output"] is (layout != "eagle3")
    assert "_name_or_path" not in config and "id2label" not in config  # save_pretrained's form, no local paths
    for name in REMOTE_CODE_FILES:
        assert (dst / name).read_bytes() == (ROOT / "src" / "eagle31_mla" / "model" / name).read_bytes()
    card = (dst / "README.md").read_text()
    assert "vllm serve" in card and "sglang serve" in card and "tokenspeed serve" in card
    assert "--eagle3-layers-to-capture 2,5,9" in card


def test_remote_code_list_is_the_one_modeling_is_generated_from():
    from eagle31_mla.hub import remote_code

    assert remote_code.REMOTE_CODE_FILES is REMOTE_CODE_FILES
    assert sorted(p.name for p in remote_code.MODELING.glob("*.py")) == sorted(REMOTE_CODE_FILES)


REMOTE = """
import sys, torch
sys.modules["eagle31_mla"] = None  # importing the library fails: only the folder's own code can run
from transformers import AutoModelForCausalLM
folder, inputs, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(
    folder, trust_remote_code=True, device_map="auto", dtype="auto", force_download=False, proxies=None
)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ids, aux = torch.load(inputs)
torch.save(model(ids, aux_hidden_states=aux).logits, out)
assert sys.modules["eagle31_mla"] is None
"""


def test_converted_folder_loads_through_auto_model_with_remote_code(tmp_path):
    """In a process where eagle31_mla cannot be imported (Transformers, the folder, and its remote code only)."""
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    dst = convert(training_checkpoint(tmp_path / "src", model), tmp_path / "hub", progress=False).folder
    ids, aux = aux_inputs(model.config, 1, 5)
    torch.save((ids, aux), tmp_path / "inputs.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [sys.executable, "-c", REMOTE, str(dst), str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    # exact: the remote code is the same source (synced from src/), same weights, same shapes, same CPU
    assert torch.equal(torch.load(tmp_path / "logits.pt"), model(ids, aux_hidden_states=aux).logits)


def test_converting_twice_gives_byte_identical_folders(tmp_path):
    model = tiny_drafter(seed=5, eagle_aux_hidden_state_layer_ids=IDS)
    src = training_checkpoint(tmp_path / "src", model)
    counts = tmp_path / "counts.txt"
    counts.write_text("".join(f"{t} {1000 - t}\n" for t in range(0, 300, 2)))
    options = dict(prune_vocab=60, token_counts=counts, max_shard_size="40KB", progress=False)
    a, b = (convert(src, tmp_path / run / "hub", **options).folder for run in "ab")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) > 7  # several shards + index
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_sharding_above_the_threshold(tmp_path):
    model = tiny_drafter(seed=6, eagle_aux_hidden_state_layer_ids=IDS)
    src = write_checkpoint(tmp_path / "src", published_style_config(model), model.state_dict())
    sizes = {k: t.numel() * t.element_size() for k, t in model.state_dict().items()}
    total = sum(sizes.values())
    one = convert(src, tmp_path / "one", max_shard_size=total, progress=False).folder
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()
    sharded = convert(src, tmp_path / "sharded", max_shard_size=total // 3, progress=False).folder
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(sizes) and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == total
    for shard in shards:  # each shard within the limit unless a single tensor exceeds it
        assert sum(n for k, n in sizes.items() if index["weight_map"][k] == shard) <= max(total // 3, *sizes.values())
    same_logits(sharded, model)


def test_dtype_option(tmp_path):
    model = tiny_drafter(seed=8, eagle_aux_hidden_state_layer_ids=IDS)
    src = training_checkpoint(tmp_path / "src", model)
    dst = convert(src, tmp_path / "bf16", dtype="bfloat16", max_shard_size="30KB", progress=False).folder
    dtypes = set()
    for file in dst.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"} and json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = Eagle31MLAForCausalLM.from_pretrained(dst)
    assert loaded.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16()), name


# ---- vocabulary pruning ------------------------------------------------------------------------------


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
    src = write_checkpoint(tmp_path / "src", published_style_config(model), model.state_dict())
    source_targets = (torch.arange(120) + model.d2t).tolist()
    counts = tmp_path / "counts.txt"
    counts.write_text("# token count\n" + "".join(f"{t} {t}\n" for t in source_targets))
    result = convert(src, tmp_path / "out", prune_vocab=30, token_counts=counts, progress=False)
    assert "pruned vocabulary 120/300" in result.source_layout
    pruned = Eagle31MLAForCausalLM.from_pretrained(result.folder)
    targets = (torch.arange(30) + pruned.d2t).tolist()
    specials = [t for t in (0, 1, 2) if t in source_targets]
    assert targets == sorted(set(specials) | set(sorted(source_targets, reverse=True)[: 30 - len(specials)]))
    assert torch.equal(pruned.lm_head.weight, model.lm_head.weight[[source_targets.index(t) for t in targets]])


def test_token_count_formats_and_choice(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([0, 5, 0, 7]))
    assert read_token_counts(tmp_path / "list.json") == {0: 0, 1: 5, 2: 0, 3: 7}
    (tmp_path / "pairs.txt").write_text("3 4\n\n1 2  # comment\n3 1\n")
    assert read_token_counts(tmp_path / "pairs.txt") == {3: 5, 1: 2}
    (tmp_path / "bad.txt").write_text("3 four\n")
    with pytest.raises(InputError, match="bad.txt"):
        read_token_counts(tmp_path / "bad.txt")
    kept, notes = choose_vocabulary({5: 9, 6: 9, 7: 1, 99: 4}, 4, range(10), always=[0])
    assert kept == [0, 5, 6, 7] and any("not in the source" in n for n in notes)  # ties: smaller id first
    with pytest.raises(InputError):
        choose_vocabulary({}, 1, range(10), always=[0, 1])
    assert parse_size("5GB") == 5 * 10**9 and parse_size("40KB") == 40_000 and parse_size("1000") == 1000
    for bad in ("0", "-1GB", "nanGB", "infGB", "1_0", "\uff18", "abc", "", "2MiB"):
        with pytest.raises(InputError):
            parse_size(bad)


# ---- refusals and the command ------------------------------------------------------------------------


def test_a_refused_source_writes_nothing(tmp_path):
    model = tiny_drafter(seed=11, eagle_aux_hidden_state_layer_ids=IDS)
    state = dict(model.state_dict())
    del state["norm.weight"]
    src = write_checkpoint(tmp_path / "src", published_style_config(model), state)
    with pytest.raises(ConvertError, match="missing tensor 'norm.weight'"):
        convert(src, tmp_path / "out", progress=False)
    state = {**model.state_dict(), "fc.weight": torch.zeros(3, 3)}
    misshaped = write_checkpoint(tmp_path / "misshaped", published_style_config(model), state)
    with pytest.raises(ConvertError, match="fc.weight"):
        convert(misshaped, tmp_path / "out", progress=False)
    good = write_checkpoint(tmp_path / "good", published_style_config(model), model.state_dict())
    (tmp_path / "counts.txt").write_text("5 1\n")
    with pytest.raises(InputError, match="special tokens"):  # bos, eos, pad cannot fit in 2
        convert(good, tmp_path / "out", prune_vocab=2, token_counts=tmp_path / "counts.txt", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counts.txt", "good", "misshaped", "src"]


def test_cli_convert_exit_codes(tmp_path, capsys):
    model = tiny_drafter(seed=12, eagle_aux_hidden_state_layer_ids=IDS)
    src = nemo_checkpoint(tmp_path / "src", model)
    assert main(["convert", str(src), str(tmp_path / "hub"), "--quiet"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "hub"), "--quiet"]) == 2  # not empty
    assert "--force" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "hub"), "--quiet", "--force", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == 20 and "NeMo" in summary["source"]
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 2
    assert main(["convert", str(src), str(tmp_path / "y"), "--prune-vocab", "10", "--quiet"]) == 2  # no counts file
    state = {**model.state_dict(), "extra.weight": torch.zeros(2)}
    bad = write_checkpoint(tmp_path / "bad", published_style_config(model), state)
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "z"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "unexpected tensor 'extra.weight'" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
