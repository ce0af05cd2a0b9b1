"""Which target layers feed the drafter: the one home for aux-layer ids.

The same three Kimi-K3 tensors go by two names (SPEC §4):

* one-based "completed layers": id ``k`` is the residual stream after ``k`` target layers, Transformers'
  ``hidden_states[k]``. vLLM, TokenSpeed and upstream SGLang's Kimi-K3 capture use it: ``[2, 46, 90]``.
* zero-based "output of layer x": the training framework's config and SGLang's native DeepSeek loader: ``[1, 45, 89]``.

This library's canonical form is :class:`AuxLayerIds` (one-based); everything else converts through it.

Reading a third-party ``config.json`` needs a rule, because the same key holds either convention
depending on who wrote the file (:func:`aux_layer_ids_from_config`):

1. ``aux_layer_ids_convention`` ("one_based" | "zero_based") is honoured when present (this library's files).
2. A top-level ``eagle_aux_hidden_state_layer_ids`` is one-based: it is vLLM's key, and every engine
   that reads the top level reads it one-based.
3. Nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, unlabelled: zero-based when its smallest id is 0 or
   1 (the training framework's configs), one-based otherwise (its export adds 1; vLLM's default starts at 2). A
   one-based list that really starts at 1 must be labelled.
4. Both present: they must name the same layers, each read by its rule; else the file is refused.

A config with no ids is an error: guessing the engine default is the silent failure this module exists to prevent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ONE_BASED = "one_based"
ZERO_BASED = "zero_based"
CONVENTIONS = (ONE_BASED, ZERO_BASED)

#: The key under which files written by this library record the convention of their ids.
CONVENTION_KEY = "aux_layer_ids_convention"
#: vLLM's top-level key and the training framework's nested key share this name.
IDS_KEY = "eagle_aux_hidden_state_layer_ids"

KIMI_K3_NUM_LAYERS = 93


class AuxLayerIdError(ValueError):
    """Aux-layer ids that would make an engine feed the drafter the wrong tensors."""


def _check_convention(convention: Any) -> str:
    if convention not in CONVENTIONS:  # "" or false would read as unlabelled
        raise AuxLayerIdError(f"{CONVENTION_KEY}: expected one of {CONVENTIONS}, got {convention!r}")
    return convention


def _read_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise AuxLayerIdError(f"{where}: expected a non-empty list of ints, got {value!r}")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise AuxLayerIdError(f"{where}: every id must be an int, got {i!r} in {list(value)}")
    return list(value)


@dataclass(frozen=True)
class AuxLayerIds:
    """Canonical aux-layer ids: one-based, ascending, distinct, within ``num_target_layers`` when known."""

    one_based: tuple[int, ...]
    num_target_layers: int | None = None

    def __post_init__(self) -> None:
        ids = self.one_based
        where = "aux-layer ids (one-based completed layers)"
        if not isinstance(ids, tuple):
            raise AuxLayerIdError(f"{where}: expected a non-empty list of ints, got {ids!r}")
        _read_ids(ids, where)
        if min(ids) < 1:
            raise AuxLayerIdError(
                f"{where}: {list(ids)} contains {min(ids)}; one-based ids must be >= 1 "
                "(0 is the embedding output, which no EAGLE-3 drafter is trained on and which crashes "
                "vLLM's DeepSeek target)"
            )
        if len(set(ids)) != len(ids):
            raise AuxLayerIdError(
                f"{where}: {list(ids)} has duplicates; expected distinct ids (engines de-duplicate them, which "
                "silently changes the width of the tensor fed to `fc`)"
            )
        if list(ids) != sorted(ids):
            raise AuxLayerIdError(
                f"{where}: {list(ids)} is not ascending; engines concatenate aux states in ascending "
                f"layer order, so `fc` was trained on {sorted(ids)}: write them in that order"
            )
        n = self.num_target_layers
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise AuxLayerIdError(f"num_target_layers must be a positive int, got {n!r}")
            if max(ids) > n:
                raise AuxLayerIdError(
                    f"{where}: {list(ids)} goes beyond the target's depth of {n} layers "
                    f"(one-based ids must be <= {n}; zero-based <= {n - 1})"
                )

    @classmethod
    def from_convention(cls, ids: Sequence[int], convention: str, num_target_layers: int | None = None) -> AuxLayerIds:
        if _check_convention(convention) == ZERO_BASED:
            ids = _read_ids(tuple(ids), "zero-based aux-layer ids")
            if min(ids) < 0:
                raise AuxLayerIdError(f"zero-based aux-layer ids: {ids} contains {min(ids)}; ids must be >= 0")
            ids = [i + 1 for i in ids]
        return cls(tuple(ids), num_target_layers)

    @property
    def zero_based(self) -> tuple[int, ...]:
        """Zero-based "output of layer x" ids (training config, SGLang-native loader)."""
        return tuple(i - 1 for i in self.one_based)

    def __len__(self) -> int:
        return len(self.one_based)

    def with_target_depth(self, num_target_layers: int) -> AuxLayerIds:
        return AuxLayerIds(self.one_based, num_target_layers)

    def describe(self) -> str:
        return f"one-based {list(self.one_based)} = zero-based {list(self.zero_based)}"


#: The ids the published Kimi-K3 drafter was trained on (after zero-based layers 1, 45, 89).
KIMI_K3_AUX_LAYER_IDS = AuxLayerIds((2, 46, 90), KIMI_K3_NUM_LAYERS)


def aux_layer_ids_from_config(
    config: Mapping[str, Any], num_target_layers: int | None = None
) -> tuple[AuxLayerIds, str]:
    """The aux-layer ids of a ``config.json`` dict, read by the module's rule, and how they were read."""
    convention = config.get(CONVENTION_KEY)
    convention = None if convention is None else _check_convention(convention)
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, Mapping):
        raise AuxLayerIdError(f"eagle_config: expected a dict, got {type(eagle_config).__name__}")
    top = config.get(IDS_KEY)
    nested = eagle_config.get(IDS_KEY)
    if top is None and nested is None:
        if "target_layer_ids" in config:
            raise AuxLayerIdError(
                "config.json has a top-level `target_layer_ids` but no `eagle_aux_hidden_state_layer_ids`: "
                "vLLM's V2 runner adds 1 to `target_layer_ids`, so its meaning depends on the engine; write "
                "`eagle_aux_hidden_state_layer_ids` with `aux_layer_ids_convention` instead"
            )
        raise AuxLayerIdError(
            "config.json names no aux layers: expected `eagle_aux_hidden_state_layer_ids` at the top level "
            "or inside `eagle_config` (Kimi-K3: one-based [2, 46, 90] = zero-based [1, 45, 89]); engines "
            "would silently fall back to their own default"
        )

    readings: list[tuple[AuxLayerIds, str]] = []
    for label, key, value in (
        ("top-level", f"top-level {IDS_KEY}", top),
        ("eagle_config", f"eagle_config.{IDS_KEY}", nested),
    ):
        if value is None:
            continue
        ids = _read_ids(value, key)
        if convention:
            conv, why = convention, "labelled"
        elif label == "top-level":
            conv, why = ONE_BASED, "top-level ids are one-based (vLLM's key)"
        elif min(ids) <= 1:
            conv, why = ZERO_BASED, "unlabelled nested ids starting at 0/1 are the training framework's zero-based form"
        else:
            conv, why = ONE_BASED, "unlabelled nested ids starting above 1 are the exported one-based form"
        how = f"{label} {ids} read {conv} ({why})"
        readings.append((AuxLayerIds.from_convention(ids, conv, num_target_layers), how))

    first, how = readings[0]
    for other, other_how in readings[1:]:
        if other.one_based != first.one_based:
            raise AuxLayerIdError(
                f"config.json is contradictory about aux layers: {how} gives {first.describe()}, but "
                f"{other_how} gives {other.describe()}; keep one, or label them with `{CONVENTION_KEY}`"
            )
    return first, "; ".join(h for _, h in readings)


