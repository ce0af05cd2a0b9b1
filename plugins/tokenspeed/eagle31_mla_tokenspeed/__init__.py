"""TokenSpeed plugin for the EAGLE-3.1 MLA drafter of Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`).

Loaded in every TokenSpeed process through the ``tokenspeed.plugins`` entry point. The model card's
command, ``python3 -m tokenspeed.cli serve --model <Kimi-K3> --speculative-algorithm EAGLE3
--speculative-draft-model-path <the drafter> ...``, then needs nothing else to feed the drafter the
tensors it was trained on:

* **The drafter** is TokenSpeed's own ``Eagle3DeepseekV2ForCausalLM`` (:mod:`.drafter`), registered again
  under its name with ``override=True``: the same model, plus a profile that gives it MLA's latent cache
  and checkpoint names read in every layout (published, NeMo's ``model.`` prefix, ``midlayer.*``).
* **Aux ids.** TokenSpeed hands the target the first ids it finds in the draft config (nested
  ``eagle_config`` first), raw, and each target class reads them its own way (Kimi-K3 one-based,
  DeepSeek-V3 / Kimi-K2.5 add 1). The profile reads the draft's ids by this library's one rule
  (:mod:`eagle31_mla.model.aux_layers`) and writes them back in the form the served target class needs,
  checked on what that class's own setter stores; a form it cannot capture, or an explicit
  ``--eagle3-layers-to-capture`` that names other layers, stops serving with the reason.
* **Kimi-K3 stream.** TokenSpeed's Kimi-K3 target captures ``prefix_sum``, the prefix-only stream the
  drafter was trained on; the plugin confirms that in the installed TokenSpeed and refuses otherwise.
* **Loud failure.** TokenSpeed only warns when a plugin fails. If its plugin API version, registry or any
  symbol the plugin needs differs, the plugin registers a stand-in for the drafter whose profile raises
  :class:`PluginAPIError` naming them, so serving this drafter stops (other models are not affected).
"""

from __future__ import annotations

import logging

from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE as DRAFT_ARCHITECTURE

from .contract import SUPPORTED_RELEASES, PluginAPIError, api_problems, refusal

__all__ = ["register", "DRAFT_ARCHITECTURE", "PluginAPIError", "api_problems", "SUPPORTED_RELEASES"]

logger = logging.getLogger(__name__)


def register() -> None:
    """Called by TokenSpeed's plugin loader (``tokenspeed.runtime.plugins.ensure_loaded``), once per process."""
    from tokenspeed.runtime.plugins.registry import register_model  # without it there is no plugin API at all

    problems = api_problems()
    if problems:
        logger.error("eagle31-mla: TokenSpeed plugin disabled for %s: %s", DRAFT_ARCHITECTURE, "; ".join(problems))
        register_model(refusal(problems), architectures=(DRAFT_ARCHITECTURE,), override=True)
        return
    from .drafter import Eagle31MLADrafter

    register_model(Eagle31MLADrafter, architectures=(DRAFT_ARCHITECTURE,), override=True)
