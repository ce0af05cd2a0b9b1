"""Eagle31MLAConfig reads every config form of SPEC §2 exactly (what it refuses: tests/unit/test_bad_inputs.py)."""

import json

import pytest
import torch

from eagle31_mla import ConfigError, Eagle31MLAConfig
from eagle31_mla.model.configuration_eagle31_mla import KIMI_K3_ROPE_PARAMETERS, describe_rope, resolve_dtype
from tests.support.paths import GOLDEN

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

K3_YARN = {
    "factor": 32.0,
    "original_max_position_embeddings": 32768,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


DROP = object()  # a key the file does not have


def published_k3_config(**changes) -> dict:
    """SPEC §2's config.json as exported by the training framework (best evidence)."""
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": 163840,
        "draft_vocab_size": 163840,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", **K3_YARN},
        "max_position_embeddings": 1048576,
        "mla_use_nope": True,
        "fc_norm": True,
        "norm_output": True,
        "target_hidden_size": 7168,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 46, 90], "use_aux_hidden_state": True},
        "bos_token_id": 163584,
        "eos_token_id": 163586,
    }
    config.update(changes)
    return {k: v for k, v in config.items() if v is not DROP}


#: The published config.json's legacy ``rope_scaling`` {"type": "yarn", ...} leaves its "type" key in
#: rope_parameters (and so in every config.json written back): the file does not read as the default config.


def read(tmp_path, config: dict) -> Eagle31MLAConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return Eagle31MLAConfig.from_pretrained(tmp_path)


def test_default_config_is_the_kimi_k3_drafter():
    c = Eagle31MLAConfig()
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads) == (7168, 18432, 64, 64)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (c.vocab_size, c.draft_vocab_size, c.target_hidden_size) == (163840, 163840, 7168)
    assert c.aux_layer_ids.one_based == (2, 46, 90) and c.aux_layer_ids.zero_based == (1, 45, 89)
    assert c.fc_norm and c.norm_output and c.is_eagle31
    assert c.rope_parameters == {"rope_type": "yarn", "rope_theta": 50000.0, **K3_YARN}
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_id, c.dtype) == (
        1048576,
        163584,
        163586,
        torch.bfloat16,
    )
    assert c.kv_cache_values_per_token == 576
    # softmax scale = 1/sqrt(192) · mscale², mscale = 0.1·1·ln(32) + 1
    assert c.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(32.0)).item() + 1) ** 2)


def test_published_config_reads_as_the_default(tmp_path):
    c = read(tmp_path, published_k3_config())
    default = Eagle31MLAConfig()
    for key in (
        "hidden_size",
        "rope_parameters",
        "fc_norm",
        "norm_output",
        "eagle_aux_hidden_state_layer_ids",
        "q_lora_rank",
        "kv_lora_rank",
        "max_position_embeddings",
        "draft_vocab_size",
    ):
        assert getattr(c, key) == getattr(default, key), key
    assert not hasattr(c, "mla_use_nope")  # ignored, as every engine ignores it
    assert c.to_dict() == default.to_dict()


@pytest.mark.parametrize("model_type", ["kimi_k2", "deepseek_v2", "deepseek_v3"])
def test_model_types(tmp_path, model_type):
    assert read(tmp_path, published_k3_config(model_type=model_type)).hidden_size == 7168


def test_rope_forms_agree(tmp_path):
    legacy = read(tmp_path, published_k3_config())
    v5 = read(
        tmp_path,
        published_k3_config(
            rope_scaling=DROP, rope_theta=DROP, rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **K3_YARN}
        ),
    )
    deepseek_name = read(tmp_path, published_k3_config(rope_scaling={"rope_type": "deepseek_yarn", **K3_YARN}))
    assert legacy.rope_parameters == v5.rope_parameters == deepseek_name.rope_parameters == KIMI_K3_ROPE_PARAMETERS


def test_no_rope_scaling_means_plain_rope(tmp_path):
    """One report says the K3 draft declares no rope scaling: plain RoPE at its theta."""
    c = read(tmp_path, published_k3_config(rope_scaling=DROP))
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert c.softmax_scale == pytest.approx(192**-0.5)
    c = read(tmp_path, published_k3_config(rope_scaling=DROP, rope_theta=DROP))
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}  # Transformers' default theta


