# ruff: noqa: E501 -- one bad input per line: the table is kept under `# fmt: off` so each row reads as a row
"""The bad inputs users actually make, one row each, with the exact error they must get, through the API or the CLI.

One table (:data:`ROWS`): a case id, the call, the error, and the exact message (a plain string, ``{t}`` standing for
the case's folder) or a regex of it (a compiled pattern). An API row's call takes the folder and raises the error
type. A CLI row (:func:`cli`) is an ``eagle31-mla`` command line, ``{t}`` the folder :func:`cli_folder` fills: exit 2,
one line on stderr (``eagle31-mla: error:`` and the message), no traceback, nothing written. A ``(wrapper, cause)``
type is one of the config's ``validate_*`` rules: its ``cause`` type with the message, raised as it is or wrapped by
huggingface_hub's ``@strict`` in ``wrapper`` (then the wrapper's ``__cause__``). Rows marked ``LIBRARY`` are inputs
the library does not yet refuse clearly (a silent wrong result or a raw error without the argument's name): they
state the refusal it should give and are strict xfails, so a fix turns them into failures until the mark is removed.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers import DynamicCache

from eagle31_mla import CheckpointError, ConfigError, DraftInputError, Eagle31MLAConfig, Eagle31MLAForCausalLM
from eagle31_mla.cli import main
from eagle31_mla.decoding import speculative
from eagle31_mla.hub.convert import read_token_counts
from eagle31_mla.model.aux_layers import (
    AuxLayerIdError,
    AuxLayerIds,
    aux_layer_ids_config_entries,
    aux_layer_ids_from_config,
)
from eagle31_mla.prompts import PROMPT_SHAPES, PromptError, prompt_token_ids, read_conversations, read_prompt_lines
from eagle31_mla.serving.command import serve_command
from eagle31_mla.serving.engines import KIMI_K3_TARGET, InputError
from eagle31_mla.serving.pd import parse_launch
from tests.support.decoding import VOCAB, drafter, prompt, tiny_target
from tests.support.engine_configs import draft as draft_config, write_config
from tests.support.tiny import aux_inputs, published_style_config, tiny_config, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers

TYPE = StrictDataclassFieldValidationError  # strict's own check of a field's type
RULE = (StrictDataclassClassValidationError, ConfigError)  # a validate_* rule's ConfigError, as strict may wrap it


@cache
def ctx():
    """One tiny drafter (batch 2, 4 context tokens), its first step, and a pruned-vocabulary drafter."""
    model = tiny_drafter(seed=21)
    ids, aux = aux_inputs(model.config, 2, 4)
    with torch.no_grad():
        out = model(ids, aux_hidden_states=aux)
    return model, ids, aux, out, tiny_drafter(seed=3, draft_vocab_size=100)


def cached(model=None):
    """A fresh cache holding the 4-token context (bound to ``model``, default the table's drafter)."""
    m, ids, aux, _, _ = ctx()
    with torch.no_grad():
        return (model or m)(ids, aux_hidden_states=aux).past_key_values


def step(**kw):
    """A decode step after the context, on a fresh cache; ``kw`` replaces arguments."""
    m, ids, _, out, _ = ctx()
    return m(**{"input_ids": ids[:, :1], "hidden_states": out.hidden_states[:, -1:], "past_key_values": cached(), **kw})


def first(**kw):
    m, ids, aux, _, _ = ctx()
    return m(**{"input_ids": ids, "aux_hidden_states": aux, **kw})


def draft(**kw):
    m, ids, aux, _, _ = ctx()
    return m.draft(**{"input_ids": ids, "aux_hidden_states": aux, "num_tokens": 2, **kw})


DROP = object()  # a key the file leaves out (None is JSON null)


def config_file(tmp: Path, base: str = "full", **changes) -> Eagle31MLAConfig:
    """The tiny drafter's published-style config.json with ``changes`` (DROP removes a key), read as a file."""
    return Eagle31MLAConfig.from_pretrained(folder(tmp, base=base, config=changes))


def folder(tmp: Path, base="full", config=None, drop=(), put=None) -> Path:
    """A checkpoint folder of the tiny drafter (``base`` full or pruned), its config and tensors edited."""
    model = ctx()[0] if base == "full" else ctx()[4]
    cfg = published_style_config(model)  # a fresh dict
    for key, value in (config or {}).items():
        cfg.pop(key) if value is DROP else cfg.__setitem__(key, value)
    tensors = {k: v for k, v in model.state_dict().items() if k not in drop} | (put or {})
    return write_checkpoint(tmp, cfg, tensors)


def load(tmp, **kw) -> Eagle31MLAForCausalLM:
    return Eagle31MLAForCausalLM.from_pretrained(folder(tmp, **kw))


def without(tmp: Path, name: str) -> Eagle31MLAForCausalLM:
    """The good checkpoint with file ``name`` removed, loaded."""
    (folder(tmp) / name).unlink()
    return Eagle31MLAForCausalLM.from_pretrained(tmp)


def from_file(tmp: Path, read: Callable[[Path], object], name: str, text: str):
    """``read`` of the file ``name`` holding ``text``."""
    (tmp / name).write_text(text)
    return read(tmp / name)


def flash_target():
    target = tiny_target()
    target.config._attn_implementation = "flash_attention_2"  # set after init: flash-attn is not installed here
    return target


BOTH = ("speculative_generate", "measure_acceptance")
GENERATE, MEASURE = BOTH[:1], BOTH[1:]


def loops(mistake: str, names: tuple, changes: dict, error: type, message: str) -> list[Row]:
    """A row for each of the decoding loop's entry points in ``names``: one prompt (a list of it for
    ``measure_acceptance``) on the tiny pair of tests/support/decoding.py, ``changes`` replacing arguments (a
    callable: built at the call), the target's forward unreachable (a refusal must come before any compute)."""

    def call(name):
        target, draft = pair()
        kwargs = {"target": target, "drafter": draft, "max_new_tokens": 4}
        kwargs |= {"input_ids": prompt(5)} if name == "speculative_generate" else {"prompts": [prompt(5)]}
        kwargs |= {key: value() if callable(value) else value for key, value in changes.items()}
        with mock.patch.object(speculative, "CachedTarget", None):
            return getattr(speculative, name)(**kwargs)

    return [Row(f"{name}: {mistake}", lambda t, name=name: call(name), error, message) for name in names]


@cache
def pair():
    return tiny_target(), drafter()


TARGET = "--target {t}/model --draft {t}/model --prompts {t}/prompts.txt"  # a valid offline acceptance pair
TRAIN = "train --target {t}/model --text {t}/prompts.txt"
SERVER = "acceptance --server http://127.0.0.1:9 --engine vllm --prompts {t}/prompts.txt"
PAIR = "--prefill-command 'vllm serve T' --decode-command 'vllm serve T'"  # a PD pair for doctor
LONG_NAME = "/tmp/" + "n" * 300  # os.stat: ENAMETOOLONG, not "no such file"


def spec_pair(spec: str) -> str:
    """doctor on a PD pair whose prefill side passes this --speculative-config."""
    prefill = shlex.quote(f"vllm serve T --speculative-config {shlex.quote(spec)}")
    return f"doctor --engine vllm --prefill-command {prefill} --decode-command 'vllm serve T'"


def cli(line: str, message: str | re.Pattern) -> Row:
    return Row("cli: " + line.replace("{t}/", ""), line, 2, message)


def read_prompts(path: Path) -> list[list[int]]:
    """A prompts file read into ids as ``acceptance --prompts`` reads it (a 512-token vocabulary)."""
    return [prompt_token_ids(prompt, None, 512, where) for where, prompt in read_prompt_lines(path)]


def strict_type(field: str, text: str) -> str:
    return f"Validation error for field '{field}':\n    TypeError: {text}"


IDS = "eagle_aux_hidden_state_layer_ids"
#: strict's message for a value that fits no type of an optional field: (field, value, type, first error, got)
UNION = "Field '{0}' with value {1} doesn't match any type in (<class '{2}'>, <class 'NoneType'>). Errors: Field '{0}' {3}; Field '{0}' expected NoneType, got {4}"
AUX = "aux-layer ids (one-based completed layers): "
ROPE = "give non-finite or non-positive frequencies or scales; expected a usable schedule (Kimi-K3's: yarn, rope_theta 50000, factor 32, beta_fast 32 > beta_slow 1)"
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 256}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TOKEN_ID = "expected a token id written as a non-negative integer (no sign, no leading zero), got "
COUNT = "expected a count written as a non-negative integer (no sign, no leading zero), got "
LIBRARY = "LIBRARY"  # a row the library fails today: see the module docstring and the report


