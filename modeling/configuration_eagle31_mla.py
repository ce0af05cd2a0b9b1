# Generated from src/eagle31_mla/model/configuration_eagle31_mla.py by scripts/sync_modeling.py: do not edit.
# Remote code for `trust_remote_code=True`; needs only torch and transformers.
"""Configuration of the EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

``Eagle31MLAConfig()`` with no arguments describes the published drafter: one MLA layer (hidden 7168, 64 heads,
q_lora 1536, kv_lora 512 + rope 64) fed by Kimi-K3's layers [2, 46, 90], EAGLE-3.1, YaRN RoPE.

A ``@strict`` Transformers-5 config; written here is only what huggingface_hub and Transformers lack: the domain
of a few numbers, the aux-layer id rule (:mod:`aux_layers`), what a *file* leaving a key out means, a usable rope.
"""

import logging
import math
from typing import Any

import torch
from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .aux_layers import (
    KIMI_K3_AUX_LAYER_IDS,
    ONE_BASED,
    AuxLayerIdError,
    AuxLayerIds,
    aux_layer_ids_from_attributes,
    write_aux_layer_ids,
)

logger = logging.getLogger(__name__)

#: ``model_type`` values of configs that describe this drafter: the published checkpoint says ``kimi_k2`` (the
#: training framework's tag for the Kimi family); vLLM's CPU MLA path wants ``deepseek_v2``; some exports say v3.
ACCEPTED_MODEL_TYPES = ("kimi_k2", "deepseek_v2", "deepseek_v3")

#: The architecture every engine serves this checkpoint family as (vLLM, SGLang's MLA-cache list, TokenSpeed).
ENGINE_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"

#: The remote-code files a checkpoint folder carries (``trust_remote_code=True`` loads them), in import order.
REMOTE_CODE_FILES = ("aux_layers.py", "configuration_eagle31_mla.py", "modeling_eagle31_mla.py")
AUTO_MAP = {
    "AutoConfig": "configuration_eagle31_mla.Eagle31MLAConfig",
    "AutoModelForCausalLM": "modeling_eagle31_mla.Eagle31MLAForCausalLM",
}

