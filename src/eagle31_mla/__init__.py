"""eagle31-mla: the EAGLE-3.1 MLA drafter for Kimi-K3 in Transformers, and its engine plugins.

Names are imported on first use, so ``import eagle31_mla`` (and the CLI's ``--help``) stays fast.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {  # name -> the module that defines it
    name: module
    for module, names in (
        ("model.aux_layers", "AuxLayerIds AuxLayerIdError KIMI_K3_AUX_LAYER_IDS"),
        ("model.configuration_eagle31_mla", "ConfigError Eagle31MLAConfig resolve_dtype"),
        ("model.modeling_eagle31_mla", "CheckpointError DraftInputError DraftOutput Eagle31MLAForCausalLM"),
        ("model.modeling_eagle31_mla", "Eagle31MLAOutput LatentKVCache check_sampling_settings"),
    )
    for name in names.split()
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