def test_absent_eagle31_flags_mean_eagle3(tmp_path):
    c = read(tmp_path, published_k3_config(fc_norm=DROP, norm_output=DROP))
    assert not c.fc_norm and not c.norm_output and not c.is_eagle31


@pytest.mark.parametrize(
    "changes, one_based",
    [
        (dict(), (2, 46, 90)),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}), (2, 46, 90)),
        (dict(eagle_config=DROP, eagle_aux_hidden_state_layer_ids=[2, 46, 90]), (2, 46, 90)),
        (dict(eagle_aux_hidden_state_layer_ids=[2, 46, 90]), (2, 46, 90)),
    ],
)
def test_aux_id_forms(tmp_path, changes, one_based):
    c = read(tmp_path, published_k3_config(**changes))
    assert c.aux_layer_ids.one_based == one_based
    written = c.to_dict()  # written back one-based everywhere, labelled
    assert written["eagle_aux_hidden_state_layer_ids"] == list(one_based)
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(one_based)
    assert written["aux_layer_ids_convention"] == "one_based"
    assert written["eagle_config"]["use_aux_hidden_state"] is True


def test_round_trip_through_save(tmp_path):
    c = read(tmp_path, published_k3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}))
    c.save_pretrained(tmp_path / "out")
    again = Eagle31MLAConfig.from_pretrained(tmp_path / "out")
    assert again.to_dict() == c.to_dict()
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and saved["model_type"] == "kimi_k2"
    assert "head_dim" not in saved and "qk_head_dim" not in saved


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("half", torch.float16),
        ("torch.float16", torch.float16),
    ],
)
def test_dtype_names(tmp_path, name, dtype):
    assert resolve_dtype(name) == dtype
    assert read(tmp_path, published_k3_config(torch_dtype=name)).dtype == dtype
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None


@pytest.mark.parametrize(
    "nulls", [{"rope_parameters": None}, {"rope_scaling": None}, {"rope_parameters": None, "rope_scaling": None}]
)
def test_null_rope_in_a_file_means_plain_rope_as_absent_does(tmp_path, nulls):
    """In a file, null and absent mean the same: plain RoPE (never the constructor's Kimi-K3 YaRN)."""
    absent = read(tmp_path, published_k3_config(rope_scaling=DROP))
    (tmp_path / "null").mkdir()
    null = read(
        tmp_path / "null", published_k3_config(**{"rope_scaling": DROP, "max_position_embeddings": 4096, **nulls})
    )
    assert null.rope_parameters == absent.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}


@pytest.mark.parametrize(
    "derived", [{"head_dim": 64}, {"head_dim": 192}, {"qk_head_dim": 192}, {"head_dim": 64, "qk_head_dim": 192}]
)
def test_derived_dims_in_their_published_forms_load(tmp_path, derived):
    """Transformers' DeepSeek configs write head_dim = qk_rope_head_dim and qk_head_dim = nope + rope."""
    config = read(tmp_path, published_k3_config(**derived))
    assert (config.head_dim, config.qk_head_dim) == (64, 192)


def test_kimi_default_token_ids_are_dropped_for_a_smaller_vocabulary():
    """The constructor's Kimi-K3 ids are defaults nobody wrote: beyond a smaller vocabulary they are left unset."""
    small = Eagle31MLAConfig(vocab_size=300, rope_parameters={"rope_type": "default"})
    assert (small.bos_token_id, small.eos_token_id, small.pad_token_id) == (None, None, 0)
    assert Eagle31MLAConfig().bos_token_id == 163584


def test_the_tiny_and_golden_configs_read():
    from tests.support.tiny import tiny_config

    tiny_config()
    tiny_config(rope_parameters={"rope_type": "default"})
    folders = [f for f in sorted(GOLDEN.glob("*/")) if (f / "config.json").is_file()]
    assert len(folders) == 2
    for folder in folders:
        Eagle31MLAConfig.from_pretrained(folder)


