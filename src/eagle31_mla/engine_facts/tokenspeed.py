"""What TokenSpeed does with an EAGLE-3 MLA draft (lightseekorg/tokenspeed 0.1.1; reference notes §5).

TokenSpeed has no plugin package: these facts are applied by :mod:`eagle31_mla.engines` and
:mod:`eagle31_mla.doctor` alone. Its ``_MLA_ARCHITECTURES`` list holds one drafter name,
:data:`~eagle31_mla.configuration_eagle31_mla.ENGINE_ARCHITECTURE`; any other name silently gets MHA.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import KIMI_K3_ARCHITECTURES, KIMI_K3_MODEL_TYPE, ONE_BASED, PLUS_ONE

__all__ = [
    "RELEASES",
    "LAYERS_FLAG",
    "ONE_BASED_TARGETS",
    "PLUS_ONE_TARGETS",
    "TOPK",
    "target_reading",
    "METRIC_PREFIX",
    "USAGE_DETAILS_FIELD",
    "ACCEPTED_PREDICTION_TOKENS",
    "REJECTED_PREDICTION_TOKENS",
    "REQUEST_ID_FIELD",
    "LOG_REQUEST_FINISH",
    "LOG_REQUEST_STATS",
    "LOG_DECODE_BATCH",
    "LOG_LINE_PREFIX",
]

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


# ---- what a running TokenSpeed server reports about speculative decoding (``eagle31-mla acceptance --server``) ----
#
# Read from the tokenspeed 0.1.1 sdist (``TS``) and the smg gateway it pins, tokenspeed-smg 1.10.1.post20260920
# (``SMG``): ``tokenspeed serve`` runs the smg gateway (Rust) in front of the engine, so the HTTP responses are smg's.

#: The prefix of the engine's Prometheus counters (``TS runtime/metrics/collector.py:227-247``; --enable-metrics).
METRIC_PREFIX = "tokenspeed:"
#: Per request (lightseekorg/tokenspeed PR #1443 + smg-project/smg PR #2481): the engine's meta_info
#: ``spec_accepted_tokens = completion_tokens - 1 - spec_verify_ct`` (``TS runtime/engine/output_processor.py:
#: 302-314``) reaches the response as ``usage.completion_tokens_details.accepted_prediction_tokens`` and
#: ``rejected_prediction_tokens`` = drafted - accepted (``SMG crates/protocols/src/common.rs:726-753``), only
#: when drafts were made; streaming only with ``stream_options.include_usage``. So, for n = 1:
#: verify rounds = completion_tokens - 1 - accepted, AL = (completion_tokens - 1) / rounds.
USAGE_DETAILS_FIELD = ("usage", "completion_tokens_details")
ACCEPTED_PREDICTION_TOKENS = "accepted_prediction_tokens"
REJECTED_PREDICTION_TOKENS = "rejected_prediction_tokens"
#: A request body's ``rid`` becomes the engine's request id exactly (``SMG model_gateway/src/routers/grpc/common/
#: stages/helpers.rs:168-183``; field at ``crates/protocols/src/chat.rs:359``, ``completion.rs:144``), so the
#: scheduler log's ``Req: {rid}`` lines can be matched to requests.
REQUEST_ID_FIELD = "rid"
#: The scheduler's per-request line at finish (``TS runtime/engine/generation_output_processor.py:538-545``),
#: ``accept_draft_tokens = (len(output_ids) - 1) / spec_verify_ct`` printed with ``str()`` (``:948-956``): the
#: bonus-inclusive AL with the prefill token left out. Written on attention-TP rank 0 only, and only without
#: --enable-log-request-stats ...
LOG_REQUEST_FINISH = "Req: {rid} Finish! Accept_num_tokens_avg: {accept_draft_tokens}"
#: ... which replaces it with the ``RequestStats`` dataclass repr (``generation_output_processor.py:547-560``,
#: ``TS runtime/engine/request_stats.py:129-218``): ``output_tokens=N`` and ``acc_len`` = that AL rounded to 2.
LOG_REQUEST_STATS = "Req: {rid} Finish! {stats}"
#: Every --decode-log-interval decode rounds (default 40) with speculative decoding on
#: (``TS runtime/engine/batch_log.py:173-213``): avg_accept_len = generated tokens / decode slots of the window.
LOG_DECODE_BATCH = (
    "Decode batch. #dp-rank: {dp_rank}, #running-req: {bs}, avg_seq_len: {avg_seq_len:.1f}, "
    "#pages(active/cached/total): {active}/{cached}/{total}, page ratio: {page_ratio:.2f}, "
    "gen throughput (token/s): {gen_throughput:.2f}, avg_accept_len: {avg_accept:.2f}, "
    "accept_rate: {accept_rate:.2f}, #queue-req: {queued}"
)
#: Each log line starts with this (``TS runtime/utils/common.py:468-474``: ``[%(asctime)s{prefix}] %(message)s``,
#: datefmt ``%Y-%m-%d %H:%M:%S``; prefix e.g. `` TP0``).
LOG_LINE_PREFIX = "[{asctime}{prefix}] "
