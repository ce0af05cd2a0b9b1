"""PD-disaggregated serving: a prefill instance and a decode instance, the prompt's KV cache moved from the first to
the second, the drafter's latent KV cache with the target's.

What the MLA drafter changes: its one attention layer caches 576 values per token (kv_lora 512 + rope 64), the
target's MLA layout, so the engines keep it beside the target's layers (vLLM: the same KV-cache group; SGLang and
TokenSpeed: the same transfer) and move it with them. Two traps follow (the facts: :mod:`.engine_facts`):

* loud: a decode side with the drafter fed by a prefill side without it. vLLM's decode engine asks for a drafter
  layer nobody wrote and fails at the first request (ExampleConnector: ``FileNotFoundError ...
  model.layers.<depth>.self_attn.attn.safetensors``; NixlConnector: the handshake hashes the drafter and refuses);
  SGLang tolerates it, and its drafter reads KV nobody wrote (silent).
* silent: the drafter's KV arrives, but not the one the decode drafter would have computed (another drafter or
  dtype on the prefill side, a connector that garbles it): the output stays right (verification is lossless)
  and only the accept length drops. ``eagle31-mla acceptance --server URL --reference offline.json`` on the
  decode side turns it into a verdict; this module's checks catch the misconfigurations before launch.

:func:`pd_commands` writes a launch pair and its router (``serve-command --pd``); :func:`parse_launch` reads what
a launch command sets that both sides must agree on, and :func:`diagnose_pd` checks a pair (``doctor
--prefill-command ... --decode-command ...``). Nothing here needs an engine.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .command import ServeCommand, serve_command
from .doctor import NOTE, Finding, Report, diagnose
from .engine_facts import ENGINE_NAMES, sglang as sglang_facts, tokenspeed as tokenspeed_facts, vllm as vllm_facts
from .engines import InputError, Target, read_config_json

__all__ = ["Launch", "PdCommands", "parse_launch", "pd_commands", "diagnose_pd", "PD_CONNECTORS"]

#: What ``serve-command --pd --connector`` takes, per engine (the first is the default).
PD_CONNECTORS = {
    "vllm": tuple(vllm_facts.PD_CONNECTORS),
    "sglang": tuple(b for b in sglang_facts.TRANSFER_BACKENDS if b not in sglang_facts.NO_PREFILL_BACKENDS),
    "tokenspeed": tokenspeed_facts.TRANSFER_BACKENDS,
}
#: The ports the printed pair listens on (prefill, decode), per engine, and the ExampleConnector's shared folder.
PORTS = {"vllm": (8100, 8200), "sglang": (30000, 30001), "tokenspeed": (8000, 8001)}
SHARED_FOLDER = "/mnt/shared/kv-transfer"

#: Launchers recognised in a command line: the words before the options, per engine.
LAUNCHERS = {
    "vllm": (("vllm", "serve"), ("-m", "vllm.entrypoints.openai.api_server")),
    "sglang": (("sglang", "serve"), ("-m", "sglang.launch_server")),
    "tokenspeed": (("tokenspeed", "serve"),),
}


# ---- the pair --------------------------------------------------------------------------------------------------


@dataclass
class PdCommands:
    prefill: ServeCommand
    decode: ServeCommand
    router: str
    comments: list[str] = field(default_factory=list)

    def text(self) -> str:
        parts = [f"# {c}" for c in self.comments]
        parts += ["", "# 1. prefill", self.prefill.text(), "", "# 2. decode", self.decode.text()]
        return "\n".join(parts + ["", "# 3. the router: clients send requests here", self.router])

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "router": self.router,
            "comments": self.comments,
        }


def pd_commands(
    engine: str,
    target_name: str,
    draft_name: str,
    target: Target,
    draft_config: Mapping[str, Any],
    *,
    connector: str | None = None,
    **settings,
) -> PdCommands:
    """The prefill and decode launch commands for ``engine`` (the same drafter and speculative settings on both,
    the same KV dtype, the transfer settings), and the router's. ``settings`` go to :func:`serve_command`.
    ValueError for a combination that cannot serve (another engine's connector, a hybrid target with a connector
    that cannot move its cache, tree drafting on TokenSpeed)."""
    choices = PD_CONNECTORS.get(engine, ())
    connector = connector or (choices[0] if choices else None)
    if connector not in choices:
        raise ValueError(
            f"--connector {connector} is not one of {ENGINE_NAMES.get(engine, engine)}'s: {', '.join(choices)}"
        )
    sides = [serve_command(engine, target_name, draft_name, target, draft_config, **settings) for _ in range(2)]
    sides[1].comments = ["the same drafter and speculative settings as the prefill side"]
    (p_port, d_port), comments = PORTS[engine], []
    for side, port in zip(sides, (p_port, d_port)):
        side.argv += ["--port", str(port)]
    if engine == "vllm":
        name = vllm_facts.PD_CONNECTORS[connector]
        if target.is_kimi_k3 and name not in vllm_facts.HMA_CONNECTORS:
            raise ValueError(
                f"--connector {connector}: vLLM's Kimi-K3 is a hybrid model (KDA + MLA layers) and {name} cannot "
                "move a hybrid cache (no hybrid KV-cache manager): the server would not start; use nixl or mooncake"
            )
        roles = ("kv_both", "kv_both") if name in vllm_facts.HMA_CONNECTORS else ("kv_producer", "kv_consumer")
        extra = {vllm_facts.EXAMPLE_CONNECTOR_PATH_KEY: SHARED_FOLDER} if connector == "example" else {}
        for i, (side, role) in enumerate(zip(sides, roles)):
            transfer = {"kv_connector": name, "kv_role": role}
            if extra:
                transfer["kv_connector_extra_config"] = extra
            side.argv += [vllm_facts.KV_TRANSFER_FLAG, json.dumps(transfer)]
            if connector == "nixl":
                side.env[vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV] = str(vllm_facts.NIXL_SIDE_CHANNEL_PORT_DEFAULT + i)
        router = vllm_facts.PD_PROXY.format(
            prefill_host="127.0.0.1", prefill_port=p_port, decode_host="127.0.0.1", decode_port=d_port
        )
        comments.append(
            f"the drafter's KV-cache layer sits in the target's group and {name} moves it with the target's"
            + (f"; {SHARED_FOLDER}: a folder both instances share" if extra else "")
            + (f"; {vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV}: one per instance on a host" if connector == "nixl" else "")
        )
        comments.append(
            "the router: vLLM's example proxy (vllm-project/vllm tests/v1/kv_connector/nixl_integration/"
            "toy_proxy_server.py) or any that sends each request to prefill with max_tokens 1 and "
            f'{vllm_facts.KV_TRANSFER_PARAMS_FIELD} {{"do_remote_decode": true}}, then to decode with the '
            f"{vllm_facts.KV_TRANSFER_PARAMS_FIELD} prefill returned"
        )
    else:
        facts = sglang_facts if engine == "sglang" else tokenspeed_facts
        for side, mode in zip(sides, ("prefill", "decode")):
            side.argv += [facts.DISAGGREGATION_MODE_FLAG, mode, facts.TRANSFER_BACKEND_FLAG, connector]
        sides[0].argv += [facts.BOOTSTRAP_PORT_FLAG, str(facts.BOOTSTRAP_PORT_DEFAULT)]
        router = facts.PD_ROUTER.format(
            prefill_url=f"http://127.0.0.1:{p_port}",
            decode_url=f"http://127.0.0.1:{d_port}",
            bootstrap_port=facts.BOOTSTRAP_PORT_DEFAULT,
        )
        comments.append(
            f"{ENGINE_NAMES[engine]} transfers the drafter's KV with the target's ({connector}): both sides need "
            "the same drafter and speculative settings"
        )
    comments.append("check a pair with: eagle31-mla doctor --engine ENGINE --prefill-command ... --decode-command ...")
    return PdCommands(*sides, router, comments)


# ---- reading a launch command ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What one side's launch command sets that the pair must agree on."""

    engine: str
    command: str
    target: str | None
    draft: str | None  # the drafter's checkpoint; None: no speculative decoding
    #: the other drafter settings both sides must share (method, revision, dtype; SGLang: steps, topk)
    draft_settings: dict[str, Any]
    #: vLLM: num_speculative_tokens (a prefill side's may differ: its drafts are not verified)
    num_speculative_tokens: int | None
    dtype: str
    kv_cache_dtype: str
    #: vLLM: kv_role; SGLang, TokenSpeed: the disaggregation mode (None: not disaggregated)
    role: str | None
    #: vLLM: kv_connector; SGLang, TokenSpeed: the transfer backend
    connector: str | None
    connector_settings: dict[str, Any]
    env: dict[str, str]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError(message)


