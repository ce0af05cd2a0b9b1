"""What TokenSpeed does with an EAGLE-3 MLA draft (lightseekorg/tokenspeed 0.1.1; reference notes §5), read offline
by ``doctor`` and at serve time by the plugin. Its ``_MLA_ARCHITECTURES`` list holds one drafter name,
:data:`~eagle31_mla.model.configuration_eagle31_mla.ENGINE_ARCHITECTURE`; any other name silently gets MHA. Paths
are in the 0.1.1 wheel (``tokenspeed/``); ``tests/engines/test_tokenspeed_plugin.py`` checks them.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import KIMI_K3_ARCHITECTURES, KIMI_K3_MODEL_TYPE, KIMI_K3_MULTIMODAL, ONE_BASED, PLUS_ONE, release_label

RELEASES = ((0, 1, 1),)
SUPPORTED_RELEASES = ", ".join(release_label(r) for r in RELEASES)


# ---- the plugin contract (``runtime/plugins/__init__.py``, ``runtime/plugins/registry.py``) ----
#
# Plugins are ``tokenspeed.plugins`` entry points whose no-argument ``register()`` runs at the top of every
# ``ModelConfig.__init__`` (``runtime/configs/model_config.py:482``), so in every process. A plugin whose
# ``register()`` raises only gets a ``UserWarning`` and its registrations are undone: failure is quiet.

#: Bumped by TokenSpeed "whenever a class or protocol on the plugin contract changes".
PLUGIN_API_VERSION = 2
#: What the plugin uses besides the registry, as ``module:qualified.name``: TokenSpeed's own MLA drafter and MLA
#: geometry, the function that reads the draft config's ids (``configure_draft_target`` in
#: ``runtime/execution/factory.py:161-202`` hands its result, or the flag, raw to the target), how the target's
#: config is read and its class resolved, and each target class's id setter.
PLUGIN_SYMBOLS = (
    "tokenspeed.runtime.configs.model_profile:ModelProfile",
    "tokenspeed.runtime.models.deepseek_v3:Eagle3DeepseekV2ForCausalLM",
    "tokenspeed.runtime.configs.model_config:configure_mla_attention",
    "tokenspeed.runtime.execution.factory:_eagle_aux_layer_ids",
    "tokenspeed.runtime.utils.hf_transformers_utils:get_config",
    "tokenspeed.runtime.models.registry:ModelRegistry.resolve_model_cls",
    "tokenspeed.runtime.models.kimi_k3:KimiK3ForConditionalGeneration.set_eagle3_layers_to_capture",
    "tokenspeed.runtime.models.kimi_k3:KimiLinearForCausalLM.set_eagle3_layers_to_capture",
    "tokenspeed.runtime.models.kimi_k3:KimiLinearModel.forward",
    "tokenspeed.runtime.models.deepseek_v3:DeepseekV3ForCausalLM.set_eagle3_layers_to_capture",
)
#: Where each target class keeps the ids it will capture, always as one-based completed-layer counts:
#: Kimi-K3's language model ``model.eagle3_layers_to_capture`` (a tuple, ``models/kimi_k3.py:3639-3658``);
#: DeepSeek-V3 ``model.layers_to_capture`` (a set of "capture before layer i" = after i layers,
#: ``models/deepseek_v3.py:2073-2080``, read at ``:1995-1997``). Kimi-K2.5 delegates to its DeepSeek-V3
#: ``language_model`` (``models/kimi_k25.py:274-281``).
STORED_IDS = {ONE_BASED: "eagle3_layers_to_capture", PLUS_ONE: "layers_to_capture"}
#: Multimodal wrappers whose setter delegates to their ``language_model``, and that model's class.
LANGUAGE_MODELS = {
    KIMI_K3_MULTIMODAL: "tokenspeed.runtime.models.kimi_k3:KimiLinearForCausalLM",
    "KimiK25ForConditionalGeneration": "tokenspeed.runtime.models.deepseek_v3:DeepseekV3ForCausalLM",
}
#: Kimi-K3's EAGLE-3 capture, the statement in ``KimiLinearModel.forward`` (``models/kimi_k3.py:3538-3540``)
#: under ``if capture_eagle3 and layer_idx + 1 in self.eagle3_layers_to_capture``: ``prefix_sum`` is what each
#: layer returns, the prefix-only AttnRes stream this drafter was trained on (the AttnRes mixture is only
#: read by DFLASH/DSpark taps, through ``dflash_aux_stream``). No flag or variable changes it.
K3_EAGLE3_CAPTURE = "aux_hidden_states.append(prefix_sum.clone())"

#: Overrides the draft config's ids; passed raw to the target, so it is in the TARGET's convention.
LAYERS_FLAG = "--eagle3-layers-to-capture"
#: Kimi-K3 (and Kimi-Linear) targets store one-based completed-layer ids unchanged (sorted, distinct, within 1..n).
ONE_BASED_TARGETS = (*KIMI_K3_ARCHITECTURES, "KimiLinearForCausalLM")
#: DeepSeek-V3 / Kimi-K2.x targets always add 1: they read zero-based "output of layer x" ids.
PLUS_ONE_TARGETS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
#: ``--speculative-eagle-topk`` accepts only 1.
TOPK = 1


def target_reading(architectures: Sequence[str], model_type: str | None) -> str | None:
    """How a TokenSpeed target class reads the ids it is handed; None: not in the table."""
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


# ---- PD-disaggregated serving (``eagle31-mla serve-command --pd``) ----
#
# Read from the tokenspeed 0.1.1 wheel (``runtime/utils/server_args.py``, ``runtime/pd/``,
# ``runtime/layers/attention/kv_cache/recipes/kimi_k3.py``) and its smg gateway: the draft's MLA layers join the
# target's full-attention group ("Draft MLA layers ... join the target's full-attention group"), so one registration
# moves both; tree drafting (topk > 1) is refused with PD, as is --enable-speculative-sampling on the prefill side.

DISAGGREGATION_MODE_FLAG = "--disaggregation-mode"  # null, prefill, decode, encode
TRANSFER_BACKEND_FLAG = "--disaggregation-transfer-backend"
TRANSFER_BACKENDS = ("mooncake",)
BOOTSTRAP_PORT_FLAG = "--disaggregation-bootstrap-port"
BOOTSTRAP_PORT_DEFAULT = 8998
#: The smg gateway (``smg/launch_router.py``): a prefill URL is followed by its bootstrap port.
PD_ROUTER = (
    "python -m smg.launch_router --pd-disaggregation --prefill {prefill_url} {bootstrap_port} --decode {decode_url}"
)
