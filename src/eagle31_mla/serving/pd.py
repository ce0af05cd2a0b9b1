"""PD-disaggregated serving (the drafter's KV moved with the target's): :func:`pd_commands` writes a pair and its
router, :func:`diagnose_pd` checks one (a prefill side without the decode side's drafter fails or drops acceptance).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import shlex
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from ..decoding.limits import DRAFTING_LIMITS
from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config
from .command import PD_CONNECTORS, ServeCommand, serve_command
from .doctor import NOTE, Finding, Report, _adder, diagnose
from .engine_facts import (
    ENGINE_NAMES,
    parse_release,
    sglang as sglang_facts,
    tokenspeed as tokenspeed_facts,
    vllm as vllm_facts,
)
from .engines import InputError, Target, read_config_json

FACTS = {"vllm": vllm_facts, "sglang": sglang_facts, "tokenspeed": tokenspeed_facts}
#: The ports the printed pair listens on (prefill, decode), per engine, and the ExampleConnector's shared folder.
PORTS = {"vllm": (8100, 8200), "sglang": (30000, 30001), "tokenspeed": (8000, 8001)}
SHARED_FOLDER = "/mnt/shared/kv-transfer"
#: Launchers recognised in a command line: the words before the options, per engine.
LAUNCHERS = {
    "vllm": (("vllm", "serve"), ("-m", "vllm.entrypoints.openai.api_server")),
    "sglang": (("sglang", "serve"), ("-m", "sglang.launch_server")),
    "tokenspeed": (("tokenspeed", "serve"),),
}


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
        sides = {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}
        return {**sides, "router": self.router, "comments": self.comments}


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
    """The prefill, decode and router commands; ``settings`` go to :func:`serve_command` (ValueError as there)."""
    sides = [serve_command(engine, target_name, draft_name, target, draft_config, **settings) for _ in range(2)]
    choices = PD_CONNECTORS[engine]
    connector = connector or choices[0]
    if connector not in choices:
        raise ValueError(f"--connector {connector} is not one of {ENGINE_NAMES[engine]}'s: {', '.join(choices)}")
    sides[1].comments = ["the same drafter and speculative settings as the prefill side"]
    (p, d), h = PORTS[engine], "127.0.0.1"
    for side, port in zip(sides, (p, d)):
        side.argv += ["--port", str(port)]
    if engine == "vllm":
        name = vllm_facts.PD_CONNECTORS[connector]
        hybrid_capable = name in vllm_facts.HMA_CONNECTORS
        if target.is_kimi_k3 and not hybrid_capable:
            raise ValueError(
                f"--connector {connector}: vLLM's Kimi-K3 is a hybrid model (KDA + MLA layers) and {name} cannot "
                "move a hybrid cache (no hybrid KV-cache manager): the server would not start; use nixl or mooncake"
            )
        roles = ("kv_both", "kv_both") if hybrid_capable else ("kv_producer", "kv_consumer")
        for i, (side, role) in enumerate(zip(sides, roles)):
            transfer = {"kv_connector": name, "kv_role": role}
            if connector == "example":
                transfer["kv_connector_extra_config"] = {vllm_facts.EXAMPLE_CONNECTOR_PATH_KEY: SHARED_FOLDER}
            side.argv += [vllm_facts.KV_TRANSFER_FLAG, json.dumps(transfer)]
            if connector == "nixl":
                side.env[vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV] = str(vllm_facts.NIXL_SIDE_CHANNEL_PORT_DEFAULT + i)
        router = vllm_facts.PD_PROXY.format(prefill_host=h, prefill_port=p, decode_host=h, decode_port=d)
        comments = [
            f"the drafter's KV-cache layer sits in the target's group and {name} moves it with the target's"
            + (f"; {SHARED_FOLDER}: a folder both instances share" if connector == "example" else "")
            + (f"; {vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV}: one per instance on a host" if connector == "nixl" else ""),
            "the router: vLLM's toy_proxy_server.py (tests/v1/kv_connector/nixl_integration/) or any that sends each "
            f"request to prefill (max_tokens 1), then to decode with the {vllm_facts.KV_TRANSFER_PARAMS_FIELD} it got",
        ]
    else:
        facts, boot = FACTS[engine], FACTS[engine].BOOTSTRAP_PORT_DEFAULT
        for side, mode in zip(sides, ("prefill", "decode")):
            side.argv += [facts.DISAGGREGATION_MODE_FLAG, mode, facts.TRANSFER_BACKEND_FLAG, connector]
        sides[0].argv += [facts.BOOTSTRAP_PORT_FLAG, str(boot)]
        urls = {"prefill_url": f"http://{h}:{p}", "decode_url": f"http://{h}:{d}"}
        router = facts.PD_ROUTER.format(**urls, bootstrap_port=boot)
        comments = [
            f"{ENGINE_NAMES[engine]} moves the drafter's KV with the target's ({connector}): same drafter on both"
        ]
    comments.append("check a pair with: eagle31-mla doctor --engine ENGINE --prefill-command ... --decode-command ...")
    return PdCommands(*sides, router, comments)


@dataclass(frozen=True)
class Launch:
    """What one side's launch sets that the pair must agree on (``role`` None: not disaggregated)."""

    engine: str
    target: str | None
    draft: str | None
    draft_settings: dict[str, Any]
    num_speculative_tokens: int | None
    dtype: str
    kv_cache_dtype: str
    role: str | None
    connector: str | None
    connector_settings: dict[str, Any]
    env: dict[str, str]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError(f"{self.where}: {message}")


