"""SGLang plugin for the EAGLE-3.1 MLA drafter of Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

Loaded in every SGLang process through the ``sglang.srt.plugins`` entry point, or by
``SGLANG_EXTERNAL_MODEL_PACKAGE=eagle31_mla_sglang``. The drafter itself is SGLang's own
``Eagle3DeepseekV2ForCausalLM`` (that name is what SGLang's MLA-cache list keys on); the plugin makes
sure it is fed the right tensors:

* **Aux ids.** SGLang hands the target only the nested ``eagle_config`` ids, raw, and each target
  class reads them its own way (DeepSeek/Kimi-K2.x add 1 only when the first id is 1, Llama always
  adds 1). The plugin reads the draft's ids by this library's rule (:mod:`eagle31_mla.model.aux_layers`:
  nested or top level, either convention), then gives the target the form that makes it capture
  exactly those layers, verified on what the target stored; a form the target cannot capture is
  refused with an error instead of being mis-mapped.
* **Kimi-K3.** SGLang 0.5.23 has no EAGLE-3 capture for a Kimi-K3 target; the plugin adds it
  (:mod:`.kimi_k3`): the prefix-only AttnRes stream after the chosen layers. A newer SGLang that has
  its own is left alone, and what it stores is checked.
* **MLA cache.** A draft of this family whose config would give it an MHA-shaped cache is refused.
* **Hooks checked.** SGLang only logs an exception raised while applying a plugin's hooks, so a renamed
  SGLang function would leave the plugin silently doing nothing. The plugin therefore checks that both
  hooks are in place (:func:`check_hooks`) when SGLang resolves the draft's aux ids and when it builds
  the ``Eagle3DeepseekV2ForCausalLM`` drafter (a guard on its ``__init__``), and stops serving with an
  error naming the missing symbol and the supported SGLang releases otherwise.
"""

from __future__ import annotations

import functools
import inspect
import logging
import pkgutil
import sys

from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE as DRAFT_ARCHITECTURE
from eagle31_mla.serving.engine_facts import release_label
from eagle31_mla.serving.engine_facts.sglang import RELEASES

__all__ = ["register", "DRAFT_ARCHITECTURE", "CanonicalAuxLayerIds", "PluginHookError", "check_hooks", "hook_problems"]

logger = logging.getLogger(__name__)

_RUNNER = "sglang.srt.model_executor.model_runner_components"
RESOLVE_TARGET = f"{_RUNNER}.spec_aux_hidden_state._resolve_eagle_aux_hidden_state"
CONFIGURE_TARGET = f"{_RUNNER}.attention_backend_setup.configure_aux_hidden_state_capture"
#: Where SGLang 0.5.23 calls the configure function from (a `from ... import` copy, which SGLang's hook
#: registry re-points when it applies a hook); checked when that module is loaded.
CONFIGURE_CALLER = "sglang.srt.model_executor.model_runner"
#: SGLang's MLA drafter class; its ``__init__`` gets the hook check (:func:`_guard_the_drafter`).
DRAFTER_MODULE = "sglang.srt.models.kimi_k25_eagle3"
SUPPORTED_RELEASES = ", ".join(release_label(r) for r in RELEASES)

_registered = False


class CanonicalAuxLayerIds(list):
    """One-based completed-layer ids that this plugin resolved for the draft (a list, so that code
    that does not know it still sees the most common form)."""

    def __init__(self, aux_layer_ids):
        super().__init__(aux_layer_ids.one_based)
        self.aux_layer_ids = aux_layer_ids


class PluginHookError(RuntimeError):
    """The plugin's hooks are not in place in this SGLang: serving the drafter would feed it wrong layers."""


