"""`eagle31-mla inspect`: the drafter in plain words, its tensors against its config and the published
roster (headers only), and which engine releases serve it."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest

from eagle31_mla import Eagle31MLAConfig
from eagle31_mla.cli import main
from eagle31_mla.hub.roster import PUBLISHED_ROSTER
from tests.support.tiny import add_to_hub_cache, published_style_config, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers


def published_shaped_folder(folder: Path) -> Path:
    """The published checkpoint's exact header over a sparse file: 6 GB on paper, nothing on disk."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(Eagle31MLAConfig().to_json_string(use_diff=True))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(PUBLISHED_ROSTER.items()):
        size = 2 * math.prod(shape)  # bfloat16
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return folder


def test_inspect_the_published_layout_by_folder_and_by_hub_id(tmp_path, capsys):
    folder = published_shaped_folder(tmp_path / "kimi-k3-eagle3.1-mla")
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "EAGLE-3.1 (fc_norm + norm_output)" in out
    assert "hidden 7168 (target 7168), 64 heads, q_lora 1536, kv_lora 512 + rope 64, nope 128, v 128, MLP 18432" in out
    assert "one-based [2, 46, 90] = zero-based [1, 45, 89]" in out
    assert "yarn, theta 50000, factor 32 over 32768 positions" in out
    assert "vocabulary: 163840 (full, not pruned)" in out
    assert "parameters: 3,015,625,728 (bfloat16)" in out
    assert "576 values = 1,152 bytes per token (bfloat16)" in out and "32,768" in out
    assert "tensors: 20 in model.safetensors" in out and "match the config" in out
    assert "published roster (lightseekorg/kimi-k3-eagle3.1-mla): matches exactly" in out
    assert "vLLM 0.27-0.33     as is" in out and "vLLM 0.20-0.26     no  (vllm-kimi-k3-version)" in out
    assert "SGLang 0.5.23      with the eagle31-mla plugin  (sglang-k3-no-capture)" in out
    assert "TokenSpeed 0.1.1   as is" in out
    # by Hub id (from the offline cache here): only config.json is fetched, the tensors are not checked
    add_to_hub_cache("someone/config-only-drafter", "c" * 40, [folder / "config.json"])
    assert main(["inspect", "someone/config-only-drafter"]) == 0
    out = capsys.readouterr().out
    assert "tensors: not checked" in out and "parameters: 3,015,625,728" in out


