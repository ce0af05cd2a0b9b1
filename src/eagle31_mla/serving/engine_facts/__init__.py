"""What the serving engines do, as plain data and pure functions (one module per engine; here what they share).
Nothing here imports an engine or torch; the plugins import the facts from here, never the other way round.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

ENGINES = ("vllm", "sglang", "tokenspeed")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tokenspeed": "TokenSpeed"}
#: The install line of this project's plugin for an engine.
PLUGIN_INSTALL = {engine: f'pip install "eagle31-mla[{engine}]"' for engine in ENGINES}


def parse_release(version: str, engine: str) -> tuple[int, int, int]:
    """A release string as a tuple: "0.22.1", "0.22", "0.32.0+cpu" -> (0, 22, 1), (0, 22, 0), (0, 32, 0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match:
        raise ValueError(f"cannot read a {ENGINE_NAMES[engine]} version from {version!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def release_label(version: tuple[int, ...]) -> str:
    """(0, 27) -> "0.27"; (0, 5, 23) -> "0.5.23"."""
    return ".".join(map(str, version))


# ---- Kimi-K3, the target the published drafter was trained for ----------------------------------------

KIMI_K3_MODEL_TYPE = "kimi_k3"
#: The class a Kimi-K3 checkpoint's config.json names (the multimodal wrapper) ...
KIMI_K3_MULTIMODAL = "KimiK3ForConditionalGeneration"
#: ... and its language model, which engines also serve on its own.
KIMI_K3_LANGUAGE_MODEL = "KimiK3LinearForCausalLM"
#: Every Kimi-K3 target class name the engines' tables key on.
KIMI_K3_ARCHITECTURES = (KIMI_K3_MULTIMODAL, KIMI_K3_LANGUAGE_MODEL)


def is_kimi_k3_model(model_type: str | None, architectures: Sequence[str] | None) -> bool:
    """A Kimi-K3 target: its ``model_type``, or any class name of the family (``KimiK3...``)."""
    return model_type == KIMI_K3_MODEL_TYPE or any("KimiK3" in a for a in architectures or ())


# ---- how a target class reads the aux-layer ids it is handed ----------------------------------------------

#: Stores one-based completed-layer ids as they are and captures AFTER each of those layers.
ONE_BASED = "one_based"
#: Adds 1 to every id (reads zero-based "output of layer x" ids).
PLUS_ONE = "plus_one"
#: Adds 1 only when the first id is 1 (SGLang's DeepSeek/Kimi-K2.x targets).
FIRST_ID_HEURISTIC = "first_id_heuristic"


def captures_layer_input(reading: str | None) -> bool:
    """Whether a target with this ``reading`` captures the INPUT of layer i for stored id i (SGLang's and TokenSpeed's
    non-Kimi-K3 targets): it cannot reach its last layer's output, which is no layer's input."""
    return reading in (PLUS_ONE, FIRST_ID_HEURISTIC)


# ---- open upstream bugs (doctor names each where it applies, with its source) --------------------------------------


@dataclass(frozen=True)
class UpstreamBug:
    """An engine bug that silently costs this drafter acceptance: doctor's check id, where it is reported, and the
    releases it affects (from ``since``; ``fixed_in`` None: every release the facts cover, as of ``as_of``)."""

    check: str
    source: str
    since: tuple[int, ...]
    fixed_in: tuple[int, ...] | None = None
    as_of: str = "2026-12-04"

    def affects(self, version: tuple[int, ...]) -> bool:
        return self.since <= version[: len(self.since)] and (self.fixed_in is None or version < self.fixed_in)

    def cite(self) -> str:
        state = "open" if self.fixed_in is None else f"fixed in {release_label(self.fixed_in)}"
        return f"{self.source}, {state} as of {self.as_of}"
