"""``eagle31-mla convert``: a drafter checkpoint into a Hub-ready folder."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
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

    settings = {k: v for k, v in vars(args).items() if k not in ("command", "target", "quiet", "json")}
    result = convert(**settings, target_name=args.target, progress=not args.quiet)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(result), indent=2, default=str))
        return 0
    weights = f"{result.tensors} tensors, {result.tensor_bytes:,} bytes of weights (source: {result.source})"
    print(f"wrote {result.folder}: {weights}")
    print("".join(f"  {name}\n" for name in result.files), end="")
    return 0
