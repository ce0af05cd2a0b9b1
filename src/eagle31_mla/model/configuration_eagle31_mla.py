"""Configuration of the EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

``Eagle31MLAConfig()`` with no arguments describes the published drafter: one DeepSeek-style MLA
decoder layer (hidden 7168, 64 heads, q_lora 1536, kv_lora 512 + rope 64) fed by three Kimi-K3 aux
states (one-based completed layers [2, 46, 90]), EAGLE-3.1's ``fc_norm`` and ``norm_output`` on, YaRN
RoPE (theta 50000, factor 32 over 32768 positions).

``Eagle31MLAConfig.kimi_k3()`` names the same drafter. Reading a ``config.json`` gives a missing key its
meaning in *files*, which differs from the constructor's defaults for four keys: see
:class:`Eagle31MLAConfig`.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import math
import os
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from .aux_layers import (
    KIMI_K3_AUX_LAYER_IDS,
    ONE_BASED,
    AuxLayerIdError,
    AuxLayerIds,
    aux_layer_ids_from_config,
    write_aux_layer_ids,
)

__all__ = ["Eagle31MLAConfig", "ConfigError"]

logger = logging.getLogger(__name__)

#: ``model_type`` values of configs that describe this drafter. The published checkpoint says
#: ``kimi_k2`` (the training framework's tag for the Kimi family); vLLM's CPU MLA path wants
#: ``deepseek_v2``; some exports say ``deepseek_v3``.
ACCEPTED_MODEL_TYPES = ("kimi_k2", "deepseek_v2", "deepseek_v3")

#: The architecture every engine serves this checkpoint family as (vLLM, SGLang's MLA-cache list,
#: TokenSpeed); written into every config.json this library saves.
ENGINE_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"

#: Kimi-K3's YaRN schedule, which the published drafter's 64-dim RoPE slice uses.
KIMI_K3_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 32768,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
SUPPORTED_ROPE_TYPES = ("default", "yarn")
DEFAULT_ROPE_THETA = 10000.0  # what Transformers assumes when a file names no theta

#: The remote-code files a checkpoint folder carries (``trust_remote_code=True`` loads them), in import
#: order; modeling/ is generated from these (:mod:`eagle31_mla.hub.remote_code`) and convert copies them.
REMOTE_CODE_FILES = (
    "aux_layers.py",
    "configuration_eagle31_mla.py",
    "checkpoint_eagle31_mla.py",
    "validation_eagle31_mla.py",
    "sampling_eagle31_mla.py",
    "modeling_eagle31_mla.py",
)

#: The ``auto_map`` every saved or converted config.json carries: which class of which remote-code file
#: each Auto class loads.
AUTO_MAP = {
    "AutoConfig": "configuration_eagle31_mla.Eagle31MLAConfig",
    "AutoModelForCausalLM": "modeling_eagle31_mla.Eagle31MLAForCausalLM",
}


def describe_rope(config: Any) -> str:
    """The rope schedule in words, e.g. ``yarn, theta 50000, factor 32 over 32768 positions`` or
    ``default, theta 10000``: the one wording inspect, roster and model cards print. ``config``: an
    :class:`Eagle31MLAConfig` or a config dict (its ``rope_parameters``)."""
    rope = (config.get("rope_parameters") if isinstance(config, dict) else config.rope_parameters) or {}
    text = f"{rope.get('rope_type', 'default')}, theta {rope.get('rope_theta', DEFAULT_ROPE_THETA):g}"
    if rope.get("rope_type") == "yarn":
        text += f", factor {rope['factor']:g} over {rope['original_max_position_embeddings']} positions"
    return text


class ConfigError(ValueError):
    """A drafter config that cannot describe a correct drafter; the message names the key."""


# ------------------------------------------------------------------------------------------------
# The settings a config.json may give, and what each must be
# ------------------------------------------------------------------------------------------------

#: The largest size, position or token id a config may give: what fits int32, the index dtype the
#: engines use for token ids and positions (int64 ids hold it too). Larger is never a real drafter.
MAX_INDEX = 2**31 - 1

#: How deeply a config.json may nest objects and lists (the published one nests 2 levels). Deeper
#: nesting is refused by name instead of exhausting Python's recursion limit in a JSON reader or copy.
MAX_CONFIG_DEPTH = 32

#: Bounds of the rope settings: a YaRN factor, mscale, attention factor or beta beyond 1e6 (Kimi-K3: 32, 1,
#: 32/1) or a theta beyond 1e12 (real models: 1e4 to 5e8) is never a real schedule; such values overflow
#: the frequency math (``Eagle31MLAConfig._check_rope_math`` catches what the bounds let through).
MAX_ROPE_NUMBER = 1e6
MAX_ROPE_THETA = 1e12
MIN_ROPE_NUMBER = 1e-6  # the least beta or attention factor (a smaller one underflows: no rotation, or no scale)

#: Domain name -> (test, the words saying what is expected).
DOMAINS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "size": (lambda v: 1 <= v <= MAX_INDEX, f">= 1 and <= {MAX_INDEX}"),
    "token_id": (lambda v: 0 <= v <= MAX_INDEX, f">= 0 and <= {MAX_INDEX}"),
    "positive": (lambda v: v > 0, "> 0"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "at_least_1": (lambda v: v >= 1, ">= 1"),
    "unit_open": (lambda v: 0 < v < 1, "> 0 and < 1"),
    # rope domains: bounded where a sane range is obvious (larger values overflow YaRN's math)
    "rope_theta": (lambda v: 1 < v <= MAX_ROPE_THETA, f"> 1 and <= {MAX_ROPE_THETA:g}"),
    "rope_positive": (
        lambda v: MIN_ROPE_NUMBER <= v <= MAX_ROPE_NUMBER,
        f">= {MIN_ROPE_NUMBER:g} and <= {MAX_ROPE_NUMBER:g}",
    ),
    "rope_non_negative": (lambda v: 0 <= v <= MAX_ROPE_NUMBER, f">= 0 and <= {MAX_ROPE_NUMBER:g}"),
    "rope_at_least_1": (lambda v: 1 <= v <= MAX_ROPE_NUMBER, f">= 1 and <= {MAX_ROPE_NUMBER:g}"),
    "": (lambda v: True, ""),
}

#: Floating-point dtypes a drafter can be built in, by every name accepted for them.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float": torch.float32,
    "half": torch.float16,
    "double": torch.float64,
}
_DTYPE_SPELLINGS = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "f32": "float32",
    "f16": "float16",
    "bfloat": "bfloat16",
    "float8": None,
    "int8": None,
}


@dataclass(frozen=True)
class ConfigField:
    """One setting of ``config.json`` and what it must be. ``name`` is the key; ``rope_parameters.<key>``
    names a key of the rope dict (``rope_scaling`` in the legacy form). ``kind``: int, float (finite),
    bool, str, dtype (a floating torch dtype), token_id (an int id), token_ids (an id or a list of ids).
    ``domain``: a key of :data:`DOMAINS`. ``optional``: absent or null is accepted (the default
    applies). ``rope_type``: a rope key needed by that rope type (checked wherever present).
    ``derived``: computed from other fields; a config may carry it, but only with the derived value."""

    name: str
    kind: str
    domain: str = ""
    optional: bool = False
    rope_type: str = ""
    hint: str = ""
    derived: bool = (
        False  # computed from other fields: a value given must agree with them (Eagle31MLAConfig._check_derived)
    )

    @property
    def key(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def nested(self) -> bool:
        """A key of the rope dict."""
        return self.name.startswith("rope_parameters.")

    @property
    def in_eagle_config(self) -> bool:
        """A key of the nested ``eagle_config`` dict."""
        return self.name.startswith("eagle_config.")

    def expected(self) -> str:
        """What a value must be, in words (the clause of every refusal)."""
        phrase = DOMAINS[self.domain][1]
        text = {
            "int": f"an int {phrase}",
            "float": f"a finite number {phrase}",
            "bool": "true or false",
            "str": "a string",
            "dtype": f"one of {_dtype_names()} (a floating-point torch dtype)",
            "token_id": f"an int {phrase}",
            "token_ids": f"an int {phrase} or a list of such ints",
        }[self.kind].strip()
        return text + (" or null" if self.optional and self.kind != "dtype" else "")

    def check(self, value: Any, shown_name: str | None = None) -> Any:
        """``value`` if it is right for this field (a dtype name resolved); else :class:`ConfigError`
        naming the field, the value given and what was expected."""
        name = shown_name or self.name
        if value is None and self.optional:
            return None
        if self.kind == "dtype" and value is not None:
            return resolve_dtype(value, name)
        if not self._fits(value):
            raise ConfigError(f"`{name}` must be {self.expected()}, got {_show(value)}{self.hint}")
        return value

    def _fits(self, value: Any) -> bool:
        test = DOMAINS[self.domain][0]
        if self.kind in ("int", "token_id"):
            return _is_int(value) and test(value)
        if self.kind == "token_ids":
            values = value if isinstance(value, (list, tuple)) and value else [value]
            return all(_is_int(v) and test(v) for v in values)
        if self.kind == "float":
            return _is_number(value) and _finite(value) and test(value)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is not an int


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)  # an int too large for a float raises OverflowError
    except OverflowError:
        return False


def _size(name: str, hint: str = "", optional: bool = False) -> ConfigField:
    return ConfigField(name, "int", "size", optional=optional, hint=hint)


#: Every setting the drafter reads from a config.json, checked at construction for type, finiteness and
#: domain (cross-field rules live in :meth:`Eagle31MLAConfig._check`). The tests generate their
#: malformed configs from this table, so a field added here is covered by them automatically.
CONFIG_FIELDS: tuple[ConfigField, ...] = (
    _size("vocab_size"),
    _size("draft_vocab_size", optional=True),
    _size("hidden_size"),
    _size("target_hidden_size", optional=True),
    _size("intermediate_size"),
    _size("num_hidden_layers"),
    _size("num_attention_heads"),
    _size("num_key_value_heads", optional=True),
    _size("q_lora_rank", hint=" (this drafter needs the low-rank q path, q_a_proj/q_b_proj)"),
    _size("kv_lora_rank"),
    _size("qk_nope_head_dim"),
    _size("qk_rope_head_dim"),
    _size("v_head_dim"),
    _size("max_position_embeddings"),
    _size("target_num_hidden_layers", optional=True),
    _size("num_aux_hidden_states", optional=True),
    ConfigField("qk_head_dim", "int", "size", optional=True, derived=True),  # = qk_nope + qk_rope
    ConfigField(
        "head_dim", "int", "size", optional=True, derived=True
    ),  # = qk_rope (Transformers' form) or qk_nope + qk_rope
    ConfigField("rms_norm_eps", "float", "unit_open"),
    ConfigField("initializer_range", "float", "non_negative"),
    ConfigField("hidden_act", "str"),
    ConfigField("fc_norm", "bool"),
    ConfigField("norm_output", "bool"),
    ConfigField("norm_before_residual", "bool"),
    ConfigField("tie_word_embeddings", "bool"),
    ConfigField("use_cache", "bool"),
    ConfigField("mla_use_nope", "bool", optional=True),
    ConfigField("bos_token_id", "token_id", "token_id", optional=True),
    ConfigField("eos_token_id", "token_ids", "token_id", optional=True),
    ConfigField("pad_token_id", "token_id", "token_id", optional=True),
    ConfigField("dtype", "dtype", optional=True),
    ConfigField("torch_dtype", "dtype", optional=True),
    ConfigField("rope_theta", "float", "rope_theta", optional=True),  # legacy form: beside rope_scaling
    ConfigField("rope_parameters.rope_theta", "float", "rope_theta", optional=True),
    ConfigField("rope_parameters.factor", "float", "rope_at_least_1", rope_type="yarn"),
    ConfigField("rope_parameters.original_max_position_embeddings", "int", "size", rope_type="yarn"),
    ConfigField("rope_parameters.beta_fast", "float", "rope_positive", optional=True, rope_type="yarn"),
    ConfigField("rope_parameters.beta_slow", "float", "rope_positive", optional=True, rope_type="yarn"),
    ConfigField("rope_parameters.mscale", "float", "rope_non_negative", optional=True, rope_type="yarn"),
    ConfigField("rope_parameters.mscale_all_dim", "float", "rope_non_negative", optional=True, rope_type="yarn"),
    ConfigField("rope_parameters.attention_factor", "float", "rope_positive", optional=True, rope_type="yarn"),
    ConfigField("rope_parameters.truncate", "bool", optional=True, rope_type="yarn"),
    # keys of the nested eagle_config dict (its aux-layer ids are read by aux_layers' own rule)
    ConfigField(
        "eagle_config.use_aux_hidden_state",
        "bool",
        optional=True,
        hint=" (this drafter's `fc` takes the concatenated aux states: true, or leave it out)",
    ),
)
TOP_LEVEL_FIELDS = tuple(f for f in CONFIG_FIELDS if "." not in f.name)
ROPE_FIELDS = tuple(f for f in CONFIG_FIELDS if f.nested)
EAGLE_CONFIG_FIELDS = tuple(f for f in CONFIG_FIELDS if f.in_eagle_config)

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel, _SHOW.maxlong = 60, 60, 3, 60


def _show(value: Any) -> str:
    """A short repr, safe for any value a JSON file can hold (huge, deep or long)."""
    return _SHOW.repr(value)


def _dtype_names(allow_auto: bool = False) -> str:
    return ", ".join(repr(n) for n in FLOAT_DTYPES) + (", 'auto'" if allow_auto else "")


def resolve_dtype(value: Any, field: str = "dtype", *, allow_auto: bool = False) -> torch.dtype | None:
    """The floating-point ``torch.dtype`` that ``value`` names (a ``torch.dtype``, or a name such as
    ``"bfloat16"``, ``"float32"``, ``"half"``, ``"torch.float16"``); ``None`` for ``None`` and, with
    ``allow_auto``, for ``"auto"`` (meaning: the config's or checkpoint's own dtype).

    Anything else -- an integer or bool dtype (``int32``), an unknown or misspelt name (``fp16``,
    ``fp32``), a non-string -- raises :class:`ConfigError` naming ``field`` (``"torch_dtype"``,
    ``"--dtype"``, ...) and listing the accepted names. One helper for the config's ``dtype`` /
    ``torch_dtype``, ``from_pretrained(dtype=..., torch_dtype=...)`` and the CLI's ``--dtype``."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if value in FLOAT_DTYPES.values():
            return value
        why = " (not a floating-point dtype)" if not value.is_floating_point else " (not supported for a drafter)"
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if allow_auto and name == "auto":
            return None
        if name in FLOAT_DTYPES:
            return FLOAT_DTYPES[name]
        if isinstance(getattr(torch, name, None), torch.dtype):
            dtype = getattr(torch, name)
            why = " (not a floating-point dtype)" if not dtype.is_floating_point else " (not supported for a drafter)"
        elif _DTYPE_SPELLINGS.get(name):
            why = f" (write {_DTYPE_SPELLINGS[name]!r})"
        else:
            why = " (not a torch dtype name)"
    else:
        why = ""
    raise ConfigError(
        f"`{field}` must be one of {_dtype_names(allow_auto)} (a floating-point torch dtype), got {_show(value)}{why}"
    )


