"""Serve-time compatibility rules: whether this draft can be served with this target on this engine.

Each rule is written once, with one wording, and returns an :class:`Incompatibility` (or a list, or
None when all is well). Its callers only decide what to do with it: ``eagle31-mla doctor`` turns it
into a finding (the id is the finding's), the vLLM plugin raises ``ServingConfigError`` with its
:attr:`~Incompatibility.message`, ``speculative_generate`` raises ``DraftInputError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..model.aux_layers import AuxLayerIds
from .engine_facts import release_label
from .engine_facts.vllm import (
    FC_WIDTH_FOLLOWS_AUX_COUNT_FROM,
    KIMI_K3_FROM,
    KIMI_K3_STREAM_ENV,
    VllmFeatures,
    kimi_k3_stream_is_prefix,
)

__all__ = [
    "Incompatibility",
    "Sizes",
    "size_mismatches",
    "vllm_fc_width",
    "vllm_kimi_k3_version",
    "vllm_kimi_k3_stream",
    "last_layer_out_of_reach",
]


@dataclass(frozen=True)
class Incompatibility:
    #: the doctor finding id (stable: scripts match on it)
    id: str
    #: what is wrong, with the expected value where there is one
    problem: str
    #: what to do about it
    fix: str

    @property
    def message(self) -> str:
        """The one-line form raised by the plugin and the reference loop."""
        return f"{self.problem}; {self.fix}"


@dataclass(frozen=True)
class Sizes:
    """A target's sizes: the target's own (``hidden_size``, ``vocab_size``, ``num_hidden_layers``), or
    those a draft was built for (``target_hidden_size``, ``vocab_size``, ``target_num_hidden_layers``).
    None: not known, not compared."""

    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None


def size_mismatches(built_for: Sizes, target: Sizes, target_name: str = "the target") -> list[Incompatibility]:
    """The sizes the draft was built for against the target's: vocabulary, ``fc`` width, depth.

    Otherwise the engine starts and fails inside a matmul, drafts other tokens than it means, or reads
    the aux layers at other depths of another model."""
    found = []
    vocab, target_vocab = built_for.vocab_size, target.vocab_size
    if vocab is not None and target_vocab is not None and vocab != target_vocab:
        found.append(
            Incompatibility(
                "vocab-size-mismatch",
                f"the draft's `vocab_size` is {vocab} but {target_name}'s is {target_vocab} (the drafter embeds the "
                "target's tokens and maps its own into them, so draft tokens would be other tokens "
                "of the target, or out "
                f"of range; expected vocab_size = {target_vocab})",
                "serve the drafter with the target (tokenizer) it was trained for; a drafter cannot be re-vocabularied "
                "by editing config.json",
            )
        )
    width, target_width = built_for.hidden_size, target.hidden_size
    if width is not None and target_width is not None and width != target_width:
        found.append(
            Incompatibility(
                "hidden-size-mismatch",
                f"the draft's `target_hidden_size` is {width} but {target_name}'s `hidden_size` is {target_width} (its "
                f"`fc` takes n × {width} captured values; expected target_hidden_size = {target_width})",
                "serve the drafter with the target it was trained for (if the draft config just lacks "
                '"target_hidden_size", set it to the training target\'s hidden size)',
            )
        )
    depth, target_depth = built_for.num_layers, target.num_layers
    if depth is not None and target_depth is not None and depth != target_depth:
        found.append(
            Incompatibility(
                "target-depth-mismatch",
                f"the draft records `target_num_hidden_layers` {depth} (the target it was trained "
                f"for) but {target_name} "
                f"has {target_depth} layers (its aux layers would be read at other depths of another model; expected "
                f"target_num_hidden_layers = {target_depth})",
                "serve the drafter with the target it was trained for (if the draft config's "
                '"target_num_hidden_layers" is wrong, set it to the training target\'s layer count)',
            )
        )
    return found


def vllm_fc_width(engine: VllmFeatures, num_aux: int) -> Incompatibility | None:
    """Before 0.22 vLLM sizes ``fc`` for exactly 3 aux states, whatever the draft names."""
    if num_aux == 3 or engine.fc_width_follows_aux_count:
        return None
    since = release_label(FC_WIDTH_FOLLOWS_AUX_COUNT_FROM)
    return Incompatibility(
        "vllm-fc-width",
        f"vLLM before {since} sizes `fc` for exactly 3 aux states; the draft names {num_aux}",
        f"use vLLM >= {since} (its `fc` follows the draft)",
    )


def vllm_kimi_k3_version(engine: VllmFeatures, is_kimi_k3: bool) -> Incompatibility | None:
    if not is_kimi_k3 or engine.kimi_k3_target:
        return None
    since = release_label(KIMI_K3_FROM)
    return Incompatibility(
        "vllm-kimi-k3-version",
        f"Kimi-K3 targets need vLLM >= {since} (earlier releases have no Kimi-K3 model)",
        f"use vLLM >= {since}",
    )


def vllm_kimi_k3_stream(engine: VllmFeatures, is_kimi_k3: bool, environ: Mapping[str, str]) -> Incompatibility | None:
    """The drafter was trained on Kimi-K3's prefix-only stream; vLLM 0.28+ can be told to capture another."""
    stream = environ.get(KIMI_K3_STREAM_ENV)
    if not is_kimi_k3 or not engine.kimi_k3_stream_env or kimi_k3_stream_is_prefix(stream):
        return None
    return Incompatibility(
        "k3-aux-stream",
        f"{KIMI_K3_STREAM_ENV}={stream} makes the Kimi-K3 target capture the AttnRes mixture (the stream DSpark "
        "drafters use), but this drafter was trained on the prefix-only stream: nothing fails, acceptance just drops",
        f"unset it or set it to 0 (`unset {KIMI_K3_STREAM_ENV}`, or `export {KIMI_K3_STREAM_ENV}=0`)",
    )


def last_layer_out_of_reach(
    engine_name: str, target_class: str, ids: AuxLayerIds, num_layers: int
) -> Incompatibility | None:
    """For a target that captures the INPUT of layer i (:func:`~eagle31_mla.serving.engine_facts.captures_layer_input`):
    the output of its last layer is no layer's input, so a draft trained on it cannot be served there."""
    if max(ids.one_based) != num_layers:
        return None
    return Incompatibility(
        "aux-ids-beyond-target",
        f"{engine_name}'s {target_class} captures the INPUT of layer i, so it cannot capture the output of the last "
        f"layer (one-based {num_layers}); the draft wants {ids.describe()}",
        "serve this drafter with vLLM (its targets capture after a layer), or use a drafter trained on earlier layers",
    )
