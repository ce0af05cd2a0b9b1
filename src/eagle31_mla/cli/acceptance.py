"""``eagle31-mla acceptance``: the accept length of a target + drafter pair, measured offline with the
reference loop (--target --draft, loaded here) or on a running server (--server URL --engine E)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from . import params
from .common import OneOf, error, option, resolve_device, shown, subcommand

#: The offline measurement's own arguments (click leaves them None, so that one given with --server is refused by
#: name), with their defaults.
OFFLINE = {"target": None, "draft": None, "num_steps": 3, "topk": 1, "num_draft_tokens": None, "seed": 0}
OFFLINE |= {"device": "auto", "dtype": "auto", "trust_remote_code": False, "revision": None, "draft_revision": None}
OFFLINE |= {"sampling_backend": "torch"}
#: The server measurement's own arguments.
SERVER = ("engine", "concurrency", "model", "timeout", "log", "expect", "reference")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@subcommand(
    "acceptance",
    "measure accept length of a target + drafter on a prompts file",
    one_of=(OneOf(("expect", "reference")),),
)
# the offline measurement: the pair is loaded here
@option("--target", type=params.MODEL, help="target model: Hub id or folder (a Transformers causal LM)")
@option("--draft", type=params.MODEL, help="drafter: Hub id or folder")
@option("--prompts", required=True, type=params.EXISTING_FILE, help="prompts file: .jsonl or text, one per line")
@option("--num-steps", type=params.NUM_STEPS, help="draft steps per round (default 3)")
@option("--topk", type=params.TOPK, help="1: chain drafting; > 1: EAGLE tree (default 1)")
@option("--num-draft-tokens", type=params.NUM_DRAFT_TOKENS, help="tree size, root included (chain: num_steps + 1)")
@option("--temperature", type=params.TEMPERATURE, default=0.0, help="0: greedy (default)")
@option("--top-p", type=params.TOP_P, default=1.0, help="in (0, 1] (default 1: no truncation)")
@option(
    "--sampling-backend",
    type=params.Choice(["torch", "flashinfer"]),
    help="torch (default) or flashinfer (CUDA, the [gpu] extra: top-p, draws and chain verification)",
)
@option("--max-new-tokens", "--max-tokens", type=params.MAX_NEW_TOKENS, default=256, help="per prompt (default 256)")
@option("--seed", type=params.SEED, help="(default 0)")
@option("--limit", type=params.POSITIVE_INT, help="use only the first N prompts")
@option("--ignore-eos", is_flag=True, help="always generate max-new-tokens")
@option("--chat-template", "--chat", is_flag=True, help="wrap text prompts as one user message (server: chat API)")
@option("--device", type=params.DEVICE, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
@option("--dtype", type=params.Choice(["auto", "float32", "bfloat16", "float16"]), help="(default: each checkpoint's)")
@option("--trust-remote-code", is_flag=True, help="allow the target's own modeling code")
@option("--revision", type=params.NONEMPTY, help="target revision (branch, tag or commit)")
@option("--draft-revision", type=params.NONEMPTY, help="drafter revision (branch, tag or commit)")
@option("--json", type=params.OUTPUT_FILE, metavar="PATH", help="also write the report as JSON ('-' for stdout)")
@option("--no-progress", is_flag=True, help="no progress bar")
# a running server: no model is loaded here (eagle31_mla.serving.live)
@option("--server", type=params.SERVER_URL, metavar="URL", help="the OpenAI-compatible server to measure instead")
@option(
    "--engine",
    type=params.Choice(["vllm", "sglang", "tokenspeed"]),
    help="what serves it: vllm (/metrics, or per-request metrics from 0.29), sglang, tokenspeed (usage fields; --log)",
)
@option("--concurrency", type=params.CONCURRENCY, metavar="N", help="requests in flight (default 1: per request)")
@option("--model", type=params.NONEMPTY, metavar="NAME", help="the served model (default: GET /v1/models)")
@option(
    "--timeout",
    type=params.POSITIVE_FLOAT,
    metavar="S",
    help="seconds for each request, connect to last byte (default 120); an answer over 64 MiB is refused",
)
@option("--log", type=params.EXISTING_FILE, metavar="FILE", help="TokenSpeed: the scheduler's log file")
@option("--expect", type=params.ACCEPT_LENGTH, metavar="X", help="the accept length the deployment should reach")
@option("--reference", type=params.EXISTING_FILE, metavar="FILE", help="an offline `acceptance --json` report")
def acceptance(args: SimpleNamespace) -> int:
    """Measure the accept length of a target + drafter pair on a prompts file with the reference
    speculative-decoding loop (eagle31_mla.decoding.speculative): mean accept length, per-position acceptance,
    histogram, drafts per generated token; a table, and JSON with --json.

    With --server URL --engine E, measure a running vLLM, SGLang or TokenSpeed deployment instead (no model
    loaded here): per-request table, mean accept length with a 95% confidence interval, per-position
    acceptance where the engine reports it, output tokens/s; with --expect X or --reference REPORT a verdict
    (exit 1 when inconsistent, naming the likely misconfiguration and the `doctor` command to run)."""
    if args.server is not None:
        given = [_flag(dest) for dest in OFFLINE if getattr(args, dest) not in (None, False)]
        if given:
            return error(
                f"{given[0]} is for the offline measurement (the pair loaded here); --server measures what the "
                f"server runs: drop {given[0]}"
            )
        return _acceptance_server(args)
    given = [_flag(dest) for dest in SERVER if getattr(args, dest) is not None]
    if given:
        return error(f"{given[0]} measures a running server: it needs --server URL (or drop {given[0]})")
    missing = [flag for flag, value in (("--target", args.target), ("--draft", args.draft)) if not value]
    if missing:
        return error(
            f"acceptance needs {' and '.join(missing)} (the pair to load here), or --server URL --engine E "
            "to measure a running server"
        )
    for dest, value in OFFLINE.items():
        setattr(args, dest, value if getattr(args, dest) is None else getattr(args, dest))
    return _acceptance_offline(args)


def _write(args: SimpleNamespace, report: dict) -> None:
    from ..locations import atomic_write

    if args.json and args.json != "-":  # atomically: a reader never sees half a report
        atomic_write(args.json, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8"))
        print(f"report written to {args.json}")


def _acceptance_server(args: SimpleNamespace) -> int:
    from ..prompts import PromptError
    from ..serving.live import LiveError, format_report, measure_server, read_reference

    try:  # read once, and before the server is asked anything
        reference = read_reference(args.reference) if args.reference else None
    except (ValueError, OSError) as err:
        what = f"an `eagle31-mla acceptance --json` report, got {shown(args.reference)}"
        return error(f"argument --reference: expected {what}: {err}")
    if args.engine is None:
        return error("--server needs --engine vllm, sglang or tokenspeed (what serves it)")
    if args.log is not None and args.engine != "tokenspeed":
        return error(f"--log reads TokenSpeed's scheduler log; --engine is {args.engine}")
    options = {name: getattr(args, name) for name in ("temperature", "top_p", "model", "log", "limit", "ignore_eos")}
    options.update(concurrency=args.concurrency or 1, max_tokens=args.max_new_tokens, chat=args.chat_template)
    options.update(timeout=args.timeout or 120.0, progress=not args.no_progress, expect=args.expect)
    try:
        report = measure_server(args.server, args.engine, args.prompts, reference=reference, **options)
    except (LiveError, PromptError) as err:
        return error(str(err))
    verdict = report.get("verdict") or {"warnings": [], "consistent": True}
    for warning in verdict["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json == "-" else format_report(report))
    _write(args, report)
    return 0 if verdict["consistent"] else 1


def _acceptance_offline(args: SimpleNamespace) -> int:
    from ..decoding.speculative import check_settings
    from ..prompts import prompt_token_ids, read_prompt_lines
    from ..serving.engines import InputError, Target, check_roles, read_config_json

    # everything that can be checked without the weights, before loading them (minutes for a real pair)
    for flag, revision, model, model_flag in (
        ("--revision", args.revision, args.target, "--target"),
        ("--draft-revision", args.draft_revision, args.draft, "--draft"),
    ):
        if revision is not None and Path(model).expanduser().exists():
            return error(
                f"argument {flag}: expected a {model_flag} given as a Hub repo id (a revision names a Hub "
                f"branch, tag or commit), got {revision!r} with the local folder {model}; drop {flag}"
            )
    try:
        check_settings(args.num_steps, args.topk, args.num_draft_tokens, args.temperature, args.top_p)
        if args.sampling_backend == "flashinfer":
            from ..model.flashinfer_backend import FlashInferUnavailable, require

            try:
                require(resolve_device(args.device))
            except FlashInferUnavailable as err:
                return error(f"argument --sampling-backend: {err}")
        prompts = read_prompt_lines(args.prompts)[: args.limit]
        if not prompts:
            return error(f"argument --prompts: expected at least one prompt, {args.prompts} has none")
        target_config, _ = read_config_json(args.target)
        draft_config, _ = read_config_json(args.draft)
        check_roles(target_config, draft_config, args.target, args.draft)
    except (InputError, OSError, ValueError) as err:
        return error(str(err))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..decoding.speculative import AcceptanceStats, context_limit, measure_acceptance
    from ..model.configuration_eagle31_mla import resolve_dtype
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    text_config = target_config.get("text_config") or target_config
    limits = [c.get("max_position_embeddings") for c in (text_config, draft_config)]
    limit = min((n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0), default=None)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype, "--dtype") or "auto"
    try:  # what the user named must exist and load; a failure here is input, not a bug
        if args.chat_template:
            prompts = [
                (w, {"messages": [{"role": "user", "content": p}]} if isinstance(p, str) else p) for w, p in prompts
            ]
        revision, trust, tokenizer = args.revision, args.trust_remote_code, None
        if any(isinstance(p, str) or (isinstance(p, dict) and "input_ids" not in p) for _, p in prompts):
            tokenizer = AutoTokenizer.from_pretrained(args.target, revision=revision, trust_remote_code=trust)
        vocab = Target.from_config(target_config).vocab_size
        ids = [prompt_token_ids(p, tokenizer, vocab, where) for where, p in prompts]  # before the weights load
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if limit is not None and len(ids[longest]) >= limit:
            return error(
                f"{prompts[longest][0]}: the prompt has {len(ids[longest])} tokens; expected fewer than "
                f"the context limit of {limit} positions (max_position_embeddings)"
            )
        target = AutoModelForCausalLM.from_pretrained(
            args.target, revision=revision, dtype=dtype, trust_remote_code=trust, attn_implementation="sdpa"
        )  # sdpa takes the tree mask (Transformers' default for these models anyway)
        target = target.to(device).eval()
        drafter = Eagle31MLAForCausalLM.from_pretrained(
            args.draft, revision=args.draft_revision, dtype=dtype, device_map=device
        )
    except (OSError, ValueError) as err:
        return error(str(err))
    settings = dict(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, seed=args.seed)
    settings.update(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    settings.update(ignore_eos=args.ignore_eos, progress=not args.no_progress, sampling_backend=args.sampling_backend)
    result = measure_acceptance(target, drafter, ids, tokenizer=tokenizer, **settings)
    limited = sum(r["context_limited"] for r in result["requests"])
    if limited:
        print(
            f"note: {limited} request(s) stopped at the context limit of {context_limit(target, drafter)} positions "
            '(max_position_embeddings) before --max-new-tokens (finish reason "length")',
            file=sys.stderr,
        )
    result["settings"].update(target=args.target, draft=args.draft, prompts=str(args.prompts))
    mode = "chain" if args.topk == 1 else f"tree (topk {args.topk})"
    backend = "" if args.sampling_backend == "torch" else f", sampling backend {args.sampling_backend}"
    print(f"{args.target} + {args.draft}: {mode}, temperature {args.temperature:g}, top-p {args.top_p:g}{backend}")
    print(AcceptanceStats.from_dict(result["total"]).table())
    if args.json == "-":
        print(json.dumps(result, indent=2))
    _write(args, result)
    return 0
