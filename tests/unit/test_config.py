"""Eagle31MLAConfig reads every config form of SPEC §2 and refuses what cannot be right."""

import json
import logging
import re

import pytest
import torch

from eagle31_mla import ConfigError, Eagle31MLAConfig
from eagle31_mla.model.configuration_eagle31_mla import KIMI_K3_ROPE_PARAMETERS
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


def test_published_config_reads_as_the_default(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
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
    assert any("mla_use_nope" in r.message and "ignored" in r.message for r in caplog.records)
    assert not hasattr(c, "mla_use_nope")


@pytest.mark.parametrize("model_type", ["kimi_k2", "deepseek_v2", "deepseek_v3"])
def test_model_types(tmp_path, model_type):
    assert read(tmp_path, published_k3_config(model_type=model_type)).hidden_size == 7168


def test_unrelated_model_type_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        read(tmp_path, published_k3_config(model_type="llama"))


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
    "changes, message",
    [
        (dict(rope_scaling={"type": "longrope", "factor": 4.0}), "longrope"),
        (dict(rope_scaling={"type": "yarn", "original_max_position_embeddings": 32768}), "factor"),
        (dict(rope_parameters={"rope_type": "yarn", **K3_YARN}), "both `rope_parameters` and `rope_scaling`"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 89]}), "duplicates"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [45, 1, 89]}), "not ascending"),
        (dict(eagle_aux_hidden_state_layer_ids=[0, 46, 90], eagle_config=DROP), ">= 1"),
        (
            dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 46, 95]}, target_num_hidden_layers=93),
            "depth of 93",
        ),
        (
            dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 46, 90], "use_aux_hidden_state": False}),
            "use_aux_hidden_state",
        ),
        (dict(eagle_config=DROP), "names no aux layers"),
        (dict(num_aux_hidden_states=4), "num_aux_hidden_states"),
        (dict(num_hidden_layers=2), "num_hidden_layers"),
        (dict(num_key_value_heads=8), "num_key_value_heads"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(draft_vocab_size=200000), "draft_vocab_size"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_act="wiggle"), "hidden_act"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(fc_norm="yes"), "fc_norm"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        read(tmp_path, published_k3_config(**changes))


# ---- every field of the config's dataclasses, through the constructor (the malformed corpus covers config.json) ----

from eagle31_mla.model.configuration_eagle31_mla import (  # noqa: E402
    FLOAT_DTYPES,
    MAX_INDEX,
    check_config_dict,
    read_config_file,
    resolve_dtype,
)
from tests.support.config_fields import CONFIG_KEYS  # noqa: E402

#: The keys the generated cases cover (the aux-layer ids have a rule of their own: tests/unit/test_aux_layers.py).
CONFIG_FIELDS = [key for key in CONFIG_KEYS if key.kind is not None]


def _constructor_kwargs(field, value) -> dict:
    if field.in_eagle_config:
        return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 46, 90], field.key: value}}
    if not field.nested:
        return {field.name: value}
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, **K3_YARN, field.key: value}
    return {"rope_parameters": rope}


def test_the_published_values_fit_their_fields():
    published = published_k3_config()
    for field in CONFIG_FIELDS:
        where = (
            published.get("rope_scaling", {})
            if field.nested
            else published.get("eagle_config", {})
            if field.in_eagle_config
            else published
        )
        if field.key in where:
            field.check(where[field.key])  # no error
    Eagle31MLAConfig(**_constructor_kwargs(CONFIG_FIELDS[0], 163840))


@pytest.mark.parametrize("field", CONFIG_FIELDS, ids=[f.name for f in CONFIG_FIELDS])
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), "6", True, 10**400, [1]], ids=["nan", "inf", "str", "bool", "huge", "list"]
)
def test_every_field_refuses_a_wrong_value_by_name(field, value):
    right = {"bool": (True,), "str": ("6",), "token_ids": ([1],)}.get(field.kind, ())
    if any(value is r or value == r for r in right):
        return  # a right value for this kind
    with pytest.raises(ConfigError) as err:
        Eagle31MLAConfig(**_constructor_kwargs(field, value))
    shown = field.name if not field.nested else f"rope_parameters.{field.key}"
    assert f"`{shown}`" in str(err.value) and " must be " in str(err.value)


