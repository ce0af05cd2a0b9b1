"""Reference speculative decoding with the EAGLE-3.1 MLA drafter and a Transformers target.

What the serving engines do, in plain PyTorch, one request at a time, so that acceptance can be
measured offline and every engine checked against it. Per round:

1. **Draft.** The drafter first catches up on the tokens the target committed last round: token
   ``i + 1``'s embedding with the target's aux states at position ``i`` (EAGLE's shift, as vLLM and
   SGLang do), appended to its latent cache. Then it drafts:
   * chain (``topk == 1``): ``num_steps`` tokens, each sampled from the drafter's (temperature,
     top-p) distribution q, each step fed the previous token and the previous step's state;
   * tree (``topk > 1``): EAGLE's top-k expansion (SGLang's ``--speculative-eagle-topk``): each step
     feeds the ``topk`` best leaves so far, in one drafter call under a tree mask; children are
     ranked by cumulative draft log-probability, and the best ``num_draft_tokens - 1`` nodes (the
     root, i.e. the last committed token, is counted) form the tree.
2. **Verify.** ONE target forward over the last committed token plus the draft tokens (a tree mask
   for trees), reusing the target's ``DynamicCache``: the prefix is never recomputed.
3. **Accept** (the output distribution is exactly the target's, p after temperature / top-p):
   * chain, draft token x sampled from q: accept x with probability min(1, p(x) / q(x)); at the first
     rejection sample from norm(max(p - q, 0)); if all are accepted, sample a bonus token from p at
     the last position. (Leviathan et al. 2023; Chen et al. 2023; gpt-fast ``speculative_decode``.)
   * tree, children of the current node tried one by one: a child is a deterministic choice (the
     drafter's top-k), i.e. a point mass, so min(1, p(x) / q(x)) = p(x): accept it with probability
     p(x); on rejection zero p(x) and renormalise (norm(max(p - onehot(x), 0))), try the next child
     against that residual; when no child is accepted, sample from the residual. P(emit x) = p(x) for
     every x, whatever the tree (EAGLE's ``evaluate_posterior``, SGLang's
     ``tree_speculative_sampling_target_only``). Greedy (temperature 0) is the same rules with
     one-hot p and q: the argmax path, so a tree with ``topk == 1`` equals the chain when greedy
     (when sampling it is the top-1 tree: also exact, but it accepts p(x) instead of min(1, p/q)).
4. **Roll back.** The target cache keeps the committed tokens only (crop for chains; for trees the
   accepted nodes' keys and values are gathered into place); the drafter cache is cropped to before
   this round's draft steps, and refilled next round from the target's own aux states of the
   accepted tokens, so the drafter always conditions on true target states for committed tokens.

The accept length is tokens per verification round, counting the bonus/correction token: accepted
drafts + 1, the number engines report (ceiling ``num_steps + 1``).

Aux states are read as :mod:`eagle31_mla.decoding.target` reads them (an id equal to the target's depth
pre-norm, through a hook); prompts and EOS ids as :mod:`eagle31_mla.prompts` reads them.

Sampling backends: ``sampling_backend="torch"`` (the default) draws with ``torch.multinomial`` and the
rules above; ``"flashinfer"`` (CUDA, the ``[gpu]`` extra, :mod:`eagle31_mla.model.flashinfer_backend`) truncates
to top-p with FlashInfer's ``top_p_renorm_probs``, draws (target and drafter) with ``sampling_from_probs``
and verifies chains with ``chain_speculative_sampling`` (the same chain rule, in one kernel). Trees keep the
torch rule above (FlashInfer has no point-mass tree acceptance), over FlashInfer's p. Greedy (temperature 0)
is the argmax rule under both backends: there is nothing to sample. Not yet run on a GPU.

Scope: batch 1 (requests run one after another: accepted lengths differ per request), target and
drafter on one device. Target requirements: a Transformers causal LM that returns ``hidden_states``,
uses the standard ``DynamicCache`` (plain ``DynamicLayer`` layers for tree drafting), and for trees
runs ``sdpa`` or ``eager`` attention, which take a custom 4-D mask (checked for Llama, Qwen2, Qwen3
and DeepSeek-V3 on Transformers 5.16, 5.19 and 5.24; flash-attention kernels cannot take one and
are refused with a hint). The mask is passed additive (0 / dtype min), not boolean: ``eager``
attention adds the mask to the scores, so a boolean one would silently let every node see every
other.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterable as _Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.modeling_eagle31_mla import (
    DraftInputError,
    Eagle31MLAForCausalLM,
    LatentKVCache,
    check_sampling_settings,
    sample_from_logits,
    sampling_probs,
)
from ..prompts import PROMPT_SHAPES, eos_token_ids, is_int, prompt_tensor, prompt_token_ids, shown as describe_value
from ..serving.engines import max_tree_draft_tokens
from .target import CachedTarget, TargetAuxCapture

__all__ = [
    "AcceptanceStats",
    "SpeculativeOutput",
    "speculative_generate",
    "measure_acceptance",
    "accept_chain",
    "accept_tree",
    "check_settings",
    "context_limit",
    "DRAFTING_LIMITS",
]


# ----------------------------------------------------------------------------------------------
# The accept / resample rules (vectorised over B independent trials; the loop uses B = 1)
# ----------------------------------------------------------------------------------------------


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of [B, V] (rows need not be normalised)."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _draw(logits: torch.Tensor, temperature: float, top_p: float, generator, backend: str) -> int:
    """The target's next token from its last-position logits [1, V], by the sampling backend's rule."""
    if backend == "torch":
        return int(_sample(sampling_probs(logits, temperature, top_p), generator))
    return int(sample_from_logits(logits, temperature, top_p, generator, backend)[0])


def accept_chain(
    draft_tokens: torch.Tensor,  # [B, k] drafted target ids, d_j ~ q_j
    draft_probs: torch.Tensor,  # [B, k, V] q_j, target vocabulary
    target_probs: torch.Tensor,  # [B, k+1, V] p_j after the committed prefix and d_1..d_j
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling over a chain: returns the number of accepted drafts [B] and the
    token that follows them [B] (the correction, or the bonus token after k accepts)."""
    B, k = draft_tokens.shape
    p = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k] p_j(d_j)
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k] q_j(d_j) > 0
    u = torch.rand(B, k, generator=generator, device=p.device)
    # accept d_j with probability min(1, p/q)  <=>  u·q < p  (no division; q = p always accepts)
    accepted = (u * q < p).long().cumprod(dim=1)  # [B, k], 1 up to the first rejection
    num_accepted = accepted.sum(1)  # [B]
    # at the first rejection j: resample from norm(max(p_j - q_j, 0)); after k accepts q_k := 0, so
    # the same expression gives the bonus token from p_k
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, k+1, V]
    at = num_accepted[:, None, None].expand(B, 1, target_probs.shape[-1])
    residual = (target_probs.gather(1, at) - q_pad.gather(1, at)).clamp_min(0)[:, 0]  # [B, V]
    return num_accepted, _sample(residual, generator)


