"""``eagle31-mla inspect``: a drafter described, and which engine releases serve it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from . import params
from .common import argument, option, subcommand


@subcommand("inspect", "describe a drafter: config, size, KV bytes, tensors, which engines serve it")
@argument("path", metavar="PATH_OR_ID", type=params.CONFIG)
@option("--json", is_flag=True, help="machine-readable output")
def inspect(args: SimpleNamespace) -> int:
    """Describe a drafter folder or Hub repo: config in plain words, parameters, KV bytes per token,
    tensors against its config and the published roster, and which engine releases serve it.

    PATH_OR_ID: a drafter folder, its config.json, or a Hub repo id."""
    from ..hub.inspection import format_inspection, inspect_drafter

    info = inspect_drafter(args.path)  # an unreadable config.json: InputError, main's one line (exit 2)
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspection(info))
    return 1 if info["errors"] else 0