def test_sizes_fit_the_index_dtype():
    assert Eagle31MLAConfig(max_position_embeddings=MAX_INDEX).max_position_embeddings == MAX_INDEX
    with pytest.raises(
        ConfigError, match=r"`max_position_embeddings` must be an int >= 1 and <= 2147483647, got 2147483648"
    ):
        Eagle31MLAConfig(max_position_embeddings=MAX_INDEX + 1)
    with pytest.raises(ConfigError, match="`eos_token_id` must be an int >= 0"):
        Eagle31MLAConfig(eos_token_id=[163586, -1])
    assert Eagle31MLAConfig(eos_token_id=[163585, 163586]).eos_token_id == [163585, 163586]


def test_yarn_beta_order():
    with pytest.raises(
        ConfigError, match=r"`rope_scaling.beta_fast` \(1.0\) must be greater than `rope_scaling.beta_slow`"
    ):
        Eagle31MLAConfig.from_dict(
            published_k3_config(rope_scaling={"type": "yarn", **K3_YARN, "beta_fast": 1.0, "beta_slow": 32.0})
        )


@pytest.mark.parametrize(
    "name, dtype", [*FLOAT_DTYPES.items(), ("torch.float16", torch.float16), ("BFloat16", torch.bfloat16)]
)
def test_dtype_names(tmp_path, name, dtype):
    assert resolve_dtype(name) == dtype
    assert read(tmp_path, published_k3_config(torch_dtype=name)).dtype == dtype


@pytest.mark.parametrize(
    "value, hint",
    [
        ("int32", "not a floating-point dtype"),
        (torch.int32, "not a floating-point dtype"),
        ("fp16", "write 'float16'"),
        ("fp32", "write 'float32'"),
        ("bf16", "write 'bfloat16'"),
        ("float8_e4m3fn", "not supported for a drafter"),
        ("wiggle", "not a torch dtype name"),
        (16, ""),
    ],
)
def test_dtype_names_refused_with_the_accepted_list(tmp_path, value, hint):
    with pytest.raises(ConfigError) as err:
        resolve_dtype(value, "--dtype")
    assert str(err.value).startswith(
        "`--dtype` must be one of 'float32', 'bfloat16', 'float16', 'float64'"
    ) and hint in str(err.value)
    if isinstance(value, str):
        for key in ("torch_dtype", "dtype"):
            with pytest.raises(ConfigError, match=f"`{key}` must be one of"):
                read(tmp_path, published_k3_config(**{key: value}))
    assert resolve_dtype("auto", allow_auto=True) is None and resolve_dtype(None) is None
    with pytest.raises(ConfigError, match="'double', 'auto'"):
        resolve_dtype("fp16", "dtype", allow_auto=True)


@pytest.mark.parametrize(
    "text, message",
    [
        ("null", "holds null; expected a JSON object"),
        ("[1, 2]", "must hold a JSON object (a dict of settings), got list"),
        ('{"a":' * 10_000 + "1" + "}" * 10_000, "nests objects/lists too deeply to read; expected at most 32 levels"),
        (
            json.dumps(published_k3_config(extra=json.loads("[" * 33 + "]" * 33))),
            "more than 32 levels deep (at `extra.0.0",
        ),
        ('{"hidden_size": ' + "7" * 5000 + "}", "is not valid JSON"),
        ("{'hidden_size': 1}", "is not valid JSON"),
    ],
)
def test_config_files_that_cannot_be_configs(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        Eagle31MLAConfig.from_pretrained(tmp_path)
    assert message in str(err.value) and err.value.__cause__ is None
    with pytest.raises(ConfigError, match=message.split(" (")[0].split(";")[0]):
        read_config_file(tmp_path / "config.json")


def test_nesting_is_checked_without_recursion():
    deep = 1
    for _ in range(100_000):  # far beyond the recursion limit: the walk is iterative
        deep = {"a": deep}
    with pytest.raises(ConfigError, match="more than 32 levels deep"):
        check_config_dict({"x": deep})
    with pytest.raises(ConfigError, match="more than 32 levels deep"):
        Eagle31MLAConfig.from_dict({**published_k3_config(), "x": deep})
    with pytest.raises(ConfigError, match="holds null"):
        Eagle31MLAConfig.from_dict(None)


@pytest.mark.parametrize(
    "nulls", [{"rope_parameters": None}, {"rope_scaling": None}, {"rope_parameters": None, "rope_scaling": None}]
)
def test_null_rope_in_a_file_means_plain_rope_as_absent_does(tmp_path, nulls):
    """In a file, null and absent mean the same: plain RoPE (never the constructor's Kimi-K3 YaRN, which
    would be refused with values the file never wrote)."""
    absent = read(tmp_path, published_k3_config(rope_scaling=DROP))
    (tmp_path / "null").mkdir()
    null = read(
        tmp_path / "null", published_k3_config(**{"rope_scaling": DROP, "max_position_embeddings": 4096, **nulls})
    )
    assert null.rope_parameters == absent.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}


