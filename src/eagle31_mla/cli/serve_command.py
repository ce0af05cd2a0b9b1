"""``eagle31-mla serve-command``: the launch command for vLLM, SGLang or TokenSpeed, checked with doctor."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from . import params
from .common import error, option, subcommand

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
        command = serve_command(
            args.engine,
            args.target,
            args.draft,
            target,
            draft,
            num_steps=args.num_steps,
            topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
            tensor_parallel_size=args.tp,
        )
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
