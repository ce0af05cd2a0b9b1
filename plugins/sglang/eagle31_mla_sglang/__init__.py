"""SGLang plugin (``sglang.srt.plugins`` or ``SGLANG_EXTERNAL_MODEL_PACKAGE=eagle31_mla_sglang``; docs/engines.md).
SGLang only logs a hook it could not apply, so the plugin checks its own (:func:`check_hooks`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import pkgutil
import sys

from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE as DRAFT_ARCHITECTURE
from eagle31_mla.serving.compatibility import PluginAPIError, ServingConfigError, served_aux_ids
from eagle31_mla.serving.engine_facts import release_label
from eagle31_mla.serving.engine_facts.sglang import RELEASES

logger = logging.getLogger(__name__)

_RUNNER = "sglang.srt.model_executor.model_runner_components"
RESOLVE_TARGET = f"{_RUNNER}.spec_aux_hidden_state._resolve_eagle_aux_hidden_state"
CONFIGURE_TARGET = f"{_RUNNER}.attention_backend_setup.configure_aux_hidden_state_capture"
#: Calls the configure function through a `from ... import` copy, which SGLang's hook registry re-points.
CONFIGURE_CALLER = "sglang.srt.model_executor.model_runner"
SUPPORTED_RELEASES = ", ".join(release_label(r) for r in RELEASES)


class CanonicalAuxLayerIds(list):
    """The draft's one-based ids as the plugin resolved them (a list, for SGLang's code)."""

    def __init__(self, aux_layer_ids):
        super().__init__(aux_layer_ids.one_based)
        self.aux_layer_ids = aux_layer_ids


@functools.cache  # once per process
def register() -> None:
    """SGLang applies the hooks after all plugins ran; the drafter's ``__init__`` checks them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVE_TARGET, resolve_eagle_aux_hidden_state, HookType.AROUND)
    HookRegistry.register(CONFIGURE_TARGET, configure_aux_hidden_state_capture, HookType.AROUND)
    cls = getattr(importlib.import_module("sglang.srt.models.kimi_k25_eagle3"), DRAFT_ARCHITECTURE)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        check_hooks()
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def _hooked_by(function, hook) -> bool:
    """Whether ``function`` is (a chain of) SGLang hook wrappers one of which calls ``hook``."""
    while function is not None:
        for cell in getattr(function, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                pass
        function = getattr(function, "__wrapped__", None)
    return False


def check_hooks() -> None:
    """Raise :class:`PluginAPIError` naming every hook that is not in place in this process."""
    problems = []
    for target, hook in (
        (RESOLVE_TARGET, resolve_eagle_aux_hidden_state),
        (CONFIGURE_TARGET, configure_aux_hidden_state_capture),
    ):
        try:
            function = pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as err:
            problems.append(f"`{target}` does not exist in this SGLang ({type(err).__name__}: {err})")
            continue
        if not _hooked_by(function, hook):
            problems.append(f"`{target}` exists but the plugin's hook was not applied to it (SGLang logs why)")
    name = CONFIGURE_TARGET.rsplit(".", 1)[1]
    copy = getattr(sys.modules.get(CONFIGURE_CALLER), name, None)
    if copy is not None and not _hooked_by(copy, configure_aux_hidden_state_capture):
        problems.append(f"`{CONFIGURE_CALLER}` calls an unhooked `{name}`")
    if problems:
        from sglang import __version__ as installed

        raise PluginAPIError(
            "eagle31-mla: the SGLang plugin cannot serve this draft: " + "; ".join(problems) + ". Without its hooks "
            f"SGLang would capture the wrong target layers for the drafter, silently. The plugin supports SGLang "
            f"{SUPPORTED_RELEASES} (installed: {installed}); install a supported release, or run SGLang without the "
            "plugin (SGLANG_PLUGINS set to the plugins you want)."
        )


def resolve_eagle_aux_hidden_state(original, *args, **kwargs):
    """After SGLang read the raw nested ids: replace them by our drafts' canonical ids."""
    original(*args, **kwargs)
    given = inspect.signature(original).bind(*args, **kwargs).arguments  # keywords in 0.5.23, any form elsewhere
    if "config" not in given:
        raise PluginAPIError(
            f"eagle31-mla: SGLang called `{RESOLVE_TARGET}` without `config` (it supports SGLang {SUPPORTED_RELEASES})"
        )
    config, target_config = given["config"], given.get("model_config")
    draft = getattr(config, "draft_model_config", None)
    architectures = getattr(getattr(draft, "hf_config", None), "architectures", None) or []
    if getattr(config, "eagle_use_aux_hidden_state", False) and DRAFT_ARCHITECTURE in architectures:
        check_hooks()  # the capture hook must be in place too, or the target would store the raw ids
        if not isinstance(depth := getattr(target_config, "num_hidden_layers", None), int):
            raise PluginAPIError(
                f"eagle31-mla: SGLang passed `{RESOLVE_TARGET}` a {type(target_config).__name__} as `model_config`, "
                "not the target's ModelConfig, whose `num_hidden_layers` the plugin checks the draft's ids against "
                f"(it supports SGLang {SUPPORTED_RELEASES})"
            )
        config.eagle_aux_hidden_state_layer_ids = canonical_ids_for_draft(draft.hf_config, depth, draft.attention_arch)


def canonical_ids_for_draft(hf_config, num_target_layers: int, attention_arch) -> CanonicalAuxLayerIds:
    if getattr(attention_arch, "name", attention_arch) != "MLA":  # an enum in 0.5.23; a string or None elsewhere
        raise ServingConfigError(
            f"eagle31-mla: SGLang would give the {DRAFT_ARCHITECTURE} draft a {attention_arch} KV cache, not MLA's "
            f"latent one; keep `{DRAFT_ARCHITECTURE}` in the draft's `architectures`"
        )
    ids, how = served_aux_ids(hf_config, num_target_layers)
    logger.info("eagle31-mla: draft aux layers %s (%s)", ids.describe(), how)
    return CanonicalAuxLayerIds(ids)


def configure_aux_hidden_state_capture(original, *args, **kwargs):
    """Give the target the id form that makes it capture exactly the canonical layers."""
    ids = kwargs.get("eagle_aux_hidden_state_layer_ids")
    if kwargs.get("eagle_use_aux_hidden_state") and isinstance(ids, CanonicalAuxLayerIds):
        from . import kimi_k3

        kimi_k3.install_if_missing(type(kwargs["model"]))
        kwargs["eagle_aux_hidden_state_layer_ids"] = target_form(kwargs["model"], ids)
    return original(*args, **kwargs)


def target_form(model, ids: CanonicalAuxLayerIds) -> list[int]:
    """The one-based or else the zero-based form, whichever the target stores as exactly the wanted (one-based) ids."""
    wanted, name = list(ids.aux_layer_ids.one_based), type(model).__name__
    pp_group = getattr(model, "pp_group", None) or getattr(getattr(model, "language_model", None), "pp_group", None)
    if pp_group is not None and not pp_group.is_last_rank:
        return wanted  # only the last pipeline rank captures; it runs this check too
    tried = []
    for form in (wanted, list(ids.aux_layer_ids.zero_based)):
        model.set_eagle3_layers_to_capture(list(form))
        stored = captured_layers(model)
        if stored is None:
            logger.warning("eagle31-mla: cannot read what %s captures; passing one-based %s", name, wanted)
            return wanted
        if list(stored) == wanted:
            return form
        tried.append((form, list(stored)))
    raise ServingConfigError(
        f"eagle31-mla: SGLang's {name} cannot capture layers {ids.aux_layer_ids.describe()}: "
        + "; ".join(f"given {given} it captures {stored}" for given, stored in tried)
        + " (DeepSeek-family targets add 1 only when the first id is 1)"
    )


def captured_layers(model):
    """The one-based layer ids a target stored for EAGLE-3 capture, or None if it keeps them elsewhere."""
    for owner in (model, getattr(model, "language_model", None)):
        inner = getattr(owner, "model", None)
        for name in ("eagle3_layers_to_capture", "layers_to_capture"):
            if (value := getattr(inner, name, None)) is not None:
                return value
