"""``eagle31-mla train`` (and ``torchrun -m eagle31_mla.train``): a drafter trained against a target with
test-time training, live or from captured states."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from . import params
from .common import OneOf, error, option, resolve_device, subcommand


@subcommand(
    "train",
    "train a drafter against a target with test-time training",
    one_of=(OneOf(("text", "conversations", "data"), required=True), OneOf(("init", "draft_config"))),
    needs=(("follow", "data"), ("last_turn_only", "conversations"), ("anchor_max_gap", "anchors")),
)
@option("--target", required=True, type=params.MODEL, help="the target: a Transformers causal LM folder or Hub id")
@option("--text", type=params.EXISTING_FILE, help='training text: one document per line, or JSONL with "text"')
@option(
    "--conversations",
    type=params.EXISTING_FILE,
    help='JSONL, one {"messages": [...]} per line, rendered with the chat template; the loss on assistant content',
)
@option(
    "--data",
    type=params.CAPTURE_FOLDER,
    help="states captured by `eagle31-mla capture` (no target runs: --target gives the embeddings and lm_head)",
)
@option("--out", required=True, type=params.OUTPUT_FOLDER, help="output folder (published layout); resumes from it")
@option("--aux-layers", type=params.ONE_BASED_IDS, metavar="IDS", help="one-based aux layer ids, e.g. 2,46,90")
@option(
    "--init",
    type=params.MODEL,
    help="fine-tune this drafter with TorchSpec's recipe (lr 2e-5, 7 steps weighted 0.8^k, bf16 compute and export)",
)
@option(
    "--draft-config",
    type=params.CONFIG,
    metavar="PATH_OR_ID",
    help="a new drafter's layer sized like this drafter's config.json (default: the published drafter's layer)",
)
@option("--eagle3", is_flag=True, help="plain EAGLE-3 (no fc_norm, no norm_output)")
@option("--follow", is_flag=True, help="--data: train while the capture is written (a spool, or a capture folder)")
@option("--epochs", type=params.POSITIVE_INT, help="--follow: passes over the capture (default 1; later shuffled)")
@option("--steps", type=params.POSITIVE_INT, help="training steps (default 1000)")
@option("--batch-size", type=params.POSITIVE_INT, default=16)
@option("--seq-len", type=params.POSITIVE_INT, default=128, help="tokens per sequence, > --depth (default 128)")
@option("--depth", type=params.POSITIVE_INT, help="TTT unroll depth (default 4; --init: 7)")
@option("--last-turn-only", is_flag=True, help="--conversations: the loss on the last assistant turn only")
@option("--anchors", type=params.POSITIVE_INT, help="anchored TTT (TorchSpec's): N anchors per sequence")
@option("--anchor-max-gap", type=params.COUNT, help="--anchors: trained positions between anchors at most")
@option("--lr", type=params.POSITIVE_FLOAT, help="learning rate (default 3e-3; --init: 2e-5)")
@option("--save-every", type=params.POSITIVE_INT, default=250, help="steps between checkpoints (default 250)")
@option("--micro-batch", type=params.POSITIVE_INT, help="under torchrun: sequences per forward on a rank")
@option("--seed", type=params.SEED, default=0)
@option("--device", default="auto", type=params.DEVICE, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
@option("--quiet", is_flag=True, help="no progress bar")
def train(args: SimpleNamespace) -> int:
    """Train a drafter against a Transformers target with test-time training on a local text file
    (one document per line, or JSONL with a "text" field), or on target states captured with vLLM
    (--data, from `eagle31-mla capture`: no target model runs). --init fine-tunes an existing drafter with
    the recipe it was trained with. Resumes from OUT when it holds a checkpoint."""
    from ..serving.engines import InputError, check_roles, read_config_json

    args.drafter_positions = None  # the drafter's max_position_embeddings where given (--init, --draft-config)
    if args.init is not None:
        from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config

        try:
            init_json = read_config_json(args.init)[0]
            init_ids = list(aux_layer_ids_from_config(init_json)[0].one_based)
            args.drafter_positions = ("--init", init_json.get("max_position_embeddings"))
        except (InputError, AuxLayerIdError) as err:
            return error(f"argument --init: {err}")
        if args.aux_layers and args.aux_layers != init_ids:
            return error(
                f"argument --aux-layers: the --init drafter reads aux layers {init_ids}, not {args.aux_layers}"
            )
        if args.eagle3:
            return error("argument --eagle3: --init fine-tunes the drafter as it is (its own fc_norm / norm_output)")
        args.aux_layers = init_ids
    if args.epochs is not None and not args.follow:
        return error("argument --epochs: applies to --follow only (otherwise --steps says how long to train)")
    if args.follow and args.steps is not None:
        return error("argument --steps: with --follow the steps follow from the capture's size and --epochs")
    args.steps, args.epochs, args.layer = args.steps or 1000, args.epochs or 1, {}
    if args.draft_config is not None:  # checked before any weight loads
        from ..model.configuration_eagle31_mla import ConfigError
        from ..training.trainer import layer_settings

        try:
            args.layer = layer_settings(read_config_json(args.draft_config)[0])
        except (InputError, ConfigError) as err:
            return error(f"argument --draft-config: {err}")
        args.drafter_positions = ("--draft-config", args.layer["max_position_embeddings"])
    args.depth = args.depth or (7 if args.init else 4)
    args.lr = args.lr or (2e-5 if args.init else 3e-3)
    if args.seq_len <= args.depth:
        return error(
            f"argument --seq-len: expected more than --depth {args.depth} tokens (each unroll step needs "
            f"a next token to predict), got {args.seq_len}"
        )
    from ..training.distributed import launched_by_torchrun

    if args.data is None and launched_by_torchrun():
        return error("training under torchrun reads captured states (--data DIR, from `eagle31-mla capture`)")
    try:
        target_json, _ = read_config_json(args.target)
        check_roles(target_json, None, args.target)
    except (InputError, OSError, ValueError) as err:
        return error(str(err))
    return _train_live(args) if args.data is None else _train_on_captured(args, target_json)


def _train_live(args: SimpleNamespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..prompts import PromptError, read_corpus
    from ..serving.engines import InputError, probe_output_folder
    from ..training.trainer import tokenize_corpus, train_drafter
    from .capture import conversations

    try:  # everything that can be checked before the target's weights are loaded
        try:
            texts = read_corpus(args.text) if args.text else None  # conversations: read once, with the tokenizer
        except PromptError as err:
            return error(f"argument --text: {err}")
        probe_output_folder(args.out, "argument --out")
        device = resolve_device(args.device)
        target_config = AutoConfig.from_pretrained(args.target).get_text_config()
    except (InputError, OSError, UnicodeDecodeError, ValueError) as err:
        return error(str(err))
    depth = getattr(target_config, "num_hidden_layers", None)
    if args.aux_layers and isinstance(depth, int) and max(args.aux_layers) > depth:
        return error(
            f"argument --aux-layers: expected one-based ids <= {depth} (the target's depth), got "
            f"{','.join(map(str, args.aux_layers))}"
        )
    limit = getattr(target_config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.seq_len > limit:
        return error(
            f"argument --seq-len: expected at most {limit} (the target's max_position_embeddings), got {args.seq_len}"
        )
    if (why := _beyond_the_drafter(args, args.seq_len)) is not None:
        return error(f"argument --seq-len: {why}")
    masks = None
    try:  # what the user named must exist and load; a failure here is input, not a bug
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        if args.conversations:  # before the weights load
            sequences, masks = conversations(args, tokenizer, getattr(target_config, "vocab_size", None))
        else:
            sequences = tokenize_corpus(tokenizer, texts, args.seq_len)
        if len(sequences) < args.batch_size:
            source = f"--conversations: {args.conversations} gives" if masks else f"--text: {args.text} gives"
            return error(
                f"argument {source} {len(sequences)} sequences of at most {args.seq_len} tokens (--seq-len); "
                f"expected at least --batch-size {args.batch_size}"
            )
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
        drafter = _drafter(args, args.aux_layers, target)
    except (OSError, ValueError, InputError) as err:
        return error(str(err))
    train_drafter(
        target, drafter, sequences, args.out, _training_config(args, args.seq_len), not args.quiet, None, masks
    )
    return _written(args, drafter)


def _beyond_the_drafter(args: SimpleNamespace, length: int) -> str | None:
    """Why sequences of ``length`` tokens would train the drafter at positions its config does not declare (its
    rope scaling is set for its max_position_embeddings), or None."""
    source, limit = args.drafter_positions or (None, None)
    if isinstance(limit, int) and length > limit:
        return (
            f"expected sequences of at most {limit} tokens (the drafter's max_position_embeddings, from {source}), got "
            f"{length}"
        )
    return None


def _drafter(args: SimpleNamespace, ids, target):
    """--init: that drafter to fine-tune, ``target``'s embedding (a loaded model, or its path); otherwise a new one."""
    from ..serving.engines import InputError
    from ..training.trainer import drafter_for_target, drafter_from_files, drafter_to_finetune, target_embeddings

    on_disk = isinstance(target, str)
    if args.init:
        try:
            embed = target_embeddings(target)[0] if on_disk else target.get_input_embeddings().weight
            return drafter_to_finetune(args.init, embed)
        except (OSError, ValueError) as err:
            raise InputError(f"argument --init: {err}") from None
    layer = dict(eagle_aux_hidden_state_layer_ids=ids, fc_norm=not args.eagle3, norm_output=not args.eagle3)
    return (drafter_from_files if on_disk else drafter_for_target)(target, **layer, **args.layer)


