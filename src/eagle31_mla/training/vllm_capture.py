"""Capture a target's aux states with vLLM (0.29 and 0.32 tested), for training at a scale Transformers cannot run.

The speculative method ``extract_hidden_states`` stores the residual stream at the drafter's aux layers (the
top-level ids, slots ascending) and the hidden-states connector writes it per request. Teacher forcing is the whole
sequence as the prompt with one output token; the loss input is vLLM's top-k ``prompt_logprobs``. An in-process
engine is stepped until its scheduler is empty, or the connector writes nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..model.aux_layers import AuxLayerIds
from ..serving.engines import Target, read_config_json
from .captured import MANIFEST, CapturedDataError, CaptureManifest, inputs_digest, read_manifest, write_manifest
from .spool import write_shards

logger = logging.getLogger(__name__)

#: Where vLLM's connector writes its per-request files inside the capture folder (removed when done).
SPOOL = ".vllm-hidden-states"
#: The vLLM plugin's connector for the CPU build, named by module path (vLLM imports it; the core does not).
CPU_CONNECTOR_MODULE = "eagle31_mla_vllm.hidden_states_connector"
CPU_CONNECTOR = "CpuHiddenStatesConnector"


def top_k_table(position_logprobs: Sequence[dict | None], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, K] log-probabilities and ids of the K most likely tokens (vLLM's extra actual token dropped)."""
    values = torch.empty(len(position_logprobs), top_k)
    ids = torch.empty(len(position_logprobs), top_k, dtype=torch.int32)
    for t, entries in enumerate(position_logprobs):
        if entries is None or len(entries) < top_k:
            raise RuntimeError(
                f"vLLM gave {0 if entries is None else len(entries)} log-probabilities at position {t}; "
                f"expected at least {top_k}"
            )
        best = sorted(entries.items(), key=lambda item: -item[1].logprob)[:top_k]
        ids[t] = torch.tensor([token for token, _ in best], dtype=torch.int32)
        values[t] = torch.tensor([entry.logprob for _, entry in best])
    return values, ids


def _check_engine(target: Target) -> str:
    """The installed vLLM's version, once checked that it can capture, and captures Kimi-K3's prefix-only stream."""
    import vllm

    from ..serving import compatibility
    from ..serving.engine_facts import parse_release, release_label
    from ..serving.engine_facts.vllm import CAPTURE_FROM, features

    version = parse_release(vllm.__version__, "vllm")
    if version < CAPTURE_FROM:
        raise ValueError(
            f"capture needs vLLM >= {release_label(CAPTURE_FROM)} (its `extract_hidden_states` method and "
            f"hidden-states connector); vLLM {vllm.__version__} is installed"
        )
    if target.is_kimi_k3:
        rule = compatibility.vllm_kimi_k3_stream(features(version), True, os.environ)
        if rule is not None:
            raise ValueError(rule.message)
    return vllm.__version__


def _drain(llm) -> None:
    """Step an in-process engine until its scheduler holds no request (the connector writes then)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    for _ in range(10_000):
        if scheduler is None or not scheduler.has_requests():
            return
        core.step()
    raise RuntimeError("vLLM's scheduler still holds requests after 10000 steps; the hidden states were not written")


def _connector_config(spool: Path) -> dict[str, Any]:
    from vllm.platforms import current_platform

    config = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(spool)},
    }
    if current_platform.is_cpu():
        config.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=CPU_CONNECTOR_MODULE)
    return config


def _open_manifest(out: Path, fresh: CaptureManifest) -> CaptureManifest:
    """The folder's manifest when resuming (the same capture), else ``fresh``, written."""
    if not (out / MANIFEST).exists():
        write_manifest(out, fresh)
        return fresh
    found = read_manifest(out)
    for key in ("target", "aux_layer_ids", "dtype", "top_k", "inputs_sha256", "num_inputs", "loss_mask", "spool"):
        if getattr(found, key) != getattr(fresh, key):
            raise CapturedDataError(
                f"{out} holds a capture with another {key} ({getattr(found, key)!r}, now {getattr(fresh, key)!r}); "
                "resume with the same target, layers, dtype, top-k and inputs, or capture into a new folder"
            )
    return found