def test_inspect_json_for_a_training_checkpoint(tmp_path, capsys):
    model = tiny_drafter(seed=2, draft_vocab_size=120, eagle_aux_hidden_state_layer_ids=[2, 46, 90])
    config = published_style_config(model)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 45, 89]  # training form: zero-based
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in model.state_dict().items()}
    folder = write_checkpoint(tmp_path / "training", config, tensors)
    assert main(["inspect", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["aux_layer_ids"]["one_based"] == [2, 46, 90] and info["aux_layer_ids"]["zero_based"] == [1, 45, 89]
    assert "zero_based" in info["aux_layer_ids"]["how"]
    assert info["eagle"] == "3.1" and info["vocabulary"] == {"vocab_size": 300, "draft_vocab_size": 120, "pruned": True}
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["kv_cache"]["values_per_token"] == 32 + 16 and info["kv_cache"]["bytes_per_token"] == 48 * 4
    assert info["tensors"]["matches_config"] and info["tensors"]["layout"] == ["midlayer.*", "published"]
    assert (
        not info["tensors"]["matches_published_roster"] and "extra d2t [120]" in info["tensors"]["roster_differences"]
    )
    vllm = {tuple(r["versions"]): r["status"] for r in info["serving"] if r["engine"] == "vllm"}
    assert vllm[tuple(f"0.{m}" for m in range(27, 34))] == "with the eagle31-mla plugin"  # nested zero-based ids
    tokenspeed = next(r for r in info["serving"] if r["engine"] == "tokenspeed")
    assert tokenspeed["status"] == "with the eagle31-mla plugin (or --eagle3-layers-to-capture 2,46,90)"


def test_inspect_refuses_a_bad_value_in_one_line(tmp_path, capsys):
    """Refused (exit 1), one line naming the field and what was given, no traceback: a config rule's own words, a
    strict type check's (its two-line wrapper dropped). Each value's exact message: tests/unit/test_bad_inputs.py."""
    model = tiny_drafter(seed=3)
    for changes, expected in [
        (dict(rms_norm_eps=math.nan), "`rms_norm_eps` is nan; expected a number > 0 and < 1"),
        (dict(num_attention_heads=True), "Field 'num_attention_heads' expected int, got bool"),
    ]:
        config = {**published_style_config(model), **changes}
        folder = write_checkpoint(tmp_path / next(iter(changes)), config, model.state_dict())
        assert main(["inspect", str(folder)]) == 1
        captured = capsys.readouterr()
        refused = [line for line in captured.out.splitlines() if line.strip().startswith("refused:")]
        assert len(refused) == 1 and expected in refused[0] and "Traceback" not in captured.out + captured.err


def test_inspect_unreadable_config_files_are_one_line_naming_the_file(tmp_path, capsys):
    """A config.json Transformers' reader cannot read as an object (not JSON, null, nested past Python's JSON
    reader), or one that is no regular file (a FIFO is never opened: reading it would block): exit 2, one line
    naming the file, no traceback."""
    cases = {"not-json": "{x", "null": "null", "deep": '{"a":' * 10_000 + "1" + "}" * 10_000}
    for name, text in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    os.mkfifo(tmp_path / "fifo.json")
    for path in [*(tmp_path / name / "config.json" for name in cases), tmp_path / "fifo.json"]:
        assert main(["inspect", str(path)]) == 2, path
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and not captured.out, (path, captured.err)


def test_inspect_names_layouts_and_tensors_that_do_not_match(tmp_path, capsys):
    """Layouts are named (and tensors renamed, as the loader and the engine plugins rename them) from the loader's
    KEY_MAPPING; a missing tensor is named, a misshaped one with both shapes."""
    from eagle31_mla.hub.inspection import layout_of
    from eagle31_mla.model.modeling_eagle31_mla import KEY_MAPPING, canonical_tensor_name

    assert KEY_MAPPING == {r"^model\.": "", r"^midlayer\.": "layers.0."}
    assert canonical_tensor_name("model.midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert layout_of("norm.weight") == "published" and layout_of("midlayer.mlp.up_proj.weight") == "midlayer.*"
    assert layout_of("model.norm.weight") == layout_of("model.midlayer.mlp.up_proj.weight") == "model. prefix"
    model = tiny_drafter(seed=4)
    state = {("model." + k if k != "lm_head.weight" else k): v for k, v in model.state_dict().items()}
    del state["model.fc_norm.1.weight"]
    state["model.norm.weight"] = state["model.norm.weight"][:-1]
    folder = write_checkpoint(tmp_path / "nemo", published_style_config(model), state)
    assert main(["inspect", str(folder)]) == 1
    assert "DO NOT match the config (2 problem(s))" in capsys.readouterr().out
    assert main(["inspect", str(folder), "--json"]) == 1
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert tensors["layout"] == ["model. prefix", "published"] and not tensors["matches_config"]
    missing, misshaped = "missing tensor 'fc_norm.1.weight'", "tensor 'norm.weight' has shape [63], expected [64]"
    assert tensors["problems"] == [missing, misshaped]


def test_inspect_refuses_weights_outside_the_folder_and_dangling_links(tmp_path, capsys):
    model = tiny_drafter(seed=3)
    escaping = write_checkpoint(tmp_path / "escaping", published_style_config(model), model.state_dict())
    (escaping / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (escaping / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"norm.weight": "../elsewhere.safetensors"}})
    )
    dangling = write_checkpoint(tmp_path / "dangling", published_style_config(model), model.state_dict())
    (dangling / "model.safetensors").unlink()
    os.symlink(tmp_path / "blobs" / "gone", dangling / "model.safetensors")
    for folder, expected in (
        (escaping, "names shards outside its folder: ['../elsewhere.safetensors']"),
        (dangling, "No such file or directory"),
    ):
        assert main(["inspect", str(folder)]) == 1
        out = capsys.readouterr().out
        assert any(line.strip().startswith("refused: tensors:") and expected in line for line in out.splitlines()), out
