"""Configuration of the EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

``Eagle31MLAConfig()`` with no arguments describes the published drafter: one DeepSeek-style MLA
decoder layer (hidden 7168, 64 heads, q_lora 1536, kv_lora 512 + rope 64) fed by three Kimi-K3 aux
states (one-based completed layers [2, 46, 90]), EAGLE-3.1's ``fc_norm`` and ``norm_output`` on, YaRN
RoPE (theta 50000, factor 32 over 32768 positions).

``Eagle31MLAConfig.kimi_k3()`` names the same drafter. Reading a ``config.json`` gives a missing key its
meaning in *files*, which differs from the constructor's defaults for four keys: see
:class:`Eagle31MLAConfig`.

Like every Transformers-5 config it is a ``@strict`` dataclass: ``huggingface_hub`` checks each field's type (a
string "6" is not an int, a bool is not an int), :func:`setting` adds the domain a type cannot say, the ``validate_*``
methods the rules across fields. Every refusal is a :class:`ConfigError` naming the key and what was expected. (No
``from __future__ import annotations``: strict checks only annotations that are types, not strings.)
"""

import contextvars
import functools
import json
import logging
import math
import os
import reprlib
import stat
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, get_args

import torch
from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
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


# JSON files (config.json, a weight index) and paths, read without surprises: a key given twice is refused, a path
# that is not a regular file is never opened, a config nested too deeply is refused by name (a ConfigError).

#: How deeply a config.json may nest objects and lists (the published one nests 2 levels). Deeper
#: nesting is refused by name instead of exhausting Python's recursion limit in a JSON reader or copy.
MAX_CONFIG_DEPTH = 32

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel, _SHOW.maxlong = 60, 60, 3, 60


def short_repr(value) -> str:
    """A short repr, safe for any value a JSON file can hold (huge, deep or long): how messages show a value."""
    return _SHOW.repr(value)


class DuplicateKeyError(Exception):
    """A JSON object names one key twice (Python's reader would keep the last value without a word).
    Not a ValueError on purpose: a JSON reader's own errors are ValueErrors."""

    def __init__(self, key: str, first, second):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second

    def describe(self) -> str:
        return (
            f"gives key {self.key[:100]!r} twice in one object (first {short_repr(self.first)}, then "
            f"{short_repr(self.second)}); expected each key once (a JSON reader keeps the last one silently)"
        )


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, out[key], value)
        out[key] = value
    return out


def loads_json(text: str):
    """``json.loads`` refusing duplicate keys (:class:`DuplicateKeyError`); every JSON file the loader
    reads (config.json, the weight index) goes through it."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys)


def not_a_regular_file(path: Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file (``"a folder"``, ``"a FIFO (named pipe)"``,
    ``"a symlink to /dev/zero, which is a character device"``); None for a regular file or nothing. Never opens it:
    a FIFO would block the reader, a device would never end."""
    try:
        mode = path.stat().st_mode  # follows symlinks; stat never blocks, not even on a FIFO
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    kind = next((words for test, words in kinds if test(mode)), "not a regular file")
    if path.is_symlink():
        return f"a symlink to {os.path.realpath(path)}, which is {kind}"
    return kind


def check_config_dict(data, where: str = "config.json") -> dict:
    """``data`` if it can be a config (a JSON object nested at most :data:`MAX_CONFIG_DEPTH` levels);
    else :class:`ConfigError`. Walks iteratively: no recursion, whatever the depth."""
    if data is None:
        raise ConfigError(f"{where} holds null; expected a JSON object (a dict of settings)")
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object (a dict of settings), got {type(data).__name__}")
    stack: list[tuple[object, str, int]] = [(data, "", 1)]
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


_show = short_repr


# ---- What a value may be beyond its type, and the dtype names ----

#: The largest size, position or token id a config may give: what fits int32, the index dtype the
#: engines use for token ids and positions (int64 ids hold it too). Larger is never a real drafter.
MAX_INDEX = 2**31 - 1