def check_config_dict(data: Any, where: str = "config.json") -> dict:
    """``data`` if it can be a config (a JSON object nested at most :data:`MAX_CONFIG_DEPTH` levels);
    else :class:`ConfigError`. Walks iteratively: no recursion, whatever the depth."""
    if data is None:
        raise ConfigError(f"{where} holds null; expected a JSON object (a dict of settings)")
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object (a dict of settings), got {type(data).__name__}")
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"{where} nests objects/lists more than {MAX_CONFIG_DEPTH} levels deep (at `{path[:200]}`); "
                f"expected at most {MAX_CONFIG_DEPTH} levels (a config nests 2)"
            )
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
    return data


class DuplicateKeyError(Exception):
    """A JSON object names one key twice (Python's reader would keep the last value without a word).
    Not a ValueError on purpose: a JSON reader's own errors are ValueErrors."""

    def __init__(self, key: str, first: Any, second: Any):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second

    def describe(self) -> str:
        return (
            f"gives key {self.key[:100]!r} twice in one object (first {_show(self.first)}, then "
            f"{_show(self.second)}); expected each key once (a JSON reader keeps the last one silently)"
        )


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, out[key], value)
        out[key] = value
    return out


def loads_json(text: str) -> Any:
    """``json.loads`` refusing duplicate keys (:class:`DuplicateKeyError`); every JSON file the loader
    reads (config.json, the weight index) goes through it."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys)


def not_a_regular_file(path: Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file (``"a folder"``, ``"a FIFO (named pipe)"``,
    ``"a symlink to /dev/zero, which is a character device"``); None for a regular file or nothing. Never opens it:
    a FIFO would block the reader, a device would never end."""
    import stat

    try:
        mode = path.stat().st_mode  # follows symlinks; stat never blocks, not even on a FIFO
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = (
        "a folder"
        if stat.S_ISDIR(mode)
        else "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    if path.is_symlink():
        return f"a symlink to {os.path.realpath(path)}, which is {kind}"
    return kind


def read_config_file(path: str | os.PathLike) -> dict:
    """The settings in a ``config.json``, or :class:`ConfigError` saying what is wrong with the file:
    a dangling symlink, not UTF-8, not JSON, ``null`` or not an object, nested too deeply (Python's JSON
    reader raises ``RecursionError`` from about 1,000 levels), or a number too long to read."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"{path} is a symlink to {os.readlink(path)}, which does not resolve (a dangling link: an interrupted "
            "download or a moved cache?); expected the drafter's config.json"
        )
    kind = not_a_regular_file(path)
    if kind:
        raise ConfigError(f"{path} is {kind}; expected a regular file (the drafter's config.json)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not readable ({err}); expected a UTF-8 JSON file") from None
    try:
        data = loads_json(text)
    except DuplicateKeyError as err:
        raise ConfigError(f"{path} {err.describe()}") from None
    except RecursionError:
        raise ConfigError(
            f"{path} nests objects/lists too deeply to read; expected at most {MAX_CONFIG_DEPTH} "
            "levels (a config nests 2)"
        ) from None
    except ValueError as err:  # JSONDecodeError, and a number of more than 4300 digits
        raise ConfigError(f"{path} is not valid JSON ({err}); expected a JSON object of settings") from None
    return check_config_dict(data, str(path))


def rope_frequencies(config: Eagle31MLAConfig, device=None) -> tuple[torch.Tensor, float]:
    """The RoPE inverse frequencies [R/2] and attention scaling of ``config``'s rope slice: YaRN through
    Transformers' own rope init (``ROPE_INIT_FUNCTIONS["yarn"]``), plain RoPE by the usual formula. The one
    computation the model uses, and the one the config checks at construction."""
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, device)
        return inv_freq, float(scaling)
    dim = config.qk_rope_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (rope["rope_theta"] ** exponents), 1.0


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


#: Keys of rope types this drafter does not support, by type: named when one turns up in a dict of another type.
_OTHER_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor", "short_mscale", "long_mscale"),
    "llama3": ("low_freq_factor", "high_freq_factor"),
}


def _foreign_rope_key(source: str, key: Any, rope_type: str, given: dict) -> str:
    """The refusal of rope key ``key`` that has no meaning for ``rope_type`` (a plain rope with a
    ``factor`` is a contradiction: the scaling would be dropped without a word)."""
    named = "rope_type" in given or "type" in given
    type_key = "type" if source == "rope_scaling" else "rope_type"
    yarn_keys = {f.key for f in ROPE_FIELDS if f.rope_type == "yarn"}
    allowed = sorted({"rope_theta"} | {f.key for f in ROPE_FIELDS if f.rope_type == rope_type})
    what = f"{rope_type} rope" + ("" if named else f" (the dict names no `{type_key}`)")
    if rope_type != "yarn" and key in yarn_keys:
        return (
            f"`{source}.{key}` is a yarn setting, but the rope dict is {what}, which has no `{key}`: "
            f"set `{type_key}: yarn` to use it (the published drafter's rope), or remove `{key}`"
        )
    others = [t for t, keys in _OTHER_ROPE_KEYS.items() if key in keys]
    belongs = f" (a setting of {'/'.join(others)} rope, which this drafter does not support)" if others else ""
    return (
        f"`{source}.{str(key)[:80]}` is not a setting of {what}{belongs}; expected only "
        f"{', '.join(f'`{k}`' for k in allowed)} besides `{type_key}`"
    )


def _normalise_rope(
    rope_parameters: dict | None, rope_scaling: dict | None, rope_theta: float | None
) -> dict[str, Any]:
    """One rope dict in Transformers-5 form, from either the v5 ``rope_parameters`` or the legacy
    ``rope_scaling`` + ``rope_theta`` pair; every key of :data:`ROPE_FIELDS` checked."""
    if rope_parameters is not None and rope_scaling is not None:
        raise ConfigError("config has both `rope_parameters` and `rope_scaling`; keep one (they may disagree)")
    given = rope_parameters if rope_parameters is not None else rope_scaling
    source = "rope_parameters" if rope_parameters is not None else "rope_scaling"
    if rope_theta is not None:
        rope_theta = float(rope_theta)  # checked with the top-level fields
    if given is None:
        return dict(KIMI_K3_ROPE_PARAMETERS, **({"rope_theta": rope_theta} if rope_theta else {}))
    if not isinstance(given, dict):
        raise ConfigError(f"`rope_scaling`/`rope_parameters`: expected a dict, got {_show(given)}")
    params = dict(given)
    if params.get("rope_type") and params.get("type") and params["rope_type"] != params["type"]:
        raise ConfigError(
            f"rope settings name two types: `rope_type` {_show(params['rope_type'])} and `type` "
            f"{_show(params['type'])}; keep one"
        )
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "deepseek_yarn":  # vLLM's name for the same schedule
        rope_type = "yarn"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"`{source}.type` / `rope_parameters.rope_type` is {_show(rope_type)}; this drafter supports "
            f"{SUPPORTED_ROPE_TYPES} (the published Kimi-K3 drafter uses yarn)"
        )
    allowed = {"rope_theta"} | {f.key for f in ROPE_FIELDS if f.rope_type == rope_type}
    for key in params:
        if key not in allowed:
            raise ConfigError(_foreign_rope_key(source, key, rope_type, given))
    for field in ROPE_FIELDS:
        if field.key in params:
            field.check(params[field.key], f"{source}.{field.key}")
        elif field.rope_type == rope_type and not field.optional:
            raise ConfigError(
                f"`{source}.{field.key}` must be {field.expected()} ({rope_type} rope needs it), got nothing"
            )
    theta = params.get("rope_theta", rope_theta)
    if theta is not None and rope_theta is not None and float(theta) != rope_theta:
        raise ConfigError(
            f"config has top-level `rope_theta` {rope_theta:g} but its rope dict says `rope_theta` {theta}; "
            "they must agree (keep one)"
        )
    params["rope_theta"] = float(theta if theta is not None else DEFAULT_ROPE_THETA)
    if rope_type == "yarn" and params.get("beta_fast") is not None and params.get("beta_slow") is not None:
        if not params["beta_fast"] > params["beta_slow"]:
            raise ConfigError(
                f"`{source}.beta_fast` ({params['beta_fast']}) must be greater than `{source}.beta_slow` "
                f"({params['beta_slow']}): YaRN ramps from the fast to the slow rotation count"
            )
    return {"rope_type": rope_type, **params}


class Eagle31MLAConfig(PretrainedConfig):
    r"""The drafter's settings. Two readings of a missing key, on purpose:

    * the constructor, ``Eagle31MLAConfig(**settings)``: a missing key takes the published Kimi-K3 drafter's
      value (``Eagle31MLAConfig()`` is that drafter, as is :meth:`kimi_k3`);
    * a ``config.json`` -- ``from_pretrained``, ``from_dict``, ``from_json_file`` (all three agree) -- gives a
      missing key its meaning in *files*, which differs for four keys: absent ``fc_norm`` / ``norm_output``
      mean EAGLE-3 (off), absent ``rope_scaling`` / ``rope_parameters`` mean plain RoPE, absent aux-layer
      ids are an error (see :mod:`aux_layers`). Another framework's EAGLE-3 file omits them meaning exactly that.

    So ``Eagle31MLAConfig(**json.load(f))`` reads a file that omits those keys as Kimi-K3's drafter; read files
    with ``Eagle31MLAConfig.from_json_file(path)`` (or ``from_dict``). A file that writes the four keys out,
    as every file this library saves does, reads the same both ways.

    Args:
        vocab_size: rows of ``embed_tokens`` = the target's vocabulary (Kimi-K3: 163840).
        draft_vocab_size: rows of ``lm_head``; smaller than ``vocab_size`` for a pruned vocabulary, which
            then needs ``d2t`` (draft id -> target id offset) and ``t2d`` in the checkpoint.
        hidden_size: the drafter's width H.
        target_hidden_size: width Ht of each captured target state (``fc`` takes n·Ht).
        intermediate_size: SwiGLU width of the one MLP.
        num_hidden_layers: must be 1 (one EAGLE layer).
        num_attention_heads / num_key_value_heads: MLA heads (equal).
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims.
        hidden_act: MLP activation (silu).
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest supported position.
        rope_parameters: Transformers-5 rope dict; ``rope_scaling`` + ``rope_theta`` are read too.
        fc_norm: EAGLE-3.1 — RMSNorm each captured state (own weight) before ``fc``.
        norm_output: EAGLE-3.1 — feed ``norm(h)`` (not ``h``) to the next draft step.
        norm_before_residual: the residual around attention is ``hidden_norm(h)`` instead of ``h``.
        eagle_aux_hidden_state_layer_ids / eagle_config / aux_layer_ids_convention: which target layers
            feed the drafter, read by the rule in :mod:`eagle31_mla.model.aux_layers`; written back one-based
            and labelled.
        target_num_hidden_layers: the target's depth, when known; aux ids beyond it are refused.
    """

    model_type = "kimi_k2"

    vocab_size: int = 163840
    draft_vocab_size: int | None = None
    hidden_size: int = 7168
    target_hidden_size: int | None = None
    intermediate_size: int = 18432
    num_hidden_layers: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    rope_parameters: dict | None = None
    fc_norm: bool = True
    norm_output: bool = True
    norm_before_residual: bool = False
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    eagle_config: dict | None = None
    aux_layer_ids_convention: str | None = None
    target_num_hidden_layers: int | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        self._check_fields(kwargs)
        model_type = kwargs.pop("model_type", None)
        if model_type is not None and model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(
                f"`model_type` is {model_type!r}; an EAGLE-3(.1) MLA drafter config says one of {ACCEPTED_MODEL_TYPES}"
            )
        if kwargs.pop("mla_use_nope", None):
            logger.info(
                "config sets `mla_use_nope: true`; ignored on purpose: this drafter applies RoPE to the "
                "rope slice, as its training code and every serving engine do"
            )
        rope_scaling = kwargs.pop("rope_scaling", None)
        rope_defaulted = self.rope_parameters is None and rope_scaling is None
        self.rope_parameters = _normalise_rope(self.rope_parameters, rope_scaling, kwargs.pop("rope_theta", None))
        self._set_aux_layer_ids(kwargs)
        num_aux = kwargs.pop("num_aux_hidden_states", None)
        if num_aux is not None and num_aux != len(self.aux_layer_ids):
            raise ConfigError(
                f"`num_aux_hidden_states` is {num_aux} but the config names {len(self.aux_layer_ids)} aux "
                f"layers ({self.aux_layer_ids.describe()}); it must equal the number of aux layers (or be left out)"
            )
        derived = {key: kwargs.pop(key, None) for key in ("qk_head_dim", "head_dim")}
        super().__post_init__(**kwargs)
        if self.dtype is None:
            self.dtype = torch.bfloat16  # the published checkpoint's dtype
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        # Derived once. `head_dim` is the rotary width, which Transformers' rope helpers read.
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.head_dim = self.qk_rope_head_dim
        self._check_derived(derived)
        self._check(rope_defaulted)

    @classmethod
    def kimi_k3(cls, **overrides) -> Eagle31MLAConfig:
        """The published drafter, `lightseekorg/kimi-k3-eagle3.1-mla` (the no-argument config), with the keys a
        file reads differently written out, so it means the same however it is passed on. ``overrides``
        change single settings (e.g. ``target_num_hidden_layers``)."""
        published = {
            "fc_norm": True,
            "norm_output": True,
            "rope_parameters": dict(KIMI_K3_ROPE_PARAMETERS),
            "eagle_aux_hidden_state_layer_ids": list(KIMI_K3_AUX_LAYER_IDS.one_based),
        }
        return cls(**{**published, **overrides})

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> Eagle31MLAConfig:
        """A ``config.json`` read as :meth:`from_dict` reads it (Transformers' own ``from_json_file`` calls the
        constructor, which would give missing keys Kimi-K3's values instead of their meaning in files)."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> Eagle31MLAConfig:
        """Read a ``config.json`` dict: absent keys take their meaning in files (see module docstring)."""
        config_dict = dict(check_config_dict(config_dict))
        config_dict.setdefault("fc_norm", False)
        config_dict.setdefault("norm_output", False)
        if config_dict.get("eagle_config") is None:
            config_dict["eagle_config"] = {}  # a file must name its aux layers: no Kimi-K3 default
        if config_dict.get("rope_parameters") is None and config_dict.get("rope_scaling") is None:
            # absent and null mean the same in a file: plain RoPE (never the constructor's Kimi-K3 YaRN)
            config_dict.pop("rope_scaling", None)
            config_dict["rope_parameters"] = {"rope_type": "default"}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike) -> dict:
        """Transformers' reader of config.json, refusing by name what it would crash on (null, deep
        nesting, a dangling link) instead of a TypeError or RecursionError."""
        return cls._decode_special_floats(read_config_file(json_file))

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form: engine-facing architecture name, derived sizes left out."""
        output = super().to_dict()
        output["architectures"] = [ENGINE_ARCHITECTURE]
        for derived in ("qk_head_dim", "head_dim"):
            output.pop(derived, None)
        if output.get("target_num_hidden_layers") is None:
            output.pop("target_num_hidden_layers", None)
        return output

    # -- aux layers -------------------------------------------------------------------------------

    def _set_aux_layer_ids(self, kwargs: dict) -> None:
        if self.eagle_config is not None and not isinstance(self.eagle_config, dict):
            raise ConfigError(
                f'`eagle_config` must be a dict (e.g. {{"eagle_aux_hidden_state_layer_ids": [2, 46, 90]}}), got '
                f"{self.eagle_config!r}"
            )
        eagle_config = dict(self.eagle_config or {})
        for field in EAGLE_CONFIG_FIELDS:  # type-checked like top-level fields (a bool must be a JSON bool)
            if field.key in eagle_config:
                field.check(eagle_config[field.key])
        if eagle_config.get("use_aux_hidden_state") is False:
            raise ConfigError(
                "`eagle_config.use_aux_hidden_state` is false (EAGLE-1 style: last hidden state only); this "
                "drafter's `fc` takes the concatenated aux states"
            )
        if self.eagle_aux_hidden_state_layer_ids is None and self.eagle_config is None:
            ids = AuxLayerIds(
                KIMI_K3_AUX_LAYER_IDS.one_based, self.target_num_hidden_layers
            )  # the no-arg config: Kimi-K3's
        else:
            raw = {
                "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
                "eagle_config": eagle_config,
                "aux_layer_ids_convention": self.aux_layer_ids_convention,
                "target_layer_ids": kwargs.get("target_layer_ids"),
            }
            raw = {k: v for k, v in raw.items() if v is not None}
            try:
                ids, how = aux_layer_ids_from_config(raw, self.target_num_hidden_layers)
            except AuxLayerIdError as err:
                raise ConfigError(str(err)) from None
            logger.info("aux layers: %s -> %s", how, ids.describe())
        if max(ids.one_based) > MAX_INDEX:
            raise ConfigError(
                f"aux-layer ids {_show(list(ids.one_based))}: every id must be <= {MAX_INDEX} (a target layer), got "
                f"{_show(max(ids.one_based))}"
            )
        write_aux_layer_ids(self, ids)

    @property
    def aux_layer_ids(self) -> AuxLayerIds:
        """The canonical aux-layer ids (one-based completed layers), whichever labelled form an engine plugin
        wrote back (the TokenSpeed plugin writes a DeepSeek target's zero-based form)."""
        return AuxLayerIds.from_convention(
            tuple(self.eagle_aux_hidden_state_layer_ids),
            self.aux_layer_ids_convention or ONE_BASED,
            self.target_num_hidden_layers,
        )

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.eagle_aux_hidden_state_layer_ids)

    # -- derived numbers ----------------------------------------------------------------------------

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(nope + rope), times mscale² under YaRN (DeepSeek's long-context correction)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_parameters
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
            scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        return scale

    @property
    def is_eagle31(self) -> bool:
        return bool(self.fc_norm and self.norm_output)

    @property
    def kv_cache_values_per_token(self) -> int:
        """What the latent cache stores per token: normalised c_kv plus the rotated shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # -- validation ---------------------------------------------------------------------------------

    def _check_fields(self, kwargs: dict) -> None:
        """Every setting of :data:`CONFIG_FIELDS` given here (as a field or a legacy keyword), checked for
        type, finiteness and domain before anything reads it; dtype names resolved; nesting bounded."""
        own = _field_names(type(self))
        check_config_dict({**{name: getattr(self, name, None) for name in own}, **kwargs}, "config")
        for field in TOP_LEVEL_FIELDS:
            if field.name in kwargs:
                kwargs[field.name] = field.check(kwargs[field.name])
            elif field.name in own:
                checked = field.check(getattr(self, field.name, None))
                if field.kind == "dtype":
                    self.dtype = checked
        legacy = kwargs.get("torch_dtype")
        if self.dtype is not None and legacy is not None and legacy != self.dtype:
            raise ConfigError(
                f"config gives two dtypes: `dtype` {str(self.dtype).removeprefix('torch.')!r} and `torch_dtype` "
                f"{str(legacy).removeprefix('torch.')!r}; they must agree (keep one: `dtype`, the Transformers-5 name)"
            )

    def _check_token_ids(self) -> None:
        """Every special token id must be a row of the vocabulary: in [0, vocab_size). Kimi-K3's ids, the
        constructor's defaults, are dropped (with a note) when not given and beyond a smaller vocabulary."""
        given = _GIVEN_KEYS.get()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name, None)
            values = value if isinstance(value, (list, tuple)) else [value]
            beyond = [v for v in values if v is not None and not 0 <= v < self.vocab_size]
            if not beyond:
                continue
            if given is not None and name not in given and value == getattr(type(self), name, None):
                logger.info(
                    "%s: Kimi-K3's default %s is beyond vocab_size %s; left unset", name, value, self.vocab_size
                )
                setattr(self, name, None)
                continue
            raise ConfigError(
                f"`{name}` is {_show(value)}: id {beyond[0]} is beyond the vocabulary; expected every special token "
                f"id in [0, {self.vocab_size}) (`vocab_size` is {self.vocab_size})"
            )

    def _check_derived(self, given: dict) -> None:
        """``qk_head_dim`` / ``head_dim`` are derived from the MLA dims; a config may carry them (Transformers'
        DeepSeek configs write both), but a value that contradicts the dims is refused, never overwritten."""
        qk = given.get("qk_head_dim")
        if qk is not None and qk != self.qk_head_dim:
            raise ConfigError(
                f"`qk_head_dim` is {qk}, but `qk_nope_head_dim` + `qk_rope_head_dim` = {self.qk_nope_head_dim} + "
                f"{self.qk_rope_head_dim} = {self.qk_head_dim}; expected {self.qk_head_dim} (it is "
                "derived: or leave it out)"
            )
        head = given.get("head_dim")
        accepted = (self.qk_rope_head_dim, self.qk_head_dim)  # Transformers' DeepSeek form; q/k's full head width
        if head is not None and head not in accepted:
            raise ConfigError(
                f"`head_dim` is {head}, which contradicts the MLA dims; expected `qk_rope_head_dim` "
                f"({self.qk_rope_head_dim}, as Transformers' DeepSeek configs write it) or `qk_nope_head_dim` + "
                f"`qk_rope_head_dim` ({self.qk_head_dim}); it is derived: or leave it out"
            )

    def _check(self, rope_defaulted: bool = False) -> None:
        """Rules across fields (each field's own type and domain: :meth:`_check_fields`)."""
        if self.num_hidden_layers != 1:
            raise ConfigError(f"`num_hidden_layers` is {self.num_hidden_layers}; this drafter has exactly 1 layer")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must equal `num_attention_heads` "
                f"({self.num_attention_heads}) for MLA"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"`qk_rope_head_dim` must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"`draft_vocab_size` ({self.draft_vocab_size}) exceeds `vocab_size` ({self.vocab_size}); it must be "
                "<= vocab_size (the draft vocabulary is a subset of the target's)"
            )
        if self.tie_word_embeddings:
            raise ConfigError(
                "`tie_word_embeddings: true` is not supported: expected false (the drafter has its own `lm_head`)"
            )
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ConfigError(
                f"`hidden_act` {_show(self.hidden_act)} is not a known activation; expected one of Transformers' "
                "ACT2FN names (the published drafter: 'silu')"
            )
        if self.rope_parameters["rope_type"] == "yarn":
            original = self.rope_parameters["original_max_position_embeddings"]
            if original > self.max_position_embeddings:
                whose = (
                    " (the constructor's default rope, Kimi-K3's YaRN, as no rope settings were given: pass "
                    "`rope_parameters`, e.g. {'rope_type': 'default'}, or a larger max_position_embeddings)"
                )
                raise ConfigError(
                    f"yarn `original_max_position_embeddings` ({original}) exceeds `max_position_embeddings` "
                    f"({self.max_position_embeddings}); it must be <= max_position_embeddings"
                    + (whose if rope_defaulted else "")
                )
        self._check_token_ids()
        self._check_rope_math()

    def _check_rope_math(self) -> None:
        """Every number the model derives from the rope settings -- the inverse frequencies and attention
        scaling (through the model's own rope init), ``softmax_scale`` and YaRN's mscale -- computed once
        here: values that pass each field's own domain yet break the math together (a theta near 1, a
        beta or mscale whose logarithm overflows) are refused by name, never met as NaN logits or a raw
        error in the first forward."""
        rope = self.rope_parameters
        problem = None
        try:
            inv_freq, scaling = rope_frequencies(self)
            softmax_scale = self.softmax_scale
            mscale = _yarn_mscale(rope["factor"], rope.get("mscale") or 1.0) if rope["rope_type"] == "yarn" else 1.0
            if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
                problem = f"its inverse frequencies are not all finite and > 0 (got {_show(inv_freq.tolist())})"
            elif not (_finite(scaling) and scaling > 0):
                problem = f"its attention scaling is {scaling!r}"
            elif not (_finite(softmax_scale) and softmax_scale > 0):
                problem = f"its softmax scale is {softmax_scale!r}"
            elif not (_finite(mscale) and mscale > 0):
                problem = f"its YaRN mscale is {mscale!r}"
        except Exception as err:  # ZeroDivisionError, OverflowError, math domain error, ... inside the rope math
            problem = f"computing its frequencies failed ({type(err).__name__}: {str(err)[:200]})"
        if problem:
            settings = ", ".join(f"`{k}` {_show(v)}" for k, v in rope.items())
            raise ConfigError(
                f"the rope settings ({settings}) do not give a usable RoPE: {problem}; expected rope settings whose "
                "inverse frequencies, attention scaling and softmax scale are finite and > 0 (e.g. Kimi-K3's: yarn, "
                "rope_theta 50000, factor 32, beta_fast 32 > beta_slow 1, mscale 1, mscale_all_dim 1)"
            )