#: The largest size or token id a config may give: what fits int32, the engines' index dtype.
MAX_INDEX = 2**31 - 1

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
_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "yarn": set(KIMI_K3_ROPE_PARAMETERS) | {"attention_factor", "truncate"},
}
_SIZES = ("vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "intermediate_size")
_SIZES += ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
_SIZES += ("v_head_dim", "max_position_embeddings", "target_num_hidden_layers")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_KIMI_K3_TOKEN_IDS = {"bos_token_id": 163584, "eos_token_id": 163586}


class ConfigError(ValueError):
    """A drafter config that cannot describe a correct drafter; the message names the key."""


def resolve_dtype(value: Any, name: str = "dtype") -> torch.dtype | None:
    """The floating-point dtype ``value`` names (None for None or "auto"): one rule for the config and the CLI."""
    if value is None or value == "auto":
        return None
    dtype = value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise ConfigError(f"`{name}` is {value!r}; expected a floating-point torch dtype such as 'bfloat16'")
    return dtype


def describe_rope(config: Any) -> str:
    """The rope schedule of a config or config dict in words, as inspect, roster and model cards print it."""
    rope = (config.get("rope_parameters") if isinstance(config, dict) else config.rope_parameters) or {}
    text = f"{rope.get('rope_type', 'default')}, theta {rope.get('rope_theta', 10000.0):g}"
    if rope.get("rope_type") == "yarn":
        text += f", factor {rope['factor']:g} over {rope['original_max_position_embeddings']} positions"
    return text


def rope_frequencies(config: "Eagle31MLAConfig", device=None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [R/2] and attention scaling of the rope slice (YaRN by Transformers' rope init)."""
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, device)
        return inv_freq, float(scaling)
    exponents = torch.arange(0, config.qk_rope_head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (rope["rope_theta"] ** (exponents / config.qk_rope_head_dim)), 1.0


@strict
class Eagle31MLAConfig(PretrainedConfig):
    r"""The drafter's settings. Two readings of a missing key, on purpose:

    * the constructor: a missing key takes the published drafter's value;
    * a ``config.json`` (``from_pretrained``, ``from_dict``, ``from_json_file``): absent ``fc_norm`` /
      ``norm_output`` mean EAGLE-3 (off), absent rope settings plain RoPE, absent aux-layer ids an error, as another
      framework's EAGLE-3 file means them. Every file this library saves writes them out: it reads the same both ways.

    ``draft_vocab_size`` < ``vocab_size``: a pruned vocabulary (``d2t``/``t2d``); ``target_hidden_size``: each
    captured state's width; ``target_num_hidden_layers`` bounds the aux ids. ``mla_use_nope`` is ignored, as every
    engine ignores it.
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
    q_lora_rank: int = 1536
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
        model_type = kwargs.pop("model_type", None)
        if model_type is not None and model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(f"`model_type` is {model_type!r}; expected one of {ACCEPTED_MODEL_TYPES}")
        kwargs.pop("mla_use_nope", None)
        for derived in ("qk_head_dim", "head_dim", "num_aux_hidden_states"):
            kwargs.pop(derived, None)  # written by other exports; recomputed below
        if self.rope_parameters is not None and kwargs.get("rope_scaling") is not None:
            raise ConfigError(
                "config gives both `rope_parameters` and `rope_scaling`; expected one (they may disagree)"
            )
        theta, nested = kwargs.get("rope_theta"), (self.rope_parameters or kwargs.get("rope_scaling"))
        if theta is not None and isinstance(nested, dict) and nested.get("rope_theta") not in (None, theta):
            raise ConfigError(f"`rope_theta` {theta} disagrees with the rope dict's {nested['rope_theta']}; keep one")
        if self.rope_parameters is None and kwargs.get("rope_scaling") is None:
            self.rope_parameters = dict(KIMI_K3_ROPE_PARAMETERS)
            if kwargs.get("rope_theta") is not None:
                self.rope_parameters["rope_theta"] = kwargs.pop("rope_theta")
        torch_dtype = kwargs.pop("torch_dtype", None)  # the legacy name
        self.dtype = resolve_dtype(self.dtype if self.dtype is not None else torch_dtype) or torch.bfloat16
        super().__post_init__(**kwargs)  # Transformers: rope_scaling + rope_theta -> rope_parameters
        rope = self.rope_parameters
        rope.pop("type", None)  # the legacy name of `rope_type`, which Transformers copied
        if rope.get("rope_type") == "deepseek_yarn":  # vLLM's name for the same schedule
            rope["rope_type"] = "yarn"
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.head_dim = self.qk_rope_head_dim  # the rotary width, which Transformers' rope helpers read
        for name, value in _KIMI_K3_TOKEN_IDS.items():  # K3's ids are dropped beyond a smaller vocabulary
            if getattr(self, name) == value and value >= self.vocab_size:
                setattr(self, name, None)
        self._set_aux_layer_ids()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "Eagle31MLAConfig":
        """Read a ``config.json`` dict: absent keys take their meaning in files (see the class docstring)."""
        if not isinstance(config_dict, dict):
            raise ConfigError(f"config.json holds a {type(config_dict).__name__}; expected a JSON object")
        config_dict = {"fc_norm": False, "norm_output": False, **config_dict}
        config_dict["eagle_config"] = config_dict.get("eagle_config") or {}  # a file must name its aux layers
        if config_dict.get("rope_parameters") is None and config_dict.get("rope_scaling") is None:
            theta = config_dict.pop("rope_theta", None)
            config_dict["rope_parameters"] = {"rope_type": "default", **({"rope_theta": theta} if theta else {})}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_json_file(cls, json_file) -> "Eagle31MLAConfig":
        """A ``config.json`` read as :meth:`from_dict` reads it (Transformers' own calls the constructor)."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @classmethod
    def _dict_from_json_file(cls, json_file) -> dict:
        """Transformers' reader of config.json, refusing a file that holds no JSON object (5.12 fails on one)."""
        data = super()._dict_from_json_file(json_file)
        if not isinstance(data, dict):
            raise ConfigError(f"config.json holds a {type(data).__name__}; expected a JSON object")
        return data

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` form: the engine-facing architecture name, derived sizes left out."""
        output = super().to_dict()
        output["architectures"] = [ENGINE_ARCHITECTURE]
        for derived in ("qk_head_dim", "head_dim"):
            output.pop(derived, None)
        if output.get("target_num_hidden_layers") is None:
            output.pop("target_num_hidden_layers", None)
        return output

    def _set_aux_layer_ids(self) -> None:
        if (self.eagle_config or {}).get("use_aux_hidden_state", True) is not True:
            raise ConfigError(
                f"`eagle_config.use_aux_hidden_state` is {self.eagle_config['use_aux_hidden_state']!r} (EAGLE-1 style: "
                "false); this drafter's `fc` takes the concatenated aux states: expected true, or leave it out"
            )
        if self.eagle_aux_hidden_state_layer_ids is None and self.eagle_config is None:
            ids = AuxLayerIds(KIMI_K3_AUX_LAYER_IDS.one_based, self.target_num_hidden_layers)  # no-arg config
        else:
            try:  # `target_layer_ids` (vLLM's key, refused alone) is an attribute here once given
                ids, how = aux_layer_ids_from_attributes(self, self.target_num_hidden_layers)
            except AuxLayerIdError as err:
                raise ConfigError(str(err)) from None
            logger.info("aux layers: %s -> %s", how, ids.describe())
        write_aux_layer_ids(self, ids)

    @property
    def aux_layer_ids(self) -> AuxLayerIds:
        """The canonical aux-layer ids, whichever labelled form an engine plugin wrote back."""
        return AuxLayerIds.from_convention(
            tuple(self.eagle_aux_hidden_state_layer_ids),
            self.aux_layer_ids_convention or ONE_BASED,
            self.target_num_hidden_layers,
        )

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.eagle_aux_hidden_state_layer_ids)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(nope + rope), times mscale² under YaRN (DeepSeek's long-context correction)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_parameters
        if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim") and rope["factor"] > 1:
            scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0) ** 2
        return scale

    @property
    def is_eagle31(self) -> bool:
        return bool(self.fc_norm and self.norm_output)

    @property
    def kv_cache_values_per_token(self) -> int:
        """What the latent cache stores per token: normalised c_kv plus the rotated shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # -- rules strict runs after __post_init__ (a type is strict's; these are what a type cannot say) ---------------

    def validate_architecture(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_INDEX:
                raise ConfigError(f"`{name}` is {value}; expected an int >= 1 and <= {MAX_INDEX}")
        if not 0 < self.rms_norm_eps < 1:
            raise ConfigError(f"`rms_norm_eps` is {self.rms_norm_eps}; expected a number > 0 and < 1")
        if self.num_hidden_layers != 1:
            raise ConfigError(f"`num_hidden_layers` is {self.num_hidden_layers}; this drafter has exactly 1 layer")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must equal `num_attention_heads` "
                f"({self.num_attention_heads}) for MLA"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"`draft_vocab_size` ({self.draft_vocab_size}) exceeds `vocab_size` ({self.vocab_size}); expected "
                "<= vocab_size (the draft vocabulary is a subset of the target's)"
            )
        if self.tie_word_embeddings:
            raise ConfigError("`tie_word_embeddings` is true; expected false (the drafter has its own `lm_head`)")
        if self.hidden_act not in ACT2FN:
            raise ConfigError(f"`hidden_act` {self.hidden_act!r} is not one of Transformers' ACT2FN names ('silu')")

    def validate_token_ids(self) -> None:
        """Special token ids are rows of the vocabulary (Transformers' own check only logs a warning)."""
        for name in _TOKEN_IDS:
            value = getattr(self, name)
            for i in value if isinstance(value, list) else [value]:
                if i is not None and not 0 <= i < self.vocab_size:
                    raise ConfigError(f"`{name}` is {value}; expected ids in [0, {self.vocab_size}) (vocab_size)")

    def validate_rope(self) -> None:
        """A known rope type, only its own keys, usable numbers (Transformers' check only warns)."""
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"`qk_rope_head_dim` is {self.qk_rope_head_dim}; expected an even number")
        rope = self.rope_parameters
        kind = rope.get("rope_type")
        if kind not in _ROPE_KEYS:
            raise ConfigError(f"`rope_parameters.rope_type` is {kind!r}; expected one of {sorted(_ROPE_KEYS)}")
        foreign = sorted(set(rope) - _ROPE_KEYS[kind] - {"type"})
        if foreign:
            raise ConfigError(f"`rope_parameters` holds {foreign}, not settings of {kind} rope; remove them")
        for key, value in rope.items():
            if key not in ("rope_type", "type", "truncate") and value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                    raise ConfigError(f"`rope_parameters.{key}` is {value!r}; expected a finite number")
        if kind == "yarn":
            if rope.get("factor") is None or not 1 <= rope["factor"] <= 1e6:
                raise ConfigError(f"`rope_parameters.factor` is {rope.get('factor')!r}; expected a number in [1, 1e6]")
            if rope["original_max_position_embeddings"] > self.max_position_embeddings:
                raise ConfigError(
                    f"yarn `original_max_position_embeddings` ({rope['original_max_position_embeddings']}) exceeds "
                    f"`max_position_embeddings` ({self.max_position_embeddings}); expected <= max_position_embeddings"
                )
            if (rope.get("beta_fast") or 32) <= (rope.get("beta_slow") or 1):
                raise ConfigError(
                    f"`rope_parameters.beta_fast` ({rope.get('beta_fast')}) must be greater than `beta_slow` "
                    f"({rope.get('beta_slow')})"
                )
        try:
            inv_freq, scaling = rope_frequencies(self)
            numbers = [*inv_freq.tolist(), scaling, self.softmax_scale]
            usable = all(math.isfinite(x) and x > 0 for x in numbers)
        except (ArithmeticError, ValueError, TypeError):
            usable = False
        if not usable:
            raise ConfigError(
                f"the rope settings {rope} give non-finite or non-positive frequencies or scales; expected a usable "
                "schedule (Kimi-K3's: yarn, rope_theta 50000, factor 32, beta_fast 32 > beta_slow 1)"
            )


def _validate(config: Eagle31MLAConfig, strict_validate=Eagle31MLAConfig.validate) -> None:
    """strict's class validation, raising the validator's ConfigError (strict's wrapper has a two-line message)."""
    try:
        strict_validate(config)
    except StrictDataclassClassValidationError as err:
        raise err.__cause__ from None


Eagle31MLAConfig.validate = _validate
