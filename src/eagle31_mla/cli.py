"""The ``eagle31-mla`` command: demo, roster, acceptance, train, inspect, convert, doctor, serve-command.

Thin on purpose: argument parsing and printing; the work is done by eagle31_mla.inspection, .convert,
.doctor and .serving. Heavy imports (torch, transformers) happen inside the subcommands, so ``--help``
stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from inspect import cleandoc

__all__ = ["main"]

EXIT_CODES = """exit codes: 0 success (doctor: nothing is wrong); 1 problems found (doctor: misconfigurations;
inspect/convert: the drafter is refused; serve-command: the command cannot serve it right);
2 usage error or unreadable input"""


def _roster(args: argparse.Namespace) -> int:
    """Build the default (Kimi-K3) drafter without allocating it and check it against the published roster."""
    import torch

    from .configuration_eagle31_mla import Eagle31MLAConfig
    from .modeling_eagle31_mla import Eagle31MLAForCausalLM
    from .roster import PUBLISHED_DTYPE, PUBLISHED_NUM_PARAMETERS, PUBLISHED_ROSTER, roster_differences

    config = Eagle31MLAConfig()
    model = Eagle31MLAForCausalLM.on_meta_device(config)
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    num_params = sum(t.numel() for t in state.values())
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values()}
    rope = config.rope_parameters

    print("EAGLE-3.1 MLA drafter for Kimi-K3 (default config, built on the meta device: nothing allocated)")
    print(f"  hidden {config.hidden_size}, {config.num_attention_heads} heads, q_lora {config.q_lora_rank}, "
          f"kv_lora {config.kv_lora_rank} + rope {config.qk_rope_head_dim}, nope {config.qk_nope_head_dim}, "
          f"v {config.v_head_dim}, MLP {config.intermediate_size}")  # fmt: skip
    print(f"  aux layers: {config.aux_layer_ids.describe()}; fc_norm {config.fc_norm}, norm_output {config.norm_output}")
    print(f"  rope: {rope['rope_type']} theta {rope['rope_theta']:g}"
          + (f", factor {rope['factor']:g} over {rope['original_max_position_embeddings']}" if rope["rope_type"] == "yarn" else ""))  # fmt: skip
    kv_bytes = config.kv_cache_values_per_token * torch.finfo(config.dtype).bits // 8
    print(f"  KV cache: {config.kv_cache_values_per_token} values = {kv_bytes} bytes per token ({config.dtype})")
    print(f"\n  {'tensor':<46} {'shape':>16}")
    for name, shape in shapes.items():
        print(f"  {name:<46} {str(list(shape)):>16}")
    print(f"\n  {len(shapes)} tensors, {num_params:,} parameters, dtype {', '.join(sorted(dtypes))}")

    problems = roster_differences(shapes)
    if num_params != PUBLISHED_NUM_PARAMETERS:
        problems.append(f"{num_params:,} parameters, published {PUBLISHED_NUM_PARAMETERS:,}")
    if dtypes != {PUBLISHED_DTYPE}:
        problems.append(f"dtype {dtypes}, published {PUBLISHED_DTYPE}")
    if problems:
        print(f"roster: MISMATCH with lightseekorg/kimi-k3-eagle3.1-mla ({len(problems)}):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly ({len(PUBLISHED_ROSTER)} tensors)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Speculative decoding on the embedded tiny pair (a Kimi-K3-style MLA target and an EAGLE-3.1
    drafter trained against it): the generated text, the accept length and the acceptance at each
    draft position, on held-out prompts. No download."""
    from .demo import run_demo

    try:
        result = run_demo(args.engine, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                          num_steps=args.num_steps)  # fmt: skip
    except (FileNotFoundError, RuntimeError) as err:
        return _error(str(err))
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.report())
    return 0