@dataclass(frozen=True)
class Row:
    id: str
    call: Callable[[Path], object] | str  # a str: a command line (a CLI row)
    error: type | tuple[type, type] | int  # a CLI row: the exit code
    message: str | re.Pattern
    status: str = ""  # LIBRARY: an xfail naming what the library does instead

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=self.status[len(LIBRARY) + 2 :])] if self.status else []
        return pytest.param(self, id=self.id, marks=marks)


# fmt: off
ROWS = [
    # ---- a config field of the wrong type (huggingface_hub's @strict, through the constructor and through a file) ----
    Row("type: int field given a string", lambda t: tiny_config(hidden_size="64"), TYPE, strict_type("hidden_size", "Field 'hidden_size' expected int, got str (value: '64')")),
    Row("type: int field given a float (file)", lambda t: config_file(t, vocab_size=300.5), TYPE, strict_type("vocab_size", "Field 'vocab_size' expected int, got float (value: 300.5)")),
    Row("type: bool field given a string (file)", lambda t: config_file(t, fc_norm="yes"), TYPE, strict_type("fc_norm", "Field 'fc_norm' expected bool, got str (value: 'yes')")),
    Row("type: float field given a string", lambda t: tiny_config(rms_norm_eps="1e-5"), TYPE, strict_type("rms_norm_eps", "Field 'rms_norm_eps' expected float, got str (value: '1e-5')")),
    Row("type: required size null (file)", lambda t: config_file(t, q_lora_rank=None), TYPE, strict_type("q_lora_rank", "Field 'q_lora_rank' expected int, got NoneType (value: None)")),
    Row("type: rope_scaling a string (file)", lambda t: config_file(t, rope_scaling="yarn"), TYPE, strict_type("rope_parameters", UNION.format("rope_parameters", "'yarn'", "dict", "expected dict, got str (value: 'yarn')", "str (value: 'yarn')"))),
    Row("type: eagle_config a list", lambda t: tiny_config(eagle_config=[2, 5, 9]), TYPE, strict_type("eagle_config", UNION.format("eagle_config", "[2, 5, 9]", "dict", "expected dict, got list (value: [2, 5, 9])", "list (value: [2, 5, 9])"))),
    Row("type: aux ids a string", lambda t: tiny_config(eagle_aux_hidden_state_layer_ids="2,5,9"), TYPE, strict_type(IDS, UNION.format(IDS, "'2,5,9'", "list[int]", "expected a list, got str", "str (value: '2,5,9')").replace("<class 'list[int]'>", "list[int]"))),
    Row("type: aux id a float", lambda t: tiny_config(eagle_aux_hidden_state_layer_ids=[2, 5.0, 9]), TYPE, strict_type(IDS, f"Field '{IDS}' with value [2, 5.0, 9] doesn't match any type in (list[int], <class 'NoneType'>). Errors: Invalid item at index 1 in list '{IDS}'; Field '{IDS}' expected NoneType, got list (value: [2, 5.0, 9])")),
    Row("type: eos id list holding a string", lambda t: tiny_config(eos_token_id=[2, "3"]), TYPE, strict_type("eos_token_id", "Field 'eos_token_id' with value [2, '3'] doesn't match any type in (<class 'int'>, list[int], <class 'NoneType'>). Errors: Field 'eos_token_id' expected int, got list (value: [2, '3']); Invalid item at index 1 in list 'eos_token_id'; Field 'eos_token_id' expected NoneType, got list (value: [2, '3'])")),
    Row("type: dtype misspelt", lambda t: tiny_config(dtype="fp16"), ConfigError, "`dtype` is 'fp16'; expected a floating-point torch dtype such as 'bfloat16'"),
    Row("type: torch_dtype misspelt (file)", lambda t: config_file(t, torch_dtype="fp16"), ConfigError, "`dtype` is 'fp16'; expected a floating-point torch dtype such as 'bfloat16'"),
    Row("type: torch_dtype not floating (file)", lambda t: config_file(t, torch_dtype="int32"), ConfigError, "`dtype` is 'int32'; expected a floating-point torch dtype such as 'bfloat16'"),
    Row("type: int field given a bool (file)", lambda t: config_file(t, num_attention_heads=True), TYPE, strict_type("num_attention_heads", "Field 'num_attention_heads' expected int, got bool (value: True)")),
    Row("type: use_aux_hidden_state a string", lambda t: tiny_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 5, 9], "use_aux_hidden_state": "false"}), ConfigError, re.compile(r"`eagle_config\.use_aux_hidden_state` is 'false' \(EAGLE-1 style: false\).*expected true, or leave it out")),
    # ---- a size or number out of range (validate_architecture) ----
    Row("range: hidden_size 0", lambda t: tiny_config(hidden_size=0), RULE, "`hidden_size` is 0; expected an int >= 1 and <= 2147483647"),
    Row("range: vocab_size 0 (file)", lambda t: config_file(t, vocab_size=0, draft_vocab_size=DROP), RULE, "`vocab_size` is 0; expected an int >= 1 and <= 2147483647"),
    Row("range: beyond int32", lambda t: tiny_config(max_position_embeddings=2**31), RULE, "`max_position_embeddings` is 2147483648; expected an int >= 1 and <= 2147483647"),
    Row("range: rms_norm_eps NaN (file, Transformers' special float)", lambda t: config_file(t, rms_norm_eps={"__float__": "NaN"}), RULE, "`rms_norm_eps` is nan; expected a number > 0 and < 1"),
    Row("range: rms_norm_eps 0", lambda t: tiny_config(rms_norm_eps=0.0), RULE, "`rms_norm_eps` is 0.0; expected a number > 0 and < 1"),
    Row("range: vocab_size beyond any int (file)", lambda t: config_file(t, vocab_size=10**30), RULE, "`vocab_size` is 1000000000000000000000000000000; expected an int >= 1 and <= 2147483647"),
    Row("arch: num_hidden_layers 2 (file)", lambda t: config_file(t, num_hidden_layers=2), RULE, "`num_hidden_layers` is 2; this drafter has exactly 1 layer"),
    Row("arch: kv heads != heads (file)", lambda t: config_file(t, num_key_value_heads=2), RULE, "`num_key_value_heads` (2) must equal `num_attention_heads` (4) for MLA"),
    Row("arch: draft_vocab_size > vocab_size", lambda t: tiny_config(draft_vocab_size=400), RULE, "`draft_vocab_size` (400) exceeds `vocab_size` (300); expected <= vocab_size (the draft vocabulary is a subset of the target's)"),
    Row("arch: tied embeddings (file)", lambda t: config_file(t, tie_word_embeddings=True), RULE, "`tie_word_embeddings` is true; expected false (the drafter has its own `lm_head`)"),
    Row("arch: unknown activation", lambda t: tiny_config(hidden_act="wiggle"), RULE, "`hidden_act` 'wiggle' is not one of Transformers' ACT2FN names ('silu')"),
    Row("arch: unrelated model_type (file)", lambda t: config_file(t, model_type="llama"), ConfigError, "`model_type` is 'llama'; expected one of ('kimi_k2', 'deepseek_v2', 'deepseek_v3')"),
    # ---- special token ids beyond the vocabulary (validate_token_ids) ----
    Row("token ids: bos = vocab_size (file)", lambda t: config_file(t, bos_token_id=300), RULE, "`bos_token_id` is 300; expected ids in [0, 300) (vocab_size)"),
    Row("token ids: one eos of a list beyond", lambda t: tiny_config(eos_token_id=[2, 300]), RULE, "`eos_token_id` is [2, 300]; expected ids in [0, 300) (vocab_size)"),
    Row("token ids: pad beyond a pruned config's vocab", lambda t: config_file(t, "pruned", pad_token_id=300), RULE, "`pad_token_id` is 300; expected ids in [0, 300) (vocab_size)"),
    Row("token ids: negative pad", lambda t: tiny_config(pad_token_id=-1), RULE, "`pad_token_id` is -1; expected ids in [0, 300) (vocab_size)"),
    # ---- rope: unsupported type, unusable numbers, contradictory dicts (validate_rope) ----
    Row("rope: unsupported type (file)", lambda t: config_file(t, rope_scaling={"type": "longrope", "factor": 4.0}), RULE, "`rope_parameters.rope_type` is 'longrope'; expected one of ['default', 'yarn']"),
    Row("rope: unsupported type dynamic", lambda t: tiny_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), RULE, "`rope_parameters.rope_type` is 'dynamic'; expected one of ['default', 'yarn']"),
    Row("rope: yarn without factor", lambda t: tiny_config(rope_parameters={k: v for k, v in YARN.items() if k != "factor"}), RULE, "`rope_parameters.factor` is None; expected a number in [1, 1e6]"),
    Row("rope: yarn factor below 1 (file)", lambda t: config_file(t, rope_scaling={"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 256}), RULE, "`rope_parameters.factor` is 0.5; expected a number in [1, 1e6]"),
    Row("rope: yarn key in a plain rope dict (file)", lambda t: config_file(t, rope_scaling={"factor": 2.0}), RULE, "`rope_parameters` holds ['factor'], not settings of default rope; remove them"),
    Row("rope: another type's key in a yarn dict", lambda t: tiny_config(rope_parameters={**YARN, "low_freq_factor": 1.0}), RULE, "`rope_parameters` holds ['low_freq_factor'], not settings of yarn rope; remove them"),
    Row("rope: beta_fast <= beta_slow", lambda t: tiny_config(rope_parameters={**YARN, "beta_fast": 1.0, "beta_slow": 32.0}), RULE, "`rope_parameters.beta_fast` (1.0) must be greater than `beta_slow` (32.0)"),
    Row("rope: yarn window beyond max_position_embeddings", lambda t: tiny_config(rope_parameters={**YARN, "original_max_position_embeddings": 100000}), RULE, "yarn `original_max_position_embeddings` (100000) exceeds `max_position_embeddings` (4096); expected <= max_position_embeddings"),
    Row("rope: the constructor's K3 yarn over a short max_position_embeddings", lambda t: Eagle31MLAConfig(max_position_embeddings=4096), RULE, "yarn `original_max_position_embeddings` (32768) exceeds `max_position_embeddings` (4096); expected <= max_position_embeddings"),
    Row("rope: theta too small to be usable", lambda t: tiny_config(rope_parameters={**YARN, "rope_theta": 1e-300}), RULE, f"the rope settings {{'rope_type': 'yarn', 'rope_theta': 1e-300, 'factor': 32.0, 'original_max_position_embeddings': 256}} {ROPE}"),
    Row("rope: negative theta", lambda t: tiny_config(rope_parameters={"rope_type": "default", "rope_theta": -5.0}), RULE, f"the rope settings {{'rope_type': 'default', 'rope_theta': -5.0}} {ROPE}"),
    Row("rope: infinite theta (file)", lambda t: config_file(t, rope_theta=math.inf), RULE, "`rope_parameters.rope_theta` is inf; expected a finite number"),
    Row("rope: yarn factor a string (file)", lambda t: config_file(t, rope_scaling={"type": "yarn", "factor": "32", "original_max_position_embeddings": 256}), RULE, "`rope_parameters.factor` is '32'; expected a finite number"),
    Row("rope: odd rope width", lambda t: tiny_config(qk_rope_head_dim=15), RULE, "`qk_rope_head_dim` is 15; expected an even number"),
    Row("rope: contradictory type and rope_type (file)", lambda t: config_file(t, rope_scaling={"type": "yarn", "rope_type": "default", "factor": 32.0}), RULE, "`rope_parameters` holds ['factor'], not settings of default rope; remove them"),
    Row("rope: both rope_parameters and rope_scaling (file)", lambda t: config_file(t, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), RULE, re.compile(r".*`rope_parameters`.*`rope_scaling`.*")),
    Row("rope: rope_theta twice, different (file)", lambda t: config_file(t, rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}), RULE, re.compile(r".*`rope_theta`.*50000.*10000.*")),
    # ---- aux-layer ids: missing, duplicate, unsorted, zero, contradictory, beyond the target, EAGLE-1 ----
    Row("aux: none named (file)", lambda t: config_file(t, eagle_config=DROP), ConfigError, "config.json names no aux layers: expected `eagle_aux_hidden_state_layer_ids` at the top level or inside `eagle_config` (Kimi-K3: one-based [2, 46, 90] = zero-based [1, 45, 89]); engines would silently fall back to their own default"),
    Row("aux: only vLLM's target_layer_ids (file)", lambda t: config_file(t, eagle_config=DROP, target_layer_ids=[2, 5, 9]), ConfigError, "config.json has a top-level `target_layer_ids` but no `eagle_aux_hidden_state_layer_ids`: vLLM's V2 runner adds 1 to `target_layer_ids`, so its meaning depends on the engine; write `eagle_aux_hidden_state_layer_ids` with `aux_layer_ids_convention` instead"),
    Row("aux: duplicate", lambda t: tiny_config(eagle_aux_hidden_state_layer_ids=[2, 5, 5]), ConfigError, AUX + "[2, 5, 5] has duplicates; expected distinct ids (engines de-duplicate them, which silently changes the width of the tensor fed to `fc`)"),
    Row("aux: unsorted (file)", lambda t: config_file(t, eagle_config={"eagle_aux_hidden_state_layer_ids": [9, 2, 5]}), ConfigError, AUX + "[9, 2, 5] is not ascending; engines concatenate aux states in ascending layer order, so `fc` was trained on [2, 5, 9]: write them in that order"),
    Row("aux: zero one-based (file, top level)", lambda t: config_file(t, eagle_config=DROP, eagle_aux_hidden_state_layer_ids=[0, 2, 5]), ConfigError, AUX + "[0, 2, 5] contains 0; one-based ids must be >= 1 (0 is the embedding output, which no EAGLE-3 drafter is trained on and which crashes vLLM's DeepSeek target)"),
    Row("aux: beyond the target depth", lambda t: tiny_config(target_num_hidden_layers=8), ConfigError, AUX + "[2, 5, 9] goes beyond the target's depth of 8 layers (one-based ids must be <= 8; zero-based <= 7)"),
    Row("aux: top level and nested disagree", lambda t: tiny_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 5, 8]}), ConfigError, "config.json is contradictory about aux layers: top-level [2, 5, 9] read one_based (top-level ids are one-based (vLLM's key)) gives one-based [2, 5, 9] = zero-based [1, 4, 8], but eagle_config [2, 5, 8] read one_based (unlabelled nested ids starting above 1 are the exported one-based form) gives one-based [2, 5, 8] = zero-based [1, 4, 7]; keep one, or label them with `aux_layer_ids_convention`"),
    Row("aux: unknown convention", lambda t: tiny_config(aux_layer_ids_convention="two_based"), ConfigError, "aux_layer_ids_convention: expected one of ('one_based', 'zero_based'), got 'two_based'"),
    Row("aux: an empty convention (file)", lambda t: config_file(t, aux_layer_ids_convention=""), ConfigError, "aux_layer_ids_convention: expected one of ('one_based', 'zero_based'), got ''"),
    Row("aux: EAGLE-1 use_aux_hidden_state false (file)", lambda t: config_file(t, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 5, 9], "use_aux_hidden_state": False}), ConfigError, "`eagle_config.use_aux_hidden_state` is False (EAGLE-1 style: false); this drafter's `fc` takes the concatenated aux states: expected true, or leave it out"),
    Row("aux ids: none", lambda t: AuxLayerIds.from_convention([], "one_based"), AuxLayerIdError, AUX + "expected a non-empty list of ints, got ()"),
    Row("aux ids: a string id", lambda t: AuxLayerIds.from_convention([2, "46", 90], "one_based"), AuxLayerIdError, AUX + "every id must be an int, got '46' in [2, '46', 90]"),
    Row("aux ids: negative zero-based", lambda t: AuxLayerIds.from_convention([-1, 4], "zero_based"), AuxLayerIdError, "zero-based aux-layer ids: [-1, 4] contains -1; ids must be >= 0"),
    Row("aux ids: zero-based id of the target's depth", lambda t: AuxLayerIds.from_convention([1, 45, 93], "zero_based", 93), AuxLayerIdError, AUX + "[2, 46, 94] goes beyond the target's depth of 93 layers (one-based ids must be <= 93; zero-based <= 92)"),
    Row("aux ids: eagle_config a list", lambda t: aux_layer_ids_from_config({"eagle_config": [1, 2]}), AuxLayerIdError, "eagle_config: expected a dict, got list"),
    Row("aux ids: written in an unknown convention", lambda t: aux_layer_ids_config_entries(AuxLayerIds((1, 2, 3)), "two_based"), AuxLayerIdError, "aux_layer_ids_convention: expected one of ('one_based', 'zero_based'), got 'two_based'"),
    # ---- config.json that is not a config ----
    Row("file: config.json is null", lambda t: from_file(t, Eagle31MLAConfig.from_pretrained, "config.json", "null"), ConfigError, "config.json holds a NoneType; expected a JSON object"),
    Row("file: config.json is a list", lambda t: from_file(t, Eagle31MLAConfig.from_pretrained, "config.json", "[1, 2]"), ConfigError, "config.json holds a list; expected a JSON object"),
    Row("file: config.json is not JSON", lambda t: from_file(t, Eagle31MLAConfig.from_pretrained, "config.json", "{'hidden_size': 1}"), OSError, re.compile(r"It looks like the config file at '{t}/config\.json' is not a valid JSON file\.")),
    Row("file: weights without config.json", lambda t: without(t, "config.json"), OSError, re.compile(r".*config\.json.*"), f"{LIBRARY}: ConfigError 'config.json names no aux layers', as if the file were there"),
    # ---- checkpoints: missing, extra, misshaped tensors; EAGLE-3 vs 3.1; pruned vocabulary; pickle; no weights ----
    Row("ckpt: missing tensor", lambda t: load(t, drop={"layers.0.self_attn.kv_a_layernorm.weight"}), CheckpointError, "{t}: the checkpoint does not match its config: missing tensor 'layers.0.self_attn.kv_a_layernorm.weight'"),
    Row("ckpt: extra tensor (another architecture's gate)", lambda t: load(t, put={"layers.0.self_attn.g_proj.weight": torch.zeros(80, 128)}), CheckpointError, "{t}: the checkpoint does not match its config: unexpected tensor 'layers.0.self_attn.g_proj.weight'"),
    Row("ckpt: misshaped tensor", lambda t: load(t, put={"layers.0.self_attn.kv_b_proj.weight": torch.zeros(144, 16)}), CheckpointError, re.compile(r".*: the checkpoint does not match its config: tensor 'layers.0.self_attn.kv_b_proj.weight' has shape \[144, 16\], expected \[144, 32\]")),
    Row("ckpt: a NaN weight", lambda t: load(t, put={"norm.weight": ctx()[0].norm.weight.detach() * float("nan")}), CheckpointError, re.compile(r".*: the checkpoint does not match its config: tensor 'norm.weight' holds NaN or inf")),
    Row("ckpt: fc stored transposed", lambda t: load(t, put={"fc.weight": ctx()[0].fc.weight.detach().T}), CheckpointError, re.compile(r".*: the checkpoint does not match its config: tensor 'fc.weight' has shape \[\d+, \d+\], expected \[\d+, \d+\]")),
    Row("ckpt: four aux ids for an fc trained on three", lambda t: load(t, config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 9, 12]}}), CheckpointError, re.compile(r".*: tensor 'fc.weight' has shape \[\d+, \d+\], expected \[\d+, \d+\]; missing tensor 'fc_norm.3.weight'")),
    Row("ckpt: EAGLE-3.1 config, no fc_norm weights", lambda t: load(t, drop={f"fc_norm.{i}.weight" for i in range(3)}), CheckpointError, "{t}: the checkpoint does not match its config: missing tensor 'fc_norm.0.weight'; missing tensor 'fc_norm.1.weight'; missing tensor 'fc_norm.2.weight'"),
    Row("ckpt: EAGLE-3.1 weights, fc_norm false", lambda t: load(t, config={"fc_norm": False}), CheckpointError, "{t}: the checkpoint does not match its config: unexpected tensor 'fc_norm.0.weight'; unexpected tensor 'fc_norm.1.weight'; unexpected tensor 'fc_norm.2.weight'"),
    Row("ckpt: EAGLE-3.1 weights, fc_norm absent (file = EAGLE-3)", lambda t: load(t, config={"fc_norm": DROP}), CheckpointError, "{t}: the checkpoint does not match its config: unexpected tensor 'fc_norm.0.weight'; unexpected tensor 'fc_norm.1.weight'; unexpected tensor 'fc_norm.2.weight'"),
    Row("ckpt: pruned config without d2t", lambda t: load(t, base="pruned", drop={"d2t", "t2d"}), CheckpointError, "{t}: the checkpoint does not match its config: missing tensor 'd2t'; missing tensor 't2d'"),
    Row("ckpt: full-vocabulary config with d2t", lambda t: load(t, put={"d2t": torch.zeros(300, dtype=torch.long)}), CheckpointError, "{t}: the checkpoint does not match its config: unexpected tensor 'd2t'"),
    Row("ckpt: d2t maps beyond the vocabulary", lambda t: load(t, base="pruned", put={"d2t": torch.full((100,), 250)}), CheckpointError, re.compile(r".*'d2t'.*\[0, 300\).*")),
    Row("ckpt: d2t maps beyond the vocabulary, no t2d", lambda t: load(t, base="pruned", drop={"t2d"}, put={"d2t": torch.full((100,), 250)}), CheckpointError, re.compile(r".*'d2t'.*\[0, 300\).*")),
    Row("ckpt: no weight file", lambda t: without(t, "model.safetensors"), OSError, re.compile(r"Error no file named model\.safetensors(, or pytorch_model\.bin)? found in directory {t}\.")),
    # ---- forward: only what would be silently wrong ----
    Row("forward: both states", lambda t: first(hidden_states=torch.zeros(2, 4, 64)), DraftInputError, "pass exactly one of `aux_hidden_states` (first step) or `hidden_states` (later)"),
    Row("forward: neither state", lambda t: ctx()[0](ctx()[1]), DraftInputError, "pass exactly one of `aux_hidden_states` (first step) or `hidden_states` (later)"),
    Row("forward: aux states of two layers, not three", lambda t: first(aux_hidden_states=ctx()[2][..., :96]), DraftInputError, "`aux_hidden_states` has shape (2, 4, 96); expected (2, 4, 144)"),
    Row("forward: aux states without the batch dim", lambda t: first(aux_hidden_states=ctx()[2][0]), DraftInputError, "`aux_hidden_states` has shape (4, 144); expected (2, 4, 144)"),
    Row("forward: input_ids shorter than the states", lambda t: first(input_ids=ctx()[1][:, :3]), DraftInputError, "`aux_hidden_states` has shape (2, 4, 144); expected (2, 3, 144)"),
    Row("forward: a target-width state fed back", lambda t: step(hidden_states=torch.zeros(2, 1, 48)), DraftInputError, "`hidden_states` has shape (2, 1, 48); expected (2, 1, 64)"),
    Row("forward: the whole state fed back for one token", lambda t: step(hidden_states=ctx()[3].hidden_states), DraftInputError, "`hidden_states` has shape (2, 4, 64); expected (2, 1, 64)"),
    Row("forward: a batch-2 cache, a batch-1 step", lambda t: step(input_ids=ctx()[1][:1, :1], hidden_states=ctx()[3].hidden_states[:1, -1:]), DraftInputError, "`past_key_values` holds 2 sequences; expected 1 (the batch)"),
    Row("forward: another drafter's cache", lambda t: step(past_key_values=cached(ctx()[4])), DraftInputError, "`past_key_values` was written by another drafter; expected this drafter's"),
    Row("forward: 2-D mask without the cached tokens", lambda t: step(attention_mask=torch.ones(2, 1, dtype=torch.long)), DraftInputError, "`attention_mask` has shape (2, 1); expected (2, 5)"),
    Row("forward: a Transformers DynamicCache", lambda t: step(past_key_values=DynamicCache()), DraftInputError, re.compile(r"`past_key_values` is a DynamicCache with use_cache=None; expected .*LatentKVCache.*")),
    Row("forward: 1-D input_ids", lambda t: first(input_ids=ctx()[1][0]), DraftInputError, re.compile(r"`input_ids` has shape \(4,\); expected .*\[B, T\].*")),
    Row("forward: a cache with use_cache=False", lambda t: step(use_cache=False), DraftInputError, re.compile(r"`past_key_values` is a LatentKVCache with use_cache=False; expected .*")),
    Row("forward: a [B, 1, 1, S] padding mask as the 4-D mask", lambda t: first(attention_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool)), DraftInputError, re.compile(r"`attention_mask` has shape \(2, 1, 1, 4\) and dtype torch.bool; expected .*\(2, 1, 4, 4\).*")),
    Row("forward: a misspelt keyword", lambda t: first(use_cahce=False), DraftInputError, re.compile(r".*`use_cahce`.*"), f"{LIBRARY}: accepted; **kwargs swallows it"),
    Row("cache: crop beyond the cached tokens", lambda t: cached().crop(7), DraftInputError, "`length` is 7; expected an int in [0, 4] (the cached tokens)"),
    # ---- draft: sampling settings, num_tokens, the last position ----
    Row("draft: temperature NaN", lambda t: draft(temperature=math.nan), DraftInputError, "`temperature` is nan; expected a finite number >= 0 (0 = greedy decoding)"),
    Row("draft: temperature negative", lambda t: draft(temperature=-0.5), DraftInputError, "`temperature` is -0.5; expected a finite number >= 0 (0 = greedy decoding)"),
    Row("draft: temperature a string", lambda t: draft(temperature="0.7"), DraftInputError, "`temperature` is '0.7'; expected a finite number >= 0 (0 = greedy decoding)"),
    Row("draft: top_p 0", lambda t: draft(temperature=0.7, top_p=0.0), DraftInputError, "`top_p` is 0.0; expected a number in (0, 1] (1 = no truncation)"),
    Row("draft: top_p above 1", lambda t: draft(temperature=0.7, top_p=1.5), DraftInputError, "`top_p` is 1.5; expected a number in (0, 1] (1 = no truncation)"),
    Row("draft: top_p negative even when greedy", lambda t: draft(top_p=-0.1), DraftInputError, "`top_p` is -0.1; expected a number in (0, 1] (1 = no truncation)"),
    Row("draft: a device name as the sampling backend", lambda t: draft(sampling_backend="cuda"), DraftInputError, "`sampling_backend` is 'cuda'; expected one of ('torch', 'flashinfer')"),
    Row("draft: num_tokens 0", lambda t: draft(num_tokens=0), DraftInputError, "`num_tokens` is 0; expected an int >= 1"),
    Row("draft: num_tokens a float", lambda t: draft(num_tokens=2.0), DraftInputError, "`num_tokens` is 2.0; expected an int >= 1"),
    Row("draft: a batch-1 cache for a batch-2 context", lambda t: draft(past_key_values=ctx()[0](ctx()[1][:1], aux_hidden_states=ctx()[2][:1]).past_key_values), DraftInputError, "`past_key_values` holds 1 sequences; expected 2 (the batch)"),
    Row("draft: explicit positions past max_position_embeddings", lambda t: draft(position_ids=torch.arange(4092, 4096).expand(2, 4)), DraftInputError, "`position_ids` reach 4096, beyond max_position_embeddings 4096 (drafting 2 tokens after the context); expected a shorter context or fewer tokens"),
    Row("draft: a cache so long the drafted tokens pass the limit", lambda t: draft(past_key_values=long_cache(4090), num_tokens=4), DraftInputError, "`position_ids` reach 4096, beyond max_position_embeddings 4096 (drafting 4 tokens after the context); expected a shorter context or fewer tokens"),
    # ---- prompts files (acceptance --prompts): every line checked, its file and line named ----
    Row("prompts: float ids", lambda t: from_file(t, read_prompts, "p.jsonl", '{"input_ids": [1.9, 2.7, 3.5]}'), PromptError, '{t}/p.jsonl:1: "input_ids" is 1.9 (float) at index 0, not an int token id; expected ' + PROMPT_SHAPES),
    Row("prompts: ids as strings", lambda t: from_file(t, read_prompts, "p.jsonl", '{"input_ids": ["12", "3"]}'), PromptError, '{t}/p.jsonl:1: "input_ids" is \'12\' (str) at index 0, not an int token id; expected ' + PROMPT_SHAPES),
    Row("prompts: no ids", lambda t: from_file(t, read_prompts, "p.jsonl", '{"input_ids": []}'), PromptError, '{t}/p.jsonl:1: "input_ids" is an empty list (a prompt needs at least one token); expected ' + PROMPT_SHAPES),
    Row("prompts: an id outside the vocabulary", lambda t: from_file(t, read_prompts, "p.jsonl", '{"input_ids": [1, 2, 999999]}'), PromptError, "{t}/p.jsonl:1: the prompt's ids hold token id 999999 at index 2, outside the target's vocabulary [0, 512)"),
    Row("prompts: a null prompt", lambda t: from_file(t, read_prompts, "p.jsonl", '{"prompt": null}'), PromptError, '{t}/p.jsonl:1: "prompt" is null, not a non-empty string; expected ' + PROMPT_SHAPES),
    Row("prompts: an empty prompt", lambda t: from_file(t, read_prompts, "p.jsonl", '{"prompt": ""}'), PromptError, '{t}/p.jsonl:1: "prompt" is "", not a non-empty string; expected ' + PROMPT_SHAPES),
    Row("prompts: a message without content", lambda t: from_file(t, read_prompts, "p.jsonl", '{"messages": [{"role": "user"}]}'), PromptError, '{t}/p.jsonl:1: "messages"[0] is {"role": "user"}, not a {"role": str, "content": str} object; expected ' + PROMPT_SHAPES),
    Row("prompts: both a prompt and ids", lambda t: from_file(t, read_prompts, "p.jsonl", '{"prompt": "a", "input_ids": [1]}'), PromptError, "{t}/p.jsonl:1: an object with both 'input_ids' and 'prompt' (which one is the prompt?); expected " + PROMPT_SHAPES),
    Row("prompts: an object of another key", lambda t: from_file(t, read_prompts, "p.jsonl", '{"other": "hello"}'), PromptError, "{t}/p.jsonl:1: an object with keys ['other']; expected " + PROMPT_SHAPES),
    Row("prompts: a bare number", lambda t: from_file(t, read_prompts, "p.jsonl", "5"), PromptError, "{t}/p.jsonl:1: 5; expected " + PROMPT_SHAPES),
    Row("prompts: a list holding a float", lambda t: from_file(t, read_prompts, "p.jsonl", "[1, 2.5]"), PromptError, "{t}/p.jsonl:1: a list holding 2.5 (float) at index 1, not an int token id; expected " + PROMPT_SHAPES),
    # ---- training data: conversations (.jsonl) and token counts ----
    Row("conversations: not a .jsonl file", lambda t: from_file(t, read_conversations, "c.txt", "hello\n"), PromptError, '{t}/c.txt: expected a .jsonl file, one {"messages": [...]} object per line'),
    Row("conversations: a prompt, not messages", lambda t: from_file(t, read_conversations, "c.jsonl", '{"prompt": "x"}\n'), PromptError, '{t}/c.jsonl:1: expected an object with "messages" (a conversation to train on)'),
    Row("conversations: no assistant turn", lambda t: from_file(t, read_conversations, "c.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n'), PromptError, "{t}/c.jsonl:1: no assistant turn with text content: nothing to train on"),
    Row("conversations: an empty assistant turn", lambda t: from_file(t, read_conversations, "c.jsonl", '{"messages": [{"role": "assistant", "content": ""}]}\n'), PromptError, "{t}/c.jsonl:1: no assistant turn with text content: nothing to train on"),
    Row("conversations: a turn without content", lambda t: from_file(t, read_conversations, "c.jsonl", '{"messages": [{"role": "assistant"}]}\n'), PromptError, '{t}/c.jsonl:1: "messages"[0] is {"role": "assistant"}, not a {"role": str, "content": str} object; expected a string, a list of int token ids, or an object with "prompt" or "text" (a string), "messages" (a list of {"role": ..., "content": ...} objects) or "input_ids" (a list of int token ids)'),
    Row("conversations: none", lambda t: from_file(t, read_conversations, "c.jsonl", "\n\n"), PromptError, "{t}/c.jsonl: expected at least one conversation, found none"),
    Row("token counts: an id twice", lambda t: from_file(t, read_token_counts, "c.json", '{"5": 3, "5": 4}'), InputError, "{t}/c.json: a token id appears twice"),
    Row("token counts: a leading zero (json)", lambda t: from_file(t, read_token_counts, "c.json", '{"05": 3, "5": 4}'), InputError, "{t}/c.json: id '05': " + TOKEN_ID + "'05'"),
    Row("token counts: a fractional count", lambda t: from_file(t, read_token_counts, "c.json", "[1.5, 2, 3]"), InputError, "{t}/c.json: id 0: " + COUNT + "1.5"),
    Row("token counts: an infinite count", lambda t: from_file(t, read_token_counts, "c.json", '{"5": 1e400}'), InputError, "{t}/c.json: id '5': " + COUNT + "inf"),
    Row("token counts: a NaN count", lambda t: from_file(t, read_token_counts, "c.json", '{"5": NaN}'), InputError, "{t}/c.json: id '5': " + COUNT + "nan"),
    Row("token counts: a negative id", lambda t: from_file(t, read_token_counts, "c.json", '{"-1": 3}'), InputError, "{t}/c.json: id '-1': " + TOKEN_ID + "'-1'"),
    Row("token counts: a bool count", lambda t: from_file(t, read_token_counts, "c.json", '{"5": true}'), InputError, "{t}/c.json: id '5': " + COUNT + "True"),
    Row("token counts: a full-width digit", lambda t: from_file(t, read_token_counts, "c.json", '{"\uff15": 3}'), InputError, "{t}/c.json: id '\uff15': " + TOKEN_ID + "'\uff15'"),
    Row("token counts: a leading zero (text)", lambda t: from_file(t, read_token_counts, "c.txt", "05 3\n5 4\n"), InputError, "{t}/c.txt: line 1: " + TOKEN_ID + "'05'"),
    Row("token counts: an infinite count (text)", lambda t: from_file(t, read_token_counts, "c.txt", "5 1e400\n"), InputError, "{t}/c.txt: line 1: " + COUNT + "'1e400'"),
    Row("token counts: a word for a count", lambda t: from_file(t, read_token_counts, "c.txt", "3 four\n"), InputError, "{t}/c.txt: line 1: " + COUNT + "'four'"),
    # ---- serving: the launch command's numbers, a PD side's launch command ----
    Row("serve: num_steps 0", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), num_steps=0), ValueError, "--num-steps must be an integer >= 1, got 0"),
    Row("serve: topk negative", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), topk=-1), ValueError, "--topk must be an integer >= 1, got -1"),
    Row("serve: num_steps a float", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), num_steps=2.5), ValueError, "--num-steps must be an integer >= 1, got 2.5"),
    Row("serve: num_steps a bool", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), num_steps=True), ValueError, "--num-steps must be an integer >= 1, got True"),
    Row("serve: num_draft_tokens 0 for a tree", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), num_draft_tokens=0, topk=2), ValueError, "--num-draft-tokens must be an integer >= 1, got 0"),
    Row("serve: tensor_parallel_size 0", lambda t: serve_command("vllm", "t", "d", KIMI_K3_TARGET, draft_config(), tensor_parallel_size=0), ValueError, "--tp must be an integer >= 1, got 0"),
    Row("pd: SGLang's command for vLLM", lambda t: parse_launch("vllm", "sglang serve --model-path T"), InputError, "the command: expected vLLM's launch command (vllm serve or -m vllm.entrypoints.openai.api_server ...), got 'sglang serve --model-path T'"),
    Row("pd: a speculative config that is not JSON", lambda t: parse_launch("vllm", "vllm serve T --speculative-config '{not json'"), InputError, "the command: --speculative-config is not JSON: '{not json'"),
    Row("pd: a kv-transfer config not an object", lambda t: parse_launch("vllm", "vllm serve T --kv-transfer-config '[1]'"), InputError, "the command: --kv-transfer-config must be a JSON object, got '[1]'"),
    Row("pd: an unbalanced quote", lambda t: parse_launch("sglang", "sglang serve 'unbalanced"), InputError, "the command: not a shell command line (No closing quotation)"),
    # ---- the decoding loop: speculative_generate and measure_acceptance, refused before any compute ----
    *loops("drafter as target", BOTH, {"target": drafter}, DraftInputError, "`target` is a Eagle31MLAForCausalLM; expected the Transformers causal LM it drafts for"),
    *loops("target as drafter", BOTH, {"drafter": tiny_target}, DraftInputError, "`drafter` is a LlamaForCausalLM; expected an Eagle31MLAForCausalLM"),
    *loops("drafter of another target", BOTH, {"drafter": lambda: drafter(target_hidden_size=32)}, DraftInputError, "the drafter's `target_hidden_size` is 32 but the target's `hidden_size` is 48; expected the target the drafter was trained for"),
    *loops("aux id beyond the depth", GENERATE, {"drafter": lambda: drafter(eagle_aux_hidden_state_layer_ids=[1, 2, 6])}, AuxLayerIdError, AUX + "[1, 2, 6] goes beyond the target's depth of 4 layers (one-based ids must be <= 4; zero-based <= 3)"),
    *loops("tree on flash attention", GENERATE, {"target": flash_target, "topk": 2, "num_draft_tokens": 7}, DraftInputError, "tree verification passes a custom 4-D attention mask, which 'flash_attention_2' cannot take; load the target with attn_implementation='sdpa' (or 'eager')"),
    *loops("negative temperature", BOTH, {"temperature": -0.5}, DraftInputError, "`temperature` is -0.5; expected a finite number >= 0 (0 = greedy decoding)"),
    *loops("top_p above 1", BOTH, {"temperature": 0.7, "top_p": 1.5}, DraftInputError, "`top_p` is 1.5; expected a number in (0, 1] (1 = no truncation)"),
    *loops("unknown backend", BOTH, {"sampling_backend": "cuda"}, DraftInputError, "`sampling_backend` is 'cuda'; expected one of ('torch', 'flashinfer')"),
    *loops("zero steps", BOTH, {"num_steps": 0}, DraftInputError, "`num_steps` is 0; expected an int in [1, 64]"),
    *loops("a huge max_new_tokens", BOTH, {"max_new_tokens": 10**12}, DraftInputError, "`max_new_tokens` is 1000000000000; expected an int in [1, 10000000]"),
    *loops("a huge tree", BOTH, {"topk": 2, "num_draft_tokens": 10**9}, DraftInputError, "`num_draft_tokens` is 1000000000; expected None or an int <= 4096"),
    *loops("tree without its size", BOTH, {"topk": 2}, DraftInputError, "tree drafting (topk 2) needs num_draft_tokens (root included), at most 11"),
    *loops("tree too big for its steps", BOTH, {"topk": 2, "num_draft_tokens": 12}, DraftInputError, "num_draft_tokens (root included) must be in [2, 11] for topk 2 and 3 steps, got 12"),
    *loops("chain with a tree size", BOTH, {"num_draft_tokens": 6}, DraftInputError, "chain drafting verifies num_steps + 1 = 4 tokens, got num_draft_tokens 6"),
    *loops("chain with topk", GENERATE, {"topk": 4, "tree": False}, DraftInputError, "chain drafting has topk 1, got 4"),
    *loops("topk beyond the draft vocabulary", BOTH, {"drafter": lambda: drafter(draft_vocab_size=20), "topk": 21, "num_draft_tokens": 8}, DraftInputError, "topk must be in [1, draft_vocab_size=20], got 21"),
    *loops("eos as a string", BOTH, {"eos_token_id": "381"}, DraftInputError, "`eos_token_id` is '381'; expected None, an int token id in [0, 64) or a list of them"),
    *loops("eos outside the vocabulary", BOTH, {"eos_token_id": [1, VOCAB]}, DraftInputError, "`eos_token_id` holds 64; expected None, an int token id in [0, 64) or a list of them"),
    *loops("ids as floats", GENERATE, {"input_ids": [1.5, 2.0]}, DraftInputError, "`input_ids` holds 1.5 (float); expected int token ids"),
    *loops("ids as a float tensor", GENERATE, {"input_ids": torch.tensor([1.0, 2.0])}, DraftInputError, "`input_ids` has dtype torch.float32; expected integer token ids"),
    *loops("no ids", GENERATE, {"input_ids": []}, DraftInputError, "`input_ids` is empty; expected a prompt of at least one token"),
    *loops("ids outside the vocabulary", GENERATE, {"input_ids": [3, VOCAB]}, DraftInputError, "`input_ids` hold ids in [3, 64]; expected ids in [0, 64) (the target's vocabulary)"),
    *loops("a seed as the generator", GENERATE, {"generator": 0}, DraftInputError, "`generator` is 0; expected a torch.Generator or None"),
    *loops("one prompt, not a list", MEASURE, {"prompts": "a prompt"}, DraftInputError, f"`prompts` is 'a prompt'; expected a list of prompts, each {PROMPT_SHAPES}"),
    *loops("no prompts", MEASURE, {"prompts": []}, DraftInputError, "`prompts` is empty; expected at least one prompt (no requests, no statistics)"),
    *loops("a prompt outside the vocabulary", MEASURE, {"prompts": [[1, VOCAB]]}, PromptError, "prompt 0: the prompt's ids hold token id 64 at index 1, outside the target's vocabulary [0, 64)"),
    # ---- the command line (each row: exit 2, exactly this one line on stderr, nothing written) ----
    # a path that is not there, or not of its kind
    cli(f"acceptance {TARGET} --prompts {{t}}/missing.txt", "argument --prompts: File '{t}/missing.txt' does not exist."),
    cli(f"{TRAIN} --out {{t}}/out --text {{t}}/a-folder", "argument --text: File '{t}/a-folder' is a directory."),
    cli(f"{TRAIN} --out {{t}}/a-file.txt", "argument --out: Directory '{t}/a-file.txt' is a file."),
    cli(f"acceptance {TARGET} --json {{t}}/no-such/r.json", "argument --json: expected a file path in an existing, writable folder, got '{t}/no-such/r.json'"),
    cli("acceptance --prompts '' --target {t}/model --draft {t}/model", "argument --prompts: expected a path, got ''"),
    # a model reference that is neither a model folder nor a Hub repo id
    cli("inspect {t}/nowhere", "argument PATH_OR_ID: expected a model folder, its config.json, or a Hub repo id like org/name, got '{t}/nowhere': no such folder or file"),
    cli("inspect {t}/a-folder", "argument PATH_OR_ID: expected a model folder, its config.json, or a Hub repo id like org/name, got '{t}/a-folder': the folder has no config.json"),
    cli("acceptance --target {t}/prompts.txt --draft {t}/model --prompts {t}/prompts.txt", "argument --target: expected a model folder (with config.json) or a Hub repo id like org/name, got '{t}/prompts.txt': a file, not a folder"),
    # numbers out of their range, or not numbers
    cli("demo --prompts -1", "argument --prompts: -1 is not in the range x>=1."),
    cli("demo --max-new-tokens -3", "argument --max-new-tokens: -3 is not in the range 1<=x<=10000000."),
    cli("demo --prompts 9999", "argument --prompts: expected at most 24 (the held-out prompts shipped), got 9999"),
    cli("serve-command --engine vllm --num-steps 100", "argument --num-steps: 100 is not in the range 1<=x<=64."),
    # a launch line is untrusted: its speculative settings typed as the engine types them
    cli(spec_pair('{"model": "D", "num_speculative_tokens": NaN}'), "argument --prefill-command: --speculative-config's num_speculative_tokens must be an integer in [1, 4096], got nan"),
    cli(spec_pair('{"model": "D", "num_speculative_tokens": 1e40}'), "argument --prefill-command: --speculative-config's num_speculative_tokens must be an integer in [1, 4096], got 1e+40"),
    cli(spec_pair('{"model": ["D"], "num_speculative_tokens": 3}'), "argument --prefill-command: --speculative-config's model must be a path or hub id, got ['D']"),
    cli("doctor --engine sglang --prefill-command 'sglang serve --model-path T --speculative-num-steps 1e9' --decode-command 'sglang serve --model-path T'", "argument --prefill-command: argument --speculative-num-steps: invalid count value: '1e9'"),
    cli("serve-command --engine vllm --tp x", "argument --tp: 'x' is not a valid integer range."),
    cli(f"acceptance {TARGET} --top-p 1.5", "argument --top-p: 1.5 is not in the range 0<x<=1."),
    cli(f"{TRAIN} --out {{t}}/out --lr nan", "argument --lr: 'nan' is not a finite number."),
    cli("demo --engine tf", "argument --engine: 'tf' is not one of 'hf', 'vllm'."),
    # the domain's own values
    cli("convert {t}/model {t}/dst --max-shard-size 10MiB", "argument --max-shard-size: expected a size like 10GB or 500MB (powers of ten) or a number of bytes, > 0, got '10MiB': cannot read a size from '10MiB' (e.g. 10GB, 500MB, 1000000)"),
    cli(f"{TRAIN} --out {{t}}/out --aux-layers 46,2", "argument --aux-layers: expected comma-separated one-based layer ids, ascending, each >= 1 (e.g. 2,46,90), got '46,2'"),
    cli("doctor --env 1X=2", "argument --env: expected NAME=VALUE with NAME an environment variable name, got '1X=2'"),
    cli("doctor --engine-version v1", "argument --engine-version: expected a release like 0.30 or 0.22.1, got 'v1'"),
    cli(f"acceptance {TARGET} --device gpu", "argument --device: expected auto, cpu, cuda, cuda:N, mps or xpu:N, got 'gpu'"),
    cli("capture --target {t}/model --text {t}/prompts.txt --out {t}/out --engine-args [1]", "argument --engine-args: expected a JSON object of vLLM engine arguments, e.g. '{\"tensor_parallel_size\": 8}', got '[1]': not a JSON object"),
    cli("acceptance --server ftp://x --engine vllm --prompts {t}/prompts.txt", "argument --server: expected an http:// or https:// URL of a running server, like http://127.0.0.1:8000, got 'ftp://x'"),
    cli(f"{SERVER} --reference {{t}}/a-file.txt", "argument --reference: expected an `eagle31-mla acceptance --json` report, got '{t}/a-file.txt': not JSON (Expecting value: line 1 column 1 (char 0))"),
    # options that go together, or exclude each other
    cli("convert {t}/model {t}/dst --prune-vocab 10", "--prune-vocab N and --token-counts FILE go together"),
    cli(f"{SERVER} --expect 2 --reference {{t}}/offline.json", "argument --reference: not allowed with argument --expect"),
    cli("capture --target {t}/model --out {t}/out", "one of the arguments --text --prompts --conversations is required"),
    cli(f"{TRAIN} --out {{t}}/out --init {{t}}/model --draft-config {{t}}/model", "argument --draft-config: not allowed with argument --init"),
    cli(f"acceptance {TARGET} --server http://127.0.0.1:9", "--target is for the offline measurement (the pair loaded here); --server measures what the server runs: drop --target"),
    cli(f"acceptance {TARGET} --expect 2.5", "--expect measures a running server: it needs --server URL (or drop --expect)"),
    cli(f"acceptance {TARGET} --topk 4", "tree drafting (topk 4) needs num_draft_tokens (root included), at most 37"),
    cli(f"acceptance {TARGET} --topk 1 --num-draft-tokens 9", "chain drafting verifies num_steps + 1 = 4 tokens, got num_draft_tokens 9"),
    cli(f"acceptance {TARGET} --revision v9", "argument --revision: expected a --target given as a Hub repo id (a revision names a Hub branch, tag or commit), got 'v9' with the local folder {t}/model; drop --revision"),
    cli("acceptance --target {t}/model --draft {t}/model --prompts {t}/blank.txt", "argument --prompts: expected at least one prompt, {t}/blank.txt has none"),
    cli(f"{TRAIN} --out {{t}}/out --seq-len 4 --depth 4", "argument --seq-len: expected more than --depth 4 tokens (each unroll step needs a next token to predict), got 4"),
    cli(f"{TRAIN} --out {{t}}/out --draft-config {{t}}/short-draft --seq-len 100", "argument --seq-len: expected sequences of at most 64 tokens (the drafter's max_position_embeddings, from --draft-config), got 100"),
    cli("train --target {t}/model --data {t}/no-such-capture --out {t}/out", "argument --data: Directory '{t}/no-such-capture' does not exist."),
    cli(f"{TRAIN} --out {{t}}/out --aux-layers 1,2,9", "argument --aux-layers: expected one-based ids <= 4 (the target's depth), got 1,2,9"),
    cli("train --target {t}/model --text {t}/blank.txt --out {t}/out", "argument --text: expected at least one non-empty document, {t}/blank.txt has none"),
    cli("serve-command --engine tokenspeed --topk 2 --num-draft-tokens 4", "TokenSpeed's --speculative-eagle-topk accepts only 1"),
    cli("serve-command --engine vllm --topk 2 --num-draft-tokens 6", "vLLM's EAGLE-3 drafts a chain: use --topk 1 (num_speculative_tokens = --num-steps)"),
    cli("serve-command --engine sglang --num-draft-tokens 7", "with topk 1 the draft is a chain: --num-draft-tokens must be --num-steps + 1 = 4"),
    cli("serve-command --engine sglang --topk 2 --num-steps 3 --num-draft-tokens 1000", "--num-draft-tokens is 1000; a tree of topk 2 over 3 steps holds 2 to 11 tokens (root included)"),
    cli("serve-command --engine vllm --connector nixl", "argument --connector: applies to --pd only"),
    cli("serve-command --engine sglang --tp 2 --cpu", "argument --cpu: vLLM's CPU build only, not sglang"),
    cli(f"acceptance {TARGET} --template x={{t}}/a-file.txt", "argument --template: applies to --sweep only"),
    cli(f"acceptance {TARGET} --sweep --expect 3", "argument --expect: not allowed with argument --sweep"),
    cli(f"acceptance {TARGET} --sweep --template raw={{t}}/a-file.txt", "argument --template: expected NAME=FILE: a name for the rendering and a Jinja chat template file, got 'raw={t}/a-file.txt': 'raw' names a built-in rendering; choose another name"),
    cli(f"acceptance {TARGET} --sweep --context-lengths 64,16", "argument --context-lengths: expected comma-separated token counts, ascending, each >= 1 (e.g. 1024,2048,4096), got '64,16'"),
    cli("acceptance --target {t}/model --draft {t}/draft --prompts {t}/prompts.txt --sweep --b-override norm_outptu=false", "argument --override/--b-override: norm_outptu is not a field of the drafter's config"),
    cli(f"{SERVER} --sweep", "--sweep --server needs --tokenizer: the target's folder or Hub id (the sweep renders and cuts the prompts here and sends token ids, so that every arm and the offline reference see the same tokens)"),
    cli("acceptance --target {t}/model --draft {t}/model --prompts hf:a:b:c", "argument --prompts: expected hf:NAME[:CONFIG][@SPLIT], got 'hf:a:b:c'"),
    cli("serve-command --engine vllm --pd --connector ascend", "--connector ascend is not one of vLLM's: nixl, mooncake, lmcache, example"),
    cli("serve-command --engine sglang --pd --connector example", "--connector example is not one of SGLang's: mooncake, nixl, ascend, mori"),
    cli("serve-command --engine vllm --pd --connector example", "--connector example: vLLM's Kimi-K3 is a hybrid model (KDA + MLA layers) and ExampleConnector cannot move a hybrid cache (no hybrid KV-cache manager): the server would not start; use nixl or mooncake"),
    cli("serve-command --engine tokenspeed --pd --topk 2 --num-draft-tokens 4", "TokenSpeed's --speculative-eagle-topk accepts only 1"),
    cli("doctor --draft {t}/draft --engine vllm", "doctor needs --target"),
    cli("doctor --target {t}/model --draft {t}/a-file.txt --engine vllm", "{t}/a-file.txt: not a readable JSON file (Expecting value: line 1 column 1 (char 0)); expected a config.json object"),
    cli("doctor --target {t}/model --draft {t}/draft --engine vllm --eagle3-layers-to-capture 2,46,90", "--eagle3-layers-to-capture is TokenSpeed's flag (use --engine tokenspeed)"),
    cli("doctor --draft {t}/model --target {t}/draft --engine vllm", "--draft {t}/model and --target {t}/draft look swapped: the target's config.json is an EAGLE drafter's and the draft's is not; expected --draft DRAFTER --target TARGET"),
    cli("doctor --engine vllm --prefill-command 'vllm serve T'", "a PD pair needs --decode-command"),
    cli(f"doctor {PAIR}", "a PD pair needs --engine"),
    cli(f"doctor --engine vllm --draft {{t}}/draft {PAIR}", "argument --draft: a PD pair takes it from --prefill-command and --decode-command"),
    cli(f"doctor --engine sglang {PAIR}", "argument --prefill-command: expected SGLang's launch command (sglang serve or -m sglang.launch_server ...), got 'vllm serve T'"),
    # an output that would overwrite an input: the same file (a hard link too), or around or inside it
    cli(f"acceptance {TARGET} --json {{t}}/prompts.txt", "argument --json: expected a path apart from the inputs: '{t}/prompts.txt' is the same file as --prompts '{t}/prompts.txt', which it would overwrite"),
    cli(f"acceptance {TARGET} --json {{t}}/hard-link.txt", "argument --json: expected a path apart from the inputs: '{t}/hard-link.txt' is the same file as --prompts '{t}/prompts.txt', which it would overwrite"),
    cli("convert {t}/model {t}/a-folder/../model/sub", "argument DST: expected a path apart from the inputs: '{t}/a-folder/../model/sub' is inside SRC '{t}/model', which it would overwrite"),
    cli("convert {t}/model {t}/model", "argument DST: expected a path apart from the inputs: '{t}/model' is the same file as SRC '{t}/model', which it would overwrite"),
    cli("convert {t}/model {t}/model/../.", "argument DST: expected a path apart from the inputs: '{t}/model/../.' contains SRC '{t}/model', which it would overwrite"),
    cli("convert {t}/model {t}/loop --force", "DST {t}/loop: cannot follow its links (a symlink loop)"),
    cli(f"{TRAIN} --out {{t}}", "argument --out: expected a path apart from the inputs: '{t}' contains --target '{t}/model', which it would overwrite"),
    # the command line itself
    cli("nope", "argument command: invalid choice: 'nope' (choose from 'demo', 'roster', 'acceptance', 'train', 'capture', 'inspect', 'convert', 'doctor', 'serve-command')"),
    cli("serve-command", "the following arguments are required: --engine"),
    cli("serve-command --engine vllm --nmu-steps 3", "unrecognized arguments: --nmu-steps (did you mean --num-steps?)"),
    cli("inspect " + LONG_NAME, f"argument PATH_OR_ID: expected a model folder, its config.json, or a Hub repo id like org/name, got '{LONG_NAME[:99]}...' (305 characters): File name too long"),
    cli(f"acceptance {TARGET} --sampling-backend flashinfer --device cpu", re.compile(r'argument --sampling-backend: the FlashInfer path cannot run: FlashInfer runs on CUDA only: no CUDA device here .*\. It needs a CUDA GPU, a CUDA build of torch and flashinfer-python>=0\.7\.2\.post1,<0\.8 \(pip install "eagle31-mla\[gpu\]"\); or keep the torch path .*')),
    cli(f"{SERVER} --sampling-backend torch", "--sampling-backend is for the offline measurement (the pair loaded here); --server measures what the server runs: drop --sampling-backend"),
]
# fmt: on


