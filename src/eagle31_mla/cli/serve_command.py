"""``eagle31-mla serve-command``: the launch command for vLLM, SGLang or TokenSpeed, checked with doctor."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from . import params
from .common import error, option, subcommand

#: serve-command --pd --connector, per engine (eagle31_mla.serving.pd.PD_CONNECTORS, which imports nothing heavy)
CONNECTORS = {
    "vllm": ("nixl", "mooncake", "lmcache", "example"),
    "sglang": ("mooncake", "nixl", "ascend", "mori"),
    "tokenspeed": ("mooncake",),
}
DEFAULT_TARGET = "moonshotai/Kimi-K3"
DEFAULT_DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"


@subcommand("serve-command", "print the launch command for vLLM, SGLang or TokenSpeed")
@option("--engine", required=True, type=params.Choice(["vllm", "sglang", "tokenspeed"]))
@option("--target", default=DEFAULT_TARGET, type=params.CONFIG, metavar="PATH_OR_ID", help=f"default {DEFAULT_TARGET}")
@option("--draft", default=DEFAULT_DRAFT, type=params.CONFIG, metavar="PATH_OR_ID", help=f"default {DEFAULT_DRAFT}")
@option("--num-steps", type=params.NUM_STEPS, default=3, help="draft steps per verification (default 3)")
@option("--topk", type=params.TOPK, default=1, help="draft branches per step (default 1: a chain)")
@option("--num-draft-tokens", type=params.NUM_DRAFT_TOKENS, help="tokens verified per step (default: num-steps + 1)")
@option("--tp", type=params.POSITIVE_INT, metavar="N", help="tensor-parallel size")
@option(
    "--engine-version", type=params.VERSION, metavar="V", help="check against this release (default: the newest known)"
)
@option(
    "--pd",
    is_flag=True,
    help="PD-disaggregated: a prefill and a decode instance with the same drafter, and the router (see --connector)",
)
@option(
    "--connector",
    type=params.Choice(sorted({c for engine in CONNECTORS.values() for c in engine})),
    help="--pd: how KV moves from prefill to decode. vLLM: "
    + ", ".join(CONNECTORS["vllm"])
    + " (default nixl); SGLang: "
    + ", ".join(CONNECTORS["sglang"])
    + " (default mooncake); TokenSpeed: mooncake",
)
@option("--json", is_flag=True, help="machine-readable output")
def serve_command(args: SimpleNamespace) -> int:
    """Print the launch command for vLLM, SGLang or TokenSpeed serving --target with --draft: aux ids in
    that engine's form, the environment variable, topk / steps / draft tokens. The pair is checked with
    `doctor` (assuming the engine's eagle31-mla plugin); exit 1 if problems remain."""
    from ..serving.command import serve_command
    from ..serving.doctor import diagnose, engine_releases
    from ..serving.engines import KIMI_K3_TARGET, InputError, Target, read_config_json

    try:
        try:
            target_config, _ = read_config_json(args.target)
            target = Target.from_config(target_config, args.target)
        except InputError:
            if args.target != DEFAULT_TARGET:
                raise
            target = KIMI_K3_TARGET  # what its config.json says, for offline use
        try:
            draft, _ = read_config_json(args.draft)
        except InputError:
            if args.draft != DEFAULT_DRAFT:
                raise
            from ..model.configuration_eagle31_mla import Eagle31MLAConfig

            draft = Eagle31MLAConfig().to_dict()  # the published drafter's config, for offline use
        if args.connector and not args.pd:
            return error("argument --connector: applies to --pd only")
        settings = dict(
            num_steps=args.num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
            tensor_parallel_size=args.tp,
        )
        if args.pd:
            return _pd(args, target, draft, settings)
        command = serve_command(args.engine, args.target, args.draft, target, draft, **settings)
        version = args.engine_version or engine_releases(args.engine)[-1][0]
        report = diagnose(
            draft,
            target,
            args.engine,
            version,
            environ=dict(command.env),
            with_plugin=True,
            layers_to_capture=command.layers_to_capture,
            draft_name=args.draft,
        )
    except (InputError, ValueError) as err:
        return error(str(err))
    if not args.engine_version:
        command.comments.append(f"checked for {report.versions[0]} (pass --engine-version for yours)")
    if args.json:
        print(json.dumps({"command": command.to_dict(), "doctor": report.to_dict()}, indent=2))
    else:
        print(command.text())
    for f in report.problems:
        print(f"eagle31-mla: problem [{f.id}]: {f.problem}\n  fix: {f.fix}", file=sys.stderr)
    return 0 if report.ok else 1


def _pd(args: SimpleNamespace, target, draft: dict, settings: dict) -> int:
    """serve-command --pd: the pair and its router, read back as `doctor --prefill-command --decode-command` reads a
    pair (so what is printed is what doctor checks)."""
    from ..serving.doctor import engine_releases
    from ..serving.engines import InputError
    from ..serving.pd import diagnose_pd, parse_launch, pd_commands

    try:
        pair = pd_commands(args.engine, args.target, args.draft, target, draft, connector=args.connector, **settings)
        sides = [parse_launch(args.engine, side.line()) for side in (pair.prefill, pair.decode)]
        version = args.engine_version or engine_releases(args.engine)[-1][0]
        report = diagnose_pd(*sides, version=version, with_plugin=True, target=target, draft_config=draft)
    except (InputError, ValueError) as err:
        return error(str(err))
    if not args.engine_version:
        pair.comments.append(f"checked for {report.versions[0]} (pass --engine-version for yours)")
    if args.json:
        print(json.dumps({"pd": pair.to_dict(), "doctor": report.to_dict()}, indent=2))
    else:
        print(pair.text())
    for f in report.problems:
        print(f"eagle31-mla: problem [{f.id}]: {f.problem}\n  fix: {f.fix}", file=sys.stderr)
    return 0 if report.ok else 1
