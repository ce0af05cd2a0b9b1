"""config.json dicts of targets and drafts for the CLI tests (no weights, written as files), and weightless
instances of engine model classes for the engine tests."""

from __future__ import annotations

import json
from pathlib import Path

K3_IDS = [2, 46, 90]  # one-based = zero-based [1, 45, 89]
K3_SIZES = dict(hidden_size=7168, vocab_size=163840, bos_token_id=163584, eos_token_id=163586)


class LastRank:
    """A single-rank pipeline group, as engine model classes query it."""

    world_size, is_first_rank, is_last_rank = 1, True, True


def bare(cls, **attributes):
    """A real engine model class instance without its weights: enough for its aux-capture methods."""
    from torch import nn

    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    for key, value in attributes.items():
        setattr(obj, key, value)
    return obj


def kimi_k3_target(**text) -> dict:
    """A Kimi-K3 config.json as the Hub ships it: a multimodal wrapper around the language model."""
    text_config = {"model_type": "kimi_linear", "num_hidden_layers": 93, **K3_SIZES, **text}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text_config}


def deepseek_target(layers: int = 61, **changes) -> dict:
    """A Kimi-K2-style target (DeepSeek-V3 architecture), from Transformers' own config class."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{"num_hidden_layers": layers, **K3_SIZES, **changes})
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config.to_dict()


def llama_target(layers: int = 32) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, **K3_SIZES}


def draft(ids=K3_IDS, **changes) -> dict:
    """The library's written config.json for a Kimi-K3-sized drafter (one-based ids, top level and nested,
    labelled), with ``changes`` applied; a value of None deletes the key."""
    from eagle31_mla import Eagle31MLAConfig

    config = json.loads(Eagle31MLAConfig(eagle_aux_hidden_state_layer_ids=list(ids)).to_json_string(use_diff=True))
    return {key: value for key, value in {**config, **changes}.items() if value is not None}


def nested_only(ids, convention=None, **changes) -> dict:
    """A draft whose ids are only in eagle_config (the training framework's layout)."""
    return draft(
        eagle_aux_hidden_state_layer_ids=None,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
        aux_layer_ids_convention=convention or None,
        **changes,
    )


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