def test_kimi_k3_preset_is_the_published_drafter():
    """The named preset, the no-argument config and the published config.json describe one drafter: the
    published tensor roster, parameter count and dtype, Kimi-K3's aux ids and YaRN."""
    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.hub.roster import roster_differences
    from eagle31_mla.model.aux_layers import KIMI_K3_AUX_LAYER_IDS

    preset = Eagle31MLAConfig.kimi_k3()
    assert preset.to_dict() == Eagle31MLAConfig().to_dict()  # the published file: test_published_config_reads_...
    assert Eagle31MLAConfig.from_dict(preset.to_dict()).to_dict() == preset.to_dict()  # the same, passed on as a file
    state = Eagle31MLAForCausalLM.on_meta_device(preset).state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    dtypes, count = {t.dtype for t in state.values()}, sum(t.numel() for t in state.values())
    assert roster_differences(shapes, dtypes=dtypes, num_parameters=count) == []
    assert preset.aux_layer_ids.one_based == KIMI_K3_AUX_LAYER_IDS.one_based
    assert preset.rope_parameters == KIMI_K3_ROPE_PARAMETERS
    assert Eagle31MLAConfig.kimi_k3(target_num_hidden_layers=93).target_num_hidden_layers == 93


def test_the_default_aux_ids_are_kimi_k3s_constant(monkeypatch):
    """One home for Kimi-K3's aux ids: the no-argument config takes them from aux_layers."""
    from eagle31_mla.model import configuration_eagle31_mla
    from eagle31_mla.model.aux_layers import AuxLayerIds

    monkeypatch.setattr(configuration_eagle31_mla, "KIMI_K3_AUX_LAYER_IDS", AuxLayerIds((3, 7, 11)))
    assert Eagle31MLAConfig().eagle_aux_hidden_state_layer_ids == [3, 7, 11]


def test_file_readers_agree_and_the_constructor_differs_only_as_documented(tmp_path):
    """from_pretrained, from_dict and from_json_file read a file that omits fc_norm / norm_output / rope alike
    (EAGLE-3, plain RoPE); the constructor gives exactly those keys Kimi-K3's values (the class docstring)."""
    file = published_k3_config(fc_norm=DROP, norm_output=DROP, rope_scaling=DROP, rope_theta=DROP)
    (tmp_path / "config.json").write_text(json.dumps(file))
    readings = [
        Eagle31MLAConfig.from_pretrained(tmp_path),
        Eagle31MLAConfig.from_dict(dict(file)),
        Eagle31MLAConfig.from_json_file(tmp_path / "config.json"),
    ]
    assert all(r.to_dict() == readings[0].to_dict() for r in readings)
    assert (readings[0].fc_norm, readings[0].norm_output, readings[0].rope_parameters) == (
        False,
        False,
        {"rope_type": "default", "rope_theta": 10000.0},
    )
    constructed = Eagle31MLAConfig(**json.loads((tmp_path / "config.json").read_text()))
    differs = {k for k, v in constructed.to_dict().items() if readings[0].to_dict().get(k) != v}
    assert differs == {"fc_norm", "norm_output", "rope_parameters"}
    assert "from_json_file" in Eagle31MLAConfig.__doc__ and "fc_norm" in Eagle31MLAConfig.__doc__
    no_ids = {k: v for k, v in file.items() if k != "eagle_config"}
    with pytest.raises(ConfigError, match="names no aux layers"):  # a file must name its aux layers
        Eagle31MLAConfig.from_dict(no_ids)
    assert Eagle31MLAConfig(**no_ids).eagle_aux_hidden_state_layer_ids == [2, 46, 90]  # the constructor: Kimi-K3's
    full = Eagle31MLAConfig.from_dict(dict(file)).to_dict()  # written out (as every saved file is): read alike
    assert Eagle31MLAConfig(**full).to_dict() == Eagle31MLAConfig.from_dict(full).to_dict()


def test_describe_rope_is_the_one_wording():
    assert describe_rope(Eagle31MLAConfig()) == "yarn, theta 50000, factor 32 over 32768 positions"
    assert describe_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}) == "default, theta 10000"