def _json_option(value: str | None, flag: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(value or "{}")
    except (ValueError, RecursionError):
        raise InputError(f"{where}: {flag} is not JSON: {value[:120]!r}") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: {flag} must be a JSON object, got {value[:120]!r}")
    return data


#: The most draft steps, top-k or tokens a launch line may ask for: the largest of the library's drafting limits (a
#: tree's draft tokens), so that no count an engine could use is refused and an absurd one (1e40) is.
MAX_STEPS = DRAFTING_LIMITS["num_draft_tokens"]


def count(text: str) -> int:
    """SGLang's and TokenSpeed's speculative counts, as their parsers type them (int), within the drafting limits."""
    value = int(text)  # a ValueError: argparse's message names the flag and the value
    if not 1 <= value <= MAX_STEPS:
        raise ValueError
    return value


@functools.cache
def _own_parser(engine: str):
    """The installed engine's own launch parser, and for vLLM its SpeculativeConfig's fields (pydantic)."""
    if engine == "vllm":
        from vllm.config import SpeculativeConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return EngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False)), SpeculativeConfig.__pydantic_fields__
    server_args = {"sglang": "sglang.srt.server_args", "tokenspeed": "tokenspeed.runtime.utils.server_args"}[engine]
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    importlib.import_module(server_args).ServerArgs.add_cli_args(parser)
    return parser, {}


def _engine_rules(engine: str, args: list[str], where: str) -> None:
    """``args`` through the installed engine's own parser (for vLLM also each --speculative-config field through its
    SpeculativeConfig's type), where the engine imports here: what it refuses, the launch would. Where it does not
    (not installed; TokenSpeed needs a GPU), the library's typed checks stand alone."""

    def refuse(message: str):
        raise InputError(f"{where}: {ENGINE_NAMES[engine]}'s own rules refuse it: {' '.join(message.split())[:300]}")

    with warnings.catch_warnings(action="ignore"):  # the engines' import-time and pydantic's field warnings
        try:  # vLLM 0.29 logs to stdout as it imports: keep a --json answer clean
            with contextlib.redirect_stdout(sys.stderr):
                parser, fields = _own_parser(engine)
        except Exception:  # noqa: BLE001 - any failure to import an engine means: not importable here
            return
        parser.error = refuse  # argparse's error() prints the usage and exits
        spec = getattr(parser.parse_known_args(args)[0], "speculative_config", None) or {}
        from pydantic import TypeAdapter, ValidationError

        for key, value in spec.items():
            if key not in fields:
                refuse(f"--speculative-config has {key!r}, not a field of vLLM's SpeculativeConfig")
            try:
                TypeAdapter(Annotated[fields[key].annotation, fields[key]]).validate_python(value)
            except ValidationError as err:
                refuse(f"--speculative-config's {key} {value!r}: {err.errors()[0]['msg']}")


def _dashes(word: str) -> str:
    """``--kv_cache_dtype=fp8`` as ``--kv-cache-dtype=fp8``: the engines' parsers take either spelling."""
    flag, sep, value = word.partition("=")
    return flag.replace("_", "-") + sep + value if word.startswith("--") else word


