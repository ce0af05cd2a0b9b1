"""`eagle31-mla inspect`: the drafter in plain words, its tensors against its config and the published
roster (headers only), and which engine releases serve it."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from eagle31_mla import Eagle31MLAConfig
from eagle31_mla.cli import main
from eagle31_mla.hub.roster import PUBLISHED_ROSTER
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers


def published_shaped_folder(folder: Path) -> Path:
    """The published checkpoint's exact header over a sparse file: 6 GB on paper, nothing on disk."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(Eagle31MLAConfig().to_json_string(use_diff=True))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in sorted(PUBLISHED_ROSTER.items()):
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return folder


def test_inspect_the_published_layout(tmp_path, capsys):
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


def test_inspect_refusals_and_unreadable_input(tmp_path, capsys):
    model = tiny_drafter(seed=3)
    state = dict(model.state_dict())
    del state["fc_norm.1.weight"]
    folder = write_checkpoint(tmp_path / "broken", published_style_config(model), state)
    assert main(["inspect", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "DO NOT match the config" in out and "missing tensor 'fc_norm.1.weight'" in out
    config = published_style_config(model)
    config["num_hidden_layers"] = 2
    assert main(["inspect", str(write_checkpoint(tmp_path / "two-layers", config, {}))]) == 1
    assert "num_hidden_layers" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_inspect_by_hub_id_reads_only_the_config(tmp_path, capsys):
    """A Hub id (from the offline cache here): only config.json is fetched, the tensors are not checked."""
    cache = Path(os.environ["HF_HUB_CACHE"])
    snapshot = cache / "models--someone--config-only-drafter" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(published_shaped_folder(tmp_path / "src") / "config.json", snapshot / "config.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c" * 40)
    assert main(["inspect", "someone/config-only-drafter"]) == 0
    out = capsys.readouterr().out
    assert "tensors: not checked" in out and "parameters: 3,015,625,728" in out


def test_inspect_refuses_bad_numbers(tmp_path, capsys):
    """A config with a non-finite, mistyped or out-of-domain number, or a misspelt dtype: refused (exit 1), one
    line naming the field and what was given, no traceback. The wording is the config's own (through
    huggingface_hub's strict check, whose wrapper is dropped)."""
    import math

    model = tiny_drafter(seed=3)

    def config(**changes):
        c = published_style_config(model)
        for key, value in changes.items():
            if key.startswith("rope_scaling."):
                c["rope_scaling"][key.partition(".")[2]] = value
            else:
                c[key] = value
        return json.dumps(c)

    cases = {
        "nan-eps": (config(rms_norm_eps=math.nan), ("`rms_norm_eps` is nan", "expected a number > 0 and < 1")),
        "inf-theta": (config(rope_theta=math.inf), "`rope_parameters.rope_theta` is inf; expected a finite number"),
        "string-factor": (
            config(**{"rope_scaling.factor": "32"}),
            "`rope_parameters.factor` is '32'; expected a finite number",
        ),
        "huge-vocab": (config(vocab_size=10**30), "`vocab_size` is 1000000000000000000000000000000; expected an int"),
        "bool-heads": (config(num_attention_heads=True), "Field 'num_attention_heads' expected int, got bool"),
        "fp16": (config(torch_dtype="fp16"), "`dtype` is 'fp16'; expected a floating-point torch dtype"),
        "int32": (config(torch_dtype="int32"), "`dtype` is 'int32'; expected a floating-point torch dtype"),
    }
    for name, (text, expected) in cases.items():
        folder = write_checkpoint(tmp_path / name, {}, model.state_dict())
        (folder / "config.json").write_text(text)
        assert main(["inspect", str(folder)]) == 1, name
        captured = capsys.readouterr()
        refused = [line for line in captured.out.splitlines() if line.strip().startswith("refused:")]
        expected = (expected,) if isinstance(expected, str) else expected  # the field and domain, then what was given
        assert len(refused) == 1 and all(part in refused[0] for part in expected), (name, captured.out)
        assert "Traceback" not in captured.out + captured.err, name


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


def test_inspect_names_layouts_and_misshaped_tensors(tmp_path, capsys):
    """Layouts are named from the loader's KEY_MAPPING; a tensor of the wrong shape is named with both shapes."""
    from eagle31_mla.hub.inspection import layout_of

    assert layout_of("norm.weight") == "published" and layout_of("midlayer.mlp.up_proj.weight") == "midlayer.*"
    assert layout_of("model.norm.weight") == layout_of("model.midlayer.mlp.up_proj.weight") == "model. prefix"
    model = tiny_drafter(seed=4)
    state = {("model." + k if k != "lm_head.weight" else k): v for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"][:-1]
    folder = write_checkpoint(tmp_path / "nemo", published_style_config(model), state)
    assert main(["inspect", str(folder), "--json"]) == 1
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert tensors["layout"] == ["model. prefix", "published"] and not tensors["matches_config"]
    assert tensors["problems"] == ["tensor 'norm.weight' has shape [63], expected [64]"]


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