def _add_acceptance_arguments(parser) -> None:
    """The ``acceptance`` command's arguments (an ``argparse`` parser or sub-parser)."""
    parser.add_argument("--target", required=True, help="target model: Hub id or folder (a Transformers causal LM)")
    parser.add_argument("--draft", required=True, help="drafter: Hub id or folder")
    parser.add_argument("--prompts", required=True,
                        help="prompts file: .jsonl (prompt / messages / input_ids) or text, one per line")  # fmt: skip
    parser.add_argument("--num-steps", type=int, default=3, help="draft steps per round (default 3)")
    parser.add_argument("--topk", type=int, default=1, help="1: chain drafting; > 1: EAGLE tree (default 1)")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="tree size, root included (chain: num_steps + 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap text prompts as one user message of the tokenizer's chat template")  # fmt: skip
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype of both models (auto: each checkpoint's)")  # fmt: skip
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    parser.add_argument("--revision", default=None, help="target revision (branch, tag or commit)")
    parser.add_argument("--draft-revision", default=None, help="drafter revision (branch, tag or commit)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON ('-' for stdout)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _acceptance(args: argparse.Namespace) -> int:
    """Measure the accept length of a target + drafter pair on a prompts file with the reference
    speculative-decoding loop (eagle31_mla.speculative): mean accept length, per-position acceptance,
    histogram, drafts per generated token; a table, and JSON with --json."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .modeling_eagle31_mla import Eagle31MLAForCausalLM
    from .speculative import AcceptanceStats, measure_acceptance, read_prompts

    device = _device(args.device)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:  # what the user named must exist and load; a failure here is input, not a bug
        prompts = read_prompts(args.prompts)[: args.limit]
        if args.chat_template:
            prompts = [{"messages": [{"role": "user", "content": p}]} if isinstance(p, str) else p for p in prompts]
        needs_tokenizer = any(isinstance(p, str) or (isinstance(p, dict) and "input_ids" not in p) for p in prompts)
        tokenizer = (
            AutoTokenizer.from_pretrained(args.target, revision=args.revision, trust_remote_code=args.trust_remote_code)
            if needs_tokenizer else None
        )  # fmt: skip
        target = AutoModelForCausalLM.from_pretrained(
            args.target, revision=args.revision, dtype=dtype, trust_remote_code=args.trust_remote_code,
            attn_implementation="sdpa",  # takes the tree mask; Transformers' default for these models anyway
        ).to(device).eval()  # fmt: skip
        drafter = Eagle31MLAForCausalLM.from_pretrained(args.draft, revision=args.draft_revision, dtype=dtype, device=device)
    except (OSError, ValueError) as err:
        return _error(str(err))
    result = measure_acceptance(
        target, drafter, prompts, num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
        tokenizer=tokenizer, ignore_eos=args.ignore_eos, progress=not args.no_progress,
    )  # fmt: skip
    result["settings"].update(target=args.target, draft=args.draft, prompts=str(args.prompts))
    mode = "chain" if args.topk == 1 else f"tree (topk {args.topk})"
    print(f"{args.target} + {args.draft}: {mode}, temperature {args.temperature:g}, top-p {args.top_p:g}")
    print(AcceptanceStats.from_dict(result["total"]).table())
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            print(f"report written to {args.json}")
    return 0


def _train(args: argparse.Namespace) -> int:
    """Train a drafter against a Transformers target with test-time training on a local text file
    (one document per line, or JSONL with a "text" field). Resumes from OUT when it holds a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .speculative import read_prompts
    from .training import TrainingConfig, drafter_for_target, tokenize_corpus, train_drafter

    try:  # what the user named must exist and load; a failure here is input, not a bug
        texts = [t if isinstance(t, str) else t.get("text", "") for t in read_prompts(args.text)]
        ids = _parse_ids(args.aux_layers, "--aux-layers")
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(_device(args.device)).eval()
    except (OSError, ValueError) as err:
        return _error(str(err))
    sequences = tokenize_corpus(tokenizer, texts, args.seq_len)
    if sequences.shape[0] < args.batch_size:
        return _error(f"{args.text} gives {sequences.shape[0]} sequences of {args.seq_len} tokens; need >= batch size")
    drafter = drafter_for_target(target, eagle_aux_hidden_state_layer_ids=ids or None, fc_norm=not args.eagle3,
                                 norm_output=not args.eagle3)  # fmt: skip
    config = TrainingConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, depth=args.depth,
                            lr=args.lr, num_anchors=args.anchors, seed=args.seed)  # fmt: skip
    train_drafter(target, drafter, sequences, args.out, config, progress=not args.quiet)
    print(f"drafter written to {args.out} ({'EAGLE-3' if args.eagle3 else 'EAGLE-3.1'}, aux layers "
          f"{drafter.config.aux_layer_ids.describe()})")  # fmt: skip
    return 0


def _device(name: str) -> str:
    import torch

    return name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def _error(message: str) -> int:
    print(f"eagle31-mla: error: {message}", file=sys.stderr)
    return 2


def _inspect(args: argparse.Namespace) -> int:
    """Describe a drafter folder or Hub repo: config in plain words, parameters, KV bytes per token,
    tensors against its config and the published roster, and which engine releases serve it."""
    from .engines import InputError
    from .inspection import format_inspection, inspect_drafter

    try:
        info = inspect_drafter(args.path)
    except InputError as err:
        return _error(str(err))
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspection(info))
    return 1 if info["errors"] else 0


