"""A corpus of malformed drafts, each built from one good tiny draft: every one is refused with a
clear error that names the field or tensor and what was expected. None loads silently; none escapes
as a bare error from inside torch, safetensors or Transformers.

"Clear" is checked the same way for every case: the exception is an instance of the library's own
class the case names (``CheckpointError`` / ``ConfigError``, or the vLLM plugin's ``ServingConfigError``
for serving-time cases), it is raised from this project's code (the innermost traceback frame), it
carries no chained low-level exception, and its message holds both parts of the case's ``expect``: what
names the field or tensor, and the clause saying what was expected (a message naming the field but
not what it should be fails).

Besides the hand-written cases, the corpus is generated from the library's lists, so a new config
field or argument is covered automatically: every field of the config's dataclasses (read with
``dataclasses.fields``: tests/support/config_fields.py; top level and inside the rope dict, in both rope forms)
gets a string of a number, NaN, Infinity, -Infinity, a bool, values out of its domain and null; every dtype
argument of ``from_pretrained`` gets non-floating and misspelt names.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eagle31_mla
import eagle31_mla_sglang
import eagle31_mla_vllm
from eagle31_mla import CheckpointError, ConfigError, Eagle31MLAForCausalLM
from eagle31_mla.model.configuration_eagle31_mla import MAX_INDEX
from tests.support.config_fields import CONFIG_KEYS, ConfigKey
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

#: Where this project's code lives, installed editable or not: an error must be raised there.
OWN_CODE = tuple(str(Path(package.__file__).parent) for package in (eagle31_mla, eagle31_mla_vllm, eagle31_mla_sglang))
#: Fragments of low-level messages that must never be what a user sees.
RAW_MESSAGES = (
    "size mismatch for",
    "Error(s) in loading state_dict",
    "mat1 and mat2",
    "index out of range in self",
    "Expected all tensors",
    "invalid for input of size",
    "Traceback (most recent call last)",
    "object is not subscriptable",
    "unsupported operand",
    "not supported between instances",
)


@dataclass
class Draft:
    """What a case edits: the config.json dict, the tensors, and the files once written."""

    config: dict
    tensors: dict
    after_write: list[Callable[[Path], None]] = dataclass_field(default_factory=list)


def SERVING() -> type:
    """The vLLM plugin's error class, imported when a serving case runs (the plugin module needs vllm)."""
    from eagle31_mla_vllm.model import ServingConfigError

    return ServingConfigError


#: Words of a clause that says what was expected; every case's expectation part holds one.
EXPECTING = (
    "expected",
    "must",
    "need",
    "keep",
    "supports",
    "says one of",
    "write",
    "set ",
    "only",
    "has no such",
    "exactly",
    "takes",
    "<=",
    ">=",
)


@dataclass(frozen=True)
class Case:
    name: str
    change: Callable[[Draft], object]
    expect: tuple[str, str]  # (what names the field or tensor, the clause saying what was expected)
    error: type | Callable[[], type] = CheckpointError  # the class the error must be an instance of
    also: tuple[str, ...] = ()  # further substrings of the message (the value given, a hint)
    base: str = "full"  # "full" vocabulary, or "pruned" (draft_vocab_size 100 with d2t/t2d)
    check: str = "load"  # "load": from_pretrained; "serving": the vLLM plugin's check_serving against a target
    serving: tuple = ()  # serving cases: (key, value) pairs changing the target, the vLLM version, the environment
    load_kwargs: tuple = ()  # load cases: (argument, value) pairs for from_pretrained
    never: tuple[str, ...] = ()  # substrings the message must not hold (a wrong hint)

    @property
    def error_class(self) -> type:
        return self.error if isinstance(self.error, type) else self.error()


# -- edits ------------------------------------------------------------------------------------------


def drop(*names):
    return lambda d: [d.tensors.pop(n) for n in names]


def put(name, make):
    return lambda d: d.tensors.__setitem__(name, make(d.tensors))


def cfg(**changes):
    return lambda d: d.config.update(changes)


def cfg_drop(*keys):
    return lambda d: [d.config.pop(k) for k in keys]


def ids(value, where="nested"):
    def change(d):
        if where == "nested":
            d.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            d.config.pop("eagle_config")
            d.config["eagle_aux_hidden_state_layer_ids"] = value

    return change


def rope(**changes):
    return lambda d: d.config["rope_scaling"].update(changes)


def both(*changes):
    return lambda d: [c(d) for c in changes]


def on_files(edit):
    return lambda d: d.after_write.append(edit)


def rewrite_header(edit):
    """Rewrite the safetensors JSON header of model.safetensors (the data stays as it is)."""

    def change(folder):
        data = (folder / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        edit(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])

    return on_files(change)


def bytes_edit(edit):
    return on_files(lambda f: (f / "model.safetensors").write_bytes(edit((f / "model.safetensors").read_bytes())))


def set_bytes(data, at, new):
    return data[:at] + new + data[at + len(new) :]


def pickle_only(filename):
    def change(folder):
        from safetensors.torch import load_file

        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save(tensors, folder / filename)

    return on_files(change)


def shard_index(index):
    def change(folder):
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))

    return on_files(change)


def write_config(text):
    return on_files(
        lambda f: (f / "config.json").write_text(text) if text is not None else (f / "config.json").unlink()
    )


def d2t_edit(edit):
    def change(d):
        d2t = d.tensors["d2t"].clone()
        edit(d2t)
        d.tensors["d2t"] = d2t

    return change


def t2d_flip(d):
    t2d = d.tensors["t2d"].clone()
    first_unmapped = int((~t2d).nonzero()[0])
    t2d[first_unmapped] = True
    d.tensors["t2d"] = t2d


SPLIT = {
    "weight_map": {"fc.weight": "model-00001-of-00002.safetensors", "norm.weight": "model-00002-of-00002.safetensors"}
}

