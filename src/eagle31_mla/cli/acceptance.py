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
OFFLINE |= {"sampling_backend": "torch", "overrides": (), "b_draft": None, "b_overrides": ()}
#: The server measurement's own arguments.
SERVER = ("engine", "concurrency", "model", "timeout", "log", "expect", "reference", "tokenizer", "b_server")
SWEEP = ("templates", "context_lengths", "overrides", "b_draft", "b_overrides", "b_server", "tokenizer")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


@subcommand(
    "acceptance",
    "measure accept length of a target + drafter on a prompts file",
    one_of=(OneOf(("expect", "reference")), OneOf(("sweep", "expect")), OneOf(("sweep", "reference"))),
    needs=tuple((name, "sweep") for name in SWEEP),
)
# the offline measurement: the pair is loaded here
@option("--target", type=params.MODEL, help="target model: Hub id or folder (a Transformers causal LM)")
@option("--draft", type=params.MODEL, help="drafter: Hub id or folder")
@option(
    "--prompts",
    required=True,
    type=params.PROMPTS,
    help="prompts file (.jsonl or text, one per line), or hf:NAME[:CONFIG][@SPLIT] (the [datasets] extra)",
)
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
# the sweep (eagle31_mla.sweep; docs/sweep.md)
@option("--sweep", is_flag=True, default=None, help="break acceptance down by template, domain, context and depth")
@option(
    "--template",
    "templates",
    multiple=True,
    type=params.TEMPLATE,
    metavar="NAME=FILE",
    help="--sweep: also render each conversation with this Jinja chat template (besides the target's and raw text)",
)
@option(
    "--context-lengths",
    type=params.CONTEXT_LENGTHS,
    metavar="N,...",
    help="--sweep: each prompt cut to its last N "
    "tokens, for each N it reaches (default: whole prompts, bucketed by length)",
)
@option("--tokenizer", type=params.MODEL, help="--sweep --server: the target's tokenizer (the sweep renders here)")
@option(
    "--override",
    "overrides",
    multiple=True,
    type=params.CONFIG_OVERRIDE,
    metavar="KEY=VALUE",
    help="--sweep: a field of the drafter's config",
)
@option("--b-draft", type=params.MODEL, help="--sweep: a second drafter, arm B, on the same prompts")
@option(
    "--b-override",
    "b_overrides",
    multiple=True,
    type=params.CONFIG_OVERRIDE,
    metavar="KEY=VALUE",
    help="--sweep: a field of arm B's drafter config (arm B: --b-draft, else --draft)",
)
@option("--b-server", type=params.SERVER_URL, metavar="URL", help="--sweep: a second server, arm B (same --engine)")
def acceptance(args: SimpleNamespace) -> int:
    """Measure the accept length of a target + drafter pair on a prompts file with the reference
    speculative-decoding loop (eagle31_mla.decoding.speculative): mean accept length, per-position acceptance,
    histogram, drafts per generated token; a table, and JSON with --json.

    With --server URL --engine E, measure a running vLLM, SGLang or TokenSpeed deployment instead (no model
    loaded here): per-request table, mean accept length with a 95% confidence interval, per-position
    acceptance where the engine reports it, output tokens/s; with --expect X or --reference REPORT a verdict
    (exit 1 when inconsistent, naming the likely misconfiguration and the `doctor` command to run)."""
    if args.server is not None:
        mine = [dest for dest in OFFLINE if not (args.sweep and dest == "trust_remote_code")]  # the tokenizer's
        given = [_flag(dest) for dest in mine if getattr(args, dest) not in (None, False, ())]
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
    if args.sweep:
        return _sweep_server(args, options)
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
        configs = [_drafter_config(args.draft, args.overrides)]  # a bad override refused before any weights load
        if args.b_draft or args.b_overrides:
            configs.append(_drafter_config(args.b_draft or args.draft, args.b_overrides))
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
        if args.sweep or any(isinstance(p, str) or (isinstance(p, dict) and "input_ids" not in p) for _, p in prompts):
            tokenizer = AutoTokenizer.from_pretrained(args.target, revision=revision, trust_remote_code=trust)
        vocab = Target.from_config(target_config).vocab_size
        if args.sweep:  # each row under each template, cut to each context length
            swept = _expand(args, tokenizer, vocab)
            prompts, ids = [(p.where, None) for p in swept], [p.input_ids for p in swept]
        else:
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
        load = dict(dtype=dtype, device_map=device)
        drafter = Eagle31MLAForCausalLM.from_pretrained(
            args.draft, revision=args.draft_revision, config=configs[0], **load
        )
        if len(configs) == 2:  # --draft-revision is --draft's
            b_revision = None if args.b_draft else args.draft_revision
            b_drafter = Eagle31MLAForCausalLM.from_pretrained(
                args.b_draft or args.draft, revision=b_revision, config=configs[1], **load
            )
    except (OSError, ValueError) as err:
        return error(str(err))
    settings = dict(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, seed=args.seed)
    settings.update(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    settings.update(ignore_eos=args.ignore_eos, progress=not args.no_progress, sampling_backend=args.sampling_backend)
    if args.sweep:
        arms = [("A", args.draft, args.overrides, drafter)]
        if args.b_draft or args.b_overrides:
            arms.append(("B", args.b_draft or args.draft, args.b_overrides, b_drafter))
        measured = []
        for name, path, overrides, model in arms:
            result = measure_acceptance(target, model, ids, tokenizer=tokenizer, **settings)
            what = path + "".join(f" {key}={json.dumps(value)}" for key, value in overrides)
            measured.append(dict(name=name, what=what, total=result["total"], requests=result["requests"]))
        result["settings"].update(target=args.target, draft=args.draft, prompts=str(args.prompts))
        _note_limited([r for arm in measured for r in arm["requests"]], context_limit(target, drafter))
        return _sweep_out(args, swept, measured, result["settings"])
    result = measure_acceptance(target, drafter, ids, tokenizer=tokenizer, **settings)
    _note_limited(result["requests"], context_limit(target, drafter))
    result["settings"].update(target=args.target, draft=args.draft, prompts=str(args.prompts))
    mode = "chain" if args.topk == 1 else f"tree (topk {args.topk})"
    backend = "" if args.sampling_backend == "torch" else f", sampling backend {args.sampling_backend}"
    print(f"{args.target} + {args.draft}: {mode}, temperature {args.temperature:g}, top-p {args.top_p:g}{backend}")
    print(AcceptanceStats.from_dict(result["total"]).table())
    if args.json == "-":
        print(json.dumps(result, indent=2))
    _write(args, result)
    return 0


def _note_limited(requests: list[dict], limit: int) -> None:
    if limited := sum(r["context_limited"] for r in requests):
        print(
            f"note: {limited} request(s) stopped at the context limit of {limit} positions "
            '(max_position_embeddings) before --max-new-tokens (finish reason "length")',
            file=sys.stderr,
        )


def _drafter_config(path: str, overrides):
    """The drafter's config.json with ``overrides`` (KEY=VALUE, dotted into dicts) applied, checked as the library
    checks a file (ConfigError names a bad value; a key the config does not have is refused here); None without."""
    from ..model.configuration_eagle31_mla import Eagle31MLAConfig
    from ..serving.engines import read_config_json

    if not overrides:
        return None
    data, known = read_config_json(path)[0], Eagle31MLAConfig().to_dict()
    for key, value in overrides:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or (not parents and key not in known):
            raise ValueError(f"argument --override/--b-override: {key} is not a field of the drafter's config")
        node[leaf] = value
    return Eagle31MLAConfig.from_dict(data)


def _expand(args: SimpleNamespace, tokenizer, vocab: int | None):
    from ..sweep import expand, read_templates

    templates = read_templates(dict(args.templates), tokenizer)
    return expand(args.prompts, tokenizer, vocab, templates, args.context_lengths or (), args.limit, args.chat_template)


def _sweep_out(args: SimpleNamespace, swept, arms: list[dict], settings: dict) -> int:
    """Print the sweep's table (or its JSON with --json -), write the JSON and the PNG beside it."""
    from ..sweep import format_sweep, plot, report

    settings.update(templates=sorted({p.template for p in swept}, key=[p.template for p in swept].index))
    settings.update(context_lengths=list(args.context_lengths or []), chat=args.chat_template)
    data = report(swept, arms, settings)
    print(json.dumps(data, indent=2) if args.json == "-" else format_sweep(data))
    _write(args, data)
    if args.json and args.json != "-":
        png = Path(args.json).with_suffix(".png")
        try:
            plot(data, png)
            print(f"plot written to {png}")
        except ImportError:
            print("note: no plot: matplotlib is not installed (pip install 'eagle31-mla[plot]')", file=sys.stderr)
    return 0


def _sweep_server(args: SimpleNamespace, options: dict) -> int:
    """The sweep on a server (and --b-server): the prompts rendered here with --tokenizer, sent as token ids."""
    from ..prompts import PromptError
    from ..serving.live import LiveError, measure_server

    if args.tokenizer is None:
        return error(
            "--sweep --server needs --tokenizer: the target's folder or Hub id (the sweep renders and cuts the prompts "
            "here and sends token ids, so that every arm and the offline reference see the same tokens)"
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
        swept = _expand(args, tokenizer, None)
        lines = [(p.where, {"input_ids": p.input_ids}) for p in swept]
        options.update(limit=None, chat=False)
        arms = []
        for name, url in (("A", args.server), ("B", args.b_server)):
            if url is None:
                continue
            measured = measure_server(url, args.engine, lines, **options)
            server = measured["server"]
            if server["attribution"] != "per-request":
                raise LiveError(
                    f"{server['url']}: the sweep needs each request's acceptance, and this run has only the "
                    f"aggregate ({server['source']}): use --concurrency 1 on an otherwise idle server"
                )
            what = f"{server['url']} ({server['engine']} {server.get('version') or ''}, model {server['model']})"
            arms.append(dict(name=name, what=what, total=measured["total"], requests=measured["requests"]))
            arms[-1]["server"] = server
    except (LiveError, PromptError, OSError, ValueError) as err:
        return error(str(err))
    measured["settings"].update(prompts=str(args.prompts), tokenizer=args.tokenizer)
    return _sweep_out(args, swept, arms, measured["settings"])