def _convert(args: argparse.Namespace) -> int:
    """Convert a drafter checkpoint (published, training `midlayer.*`, NeMo `model.`, EAGLE-3, pruned)
    into a Hub-ready folder: published tensor names, sharded above --max-shard-size, config.json right
    for vLLM, SGLang and TokenSpeed, auto_map with its remote code, a model card with serving commands.
    Streams tensor by tensor; converting twice gives byte-identical folders."""
    from .convert import ConvertError, convert
    from .engines import InputError

    try:
        result = convert(args.src, args.dst, prune_vocab=args.prune_vocab, token_counts=args.token_counts,
                         max_shard_size=args.max_shard_size, dtype=args.dtype, repo_id=args.repo_id,
                         target_name=args.target, force=args.force, progress=not args.quiet)  # fmt: skip
    except InputError as err:
        return _error(str(err))
    except ConvertError as err:
        print(f"eagle31-mla: the source is refused: {err}", file=sys.stderr)
        return 1
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"folder": str(result.folder), "files": result.files, "tensors": result.num_tensors,
                          "tensor_bytes": result.total_bytes, "source": result.source_layout,
                          "vocab_size": result.vocab_size, "draft_vocab_size": result.draft_vocab_size,
                          "notes": result.notes}, indent=2))  # fmt: skip
    else:
        print(f"wrote {result.folder}: {result.num_tensors} tensors, {result.total_bytes:,} bytes of weights "
              f"(source: {result.source_layout})")  # fmt: skip
        for name in result.files:
            print(f"  {name}")
    return 0


def _parse_ids(text: str | None, flag: str = "--eagle3-layers-to-capture") -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated ints like 2,46,90, got {text!r}") from None