def test_default_rope_error_says_it_was_the_default():
    with pytest.raises(
        ConfigError, match=r"\(32768\) exceeds `max_position_embeddings` \(4096\).*the constructor's default rope"
    ):
        Eagle31MLAConfig(max_position_embeddings=4096)


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 2.0},
        {"type": "default", "factor": 2.0},
        {"original_max_position_embeddings": 4096},
        {"type": "default", "mscale_all_dim": 1.0},
    ],
)
def test_scaling_keys_in_a_plain_rope_dict_are_refused(tmp_path, rope):
    with pytest.raises(ConfigError, match=r"`rope_scaling\.\w+` is a yarn setting, .* set `type: yarn` to use it"):
        read(tmp_path, published_k3_config(rope_scaling=rope))
    with pytest.raises(
        ConfigError, match=r"`rope_parameters\.\w+` is a yarn setting, .* set `rope_type: yarn` to use it"
    ):
        Eagle31MLAConfig(rope_parameters={"rope_type": "default", **{k: v for k, v in rope.items() if k != "type"}})


@pytest.mark.parametrize(
    "derived", [{"head_dim": 64}, {"head_dim": 192}, {"qk_head_dim": 192}, {"head_dim": 64, "qk_head_dim": 192}]
)
def test_derived_dims_in_their_published_forms_load(tmp_path, derived):
    """Transformers' DeepSeek configs write head_dim = qk_rope_head_dim and qk_head_dim = nope + rope."""
    config = read(tmp_path, published_k3_config(**derived))
    assert (config.head_dim, config.qk_head_dim) == (64, 192)


@pytest.mark.parametrize(
    "derived, message",
    [
        ({"head_dim": 7}, "`head_dim` is 7"),
        ({"head_dim": 128}, "`head_dim` is 128"),
        ({"qk_head_dim": 99}, "`qk_head_dim` is 99"),
        ({"qk_head_dim": 64}, "`qk_head_dim` is 64"),
    ],
)
def test_contradicting_derived_dims_are_refused(tmp_path, derived, message):
    with pytest.raises(ConfigError, match=re.escape(message) + ".*expected"):
        read(tmp_path, published_k3_config(**derived))


@pytest.mark.parametrize(
    "changes",
    [
        {"bos_token_id": 163840},
        {"eos_token_id": [163586, 200000]},
        {"pad_token_id": 163840},
        {"vocab_size": 1000, "draft_vocab_size": 1000},
    ],
)
def test_special_token_ids_beyond_the_vocabulary_are_refused(tmp_path, changes):
    with pytest.raises(ConfigError, match=r"is beyond the vocabulary; expected every special token id in \[0, \d+\)"):
        read(tmp_path, published_k3_config(**changes))


def test_kimi_default_token_ids_are_dropped_for_a_smaller_vocabulary_when_not_given():
    """The constructor's Kimi-K3 ids are defaults nobody wrote: beyond a smaller vocabulary they are left
    unset, not refused; given explicitly they are refused."""
    small = Eagle31MLAConfig(vocab_size=300, rope_parameters={"rope_type": "default"})
    assert (small.bos_token_id, small.eos_token_id, small.pad_token_id) == (None, None, 0)
    assert Eagle31MLAConfig().bos_token_id == 163584
    with pytest.raises(ConfigError, match=r"`bos_token_id` is 163584: id 163584 is beyond the vocabulary"):
        Eagle31MLAConfig(vocab_size=300, bos_token_id=163584, rope_parameters={"rope_type": "default"})


def test_duplicate_keys_are_refused_by_name(tmp_path):
    text = json.dumps(published_k3_config()).replace('{"architectures"', '{"vocab_size": 1000, "architectures"', 1)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(
        ConfigError,
        match=r"gives key 'vocab_size' twice in one object \(first 1000, then 163840\); expected each key once",
    ):
        Eagle31MLAConfig.from_pretrained(tmp_path)


def test_dtype_and_torch_dtype_must_agree(tmp_path):
    assert read(tmp_path, published_k3_config(dtype="bfloat16")).dtype == torch.bfloat16  # the same, twice: fine
    with pytest.raises(
        ConfigError, match=r"two dtypes: `dtype` 'float16' and `torch_dtype` 'bfloat16'; they must agree"
    ):
        read(tmp_path, published_k3_config(dtype="float16"))
    with pytest.raises(
        ConfigError, match=r"two dtypes: `dtype` 'float32' and `torch_dtype` 'bfloat16'; they must agree"
    ):
        Eagle31MLAConfig(dtype=torch.float32, torch_dtype="bfloat16")


