"""``eagle31-mla convert``: a drafter checkpoint into a Hub-ready folder."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from . import params
from .common import argument, option, subcommand
from .serve_command import DEFAULT_TARGET


@subcommand("convert", "convert a drafter checkpoint into a Hub-ready folder")
@argument("src", metavar="SRC", type=params.MODEL)
@argument("dst", metavar="DST", type=params.OUTPUT_FOLDER)
@option(
    "--prune-vocab",
    type=params.POSITIVE_INT,
    metavar="N",
    help="keep the N most frequent target tokens (with bos/eos/pad)",
)
@option(
    "--token-counts",
    type=params.EXISTING_FILE,
    metavar="FILE",
    help="token frequencies over the target vocabulary: JSON "
    '{"token_id": count} or a list of counts, or text lines "token_id count"',
)
@option(
    "--max-shard-size",
    default="10GB",
    type=params.SIZE,
    metavar="SIZE",
    help="shard above this size (default 10GB = 1e10 bytes: the published drafter stays one file; also 500MB, bytes)",
)
@option(
    "--dtype",
    default="keep",
    type=params.Choice(["keep", "bfloat16", "float16", "float32"]),
    help="weights dtype (default: keep the source's)",
)
@option(
    "--repo-id",
    type=params.REPO_ID,
    metavar="ORG/NAME",
    help="the Hub id the model card names (default: DST's folder name)",
)
@option(
    "--target",
    default=DEFAULT_TARGET,
    type=params.NONEMPTY,
    metavar="ID",
    help=f"the target the model card's commands serve (default {DEFAULT_TARGET})",
)
@option(
    "--force",
    is_flag=True,
    help="replace what an earlier convert wrote in DST (its manifest says which files; others are kept)",
)
@option("--quiet", is_flag=True, help="no progress bar")
@option("--json", is_flag=True, help="machine-readable summary")
def convert(args: SimpleNamespace) -> int:
    """Convert a drafter checkpoint (published, training `midlayer.*`, NeMo `model.`, EAGLE-3, pruned)
    into a Hub-ready folder: published tensor names, sharded above --max-shard-size, config.json right
    for vLLM, SGLang and TokenSpeed, auto_map with its remote code, a model card with serving commands.
    Loads the model once (Transformers' from_pretrained), writes it with save_pretrained; converting twice gives
    byte-identical folders.

    SRC: the source drafter, a folder (or a Hub repo id); DST: the folder to write (new or empty; see --force)."""
    from ..hub.convert import convert

    result = convert(
        args.src,
        args.dst,
        prune_vocab=args.prune_vocab,
        token_counts=args.token_counts,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        repo_id=args.repo_id,
        target_name=args.target,
        force=args.force,
        progress=not args.quiet,
    )
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        summary = dict(folder=str(result.folder), files=result.files, tensors=result.num_tensors)
        summary.update(tensor_bytes=result.total_bytes, source=result.source_layout, vocab_size=result.vocab_size)
        summary.update(draft_vocab_size=result.draft_vocab_size, notes=result.notes)
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"wrote {result.folder}: {result.num_tensors} tensors, {result.total_bytes:,} bytes of weights "
        f"(source: {result.source_layout})"
    )
    print("".join(f"  {name}\n" for name in result.files), end="")
    return 0
