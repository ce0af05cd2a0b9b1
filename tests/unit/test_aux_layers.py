"""The one home of aux-layer ids: conversions and the documented reading rule (what it refuses, with the exact
messages: the "aux" rows of tests/unit/test_bad_inputs.py)."""

import pytest

from eagle31_mla import Eagle31MLAConfig
from eagle31_mla.model.aux_layers import (
    KIMI_K3_AUX_LAYER_IDS,
    AuxLayerIds,
    aux_layer_ids_config_entries,
    aux_layer_ids_from_config,
    write_aux_layer_ids,
)

IDS = "eagle_aux_hidden_state_layer_ids"


def test_kimi_k3_ids_in_both_conventions():
    assert KIMI_K3_AUX_LAYER_IDS.one_based == (2, 46, 90)
    assert KIMI_K3_AUX_LAYER_IDS.zero_based == (1, 45, 89)
    assert AuxLayerIds.from_convention([1, 45, 89], "zero_based") == AuxLayerIds((2, 46, 90))
    AuxLayerIds.from_convention([1, 45, 92], "zero_based", 93)  # zero-based 92 = the last layer's output: fine


# The documented rule, as a literal table: (config.json fragment) -> one-based ids.
READINGS = [
    ({"eagle_config": {IDS: [2, 46, 90]}}, (2, 46, 90)),  # published export
    ({"eagle_config": {IDS: [1, 45, 89]}}, (2, 46, 90)),  # training config
    ({"eagle_config": {IDS: [0, 4, 8]}}, (1, 5, 9)),
    ({IDS: [2, 46, 90]}, (2, 46, 90)),  # vLLM top level
    ({IDS: [1, 45, 89]}, (1, 45, 89)),  # top level is always one-based
    ({IDS: [2, 46, 90], "eagle_config": {IDS: [2, 46, 90]}}, (2, 46, 90)),
    ({IDS: [2, 46, 90], "eagle_config": {IDS: [1, 45, 89]}}, (2, 46, 90)),
    ({"aux_layer_ids_convention": "one_based", "eagle_config": {IDS: [1, 45, 89]}}, (1, 45, 89)),  # labelled
    ({"aux_layer_ids_convention": "zero_based", IDS: [1, 45, 89]}, (2, 46, 90)),
]


@pytest.mark.parametrize("fragment, one_based", READINGS)
def test_reading_rule(fragment, one_based):
    ids, how = aux_layer_ids_from_config(fragment)
    assert ids.one_based == one_based and how


@pytest.mark.parametrize("convention", ["one_based", "zero_based"])
def test_written_entries_are_labelled_and_read_back_unchanged(convention):
    """One-based is what files get ((1, ...) would be misread unlabelled); the TokenSpeed plugin writes a DeepSeek
    target's zero-based form onto the draft config: labelled, both read back as the same layers (by the rule and
    by the config class), so rewriting them again is harmless."""
    for ids in [AuxLayerIds(i) for i in [(1, 45, 89), (2, 46, 90), (1, 2, 3)]]:
        entries = aux_layer_ids_config_entries(ids, convention)
        form = list(ids.one_based if convention == "one_based" else ids.zero_based)
        assert entries[IDS] == entries["eagle_config"][IDS] == form
        assert entries["aux_layer_ids_convention"] == convention
        assert aux_layer_ids_from_config(entries)[0] == ids
        config = Eagle31MLAConfig(eagle_config={IDS: [2, 46, 90], "use_aux_hidden_state": True, "other": 1})
        write_aux_layer_ids(config, ids, convention)
        assert config.eagle_config["other"] == 1 and config.aux_layer_ids == ids