def parse_launch(engine: str, command: str, where: str = "the command") -> Launch:
    """The settings of a launch ``command`` the pair must agree on, read as the engine's own parser reads them."""
    try:
        words = shlex.split(command)
    except ValueError as err:
        raise InputError(f"{where}: not a shell command line ({err})") from None
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        env.update([words.pop(0).split("=", 1)])
    launchers = LAUNCHERS[engine]
    starts = [i + len(x) for i in range(len(words)) for x in launchers if tuple(words[i : i + len(x)]) == x]
    if not starts:
        shown = " or ".join(" ".join(launcher) for launcher in launchers)
        name = ENGINE_NAMES[engine]
        raise InputError(f"{where}: expected {name}'s launch command ({shown} ...), got {command[:120]!r}")
    args = [_dashes(word) for word in words[starts[0] :]]
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.where = where
    parser.add_argument("model", nargs="?")
    parser.add_argument("--model", "--model-path", dest="model_flag")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    if engine == "vllm":
        parser.add_argument("--speculative-config")
        parser.add_argument(vllm_facts.KV_TRANSFER_FLAG)
        ns, _ = parser.parse_known_args(args)
        spec = _json_option(ns.speculative_config, "--speculative-config", where)
        transfer = _json_option(ns.kv_transfer_config, vllm_facts.KV_TRANSFER_FLAG, where)
        draft, steps = spec.get("model"), spec.get("num_speculative_tokens")
        counted = steps is None or type(steps) is int and 1 <= steps <= MAX_STEPS
        for key, value, ok, expected in (  # vLLM's own SpeculativeConfig types (its pydantic model refuses others)
            ("model", draft, draft is None or isinstance(draft, str), "a path or hub id"),
            ("method", spec.get("method"), spec.get("method") is None or isinstance(spec["method"], str), "a name"),
            ("num_speculative_tokens", steps, counted, f"an integer in [1, {MAX_STEPS}]"),
        ):
            if not ok:
                raise InputError(f"{where}: --speculative-config's {key} must be {expected}, got {value!r}")
        _engine_rules(engine, args, where)  # after the library's typed checks: their messages wherever it runs
        settings = {k: spec[k] for k in ("method", "revision", "dtype", "quantization") if spec.get(k) is not None}
        link = transfer.get("kv_role"), transfer.get("kv_connector"), transfer.get("kv_connector_extra_config") or {}
    else:
        facts = FACTS[engine]
        spec = ("algorithm", "draft_model_path", "draft_model_revision", "num_steps", "eagle_topk", "num_draft_tokens")
        for name in spec:
            counted = name in ("num_steps", "eagle_topk", "num_draft_tokens")
            parser.add_argument("--speculative-" + name.replace("_", "-"), type=count if counted else None)
        parser.add_argument("--speculative-draft-model", dest="speculative_draft_model_path")
        parser.add_argument(facts.DISAGGREGATION_MODE_FLAG, default="null")
        parser.add_argument(facts.TRANSFER_BACKEND_FLAG)
        ns, _ = parser.parse_known_args(args)
        _engine_rules(engine, args, where)
        draft, steps = ns.speculative_draft_model_path if ns.speculative_algorithm else None, None
        settings = {k: getattr(ns, f"speculative_{k}") for k in spec if k != "draft_model_path"}
        settings = {k: v for k, v in settings.items() if v is not None}
        role = None if ns.disaggregation_mode == "null" else ns.disaggregation_mode
        backend = ns.disaggregation_transfer_backend or getattr(facts, "TRANSFER_BACKEND_DEFAULT", "mooncake")
        link = role, backend if role else None, {}
    target = ns.model_flag or ns.model
    return Launch(engine, target, draft, settings, steps, ns.dtype, ns.kv_cache_dtype, *link, env)


