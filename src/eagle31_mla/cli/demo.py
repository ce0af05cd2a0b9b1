"""``eagle31-mla demo``: speculative decoding on the embedded tiny pair."""

from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

from . import params
from .common import error, option, subcommand


@subcommand("demo", "speculative decoding on the embedded tiny pair: text, accept length, acceptance")
@option(
    "--engine",
    type=params.Choice(["hf", "vllm"]),
    default="hf",
    help="hf: the reference loop (default); vllm: vLLM with the plugin",
)
@option("--prompts", type=params.POSITIVE_INT, default=8, metavar="N", help="held-out prompts to run (default 8)")
@option("--max-new-tokens", type=params.MAX_NEW_TOKENS, default=48, help="tokens per prompt (default 48)")
@option("--num-steps", type=params.NUM_STEPS, default=3, help="draft steps per round (default 3)")
@option("--json", is_flag=True, help="machine-readable output")
def demo(args: SimpleNamespace) -> int:
    """Speculative decoding on the embedded tiny pair (a Kimi-K3-style MLA target and an EAGLE-3.1
    drafter trained against it): the generated text, the accept length and the acceptance at each
    draft position, on held-out prompts. No download."""
    from ..demo import demo_prompts, run_demo

    available = len(demo_prompts())
    if args.prompts > available:
        return error(
            f"argument --prompts: expected at most {available} (the held-out prompts shipped), got {args.prompts}"
        )
    try:
        result = run_demo(
            args.engine, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, num_steps=args.num_steps
        )
    except RuntimeError as err:  # no vLLM
        return error(str(err))
    print(json.dumps(asdict(result), indent=2) if args.json else result.report())
    return 0
