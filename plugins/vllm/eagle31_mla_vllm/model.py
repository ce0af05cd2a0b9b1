"""The EAGLE-3.1 MLA drafter of Kimi-K3 in vLLM: the built-in ``Eagle3DeepseekV2ForCausalLM`` (found through vLLM's
model registry, wherever its module lives) plus the refusals
before any weight is read, ``fc_norm`` / ``norm_output`` where a release lacks them, and the library's checkpoint
layouts (docs/engines.md). Subclassing the built-in class keeps vLLM's runner check (``isinstance``) and all its
loading and logits code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm

from eagle31_mla.model.modeling_eagle31_mla import canonical_tensor_name, normalise_aux_chunks
from eagle31_mla.serving import compatibility
from eagle31_mla.serving.compatibility import ServingConfigError
from eagle31_mla.serving.engine_facts import is_kimi_k3_model
from eagle31_mla.serving.engine_facts.vllm import VllmFeatures, features

from . import builtin_drafter_class, installed_version

logger = logging.getLogger(__name__)


def check_serving(draft_hf_config, target_model_config, engine: VllmFeatures, environ=os.environ) -> None:
    """Every check that needs the target and the engine; raises :class:`ServingConfigError`."""
    depth = target_model_config.get_total_num_hidden_layers()
    ids, _ = compatibility.served_aux_ids(draft_hf_config, depth, "do not fit this target")
    target_hf_config = target_model_config.hf_config
    text = getattr(target_model_config, "hf_text_config", None) or target_hf_config
    # vLLM builds `fc` for target_hidden_size (else hidden_size); None is not compared; the ids met the real depth
    width = getattr(draft_hf_config, "target_hidden_size", None) or getattr(draft_hf_config, "hidden_size", None)
    built_for = compatibility.Sizes(width, getattr(draft_hf_config, "vocab_size", None))
    sizes = compatibility.Sizes(getattr(text, "hidden_size", None), getattr(text, "vocab_size", None))
    mismatches = compatibility.size_mismatches(built_for, sizes)
    if mismatches:  # otherwise the engine starts and fails inside a matmul, or drafts other tokens than it means
        problems = "; ".join(m.message for m in mismatches)
        raise ServingConfigError(f"eagle31-mla: the draft does not fit this target: {problems}")
    if not engine.supported:
        logger.warning("eagle31-mla: %s is outside the supported range 0.20-0.33", engine.describe())
    kimi_k3 = is_kimi_k3_model(target_hf_config.model_type, target_hf_config.architectures)
    for rule in (
        compatibility.vllm_fc_width(engine, len(ids)),
        compatibility.vllm_kimi_k3_version(engine, kimi_k3),
        compatibility.vllm_kimi_k3_stream(engine, kimi_k3, environ),
    ):
        if rule is not None:
            raise ServingConfigError(f"eagle31-mla: {rule.message} (this is {engine.describe()})")
    logger.info("eagle31-mla: target captures %s for the drafter (target depth %d)", ids.describe(), depth)


class Eagle31MLAEagle3ForCausalLM(builtin_drafter_class()):
    def __init__(self, *, vllm_config, prefix: str = ""):
        engine = features(installed_version())
        draft = vllm_config.speculative_config.draft_model_config.hf_config
        check_serving(draft, vllm_config.model_config, engine)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        fc_norm = bool(getattr(draft, "fc_norm", False))
        self.norm_output_in_plugin = bool(getattr(draft, "norm_output", False)) and not engine.applies_norm_output
        self.fc_norm_in_plugin = fc_norm and not engine.applies_fc_norm
        self.fc_norm_loaded_by_plugin = fc_norm and not engine.builds_fc_norm
        if self.fc_norm_loaded_by_plugin:  # vLLM < 0.22 builds no fc_norm and its loader drops the weights
            width = getattr(draft, "target_hidden_size", None) or draft.hidden_size
            n = len(draft.eagle_aux_hidden_state_layer_ids)
            self.model.fc_norm = nn.ModuleList(RMSNorm(width, eps=draft.rms_norm_eps) for _ in range(n))
        if self.fc_norm_in_plugin or self.norm_output_in_plugin:
            logger.info(
                "eagle31-mla: %s needs the plugin for fc_norm=%s norm_output=%s",
                engine.describe(),
                self.fc_norm_in_plugin,
                self.norm_output_in_plugin,
            )

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.fc_norm_in_plugin:
            return super().combine_hidden_states(hidden_states)
        out = self.model.fc(normalise_aux_chunks(hidden_states, self.model.fc_norm))
        return out[0] if isinstance(out, tuple) else out

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        out = super().forward(input_ids, positions, hidden_states, inputs_embeds)
        if not self.norm_output_in_plugin:
            return out
        normed = out[0] if isinstance(out, tuple) else out
        return normed, normed  # (for logits, for the next draft step): post-norm under norm_output

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        weights = ((canonical_tensor_name(name), tensor) for name, tensor in weights)
        if self.fc_norm_loaded_by_plugin:
            weights = self._load_fc_norm(weights)
        return super().load_weights(weights)

    def _load_fc_norm(self, weights):
        loaded = set()
        for name, tensor in weights:
            if name.startswith("fc_norm."):
                index = int(name.split(".")[1])
                self.model.fc_norm[index].weight.data.copy_(tensor)
                loaded.add(index)
            else:
                yield name, tensor
        missing = set(range(len(self.model.fc_norm))) - loaded
        if missing:
            raise ServingConfigError(f"eagle31-mla: config says fc_norm but fc_norm.{min(missing)}.weight is missing")
