"""A Transformers target's side: the drafter's aux states read out of its forward, and the reference loop's target.

Aux id k is ``hidden_states[k]``, with one exception: in Transformers 5 ``hidden_states[num_hidden_layers]`` is
AFTER the final norm, while engines capture the pre-norm residual stream, so an id equal to the target's depth is
read with a forward hook on the last decoder layer. Training and the reference loop read them the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from ..model.aux_layers import AuxLayerIds


class TargetAuxCapture:
    """Reads the drafter's aux states [B, T, n·Ht] out of a target forward; a context manager (the hook)."""

    def __init__(self, target, aux_layer_ids: AuxLayerIds):
        self.depth = target.config.get_text_config().num_hidden_layers
        self.indices = aux_layer_ids.with_target_depth(self.depth).one_based  # = outputs.hidden_states indices
        self._last: torch.Tensor | None = None
        self._handle = None
        if self.depth in self.indices:
            layers = getattr(target.get_decoder(), "layers", None)
            if layers is None or len(layers) != self.depth:
                raise ValueError(
                    f"aux id {self.depth} is the target's last layer, which Transformers returns after the final norm; "
                    f"reading its pre-norm output needs the decoder layers (`model.layers`), not found on "
                    f"{type(target).__name__}"
                )
            self._handle = layers[-1].register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self._last = output[0] if isinstance(output, (tuple, list)) else output

    def __call__(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        if hidden_states is None or len(hidden_states) != self.depth + 1:
            raise ValueError(
                f"the target returned {None if hidden_states is None else len(hidden_states)} hidden states; "
                f"expected num_hidden_layers + 1 = {self.depth + 1} (embeddings, then one per layer)"
            )
        states = [self._last if i == self.depth else hidden_states[i] for i in self.indices]
        return torch.cat(states, dim=-1)  # [B, T, n·Ht], ascending layer order

    def __enter__(self) -> TargetAuxCapture:
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()


#: tokens per target forward when training reads a longer sequence: Transformers runs a prompt in one forward, and an
#: MLA target's attention (value narrower than key) takes SDPA's math path, whose scores grow with the square of the
#: sequence (8 GB per layer for the demo target at 32k tokens); chunks through the KV cache keep them to 4k x S.
PREFILL_CHUNK = 4096


@torch.no_grad()
def capture_target_states(target, input_ids: torch.Tensor, aux_layer_ids: AuxLayerIds):
    """The target's aux states [B, S, n·Ht] and next-token distributions [B, S, V]: what training learns from. A
    sequence longer than :data:`PREFILL_CHUNK` goes through the KV cache a chunk at a time (chunked prefill)."""
    with TargetAuxCapture(target, aux_layer_ids) as capture:
        S = input_ids.shape[1]
        if S <= PREFILL_CHUNK:
            out = target(input_ids, output_hidden_states=True)
            return capture(out.hidden_states), torch.softmax(out.logits.float(), dim=-1)
        cached = CachedTarget(target, capture)
        positions = torch.arange(S, device=input_ids.device).expand(input_ids.shape[0], -1)
        parts = [
            cached.forward(input_ids[:, i : i + PREFILL_CHUNK], positions[:, i : i + PREFILL_CHUNK])
            for i in range(0, S, PREFILL_CHUNK)
        ]
    logits, aux = (torch.cat(column, dim=1) for column in zip(*parts))
    return aux, torch.softmax(logits.float(), dim=-1)


class CachedTarget:
    """Forwards that fill one ``DynamicCache`` and return (logits, aux states); the cache rolled back."""

    def __init__(self, model, capture: TargetAuxCapture):
        from transformers import DynamicCache

        self.model, self.capture = model, capture
        self.device = next(model.parameters()).device  # the embeddings' device: inputs go there
        self.cache = DynamicCache(config=model.config)
        params = inspect.signature(model.forward).parameters
        # Transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns)
        self.cache_keyword = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params

    @property
    def length(self) -> int:  # the committed tokens, between rounds
        return self.cache.get_seq_length()

    def forward(self, ids, positions, mask=None, last_only=False):
        kwargs = dict(use_cache=True, output_hidden_states=True, position_ids=positions)
        kwargs[self.cache_keyword] = self.cache
        if mask is not None:  # bool (True = attend) -> additive (0 / dtype min): eager attention adds it to the scores
            dtype = self.model.dtype
            kwargs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(
                ~mask.to(self.device), torch.finfo(dtype).min
            )
        if last_only and self.keeps_logits:
            kwargs["logits_to_keep"] = 1  # a long prompt's logits over a large vocabulary are not needed
        out = self.model(ids, **kwargs)
        logits = out.logits[:, -1:] if last_only else out.logits
        return logits.to(self.device), self.capture(out.hidden_states).to(self.device)  # [1, T, V], [1, T, n·Ht]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a chain's accepted prefix): any cache layer can."""
        removed = self.cache.get_seq_length() - length
        if removed > 0:
            self.cache.crop(-removed)  # negative: tokens to remove (a positive value is a length on < 5.18 only)

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only ``positions`` (ascending) of every layer: an accepted tree path moves into place."""
        from transformers.cache_utils import DynamicLayer

        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"tree verification needs plain DynamicLayer cache layers; the target's cache has "
                    f"{type(layer).__name__} (sliding-window or linear-attention layers cannot drop single positions)"
                )
            layer.keys = layer.keys.index_select(-2, positions.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, positions.to(layer.values.device))