def diagnose_pd(
    prefill: Launch,
    decode: Launch,
    *,
    version: str | None = None,
    with_plugin: bool = False,
    target: Target | None = None,
    draft_config: Mapping[str, Any] | None = None,
) -> Report:
    """The pair's problems, then doctor's checks of the decode side's draft and target."""
    findings: list[Finding] = []
    add = _adder(findings)
    if target is None and decode.target:
        target = Target.from_config(read_config_json(decode.target)[0], decode.target)
    _check_transfer(prefill, decode, target, add)
    _check_sides_agree(prefill, decode, add)
    details = []
    for side, role in ((prefill, "prefill"), (decode, "decode")):
        transfer = f"{side.connector} ({side.role})" if side.connector else "no KV transfer"
        drafter = f"drafter {side.draft}" if side.draft else "no drafter"
        details.append(f"PD pair: {role}: {side.target}, {drafter}, {transfer}, kv cache dtype {side.kv_cache_dtype}")
    if not (decode.draft and target is not None):
        shown, versions = target.describe() if target else str(decode.target), (version,) if version else ()
        return Report(
            decode.engine, versions, with_plugin, decode.draft or "(no drafter)", shown, None, "", findings, details
        )
    if draft_config is None:
        draft_config, _ = read_config_json(decode.draft)
    if prefill.draft and prefill.draft != decode.draft:  # two checkpoints: their aux layers, when readable
        try:
            configs = (read_config_json(prefill.draft)[0], draft_config)
            ids = [list(aux_layer_ids_from_config(config)[0].one_based) for config in configs]
        except (InputError, AuxLayerIdError):
            ids = [None, None]
        if ids[0] != ids[1]:
            problem = f"the prefill drafter reads aux layers {ids[0]}, the decode drafter {ids[1]}"
            add("pd-draft-differs", problem, "give both sides the same drafter")
    bug = vllm_facts.K3_PD_SPECULATION
    release = parse_release(version, "vllm") if version else vllm_facts.RELEASES[-1]
    if decode.engine == "vllm" and target.is_kimi_k3 and bug.affects(release):
        problem = "vLLM corrupts Kimi-K3 output when PD disaggregation and speculative decoding run together "
        fix = "until a release fixes it: serve Kimi-K3 with the drafter on instances without PD, or PD without it"
        add(bug.check, problem + f"({bug.cite()})", fix)
    if not isinstance(draft_config.get("kv_lora_rank"), int):
        problem = "the draft is not MLA: its KV is another cache spec beside the target's MLA one, moved as another "
        problem += "layer kind (vLLM keeps both in one KV-cache group only with one block size)"
        fix = "serve the MLA drafter (Eagle3DeepseekV2ForCausalLM), whose cache has the target's layout"
        add("pd-mha-draft-cache", problem, fix, NOTE)
    options = dict(environ=decode.env, with_plugin=with_plugin, draft_name=decode.draft)
    report = diagnose(draft_config, target, decode.engine, version, **options)
    report.findings, report.details = findings + report.findings, details
    return report


def _check_transfer(prefill: Launch, decode: Launch, target: Target | None, add) -> None:
    """Each side disaggregated, in its role, on a connector the engine (and the target) can use; both on one."""
    engine, name, facts = decode.engine, ENGINE_NAMES[decode.engine], FACTS[decode.engine]
    use = f"use one of {', '.join(PD_CONNECTORS[engine])}"
    for side, role in ((prefill, "prefill"), (decode, "decode")):
        if side.connector is None:
            flag = vllm_facts.KV_TRANSFER_FLAG if engine == "vllm" else facts.DISAGGREGATION_MODE_FLAG
            fix = f"add {flag} to the {role} command (serve-command --pd prints both)"
            add("pd-not-disaggregated", f"the {role} side has no {flag}: it moves no KV", fix)
            continue
        if engine == "vllm":
            roles = vllm_facts.KV_PRODUCER_ROLES if role == "prefill" else vllm_facts.KV_CONSUMER_ROLES
            if side.role not in roles:
                problem = f"the {role} side's kv_role is {side.role!r}; a {role} side's is one of {', '.join(roles)}"
                add("pd-roles", problem, f'set "kv_role": "{roles[-1]}" in its {vllm_facts.KV_TRANSFER_FLAG}')
        elif side.role != role:
            flag = facts.DISAGGREGATION_MODE_FLAG
            add("pd-roles", f"the {role} side runs with {flag} {side.role}", f"give it {flag} {role}")
        if side.connector not in (vllm_facts.KV_CONNECTORS if engine == "vllm" else facts.TRANSFER_BACKENDS):
            problem = f"the {role} side's connector {side.connector!r} is not one {name} has: it will not start"
            add("pd-connector-unknown", problem, use)
        elif role == "prefill" and side.connector in getattr(facts, "NO_PREFILL_BACKENDS", ()):
            add("pd-connector-unknown", f"{name} refuses the backend {side.connector!r} on a prefill server", use)
    p, d = ((s.connector, s.connector_settings) for s in (prefill, decode))
    if prefill.connector and decode.connector and p != d:
        problem = f"the sides transfer differently: prefill {p[0]} {json.dumps(p[1])}, decode {d[0]} {json.dumps(d[1])}"
        fix = "give both sides the same connector and settings (ExampleConnector: the same shared_storage_path)"
        add("pd-connector-mismatch", problem, fix)
    if engine != "vllm" or decode.connector is None:
        return
    connector = decode.connector
    if target is not None and target.is_kimi_k3 and connector not in vllm_facts.HMA_CONNECTORS:
        problem = f"vLLM's Kimi-K3 is a hybrid model (KDA + MLA layers) and {connector} cannot move a hybrid cache: "
        problem += "the server fails at startup"
        add("pd-hybrid-target-connector", problem, "use NixlConnector or MooncakeConnector (--connector nixl)")
    if connector == "ExampleConnector":
        problem = "ExampleConnector moves KV through files on a shared disk, synchronously: a connector for tests"
        add("pd-example-connector", problem, "for serving use NixlConnector or MooncakeConnector", NOTE)


