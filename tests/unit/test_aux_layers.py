"""The one home of aux-layer ids: conversions, validation and the documented reading rule."""

import pytest

from eagle31_mla.model.aux_layers import (
    KIMI_K3_AUX_LAYER_IDS,
    AuxLayerIdError,
    AuxLayerIds,
    aux_layer_ids_config_entries,
    aux_layer_ids_from_config,
)


def test_kimi_k3_ids_in_both_conventions():
    assert KIMI_K3_AUX_LAYER_IDS.one_based == (2, 46, 90)
    assert KIMI_K3_AUX_LAYER_IDS.zero_based == (1, 45, 89)
    assert KIMI_K3_AUX_LAYER_IDS.hidden_states_indices == (2, 46, 90)  # HF output_hidden_states index
    assert AuxLayerIds.from_zero_based([1, 45, 89]) == AuxLayerIds.from_one_based([2, 46, 90])
    assert AuxLayerIds.from_convention([1, 45, 89], "zero_based").one_based == (2, 46, 90)


@pytest.mark.parametrize(
    "ids, depth, message",
    [
        ([0, 46, 90], None, "must be >= 1"),
        ([2, 2, 90], None, "duplicates"),
        ([46, 2, 90], None, "not ascending"),
        ([2, 46, 94], 93, "beyond the target's depth of 93"),
        ([], None, "non-empty"),
        ([2, "46", 90], None, "must be an int"),
    ],
)
def test_invalid_one_based_ids(ids, depth, message):
    with pytest.raises(AuxLayerIdError, match=message):
        AuxLayerIds.from_one_based(ids, depth)


def test_zero_based_negative_and_depth():
    with pytest.raises(AuxLayerIdError, match=">= 0"):
        AuxLayerIds.from_zero_based([-1, 4])
    AuxLayerIds.from_zero_based([1, 45, 92], 93)  # zero-based 92 = the last layer's output: fine
    with pytest.raises(AuxLayerIdError, match="depth"):
        AuxLayerIds.from_zero_based([1, 45, 93], 93)


# The documented rule, as a literal table: (config.json fragment) -> one-based ids.
READINGS = [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 46, 90]}}, (2, 46, 90)),  # published export
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}}, (2, 46, 90)),  # training config
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 4, 8]}}, (1, 5, 9)),
    ({"eagle_aux_hidden_state_layer_ids": [2, 46, 90]}, (2, 46, 90)),  # vLLM top level
    ({"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}, (1, 45, 89)),  # top level is always one-based
    (
        {
            "eagle_aux_hidden_state_layer_ids": [2, 46, 90],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 46, 90]},
        },
        (2, 46, 90),
    ),
    (
        {
            "eagle_aux_hidden_state_layer_ids": [2, 46, 90],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 45, 89]},
        },
        (2, 46, 90),
    ),
    (
        {"aux_layer_ids_convention": "one_based", "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 45, 89]}},
        (1, 45, 89),  # labelled: no guessing
    ),
    (
        {"aux_layer_ids_convention": "zero_based", "eagle_aux_hidden_state_layer_ids": [1, 45, 89]},
        (2, 46, 90),
    ),
]


@pytest.mark.parametrize("fragment, one_based", READINGS)
def test_reading_rule(fragment, one_based):
    ids, how = aux_layer_ids_from_config(fragment)
    assert ids.one_based == one_based
    assert how


@pytest.mark.parametrize(
    "fragment, message",
    [
        ({}, "names no aux layers"),
        ({"eagle_config": {}}, "names no aux layers"),
        ({"target_layer_ids": [1, 45, 89]}, "target_layer_ids"),
        (
            {
                "eagle_aux_hidden_state_layer_ids": [2, 46, 90],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 47, 91]},
            },
            "contradictory",
        ),
        ({"aux_layer_ids_convention": "two_based", "eagle_aux_hidden_state_layer_ids": [2]}, "expected one of"),
        ({"eagle_config": [1, 2]}, "expected a dict"),
    ],
)
def test_reading_rule_refuses(fragment, message):
    with pytest.raises(AuxLayerIdError, match=message):
        aux_layer_ids_from_config(fragment)


def test_written_entries_are_labelled_and_read_back_unchanged():
    for ids in [(1, 45, 89), (2, 46, 90), (1, 2, 3)]:  # (1, ...) one-based would be misread unlabelled
        entries = aux_layer_ids_config_entries(AuxLayerIds(ids))
        assert entries["aux_layer_ids_convention"] == "one_based"
        assert entries["eagle_aux_hidden_state_layer_ids"] == list(ids)
        assert entries["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(ids)
        assert aux_layer_ids_from_config(entries)[0].one_based == ids


def test_entries_written_zero_based_for_an_engine_read_back_unchanged():
    """The TokenSpeed plugin writes a DeepSeek target's zero-based form onto the draft config: labelled, it
    still reads as the same layers (by the rule and by the config class), so rewriting it again is harmless."""
    from types import SimpleNamespace

    from eagle31_mla import Eagle31MLAConfig
    from eagle31_mla.model.aux_layers import write_aux_layer_ids

    ids = AuxLayerIds((2, 46, 90))
    entries = aux_layer_ids_config_entries(ids, "zero_based")
    assert (
        entries["eagle_aux_hidden_state_layer_ids"]
        == [1, 45, 89]
        == entries["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert aux_layer_ids_from_config(entries)[0] == ids
    config = SimpleNamespace(eagle_config={"use_aux_hidden_state": True, "other": 1})
    write_aux_layer_ids(config, ids, "zero_based")
    assert config.eagle_config["other"] == 1 and config.aux_layer_ids_convention == "zero_based"
    model_config = Eagle31MLAConfig()
    write_aux_layer_ids(model_config, ids, "zero_based")
    assert model_config.aux_layer_ids.one_based == (2, 46, 90)
    with pytest.raises(AuxLayerIdError, match="expected one of"):
        aux_layer_ids_config_entries(ids, "two_based")
