"""What each serving engine does with a draft/target pair, from their ``config.json`` files and :mod:`.engine_facts`:
each ``*_capture`` answers which one-based layers the bare engine captures, and from which key of the draft config.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..locations import looks_like_a_local_path
from ..model.aux_layers import IDS_KEY, KIMI_K3_NUM_LAYERS, AuxLayerIds, engine_default_one_based_ids
from ..prompts import eos_token_ids
from .engine_facts import (
    KIMI_K3_MODEL_TYPE,
    KIMI_K3_MULTIMODAL,
    ONE_BASED,
    PLUS_ONE,
    is_kimi_k3_model,
    sglang as sglang_facts,
    tokenspeed as tokenspeed_facts,
)


class InputError(Exception):
    """A file or id that cannot be read: the CLI's exit code 2."""


def read_config_json(path_or_id: str) -> tuple[dict[str, Any], str]:
    """The ``config.json`` of a folder, a ``.json`` file, or a Hub repo id, and where it came from."""
    path = Path(path_or_id)
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise InputError(f"{path} has no config.json")
    elif path.is_file():
        file = path
    elif path.exists() or looks_like_a_local_path(str(path_or_id)):
        raise InputError(f"{path_or_id}: no such folder or file")
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(str(path_or_id), "config.json"))
        except Exception as err:  # offline and not cached, unknown repo, no network: all the same to a user
            raise InputError(f"{path_or_id}: cannot read its config.json ({type(err).__name__}: {err})") from None
    try:
        config = json.loads(file.read_text())
    except (OSError, RecursionError, ValueError) as err:
        # RecursionError: nesting deeper than Python's json reader goes; ValueError: not UTF-8 or JSON, an int too long
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise InputError(f"{file}: not a readable JSON file ({reason}); expected a config.json object") from None
    if not isinstance(config, dict):
        raise InputError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config, str(file)


def looks_like_a_drafter(config: Mapping[str, Any]) -> bool:
    """An ``Eagle`` architecture or an EAGLE key (``model_type`` says nothing: the published one is kimi_k2)."""
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    return any("eagle" in a.lower() for a in names) or IDS_KEY in config or "eagle_config" in config


def check_roles(
    target: Mapping[str, Any] | None, draft: Mapping[str, Any] | None, target_name: str = "", draft_name: str = ""
) -> None:
    """Refuse a drafter given as --target or a target given as --draft, from their config.json, before loading."""
    if target is not None and looks_like_a_drafter(target):
        raise InputError(
            f"argument --target: {target_name} is an EAGLE drafter (its config.json has EAGLE "
            "architectures / aux-layer keys); expected the target model it drafts for"
        )
    if draft is not None and not looks_like_a_drafter(draft):
        arch = (draft.get("architectures") or ["?"]) if isinstance(draft.get("architectures"), list) else ["?"]
        raise InputError(
            f"argument --draft: {draft_name} is not an EAGLE drafter (architectures {arch}, no "
            "eagle_aux_hidden_state_layer_ids); is it the target model?"
        )


def probe_output_folder(path: str | Path, what: str) -> None:
    """Create and remove a probe folder where ``path`` goes: some pass ``os.access`` and refuse (/proc, read-only)."""
    target = Path(path).expanduser().absolute()
    parent = target if target.is_dir() else target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".eagle31-mla-probe-", dir=parent))
    except OSError as err:
        raise InputError(
            f"{what}: cannot create {target} ({parent} refuses new folders: {err.strerror or err}); "
            "expected a writable location"
        ) from None


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Target:
    """What the checks need from a target's ``config.json`` (sizes from a multimodal wrapper's ``text_config``)."""

    name: str
    architectures: tuple[str, ...]
    model_type: str | None
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: fields of the config.json present with a value of the wrong type or shape (key, what was expected)
    unreadable: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "target") -> Target:
        text = config.get("text_config")
        text = text if isinstance(text, Mapping) else {}

        def get(key):
            return text.get(key, config.get(key))

        unreadable = []
        raw = config.get("architectures")
        architectures = [a for a in raw if isinstance(a, str) and a] if isinstance(raw, list) else []
        if not architectures or len(architectures) != len(raw):
            unreadable.append(("architectures", f"a non-empty list of class names, got {raw!r}"[:200]))
        model_type = config.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            unreadable.append(("model_type", f"a string, got {model_type!r}"[:200]))
        bos = get("bos_token_id")  # depth and sizes: target-depth-unknown / target-sizes-unknown
        if bos is not None and _int(bos) is None:
            unreadable.append(("bos_token_id", f"an integer token id, got {bos!r}"[:200]))
        eos = get("eos_token_id")
        if eos is not None and len(eos_token_ids(eos)) != (len(eos) if isinstance(eos, (list, tuple)) else 1):
            unreadable.append(("eos_token_id", f"an integer token id or a list of them, got {eos!r}"[:200]))
        return cls(
            name=name,
            unreadable=tuple(unreadable),
            architectures=tuple(architectures),
            model_type=model_type if isinstance(model_type, str) else None,
            num_layers=_int(get("num_hidden_layers")),
            hidden_size=_int(get("hidden_size")),
            vocab_size=_int(get("vocab_size")),
            bos_token_id=_int(get("bos_token_id")),
            eos_token_ids=eos_token_ids(get("eos_token_id")),
        )

    @property
    def is_kimi_k3(self) -> bool:
        return is_kimi_k3_model(self.model_type, self.architectures)

    def describe(self) -> str:
        arch = self.architectures[0] if self.architectures else self.model_type or "unknown architecture"
        depth = f"{self.num_layers} layers" if self.num_layers else "depth unknown"
        return f"{self.name} ({arch}, {depth})"