#: What a decode side with a drafter meets when the prefill side has none, per engine.
NO_PREFILL_DRAFTER = {
    "vllm": "vLLM's decode engine fails at the first request (no KV for the drafter's layer; Nixl refuses the pair)",
    "sglang": "SGLang's decode drafter reads KV nobody wrote: the accept length drops, silently",
    "tokenspeed": "the decode side's drafter reads KV the prefill side never computed",
}


def _check_sides_agree(prefill: Launch, decode: Launch, add) -> None:
    """The same target, the same drafter, the same KV format on both sides."""
    if prefill.target != decode.target:
        problem = f"the sides serve different targets: {prefill.target} and {decode.target}"
        add("pd-target-differs", problem, "serve the same target checkpoint on both sides")
    if decode.draft and not prefill.draft:
        problem = f"the decode side speculates with {decode.draft} but the prefill side has no drafter: "
        fix = "launch the prefill side with the decode side's speculative settings (serve-command --pd prints both)"
        add("pd-prefill-without-draft", problem + NO_PREFILL_DRAFTER[decode.engine], fix)
    elif prefill.draft and not decode.draft:
        problem = "the prefill side has a drafter, the decode side none: decode runs without speculative decoding"
        add("pd-decode-without-draft", problem, "launch the decode side with the prefill side's speculative settings")
    elif prefill.draft and (prefill.draft, prefill.draft_settings) != (decode.draft, decode.draft_settings):
        problem = f"the sides run different drafters (prefill {prefill.draft} {json.dumps(prefill.draft_settings)}, "
        problem += f"decode {decode.draft} {json.dumps(decode.draft_settings)}): the decode drafter reads KV another "
        problem += "drafter computed (silent: the accept length drops)"
        add("pd-draft-differs", problem, "give both sides the same drafter checkpoint, revision, method and dtype")
    for what, flag in (("kv_cache_dtype", "--kv-cache-dtype"), ("dtype", "--dtype")):
        if (p := getattr(prefill, what)) != (d := getattr(decode, what)):
            problem = f"the sides' {flag} differ ({p} on prefill, {d} on decode): the decode side reads the KV, the "
            add("pd-kv-dtype-differs", problem + "drafter's too, in another format", f"give both sides the same {flag}")
    if decode.engine != "vllm":
        return
    steps = (prefill.num_speculative_tokens, decode.num_speculative_tokens)
    if prefill.draft and decode.draft and steps[0] != steps[1]:
        problem = f"num_speculative_tokens differs ({steps[0]} on prefill, {steps[1]} on decode): harmless"
        add("pd-draft-steps-differ", problem, "use the decode side's speculative config on both sides", NOTE)
    port = vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV
    if decode.connector == "NixlConnector" and prefill.env.get(port) == decode.env.get(port):
        value = decode.env.get(port) or vllm_facts.NIXL_SIDE_CHANNEL_PORT_DEFAULT
        problem = f"both sides use one {port} ({value}): two instances on one host cannot"
        add("pd-nixl-side-channel", problem, f"give each instance on a host its own {port}", NOTE)
