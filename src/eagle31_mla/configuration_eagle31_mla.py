"""Configuration of the EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

``Eagle31MLAConfig()`` with no arguments describes the published drafter: one DeepSeek-style MLA
decoder layer (hidden 7168, 64 heads, q_lora 1536, kv_lora 512 + rope 64) fed by three Kimi-K3 aux
states (one-based completed layers [2, 46, 90]), EAGLE-3.1's ``fc_norm`` and ``norm_output`` on, YaRN
RoPE (theta 50000, factor 32 over 32768 positions).

Reading a ``config.json`` (``from_pretrained`` / ``from_dict``) gives a missing key its meaning in
*files*, which differs from the constructor defaults for four keys: absent ``fc_norm`` /
``norm_output`` mean EAGLE-3 (off); absent ``rope_scaling`` / ``rope_parameters`` mean plain RoPE;
absent aux-layer ids are an error (see :mod:`aux_layers`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import PretrainedConfig

from .aux_layers import AuxLayerIds, AuxLayerIdError, aux_layer_ids_config_entries, aux_layer_ids_from_config

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


class ConfigError(ValueError):
    """A drafter config that cannot describe a correct drafter; the message names the key."""


def _positive_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"`{key}` must be a positive number, got {value!r}")
    return float(value)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _normalise_rope(
    rope_parameters: dict | None, rope_scaling: dict | None, rope_theta: float | None
) -> dict[str, Any]:
    """One rope dict in Transformers-5 form, from either the v5 ``rope_parameters`` or the legacy
    ``rope_scaling`` + ``rope_theta`` pair."""
    if rope_parameters is not None and rope_scaling is not None:
        raise ConfigError("config has both `rope_parameters` and `rope_scaling`; keep one (they may disagree)")
    given = rope_parameters if rope_parameters is not None else rope_scaling
    if rope_theta is not None:
        rope_theta = _positive_number("rope_theta", rope_theta)
    if given is None:
        return dict(KIMI_K3_ROPE_PARAMETERS, **({"rope_theta": rope_theta} if rope_theta else {}))
    if not isinstance(given, dict):
        raise ConfigError(f"`rope_scaling`/`rope_parameters`: expected a dict, got {given!r}")
    params = dict(given)
    if params.get("rope_type") and params.get("type") and params["rope_type"] != params["type"]:
        raise ConfigError(
            f"rope settings name two types: `rope_type` {params['rope_type']!r} and `type` {params['type']!r}; keep one"
        )
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "deepseek_yarn":  # vLLM's name for the same schedule
        rope_type = "yarn"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"`rope_scaling.type` / `rope_parameters.rope_type` is {rope_type!r}; this drafter supports "
            f"{SUPPORTED_ROPE_TYPES} (the published Kimi-K3 drafter uses yarn)"
        )
    theta = params.get("rope_theta", rope_theta)
    if theta is not None and rope_theta is not None and _positive_number("rope_theta", theta) != rope_theta:
        raise ConfigError(
            f"config has top-level `rope_theta` {rope_theta:g} but its rope dict says `rope_theta` {theta}; "
            "they must agree (keep one)"
        )
    params["rope_theta"] = _positive_number("rope_theta", theta if theta is not None else DEFAULT_ROPE_THETA)
    if rope_type == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if not isinstance(params.get(key), (int, float)) or params[key] <= 0:
                raise ConfigError(f"yarn rope needs a positive `{key}`, got {params.get(key)!r}")
        if params["factor"] < 1:
            raise ConfigError(f"yarn rope `factor` must be >= 1, got {params['factor']}")
    return {"rope_type": rope_type, **params}


class Eagle31MLAConfig(PretrainedConfig):
    r"""
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
            feed the drafter, read by the rule in :mod:`eagle31_mla.aux_layers`; written back one-based
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
        model_type = kwargs.pop("model_type", None)
        if model_type is not None and model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(
                f"`model_type` is {model_type!r}; an EAGLE-3(.1) MLA drafter config says one of "
                f"{ACCEPTED_MODEL_TYPES}"
            )
        if kwargs.pop("mla_use_nope", None):
            logger.info(
                "config sets `mla_use_nope: true`; ignored on purpose: this drafter applies RoPE to the "
                "rope slice, as its training code and every serving engine do"
            )
        self.rope_parameters = _normalise_rope(
            self.rope_parameters, kwargs.pop("rope_scaling", None), kwargs.pop("rope_theta", None)
        )
        self._set_aux_layer_ids(kwargs)
        num_aux = kwargs.pop("num_aux_hidden_states", None)
        if num_aux is not None and num_aux != len(self.aux_layer_ids):
            raise ConfigError(
                f"`num_aux_hidden_states` is {num_aux} but the config names {len(self.aux_layer_ids)} aux "
                f"layers ({self.aux_layer_ids.describe()})"
            )
        kwargs.pop("qk_head_dim", None)
        kwargs.pop("head_dim", None)
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
        self._check()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "Eagle31MLAConfig":
        """Read a ``config.json`` dict: absent keys take their meaning in files (see module docstring)."""
        if not isinstance(config_dict, dict):
            raise ConfigError(f"config.json must hold a JSON object (a dict of settings), got {type(config_dict).__name__}")
        config_dict = dict(config_dict)
        config_dict.setdefault("fc_norm", False)
        config_dict.setdefault("norm_output", False)
        if config_dict.get("eagle_config") is None:
            config_dict["eagle_config"] = {}  # a file must name its aux layers: no Kimi-K3 default
        if "rope_parameters" not in config_dict and config_dict.get("rope_scaling") is None:
            config_dict.pop("rope_scaling", None)
            config_dict["rope_parameters"] = {"rope_type": "default"}
        return super().from_dict(config_dict, **kwargs)

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
                f"`eagle_config` must be a dict (e.g. {{\"eagle_aux_hidden_state_layer_ids\": [2, 46, 90]}}), got "
                f"{self.eagle_config!r}"
            )
        eagle_config = dict(self.eagle_config or {})
        if eagle_config.get("use_aux_hidden_state") is False:
            raise ConfigError(
                "`eagle_config.use_aux_hidden_state` is false (EAGLE-1 style: last hidden state only); this "
                "drafter's `fc` takes the concatenated aux states"
            )
        if self.eagle_aux_hidden_state_layer_ids is None and self.eagle_config is None:
            ids = AuxLayerIds((2, 46, 90), self.target_num_hidden_layers)  # Kimi-K3's, for the no-arg config
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
        entries = aux_layer_ids_config_entries(ids)
        self.eagle_aux_hidden_state_layer_ids = entries["eagle_aux_hidden_state_layer_ids"]
        self.aux_layer_ids_convention = entries["aux_layer_ids_convention"]
        self.eagle_config = {**eagle_config, **entries["eagle_config"]}

    @property
    def aux_layer_ids(self) -> AuxLayerIds:
        """The canonical aux-layer ids (one-based completed layers)."""
        return AuxLayerIds(tuple(self.eagle_aux_hidden_state_layer_ids), self.target_num_hidden_layers)

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

    def _check(self) -> None:
        positive = (
            "vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "intermediate_size",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "max_position_embeddings",
        )  # fmt: skip
        for key in positive:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"`{key}` must be a positive int, got {value!r}")
        if self.num_hidden_layers != 1:
            raise ConfigError(f"`num_hidden_layers` is {self.num_hidden_layers}; this drafter has exactly 1 layer")
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0:
            raise ConfigError(f"`q_lora_rank` is {self.q_lora_rank!r}; expected a positive int (this drafter needs the low-rank q path, q_a/q_b)")
        _positive_number("rms_norm_eps", self.rms_norm_eps)
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must equal `num_attention_heads` "
                f"({self.num_attention_heads}) for MLA"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"`qk_rope_head_dim` must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"`draft_vocab_size` ({self.draft_vocab_size}) exceeds `vocab_size` ({self.vocab_size})"
            )
        if self.tie_word_embeddings:
            raise ConfigError("`tie_word_embeddings: true` is not supported: the drafter has its own `lm_head`")
        from transformers.activations import ACT2FN

        if self.hidden_act not in ACT2FN:
            raise ConfigError(f"`hidden_act` {self.hidden_act!r} is not a known activation")
        for key in ("fc_norm", "norm_output", "norm_before_residual"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"`{key}` must be true or false, got {getattr(self, key)!r}")
        if self.rope_parameters["rope_type"] == "yarn":
            original = self.rope_parameters["original_max_position_embeddings"]
            if original > self.max_position_embeddings:
                raise ConfigError(
                    f"yarn `original_max_position_embeddings` ({original}) exceeds `max_position_embeddings` "
                    f"({self.max_position_embeddings})"
                )


__all__ += ["ACCEPTED_MODEL_TYPES", "KIMI_K3_ROPE_PARAMETERS"]