def long_cache(length: int):
    cache = cached()
    cache.latent = cache.latent.new_zeros(2, 4096, cache.latent.shape[-1])
    cache.length = length
    return cache


def expected_message(row: Row, tmp: Path) -> re.Pattern:
    if isinstance(row.message, str):
        return re.compile(re.escape(row.message).replace(re.escape("{t}"), re.escape(str(tmp))))
    return re.compile(row.message.pattern.replace("{t}", re.escape(str(tmp))), re.DOTALL)


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    """What the CLI rows name: a target-like model folder, a drafter's config, prompts, a hard link, a blank file,
    a file, an empty folder, a symlink loop, an offline report."""
    root = tmp_path_factory.mktemp("cli")
    (root / "model").mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 300}
    (root / "model" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    write_config(root / "draft", draft_config())  # an EAGLE drafter's config, for doctor
    write_config(root / "short-draft", draft_config(max_position_embeddings=64, rope_parameters=PLAIN_ROPE))
    (root / "prompts.txt").write_text("Once upon a time\n")
    (root / "hard-link.txt").hardlink_to(root / "prompts.txt")
    (root / "blank.txt").write_text("\n   \n\n")
    (root / "a-file.txt").write_text("x")
    (root / "a-folder").mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "offline.json").write_text(json.dumps({"settings": {}, "total": {"mean_accept_length": 2.5}}))
    return root