# ---- values that pass each field's own domain but would break the rope math together ----

import math  # noqa: E402

from eagle31_mla.model import configuration_eagle31_mla as config_module  # noqa: E402


@pytest.mark.parametrize(
    "key,value",
    [
        ("rope_theta", 1e-300),
        ("rope_theta", 1.0),
        ("mscale", 1e300),
        ("attention_factor", 1e300),
        ("beta_fast", 1e308),
        ("beta_slow", 1e-320),
        ("mscale_all_dim", 1e300),
        ("factor", 1e300),
    ],
)
def test_rope_values_that_break_the_math_are_refused_at_construction(key, value):
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, **K3_YARN, key: value}
    with pytest.raises(ConfigError, match=rf"`rope_parameters\.{key}` must be a finite number"):
        Eagle31MLAConfig(rope_parameters=rope)


@pytest.mark.parametrize("broken", ["nan", "zero", "raise", "scaling"])
def test_the_rope_math_guard_refuses_any_unusable_result(monkeypatch, broken):
    """Whatever the domains let through, the derived numbers are computed at construction (through the model's
    own rope init) and an exception, a non-finite or a zero result is a ConfigError naming the rope settings."""
    real = config_module.rope_frequencies

    def fake(config, device=None):
        inv_freq, scaling = real(config, device)
        if broken == "raise":
            raise ZeroDivisionError("float division by zero")
        if broken == "scaling":
            return inv_freq, math.inf
        return inv_freq * (math.nan if broken == "nan" else 0.0), scaling

    monkeypatch.setattr(config_module, "rope_frequencies", fake)
    with pytest.raises(
        ConfigError,
        match=r"the rope settings \(`rope_type` 'yarn', .*do not give a usable RoPE.*expected rope settings",
    ):
        Eagle31MLAConfig()


def test_the_published_tiny_and_golden_configs_pass_the_rope_guard():
    from tests.support.tiny import tiny_config

    Eagle31MLAConfig()
    tiny_config()
    tiny_config(rope_parameters={"rope_type": "default"})
    for folder in sorted(GOLDEN.glob("*/")):
        if (folder / "config.json").is_file():
            Eagle31MLAConfig.from_pretrained(folder)


@pytest.mark.parametrize("value", [0, 1, "false", "true", 0.0])
def test_nested_eagle_config_bools_must_be_json_bools(value):
    with pytest.raises(ConfigError, match=r"`eagle_config\.use_aux_hidden_state` must be true or false"):
        Eagle31MLAConfig(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 46, 90], "use_aux_hidden_state": value})


def test_kimi_k3_preset_is_the_published_drafter():
    """The named preset, the no-argument config and the published config.json describe one drafter: the
    published tensor roster, parameter count and dtype, Kimi-K3's aux ids and YaRN."""
    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.hub.roster import roster_differences
    from eagle31_mla.model.aux_layers import KIMI_K3_AUX_LAYER_IDS

    preset = Eagle31MLAConfig.kimi_k3()
    assert (
        preset.to_dict() == Eagle31MLAConfig().to_dict() == Eagle31MLAConfig.from_dict(published_k3_config()).to_dict()
    )
    assert Eagle31MLAConfig.from_dict(preset.to_dict()).to_dict() == preset.to_dict()  # the same, passed on as a file
    state = Eagle31MLAForCausalLM.on_meta_device(preset).state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    assert (
        roster_differences(
            shapes, dtypes={t.dtype for t in state.values()}, num_parameters=sum(t.numel() for t in state.values())
        )
        == []
    )
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
    with pytest.raises(ConfigError, match="aux"):  # a file must name its aux layers
        Eagle31MLAConfig.from_dict(no_ids)
    assert Eagle31MLAConfig(**no_ids).eagle_aux_hidden_state_layer_ids == [2, 46, 90]  # the constructor: Kimi-K3's
    # a file that writes the four keys out (as every file this library saves does) reads the same both ways
    full = Eagle31MLAConfig.from_dict(dict(file)).to_dict()
    assert Eagle31MLAConfig(**full).to_dict() == Eagle31MLAConfig.from_dict(full).to_dict()


def test_describe_rope_is_the_one_wording():
    from eagle31_mla.model.configuration_eagle31_mla import describe_rope

    assert describe_rope(Eagle31MLAConfig()) == "yarn, theta 50000, factor 32 over 32768 positions"
    assert describe_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}) == "default, theta 10000"
