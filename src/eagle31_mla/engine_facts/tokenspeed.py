"""What TokenSpeed does with an EAGLE-3 MLA draft (lightseekorg/tokenspeed 0.1.1; reference notes §5).

TokenSpeed has no plugin package: these facts are applied by :mod:`eagle31_mla.engines` and
:mod:`eagle31_mla.doctor` alone. Its ``_MLA_ARCHITECTURES`` list holds one drafter name,
:data:`~eagle31_mla.configuration_eagle31_mla.ENGINE_ARCHITECTURE`; any other name silently gets MHA.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import KIMI_K3_ARCHITECTURES, KIMI_K3_MODEL_TYPE, ONE_BASED, PLUS_ONE

__all__ = ["RELEASES", "LAYERS_FLAG", "ONE_BASED_TARGETS", "PLUS_ONE_TARGETS", "TOPK", "target_reading"]

RELEASES = ((0, 1, 1),)
#: Overrides the draft config's ids; passed raw to the target, so it is in the TARGET's convention.
LAYERS_FLAG = "--eagle3-layers-to-capture"
#: Kimi-K3 (and Kimi-Linear) targets store one-based completed-layer ids unchanged (sorted, distinct, within 1..n).
ONE_BASED_TARGETS = (*KIMI_K3_ARCHITECTURES, "KimiLinearForCausalLM")
#: DeepSeek-V3 / Kimi-K2.x targets always add 1: they read zero-based "output of layer x" ids.
PLUS_ONE_TARGETS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
#: ``--speculative-eagle-topk`` accepts only 1.
TOPK = 1


def target_reading(architectures: Sequence[str], model_type: str | None) -> str | None:
    """How a TokenSpeed target class reads the ids it is handed: "one_based", "plus_one", or None
    when this table does not know the class."""
    if any(a in ONE_BASED_TARGETS for a in architectures) or model_type == KIMI_K3_MODEL_TYPE:
        return ONE_BASED
    if any(a in PLUS_ONE_TARGETS for a in architectures):
        return PLUS_ONE
    return None
