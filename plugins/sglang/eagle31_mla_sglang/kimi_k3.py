"""EAGLE-3 capture for SGLang's Kimi-K3 target, which 0.5.23 lacks: the prefix-only stream the drafter was trained
on (after zero-based layer L, the layer outputs since L's AttnRes block began: ``residual.batch.snapshot``), never
the AttnRes mixture. Ids are one-based (Kimi-K3: [2, 46, 90]); forward hooks on the chosen layers capture them.
"""

from __future__ import annotations

import logging

import torch

from eagle31_mla.serving.engine_facts import KIMI_K3_ARCHITECTURES, KIMI_K3_LANGUAGE_MODEL, KIMI_K3_MULTIMODAL

logger = logging.getLogger(__name__)


def prefix_stream(layer_output, forward_batch) -> torch.Tensor:
    """Written residual + pending output (a copy)."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

    return residual_batch.snapshot(layer_output, forward_batch)


def set_eagle3_layers_to_capture_language_model(self, layer_ids=None):
    from eagle31_mla.model.aux_layers import AuxLayerIds, engine_default_one_based_ids

    n = self.config.num_hidden_layers
    ids = AuxLayerIds(tuple(layer_ids if layer_ids is not None else engine_default_one_based_ids(n)), n)
    model = self.model
    if self.pp_group.world_size != 1:
        raise NotImplementedError("eagle31-mla: Kimi-K3 EAGLE-3 capture supports pipeline parallel size 1")
    if getattr(model, "carries_bank_slices", False):
        raise RuntimeError(
            "eagle31-mla: SGLANG_K3_SP_ATTN_RES keeps only a shard of each row; nothing whole to capture"
        )
    if getattr(model, "dspark_layers_to_capture", None) is not None:
        raise RuntimeError("eagle31-mla: EAGLE-3 and DSpark capture cannot both be on")
    for handle in getattr(model, "_eagle31_handles", []):
        handle.remove()
    model.eagle3_layers_to_capture = list(ids.one_based)
    model._eagle31_buffer = None

    def capture(layer, args, kwargs, output):
        if model._eagle31_buffer is not None:
            model._eagle31_buffer.append(prefix_stream(output, kwargs["forward_batch"]))

    def open_buffer(module, args, kwargs):
        module._eagle31_buffer = []

    def return_aux(module, args, kwargs, output):
        buffer, module._eagle31_buffer = module._eagle31_buffer, None
        return (output, buffer) if isinstance(output, torch.Tensor) else output

    handles = [
        model.layers[x].register_forward_hook(capture, with_kwargs=True)  # after zero-based layer x
        for x in ids.zero_based
        if model.start_layer <= x < model.end_layer
    ]
    handles.append(model.register_forward_pre_hook(open_buffer, with_kwargs=True))
    handles.append(model.register_forward_hook(return_aux, with_kwargs=True))
    model._eagle31_handles = handles
    self.capture_aux_hidden_states = True  # the causal-LM forward then unpacks (hidden, aux)


def set_eagle3_layers_to_capture_multimodal(self, layer_ids=None):
    if self.language_model is None:
        raise AttributeError("eagle31-mla: EAGLE-3 capture is not available in encoder-only mode")
    self.language_model.set_eagle3_layers_to_capture(layer_ids)


def install_if_missing(model_class) -> None:
    """Add the methods to SGLang's Kimi-K3 classes, unless this SGLang already has its own."""
    if not any(cls.__name__ in KIMI_K3_ARCHITECTURES for cls in model_class.__mro__):
        return
    from sglang.srt.models import kimi_k3

    for name, method in (
        (KIMI_K3_LANGUAGE_MODEL, set_eagle3_layers_to_capture_language_model),
        (KIMI_K3_MULTIMODAL, set_eagle3_layers_to_capture_multimodal),
    ):
        cls = getattr(kimi_k3, name)
        if not hasattr(cls, "set_eagle3_layers_to_capture"):
            cls.set_eagle3_layers_to_capture = method
            logger.info("eagle31-mla: added EAGLE-3 prefix-stream capture to SGLang's %s", name)