#: Bounds of the rope settings: a YaRN factor, mscale, attention factor or beta beyond 1e6 (Kimi-K3: 32, 1,
#: 32/1) or a theta beyond 1e12 (real models: 1e4 to 5e8) is never a real schedule; such values overflow
#: the frequency math (``Eagle31MLAConfig.validate_rope`` catches what the bounds let through).
MAX_ROPE_NUMBER = 1e6
MAX_ROPE_THETA = 1e12
MIN_ROPE_NUMBER = 1e-6  # the least beta or attention factor (a smaller one underflows: no rotation, or no scale)

#: Domain name -> (test, the words saying what is expected): the range of a number that its type cannot say.
DOMAINS: dict[str, tuple[Any, str]] = {
    "size": (lambda v: 1 <= v <= MAX_INDEX, f">= 1 and <= {MAX_INDEX}"),
    "token_id": (lambda v: 0 <= v <= MAX_INDEX, f">= 0 and <= {MAX_INDEX}"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
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
FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_DTYPES.update(float64=torch.float64, float=torch.float32, half=torch.float16, double=torch.float64)
#: Names people write for a dtype, and the name to write instead (None: no drafter dtype).
_DTYPE_SPELLINGS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64", "f32": "float32"}
_DTYPE_SPELLINGS.update(f16="float16", bfloat="bfloat16", float8=None, int8=None)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)  # an int too large for a float raises OverflowError
    except OverflowError:
        return False


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


# ---- Settings: strict checks a field's type; its domain and the refusal's words are added here ----


def setting(default: Any = None, domain: str = "", *, hint: str = "", rope_type: str = "", derived: bool = False):
    """A field whose type strict checks and whose numbers must then be finite (strict lets NaN and inf
    through) and in ``domain`` (a key of :data:`DOMAINS`). ``hint``: words added to a refusal; ``rope_type``: a
    rope key only that rope type has (needed there unless null is allowed); ``derived``: computed from other
    settings, so a value given must agree with them."""
    test, words = DOMAINS[domain]

    def in_domain(value: Any) -> None:
        numbers = [v for v in (value if isinstance(value, list) else [value]) if _is_number(v)]
        if value == [] or not all(_finite(v) and test(v) for v in numbers):
            raise ValueError(f"expected {words}")

    metadata = {"domain": domain, "hint": hint, "rope_type": rope_type, "derived": derived}
    return validated_field(in_domain, default=default, metadata=metadata)


def dtype_setting(name: str):
    """A dtype field: a floating-point ``torch.dtype`` or one of its names (resolved in ``__post_init__``)."""
    expected = f"one of {_dtype_names()} (a floating-point torch dtype)"
    return validated_field(functools.partial(resolve_dtype, field=name), default=None, metadata={"expected": expected})


#: The words for a value of each type, in this order (a float field takes an int too).
_TYPE_WORDS = {float: "a finite number", int: "an int", bool: "true or false", str: "a string", dict: "a dict"}


def expected(setting_field: Field) -> str:
    """What a value of ``setting_field`` must be, in words: its type, domain and nullability (the clause of
    every refusal)."""
    if "expected" in setting_field.metadata:
        return setting_field.metadata["expected"]
    types = set(get_args(setting_field.type)) or {setting_field.type}
    words = DOMAINS[setting_field.metadata.get("domain", "")][1]
    if list[int] in types:
        text = f"an int {words} or a list of such ints" if int in types else "a list of ints"
    else:
        kind = next((kind for t, kind in _TYPE_WORDS.items() if t in types), None)
        if kind is None:  # a field of Transformers' own (checked by strict on 5.12, whose annotations are types)
            return f"a value of type {setting_field.type}"
        text = f"{kind} {words}" if kind in ("a finite number", "an int") else kind
    return text.strip() + (" or null" if type(None) in types else "")


def _refusal(owner: type, name: str, value: Any, err: Exception, shown: str = "") -> ConfigError:
    """Strict's refusal (``err``) of ``value`` for field ``name`` of ``owner``, in this library's words."""
    if isinstance(err.__cause__, ConfigError):  # a validator that words its own refusal (a dtype name)
        return ConfigError(str(err.__cause__))
    setting_field = next(f for f in fields(owner) if f.name == name)
    hint = setting_field.metadata.get("hint", "")
    return ConfigError(f"`{shown or name}` must be {expected(setting_field)}, got {_show(value)}{hint}")


def check_settings(keys: type, values: dict, prefix: str = "") -> None:
    """Each of ``values`` that names a field of the strict dataclass ``keys``, checked as that field (type,
    then domain): a :class:`ConfigError` naming ``prefix + name`` for the first that does not fit."""
    names = {f.name for f in fields(keys)}
    for name, value in values.items():
        if name in names:
            try:
                keys(**{name: value})
            except StrictDataclassFieldValidationError as err:
                raise _refusal(keys, name, value, err, prefix + name) from None


#: The keyword arguments the constructor was called with (from_dict passes a file's keys), so that a default
#: the caller never wrote is told apart from a value given. None outside a constructor call.
_GIVEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("eagle31_mla_given", default=None)


def _refusing_by_name(cls: type) -> type:
    """Strict's errors -- a field's, on every assignment (the constructor's too), and a ``validate_*`` method's --
    raised as :class:`ConfigError`; the constructor records its arguments in :data:`_GIVEN`."""
    strict_setattr, strict_validate, init = cls.__setattr__, cls.validate, cls.__init__

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as err:
            raise _refusal(type(self), name, value, err) from None

    @functools.wraps(strict_validate)
    def validate(self) -> None:
        try:
            strict_validate(self)
        except StrictDataclassClassValidationError as err:
            raise ConfigError(str(err.__cause__)) from None

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        token = _GIVEN.set(kwargs)
        try:
            init(self, *args, **kwargs)
        finally:
            _GIVEN.reset(token)

    cls.__setattr__, cls.validate, cls.__init__ = __setattr__, validate, __init__
    return cls


# ---- The keys of the nested dicts, and the keys a config reads but does not keep ----


@strict
@dataclass
class RopeKeys:
    """The keys of a rope dict besides its type (``rope_parameters.rope_type``, or ``type`` in the legacy
    ``rope_scaling``). A key with a ``rope_type`` belongs to that type only, and is needed there unless it may be
    null. Defaults: Kimi-K3's YaRN, the published drafter's (a dict without ``rope_theta`` gets 10000)."""

    rope_theta: float | int | None = setting(50000.0, "rope_theta")
    factor: float | int = setting(32.0, "rope_at_least_1", rope_type="yarn")
    original_max_position_embeddings: int = setting(32768, "size", rope_type="yarn")
    beta_fast: float | int | None = setting(32.0, "rope_positive", rope_type="yarn")
    beta_slow: float | int | None = setting(1.0, "rope_positive", rope_type="yarn")
    mscale: float | int | None = setting(1.0, "rope_non_negative", rope_type="yarn")
    mscale_all_dim: float | int | None = setting(1.0, "rope_non_negative", rope_type="yarn")
    attention_factor: float | int | None = setting(None, "rope_positive", rope_type="yarn")
    truncate: bool | None = setting(None, rope_type="yarn")


#: Kimi-K3's YaRN schedule, which the published drafter's 64-dim RoPE slice uses: the defaults of :class:`RopeKeys`.
KIMI_K3_ROPE_PARAMETERS = {"rope_type": "yarn"} | {f.name: f.default for f in fields(RopeKeys) if f.default is not None}


@strict
@dataclass
class EagleConfigKeys:
    """The keys of the nested ``eagle_config`` dict checked here (its aux-layer ids: :mod:`aux_layers`' rule)."""

    use_aux_hidden_state: bool | None = setting(
        None, hint=" (this drafter's `fc` takes the concatenated aux states: true, or leave it out)"
    )


@strict
@dataclass
class ExtraKeys:
    """Keys a config may give besides :class:`Eagle31MLAConfig`'s fields: read once by its ``__post_init__``,
    checked like fields, not kept. (The legacy rope dict ``rope_scaling`` is read with :class:`RopeKeys`.)"""

    rope_theta: float | int | None = setting(None, "rope_theta")  # the legacy rope form, beside `rope_scaling`
    torch_dtype: str | torch.dtype | None = dtype_setting("torch_dtype")  # the legacy name of `dtype`
    mla_use_nope: bool | None = None  # ignored on purpose (logged): this drafter applies RoPE, as every engine does
    num_aux_hidden_states: int | None = setting(None, "size")  # must equal the number of aux layers
    qk_head_dim: int | None = setting(None, "size", derived=True)  # = qk_nope_head_dim + qk_rope_head_dim
    head_dim: int | None = setting(None, "size", derived=True)  # = qk_rope_head_dim (Transformers' form) or qk_head_dim


# ---- RoPE ----


def rope_frequencies(config: "Eagle31MLAConfig", device=None) -> tuple[torch.Tensor, float]:
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


def _rope_keys(rope_type: str) -> dict[str, Field]:
    """The fields of :class:`RopeKeys` a rope dict of ``rope_type`` may hold, by key."""
    return {f.name: f for f in fields(RopeKeys) if f.metadata["rope_type"] in ("", rope_type)}


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
    what = f"{rope_type} rope" + ("" if named else f" (the dict names no `{type_key}`)")
    if rope_type != "yarn" and key in _rope_keys("yarn"):
        return (
            f"`{source}.{key}` is a yarn setting, but the rope dict is {what}, which has no `{key}`: "
            f"set `{type_key}: yarn` to use it (the published drafter's rope), or remove `{key}`"
        )
    others = [t for t, keys in _OTHER_ROPE_KEYS.items() if key in keys]
    belongs = f" (a setting of {'/'.join(others)} rope, which this drafter does not support)" if others else ""
    return (
        f"`{source}.{str(key)[:80]}` is not a setting of {what}{belongs}; expected only "
        f"{', '.join(f'`{k}`' for k in sorted(_rope_keys(rope_type)))} besides `{type_key}`"
    )


def _normalise_rope(rope_parameters: dict | None, rope_scaling: Any, rope_theta: float | None) -> dict[str, Any]:
    """One rope dict in Transformers-5 form, from either the v5 ``rope_parameters`` or the legacy
    ``rope_scaling`` + ``rope_theta`` pair, holding only keys of its rope type, each checked as its
    :class:`RopeKeys` field. Transformers' ``convert_rope_params_to_dict`` / ``standardize_rope_params`` merge the
    two forms too, but silently: they prefer ``rope_scaling`` when both are given and the dict's theta when two
    disagree, keep keys of other rope types, give YaRN a missing window (``max_position_embeddings``), and its
    ``validate_rope`` only logs warnings (a factor < 1, beta order, unknown keys) and checks no value's range."""
    if rope_parameters is not None and rope_scaling is not None:
        raise ConfigError("config has both `rope_parameters` and `rope_scaling`; keep one (they may disagree)")
    given = rope_parameters if rope_parameters is not None else rope_scaling
    source = "rope_parameters" if rope_parameters is not None else "rope_scaling"
    if given is None:
        return dict(KIMI_K3_ROPE_PARAMETERS, **({"rope_theta": float(rope_theta)} if rope_theta else {}))
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
    keys = _rope_keys(rope_type)
    for key in params:
        if key not in keys:
            raise ConfigError(_foreign_rope_key(source, key, rope_type, given))
    check_settings(RopeKeys, params, f"{source}.")
    for key, key_field in keys.items():
        if key not in params and key_field.metadata["rope_type"] and type(None) not in get_args(key_field.type):
            raise ConfigError(
                f"`{source}.{key}` must be {expected(key_field)} ({rope_type} rope needs it), got nothing"
            )
    theta = params.get("rope_theta", rope_theta)
    if theta is not None and rope_theta is not None and float(theta) != float(rope_theta):
        raise ConfigError(
            f"config has top-level `rope_theta` {float(rope_theta):g} but its rope dict says `rope_theta` {theta}; "
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


# ---- The config ----

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@_refusing_by_name
@strict
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

    Args (defaults: the published drafter; strict checks the types, :func:`setting` the ranges):
        vocab_size: rows of ``embed_tokens`` = the target's vocabulary (Kimi-K3: 163840).
        draft_vocab_size: rows of ``lm_head`` (default ``vocab_size``); smaller for a pruned vocabulary, which
            then needs ``d2t`` (draft id -> target id offset) and ``t2d`` in the checkpoint.
        hidden_size / target_hidden_size: the drafter's width H; each captured target state's Ht (``fc`` takes n·Ht).
        intermediate_size: SwiGLU width of the one MLP; ``hidden_act`` its activation (an ``ACT2FN`` name).
        num_hidden_layers: must be 1 (one EAGLE layer).
        num_attention_heads / num_key_value_heads: MLA heads (equal).
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (even), v_head_dim: MLA dims.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest supported position.
        rope_parameters: Transformers-5 rope dict (its keys: :class:`RopeKeys`); ``rope_scaling`` + ``rope_theta``
            are read too.
        fc_norm: EAGLE-3.1 -- RMSNorm each captured state (own weight) before ``fc``.
        norm_output: EAGLE-3.1 -- feed ``norm(h)`` (not ``h``) to the next draft step.
        norm_before_residual: the residual around attention is ``hidden_norm(h)`` instead of ``h``.
        eagle_aux_hidden_state_layer_ids / eagle_config / aux_layer_ids_convention: which target layers feed the
            drafter, read by the rule in :mod:`eagle31_mla.model.aux_layers`; written back one-based and labelled.
            ``eagle_config``'s other keys: :class:`EagleConfigKeys`.
        target_num_hidden_layers: the target's depth, when known; aux ids beyond it are refused.
        initializer_range, use_cache: as in every Transformers config; ``tie_word_embeddings`` must be false.
        bos_token_id / eos_token_id / pad_token_id: ids inside the vocabulary (eos: an id or a list of ids).
        dtype: the weights' floating-point dtype (``torch_dtype`` is read too).

    Keys a config may give besides these (legacy names, derived sizes, an ignored flag): :class:`ExtraKeys`.
    """

    model_type = "kimi_k2"
    extra_keys: ClassVar[type] = ExtraKeys

    vocab_size: int = setting(163840, "size")
    draft_vocab_size: int | None = setting(None, "size")
    hidden_size: int = setting(7168, "size")
    target_hidden_size: int | None = setting(None, "size")
    intermediate_size: int = setting(18432, "size")
    num_hidden_layers: int = setting(1, "size")
    num_attention_heads: int = setting(64, "size")
    num_key_value_heads: int | None = setting(None, "size")
    q_lora_rank: int = setting(1536, "size", hint=" (this drafter needs the low-rank q path, q_a_proj/q_b_proj)")
    kv_lora_rank: int = setting(512, "size")
    qk_nope_head_dim: int = setting(128, "size")
    qk_rope_head_dim: int = setting(64, "size")
    v_head_dim: int = setting(128, "size")
    hidden_act: str = "silu"
    rms_norm_eps: float | int = setting(1e-5, "unit_open")
    max_position_embeddings: int = setting(1048576, "size")
    rope_parameters: dict | None = field(default=None, metadata={"keys": RopeKeys})
    fc_norm: bool = True
    norm_output: bool = True
    norm_before_residual: bool = False
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    eagle_config: dict | None = field(
        default=None,
        metadata={"keys": EagleConfigKeys, "hint": ' (e.g. {"eagle_aux_hidden_state_layer_ids": [2, 46, 90]})'},
    )
    aux_layer_ids_convention: str | None = None
    target_num_hidden_layers: int | None = setting(None, "size")
    initializer_range: float | int = setting(0.02, "non_negative")
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = setting(163584, "token_id")
    eos_token_id: int | list[int] | None = setting(163586, "token_id")
    pad_token_id: int | None = setting(0, "token_id")
    dtype: str | torch.dtype | None = dtype_setting("dtype")

    def __post_init__(self, **kwargs):
        check_config_dict({**{f.name: getattr(self, f.name) for f in fields(self)}, **kwargs}, "config")
        check_settings(ExtraKeys, kwargs)
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
        dtype, torch_dtype = resolve_dtype(self.dtype), resolve_dtype(kwargs.pop("torch_dtype", None))
        if dtype is not None and torch_dtype is not None and torch_dtype != dtype:
            raise ConfigError(
                f"config gives two dtypes: `dtype` {str(dtype).removeprefix('torch.')!r} and `torch_dtype` "
                f"{str(torch_dtype).removeprefix('torch.')!r}; they must agree (keep one: `dtype`, the Transformers-5 "
                "name)"
            )
        self.dtype = next((d for d in (dtype, torch_dtype) if d is not None), torch.bfloat16)  # the published one
        self.rope_parameters = _normalise_rope(
            self.rope_parameters, kwargs.pop("rope_scaling", None), kwargs.pop("rope_theta", None)
        )
        self._set_aux_layer_ids(kwargs.get("target_layer_ids"))
        num_aux = kwargs.pop("num_aux_hidden_states", None)
        if num_aux is not None and num_aux != len(self.aux_layer_ids):
            raise ConfigError(
                f"`num_aux_hidden_states` is {num_aux} but the config names {len(self.aux_layer_ids)} aux "
                f"layers ({self.aux_layer_ids.describe()}); it must equal the number of aux layers (or be left out)"
            )
        derived = {key: kwargs.pop(key, None) for key in ("qk_head_dim", "head_dim")}
        super().__post_init__(**kwargs)
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
        given = _GIVEN.get()
        for name in _TOKEN_IDS:  # Kimi-K3's ids are defaults nobody wrote: dropped beyond a smaller vocabulary
            if given is not None and name not in given and self._beyond_vocabulary(name):
                value = getattr(self, name)
                logger.info(
                    "%s: Kimi-K3's default %s is beyond vocab_size %s; left unset", name, value, self.vocab_size
                )
                setattr(self, name, None)

    @classmethod
    def kimi_k3(cls, **overrides) -> "Eagle31MLAConfig":
        """The published drafter, `lightseekorg/kimi-k3-eagle3.1-mla` (the no-argument config), with the keys a
        file reads differently written out, so it means the same however it is passed on. ``overrides``
        change single settings (e.g. ``target_num_hidden_layers``)."""
        ids = list(KIMI_K3_AUX_LAYER_IDS.one_based)
        published = dict(fc_norm=True, norm_output=True, rope_parameters=dict(KIMI_K3_ROPE_PARAMETERS))
        return cls(**{**published, "eagle_aux_hidden_state_layer_ids": ids, **overrides})

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> "Eagle31MLAConfig":
        """A ``config.json`` read as :meth:`from_dict` reads it (Transformers' own ``from_json_file`` calls the
        constructor, which would give missing keys Kimi-K3's values instead of their meaning in files)."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "Eagle31MLAConfig":
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

    def _set_aux_layer_ids(self, target_layer_ids: Any) -> None:
        eagle_config = dict(self.eagle_config or {})
        check_settings(EagleConfigKeys, eagle_config, "eagle_config.")
        if eagle_config.get("use_aux_hidden_state") is False:
            raise ConfigError(
                "`eagle_config.use_aux_hidden_state` is false (EAGLE-1 style: last hidden state only); this "
                "drafter's `fc` takes the concatenated aux states"
            )
        if self.eagle_aux_hidden_state_layer_ids is None and self.eagle_config is None:
            ids = AuxLayerIds(KIMI_K3_AUX_LAYER_IDS.one_based, self.target_num_hidden_layers)  # no-arg config: K3's
        else:
            raw = dict(
                eagle_aux_hidden_state_layer_ids=self.eagle_aux_hidden_state_layer_ids,
                eagle_config=eagle_config,
                aux_layer_ids_convention=self.aux_layer_ids_convention,
                target_layer_ids=target_layer_ids,
            )
            try:
                ids, how = aux_layer_ids_from_config(
                    {k: v for k, v in raw.items() if v is not None}, self.target_num_hidden_layers
                )
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

    # -- rules across fields: derived sizes (in __post_init__), then the validate_* methods strict runs after it ----

    def _beyond_vocabulary(self, name: str) -> list[int]:
        ids = getattr(self, name) if isinstance(getattr(self, name), list) else [getattr(self, name)]
        return [i for i in ids if i is not None and not 0 <= i < self.vocab_size]

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
        if head is not None and head not in (self.qk_rope_head_dim, self.qk_head_dim):
            raise ConfigError(
                f"`head_dim` is {head}, which contradicts the MLA dims; expected `qk_rope_head_dim` "
                f"({self.qk_rope_head_dim}, as Transformers' DeepSeek configs write it) or `qk_nope_head_dim` + "
                f"`qk_rope_head_dim` ({self.qk_head_dim}); it is derived: or leave it out"
            )

    def validate_architecture(self) -> None:
        """The one-layer MLA drafter's shape (Transformers' own check is about widths this config has not)."""
        if self.num_hidden_layers != 1:
            raise ConfigError(f"`num_hidden_layers` is {self.num_hidden_layers}; this drafter has exactly 1 layer")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must equal `num_attention_heads` "
                f"({self.num_attention_heads}) for MLA"
            )
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

    def validate_token_ids(self) -> None:
        """Every special token id is a row of the vocabulary, in [0, vocab_size): refused where Transformers'
        own check only logs a warning."""
        for name in _TOKEN_IDS:
            beyond = self._beyond_vocabulary(name)
            if beyond:
                raise ConfigError(
                    f"`{name}` is {_show(getattr(self, name))}: id {beyond[0]} is beyond the vocabulary; expected "
                    f"every special token id in [0, {self.vocab_size}) (`vocab_size` is {self.vocab_size})"
                )

    def validate_rope(self) -> None:
        """The rope slice and every number the model derives from the rope settings -- the inverse frequencies
        and attention scaling (through the model's own rope init), ``softmax_scale`` and YaRN's mscale -- computed
        once: values that pass each key's own domain yet break the math together (a theta near 1, a beta or
        mscale whose logarithm overflows) are refused by name, never met as NaN logits or a raw error in the
        first forward. (Transformers' own ``validate_rope`` only logs warnings, and checks no number.)"""
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"`qk_rope_head_dim` must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        rope = self.rope_parameters
        if rope["rope_type"] == "yarn" and rope["original_max_position_embeddings"] > self.max_position_embeddings:
            given = _GIVEN.get()
            defaulted = given is not None and given.get("rope_parameters") is None and given.get("rope_scaling") is None
            raise ConfigError(
                f"yarn `original_max_position_embeddings` ({rope['original_max_position_embeddings']}) exceeds "
                f"`max_position_embeddings` ({self.max_position_embeddings}); it must be <= max_position_embeddings"
                + (
                    " (the constructor's default rope, Kimi-K3's YaRN, as no rope settings were given: pass "
                    "`rope_parameters`, e.g. {'rope_type': 'default'}, or a larger max_position_embeddings)"
                    if defaulted
                    else ""
                )
            )
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


__all__ += ["rope_frequencies", "MAX_ROPE_NUMBER", "MAX_ROPE_THETA", "MIN_ROPE_NUMBER", "DOMAINS"]
__all__ += ["REMOTE_CODE_FILES", "AUTO_MAP", "describe_rope", "ENGINE_ARCHITECTURE"]
__all__ += ["RopeKeys", "EagleConfigKeys", "ExtraKeys", "setting", "dtype_setting", "expected", "check_settings"]
__all__ += [
    "ACCEPTED_MODEL_TYPES",
    "KIMI_K3_ROPE_PARAMETERS",
    "resolve_dtype",
    "read_config_file",
    "check_config_dict",
    "MAX_INDEX",
    "MAX_CONFIG_DEPTH",
    "FLOAT_DTYPES",
    "DuplicateKeyError",
    "loads_json",
    "not_a_regular_file",
    "short_repr",
]