def files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("row", [r.param() for r in ROWS])
def test_bad_input(row: Row, tmp_path, request, capsys):
    if isinstance(row.call, str):  # a command line
        folder = request.getfixturevalue("cli_folder")
        before = files(folder)
        assert main(shlex.split(row.call.replace("{t}", str(folder)))) == row.error
        out, err = capsys.readouterr()
        assert not out and err.startswith("eagle31-mla: error: ") and err.count("\n") == 1, err
        assert expected_message(row, folder).fullmatch(err.removeprefix("eagle31-mla: error: ")[:-1]), err
        assert files(folder) == before and not (folder / "out").exists() and not (folder / "dst").exists()
        return
    outer, cause = row.error if isinstance(row.error, tuple) else (row.error, None)
    with pytest.raises(Exception) as caught:
        row.call(tmp_path)
    err = caught.value
    if cause is not None and type(err) is outer:  # strict's wrapper: the rule's own error is the cause
        assert type(err.__cause__) is cause and f"{cause.__name__}: {err.__cause__}" in str(err)
        err = err.__cause__
    assert type(err) is (cause or outer), f"raised {type(err).__name__}: {err}"
    assert expected_message(row, tmp_path).fullmatch(str(err)), f"message: {err}"


def test_the_table_ids_are_distinct_and_every_library_row_says_what_happens_instead():
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert all(r.status.startswith(f"{LIBRARY}: ") and len(r.status) > 20 for r in ROWS if r.status)


