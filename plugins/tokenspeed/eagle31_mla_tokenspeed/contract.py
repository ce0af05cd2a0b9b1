"""What the plugin needs from TokenSpeed, checked: a TokenSpeed that differs stops serving the drafter, loudly."""

from __future__ import annotations

import pkgutil

from eagle31_mla.serving.engine_facts import release_label
from eagle31_mla.serving.engine_facts.tokenspeed import PLUGIN_API_VERSION, PLUGIN_SYMBOLS, RELEASES

__all__ = ["PluginAPIError", "api_problems", "installed_release", "refusal", "SUPPORTED_RELEASES"]

SUPPORTED_RELEASES = ", ".join(release_label(r) for r in RELEASES)


class PluginAPIError(RuntimeError):
    """This TokenSpeed lacks what the plugin needs: serving the drafter would feed it the wrong layers."""


def api_problems() -> list[str]:
    """What differs from the TokenSpeed the plugin was written for (empty when nothing does)."""
    problems = []
    try:
        from tokenspeed.runtime.plugins import PLUGIN_API_VERSION as installed_api
    except ImportError as err:
        return [f"`tokenspeed.runtime.plugins.PLUGIN_API_VERSION` cannot be read ({err})"]
    if installed_api != PLUGIN_API_VERSION:
        problems.append(f"plugin API version {installed_api!r} (the plugin is written for {PLUGIN_API_VERSION})")
    for symbol in PLUGIN_SYMBOLS:
        try:
            pkgutil.resolve_name(symbol)
        except (ImportError, AttributeError, ValueError) as err:
            problems.append(f"`{symbol}` is missing ({type(err).__name__}: {err})")
    return problems


def installed_release() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenspeed")
    except PackageNotFoundError:
        return "?"


def refusal(problems: list[str]) -> type:
    """A registry entry for the drafter's architecture that stops serving it, with the reason."""
    message = (
        "eagle31-mla: the TokenSpeed plugin cannot serve this drafter: " + "; ".join(problems) + ". Without it "
        "TokenSpeed would capture target layers for the drafter by its own reading of the draft config, which is "
        f"silently wrong for some configs and targets. The plugin supports TokenSpeed {SUPPORTED_RELEASES} "
        f"(installed: {installed_release()}); install a supported release, or serve without the plugin "
        "(TOKENSPEED_DISABLE_PLUGINS=eagle31_mla) and pass --eagle3-layers-to-capture in the target's convention "
        "(`eagle31-mla serve-command --engine tokenspeed` prints it)."
    )

    class Eagle31MLAUnsupportedTokenSpeed:
        @classmethod
        def model_profile(cls, hf_config):
            raise PluginAPIError(message)

    return Eagle31MLAUnsupportedTokenSpeed
