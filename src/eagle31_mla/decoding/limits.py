"""How much one speculative round may draft: plain arithmetic, importable without torch (the serving rules
and ``serve-command`` use it where torch is not installed)."""

from __future__ import annotations

#: Upper bounds of the drafting counts (the CLI's types and ``check_settings`` share them): far above any
#: useful setting (engines draft <= ~10 steps, trees of <= a few hundred nodes), low enough that a typo fails
#: at once instead of exhausting memory.
DRAFTING_LIMITS = {"num_steps": 64, "topk": 64, "num_draft_tokens": 4096, "max_new_tokens": 10_000_000}


def max_tree_draft_tokens(topk: int, num_steps: int) -> int:
    """The most tokens an EAGLE draft tree can hand to verification, root included: the first step adds
    topk nodes, each later step topk children of each of the topk best (SGLang's and the reference
    loop's tree). A chain (topk 1) gives num_steps + 1."""
    return 1 + topk + (num_steps - 1) * topk * topk
