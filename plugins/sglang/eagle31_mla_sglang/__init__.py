"""SGLang plugin for the EAGLE-3.1 MLA drafter of Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

Loaded in every SGLang process through the ``sglang.srt.plugins`` entry point, or by
``SGLANG_EXTERNAL_MODEL_PACKAGE=eagle31_mla_sglang``. The drafter itself is SGLang's own
``Eagle3DeepseekV2ForCausalLM`` (that name is what SGLang's MLA-cache list keys on); the plugin makes
sure it is fed the right tensors:

* **Aux ids.** SGLang hands the target only the nested ``eagle_config`` ids, raw, and each target
  class reads them its own way (DeepSeek/Kimi-K2.x add 1 only when the first id is 1, Llama always
  adds 1). The plugin reads the draft's ids by this library's rule (:mod:`eagle31_mla.aux_layers`:
  nested or top level, either convention), then gives the target the form that makes it capture
  exactly those layers, verified on what the target stored; a form the target cannot capture is
  refused with an error instead of being mis-mapped.
* **Kimi-K3.** SGLang 0.5.23 has no EAGLE-3 capture for a Kimi-K3 target; the plugin adds it
  (:mod:`.kimi_k3`): the prefix-only AttnRes stream after the chosen layers. A newer SGLang that has
  its own is left alone, and what it stores is checked.
* **MLA cache.** A draft of this family whose config would give it an MHA-shaped cache is refused.
"""

from __future__ import annotations

import logging

from .versions import MLA_DRAFT_ARCHITECTURE as DRAFT_ARCHITECTURE

__all__ = ["register", "DRAFT_ARCHITECTURE", "CanonicalAuxLayerIds"]

logger = logging.getLogger(__name__)

_RUNNER = "sglang.srt.model_executor.model_runner_components"
RESOLVE_TARGET = f"{_RUNNER}.spec_aux_hidden_state._resolve_eagle_aux_hidden_state"
CONFIGURE_TARGET = f"{_RUNNER}.attention_backend_setup.configure_aux_hidden_state_capture"

_registered = False


class CanonicalAuxLayerIds(list):
    """One-based completed-layer ids that this plugin resolved for the draft (a list, so that code
    that does not know it still sees the most common form)."""

    def __init__(self, aux_layer_ids):
        super().__init__(aux_layer_ids.one_based)
        self.aux_layer_ids = aux_layer_ids


def register() -> None:
    """Idempotent: hooks are registered once per process; SGLang applies them after all plugins ran."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVE_TARGET, resolve_eagle_aux_hidden_state, HookType.AROUND)
    HookRegistry.register(CONFIGURE_TARGET, configure_aux_hidden_state_capture, HookType.AROUND)
    _registered = True


def resolve_eagle_aux_hidden_state(original, *args, **kwargs):
    """After SGLang read the raw nested ids: replace them by the canonical ids of our drafts."""
    original(*args, **kwargs)
    config, target_config = kwargs["config"], kwargs["model_config"]
    draft = config.draft_model_config
    if not config.eagle_use_aux_hidden_state or draft is None:
        return
    hf_config = draft.hf_config
    if DRAFT_ARCHITECTURE not in (getattr(hf_config, "architectures", None) or []):
        return
    config.eagle_aux_hidden_state_layer_ids = canonical_ids_for_draft(
        hf_config, target_config.num_hidden_layers, attention_arch=draft.attention_arch
    )


def canonical_ids_for_draft(hf_config, num_target_layers: int, attention_arch=None) -> CanonicalAuxLayerIds:
    from eagle31_mla.aux_layers import AuxLayerIdError, aux_layer_ids_from_attributes

    if attention_arch is not None and getattr(attention_arch, "name", str(attention_arch)) != "MLA":
        raise ValueError(
            f"eagle31-mla: SGLang would give the {DRAFT_ARCHITECTURE} draft a {attention_arch} KV cache, not MLA's "
            "latent one; keep `Eagle3DeepseekV2ForCausalLM` in the draft's `architectures`"
        )
    try:
        ids, how = aux_layer_ids_from_attributes(hf_config, num_target_layers)
    except AuxLayerIdError as err:
        raise ValueError(f"eagle31-mla: the draft's aux layers cannot be served: {err}") from None
    logger.info("eagle31-mla: draft aux layers %s (%s)", ids.describe(), how)
    return CanonicalAuxLayerIds(ids)


def configure_aux_hidden_state_capture(original, *args, **kwargs):
    """Give the target the id form that makes it capture exactly the canonical layers."""
    ids = kwargs.get("eagle_aux_hidden_state_layer_ids")
    model = kwargs.get("model")
    if kwargs.get("eagle_use_aux_hidden_state") and isinstance(ids, CanonicalAuxLayerIds):
        from . import kimi_k3

        kimi_k3.install_if_missing(type(model))
        kwargs["eagle_aux_hidden_state_layer_ids"] = target_form(model, ids)
    return original(*args, **kwargs)


def target_form(model, ids: CanonicalAuxLayerIds) -> list[int]:
    """Try the one-based, then the zero-based form on the target itself and keep the one after which
    it stores exactly the wanted layers (SGLang's targets capture the input of layer i, i.e. one-based
    completed-layer id i, so what they store is directly comparable)."""
    wanted = list(ids.aux_layer_ids.one_based)
    pp_group = getattr(model, "pp_group", None) or getattr(getattr(model, "language_model", None), "pp_group", None)
    if pp_group is not None and not pp_group.is_last_rank:
        return wanted  # only the last pipeline rank captures; it runs this check too
    tried = []
    for form in (wanted, list(ids.aux_layer_ids.zero_based)):
        model.set_eagle3_layers_to_capture(list(form))
        stored = captured_layers(model)
        if stored is None:
            logger.warning("eagle31-mla: cannot read back what %s captures; passing one-based %s",
                           type(model).__name__, wanted)  # fmt: skip
            return wanted
        if list(stored) == wanted:
            return form
        tried.append((form, list(stored)))
    raise ValueError(
        f"eagle31-mla: SGLang's {type(model).__name__} cannot capture layers {ids.aux_layer_ids.describe()}: "
        + "; ".join(f"given {given} it captures {stored}" for given, stored in tried)
        + " (DeepSeek-family targets add 1 only when the first id is 1)"
    )


def captured_layers(model):
    """The one-based layer ids a target stored for EAGLE-3 capture, or None if it keeps them elsewhere."""
    for owner in (model, getattr(model, "language_model", None)):
        inner = getattr(owner, "model", None)
        for name in ("eagle3_layers_to_capture", "layers_to_capture"):
            value = getattr(inner, name, None)
            if value is not None:
                return value
    return None