def _doctor(args: argparse.Namespace) -> int:
    """Find every silent misconfiguration of a draft + target + engine (aux ids and their convention per
    engine and release, vLLM's V2-runner and target_layer_ids traps, SGLang's first-id rule, Kimi-K3
    capture and stream, EAGLE-3.1 support, MLA detection, depth, vocabulary, sizes, bos/eos), each with
    its exact fix. Reads only the two config.json files. Exit 0 only when nothing is wrong."""
    from .doctor import CHECKS, diagnose
    from .engines import InputError, Target, read_config_json

    if args.list_checks:
        for check, what in CHECKS.items():
            print(f"{check:<30} {what}")
        return 0
    missing = [flag for flag, value in (("--draft", args.draft), ("--target", args.target), ("--engine", args.engine)) if not value]
    if missing:
        return _error(f"doctor needs {', '.join(missing)}")
    environ = dict(os.environ)
    for item in args.env:
        if "=" not in item:
            return _error(f"--env expects NAME=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        environ[name] = value
    try:
        layers = _parse_ids(args.eagle3_layers_to_capture)
        if layers is not None and args.engine != "tokenspeed":
            raise ValueError("--eagle3-layers-to-capture is TokenSpeed's flag (use --engine tokenspeed)")
        draft, _ = read_config_json(args.draft)
        target_config, _ = read_config_json(args.target)
        report = diagnose(draft, Target.from_config(target_config, args.target), args.engine, args.engine_version,
                          environ=environ, with_plugin=args.with_plugin, layers_to_capture=layers,
                          draft_name=args.draft)  # fmt: skip
    except (InputError, ValueError) as err:
        return _error(str(err))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


DEFAULT_TARGET = "moonshotai/Kimi-K3"
DEFAULT_DRAFT = "lightseekorg/kimi-k3-eagle3.1-mla"


def _serve_command(args: argparse.Namespace) -> int:
    """Print the launch command for vLLM, SGLang or TokenSpeed serving --target with --draft: aux ids in
    that engine's form, the environment variable, topk / steps / draft tokens. The pair is checked with
    `doctor` (assuming the eagle31-mla plugin for vLLM and SGLang); exit 1 if problems remain."""
    from .doctor import diagnose, engine_releases
    from .engines import KIMI_K3_TARGET, InputError, Target, read_config_json
    from .serving import serve_command

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
            from .configuration_eagle31_mla import Eagle31MLAConfig

            draft = Eagle31MLAConfig().to_dict()  # the published drafter's config, for offline use
        command = serve_command(args.engine, args.target, args.draft, target, draft, num_steps=args.num_steps,
                                topk=args.topk, num_draft_tokens=args.num_draft_tokens,
                                tensor_parallel_size=args.tp)  # fmt: skip
        version = args.engine_version or engine_releases(args.engine)[-1][0]
        report = diagnose(draft, target, args.engine, version, environ=dict(command.env), with_plugin=args.engine != "tokenspeed",
                          layers_to_capture=command.layers_to_capture, draft_name=args.draft)  # fmt: skip
    except (InputError, ValueError) as err:
        return _error(str(err))
    if not args.engine_version:
        command.comments.append(f"checked for {report.versions[0]} (pass --engine-version for yours)")
    if args.json:
        print(json.dumps({"command": command.to_dict(), "doctor": report.to_dict()}, indent=2))
    else:
        print(command.text())
    for f in report.problems:
        print(f"eagle31-mla: problem [{f.id}]: {f.problem}\n  fix: {f.fix}", file=sys.stderr)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle31-mla", description="The EAGLE-3.1 MLA drafter for Kimi-K3: demo, "
                                     "roster, acceptance, train, inspect, convert, doctor, serve-command.",
                                     epilog=EXIT_CODES)  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name, run, summary, doc=None):
        sub = commands.add_parser(name, help=summary, description=cleandoc(doc or run.__doc__), epilog=EXIT_CODES,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        sub.set_defaults(run=run)
        return sub

    demo = add("demo", _demo, "speculative decoding on the embedded tiny pair: text, accept length, acceptance")
    demo.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="hf: the reference loop (default); vllm: vLLM with the plugin")
    demo.add_argument("--prompts", type=int, default=8, metavar="N", help="held-out prompts to run (default 8)")
    demo.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default 48)")
    demo.add_argument("--num-steps", type=int, default=3, help="draft steps per round (default 3)")
    demo.add_argument("--json", action="store_true", help="machine-readable output")

    add("roster", _roster, "check the default (Kimi-K3) drafter against the published checkpoint's tensor roster")

    acceptance = add("acceptance", _acceptance, "measure accept length of a target + drafter on a prompts file")
    _add_acceptance_arguments(acceptance)

    train = add("train", _train, "train a drafter against a target with test-time training")
    train.add_argument("--target", required=True, help="the target: a Transformers causal LM folder or Hub id")
    train.add_argument("--text", required=True, help="training text: one document per line, or JSONL with \"text\"")
    train.add_argument("--out", required=True, help="output folder (published layout); resumes from it")
    train.add_argument("--aux-layers", metavar="IDS", help="one-based aux layer ids, e.g. 2,46,90 (default: Kimi-K3's)")
    train.add_argument("--eagle3", action="store_true", help="plain EAGLE-3 (no fc_norm, no norm_output)")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument("--depth", type=int, default=4, help="TTT unroll depth (default 4)")
    train.add_argument("--anchors", type=int, default=None, help="anchored TTT: unroll depths >= 1 at N positions")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")

    inspect_ = add("inspect", _inspect, "describe a drafter: config, size, KV bytes, tensors, which engines serve it")
    inspect_.add_argument("path", metavar="PATH_OR_ID", help="a drafter folder, its config.json, or a Hub repo id")
    inspect_.add_argument("--json", action="store_true", help="machine-readable output")

    convert = add("convert", _convert, "convert a drafter checkpoint into a Hub-ready folder")
    convert.add_argument("src", metavar="SRC", help="the source drafter: a folder (or a Hub repo id)")
    convert.add_argument("dst", metavar="DST", help="the folder to write (new or empty; see --force)")
    convert.add_argument("--prune-vocab", type=int, metavar="N", help="keep the N most frequent target tokens (with bos/eos/pad)")
    convert.add_argument("--token-counts", metavar="FILE", help="token frequencies over the target vocabulary: JSON "
                         '{"token_id": count} or a list of counts, or text lines "token_id count"')  # fmt: skip
    convert.add_argument("--max-shard-size", default="10GB", metavar="SIZE", help="shard above this size (default 10GB = 1e10 bytes: the published drafter stays one file; also 512MiB, bytes)")
    convert.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float16", "float32"], help="weights dtype (default: keep the source's)")
    convert.add_argument("--repo-id", metavar="ORG/NAME", help="the Hub id the model card names (default: DST's folder name)")
    convert.add_argument("--target", default=DEFAULT_TARGET, metavar="ID", help=f"the target the model card's commands serve (default {DEFAULT_TARGET})")
    convert.add_argument("--force", action="store_true", help="overwrite what convert writes in a non-empty DST")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.add_argument("--json", action="store_true", help="machine-readable summary")

    doctor = add("doctor", _doctor, "find silent misconfigurations of a draft + target + engine, with fixes")
    doctor.add_argument("--draft", metavar="PATH_OR_ID", help="the drafter: folder, config.json, or Hub repo id")
    doctor.add_argument("--target", metavar="PATH_OR_ID", help="the target model: folder, config.json, or Hub repo id")
    doctor.add_argument("--engine", choices=["vllm", "sglang", "tokenspeed"])
    doctor.add_argument("--engine-version", metavar="V", help="e.g. 0.22.1 (default: every release the facts cover)")
    doctor.add_argument("--with-plugin", action="store_true", help="assume this project's plugin is installed where the engine runs")
    doctor.add_argument("--eagle3-layers-to-capture", metavar="IDS", help="TokenSpeed: the flag value you will pass, e.g. 2,46,90")
    doctor.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="the serving environment (default: this shell's), e.g. VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0")  # fmt: skip
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--list-checks", action="store_true", help="list every check id and what it catches")

    serve = add("serve-command", _serve_command, "print the launch command for vLLM, SGLang or TokenSpeed")
    serve.add_argument("--engine", required=True, choices=["vllm", "sglang", "tokenspeed"])
    serve.add_argument("--target", default=DEFAULT_TARGET, metavar="PATH_OR_ID", help=f"default {DEFAULT_TARGET}")
    serve.add_argument("--draft", default=DEFAULT_DRAFT, metavar="PATH_OR_ID", help=f"default {DEFAULT_DRAFT}")
    serve.add_argument("--num-steps", type=int, default=3, help="draft steps per verification (default 3)")
    serve.add_argument("--topk", type=int, default=1, help="draft branches per step (default 1: a chain)")
    serve.add_argument("--num-draft-tokens", type=int, help="tokens verified per step (default: num-steps + 1)")
    serve.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size")
    serve.add_argument("--engine-version", metavar="V", help="check against this release (default: the newest known)")
    serve.add_argument("--json", action="store_true", help="machine-readable output")

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
