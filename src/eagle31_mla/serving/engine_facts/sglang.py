"""What SGLang does with an EAGLE-3 MLA draft, by release and by target class. Read from the sglang 0.5.23 wheel
(``srt/configs/model_config.py``, ``srt/model_executor/model_runner_components/spec_aux_hidden_state.py``, each
target's ``set_eagle3_layers_to_capture``), and from upstream main for the Kimi-K3 capture.

SGLang passes ONLY the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, raw, to the target's
``set_eagle3_layers_to_capture`` (top-level ids size the drafter's ``fc`` but are silently ignored for capture). The
target stores ``layers_to_capture`` and captures the input of layer i for each stored i, i.e. one-based
completed-layer id i (:func:`~eagle31_mla.serving.engine_facts.captures_layer_input`); without ids, [2, n//2, n-3].

SGLang's hard-coded MLA list (``ModelConfig``) holds one EAGLE-3 drafter name,
:data:`~eagle31_mla.model.configuration_eagle31_mla.ENGINE_ARCHITECTURE`: any other silently gets an MHA KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...model.aux_layers import engine_default_one_based_ids
from . import FIRST_ID_HEURISTIC, KIMI_K3_ARCHITECTURES, ONE_BASED, PLUS_ONE, release_label

#: Targets that add 1 to the ids only when the first id is 1 (sgl-project/sglang PR #25454), so a
#: zero-based list starting at 1 and a one-based list starting above 1 both work; any other first id
#: is taken as is. Kimi-K2 checkpoints are ``DeepseekV3ForCausalLM``; Kimi-K2.5 delegates to it.
FIRST_ID_HEURISTIC_TARGETS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Glm4MoeLiteForCausalLM",
)
#: Targets that always add 1 (they read zero-based "output of layer x" ids).
PLUS_ONE_TARGETS = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Gemma3ForCausalLM",
    "BailingMoeV2ForCausalLM",
    "LongcatFlashForCausalLM",
)
# Kimi-K3 targets (KIMI_K3_ARCHITECTURES): 0.5.23 has no EAGLE-3 capture for them (starting EAGLE-3
# raises); upstream main (and this project's SGLang plugin) stores one-based ids unchanged and captures
# the prefix-only AttnRes stream after each.

SUPPORTED_FROM = (0, 5, 23)
#: Releases whose facts were read: the version checks run over these when none is named.
RELEASES = ((0, 5, 23),)


@dataclass(frozen=True)
class SglangFeatures:
    version: tuple[int, int, int]
    #: Kimi-K3 targets have `set_eagle3_layers_to_capture`: False up to 0.5.23; None = not known
    #: (upstream main has it; the release that ships it was not confirmed).
    kimi_k3_eagle3_capture: bool | None

    @property
    def supported(self) -> bool:
        return self.version >= SUPPORTED_FROM

    def describe(self) -> str:
        return "SGLang " + release_label(self.version)


def features(version: tuple[int, int, int]) -> SglangFeatures:
    return SglangFeatures(version=version, kimi_k3_eagle3_capture=False if version <= (0, 5, 23) else None)


def target_reading(architectures: Sequence[str]) -> str | None:
    """How a target class reads the ids it is given (Kimi-K3: one-based); None: not in the table."""
    for name in architectures:
        if name in KIMI_K3_ARCHITECTURES:
            return ONE_BASED
        if name in FIRST_ID_HEURISTIC_TARGETS:
            return FIRST_ID_HEURISTIC
        if name in PLUS_ONE_TARGETS:
            return PLUS_ONE
    return None


def stored_layers(reading: str, ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """What a target stores (= the one-based layers it captures) when given ``ids`` (None: default)."""
    if ids is None:
        return engine_default_one_based_ids(num_layers)
    if reading == PLUS_ONE or (reading == FIRST_ID_HEURISTIC and ids and ids[0] == 1):
        return [i + 1 for i in ids]
    return list(ids)


# ---- what a running SGLang server reports about speculative decoding (``eagle31-mla acceptance --server``) ----
#
# Read from the sglang 0.5.23 wheel (``srt/entrypoints/openai/``, ``srt/managers/tokenizer_manager.py``).

#: The prefix of its Prometheus series (``/metrics`` exists only with --enable-metrics: http_server.py:314-317).
METRIC_PREFIX = "sglang:"
#: ``owned_by`` of its ``/v1/models`` entries (``openai/protocol.py:93``).
MODEL_OWNER = "sglang"
#: Speculative decoding is on with this server flag; without it no request carries the fields below.
SPEC_FLAG = "--speculative-algorithm"
#: Set true in a /v1/completions or /v1/chat/completions request body (``protocol.py:393,961``; no server flag) ...
SPEC_DETAILS_REQUEST_FIELD = "return_spec_tokens_details"
#: ... and the response carries ``sglext.spec_tokens_details`` (``SpecTokensDetails``, ``protocol.py:456-467``;
#: an object for n = 1; mapped from meta_info in ``openai/utils.py:310-351``), present only when the request
#: had verify rounds (``tokenizer_manager.py:3138-3206``: added only when ``spec_verify_ct > 0``).
SPEC_DETAILS_RESPONSE_FIELD = ("sglext", "spec_tokens_details")
#: Verify rounds of the request.
SPEC_VERIFY_CT = "spec_verify_ct"
#: Accepted drafts (the bonus token excluded): AL = 1 + correct / verify_ct, bonus included.
SPEC_NUM_CORRECT_DRAFTS = "spec_num_correct_drafts"
#: verify_ct * (speculative_num_draft_tokens - 1).
SPEC_NUM_PROPOSED_DRAFTS = "spec_num_proposed_drafts"
#: Index j: verify rounds that accepted exactly j drafts; only as long as the largest j seen
#: (``schedule_batch.py:1566-1572``).
SPEC_CORRECT_DRAFTS_HISTOGRAM = "spec_correct_drafts_histogram"
# (``spec_accept_length`` = completion_tokens / verify_ct counts the prefill token too: high by 1 / verify_ct.)
#: GET: the server's arguments (``model_path``, ``speculative_draft_model_path``, ...) and ``version``
#: (``http_server.py:863-892``).
SERVER_INFO_PATH = "/server_info"


# ---- PD-disaggregated serving (``eagle31-mla serve-command --pd``, ``doctor --prefill-command/--decode-command``) ----
#
# Read from the sglang 0.5.23 wheel: ``srt/arg_groups/fields/disagg.py``, ``srt/disaggregation/{prefill,decode,
# utils}.py``, ``.../common/conn.py``. With EAGLE/EAGLE3 the drafter's KV is transferred beside the target's (its
# layers take ids above the target's, ``build_kv_layer_ids``), with the prefill's draft top-k and hidden states; the
# decode side builds its first draft from them and starts with a verify step. A decode side with a drafter fed by a
# prefill side without one is tolerated (``conn.py``: "Decode has draft model KV while Prefill is deployed without
# speculative decoding"): the drafter then reads KV that nobody wrote.

DISAGGREGATION_MODE_FLAG = "--disaggregation-mode"  # null (default), prefill, decode
TRANSFER_BACKEND_FLAG = "--disaggregation-transfer-backend"
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori")
TRANSFER_BACKEND_DEFAULT = "mooncake"
#: Backends a prefill server refuses at startup ("fake" moves no KV: synthetic decode benchmarks only).
NO_PREFILL_BACKENDS = ("fake",)
BOOTSTRAP_PORT_FLAG = "--disaggregation-bootstrap-port"
BOOTSTRAP_PORT_DEFAULT = 8998
#: The router (the ``sglang-router`` package; ``docs/advanced_features/pd_disaggregation.md``).
PD_ROUTER = (
    "python -m sglang_router.launch_router --pd-disaggregation --prefill {prefill_url} --decode {decode_url} "
    "--host 0.0.0.0 --port 8000"
)
