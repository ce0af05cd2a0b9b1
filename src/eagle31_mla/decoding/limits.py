"""How much one speculative round may draft: plain arithmetic, importable without torch (the serving rules
and ``serve-command`` use it where torch is not installed)."""

from __future__ import annotations

#: Upper bounds of the drafting counts (the CLI's and ``check_settings``): far above any useful setting, low
#: enough that a typo fails at once instead of exhausting memory.
DRAFTING_LIMITS = {"num_steps": 64, "topk": 64, "num_draft_tokens": 4096, "max_new_tokens": 10_000_000}


def max_tree_draft_tokens(topk: int, num_steps: int) -> int:
    """The most tokens an EAGLE draft tree hands to verification, root included: topk nodes at the first step, then
    topk children of each of the topk best (SGLang's and the reference loop's tree)."""
    return 1 + topk + (num_steps - 1) * topk * topk