# fmt: off
CASES = [
    # ---- tensors: missing, extra, misshaped, mistyped ----
    Case("missing tensor", drop("layers.0.self_attn.kv_a_layernorm.weight"),
         ("missing tensor 'layers.0.self_attn.kv_a_layernorm.weight'", "expected shape [32]")),
    Case("missing lm_head", drop("lm_head.weight"), ("missing tensor 'lm_head.weight'", "expected shape [300, 64]")),
    Case("extra tensor (K3 gate of another architecture)", put("layers.0.self_attn.g_proj.weight", lambda t: torch.zeros(80, 128)),
         ("unexpected tensor 'layers.0.self_attn.g_proj.weight'", "has no such tensor")),
    Case("extra second decoder layer", put("layers.1.mlp.down_proj.weight", lambda t: torch.zeros(64, 96)),
         ("unexpected tensor 'layers.1.mlp.down_proj.weight'", "has no such tensor")),
    Case("misshaped kv_b_proj", put("layers.0.self_attn.kv_b_proj.weight", lambda t: torch.zeros(144, 16)),
         ("'layers.0.self_attn.kv_b_proj.weight' has shape [144, 16]", "expected [144, 32]")),
    Case("embedding rows differ from vocab_size", put("embed_tokens.weight", lambda t: t["embed_tokens.weight"][:299]),
         ("'embed_tokens.weight' has shape [299, 64]", "expected [300, 64]")),
    Case("fc stored transposed", put("fc.weight", lambda t: t["fc.weight"].T),
         ("'fc.weight' has shape [144, 64]", "expected [64, 144]")),
    Case("norm weight is a scalar", put("norm.weight", lambda t: torch.tensor(1.0)),
         ("'norm.weight' has shape []", "expected [64]")),
    Case("integer norm weight", put("norm.weight", lambda t: torch.ones(64, dtype=torch.int32)),
         ("'norm.weight' has dtype I32", "expected a floating-point dtype")),
    Case("bool projection", put("layers.0.self_attn.o_proj.weight", lambda t: torch.ones(64, 80, dtype=torch.bool)),
         ("'layers.0.self_attn.o_proj.weight' has dtype BOOL", "expected a floating-point dtype")),
    Case("several problems at once", both(drop("fc.weight"), put("extra.weight", lambda t: torch.zeros(1))),
         ("missing tensor 'fc.weight'", "expected shape [64, 144]"), also=("2 problem(s)", "unexpected tensor 'extra.weight'")),
    Case("published and training names for one tensor", put("midlayer.mlp.up_proj.weight", lambda t: t["layers.0.mlp.up_proj.weight"].clone()),
         ("'layers.0.mlp.up_proj.weight' and 'midlayer.mlp.up_proj.weight' both map to 'layers.0.mlp.up_proj.weight'", "expected one tensor per name")),
    Case("NeMo prefix and plain name for one tensor", put("model.norm.weight", lambda t: t["norm.weight"].clone()),
         ("both map to 'norm.weight'", "expected one tensor per name")),
    # ---- EAGLE-3.1 vs EAGLE-3, fc width ----
    Case("EAGLE-3.1 config without fc_norm weights", drop("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"),
         ("missing tensor 'fc_norm.0.weight'", "expected shape [48]"), also=("fc_norm: true",)),
    Case("EAGLE-3 config with fc_norm weights", cfg_drop("fc_norm"),
         ("unexpected tensor 'fc_norm.0.weight'", "set fc_norm: true")),
    Case("one fc_norm weight missing", drop("fc_norm.2.weight"), ("missing tensor 'fc_norm.2.weight'", "expected shape [48]")),
    Case("fc_norm weight of the drafter's width", put("fc_norm.1.weight", lambda t: torch.ones(64)),
         ("'fc_norm.1.weight' has shape [64]", "expected [48]")),
    Case("fc width vs target_hidden_size", cfg(target_hidden_size=64), ("'fc.weight' has shape [64, 144]", "expected [64, 192]")),
    Case("fc width vs four aux ids", ids([2, 5, 9, 12]), ("'fc.weight' has shape [64, 144]", "expected [64, 192]")),
    Case("fc width vs two aux ids", ids([2, 5]), ("'fc.weight' has shape [64, 144]", "expected [64, 96]")),
    # ---- pruned vocabulary: d2t / t2d ----
    Case("d2t maps beyond the vocabulary", d2t_edit(lambda d: d.__setitem__(-1, 10_000)),
         ("'d2t' maps draft ids to target ids in", "expected every target id in [0, 300)"), base="pruned"),
    Case("d2t maps below 0", d2t_edit(lambda d: d.__setitem__(0, -5)), ("'d2t' maps draft ids to target ids in [-5,", "expected every target id in [0, 300)"), base="pruned"),
    Case("d2t of the wrong length", put("d2t", lambda t: t["d2t"][:99]), ("'d2t' has shape [99]", "expected [100]"), base="pruned"),
    Case("float d2t", put("d2t", lambda t: t["d2t"].float()), ("'d2t' has dtype F32", "expected an integer dtype"), base="pruned"),
    Case("d2t maps two draft ids to one target id", d2t_edit(lambda d: d.__setitem__(1, d[0] - 1)),
         ("'d2t' maps two draft ids to the same target id", "expected distinct target ids"), base="pruned"),
    Case("t2d disagrees with d2t", t2d_flip, ("'t2d' disagrees with 'd2t'", "true exactly for mapped ids"), base="pruned"),
    Case("t2d of the wrong length", put("t2d", lambda t: t["t2d"][:299]), ("'t2d' has shape [299]", "expected [300]"), base="pruned"),
    Case("float t2d", put("t2d", lambda t: t["t2d"].float()), ("'t2d' has dtype F32", "expected bool"), base="pruned"),
    Case("pruned config without d2t", drop("d2t", "t2d"),
         ("missing tensor 'd2t'", "expected shape [100]"), also=("needs the vocab map",), base="pruned"),
    Case("full-vocabulary config with d2t", put("d2t", lambda t: torch.zeros(300, dtype=torch.long)),
         ("unexpected tensor 'd2t'", "has no such tensor"), also=("draft_vocab_size equals vocab_size",)),
    Case("lm_head over the full vocabulary in a pruned config", put("lm_head.weight", lambda t: torch.zeros(300, 64)),
         ("'lm_head.weight' has shape [300, 64]", "expected [100, 64]"), base="pruned"),
    # ---- files ----
    Case("truncated safetensors", bytes_edit(lambda b: b[: len(b) // 2]), ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("corrupt safetensors header", bytes_edit(lambda b: set_bytes(b, 8, b"not json")),
         ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("header length beyond the file", bytes_edit(lambda b: set_bytes(b, 0, struct.pack("<Q", 10**12))),
         ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("empty safetensors file", bytes_edit(lambda b: b""), ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("tensor offsets beyond the data", rewrite_header(lambda h: h["norm.weight"].update(data_offsets=[0, 10**9])),
         ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("unknown dtype in the header", rewrite_header(lambda h: h["norm.weight"].update(dtype="Q7")),
         ("model.safetensors is not a readable safetensors file", "expected the safetensors format")),
    Case("pickle .bin instead of safetensors", pickle_only("pytorch_model.bin"),
         ("pytorch_model.bin", "safetensors only"), also=("safetensors.torch.save_file", "allow_pickle=True")),
    Case("pickle .pt instead of safetensors", pickle_only("weights.pt"), ("weights.pt", "reads safetensors only"), also=("safetensors.torch.save_file",)),
    Case("no weights at all", on_files(lambda f: (f / "model.safetensors").unlink()),
         ("neither model.safetensors nor model.safetensors.index.json", "expected one of them next to config.json")),
    Case("index that is not JSON", shard_index("{oops"), ("model.safetensors.index.json is not a valid index", "expected JSON with a `weight_map`")),
    Case("index without weight_map", shard_index({"metadata": {}}), ("model.safetensors.index.json is not a valid index", "expected JSON with a `weight_map`")),
    Case("index with an empty weight_map", shard_index({"weight_map": {}}), ("has an empty `weight_map`", "expected tensor name -> file entries")),
    Case("index naming an absent shard", shard_index(SPLIT),
         ("model.safetensors.index.json names shard(s) ['model-00002-of-00002.safetensors']", "expected every shard it names next to it")),
    Case("no config.json", write_config(None), ("has no config.json", "expected next to the weights"), error=ConfigError),
    Case("config.json that is not JSON", write_config("{'hidden_size': 64"), ("config.json is not valid JSON", "expected a JSON object of settings"), error=ConfigError),
    Case("config.json that is a list", write_config("[1, 2]"), ("config.json", "must hold a JSON object"), also=("got list",), error=ConfigError),
    # ---- aux-layer ids ----
    Case("aux id 0", ids([0, 2, 5], where="top"), ("[0, 2, 5]", "must be >= 1"), error=ConfigError),
    Case("aux ids duplicated", ids([2, 5, 5]), ("[2, 5, 5] has duplicates", "expected distinct ids"), error=ConfigError),
    Case("aux ids unsorted", ids([9, 2, 5]), ("[9, 2, 5] is not ascending", "write them in that order"), also=("trained on [2, 5, 9]",), error=ConfigError),
    Case("aux ids beyond the target depth", cfg(target_num_hidden_layers=8), ("beyond the target's depth of 8", "one-based ids must be <= 8"), error=ConfigError),
    Case("eagle_config that is a list", cfg(eagle_config=[2, 5, 9]), ("`eagle_config`", "must be a dict"), error=ConfigError),
    Case("aux ids as a string", ids("2,5,9"), ("eagle_config.eagle_aux_hidden_state_layer_ids", "expected a non-empty list of ints"), error=ConfigError),
    Case("aux ids only under target_layer_ids", both(cfg_drop("eagle_config"), cfg(target_layer_ids=[2, 5, 9])),
         ("`target_layer_ids`", "write `eagle_aux_hidden_state_layer_ids`"), error=ConfigError),
    Case("aux ids contradictory (top level vs nested)", cfg(eagle_aux_hidden_state_layer_ids=[2, 5, 8]),
         ("contradictory about aux layers", "keep one"), also=("[2, 5, 8]", "[2, 5, 9]"), error=ConfigError),
    Case("no aux ids", cfg_drop("eagle_config"), ("names no aux layers", "expected `eagle_aux_hidden_state_layer_ids`"), error=ConfigError),
    Case("non-integer aux id", ids([2, 5.0, 9]), ("eagle_config.eagle_aux_hidden_state_layer_ids", "every id must be an int"), also=("5.0",), error=ConfigError),
    Case("unknown aux id convention", cfg(aux_layer_ids_convention="two_based"),
         ("aux_layer_ids_convention", "expected one of ('one_based', 'zero_based')"), error=ConfigError),
    Case("use_aux_hidden_state false", lambda d: d.config["eagle_config"].update(use_aux_hidden_state=False),
         ("`eagle_config.use_aux_hidden_state` is false", "takes the concatenated aux states"), error=ConfigError),
    Case("num_aux_hidden_states disagrees with the ids", cfg(num_aux_hidden_states=4),
         ("`num_aux_hidden_states` is 4", "must equal the number of aux layers"), also=("names 3 aux layers",), error=ConfigError),
    # ---- rope ----
    Case("unknown rope type", cfg(rope_scaling={"type": "dynamic", "factor": 2.0}), ("'dynamic'", "this drafter supports ('default', 'yarn')"), error=ConfigError),
    Case("longrope", cfg(rope_scaling={"type": "longrope", "factor": 4.0}), ("'longrope'", "this drafter supports ('default', 'yarn')"), error=ConfigError),
    Case("yarn without factor", lambda d: d.config["rope_scaling"].pop("factor"), ("`rope_scaling.factor`", "must be a finite number >= 1"), also=("yarn rope needs it",), error=ConfigError),
    Case("yarn factor below 1", rope(factor=0.5), ("`rope_scaling.factor`", "must be a finite number >= 1"), also=("got 0.5",), error=ConfigError),
    Case("both rope_parameters and rope_scaling", cfg(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         ("both `rope_parameters` and `rope_scaling`", "keep one"), error=ConfigError),
    Case("rope_scaling that is not a dict", cfg(rope_scaling="yarn"), ("`rope_scaling`/`rope_parameters`", "expected a dict"), error=ConfigError),
    Case("rope type named twice, differently", rope(rope_type="default"), ("`rope_type` 'default' and `type` 'yarn'", "keep one"), error=ConfigError),
    Case("rope_theta given twice, differently", rope(rope_theta=10000.0), ("`rope_theta` 50000", "must agree"), error=ConfigError),
    Case("negative rope_theta", cfg(rope_theta=-5.0), ("`rope_theta`", "must be a finite number > 1"), also=("got -5.0",), error=ConfigError),
    Case("yarn window beyond max_position_embeddings", rope(original_max_position_embeddings=100000),
         ("`original_max_position_embeddings` (100000) exceeds `max_position_embeddings` (4096)", "must be <= max_position_embeddings"), error=ConfigError),
    # ---- other config fields ----
    Case("unrelated model_type", cfg(model_type="llama"), ("`model_type` is 'llama'", "says one of ('kimi_k2'"), error=ConfigError),
    Case("two decoder layers", cfg(num_hidden_layers=2), ("`num_hidden_layers` is 2", "exactly 1 layer"), error=ConfigError),
    Case("fewer kv heads than heads", cfg(num_key_value_heads=2), ("`num_key_value_heads` (2)", "must equal `num_attention_heads` (4)"), error=ConfigError),
    Case("no q_lora_rank", cfg(q_lora_rank=None), ("`q_lora_rank`", "must be an int >= 1"), also=("got None", "low-rank q path"), error=ConfigError),
    Case("draft vocabulary larger than the vocabulary", cfg(draft_vocab_size=400), ("`draft_vocab_size` (400) exceeds `vocab_size` (300)", "must be <= vocab_size"), error=ConfigError),
    Case("hidden_size as a string", cfg(hidden_size="64"), ("`hidden_size`", "must be an int >= 1"), also=("got '64'",), error=ConfigError),
    Case("rms_norm_eps as a string", cfg(rms_norm_eps="1e-5"), ("`rms_norm_eps`", "must be a finite number > 0"), also=("got '1e-5'",), error=ConfigError),
    Case("fc_norm as a string", cfg(fc_norm="yes"), ("`fc_norm`", "must be true or false"), also=("got 'yes'",), error=ConfigError),
    Case("tied embeddings", cfg(tie_word_embeddings=True), ("`tie_word_embeddings: true` is not supported", "expected false"), error=ConfigError),
    Case("unknown activation", cfg(hidden_act="wiggle"), ("`hidden_act` 'wiggle'", "expected one of Transformers' ACT2FN names"), error=ConfigError),
    Case("odd rope width", cfg(qk_rope_head_dim=15), ("`qk_rope_head_dim`", "must be even"), also=("got 15",), error=ConfigError),
    # ---- at serving time: the vLLM plugin's check against the target vLLM loaded ----
    Case("serving: hidden sizes disagree", cfg(target_hidden_size=64),
         ("`target_hidden_size` is 64", "expected target_hidden_size = 48"), error=SERVING, check="serving"),
    Case("serving: aux ids beyond the target depth", ids([2, 46, 90]),
         ("[2, 46, 90] goes beyond the target's depth of 12", "one-based ids must be <= 12"), also=("do not fit this target",), error=SERVING, check="serving"),
    Case("serving: vocabulary disagrees", cfg(vocab_size=400), ("`vocab_size` is 400", "expected vocab_size = 300"),
         error=SERVING, check="serving"),
    Case("serving: hidden sizes disagree with a multimodal target's text_config", cfg(target_hidden_size=64),
         ("`target_hidden_size` is 64", "expected target_hidden_size = 48"), also=("`hidden_size` is 48",), error=SERVING, check="serving",
         serving=(("text_config", True),)),
    Case("serving: Kimi-K3 target on the AttnRes mixture stream", lambda d: None,
         ("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1", "unset it or set it to 0"), also=("prefix-only",), error=SERVING, check="serving",
         serving=(("kimi_k3", True), ("environ", {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}))),
    Case("serving: four aux states on a vLLM that sizes fc for three", ids([2, 5, 9, 11]),
         ("the draft names 4", "sizes `fc` for exactly 3 aux states"), error=SERVING, check="serving",
         serving=(("vllm", (0, 21, 0)),)),
]
# fmt: on

# -- generated from the library's tables: every config field, every dtype argument ---------------------


def bad_values(field: ConfigKey) -> list[tuple[str, object]]:
    """Values ``field`` must refuse: wrong type (a string of a number, a bool), NaN and +/-Infinity (which
    Python's json reads), values outside its domain or too big for the index dtype, and null."""
    nonfinite = [("NaN", math.nan), ("Infinity", math.inf), ("-Infinity", -math.inf)]
    if field.kind in ("int", "token_id", "token_ids"):
        below = 0 if field.domain == "size" else -1
        values = [
            ("a string of a number", "6"),
            ("a float", 6.5),
            ("a bool", True),
            *nonfinite,
            (f"{below} (below its domain)", below),
            ("-3", -3),
            ("2**31 (beyond int32)", MAX_INDEX + 1),
            ("10**30", 10**30),
        ]
        if field.kind == "token_ids":
            values += [("a list holding a string", [2, "3"]), ("an empty list", [])]
    elif field.kind == "float":
        below = {
            "positive": 0,
            "non_negative": -0.5,
            "at_least_1": 0.5,
            "unit_open": 0,
            "rope_theta": 1.0,
            "rope_positive": 0,
            "rope_non_negative": -0.5,
            "rope_at_least_1": 0.5,
        }[field.domain]
        values = [
            ("a string of a number", "1e-05"),
            ("a bool", True),
            *nonfinite,
            (f"{below} (outside its domain)", below),
            ("-1", -1),
            ("a list", [1.0]),
            ("10**400 (no float holds it)", 10**400),
        ]
        if field.domain == "unit_open":
            values.append(("1.5 (outside its domain)", 1.5))
        if field.domain.startswith("rope_"):  # bounded: huge values overflow the rope math (1e300: NaN logits)
            values.append(("1e300 (beyond its bound)", 1e300))
        if field.domain == "rope_positive":  # bounded below too: 1e-320 overflows YaRN's logarithms
            values += [("1e-320 (below its bound)", 1e-320)]
    elif field.kind == "bool":
        values = [("a string", "true"), ("an int", 1), ("NaN", math.nan)]
    elif field.kind == "str":
        values = [("a number", 5), ("NaN", math.nan)]
    elif field.kind == "dtype":
        values = [("int32", "int32"), ("fp16", "fp16"), ("fp32", "fp32"), ("bool", "bool"), ("a number", 16)]
    else:
        raise AssertionError(f"no bad values for kind {field.kind!r}: add them here")
    if not field.optional:
        values.append(("null", None))
    return values


def _v5_rope(config: dict) -> dict:
    """The good draft's legacy rope_scaling + rope_theta rewritten in the Transformers-5 rope_parameters form."""
    rope = dict(config.pop("rope_scaling"))
    config["rope_parameters"] = {"rope_type": rope.pop("type"), "rope_theta": config.pop("rope_theta"), **rope}
    return config["rope_parameters"]


def set_field(field: ConfigKey, value, form: str):
    def change(d):
        if field.in_eagle_config:
            d.config["eagle_config"][field.key] = value
            return
        if not field.nested:
            d.config[field.name] = value
            return
        rope = d.config["rope_scaling"] if form == "rope_scaling" else _v5_rope(d.config)
        if value is MISSING:
            rope.pop(field.key)
        else:
            rope[field.key] = value

    return change


MISSING = object()


#: Fields whose bad values are hand-written cases above (their type is a rule of its own): field -> the case.
HAND_WRITTEN = {"eagle_aux_hidden_state_layer_ids": "aux id 0"}


def field_cases() -> list[Case]:
    cases = []
    for field in CONFIG_KEYS:
        if field.name in HAND_WRITTEN:
            continue
        values = bad_values(field)
        if field.rope_type and not field.optional:
            values.append(("missing", MISSING))
        for form in ("rope_scaling", "rope_parameters") if field.nested else ("",):
            shown = f"{form}.{field.key}" if field.nested else field.name
            for label, value in values:
                got = "nothing" if value is MISSING else repr(value)[:20]  # a long value is shown shortened
                cases.append(
                    Case(
                        f"config `{shown}` = {label}",
                        set_field(field, value, form),
                        (f"`{shown}`", f"must be {field.expected()}"),
                        error=ConfigError,
                        also=(f"got {got}",),
                    )
                )
    return cases


#: from_pretrained's dtype arguments (and the CLI's --dtype goes through the same resolve_dtype).
DTYPE_ARGUMENTS = ("dtype", "torch_dtype")


def argument_cases() -> list[Case]:
    bad = [
        ("int32", "int32"),
        ("fp16", "fp16"),
        ("fp32", "fp32"),
        ("bf16", "bf16"),
        ("torch.int64", torch.int64),
        ("float8", "float8_e4m3fn"),
        ("a number", 16),
    ]
    return [
        Case(
            f"from_pretrained({argument}={label})",
            lambda d: None,
            (f"`{argument}`", "must be one of 'float32', 'bfloat16'"),
            error=ConfigError,
            load_kwargs=((argument, value),),
        )
        for argument in DTYPE_ARGUMENTS
        for label, value in bad
    ]


# -- weights holding NaN/inf, index paths out of the folder, dangling links, unreadable config files ---------


def with_values(name, *values, dtype=None):
    """Tensor ``name`` with its first values replaced (NaN, inf, ...), optionally stored in ``dtype``."""

    def make(tensors):
        tensor = tensors[name].clone().to(dtype or tensors[name].dtype)
        tensor.view(-1)[: len(values)] = torch.tensor(values, dtype=tensor.dtype)
        return tensor

    return put(name, make)


def index_naming(shard_name):
    """All tensors in one shard, the index naming it as ``shard_name(folder)`` (a path outside the folder)."""

    def change(folder):
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as f:
            names = list(f.keys())
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        index = {"weight_map": dict.fromkeys(names, shard_name(folder))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return on_files(change)


def split_index(edit_map):
    """The tensors split over two shards with a correct index, then ``edit_map(weight_map, names of shard 1)``
    makes the index and the shards' headers disagree."""

    def change(folder):
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        names = sorted(tensors)
        first, second = names[: len(names) // 2], names[len(names) // 2 :]
        save_file({n: tensors[n] for n in first}, str(folder / "model-00001-of-00002.safetensors"))
        save_file({n: tensors[n] for n in second}, str(folder / "model-00002-of-00002.safetensors"))
        (folder / "model.safetensors").unlink()
        weight_map = {
            **dict.fromkeys(first, "model-00001-of-00002.safetensors"),
            **dict.fromkeys(second, "model-00002-of-00002.safetensors"),
        }
        edit_map(weight_map, first)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return on_files(change)


def dangling_shard(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").unlink()
    os.symlink(folder / "blobs" / "deadbeef", folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")})
    )


def nested(levels: int):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


DEEP_JSON = '{"a":' * 10_000 + "1" + "}" * 10_000  # Python's json raises RecursionError on it

# fmt: off
HARDENING_CASES = [
    # ---- weights: NaN / inf, reported by name ----
    Case("NaN in a norm weight", with_values("norm.weight", math.nan), ("tensor 'norm.weight'", "expected finite values"),
         also=("1 NaN and 0 inf",)),
    Case("inf in fc", with_values("fc.weight", math.inf, math.inf), ("tensor 'fc.weight'", "expected finite values"),
         also=("0 NaN and 2 inf",)),
    Case("-inf in lm_head", with_values("lm_head.weight", -math.inf), ("tensor 'lm_head.weight'", "expected finite values")),
    Case("NaN in a bf16 tensor", with_values("layers.0.self_attn.kv_b_proj.weight", math.nan, dtype=torch.bfloat16),
         ("tensor 'layers.0.self_attn.kv_b_proj.weight'", "expected finite values")),
    Case("NaN in two tensors", both(with_values("norm.weight", math.nan), with_values("layers.0.mlp.up_proj.weight", math.inf)),
         ("tensor 'layers.0.mlp.up_proj.weight'", "expected finite values"), also=("2 tensor(s)", "tensor 'norm.weight'")),
    Case("NaN in the training layout", both(lambda d: d.tensors.update({k.replace("layers.0.", "midlayer."): d.tensors.pop(k) for k in list(d.tensors) if k.startswith("layers.0.")}),
                                             with_values("midlayer.mlp.down_proj.weight", math.nan)),
         ("tensor 'midlayer.mlp.down_proj.weight'", "expected finite values")),
    Case("finite in the file, inf in float16", with_values("layers.0.mlp.gate_proj.weight", 1e6),
         ("tensor 'layers.0.mlp.gate_proj.weight'", "expected finite values"), also=("after conversion from F32 to torch.float16",),
         load_kwargs=(("dtype", torch.float16),)),
    # ---- index shard paths that leave the model folder ----
    Case("index naming ../x.safetensors", index_naming(lambda f: "../model-00001-of-00001.safetensors"),
         ("'../model-00001-of-00001.safetensors'", "expected file names inside"), also=("climbs out with '..'",)),
    Case("index naming sub/../../x.safetensors", index_naming(lambda f: "sub/../../x.safetensors"),
         ("'sub/../../x.safetensors'", "expected file names inside")),
    Case("index naming an absolute path (to the real shard)", index_naming(lambda f: str(f / "model-00001-of-00001.safetensors")),
         ("model-00001-of-00001.safetensors", "expected file names inside"), also=("an absolute path",)),
    Case("index naming a Windows drive path", index_naming(lambda f: "C:\\weights\\model.safetensors"),
         ("'C:\\\\weights\\\\model.safetensors'", "expected file names inside"), also=("an absolute path",)),
    Case("index naming a number", index_naming(lambda f: 7), ("7 (not a file name)", "expected file names inside")),
    Case("index naming a shard with a NUL byte", index_naming(lambda f: "model\x00.safetensors"),
         ("'model\\x00.safetensors' (a name holding a NUL byte", "expected file names inside")),
    Case("index naming a shard with a line break", index_naming(lambda f: "model\n.safetensors"),
         ("(a name holding a NUL byte or line break", "expected file names inside")),
    # the index and the shards' headers must agree both ways
    Case("index listing a tensor no shard holds", split_index(lambda m, first: m.update({"bogus.extra": "model-00001-of-00002.safetensors"})),
         ("lists tensor 'bogus.extra' in model-00001-of-00002.safetensors", "expected the index and its shards to agree"), also=("no shard holds it",)),
    Case("index listing a tensor under the wrong shard", split_index(lambda m, first: m.update({first[0]: "model-00002-of-00002.safetensors"})),
         ("does not hold it (it is in model-00001-of-00002.safetensors)", "expected the index and its shards to agree")),
    Case("shard tensor missing from the index", split_index(lambda m, first: m.pop(first[0])),
         ("model-00001-of-00002.safetensors in", "expected the index and its shards to agree"), also=("does not list", "every shard tensor listed")),
    Case("index that is null", shard_index("null"), ("model.safetensors.index.json is not a valid index", "expected JSON with a `weight_map`"),
         also=("got a NoneType",)),
    Case("index whose weight_map is a list", shard_index({"weight_map": ["model-00001-of-00002.safetensors"]}),
         ("model.safetensors.index.json is not a valid index", "expected JSON with a `weight_map`"), also=("got a list `weight_map`",)),
    Case("aux id beyond int32", ids([2, 5, 10**30]), ("aux-layer ids [2, 5, 1000000000000000000000000000000]", "every id must be <= 2147483647"),
         error=ConfigError),
    # ---- dangling symlinks ----
    Case("model.safetensors is a dangling symlink", on_files(lambda f: (f / "model.safetensors").unlink() or os.symlink(f / "blobs" / "deadbeef", f / "model.safetensors")),
         ("model.safetensors", "expected the file itself"), also=("dangling link", "blobs/deadbeef")),
    Case("a shard is a dangling symlink", on_files(dangling_shard), ("model-00001-of-00001.safetensors", "expected the file itself"),
         also=("dangling link",)),
    Case("config.json is a dangling symlink", on_files(lambda f: (f / "config.json").unlink() or os.symlink(f / "blobs" / "c0ffee", f / "config.json")),
         ("config.json", "expected the drafter's config.json"), error=ConfigError, also=("dangling link",)),
    Case("the index is a dangling symlink", on_files(lambda f: os.symlink(f / "blobs" / "1dx", f / "model.safetensors.index.json")),
         ("model.safetensors.index.json", "expected the file itself"), also=("dangling link",)),
    # ---- config.json that is not a config ----
    Case("config.json that is null", write_config("null"), ("config.json holds null", "expected a JSON object"), error=ConfigError),
    Case("config.json that is a number", write_config("7"), ("config.json", "must hold a JSON object"), error=ConfigError, also=("got int",)),
    Case("config.json nested 10000 levels", write_config(DEEP_JSON), ("config.json nests objects/lists too deeply", "expected at most 32 levels"),
         error=ConfigError),
    Case("config.json with a setting nested 100 levels", cfg(extra=nested(100)), ("more than 32 levels deep (at `extra.a.a", "expected at most 32 levels"),
         error=ConfigError),
    Case("rope_scaling nested 50 levels", rope(extra=nested(50)), ("(at `rope_scaling.extra.a", "expected at most 32 levels"), error=ConfigError),
    Case("an int of 5000 digits", write_config('{"hidden_size": ' + "9" * 5000 + "}"), ("config.json is not valid JSON", "expected a JSON object of settings"),
         error=ConfigError),
    Case("NaN in Transformers' special-float form", cfg(rms_norm_eps={"__float__": "NaN"}), ("`rms_norm_eps`", "must be a finite number > 0"),
         error=ConfigError, also=("got nan",)),
    Case("yarn beta_fast below beta_slow", rope(beta_fast=1.0, beta_slow=32.0), ("`rope_scaling.beta_fast` (1.0)", "must be greater than `rope_scaling.beta_slow`"),
         error=ConfigError),
]
# fmt: on

# -- the second battery: rope keys of another type, token ids beyond the vocabulary, contradicting derived
# fields, duplicate JSON keys, dtypes given twice, files that are not regular files, d2t checked before use --


def rope_dict(form: str, rope_type, **keys):
    """The good draft's rope settings replaced by one dict of ``rope_type`` (None: the dict names no type)."""

    def change(d):
        theta = d.config.pop("rope_theta")
        d.config.pop("rope_scaling")
        type_key = "type" if form == "rope_scaling" else "rope_type"
        d.config[form] = {**({type_key: rope_type} if rope_type else {}), **keys}
        if form == "rope_parameters":
            d.config[form]["rope_theta"] = theta
        else:
            d.config["rope_theta"] = theta

    return change


#: A valid value of every yarn key (the good draft's, or Transformers' neutral one).
YARN_VALUES = {
    "factor": 32.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "attention_factor": 1.0,
    "truncate": True,
}
#: Keys of rope types this drafter does not support.
OTHER_ROPE_KEYS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "short_factor": [1.0],
    "long_factor": [1.0],
    "long_mscale": 1.0,
}


def rope_key_cases() -> list[Case]:
    """Every yarn key of CONFIG_KEYS in a plain rope dict (no type, or type default), in both forms: the
    scaling would be dropped without a word; and keys of other rope types in a yarn dict."""
    cases = []
    for field in CONFIG_KEYS:
        if field.rope_type != "yarn":
            continue
        assert field.key in YARN_VALUES, f"give YARN_VALUES a valid value of {field.key}"
        for form in ("rope_scaling", "rope_parameters"):
            type_key = "type" if form == "rope_scaling" else "rope_type"
            for label, rope_type in (("no type", None), ("type default", "default")):
                cases.append(
                    Case(
                        f"{form} with {label} and yarn key `{field.key}`",
                        rope_dict(form, rope_type, **{field.key: YARN_VALUES[field.key]}),
                        (f"`{form}.{field.key}` is a yarn setting", f"set `{type_key}: yarn`"),
                        error=ConfigError,
                    )
                )
    for key, value in OTHER_ROPE_KEYS.items():
        for form in ("rope_scaling", "rope_parameters"):
            yarn = {k: YARN_VALUES[k] for k in ("factor", "original_max_position_embeddings")}
            cases.append(
                Case(
                    f"{form} yarn with foreign key `{key}`",
                    rope_dict(form, "yarn", **yarn, **{key: value}),
                    (f"`{form}.{key}` is not a setting of yarn rope", "expected only `attention_factor`"),
                    error=ConfigError,
                )
            )
    return cases


def token_id_cases() -> list[Case]:
    """Every special-token field of CONFIG_KEYS with an id beyond the vocabulary (vocab_size 300)."""
    cases = []
    for field in CONFIG_KEYS:
        if field.kind not in ("token_id", "token_ids"):
            continue
        values = [("vocab_size", 300, 300), ("vocab_size + 699", 999, 999)]
        if field.kind == "token_ids":
            values += [
                ("a list with one id = vocab_size", [2, 300], 300),
                ("a list with one id far beyond", [999, 2], 999),
            ]
        for label, value, bad in values:
            for base in ("full", "pruned"):  # the rule is the target vocabulary's, pruned or not
                cases.append(
                    Case(
                        f"config `{field.name}` = {label} ({base} vocabulary)",
                        cfg(**{field.name: value}),
                        (f"`{field.name}` is {value!r}", "expected every special token id in [0, 300)"),
                        also=(f"id {bad} is beyond",),
                        error=ConfigError,
                        base=base,
                    )
                )
    return cases


def derived_field_cases() -> list[Case]:
    """Every derived field of CONFIG_KEYS given a value that contradicts the dims it is derived from
    (tiny: qk_nope 16 + qk_rope 16 = 32; head_dim may be 16 or 32)."""
    cases = []
    for field in CONFIG_KEYS:
        if not field.derived:
            continue
        for value in (7, 99, 31, 48):
            cases.append(
                Case(
                    f"config `{field.name}` = {value} (contradicts the dims it is derived from)",
                    cfg(**{field.name: value}),
                    (f"`{field.name}` is {value}", "expected"),
                    also=("leave it out",),
                    error=ConfigError,
                )
            )
    return cases


def duplicate_key(key: str, value, inside: str | None = None):
    """config.json with ``key`` given twice (first ``value``, then the good draft's), at the top level or in ``inside``."""

    def change(folder):
        text = (folder / "config.json").read_text()
        opening = "{" if inside is None else f'"{inside}": {{'
        assert opening in text
        pair = f"{json.dumps(key)}: {json.dumps(value)}, "
        text = text.replace(opening, opening + pair * 2, 1)  # twice: whether or not the good draft gives it too
        (folder / "config.json").write_text(text)

    return on_files(change)


def duplicate_key_cases() -> list[Case]:
    """Every top-level field of CONFIG_KEYS that the good draft's config.json gives, given twice (a
    different value first, then the same): the last would win silently. And nested and index keys."""
    cases = []
    good = {
        "vocab_size": 300,
        "hidden_size": 64,
        "rms_norm_eps": 1e-05,
        "fc_norm": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "rope_theta": 50000.0,
    }
    for field in CONFIG_KEYS:
        if field.nested or field.derived or field.name == "dtype":
            continue
        for label, value in (("another value first", "first"), ("the same value twice", good.get(field.name, "same"))):
            if label.startswith("the same") and field.name not in good:
                continue
            cases.append(
                Case(
                    f"config.json gives `{field.name}` twice ({label})",
                    duplicate_key(field.name, value),
                    (f"gives key {field.name!r} twice", "expected each key once"),
                    error=ConfigError,
                )
            )
    cases += [
        Case(
            "config.json gives a rope key twice",
            duplicate_key("factor", 2.0, inside="rope_scaling"),
            ("gives key 'factor' twice", "expected each key once"),
            error=ConfigError,
        ),
        Case(
            "config.json gives the aux ids twice",
            duplicate_key("eagle_aux_hidden_state_layer_ids", [1, 2, 3], inside="eagle_config"),
            ("gives key 'eagle_aux_hidden_state_layer_ids' twice", "expected each key once"),
            error=ConfigError,
        ),
        Case(
            "index gives a tensor twice in its weight_map",
            on_files(index_with_duplicate),
            ("model.safetensors.index.json", "expected each key once"),
            also=("gives key 'norm.weight' twice",),
        ),
    ]
    return cases


def index_with_duplicate(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    entries = [f'"{n}": "model-00001-of-00001.safetensors"' for n in names + ["norm.weight"]]
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {' + ", ".join(entries) + "}}")


#: What a path that is not a regular file can be, and the words the refusal says it is.
IRREGULAR = {
    "a folder": "a folder",
    "a FIFO": "a FIFO (named pipe)",
    "a symlink to /dev/zero": "a symlink to /dev/zero, which is a character device",
}


def make_irregular(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "a folder":
        path.mkdir()
        (path / "inside.txt").write_text("x")
    elif kind == "a FIFO":
        os.mkfifo(path)  # opening it for reading would block the loader forever: it must never be opened
    else:
        os.symlink("/dev/zero", path)  # reading it would never end


def irregular_file_cases() -> list[Case]:
    """config.json, model.safetensors, the index and a shard, each a folder, a FIFO or a symlink to
    /dev/zero: refused, saying what it is and that a regular file was expected (never opened)."""
    cases = []
    for kind, words in IRREGULAR.items():
        cases += [
            Case(
                f"config.json is {kind}",
                on_files(lambda f, k=kind: make_irregular(f / "config.json", k)),
                (f"config.json is {words}", "expected a regular file"),
                error=ConfigError,
            ),
            Case(
                f"model.safetensors is {kind}",
                on_files(lambda f, k=kind: make_irregular(f / "model.safetensors", k)),
                ("weight file 'model.safetensors' in", "expected a regular file"),
                also=(f"is {words}",),
            ),
            Case(
                f"model.safetensors.index.json is {kind}",
                on_files(lambda f, k=kind: make_irregular(f / "model.safetensors.index.json", k)),
                ("weight index 'model.safetensors.index.json' in", "expected a regular file"),
                also=(f"is {words}",),
            ),
            Case(
                f"a shard is {kind}",
                both(
                    index_naming(lambda f: "model-00001-of-00001.safetensors"),
                    on_files(lambda f, k=kind: make_irregular(f / "model-00001-of-00001.safetensors", k)),
                ),
                ("names shard 'model-00001-of-00001.safetensors'", "expected a regular file"),
                also=(f"is {words}",),
            ),
        ]
    return cases


def same_tensor_in_two_shards(name):
    def change(folder):
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        save_file(tensors, str(folder / "model-00001-of-00002.safetensors"))
        save_file({name: tensors[name]}, str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {
            **dict.fromkeys(tensors, "model-00001-of-00002.safetensors"),
            name: "model-00002-of-00002.safetensors",
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return on_files(change)


# fmt: off
REVIEW_CASES = [
    Case("config dtype and torch_dtype disagree", cfg(dtype="bfloat16"), ("`dtype` 'bfloat16' and `torch_dtype` 'float32'", "they must agree"), error=ConfigError),
    Case("config dtype and torch_dtype disagree (torch. prefix)", cfg(dtype="torch.float16"), ("`dtype` 'float16' and `torch_dtype` 'float32'", "they must agree"), error=ConfigError),
    *[Case(f"from_pretrained(dtype={a}, torch_dtype={b})", lambda d: None, (f"`dtype` {a!r} and `torch_dtype` {b!r}", "they must agree"),
           error=ConfigError, load_kwargs=(("dtype", a), ("torch_dtype", b)))
      for a, b in (("float16", "bfloat16"), ("float32", "float16"), ("auto", "float16"), ("bfloat16", "auto"))],
    Case("from_pretrained(dtype=torch.float16, torch_dtype=torch.bfloat16)", lambda d: None, ("`dtype` 'float16' and `torch_dtype` 'bfloat16'", "they must agree"),
         error=ConfigError, load_kwargs=(("dtype", torch.float16), ("torch_dtype", torch.bfloat16))),
    Case("fc_norm weights of three aux states, config names two", ids([5, 9]), ("unexpected tensor 'fc_norm.2.weight'", "expected as many aux-layer ids"),
         also=("has 3 fc_norm weight(s)", "names 2 aux layers"), never=("set fc_norm: true",)),
    Case("fc_norm weights of three aux states, config names four", ids([2, 5, 9, 12]), ("missing tensor 'fc_norm.3.weight'", "expected shape [48]"),
         also=("has 3 fc_norm weight(s)", "names 4 aux layers", "expected as many aux-layer ids"), never=("needs fc_norm: false",)),
    Case("one tensor in two shards", same_tensor_in_two_shards("norm.weight"),
         ("'norm.weight' in model-00001-of-00002.safetensors, 'norm.weight' in model-00002-of-00002.safetensors", "expected one tensor per name")),
    # d2t is range-checked before t2d is derived from it (no t2d in the checkpoint)
    Case("d2t maps beyond the vocabulary, no t2d", both(drop("t2d"), d2t_edit(lambda d: d.fill_(250))),
         ("'d2t' maps draft ids to target ids in [250, 349]", "expected every target id in [0, 300)"), base="pruned"),
    Case("d2t maps below 0, no t2d", both(drop("t2d"), d2t_edit(lambda d: d.__setitem__(0, -5))),
         ("'d2t' maps draft ids to target ids in [-5,", "expected every target id in [0, 300)"), base="pruned"),
    Case("d2t maps far beyond the vocabulary, no t2d", both(drop("t2d"), d2t_edit(lambda d: d.__setitem__(-1, 10**12))),
         ("'d2t' maps draft ids to target ids in", "expected every target id in [0, 300)"), base="pruned"),
    Case("d2t maps two draft ids to one target id, no t2d", both(drop("t2d"), d2t_edit(lambda d: d.__setitem__(1, d[0] - 1))),
         ("'d2t' maps two draft ids to the same target id", "expected distinct target ids"), base="pruned"),
]
# fmt: on

CASES += field_cases() + argument_cases() + HARDENING_CASES
CASES += (
    rope_key_cases()
    + token_id_cases()
    + derived_field_cases()
    + duplicate_key_cases()
    + irregular_file_cases()
    + REVIEW_CASES
)

TARGET = dict(hidden_size=48, vocab_size=300, num_hidden_layers=12)  # the serving cases' target: the good drafts fit it


@pytest.fixture(scope="module")
def good_drafts():
    """The one good draft each case starts from: full vocabulary, and pruned with d2t/t2d."""
    full = tiny_drafter(seed=8)
    pruned = tiny_drafter(seed=3, draft_vocab_size=100)
    return {"full": full, "pruned": pruned}


def build(case: Case, good, folder: Path) -> Path:
    model = good[case.base]
    draft = Draft(copy.deepcopy(published_style_config(model)), dict(model.state_dict()))
    case.change(draft)
    write_checkpoint(folder, draft.config, draft.tensors)
    for edit in draft.after_write:
        edit(folder)
    return folder


def attempt(case: Case, folder: Path) -> None:
    """Load the malformed draft the way its layer would: returns only if it was accepted."""
    if case.check == "load":
        Eagle31MLAForCausalLM.from_pretrained(folder, **dict(case.load_kwargs))
    else:
        check_serving(folder, **dict(case.serving))


def check_serving(folder: Path, *, text_config=False, kimi_k3=False, vllm=(0, 32, 0), environ=None) -> None:
    """The plugin's serving-time check (pure Python) with a fake target: what vLLM hands it."""
    from eagle31_mla.serving.engine_facts.vllm import features
    from eagle31_mla_vllm.model import check_serving

    draft_hf_config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
    arch = ["KimiK3ForConditionalGeneration"] if kimi_k3 else ["DeepseekV3ForCausalLM"]
    if text_config:  # a multimodal wrapper: the language model's sizes live in its text config
        target = SimpleNamespace(
            hf_config=SimpleNamespace(architectures=arch, model_type="wrapper"),
            hf_text_config=SimpleNamespace(**TARGET),
        )
    else:
        target = SimpleNamespace(hf_config=SimpleNamespace(architectures=arch, model_type="deepseek_v3", **TARGET))
    target.get_total_num_hidden_layers = lambda: TARGET["num_hidden_layers"]
    check_serving(draft_hf_config, target, features(vllm), environ=environ or {})


def refusal_problems(case: Case, err: BaseException) -> list[str]:
    """Why ``err`` is not a clear refusal of ``case`` (empty when it is)."""
    problems = []
    cls = case.error_class
    if not isinstance(err, cls):
        problems.append(
            f"raised {type(err).__module__}.{type(err).__name__}, expected an instance of {cls.__module__}.{cls.__name__}"
        )
    message = str(err)
    name, expected = case.expect
    if name not in message:
        problems.append(f"message does not name it: lacks {name!r}")
    if expected not in message:
        problems.append(f"message lacks the expectation {expected!r}")
    problems += [f"message lacks {s!r}" for s in case.also if s not in message]
    problems += [f"message holds {s!r}, a wrong hint" for s in case.never if s in message]
    problems += [f"message is a raw low-level one ({s!r})" for s in RAW_MESSAGES if s in message]
    if err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        problems.append(f"chained to {type(err.__cause__ or err.__context__).__name__}: the user sees two tracebacks")
    innermost = traceback.extract_tb(err.__traceback__)[-1].filename
    if not innermost.startswith(OWN_CODE):
        problems.append(f"raised from {innermost}, not from this project's code")
    return problems


RESULTS: dict[str, str] = {}  # case name -> "refused" | "skipped" | what went wrong


def run_case(case: Case, good, folder: Path) -> str:
    if case.name not in RESULTS:
        if case.check == "serving":
            try:
                import vllm  # noqa: F401
            except ImportError:
                RESULTS[case.name] = "skipped"
                return RESULTS[case.name]
        folder = build(case, good, folder)  # outside the try: a broken case must fail, not count as refused
        try:
            attempt(case, folder)
        except Exception as err:  # noqa: BLE001 - judging exactly which exception escaped is the point
            problems = refusal_problems(case, err)
            RESULTS[case.name] = "refused" if not problems else f"{'; '.join(problems)}\n    message: {err}"
        else:
            RESULTS[case.name] = "LOADED SILENTLY"
    return RESULTS[case.name]


def test_the_good_drafts_load(good_drafts, tmp_path):
    for base, model in good_drafts.items():
        folder = write_checkpoint(tmp_path / base, published_style_config(model), model.state_dict())
        Eagle31MLAForCausalLM.from_pretrained(folder)
        if base == "full":
            try:
                import vllm  # noqa: F401
            except ImportError:
                continue
            check_serving(folder)  # the serving cases' target is a fit


def test_the_judge_rejects_unclear_errors():
    """Control: what the corpus would count as a bare, chained, misplaced or vague error."""
    case = Case("control", lambda d: None, ("missing tensor 'norm.weight'", "expected shape [64]"))
    try:
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    except RuntimeError as err:
        problems = refusal_problems(case, err)
    assert any("raised builtins.RuntimeError" in p for p in problems) and any("mat1 and mat2" in p for p in problems)
    try:  # names the tensor but not what was expected
        raise CheckpointError("missing tensor 'norm.weight'")
    except CheckpointError as err:
        problems = refusal_problems(case, err)
    assert "message lacks the expectation 'expected shape [64]'" in problems and not any(
        "does not name" in p for p in problems
    )
    try:  # a ValueError with the right words is still not the library's class
        raise ValueError("missing tensor 'norm.weight', expected shape [64]")
    except ValueError as err:
        problems = refusal_problems(case, err)
    assert any(
        "expected an instance of eagle31_mla.model.checkpoint_eagle31_mla.CheckpointError" in p for p in problems
    ), problems
    config_case = Case("control", lambda d: None, ("`hidden_size`", "must be an int >= 1"), error=ConfigError)
    try:  # the other library class is not the one the case names
        raise CheckpointError("`hidden_size` must be an int >= 1, got 0")
    except CheckpointError as err:
        assert any("expected an instance of" in p for p in refusal_problems(config_case, err))
    assert any("not from this project's code" in p for p in problems)
    try:
        try:
            {}["norm.weight"]
        except KeyError as inner:
            raise CheckpointError("missing tensor 'norm.weight'") from inner
    except CheckpointError as err:
        problems = refusal_problems(case, err)
    assert any("chained to KeyError" in p for p in problems) and any(
        "not from this project's code" in p for p in problems
    )
    try:
        Eagle31MLAForCausalLM.from_pretrained(Path("/nonexistent-eagle31-folder"))
    except Exception as err:  # noqa: BLE001
        problems = refusal_problems(case, err)
    assert any("message does not name it" in p for p in problems)


def test_the_corpus_is_large_and_distinct():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    vague = []
    for case in CASES:  # each case: what names the field or tensor, and a clause saying what was expected
        assert len(case.expect) == 2 and all(case.expect) and case.expect[0] != case.expect[1], case.name
        if not any(word in case.expect[1] for word in EXPECTING):
            vague.append(f"{case.name}: {case.expect[1]!r}")
        assert issubclass(case.error_class if case.check == "load" else ValueError, ValueError), case.name
    assert not vague, "expectation parts that say nothing expected:\n" + "\n".join(vague)


def test_every_config_field_and_dtype_argument_is_in_the_corpus():
    """Generated from the dataclasses: a new field (or dtype argument) is covered without edits here."""
    names = " ".join(c.name for c in CASES)
    for field in CONFIG_KEYS:
        if field.name in HAND_WRITTEN:
            assert HAND_WRITTEN[field.name] in {c.name for c in CASES}, field.name
            continue
        forms = [f"rope_scaling.{field.key}", f"rope_parameters.{field.key}"] if field.nested else [field.name]
        for shown in forms:
            assert f"config `{shown}` = " in names, shown
            if field.kind in ("int", "float", "token_id", "token_ids"):
                for label in ("NaN", "Infinity", "-Infinity", "a string of a number", "a bool"):
                    assert f"config `{shown}` = {label}" in {c.name for c in CASES}, (shown, label)
    for argument in DTYPE_ARGUMENTS:
        for label in ("int32", "fp16", "fp32"):
            assert f"from_pretrained({argument}={label})" in names


def _param(case: Case):
    return pytest.param(case, id=case.name)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_malformed_draft_is_refused_clearly(case, good_drafts, tmp_path):
    outcome = run_case(case, good_drafts, tmp_path)
    if outcome == "skipped":
        pytest.skip("serving-time check: needs the vLLM plugin's dependencies (vllm)")
    assert outcome == "refused", outcome


def test_tally(good_drafts, tmp_path_factory, capsys):
    """Runs any case not yet run (so the tally is complete under -k too) and prints the tally."""
    for case in CASES:
        if case.name not in RESULTS:
            run_case(case, good_drafts, tmp_path_factory.mktemp("case"))
    outcomes = [RESULTS[c.name] for c in CASES]
    skipped = outcomes.count("skipped")
    refused = outcomes.count("refused")
    by_kind = {}
    for case, outcome in zip(CASES, outcomes):
        if outcome == "refused":
            kind = case.error_class.__name__
            by_kind[kind] = by_kind.get(kind, 0) + 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(by_kind.items()))
    with capsys.disabled():
        print(
            f"\n  malformed-draft corpus: {len(CASES) - skipped} malformed drafts (configs, checkpoints, serving setups), {refused} refused with a clear error "
            f"({kinds})" + (f"; {skipped} serving-time cases skipped (no vLLM)" if skipped else "")
        )
    failed = {c.name: o for c, o in zip(CASES, outcomes) if o not in ("refused", "skipped")}
    assert not failed, failed
