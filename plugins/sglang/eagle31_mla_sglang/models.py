"""Entry for ``SGLANG_EXTERNAL_MODEL_PACKAGE=eagle31_mla_sglang``: importing it installs the plugin. ``EntryClass``
is SGLang's own MLA drafter, unchanged: its name is what SGLang's MLA-cache list recognises."""

from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
from sglang.srt.plugins.hook_registry import HookRegistry

from . import register

register()
HookRegistry.apply_hooks()  # entry-point plugins get this from load_plugins(); here we apply ourselves

EntryClass = [Eagle3DeepseekV2ForCausalLM]
