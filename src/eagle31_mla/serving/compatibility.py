"""Serve-time compatibility rules, each written once: ``doctor`` reports them, the plugins raise their message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..model.aux_layers import AuxLayerIdError, AuxLayerIds, aux_layer_ids_from_attributes
from .engine_facts import release_label, vllm as vllm_facts


class ServingConfigError(ValueError):
    """What a plugin refuses to serve (draft, target, flags, engine): the drafter would get other tensors than it was
    trained on. The message says why and what to do."""


class PluginAPIError(RuntimeError):
    """The installed engine lacks what its plugin needs: serving the drafter would feed it the wrong layers."""


def served_aux_ids(draft_config, depth: int | None, why: str = "cannot be served") -> tuple[AuxLayerIds, str]:
    """A plugin's reading of the draft config object's aux ids (and how) for a target of this depth."""
    try:
        return aux_layer_ids_from_attributes(draft_config, depth)
    except AuxLayerIdError as err:
        raise ServingConfigError(f"eagle31-mla: the draft's aux layers {why}: {err}") from None


@dataclass(frozen=True)
class Incompatibility:
    id: str  # the doctor finding id (stable: scripts match on it)
    problem: str  # what is wrong, with the expected value where there is one
    fix: str

    @property
    def message(self) -> str:
        """The one-line form the plugins and the reference loop raise."""
        return f"{self.problem}; {self.fix}"


@dataclass(frozen=True)
class Sizes:
    """A target's sizes, or those a draft was built for (:data:`SIZE_RULES`). None: not known, not compared."""

    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None


TRAINED_FOR = "serve the drafter with the target it was trained for"
#: Sizes field -> (id, the draft's key, what a mismatch does, the fix); the target's key is the draft's less "target_"
SIZE_RULES = {
    "vocab_size": ("vocab-size-mismatch", "vocab_size", "draft tokens would be other tokens", TRAINED_FOR),
    "hidden_size": (
        "hidden-size-mismatch",
        "target_hidden_size",
        "its `fc` takes n × target_hidden_size captured values",
        f"{TRAINED_FOR} (if the draft config just lacks target_hidden_size, set it to the training target's)",
    ),
    "num_layers": (
        "target-depth-mismatch",
        "target_num_hidden_layers",
        "its aux layers would be read at other depths of another model",
        f"{TRAINED_FOR} (if the draft config's target_num_hidden_layers is wrong, set it to the training target's)",
    ),
}


def size_mismatches(built_for: Sizes, target: Sizes, target_name: str = "the target") -> list[Incompatibility]:
    """The sizes the draft was built for against the target's (each mismatch's effect in :data:`SIZE_RULES`)."""
    found = []
    for attribute, (check, draft_key, consequence, fix) in SIZE_RULES.items():
        mine, theirs = getattr(built_for, attribute), getattr(target, attribute)
        if mine is not None and theirs is not None and mine != theirs:
            target_key = draft_key.removeprefix("target_")
            problem = f"the draft's `{draft_key}` is {mine} but {target_name}'s `{target_key}` is {theirs} "
            found.append(Incompatibility(check, f"{problem}({consequence}; expected {draft_key} = {theirs})", fix))
    return found


def vllm_fc_width(engine: vllm_facts.VllmFeatures, num_aux: int) -> Incompatibility | None:
    """Before 0.22 vLLM sizes ``fc`` for exactly 3 aux states, whatever the draft names."""
    if num_aux == 3 or engine.fc_width_follows_aux_count:
        return None
    since = release_label(vllm_facts.FC_WIDTH_FOLLOWS_AUX_COUNT_FROM)
    problem = f"vLLM before {since} sizes `fc` for exactly 3 aux states; the draft names {num_aux}"
    return Incompatibility("vllm-fc-width", problem, f"use vLLM >= {since} (its `fc` follows the draft)")


def vllm_kimi_k3_version(engine: vllm_facts.VllmFeatures, is_kimi_k3: bool) -> Incompatibility | None:
    if not is_kimi_k3 or engine.kimi_k3_target:
        return None
    since = release_label(vllm_facts.KIMI_K3_FROM)
    problem = f"Kimi-K3 targets need vLLM >= {since} (earlier releases have no Kimi-K3 model)"
    return Incompatibility("vllm-kimi-k3-version", problem, f"use vLLM >= {since}")


def vllm_kimi_k3_stream(
    engine: vllm_facts.VllmFeatures, is_kimi_k3: bool, environ: Mapping[str, str]
) -> Incompatibility | None:
    """The drafter was trained on Kimi-K3's prefix-only stream; vLLM 0.28+ can be told to capture another."""
    name = vllm_facts.KIMI_K3_STREAM_ENV
    stream = environ.get(name)
    if not is_kimi_k3 or not engine.kimi_k3_stream_env or vllm_facts.kimi_k3_stream_is_prefix(stream):
        return None
    problem = f"{name}={stream} makes the Kimi-K3 target capture the AttnRes mixture (the stream DSpark drafters use), "
    problem += "but this drafter was trained on the prefix-only stream: nothing fails, acceptance just drops"
    return Incompatibility("k3-aux-stream", problem, f"unset it or set it to 0 (`export {name}=0`)")


def last_layer_out_of_reach(
    engine_name: str, target_class: str, ids: AuxLayerIds, num_layers: int
) -> Incompatibility | None:
    """A target that captures the INPUT of layer i cannot capture its last layer's output, no layer's input."""
    if max(ids.one_based) != num_layers:
        return None
    problem = f"{engine_name}'s {target_class} captures the INPUT of layer i, so it cannot capture the output of the "
    problem += f"last layer (one-based {num_layers}); the draft wants {ids.describe()}"
    fix = "serve this drafter with vLLM (its targets capture after a layer), or use a drafter trained on earlier layers"
    return Incompatibility("aux-ids-beyond-target", problem, fix)