def register() -> None:
    """Idempotent: hooks are registered once per process; SGLang applies them after all plugins ran.
    SGLang's drafter class gets the hook check now (it runs when a drafter is built, hooks applied by then)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(RESOLVE_TARGET, resolve_eagle_aux_hidden_state, HookType.AROUND)
    HookRegistry.register(CONFIGURE_TARGET, configure_aux_hidden_state_capture, HookType.AROUND)
    _registered = True
    _guard_the_drafter()


def _hooked_by(function, hook) -> bool:
    """Whether ``function`` is (a chain of) SGLang hook wrappers one of which calls ``hook``."""
    seen = set()
    while function is not None and id(function) not in seen:
        seen.add(id(function))
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
        elif target == RESOLVE_TARGET and "config" not in inspect.signature(inspect.unwrap(function)).parameters:
            problems.append(f"`{target}` takes no `config` argument, which the plugin rewrites")
    caller = sys.modules.get(CONFIGURE_CALLER)
    copy = getattr(caller, CONFIGURE_TARGET.rsplit(".", 1)[1], None) if caller is not None else None
    if copy is not None and not _hooked_by(copy, configure_aux_hidden_state_capture):
        problems.append(f"`{CONFIGURE_CALLER}` calls an unhooked `{CONFIGURE_TARGET.rsplit('.', 1)[1]}`")
    return problems


def check_hooks() -> None:
    """Raise :class:`PluginHookError` naming every hook that is not in place."""
    problems = hook_problems()
    if problems:
        try:
            from sglang import __version__ as installed
        except ImportError:
            installed = "?"
        raise PluginHookError(
            "eagle31-mla: the SGLang plugin cannot serve this draft: " + "; ".join(problems) + ". Without its hooks "
            f"SGLang would capture the wrong target layers for the drafter, silently. The plugin supports SGLang "
            f"{SUPPORTED_RELEASES} (installed: {installed}); install a supported release, or run SGLang without the "
            "plugin (SGLANG_PLUGINS set to the plugins you want)."
        )


def _guard_the_drafter() -> None:
    """Check the hooks whenever SGLang builds its MLA drafter (where the draft is served)."""
    import importlib

    cls = getattr(importlib.import_module(DRAFTER_MODULE), DRAFT_ARCHITECTURE)
    init = cls.__init__
    if getattr(init, "_eagle31_guard", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        check_hooks()
        init(self, *args, **kwargs)

    __init__._eagle31_guard = True
    cls.__init__ = __init__


def _arguments(function, args, kwargs) -> dict:
    """The call's arguments by name, whatever this SGLang's signature is (keyword-only in 0.5.23)."""
    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def resolve_eagle_aux_hidden_state(original, *args, **kwargs):
    """After SGLang read the raw nested ids: replace them by the canonical ids of our drafts.

    SGLang 0.5.23 passes the target's ``model_config``; releases whose signature has none get the
    ids unchecked against the target's depth here, and checked in :func:`configure_aux_hidden_state_capture`."""
    original(*args, **kwargs)
    arguments = _arguments(original, args, kwargs)
    config, target_config = arguments["config"], arguments.get("model_config")
    draft = getattr(config, "draft_model_config", None)
    if not getattr(config, "eagle_use_aux_hidden_state", False) or draft is None:
        return
    hf_config = draft.hf_config
    if DRAFT_ARCHITECTURE not in (getattr(hf_config, "architectures", None) or []):
        return
    check_hooks()  # the capture hook must be in place too, or the target would store the raw ids
    depth = getattr(target_config, "num_hidden_layers", None) if target_config is not None else None
    config.eagle_aux_hidden_state_layer_ids = canonical_ids_for_draft(
        hf_config, depth, attention_arch=getattr(draft, "attention_arch", None)
    )


def canonical_ids_for_draft(hf_config, num_target_layers: int | None, attention_arch=None) -> CanonicalAuxLayerIds:
    from eagle31_mla.model.aux_layers import AuxLayerIdError, aux_layer_ids_from_attributes

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
    model = kwargs.get("model")
    if kwargs.get("eagle_use_aux_hidden_state") and isinstance(ids, CanonicalAuxLayerIds):
        from . import kimi_k3

        _check_depth(model, ids)
        kimi_k3.install_if_missing(type(model))
        kwargs["eagle_aux_hidden_state_layer_ids"] = target_form(model, ids)
    return original(*args, **kwargs)


def target_depth(model) -> int | None:
    for owner in (model, getattr(model, "language_model", None)):
        config = getattr(owner, "config", None)
        for candidate in (config, getattr(config, "text_config", None)):
            depth = getattr(candidate, "num_hidden_layers", None)
            if isinstance(depth, int):
                return depth
    return None


def _check_depth(model, ids: CanonicalAuxLayerIds) -> None:
    """The ids against the target's depth (already done at resolution where SGLang passes the target's config)."""
    from eagle31_mla.model.aux_layers import AuxLayerIdError, AuxLayerIds

    depth = target_depth(model)
    if depth is None:
        return
    try:
        AuxLayerIds.from_one_based(list(ids.aux_layer_ids.one_based), depth)
    except AuxLayerIdError as err:
        raise ValueError(f"eagle31-mla: the draft's aux layers cannot be served: {err}") from None


def target_form(model, ids: CanonicalAuxLayerIds) -> list[int]:
    """Try the one-based, then the zero-based form on the target itself and keep the one after which
    it stores exactly the wanted layers (what SGLang's targets store is one-based: see
    :mod:`eagle31_mla.serving.engine_facts.sglang`, so it is directly comparable)."""
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
                "eagle31-mla: cannot read back what %s captures; passing one-based %s", type(model).__name__, wanted
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
            value = getattr(inner, name, None)
            if value is not None:
                return value
    return None