#: Kimi-K3 as its config.json describes it: the target the published drafter was trained for.
KIMI_K3_TARGET = Target(
    name="moonshotai/Kimi-K3",
    architectures=(KIMI_K3_MULTIMODAL,),
    model_type=KIMI_K3_MODEL_TYPE,
    num_layers=KIMI_K3_NUM_LAYERS,
    hidden_size=7168,
    vocab_size=163840,
    bos_token_id=163584,
    eos_token_ids=(163586,),
)


@dataclass(frozen=True)
class Capture:
    """The one-based ``layers`` the target captures (None: cannot tell) and where the engine took them from."""

    layers: tuple[int, ...] | None
    source: str


DEFAULT = "default"  # Capture.source when the engine fell back to the target's own choice
TOP_LEVEL = "top_level"
NESTED = "eagle_config"
TARGET_LAYER_IDS = "target_layer_ids"
FLAG = "flag"


def _id_list(value) -> list[int] | None:
    """A raw id list as an engine would take it (anything not a non-empty list counts as absent)."""
    if isinstance(value, (list, tuple)) and value and all(_int(v) is not None for v in value):
        return list(value)
    return None


def _nested(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    nested = config.get("eagle_config")
    return nested if isinstance(nested, Mapping) else None


def _default_layers(target: Target) -> list[int] | None:
    return engine_default_one_based_ids(target.num_layers) if target.num_layers else None


def vllm_capture(draft: Mapping[str, Any], target: Target, engine, runner: str) -> Capture:
    """vLLM's ``_get_eagle3_aux_layers_from_config`` (V1 runner) / ``get_eagle3_aux_layers_from_config`` (V2): the
    ids it uses, all read one-based; the target keeps ``sorted(set(ids))``."""
    ids, source = _id_list(draft.get(IDS_KEY)), TOP_LEVEL
    nested = _nested(draft)
    if ids is None and runner == "v1" and engine.v1_reads_nested_aux_ids and nested is not None:
        ids, source = _id_list(nested.get(IDS_KEY)), NESTED
    if ids is None and runner == "v2":
        target_layer_ids = _id_list(draft.get("target_layer_ids"))
        if target_layer_ids is not None:
            ids, source = [i + 1 for i in target_layer_ids], TARGET_LAYER_IDS
    if ids is None:
        ids, source = _default_layers(target), DEFAULT
    return Capture(tuple(sorted(set(ids))) if ids is not None else None, source)


def sglang_capture(draft: Mapping[str, Any], target: Target) -> Capture:
    """SGLang passes only the nested ids, raw, to the target class, which reads them its own way."""
    reading = sglang_facts.target_reading(target.architectures)
    nested = _nested(draft)
    ids = _id_list(nested.get(IDS_KEY)) if nested is not None else None
    source = NESTED if ids is not None else DEFAULT
    if reading is None or target.num_layers is None:
        return Capture(None, source)
    return Capture(tuple(sglang_facts.stored_layers(reading, ids, target.num_layers)), source)


def tokenspeed_capture(draft: Mapping[str, Any], target: Target, layers_flag: Sequence[int] | None = None) -> Capture:
    """TokenSpeed's ``_eagle_aux_layer_ids``: the flag, else the draft config (a nested ``eagle_config`` hides the
    top-level key; then ``text_config``), passed raw."""
    ids, source = (list(layers_flag), FLAG) if layers_flag else (None, DEFAULT)
    for config in (draft, draft.get("text_config")) if ids is None else ():
        if isinstance(config, Mapping):
            nested = _nested(config)
            ids = _id_list((config if nested is None else nested).get(IDS_KEY))
            if ids is not None:
                source = TOP_LEVEL if nested is None else NESTED
                break
    reading = tokenspeed_facts.target_reading(target.architectures, target.model_type)
    if reading is None or target.num_layers is None:
        return Capture(None, source)
    if ids is None:
        return Capture(tuple(_default_layers(target)), DEFAULT)
    return Capture(tuple(i + 1 for i in ids) if reading == PLUS_ONE else tuple(ids), source)


def tokenspeed_flag_form(target: Target, ids: AuxLayerIds) -> list[int] | None:
    """``--eagle3-layers-to-capture`` for this target: its own convention (None: unknown class)."""
    reading = tokenspeed_facts.target_reading(target.architectures, target.model_type)
    return {ONE_BASED: list(ids.one_based), PLUS_ONE: list(ids.zero_based)}.get(reading)