def _written(args: SimpleNamespace, drafter, more: str = "") -> int:
    kind = "EAGLE-3" if args.eagle3 else "EAGLE-3.1"
    print(f"drafter written to {args.out} ({kind}, aux layers {drafter.config.aux_layer_ids.describe()}{more})")
    return 0


def _training_config(args: SimpleNamespace, seq_len: int):
    """From scratch: the defaults; --init: TorchSpec's fine-tuning recipe (TrainingConfig.finetune)."""
    from ..training.trainer import TrainingConfig

    chosen = dict(steps=args.steps, batch_size=args.batch_size, seq_len=seq_len, depth=args.depth, lr=args.lr)
    chosen.update(num_anchors=args.anchors, anchor_max_gap=args.anchor_max_gap, seed=args.seed)
    return (TrainingConfig.finetune if args.init else TrainingConfig)(**chosen, save_every=args.save_every)


def _train_on_captured(args: SimpleNamespace, target_json: dict) -> int:
    from ..serving.engines import InputError, Target
    from ..training.captured import MANIFEST, CapturedDataError, CapturedStates
    from ..training.trainer import CapturedTarget, train_on

    try:
        if args.follow:
            from ..training.spool import FollowedCapture

            data = FollowedCapture(args.data, say=_say)
            data.check_plan(args.batch_size, args.epochs)
            args.steps = -(-len(data) * args.epochs // args.batch_size)  # every sequence --epochs times
        elif not Path(args.data).is_dir():
            raise InputError(f"argument --data: Directory '{args.data}' does not exist.")
        elif not (Path(args.data) / MANIFEST).is_file():
            raise InputError(f"argument --data: {args.data} holds no {MANIFEST}; a spool is read with --follow")
        else:
            data = CapturedStates(args.data)
        target = Target.from_config(target_json, args.target)
        captured = data.manifest.target
        found = (target.num_layers, target.hidden_size, target.vocab_size)
        wanted = (captured["num_hidden_layers"], captured["hidden_size"], captured["vocab_size"])
        if found != wanted:
            raise InputError(
                f"argument --data: captured from a target with (layers, hidden size, vocabulary) {wanted}, but "
                f"--target {args.target} has {found}; give the target the capture was made with"
            )
        ids = data.manifest.aux_layer_ids
        if args.aux_layers and args.aux_layers != ids:
            raise InputError(
                f"argument --aux-layers: the capture holds aux layers {ids} (one-based), not {args.aux_layers}"
            )
        if len(data) < args.batch_size:
            raise InputError(
                f"argument --data: {len(data)} captured sequences; expected at least --batch-size {args.batch_size}"
            )
        if not args.follow and (why := _beyond_the_drafter(args, data.longest)) is not None:
            raise InputError(f"argument --data: {why}")
        device = resolve_device(args.device)
        import torch

        torch.manual_seed(args.seed)  # a new drafter's layers start the same on every rank (and run to run)
        drafter = _drafter(args, ids, args.target)
    except (InputError, CapturedDataError, OSError, ValueError) as err:
        return error(str(err))
    if args.follow:
        from ..training.spool import FollowTarget

        states = FollowTarget(data, target.vocab_size, device, epochs=args.epochs)
    else:
        states = CapturedTarget(data, target.vocab_size, device)
    config = _training_config(args, args.seq_len if args.follow else data.longest)
    from ..training.distributed import launched_by_torchrun, train_distributed

    if launched_by_torchrun():
        train_distributed(states, drafter, args.out, config, micro_batch=args.micro_batch, progress=not args.quiet)
        if int(os.environ.get("RANK", 0)):
            return 0  # rank 0 reports
    else:
        train_on(states, drafter, args.out, config, progress=not args.quiet)
    return _written(args, drafter, f", {len(data)} captured sequences")


def _say(line: str) -> None:
    """A waiting trainer says so (on stderr, beside the progress bar), from rank 0 only."""
    if not int(os.environ.get("RANK", 0)):
        print(f"train: {line}", file=sys.stderr, flush=True)
