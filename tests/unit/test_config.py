"""Eagle31MLAConfig reads every config form of SPEC §2 exactly (what it refuses: tests/unit/test_bad_inputs.py)."""

import json

import pytest
import torch

from eagle31_mla import ConfigError, Eagle31MLAConfig
from eagle31_mla.model.aux_layers import KIMI_K3_AUX_LAYER_IDS
from eagle31_mla.model.configuration_eagle31_mla import KIMI_K3_ROPE_PARAMETERS, describe_rope, resolve_dtype

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


def read(tmp_path, config: dict) -> Eagle31MLAConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return Eagle31MLAConfig.from_pretrained(tmp_path)


def test_default_config_is_the_published_kimi_k3_drafter():
    """The no-argument config and the published config.json (next test) describe one drafter: its dims are the
    published tensor roster's (tests/unit/test_checkpoint.py), with Kimi-K3's aux ids, YaRN and ids."""
    c = Eagle31MLAConfig()
    assert Eagle31MLAConfig.from_dict(c.to_dict()).to_dict() == c.to_dict()  # the same, passed on as a file
    assert (c.num_key_value_heads, c.vocab_size, c.draft_vocab_size, c.target_hidden_size) == (64, 163840, 163840, 7168)
    assert c.aux_layer_ids.one_based == KIMI_K3_AUX_LAYER_IDS.one_based == (2, 46, 90)
    assert c.aux_layer_ids.zero_based == (1, 45, 89) and c.fc_norm and c.norm_output and c.is_eagle31
    assert c.rope_parameters == KIMI_K3_ROPE_PARAMETERS == {"rope_type": "yarn", "rope_theta": 50000.0, **K3_YARN}
    assert describe_rope(c) == "yarn, theta 50000, factor 32 over 32768 positions"  # as inspect, roster, cards say
    assert (c.max_position_embeddings, c.bos_token_id, c.eos_token_id) == (1048576, 163584, 163586)
    assert c.dtype == torch.bfloat16 and c.kv_cache_values_per_token == 576
    # softmax scale = 1/sqrt(192) · mscale², mscale = 0.1·1·ln(32) + 1
    assert c.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(32.0)).item() + 1) ** 2)
    # the constructor's Kimi-K3 ids are defaults nobody wrote: beyond a smaller vocabulary they are left unset
    small = Eagle31MLAConfig(vocab_size=300, rope_parameters={"rope_type": "default"})
    assert (small.bos_token_id, small.eos_token_id, small.pad_token_id) == (None, None, 0)


def test_published_config_reads_as_the_default_and_saves_in_its_form(tmp_path):
    c = read(tmp_path, published_k3_config())
    assert not hasattr(c, "mla_use_nope")  # ignored, as every engine ignores it
    assert c.to_dict() == Eagle31MLAConfig().to_dict()
    c.save_pretrained(tmp_path / "out")
    assert Eagle31MLAConfig.from_pretrained(tmp_path / "out").to_dict() == c.to_dict()
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and saved["model_type"] == "kimi_k2"
    assert "head_dim" not in saved and "qk_head_dim" not in saved
    for model_type in ("deepseek_v2", "deepseek_v3"):  # the other model types drafters are exported as
        assert read(tmp_path, published_k3_config(model_type=model_type)).hidden_size == 7168


PLAIN = {"rope_type": "default", "rope_theta": 50000.0}
ROPE_FORMS = {  # the file's rope keys -> the rope read. No rope (one report on the K3 draft), null or absent alike:
    # plain RoPE at the file's theta, never the constructor's Kimi-K3 YaRN
    "rope_parameters": (dict(rope_scaling=DROP, rope_theta=DROP, rope_parameters=KIMI_K3_ROPE_PARAMETERS), None),
    "deepseek_yarn": (dict(rope_scaling={"rope_type": "deepseek_yarn", **K3_YARN}), None),
    "absent": (dict(rope_scaling=DROP), PLAIN),
    "null_parameters": (dict(rope_scaling=DROP, rope_parameters=None), PLAIN),
    "null_scaling": (dict(rope_scaling=None), PLAIN),
    "both_null": (dict(rope_scaling=None, rope_parameters=None), PLAIN),
}


@pytest.mark.parametrize("form", ROPE_FORMS)
def test_rope_forms(tmp_path, form):
    """The legacy rope_scaling form: the published config (test_published_config_reads_as_the_default)."""
    changes, plain = ROPE_FORMS[form]
    c = read(tmp_path, published_k3_config(**changes))
    assert c.rope_parameters == (plain or KIMI_K3_ROPE_PARAMETERS)
    if plain:
        assert c.softmax_scale == pytest.approx(192**-0.5) and describe_rope(c.to_dict()) == "default, theta 50000"


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}),
        dict(eagle_config=DROP, eagle_aux_hidden_state_layer_ids=[2, 46, 90]),
        dict(eagle_aux_hidden_state_layer_ids=[2, 46, 90]),
    ],
)
def test_aux_id_forms(tmp_path, changes):
    c = read(tmp_path, published_k3_config(**changes))
    assert c.aux_layer_ids.one_based == (2, 46, 90)
    written = c.to_dict()  # written back one-based everywhere, labelled
    assert written["eagle_aux_hidden_state_layer_ids"] == written["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 46, 90]
    assert written["aux_layer_ids_convention"] == "one_based"
    assert written["eagle_config"]["use_aux_hidden_state"] is True


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16, "torch.float16": torch.float16}


@pytest.mark.parametrize("name", DTYPES)
def test_dtype_names(tmp_path, name):
    assert resolve_dtype(name) == DTYPES[name] == read(tmp_path, published_k3_config(torch_dtype=name)).dtype
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None


@pytest.mark.parametrize(
    "derived", [{"head_dim": 64}, {"head_dim": 192}, {"qk_head_dim": 192}, {"head_dim": 64, "qk_head_dim": 192}]
)
def test_derived_dims_in_their_published_forms_load(tmp_path, derived):
    """Transformers' DeepSeek configs write head_dim = qk_rope_head_dim and qk_head_dim = nope + rope."""
    config = read(tmp_path, published_k3_config(**derived))
    assert (config.head_dim, config.qk_head_dim) == (64, 192)


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
    assert not readings[0].fc_norm and not readings[0].norm_output and not readings[0].is_eagle31  # EAGLE-3
    assert readings[0].rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}  # Transformers' default theta
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