#: The keyword names the constructor was called with (from_dict passes a file's keys), so that a default
#: the caller never wrote is told apart from a value given. None outside a constructor call.
_GIVEN_KEYS: contextvars.ContextVar[frozenset | None] = contextvars.ContextVar("eagle31_mla_given_keys", default=None)


def _recording_given_keys(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        token = _GIVEN_KEYS.set(frozenset(kwargs))
        try:
            init(self, *args, **kwargs)
        finally:
            _GIVEN_KEYS.reset(token)

    return __init__


Eagle31MLAConfig.__init__ = _recording_given_keys(Eagle31MLAConfig.__init__)


def _field_names(cls: type) -> frozenset[str]:
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls))


__all__ += ["rope_frequencies", "EAGLE_CONFIG_FIELDS", "MAX_ROPE_NUMBER", "MAX_ROPE_THETA", "MIN_ROPE_NUMBER"]
__all__ += ["REMOTE_CODE_FILES", "AUTO_MAP", "describe_rope", "ENGINE_ARCHITECTURE"]
__all__ += [
    "ACCEPTED_MODEL_TYPES",
    "KIMI_K3_ROPE_PARAMETERS",
    "CONFIG_FIELDS",
    "ConfigField",
    "resolve_dtype",
    "read_config_file",
    "check_config_dict",
    "loads_json",
    "DuplicateKeyError",
    "not_a_regular_file",
    "MAX_INDEX",
    "MAX_CONFIG_DEPTH",
    "FLOAT_DTYPES",
]
