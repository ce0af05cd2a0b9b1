"""``eagle31-mla convert``: a drafter checkpoint into a Hub-ready folder."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from . import params
from .common import argument, error, one_line, option, subcommand
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
    from ..hub.convert import ConvertError, convert
    from ..serving.engines import InputError

    try:
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
    except InputError as err:
        return error(str(err))
    except ConvertError as err:
        print(f"eagle31-mla: the source is refused: {one_line(err)}", file=sys.stderr)
        return 1
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "folder": str(result.folder),
                    "files": result.files,
                    "tensors": result.num_tensors,
                    "tensor_bytes": result.total_bytes,
                    "source": result.source_layout,
                    "vocab_size": result.vocab_size,
                    "draft_vocab_size": result.draft_vocab_size,
                    "notes": result.notes,
                },
                indent=2,
            )
        )
    else:
        print(
            f"wrote {result.folder}: {result.num_tensors} tensors, {result.total_bytes:,} bytes of weights "
            f"(source: {result.source_layout})"
        )
        for name in result.files:
            print(f"  {name}")
    return 0