# ---- what is not a one-liner ----


def test_a_refused_step_leaves_the_cache_as_it_was():
    """The refusals come before any write: a rejected step (batch mismatch, bad state) changes no byte."""
    model, ids, _, out, _ = ctx()
    cache = cached()
    before = cache.latent.clone().view(torch.uint8)
    for kwargs in ({"input_ids": ids[:1, :1], "hidden_states": out.hidden_states[:1, -1:]},
                   {"input_ids": ids[:, :1], "hidden_states": torch.zeros(2, 1, 48)}):  # fmt: skip
        with pytest.raises(DraftInputError):
            model(past_key_values=cache, **kwargs)
    with pytest.raises(DraftInputError):
        model.draft(ids, ctx()[2], 0, past_key_values=cache)
    assert cache.length == 4 and torch.equal(cache.latent.view(torch.uint8), before)


def test_draft_reaches_exactly_the_last_position():
    """The position check is exact: the last allowed position drafts, one more is refused (table)."""
    assert draft(position_ids=torch.arange(4092, 4096).expand(2, 4), num_tokens=1).tokens.shape == (2, 1)
    assert draft(past_key_values=long_cache(4090), num_tokens=3).tokens.shape == (2, 3)


def test_an_unknown_hub_keyword_reaches_transformers(tmp_path, monkeypatch):
    """No allow-list: a keyword this library has never heard of is handed to Transformers' from_pretrained
    untouched (with the library's own defaults beside it); Transformers decides what it means."""
    from transformers import PreTrainedModel

    seen = {}
    real = PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        kwargs.pop("future_hub_option")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(spy))
    path = folder(tmp_path)
    loaded = Eagle31MLAForCausalLM.from_pretrained(path, future_hub_option={"x": 1}, revision="main", proxies=None)
    assert seen["future_hub_option"] == {"x": 1} and seen["revision"] == "main" and "proxies" in seen
    assert torch.equal(loaded.fc.weight, ctx()[0].fc.weight)