def capture_with_vllm(
    target: str,
    sequences: Sequence[Sequence[int]],
    aux_layer_ids: AuxLayerIds,
    out: str | Path,
    *,
    draft: str | None = None,
    dtype: str = "bfloat16",
    top_k: int = 64,
    engine_args: dict[str, Any] | None = None,
    sequences_per_shard: int = 64,
    progress: bool = True,
    max_shards: int | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
    loss_mask_kind: str = "all",
    spool: dict[str, int] | None = None,
) -> CaptureManifest:
    """Capture ``sequences`` through ``target`` in vLLM into ``out``, resuming what it holds. ``loss_masks`` (None:
    every token) are stored, labelled ``loss_mask_kind``; ``spool``: a part's entry (:func:`..spool.plan_part`);
    ``max_shards`` stops after that many new shards, as an interruption would (for tests)."""
    from tqdm.auto import tqdm

    info = Target.from_config(read_config_json(target)[0], target)
    if not info.num_layers or not info.hidden_size:
        raise ValueError(f"{target}: its config.json gives no readable num_hidden_layers / hidden_size")
    ids = aux_layer_ids.with_target_depth(info.num_layers)
    version = _check_engine(info)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(num_hidden_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size)
    manifest = _open_manifest(
        out,
        CaptureManifest(
            target=dict(name=target, architectures=list(info.architectures), **sizes),
            aux_layer_ids=list(ids.one_based),
            dtype=dtype,
            top_k=top_k,
            inputs_sha256=inputs_digest(sequences, loss_masks),
            num_inputs=len(sequences),
            engine=f"vllm {version}",
            draft=draft,
            loss_mask=loss_mask_kind,
            spool=spool,
        ),
    )
    pending = [i for i in range(len(sequences)) if i not in manifest.done]
    if not pending:
        return manifest

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    slots = list(ids.one_based)  # ascending: vLLM's slot order
    connector_dir = out / SPOOL
    llm = LLM(
        model=target,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": slots}},
        },
        kv_transfer_config=_connector_config(connector_dir),
        **{"max_logprobs": top_k, **(engine_args or {})},
    )

    def run_target(chunk: list[int]) -> list[tuple]:
        outputs = llm.generate(
            [{"prompt_token_ids": list(map(int, sequences[i]))} for i in chunk],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, logprobs=top_k),
            use_tqdm=False,
        )
        _drain(llm)
        items = []
        for i, output in zip(chunk, outputs):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"vLLM returned no hidden-states file for input sequence {i}")
            data = load_hidden_states(path)  # waits for the connector's write (its file lock)
            cleanup_hidden_states(path)
            states, token_ids = data["hidden_states"], data["token_ids"]
            if token_ids.tolist() != list(map(int, sequences[i])) or states.shape[1] != len(slots):
                raise RuntimeError(
                    f"vLLM's hidden-states file for input sequence {i} holds {list(states.shape)} for "
                    f"{token_ids.numel()} tokens; expected {len(sequences[i])} tokens x {len(slots)} layers {slots}"
                )
            # position t predicts x[t+1]: vLLM's prompt log-probabilities at t+1, then the generated token's
            logprobs, logprob_ids = top_k_table([*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]], top_k)
            mask = torch.ones(token_ids.numel()) if loss_masks is None else torch.tensor(loss_masks[i])
            items.append((i, token_ids, states.to(getattr(torch, dtype)), logprobs, logprob_ids, mask))
        return items

    bar = tqdm(total=len(sequences), initial=len(manifest.done), desc="capture", unit="seq", disable=not progress)
    started, tokens = time.monotonic(), 0
    try:
        limit, longest = llm.model_config.max_model_len, max(len(sequences[i]) for i in pending)
        if longest >= limit:  # vLLM's own limit, as it derived it; it would refuse the request (the run half done)
            raise CapturedDataError(
                f"a sequence of {longest} tokens; expected at most {limit - 1}: vLLM's max_model_len is {limit} and it "
                f"generates one token after each sequence (the last position's distribution); lower --seq-len or "
                f"raise max_model_len (--engine-args)"
            )
        for written, (count, shard_tokens) in enumerate(
            write_shards(out, manifest, sequences, run_target, sequences_per_shard=sequences_per_shard, say=tqdm.write),
            1,
        ):
            tokens += shard_tokens
            bar.update(count)
            bar.set_postfix(tokens_per_s=f"{tokens / max(time.monotonic() - started, 1e-9):.0f}")
            if max_shards is not None and written >= max_shards:
                break
    finally:
        bar.close()
        # vLLM 0.29 replaces its KV-connector agent (a module global) only for a next engine with a connector: one
        # started later without would inherit ours (and fail registering its caches)
        ensure_kv_transfer_shutdown()
    if connector_dir.is_dir() and not any(connector_dir.iterdir()):
        connector_dir.rmdir()
    logger.info("captured %d tokens in %.1f s", tokens, time.monotonic() - started)
    return manifest