def accept_tree(
    tokens: torch.Tensor,  # [N] target id of each tree node; node 0 is the root (the last committed token)
    parents: Sequence[int],  # [N] parent node of each node (parents[0] = -1, parents[i] < i)
    target_probs: torch.Tensor,  # [B, N, V] p after each node
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling down a tree of deterministic drafts: returns the number of
    accepted drafts [B], the accepted nodes [B, depth] (-1 past the end) and the next token [B]."""
    B, N, V = target_probs.shape
    device = target_probs.device
    children: list[list[int]] = [[] for _ in range(N)]
    depth = [0] * N
    for i in range(1, N):
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
    max_depth, width = max(depth), max(len(c) for c in children)
    table = torch.full((N, max(width, 1)), -1, dtype=torch.long, device=device)  # children in order, -1 = none
    for i, c in enumerate(children):
        table[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    rows = torch.arange(B, device=device)
    tokens = tokens.to(device)

    node = torch.zeros(B, dtype=torch.long, device=device)  # current node: the root
    residual = target_probs[:, 0].clone()  # [B, V] what is left of p at the current node
    live = torch.ones(B, dtype=torch.bool, device=device)  # still walking down
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=device)
    for d in range(max_depth):
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        for j in range(width):
            child = table[node, j]  # [B]
            trying = live & ~moved & (child >= 0)
            if not bool(trying.any()):
                continue
            x = tokens[child.clamp_min(0)]  # [B]
            # a point-mass draft x: accept with probability min(1, p(x)/1) = p(x) ...
            accept = trying & (torch.rand(B, generator=generator, device=device) < residual[rows, x])
            reject = trying & ~accept
            # ... else p <- norm(max(p - onehot(x), 0)): x's mass goes, the rest is renormalised
            zeroed = residual.scatter(1, x[:, None], 0.0)
            residual = torch.where(reject[:, None], zeroed / zeroed.sum(-1, keepdim=True).clamp_min(1e-30), residual)
            # accepted: step into the child, whose own p is fresh
            node = torch.where(accept, child, node)
            residual = torch.where(accept[:, None], target_probs[rows, node], residual)
            path[:, d] = torch.where(accept, child, path[:, d])
            moved |= accept
        live &= moved
    num_accepted = (path >= 0).sum(1)
    return num_accepted, path, _sample(residual, generator)


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


@dataclass
class AcceptanceStats:
    """Acceptance of one request or a run: ``accept_histogram[m]`` counts verification rounds that
    accepted m drafts (m = 0..num_steps, before truncation at EOS / max_new_tokens)."""

    num_steps: int
    draft_tokens_per_round: int
    accept_histogram: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0  # new tokens, the one sampled after the prompt included
    num_requests: int = 0

    def __post_init__(self) -> None:
        if not self.accept_histogram:
            self.accept_histogram = [0] * (self.num_steps + 1)

    def record(self, num_accepted: int) -> None:
        self.accept_histogram[num_accepted] += 1

    @property
    def num_rounds(self) -> int:
        """Verification steps (vLLM: ``num_drafts``)."""
        return sum(self.accept_histogram)

    @property
    def num_draft_tokens(self) -> int:
        return self.num_rounds * self.draft_tokens_per_round

    @property
    def num_accepted_tokens(self) -> int:
        return sum(m * n for m, n in enumerate(self.accept_histogram))

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verification round, the bonus/correction token included (ceiling num_steps + 1)."""
        rounds = self.num_rounds
        return (self.num_accepted_tokens + rounds) / rounds if rounds else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Share of rounds whose draft at position (depth) j + 1 was accepted."""
        rounds = self.num_rounds
        return [sum(self.accept_histogram[j + 1 :]) / rounds if rounds else float("nan") for j in range(self.num_steps)]

    @property
    def draft_tokens_per_generated_token(self) -> float:
        return self.num_draft_tokens / self.num_generated_tokens if self.num_generated_tokens else float("nan")

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        if (self.num_steps, self.draft_tokens_per_round) != (other.num_steps, other.draft_tokens_per_round):
            raise ValueError("cannot add statistics of runs with different drafting settings")
        return AcceptanceStats(
            self.num_steps,
            self.draft_tokens_per_round,
            [a + b for a, b in zip(self.accept_histogram, other.accept_histogram)],
            self.num_generated_tokens + other.num_generated_tokens,
            self.num_requests + other.num_requests,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests,
            "num_steps": self.num_steps,
            "draft_tokens_per_round": self.draft_tokens_per_round,
            "num_rounds": self.num_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "mean_accept_length": self.mean_accept_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "accept_histogram": list(self.accept_histogram),
            "draft_tokens_per_generated_token": self.draft_tokens_per_generated_token,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceStats:
        return cls(
            d["num_steps"],
            d["draft_tokens_per_round"],
            list(d["accept_histogram"]),
            d["num_generated_tokens"],
            d["num_requests"],
        )

    def table(self) -> str:
        rounds = self.num_rounds
        lines = [
            f"requests {self.num_requests}, generated tokens {self.num_generated_tokens}, "
            f"verification rounds {rounds}, "
            f"{self.draft_tokens_per_round} draft tokens per round ({self.num_steps} steps)",
            f"mean accept length          {self.mean_accept_length:.3f}  (tokens per round, bonus included; "
            f"ceiling {self.num_steps + 1})",
            f"draft tokens per new token  {self.draft_tokens_per_generated_token:.3f}",
            "",
            f"{'position':>8}  {'acceptance rate':>15}",
        ]
        lines += [f"{j + 1:>8}  {rate:>15.3f}" for j, rate in enumerate(self.acceptance_rate_per_position)]
        lines += ["", f"{'accepted':>8}  {'rounds':>8}  {'share':>6}  histogram"]
        for m, n in enumerate(self.accept_histogram):
            share = n / rounds if rounds else 0.0
            lines.append(f"{m:>8}  {n:>8}  {share:>6.3f}  {'#' * round(40 * share)}")
        return "\n".join(lines)


@dataclass
class SpeculativeOutput:
    """``tokens``: the new tokens; ``accepted_per_round``: drafts accepted at each verification;
    ``finish_reason``: "stop" (an EOS token) or "length" (``max_new_tokens``, or the context limit:
    then ``context_limited`` is True)."""

    tokens: list[int]
    stats: AcceptanceStats
    accepted_per_round: list[int]
    finish_reason: str = "length"
    context_limited: bool = False


def context_limit(target, drafter) -> int:
    """The most tokens (prompt + generated) one sequence may hold: the smaller of the target's and the
    drafter's ``max_position_embeddings`` (what an engine's ``max_model_len`` defaults to)."""
    limits = [drafter.config.max_position_embeddings]
    target_limit = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if is_int(target_limit) and target_limit > 0:
        limits.append(target_limit)
    return min(limits)


# ----------------------------------------------------------------------------------------------
# Drafting
# ----------------------------------------------------------------------------------------------


def _draft_probs_in_target_vocab(drafter: Eagle31MLAForCausalLM, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[.., draft_vocab] -> [.., vocab]: a pruned vocabulary's probabilities moved to target ids via d2t."""
    if drafter.d2t is None:
        return probs
    target_ids = torch.arange(probs.shape[-1], device=probs.device) + drafter.d2t
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return out.index_copy(-1, target_ids, probs)


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k along the last dim, ties to the lowest index (as argmax; torch.topk leaves ties unordered)."""
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]


@dataclass
class _Tree:
    tokens: torch.Tensor  # [N] target ids; node 0 = the root (last committed token)
    parents: list[int]  # [N], parents[0] = -1
    depth: list[int]  # [N]

    def mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        N = len(self.parents)
        allow = torch.eye(N, dtype=torch.bool)
        for i in range(1, N):
            allow[i] |= allow[self.parents[i]]
        return allow

    def target_mask(self, past: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[1, 1, N, past+N] additive mask for the target: the whole cached prefix plus the node's branch.
        Additive (0 / dtype min), not bool: eager attention adds the mask to the scores."""
        allow = torch.cat([torch.ones(len(self.parents), past, dtype=torch.bool), self.mask()], dim=1)
        mask = torch.zeros(allow.shape, dtype=dtype).masked_fill(~allow, torch.finfo(dtype).min)
        return mask.to(device)[None, None]