def _json_option(value: str | None, flag: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        raise InputError(f"{where}: {flag} is not JSON: {value[:120]!r}") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: {flag} must be a JSON object, got {value[:120]!r}")
    return data


def _dashes(word: str) -> str:
    """``--kv_cache_dtype=fp8`` as ``--kv-cache-dtype=fp8``: the engines' parsers take either spelling."""
    if not word.startswith("--"):
        return word
    flag, sep, value = word.partition("=")
    return flag.replace("_", "-") + sep + value


def parse_launch(engine: str, command: str, where: str = "the command") -> Launch:
    """The settings of ``command`` (a shell line: ``[NAME=VALUE ...] vllm serve MODEL ...``, ``sglang serve ...``,
    ``python -m ...``), read as the engine's own parser reads them (only the flags the pair must agree on;
    others are left alone). InputError for a line that is not that engine's launch command."""
    try:
        words = shlex.split(command)
    except ValueError as err:
        raise InputError(f"{where}: not a shell command line ({err})") from None
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    start = next(
        (
            i + len(launcher)
            for i in range(len(words))
            for launcher in LAUNCHERS[engine]
            if tuple(words[i : i + len(launcher)]) == launcher
        ),
        None,
    )
    if start is None:
        shown = " or ".join(" ".join(launcher) for launcher in LAUNCHERS[engine])
        raise InputError(
            f"{where}: expected {ENGINE_NAMES[engine]}'s launch command ({shown} ...), got {command[:120]!r}"
        )
    args = [_dashes(word) for word in words[start:]]
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--model", "--model-path", dest="model_flag")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    if engine == "vllm":
        parser.add_argument("--speculative-config", "-sc")
        parser.add_argument(vllm_facts.KV_TRANSFER_FLAG)
        ns, _ = parser.parse_known_args(args)
        spec = _json_option(ns.speculative_config, "--speculative-config", where)
        transfer = _json_option(ns.kv_transfer_config, vllm_facts.KV_TRANSFER_FLAG, where)
        draft = spec.get("model")
        settings = {k: spec.get(k) for k in ("method", "revision", "dtype", "quantization") if spec.get(k) is not None}
        steps, role, connector = (
            spec.get("num_speculative_tokens"),
            transfer.get("kv_role"),
            transfer.get("kv_connector"),
        )
        connector_settings = dict(transfer.get("kv_connector_extra_config") or {})
    else:
        facts = sglang_facts if engine == "sglang" else tokenspeed_facts
        parser.add_argument("--speculative-algorithm")
        parser.add_argument("--speculative-draft-model-path", "--speculative-draft-model")
        parser.add_argument("--speculative-draft-model-revision")
        parser.add_argument("--speculative-num-steps")
        parser.add_argument("--speculative-eagle-topk")
        parser.add_argument("--speculative-num-draft-tokens")
        parser.add_argument(facts.DISAGGREGATION_MODE_FLAG, default="null")
        parser.add_argument(facts.TRANSFER_BACKEND_FLAG)
        parser.add_argument(facts.BOOTSTRAP_PORT_FLAG)
        ns, _ = parser.parse_known_args(args)
        draft = ns.speculative_draft_model_path if ns.speculative_algorithm else None
        settings = {
            "algorithm": ns.speculative_algorithm,
            "revision": ns.speculative_draft_model_revision,
            "num_steps": ns.speculative_num_steps,
            "topk": ns.speculative_eagle_topk,
            "num_draft_tokens": ns.speculative_num_draft_tokens,
        }
        settings = {k: v for k, v in settings.items() if v is not None}
        steps = None
        role = None if ns.disaggregation_mode == "null" else ns.disaggregation_mode
        connector = ns.disaggregation_transfer_backend or (
            sglang_facts.TRANSFER_BACKEND_DEFAULT if engine == "sglang" else tokenspeed_facts.TRANSFER_BACKENDS[0]
        )
        connector_settings = {}
        if role is None:
            connector = None
    return Launch(
        engine,
        command,
        ns.model_flag or ns.model,
        draft,
        settings,
        steps,
        ns.dtype,
        ns.kv_cache_dtype,
        role,
        connector,
        connector_settings,
        env,
    )


# ---- checking a pair ---------------------------------------------------------------------------------------------


def _mla_values_per_token(config: Mapping[str, Any]) -> int | None:
    latent, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    return latent + rope if isinstance(latent, int) and isinstance(rope, int) else None


def _mha_values_per_token(config: Mapping[str, Any]) -> int | None:
    """K and V of every key-value head: what an MHA (Llama-style) drafter caches per token."""
    heads, kv_heads, hidden = (config.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if not all(isinstance(n, int) and n > 0 for n in (heads, hidden)):
        return None
    head_dim = config.get("head_dim") if isinstance(config.get("head_dim"), int) else hidden // heads
    return 2 * (kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads) * head_dim


def diagnose_pd(
    prefill: Launch,
    decode: Launch,
    *,
    version: str | None = None,
    with_plugin: bool = False,
    target: Target | None = None,
    draft_config: Mapping[str, Any] | None = None,
) -> Report:
    """The pair's problems (each side's transfer settings, the drafter and the KV format on both sides, the
    connector against the target), then doctor's own checks of the decode side's draft and target. Their
    config.json files are read here unless given; InputError when one cannot be read."""
    findings: list[Finding] = []
    _check_transfer(prefill, decode, findings.append)
    _check_sides_agree(prefill, decode, findings.append)
    if target is None and decode.target:
        target_json, _ = read_config_json(decode.target)
        target = Target.from_config(target_json, decode.target)
    _check_connector(decode, target, findings.append)
    pair = Report(
        decode.engine,
        (version,) if version else (),
        with_plugin,
        decode.draft or "(no drafter)",
        target.describe() if target else str(decode.target),
        None,
        "",
        findings,
    )
    pair.details = [f"PD pair: {_described(side, prefill)}" for side in (prefill, decode)]
    if not (decode.draft and target is not None):
        return pair
    if draft_config is None:
        draft_config, _ = read_config_json(decode.draft)
    if prefill.draft and prefill.draft != decode.draft:
        _check_prefill_drafter_ids(prefill, draft_config, findings.append)
    if _mla_values_per_token(draft_config) is None:
        findings.append(
            Finding(
                "pd-mha-draft-cache",
                f"the draft is not MLA: its KV ({_mha_values_per_token(draft_config) or 'unknown'} values per token "
                "and layer, against 576 for the MLA drafter's latent) is another cache spec beside the target's MLA "
                "one, moved as another layer kind (vLLM keeps both in one KV-cache group only with one block size)",
                "serve the MLA drafter (Eagle3DeepseekV2ForCausalLM), whose cache has the target's layout",
                NOTE,
            )
        )
    report = diagnose(
        draft_config,
        target,
        decode.engine,
        version,
        environ=decode.env,
        with_plugin=with_plugin,
        draft_name=decode.draft,
    )
    report.findings = findings + report.findings
    report.details = pair.details
    return report


def _side(side: Launch, prefill: Launch) -> str:
    return "prefill" if side is prefill else "decode"


def _described(side: Launch, prefill: Launch) -> str:
    transfer = f"{side.connector} ({side.role})" if side.connector else "no KV transfer"
    drafter = f"drafter {side.draft}" if side.draft else "no drafter"
    return f"{_side(side, prefill)}: {side.target}, {drafter}, {transfer}, kv cache dtype {side.kv_cache_dtype}"


def _check_transfer(prefill: Launch, decode: Launch, add) -> None:
    """Each side disaggregated, in its role, on a connector the engine has; both on the same one."""
    engine, name = decode.engine, ENGINE_NAMES[decode.engine]
    facts = {"vllm": vllm_facts, "sglang": sglang_facts, "tokenspeed": tokenspeed_facts}[engine]
    for side in (prefill, decode):
        role = _side(side, prefill)
        if side.connector is None:
            flag = vllm_facts.KV_TRANSFER_FLAG if engine == "vllm" else facts.DISAGGREGATION_MODE_FLAG
            fix = f"add {flag} to the {role} command (serve-command --pd prints both)"
            add(Finding("pd-not-disaggregated", f"the {role} side has no {flag}: it moves no KV", fix))
            continue
        if engine == "vllm":
            roles = vllm_facts.KV_PRODUCER_ROLES if role == "prefill" else vllm_facts.KV_CONSUMER_ROLES
            if side.role not in roles:
                add(
                    Finding(
                        "pd-roles",
                        f"the {role} side's kv_role is {side.role!r}; a {role} side's is one of {', '.join(roles)}",
                        f'set "kv_role": "{roles[-1]}" in the {role} side\'s {vllm_facts.KV_TRANSFER_FLAG}',
                    )
                )
            known = vllm_facts.KV_CONNECTORS
        else:
            if side.role != role:
                flag = facts.DISAGGREGATION_MODE_FLAG
                add(Finding("pd-roles", f"the {role} side runs with {flag} {side.role}", f"give it {flag} {role}"))
            known = facts.TRANSFER_BACKENDS
        if side.connector not in known:
            add(
                Finding(
                    "pd-connector-unknown",
                    f"the {role} side's connector {side.connector!r} is not one {name} has: it will not start",
                    f"use one of {', '.join(PD_CONNECTORS[engine])}",
                )
            )
        elif role == "prefill" and side.connector in getattr(facts, "NO_PREFILL_BACKENDS", ()):
            add(
                Finding(
                    "pd-connector-unknown",
                    f"the prefill side's backend {side.connector!r} moves no KV: {name} refuses it on a prefill server",
                    f"use one of {', '.join(PD_CONNECTORS[engine])}",
                )
            )
    if prefill.connector and decode.connector:
        p, d = (prefill.connector, prefill.connector_settings), (decode.connector, decode.connector_settings)
        if p != d:
            add(
                Finding(
                    "pd-connector-mismatch",
                    f"the sides transfer differently: prefill {_shown(*p)}, decode {_shown(*d)}",
                    "give both sides the same connector and settings (ExampleConnector: the same shared_storage_path)",
                )
            )


def _shown(connector: str, settings: Mapping[str, Any]) -> str:
    return connector + (f" {json.dumps(settings)}" if settings else "")


#: What a decode side with a drafter meets when the prefill side has none, per engine.
NO_PREFILL_DRAFTER = {
    "vllm": "vLLM's decode engine fails at the first request (ExampleConnector: no file for the drafter's layer; "
    "NixlConnector: the handshake, which hashes the drafter, is refused)",
    "sglang": "SGLang accepts it, and the decode side's drafter reads KV nobody wrote: the output stays right, the "
    "accept length drops, silently",
    "tokenspeed": "the decode side's drafter reads KV the prefill side never computed",
}


def _check_sides_agree(prefill: Launch, decode: Launch, add) -> None:
    """The same target, the same drafter, the same KV format on both sides."""
    if prefill.target != decode.target:
        add(
            Finding(
                "pd-target-differs",
                f"the sides serve different targets: {prefill.target} and {decode.target}",
                "serve the same target checkpoint on both sides",
            )
        )
    same_spec = "launch the prefill side with the decode side's speculative settings (serve-command --pd prints both)"
    if decode.draft and not prefill.draft:
        add(
            Finding(
                "pd-prefill-without-draft",
                f"the decode side speculates with {decode.draft} but the prefill side has no drafter: "
                + NO_PREFILL_DRAFTER[decode.engine],
                same_spec,
            )
        )
    elif prefill.draft and not decode.draft:
        add(
            Finding(
                "pd-decode-without-draft",
                "the prefill side has a drafter, the decode side none: decode runs without speculative decoding (and "
                "the prefill side computes the drafter's KV for nothing)",
                "launch the decode side with the prefill side's speculative settings",
            )
        )
    elif prefill.draft and (prefill.draft, prefill.draft_settings) != (decode.draft, decode.draft_settings):
        add(
            Finding(
                "pd-draft-differs",
                f"the sides run different drafters (prefill {prefill.draft} {json.dumps(prefill.draft_settings)}, "
                f"decode {decode.draft} {json.dumps(decode.draft_settings)}): the decode drafter reads KV another "
                "drafter computed (silent: the accept length drops; vLLM's NixlConnector refuses the handshake)",
                "give both sides the same drafter checkpoint, revision, method and dtype",
            )
        )
    for what, flag in (("kv_cache_dtype", "--kv-cache-dtype"), ("dtype", "--dtype")):
        p, d = getattr(prefill, what), getattr(decode, what)
        if p != d:
            add(
                Finding(
                    "pd-kv-dtype-differs",
                    f"the sides' {flag} differ ({p} on prefill, {d} on decode): the decode side reads the prefill "
                    "side's KV, the drafter's too, in another format",
                    f"give both sides the same {flag}",
                )
            )
    if decode.engine != "vllm":
        return
    steps = (prefill.num_speculative_tokens, decode.num_speculative_tokens)
    if prefill.draft and decode.draft and steps[0] != steps[1]:
        add(
            Finding(
                "pd-draft-steps-differ",
                f"num_speculative_tokens differs ({steps[0]} on prefill, {steps[1]} on decode): harmless (the prefill "
                "side's drafts are never verified), but one speculative config on both sides is simpler",
                "use the decode side's speculative config on both sides",
                NOTE,
            )
        )
    port = vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV
    if decode.connector == "NixlConnector" and prefill.env.get(port) == decode.env.get(port):
        add(
            Finding(
                "pd-nixl-side-channel",
                f"both sides use one {port} ({decode.env.get(port) or vllm_facts.NIXL_SIDE_CHANNEL_PORT_DEFAULT}): two "
                "instances on one host cannot",
                f"give each instance on a host its own {port}",
                NOTE,
            )
        )


def _check_connector(decode: Launch, target: Target | None, add) -> None:
    if decode.engine != "vllm" or decode.connector is None:
        return
    if target is not None and target.is_kimi_k3 and decode.connector not in vllm_facts.HMA_CONNECTORS:
        add(
            Finding(
                "pd-hybrid-target-connector",
                f"vLLM's Kimi-K3 is a hybrid model (KDA + MLA layers) and {decode.connector} cannot move a hybrid "
                "cache: vLLM turns its hybrid KV-cache manager off and the server fails at startup",
                "use NixlConnector or MooncakeConnector (serve-command --pd --connector nixl)",
            )
        )
    if decode.connector == "ExampleConnector":
        add(
            Finding(
                "pd-example-connector",
                "ExampleConnector writes each layer of each prompt prefix to a file on a shared disk and loads it "
                "synchronously: a connector for tests",
                "for serving use NixlConnector or MooncakeConnector",
                NOTE,
            )
        )


def _check_prefill_drafter_ids(prefill: Launch, decode_draft: Mapping[str, Any], add) -> None:
    """Two drafter checkpoints: their aux layers, when the prefill side's config.json can be read."""
    from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config

    try:
        prefill_draft, _ = read_config_json(prefill.draft)
        ids = [aux_layer_ids_from_config(config)[0].one_based for config in (prefill_draft, decode_draft)]
    except (InputError, AuxLayerIdError):
        return
    if ids[0] != ids[1]:
        add(
            Finding(
                "pd-draft-differs",
                f"the prefill drafter reads aux layers {list(ids[0])}, the decode drafter {list(ids[1])}",
                "give both sides the same drafter",
            )
        )
