"""The checkpoint contract: the published roster and other layouts of the same tensors, loaded exactly (what it
refuses: tests/unit/test_bad_inputs.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP
from tests.support.tiny import aux_inputs, published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

# SPEC §2, transcribed here on purpose (not imported from the library): the published file's header.
PUBLISHED = {
    "embed_tokens.weight": [163840, 7168],
    "fc.weight": [7168, 21504],
    "fc_norm.0.weight": [7168],
    "fc_norm.1.weight": [7168],
    "fc_norm.2.weight": [7168],
    "layers.0.hidden_norm.weight": [7168],
    "layers.0.input_layernorm.weight": [7168],
    "layers.0.post_attention_layernorm.weight": [7168],
    "layers.0.self_attn.q_a_proj.weight": [1536, 14336],
    "layers.0.self_attn.q_a_layernorm.weight": [1536],
    "layers.0.self_attn.q_b_proj.weight": [12288, 1536],
    "layers.0.self_attn.kv_a_proj_with_mqa.weight": [576, 14336],
    "layers.0.self_attn.kv_a_layernorm.weight": [512],
    "layers.0.self_attn.kv_b_proj.weight": [16384, 512],
    "layers.0.self_attn.o_proj.weight": [7168, 8192],
    "layers.0.mlp.gate_proj.weight": [18432, 7168],
    "layers.0.mlp.up_proj.weight": [18432, 7168],
    "layers.0.mlp.down_proj.weight": [7168, 18432],
    "norm.weight": [7168],
    "lm_head.weight": [163840, 7168],
}


def test_default_config_reproduces_the_published_roster():
    model = Eagle31MLAForCausalLM.on_meta_device(Eagle31MLAConfig())
    state = model.state_dict()
    assert {k: list(v.shape) for k, v in state.items()} == PUBLISHED
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert sum(v.numel() for v in state.values()) == 3_015_625_728
    # bytes on disk: bf16 data + 8-byte length + 2,128-byte header = the pinned file size
    assert 2 * 3_015_625_728 + 8 + 2128 == 6_031_253_592
    assert all(p.is_meta for p in model.parameters())


def test_library_roster_table_matches_spec():
    from eagle31_mla.hub.roster import PUBLISHED_NUM_PARAMETERS, PUBLISHED_ROSTER, roster_differences

    assert {k: list(v) for k, v in PUBLISHED_ROSTER.items()} == PUBLISHED
    assert PUBLISHED_NUM_PARAMETERS == 3_015_625_728
    assert roster_differences({**PUBLISHED, "g_proj.weight": [1]}) == ["extra g_proj.weight [1]"]


def test_save_pretrained_writes_exactly_the_published_names(tmp_path):
    model = tiny_drafter()
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(PUBLISHED)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert (
        config["auto_map"]
        == AUTO_MAP
        == {  # the classes, as Transformers names them from their modules
            "AutoConfig": "configuration_eagle31_mla.Eagle31MLAConfig",
            "AutoModelForCausalLM": "modeling_eagle31_mla.Eagle31MLAForCausalLM",
        }
    )
    again = Eagle31MLAForCausalLM.from_pretrained(tmp_path)
    ids, aux = aux_inputs(model.config, 1, 6)
    # exact on purpose: the same weights (copied through the file), kernels and shapes in one process
    assert torch.equal(again(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


def relayout(model, rename) -> dict:
    return {rename(k): v for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "layout, rename",
    [
        ("published", lambda k: k),
        ("training midlayer", lambda k: k.replace("layers.0.", "midlayer.")),
        ("NeMo model. prefix", lambda k: k if k.startswith("lm_head") else "model." + k),
    ],
)
def test_layouts_load_with_identical_logits(tmp_path, layout, rename):
    model = tiny_drafter(seed=1)
    folder = write_checkpoint(tmp_path, published_style_config(model), relayout(model, rename))
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder)
    ids, aux = aux_inputs(model.config, 2, 6)
    # exact on purpose: the same weights (copied through the file), kernels and shapes in one process
    assert torch.equal(loaded(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


def test_eagle3_checkpoint_without_fc_norm(tmp_path):
    model = tiny_drafter(seed=2, fc_norm=False, norm_output=False)
    folder = write_checkpoint(tmp_path, published_style_config(model), model.state_dict())
    assert "fc_norm" not in json.loads((folder / "config.json").read_text())
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder)
    assert not loaded.config.fc_norm and not hasattr(loaded, "fc_norm")
    ids, aux = aux_inputs(model.config, 1, 6)
    # exact on purpose: the same weights (copied through the file), kernels and shapes in one process
    assert torch.equal(loaded(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


def test_pruned_vocabulary_with_d2t_and_t2d(tmp_path):
    model = tiny_drafter(seed=3, draft_vocab_size=100)
    state = model.state_dict()
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    folder = write_checkpoint(tmp_path, published_style_config(model), state)
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    # draft id i means target id i + d2t[i]; t2d marks exactly those target ids
    targets = torch.arange(100) + loaded.d2t
    assert loaded.t2d.sum() == 100 and loaded.t2d[targets].all()
    assert torch.equal(loaded.draft_to_target_ids(torch.tensor([0, 99])), targets[[0, 99]])
    # d2t alone (vLLM ignores t2d, many exports omit it): t2d is derived
    del state["t2d"]
    loaded = Eagle31MLAForCausalLM.from_pretrained(
        write_checkpoint(tmp_path / "no_t2d", published_style_config(model), state)
    )
    assert torch.equal(loaded.t2d, model.t2d)


def test_dtype_choice(tmp_path):
    model = tiny_drafter()
    folder = write_checkpoint(
        tmp_path, published_style_config(model), {k: v.bfloat16() for k, v in model.state_dict().items()}
    )
    assert Eagle31MLAForCausalLM.from_pretrained(folder).dtype == torch.float32  # config.json torch_dtype
    assert Eagle31MLAForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert Eagle31MLAForCausalLM.from_pretrained(folder, torch_dtype="bfloat16").dtype == torch.bfloat16


def test_sharded_checkpoint_with_index(tmp_path):
    model = tiny_drafter(seed=6)
    state = model.state_dict()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    tmp_path.mkdir(exist_ok=True)
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(published_style_config(model)))
    loaded = Eagle31MLAForCausalLM.from_pretrained(tmp_path)
    ids, aux = aux_inputs(model.config, 1, 4)
    # exact on purpose: the same weights (copied through the file), kernels and shapes in one process
    assert torch.equal(loaded(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


def test_loading_never_initialises_random_weights(tmp_path, monkeypatch):
    """Build on the meta device and assign the file's tensors: no init pass runs at all."""
    model = tiny_drafter()
    folder = write_checkpoint(tmp_path, published_style_config(model), model.state_dict())
    touched = []
    for name in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_"):
        original = getattr(torch.nn.init, name)

        def spy(tensor, *args, _original=original, **kwargs):
            touched.append(tensor.device.type)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, spy)
    Eagle31MLAForCausalLM.from_pretrained(folder)
    assert set(touched) <= {"meta"}  # module constructors may "init" meta tensors: free, no storage
    Eagle31MLAForCausalLM(model.config)  # control: the spy does see a real initialisation
    assert "cpu" in touched


