"""SGLang plugin for the EAGLE-3.1 MLA drafter of Kimi-K3, loaded through the ``sglang.srt.plugins`` entry point
or ``SGLANG_EXTERNAL_MODEL_PACKAGE=eagle31_mla_sglang``. The drafter is SGLang's own ``Eagle3DeepseekV2ForCausalLM``.

The plugin reads the draft's aux ids by this library's rule (:mod:`eagle31_mla.model.aux_layers`) and gives the
target the form after which it stores exactly those layers (refused where none does); adds Kimi-K3's prefix-only
capture (:mod:`.kimi_k3`); refuses an MHA-shaped cache; and, since SGLang only logs a hook it could not apply,
checks its hooks (:func:`check_hooks`) when the ids are resolved and the drafter is built.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import pkgutil
import sys

from eagle31_mla.model.aux_layers import AuxLayerIdError, aux_layer_ids_from_attributes
from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE as DRAFT_ARCHITECTURE
from eagle31_mla.serving.engine_facts import release_label
from eagle31_mla.serving.engine_facts.sglang import RELEASES

__all__ = ["register", "DRAFT_ARCHITECTURE", "CanonicalAuxLayerIds", "PluginHookError", "check_hooks", "hook_problems"]

logger = logging.getLogger(__name__)

_RUNNER = "sglang.srt.model_executor.model_runner_components"
RESOLVE_TARGET = f"{_RUNNER}.spec_aux_hidden_state._resolve_eagle_aux_hidden_state"
CONFIGURE_TARGET = f"{_RUNNER}.attention_backend_setup.configure_aux_hidden_state_capture"
#: Calls the configure function through a `from ... import` copy, which SGLang's hook registry re-points.
CONFIGURE_CALLER = "sglang.srt.model_executor.model_runner"
DRAFTER_MODULE = "sglang.srt.models.kimi_k25_eagle3"
SUPPORTED_RELEASES = ", ".join(release_label(r) for r in RELEASES)


class CanonicalAuxLayerIds(list):
    """The draft's one-based completed-layer ids as the plugin resolved them (a list, for code that knows no better)."""

    def __init__(self, aux_layer_ids):
        super().__init__(aux_layer_ids.one_based)
        self.aux_layer_ids = aux_layer_ids


class PluginHookError(RuntimeError):
    """The plugin's hooks are not in place in this SGLang: serving the drafter would feed it wrong layers."""


@functools.cache  # once per process
def register() -> None:
    """SGLang applies the hooks after all plugins ran. The drafter's ``__init__`` gets the hook check."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVE_TARGET, resolve_eagle_aux_hidden_state, HookType.AROUND)
    HookRegistry.register(CONFIGURE_TARGET, configure_aux_hidden_state_capture, HookType.AROUND)
    cls = getattr(importlib.import_module(DRAFTER_MODULE), DRAFT_ARCHITECTURE)
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


def hook_problems() -> list[str]:
    """What is missing for the plugin's hooks to run in this process (empty when all are in place)."""
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
        elif target == RESOLVE_TARGET and not {"config", "model_config"} <= set(
            inspect.signature(inspect.unwrap(function)).parameters
        ):
            problems.append(f"`{target}` takes no `config` and `model_config` arguments, which the plugin reads")
    name = CONFIGURE_TARGET.rsplit(".", 1)[1]
    copy = getattr(sys.modules.get(CONFIGURE_CALLER), name, None)
    if copy is not None and not _hooked_by(copy, configure_aux_hidden_state_capture):
        problems.append(f"`{CONFIGURE_CALLER}` calls an unhooked `{name}`")
    return problems


def check_hooks() -> None:
    """Raise :class:`PluginHookError` naming every hook that is not in place."""
    if problems := hook_problems():
        from sglang import __version__ as installed

        raise PluginHookError(
            "eagle31-mla: the SGLang plugin cannot serve this draft: " + "; ".join(problems) + ". Without its hooks "
            f"SGLang would capture the wrong target layers for the drafter, silently. The plugin supports SGLang "
            f"{SUPPORTED_RELEASES} (installed: {installed}); install a supported release, or run SGLang without the "
            "plugin (SGLANG_PLUGINS set to the plugins you want)."
        )


def resolve_eagle_aux_hidden_state(original, *args, **kwargs):
    """After SGLang read the raw nested ids: replace them by the canonical ids of our drafts."""
    original(*args, **kwargs)
    arguments = inspect.signature(original).bind(*args, **kwargs).arguments
    config, target_config = arguments["config"], arguments["model_config"]
    draft = getattr(config, "draft_model_config", None)
    if not getattr(config, "eagle_use_aux_hidden_state", False) or draft is None:
        return
    if DRAFT_ARCHITECTURE not in (getattr(draft.hf_config, "architectures", None) or []):
        return
    check_hooks()  # the capture hook must be in place too, or the target would store the raw ids
    config.eagle_aux_hidden_state_layer_ids = canonical_ids_for_draft(
        draft.hf_config, getattr(target_config, "num_hidden_layers", None), draft.attention_arch
    )


def canonical_ids_for_draft(hf_config, num_target_layers: int | None, attention_arch=None) -> CanonicalAuxLayerIds:
    if attention_arch is not None and getattr(attention_arch, "name", str(attention_arch)) != "MLA":
        raise ValueError(
            f"eagle31-mla: SGLang would give the {DRAFT_ARCHITECTURE} draft a {attention_arch} KV cache, not MLA's "
            f"latent one; keep `{DRAFT_ARCHITECTURE}` in the draft's `architectures`"
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
    if kwargs.get("eagle_use_aux_hidden_state") and isinstance(ids, CanonicalAuxLayerIds):
        from . import kimi_k3

        kimi_k3.install_if_missing(type(kwargs["model"]))
        kwargs["eagle_aux_hidden_state_layer_ids"] = target_form(kwargs["model"], ids)
    return original(*args, **kwargs)


def target_form(model, ids: CanonicalAuxLayerIds) -> list[int]:
    """The one-based or else the zero-based form, whichever the target itself stores as exactly the wanted layers
    (SGLang's targets store one-based ids: :mod:`eagle31_mla.serving.engine_facts.sglang`)."""
    wanted = list(ids.aux_layer_ids.one_based)
    pp_group = getattr(model, "pp_group", None) or getattr(getattr(model, "language_model", None), "pp_group", None)
    if pp_group is not None and not pp_group.is_last_rank:
        return wanted  # only the last pipeline rank captures; it runs this check too
    tried = []
    for form in (wanted, list(ids.aux_layer_ids.zero_based)):
        model.set_eagle3_layers_to_capture(list(form))
        stored = captured_layers(model)
        if stored is None:
            logger.warning(
                "eagle31-mla: cannot read what %s captures; passing one-based %s", type(model).__name__, wanted
            )
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
            if (value := getattr(inner, name, None)) is not None:
                return value
    return None
