"""TokenSpeed plugin (``tokenspeed.plugins`` entry point): its own MLA drafter registered again with a profile
(:mod:`.drafter`; docs/engines.md). TokenSpeed only warns when a plugin fails, so an unsupported TokenSpeed gets a
stand-in drafter whose profile raises ``PluginAPIError`` naming what is missing.
"""

from __future__ import annotations

import logging
import pkgutil
from importlib.metadata import version

from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE as DRAFT_ARCHITECTURE
from eagle31_mla.serving.compatibility import PluginAPIError
from eagle31_mla.serving.engine_facts import tokenspeed as facts

logger = logging.getLogger(__name__)


def register() -> None:
    """Called by TokenSpeed's plugin loader (``tokenspeed.runtime.plugins.ensure_loaded``), once per process."""
    from tokenspeed.runtime.plugins import PLUGIN_API_VERSION as installed_api
    from tokenspeed.runtime.plugins.registry import register_model  # without it there is no plugin API at all

    problems = []
    if installed_api != facts.PLUGIN_API_VERSION:
        problems.append(f"plugin API version {installed_api!r} (the plugin is written for {facts.PLUGIN_API_VERSION})")
    for symbol in facts.PLUGIN_SYMBOLS:
        try:
            pkgutil.resolve_name(symbol)
        except (ImportError, AttributeError, ValueError) as err:
            problems.append(f"`{symbol}` is missing ({type(err).__name__}: {err})")
    if not problems:
        from .drafter import Eagle31MLADrafter

        register_model(Eagle31MLADrafter, architectures=(DRAFT_ARCHITECTURE,), override=True)
        return
    logger.error("eagle31-mla: TokenSpeed plugin disabled for %s: %s", DRAFT_ARCHITECTURE, "; ".join(problems))
    message = (
        "eagle31-mla: the TokenSpeed plugin cannot serve this drafter: " + "; ".join(problems) + ". Without it "
        "TokenSpeed would capture target layers for the drafter by its own reading of the draft config, which is "
        f"silently wrong for some configs and targets. The plugin supports TokenSpeed {facts.SUPPORTED_RELEASES} "
        f"(installed: {version('tokenspeed')}); install a supported release, or serve without the plugin "
        "(TOKENSPEED_DISABLE_PLUGINS=eagle31_mla) and pass --eagle3-layers-to-capture in the target's convention "
        "(`eagle31-mla serve-command --engine tokenspeed` prints it)."
    )

    class Eagle31MLAUnsupportedTokenSpeed:
        @classmethod
        def model_profile(cls, hf_config):
            raise PluginAPIError(message)

    register_model(Eagle31MLAUnsupportedTokenSpeed, architectures=(DRAFT_ARCHITECTURE,), override=True)