def test_hub_cache_layout_with_symlinks_to_blobs_loads(tmp_path):
    """huggingface_hub snapshots are symlinks to ../../blobs: outside the snapshot folder, and fine."""
    model = tiny_drafter(seed=4)
    source = write_checkpoint(tmp_path / "source", published_style_config(model), model.state_dict())
    blobs = tmp_path / "models--org--drafter" / "blobs"
    snapshot = tmp_path / "models--org--drafter" / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (source / name).rename(blobs / f"blob-{name}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"blob-{name}")
    loaded = Eagle31MLAForCausalLM.from_pretrained(snapshot)
    assert torch.equal(loaded.norm.weight, model.norm.weight)


def test_index_may_name_shards_in_a_subfolder(tmp_path):
    model = tiny_drafter(seed=5)
    (tmp_path / "shards").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "shards" / "all.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(model.state_dict(), "shards/all.safetensors")})
    )
    (tmp_path / "config.json").write_text(json.dumps(published_style_config(model)))
    assert torch.equal(Eagle31MLAForCausalLM.from_pretrained(tmp_path).fc.weight, model.fc.weight)


def test_layouts_are_one_key_mapping():
    """The other layouts are Transformers' key_mapping (the default of from_pretrained), and the engine plugins
    rename through the same table."""
    from eagle31_mla.model.modeling_eagle31_mla import KEY_MAPPING, canonical_tensor_name

    assert KEY_MAPPING == {r"^model\.": "", r"^midlayer\.": "layers.0."}
    assert canonical_tensor_name("model.midlayer.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert canonical_tensor_name("lm_head.weight") == "lm_head.weight"


def test_t2d_is_derived_from_d2t_in_one_place():
    from eagle31_mla.model.modeling_eagle31_mla import t2d_from_d2t

    d2t = torch.tensor([0, 2, 5])  # draft ids 0, 1, 2 -> target ids 0, 3, 7
    assert t2d_from_d2t(d2t, 9).nonzero().flatten().tolist() == [0, 3, 7]


def test_the_roster_compares_dtypes_in_either_spelling():
    from eagle31_mla.hub.roster import PUBLISHED_NUM_PARAMETERS, roster_differences

    assert (
        roster_differences(PUBLISHED, dtypes=["BF16"]) == roster_differences(PUBLISHED, dtypes=[torch.bfloat16]) == []
    )
    assert roster_differences(PUBLISHED, dtypes=["F32"]) == ["dtypes ['float32'], published bfloat16"]
    assert roster_differences(PUBLISHED, num_parameters=PUBLISHED_NUM_PARAMETERS + 1) == [
        f"{PUBLISHED_NUM_PARAMETERS + 1:,} parameters, published {PUBLISHED_NUM_PARAMETERS:,}"
    ]
