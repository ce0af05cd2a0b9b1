"""``eagle31-mla doctor``: the silent misconfigurations of a draft + target + engine, with fixes."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from . import params
from .common import error, option, subcommand


@subcommand("doctor", "find silent misconfigurations of a draft + target + engine, with fixes")
@option("--draft", type=params.CONFIG, metavar="PATH_OR_ID", help="the drafter: folder, config.json, or Hub repo id")
@option(
    "--target", type=params.CONFIG, metavar="PATH_OR_ID", help="the target model: folder, config.json, or Hub repo id"
)
@option("--engine", type=params.Choice(["vllm", "sglang", "tokenspeed"]))
@option(
    "--engine-version", type=params.VERSION, metavar="V", help="e.g. 0.22.1 (default: every release the facts cover)"
)
@option("--with-plugin", is_flag=True, help="assume this project's plugin is installed where the engine runs")
@option("--tp", type=params.POSITIVE_INT, metavar="N", help="the tensor-parallel size it will be served at")
@option("--pp", type=params.POSITIVE_INT, metavar="N", help="the pipeline-parallel size it will be served at")
@option(
    "--eagle3-layers-to-capture",
    type=params.LAYER_IDS,
    metavar="IDS",
    help="TokenSpeed: the flag value you will pass, e.g. 2,46,90",
)
@option(
    "--env",
    multiple=True,
    type=params.ENV_ASSIGNMENT,
    metavar="NAME=VALUE",
    help="the serving environment (default: this shell's), e.g. VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0",
)
@option(
    "--prefill-command",
    type=params.LAUNCH_COMMAND,
    metavar="COMMAND",
    help="a PD-disaggregated pair: the prefill instance's launch command (quoted; with --decode-command; the draft "
    "and target come from the commands)",
)
@option("--decode-command", type=params.LAUNCH_COMMAND, metavar="COMMAND", help="the decode instance's launch command")
@option("--json", is_flag=True, help="machine-readable output")
@option("--list-checks", is_flag=True, help="list every check id and what it catches")
def doctor(args: SimpleNamespace) -> int:
    """Find every silent misconfiguration of a draft + target + engine (aux ids and their convention per
    engine and release, vLLM's V2-runner and target_layer_ids traps, SGLang's first-id rule, Kimi-K3
    capture and stream, EAGLE-3.1 support, MLA detection, depth, vocabulary, sizes, bos/eos), each with
    its exact fix. Reads only the two config.json files. Exit 0 only when nothing is wrong."""
    from ..serving.doctor import CHECKS, diagnose
    from ..serving.engines import InputError, Target, looks_like_a_drafter, read_config_json

    if args.list_checks:
        for check, what in CHECKS.items():
            print(f"{check:<30} {what}")
        return 0
    pd = args.prefill_command or args.decode_command
    needed = ("--prefill-command", "--decode-command", "--engine") if pd else ("--draft", "--target", "--engine")
    if missing := [flag for flag in needed if not getattr(args, flag[2:].replace("-", "_"))]:
        return error(f"{'a PD pair' if pd else 'doctor'} needs {', '.join(missing)}")
    try:
        if pd:
            report = _pd(args)
        else:
            layers = args.eagle3_layers_to_capture
            if layers is not None and args.engine != "tokenspeed":
                raise ValueError("--eagle3-layers-to-capture is TokenSpeed's flag (use --engine tokenspeed)")
            draft, _ = read_config_json(args.draft)
            target_config, _ = read_config_json(args.target)
            if looks_like_a_drafter(target_config) and not looks_like_a_drafter(draft):
                raise InputError(
                    f"--draft {args.draft} and --target {args.target} look swapped: the target's config.json "
                    "is an EAGLE drafter's and the draft's is not; expected --draft DRAFTER --target TARGET"
                )
            environ = {**os.environ, **dict(item.split("=", 1) for item in args.env)}  # params.ENV_ASSIGNMENT
            options = dict(environ=environ, with_plugin=args.with_plugin, layers_to_capture=layers)
            options.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
            target = Target.from_config(target_config, args.target)
            report = diagnose(draft, target, args.engine, args.engine_version, draft_name=args.draft, **options)
    except (InputError, ValueError) as err:
        return error(str(err))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


def _pd(args: SimpleNamespace):
    """doctor --prefill-command ... --decode-command ...: a PD-disaggregated pair (eagle31_mla.serving.pd)."""
    from ..serving.pd import diagnose_pd, parse_launch

    for flag in ("--draft", "--target", "--eagle3-layers-to-capture", "--env", "--tp", "--pp"):
        if getattr(args, flag[2:].replace("-", "_")):
            raise ValueError(f"argument {flag}: a PD pair takes it from --prefill-command and --decode-command")
    commands = {"--prefill-command": args.prefill_command, "--decode-command": args.decode_command}
    sides = [parse_launch(args.engine, command, f"argument {flag}") for flag, command in commands.items()]
    return diagnose_pd(*sides, version=args.engine_version, with_plugin=args.with_plugin)