def aux_layer_ids_from_attributes(config: Any, num_target_layers: int | None = None) -> tuple[AuxLayerIds, str]:
    """:func:`aux_layer_ids_from_config` for a config object (an engine's parsed ``PretrainedConfig``)."""
    keys = (IDS_KEY, "eagle_config", CONVENTION_KEY, "target_layer_ids")
    raw = {key: getattr(config, key, None) for key in keys}
    return aux_layer_ids_from_config({k: v for k, v in raw.items() if v is not None}, num_target_layers)


def engine_default_one_based_ids(num_target_layers: int) -> list[int]:
    """The ids vLLM and SGLang capture when a draft names none: one-based ``(2, n // 2, n - 3)``."""
    n = num_target_layers
    return [2, n // 2, n - 3]


def aux_layer_ids_config_entries(ids: AuxLayerIds, convention: str = ONE_BASED) -> dict[str, Any]:
    """The ``config.json`` entries this library writes, labelled. Files get one-based: the top level for vLLM (both
    runners, every version) and TokenSpeed, the nested copy as published. A plugin handing a target the other form
    writes it labelled, so the entries still read back as ``ids``."""
    form = list(ids.one_based) if _check_convention(convention) == ONE_BASED else list(ids.zero_based)
    return {
        IDS_KEY: form,
        CONVENTION_KEY: convention,
        "eagle_config": {IDS_KEY: list(form), "use_aux_hidden_state": True},
    }


def write_aux_layer_ids(config: Any, ids: AuxLayerIds, convention: str = ONE_BASED) -> None:
    """Set :func:`aux_layer_ids_config_entries` on a config object, keeping other ``eagle_config`` keys."""
    entries = aux_layer_ids_config_entries(ids, convention)
    config.eagle_aux_hidden_state_layer_ids = entries[IDS_KEY]
    config.aux_layer_ids_convention = entries[CONVENTION_KEY]
    config.eagle_config = {**(getattr(config, "eagle_config", None) or {}), **entries["eagle_config"]}