def _top_k_tree(
    drafter,
    cache: LatentKVCache,
    logits,
    state,
    last_position: int,
    num_steps: int,
    topk: int,
    num_nodes: int,
    root: int,
) -> _Tree:
    """EAGLE top-k tree: ``logits`` [Vd] and ``state`` [H] come from the drafter at the root's position."""
    c0 = cache.get_seq_length()
    device = logits.device
    # the pool of candidate nodes, in generation order (a parent always precedes its children)
    scores = []  # tensors of cumulative log-probabilities
    draft_ids = []  # tensors of draft-vocabulary ids
    parent_of: list[int] = []  # pool index of the parent, -1 = root
    slot: dict[int, int] = {}  # pool index -> drafter cache position (nodes fed to the drafter)
    ancestors: dict[int, list[int]] = {}  # pool index -> cache positions of its fed ancestors

    lp, ids = _top(torch.log_softmax(logits.float(), -1), topk)  # depth 1: the root's top-k children
    scores.append(lp)
    draft_ids.append(ids)
    parent_of += [-1] * topk
    frontier = list(range(topk))  # pool indices expanded next
    frontier_scores, frontier_states = lp, state[None].expand(topk, -1)  # [k], [k, H] the state each is fed with
    for p in frontier:
        ancestors[p] = []
    for step in range(1, num_steps):
        T, base = len(frontier), cache.get_seq_length()
        mask = torch.zeros(1, 1, T, base + T, dtype=torch.bool, device=device)
        mask[..., :c0] = True  # the committed context
        for i, p in enumerate(frontier):
            mask[0, 0, i, ancestors[p]] = True  # its own branch
            mask[0, 0, i, base + i] = True
            slot[p] = base + i
        ids = drafter.draft_to_target_ids(torch.cat(draft_ids)[frontier])[None]  # [1, T]
        positions = torch.full((1, T), last_position + step, dtype=torch.long, device=device)
        out = drafter(
            ids,
            hidden_states=frontier_states[None],
            past_key_values=cache,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
        )
        # children of each leaf, ranked by cumulative log-probability
        lp, child = _top(torch.log_softmax(out.logits[0].float(), -1), topk)  # [T, k]
        child_scores = frontier_scores[:, None] + lp  # [T, k]
        first = sum(s.numel() for s in scores)
        scores.append(child_scores.flatten())
        draft_ids.append(child.flatten())
        parent_of += [p for p in frontier for _ in range(topk)]
        # the next leaves to expand: the best k of the k·k children
        best = _top(child_scores.flatten(), topk)[1].tolist()
        new_frontier = [first + b for b in best]
        for b, p in zip(best, new_frontier):
            parent = frontier[b // topk]
            ancestors[p] = ancestors[parent] + [slot[parent]]
        frontier_states = out.hidden_states[0][[b // topk for b in best]]  # [k, H]
        frontier_scores = child_scores.flatten()[best]
        frontier = new_frontier

    # the tree: the best num_nodes - 1 candidates (stable: a parent ties before its children)
    chosen = sorted(_top(torch.cat(scores), num_nodes - 1)[1].tolist())
    node_of = {-1: 0, **{p: i + 1 for i, p in enumerate(chosen)}}
    if any(parent_of[p] not in node_of for p in chosen):
        raise AssertionError("tree selection is not closed under parents")
    parents = [-1] + [node_of[parent_of[p]] for p in chosen]
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    tokens = drafter.draft_to_target_ids(torch.cat(draft_ids)[chosen])
    tokens = torch.cat([torch.tensor([root], device=device), tokens])
    return _Tree(tokens, parents, depth)


@dataclass
class _Round:
    """One round's draft as verification sees it, chain or tree: node 0 is the root (the last committed
    token), verified with the drafts in one target forward."""

    nodes: torch.Tensor  # [1, N] target ids
    positions: torch.Tensor  # [1, N] the root's position plus each node's depth
    mask: torch.Tensor | None  # [1, 1, N, L+N] additive tree mask; None: causal (a chain)


@dataclass
class _ChainRound(_Round):
    drafts: torch.Tensor  # [1, k] target ids, d_j ~ q_j
    q: torch.Tensor  # [1, k, V] the drafter's distributions in the target vocabulary
    rule: Any = accept_chain  # accept_chain, or flashinfer_backend.accept_chain (same signature)

    def accept(self, p: torch.Tensor, generator) -> tuple[int, list[int], torch.Tensor]:
        """(accepted drafts m, the accepted nodes 1..m, the next token) by rejection sampling against p [1, N, V]."""
        m, nxt = self.rule(self.drafts, self.q, p, generator)
        return int(m), list(range(1, int(m) + 1)), nxt

    def roll_back(self, target: CachedTarget, committed: int, keep: list[int]) -> None:
        target.crop(committed + len(keep))  # the root and the accepted prefix


@dataclass
class _TreeRound(_Round):
    tree: _Tree

    def accept(self, p: torch.Tensor, generator) -> tuple[int, list[int], torch.Tensor]:
        """(accepted drafts m, the accepted path of nodes, the next token) walking down the tree against p [1, N, V]."""
        m, path, nxt = accept_tree(self.tree.tokens, self.tree.parents, p, generator)
        return int(m), path[0, : int(m)].tolist(), nxt

    def roll_back(self, target: CachedTarget, committed: int, keep: list[int]) -> None:
        target.keep(torch.cat([torch.arange(committed), committed + torch.tensor(keep)]))  # the path moves into place


def _draft_chain(
    drafter,
    cache,
    ids,
    aux,
    root: int,
    committed: int,
    *,
    device,
    num_steps,
    temperature,
    top_p,
    generator,
    vocab_size,
    sampling_backend="torch",
) -> tuple[_ChainRound, LatentKVCache]:
    """Chain drafting (topk 1): the drafter catches up on ``ids`` / ``aux`` (the committed tokens), then
    samples ``num_steps`` tokens from its (temperature, top-p) q, each step fed the previous one."""
    d = drafter.draft(
        ids,
        aux,
        num_steps,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        past_key_values=cache,
        sampling_backend=sampling_backend,
    )
    drafts = d.tokens.to(device)  # [1, k] target ids
    nodes = torch.cat([torch.tensor([[root]], device=device), drafts], dim=1)  # [1, k+1]
    positions = torch.arange(committed, committed + num_steps + 1, device=device)[None]
    q = _draft_probs_in_target_vocab(drafter, d.probs, vocab_size).to(device)
    rule = accept_chain
    if sampling_backend == "flashinfer" and temperature > 0:  # greedy keeps the argmax rule (one-hot p and q)
        from ..model.flashinfer_backend import accept_chain as rule
    return _ChainRound(nodes, positions, None, drafts, q, rule), d.past_key_values


def _draft_tree(
    drafter, cache, ids, aux, root: int, committed: int, *, device, num_steps, topk, num_nodes, dtype
) -> tuple[_TreeRound, LatentKVCache]:
    """Tree drafting: the drafter catches up on ``ids`` / ``aux`` (the committed tokens), then grows
    EAGLE's top-k tree of ``num_nodes`` nodes (:func:`_top_k_tree`); deterministic, no sampling."""
    step = drafter(ids, aux_hidden_states=aux, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache = step.past_key_values
    tree = _top_k_tree(
        drafter,
        cache,
        step.logits[0, -1],
        step.hidden_states[0, -1],
        cache.get_seq_length() - 1,
        num_steps,
        topk,
        num_nodes,
        root,
    )
    nodes = tree.tokens.to(device)[None]  # [1, N]
    positions = (committed + torch.tensor(tree.depth, device=device))[None]  # a node sits at root + its depth
    return _TreeRound(nodes, positions, tree.target_mask(committed, dtype, device), tree), cache


# ----------------------------------------------------------------------------------------------
# Checks and the loop
# ----------------------------------------------------------------------------------------------


#: Upper bounds of the drafting counts (the CLI's types and :func:`check_settings` share them): far
#: above any useful setting (engines draft <= ~10 steps, trees of <= a few hundred nodes), low enough
#: that a typo fails at once instead of exhausting memory.
DRAFTING_LIMITS = {"num_steps": 64, "topk": 64, "num_draft_tokens": 4096, "max_new_tokens": 10_000_000}


def check_settings(
    num_steps,
    topk,
    num_draft_tokens,
    temperature,
    top_p,
    tree=None,
    max_new_tokens=1,
    *,
    draft_vocab_size: int | None = None,
) -> tuple[bool, int]:
    """Settings of the loop, checked before any compute (sampling ones by the library-wide rule,
    :func:`~eagle31_mla.model.modeling_eagle31_mla.check_sampling_settings`); ``topk`` at most the drafter's
    ``draft_vocab_size`` when given. Returns (tree, tokens verified per round, root included)."""
    for name, value, low in (("num_steps", num_steps, 1), ("topk", topk, 1), ("max_new_tokens", max_new_tokens, 1)):
        if not is_int(value) or not low <= value <= DRAFTING_LIMITS[name]:
            raise DraftInputError(f"`{name}` is {value!r}; expected an int in [{low}, {DRAFTING_LIMITS[name]}]")
    if num_draft_tokens is not None and not (
        is_int(num_draft_tokens) and num_draft_tokens <= DRAFTING_LIMITS["num_draft_tokens"]
    ):
        raise DraftInputError(
            f"`num_draft_tokens` is {num_draft_tokens!r}; expected an int <= "
            f"{DRAFTING_LIMITS['num_draft_tokens']} (root included) or None"
        )
    if tree is not None and not isinstance(tree, bool):
        raise DraftInputError(f"`tree` is {tree!r}; expected a bool or None (None: topk > 1)")
    if draft_vocab_size is not None and not 1 <= topk <= draft_vocab_size:
        raise DraftInputError(f"topk must be in [1, draft_vocab_size={draft_vocab_size}], got {topk}")
    check_sampling_settings(temperature, top_p)
    tree = topk > 1 if tree is None else tree
    if not tree:
        if topk != 1:
            raise DraftInputError(f"chain drafting has topk 1, got {topk}")
        chain = max_tree_draft_tokens(1, num_steps)
        if num_draft_tokens not in (None, chain):
            raise DraftInputError(
                f"chain drafting verifies num_steps + 1 = {chain} tokens, got num_draft_tokens {num_draft_tokens}"
            )
        return False, chain
    pool = max_tree_draft_tokens(topk, num_steps) - 1
    if num_draft_tokens is None:
        if topk > 1:
            raise DraftInputError(
                f"tree drafting (topk {topk}) needs num_draft_tokens (root included), at most {pool + 1}"
            )
        num_draft_tokens = max_tree_draft_tokens(1, num_steps)  # a top-1 tree is a chain
    if not 2 <= num_draft_tokens <= pool + 1:
        raise DraftInputError(
            f"num_draft_tokens (root included) must be in [2, {pool + 1}] for topk {topk} and {num_steps} steps, "
            f"got {num_draft_tokens}"
        )
    return True, num_draft_tokens


def _check_models(target, drafter) -> int:
    """``target`` is a Transformers causal LM (not a drafter), ``drafter`` an EAGLE-3.1 drafter; returns the
    target's vocabulary size."""
    from ..serving.engines import looks_like_a_drafter

    if not isinstance(drafter, Eagle31MLAForCausalLM):
        raise DraftInputError(f"`drafter` is {describe_value(drafter)}; expected an Eagle31MLAForCausalLM")
    config = getattr(target, "config", None)
    if not (isinstance(target, torch.nn.Module) and callable(getattr(config, "get_text_config", None))):
        raise DraftInputError(
            f"`target` is {describe_value(target)}; expected a Transformers causal LM (a torch module with a config)"
        )
    try:
        as_dict = config.to_dict() if callable(getattr(config, "to_dict", None)) else {}
    except Exception:  # noqa: BLE001 - an odd config: the pair check below reports what matters
        as_dict = {}
    if isinstance(target, Eagle31MLAForCausalLM) or looks_like_a_drafter(as_dict):
        raise DraftInputError(
            "`target` is an EAGLE drafter (its config has EAGLE architectures / aux-layer keys); "
            "expected the target model it drafts for"
        )
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not is_int(vocab) or vocab < 1:
        raise DraftInputError(f"`target` has vocab_size {vocab!r} in its config; expected a positive int")
    return int(vocab)


def _check_generator(generator, target) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise DraftInputError(f"`generator` is {describe_value(generator)}; expected a torch.Generator or None")
    device = next(target.parameters()).device
    if generator.device.type != device.type:
        raise DraftInputError(f"`generator` is on {generator.device}; expected one on the target's device ({device})")


def _require_sampling_backend(backend, target, drafter) -> None:
    """``backend`` one of "torch" / "flashinfer"; for "flashinfer", FlashInfer must run where both models are."""
    if backend not in ("torch", "flashinfer"):
        raise DraftInputError(f"`sampling_backend` is {backend!r}; expected one of ('torch', 'flashinfer')")
    if backend == "flashinfer":
        from ..model.flashinfer_backend import require

        for model in (target, drafter):
            require(next(model.parameters()).device)


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise DraftInputError(f"`{name}` is {describe_value(value)}; expected True or False")


def _check_pair(target, drafter) -> None:
    from ..serving.compatibility import Sizes, size_mismatches

    text_config = target.config.get_text_config()
    config = drafter.config
    built_for = Sizes(config.target_hidden_size, config.vocab_size, config.target_num_hidden_layers)
    sizes = Sizes(text_config.hidden_size, text_config.vocab_size, text_config.num_hidden_layers)
    mismatches = size_mismatches(built_for, sizes)
    if mismatches:
        raise DraftInputError("; ".join(m.message for m in mismatches))


@torch.no_grad()
def speculative_generate(
    target,
    drafter: Eagle31MLAForCausalLM,
    input_ids: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int = 64,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    tree: bool | None = None,
    sampling_backend: str = "torch",
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` after one prompt (``input_ids`` [1, n] or a list) with EAGLE
    speculative decoding; stops after any of ``eos_token_id``. ``tree`` defaults to ``topk > 1``;
    ``tree=True`` with ``topk=1`` runs the tree code on a chain (it equals chain drafting when greedy).
    ``num_draft_tokens`` counts the root, as SGLang's flag does (chain: num_steps + 1).
    ``sampling_backend`` "flashinfer" samples and verifies chains with FlashInfer on CUDA (module docstring);
    without CUDA or the package it raises ``FlashInferUnavailable``, naming what is missing.

    Generation stops at the context limit (:func:`context_limit`, as an engine stops at ``max_model_len``;
    ``finish_reason`` "length", ``context_limited`` True): a verification round runs only when all it can
    emit fits, and the last few tokens before the limit are decoded by the target alone (they count as
    generated tokens, not as rounds, so the acceptance statistics cover full rounds only)."""
    vocab = _check_models(target, drafter)
    tree, num_nodes = check_settings(
        num_steps,
        topk,
        num_draft_tokens,
        temperature,
        top_p,
        tree,
        max_new_tokens,
        draft_vocab_size=drafter.config.draft_vocab_size,
    )
    _check_pair(target, drafter)
    eos = set(eos_token_ids(eos_token_id, vocab_size=vocab, strict=True))
    _check_generator(generator, target)
    _require_sampling_backend(sampling_backend, target, drafter)
    prompt = prompt_tensor(input_ids, vocab)
    limit = context_limit(target, drafter)
    if prompt.shape[1] >= limit:
        raise DraftInputError(
            f"the prompt has {prompt.shape[1]} tokens; expected fewer than the context limit of "
            f"{limit} positions (max_position_embeddings), leaving room for a new token"
        )
    attention = getattr(target.config.get_text_config(), "_attn_implementation", None)  # the language model's
    if tree and attention not in (None, "sdpa", "eager"):
        raise ValueError(
            f"tree verification passes a custom 4-D attention mask, which {attention!r} "
            "cannot take; load the target with attn_implementation='sdpa' (or 'eager')"
        )
    device = next(target.parameters()).device
    prompt = prompt.to(device)
    draft_device, draft_dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    stats = AcceptanceStats(num_steps, num_nodes - 1, num_requests=1)
    accepted_per_round: list[int] = []
    if tree:
        draft = functools.partial(
            _draft_tree, drafter, device=device, num_steps=num_steps, topk=topk, num_nodes=num_nodes, dtype=target.dtype
        )
    else:
        draft = functools.partial(
            _draft_chain,
            drafter,
            device=device,
            num_steps=num_steps,
            temperature=temperature,
            top_p=top_p,
            generator=generator,
            vocab_size=vocab,
            sampling_backend=sampling_backend,
        )

    with TargetAuxCapture(target, drafter.config.aux_layer_ids) as capture:
        tgt = CachedTarget(target, capture)
        n = prompt.shape[1]
        logits, aux = tgt.forward(prompt, torch.arange(n, device=device)[None], last_only=True)
        token = _draw(logits[:, -1], temperature, top_p, generator, sampling_backend)
        out = [token]
        # EAGLE's shift: drafter position i gets token i+1's embedding and the target's state at position i
        pending_ids = torch.cat([prompt[:, 1:], prompt.new_tensor([[token]])], dim=1)  # [1, n]
        pending_aux = aux  # [1, n, n·Ht]
        draft_cache = None
        context_limited = False
        while len(out) < max_new_tokens and token not in eos:
            L = tgt.length  # committed tokens in the target cache; `token` (position L) is not yet
            if L + 1 >= limit:  # the sequence (L committed + `token`) fills the context
                context_limited = True
                break
            if L + 1 + num_steps + 1 > limit:  # a full round could emit past the limit: the target alone
                logits, _ = tgt.forward(prompt.new_tensor([[token]]), torch.tensor([[L]], device=device))
                token = _draw(logits[:, -1], temperature, top_p, generator, sampling_backend)
                out.append(token)
                continue
            # 1. draft (the drafter first catches up on the committed tokens' true target states)
            pending = pending_ids.to(draft_device), pending_aux.to(draft_device, draft_dtype)
            drafted, draft_cache = draft(draft_cache, *pending, token, L)
            draft_cache.crop(L)  # forget this round's draft steps; the accepted tokens are refilled next round

            # 2. verify: one target forward over the root and the draft tokens
            logits, aux = tgt.forward(drafted.nodes, drafted.positions, drafted.mask)  # [1, N, V], [1, N, n·Ht]

            # 3. accept
            m, path, nxt = drafted.accept(sampling_probs(logits, temperature, top_p, sampling_backend), generator)
            stats.record(m)
            accepted_per_round.append(m)

            # 4. roll back the target cache to the committed tokens, commit, queue the drafter's refill
            keep = [0] + path  # the root and the accepted nodes
            drafted.roll_back(tgt, L, keep)
            new = drafted.nodes[0, path].tolist() + [int(nxt)]
            pending_ids = prompt.new_tensor([new])  # [1, m+1]
            pending_aux = aux[:, keep]  # [1, m+1, n·Ht]
            for tok in new:
                if len(out) == max_new_tokens or token in eos:
                    break
                out.append(tok)
                token = tok
        stats.num_generated_tokens = len(out)
    context_limited = context_limited or (token not in eos and len(out) < max_new_tokens)
    return SpeculativeOutput(out, stats, accepted_per_round, "stop" if token in eos else "length", context_limited)


# ----------------------------------------------------------------------------------------------
# Acceptance measurement: Python API and the command-line logic
# ----------------------------------------------------------------------------------------------


def _default_eos(target) -> list[int]:
    """The target's EOS ids: its ``generation_config``'s, else its text config's."""
    for source in (getattr(target, "generation_config", None), target.config.get_text_config()):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return list(eos_token_ids(eos))
    return []


@torch.no_grad()
def measure_acceptance(
    target,
    drafter: Eagle31MLAForCausalLM,
    prompts: Iterable[Any],
    *,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
    tokenizer=None,
    eos_token_id: int | Iterable[int] | None = None,
    ignore_eos: bool = False,
    progress: bool = False,
    sampling_backend: str = "torch",
) -> dict[str, Any]:
    """Run every prompt (text, chat ``messages``, ``input_ids`` objects or id lists) through
    :func:`speculative_generate`; returns ``{"settings", "total", "requests"}``, JSON-ready (``total`` and
    each request carry :meth:`AcceptanceStats.to_dict`; requests also carry their output ids).
    EOS defaults to the target's ``generation_config``; ``ignore_eos`` generates ``max_new_tokens`` always.
    ``sampling_backend``: as :func:`speculative_generate`'s."""
    from tqdm.auto import tqdm

    vocab = _check_models(target, drafter)
    check_settings(
        num_steps,
        topk,
        num_draft_tokens,
        temperature,
        top_p,
        None,
        max_new_tokens,
        draft_vocab_size=drafter.config.draft_vocab_size,
    )
    _check_pair(target, drafter)
    _check_flag("ignore_eos", ignore_eos)
    _check_flag("progress", progress)
    _require_sampling_backend(sampling_backend, target, drafter)
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise DraftInputError(f"`seed` is {describe_value(seed)}; expected an int in [0, 2**63)")
    if tokenizer is not None and (
        isinstance(tokenizer, (str, bytes)) or not callable(getattr(tokenizer, "encode", None))
    ):
        raise DraftInputError(f"`tokenizer` is {describe_value(tokenizer)}; expected a Transformers tokenizer or None")
    if isinstance(prompts, (str, bytes, bytearray, Mapping, torch.Tensor)) or not isinstance(prompts, _Iterable):
        raise DraftInputError(
            f"`prompts` is {describe_value(prompts)}; expected a list of prompts, each {PROMPT_SHAPES}"
        )
    prompts = list(prompts)
    if not prompts:
        raise DraftInputError(
            "`prompts` is empty; expected at least one prompt (statistics of no requests are undefined)"
        )
    eos = sorted(set(eos_token_ids(eos_token_id, vocab_size=vocab, strict=True))) if eos_token_id is not None else None
    eos = [] if ignore_eos else (_default_eos(target) if eos is None else eos)
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    settings = dict(
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        eos_token_id=eos,
    )
    total = None
    requests = []
    bar = tqdm(prompts, desc="acceptance", unit="req", disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(bar):
        ids = prompt_token_ids(prompt, tokenizer, target.config.get_text_config().vocab_size, f"prompt {i}")
        result = speculative_generate(
            target,
            drafter,
            ids,
            max_new_tokens=max_new_tokens,
            num_steps=num_steps,
            topk=topk,
            num_draft_tokens=num_draft_tokens,
            temperature=temperature,
            top_p=top_p,
            eos_token_id=eos,
            generator=generator,
            sampling_backend=sampling_backend,
        )
        total = result.stats if total is None else total + result.stats
        requests.append(
            {
                "index": i,
                "num_prompt_tokens": len(ids),
                **result.stats.to_dict(),
                "output_ids": result.tokens,
                "finish_reason": result.finish_reason,
                "context_limited": result.context_limited,
            }
        )
        bar.set_postfix(accept_length=f"{total.mean_accept_length:.3f}")
    if total is None:
        _, nodes = check_settings(num_steps, topk, num_draft_tokens, temperature, top_p)
        total = AcceptanceStats(num_steps, nodes - 1)
    settings["num_draft_tokens"] = total.draft_tokens_per_round + 1
    return {"settings": settings, "total": total.to_dict(), "requests": requests}
