"""Reference speculative decoding with the EAGLE-3.1 MLA drafter and a Transformers target.

What the serving engines do, in plain PyTorch, one request at a time (batch 1, one device), so that acceptance
can be measured offline and every engine checked against it. A round (gpt-fast's ``speculative_decode``):

1. **Draft.** The drafter catches up on the tokens committed last round (EAGLE's shift), then drafts ``num_steps``
   tokens from its q (a chain), or grows EAGLE's top-k tree: each step expands the ``topk`` best leaves in one call;
   the best ``num_draft_tokens - 1`` nodes by cumulative log-probability form the tree under the root.
2. **Verify.** ONE target forward over the root and the drafts (a tree mask for trees: ``sdpa`` or ``eager``).
3. **Accept**, so that the output follows exactly the target's p (after temperature / top-p): a chain by
   speculative rejection sampling (Leviathan et al. 2023), a tree of point-mass drafts by EAGLE's
   ``evaluate_posterior`` (the rules beside the code). Greedy is the same rules with one-hot p and q.
4. **Roll back.** The target cache keeps the committed tokens (a tree's accepted path is gathered into place);
   the drafter cache is cropped to before the draft steps and refilled next round from the target's own states.

The accept length counts the bonus/correction token (as engines do). ``sampling_backend="flashinfer"``: docs/gpu.md.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..model.modeling_eagle31_mla import (
    DraftInputError,
    Eagle31MLAForCausalLM,
    check_sampling_settings,
    flashinfer_backend,
    sample_from_logits,
    sampling_probs,
)
from ..prompts import PROMPT_SHAPES, eos_token_ids, is_int, prompt_tensor, prompt_token_ids, shown
from .limits import DRAFTING_LIMITS, max_tree_draft_tokens
from .target import CachedTarget, TargetAuxCapture

# ---- The accept / resample rules (vectorised over B independent trials; the loop uses B = 1) ----------------


def accept_chain(
    draft_tokens: torch.Tensor,  # [B, k] drafted target ids, d_j ~ q_j
    draft_probs: torch.Tensor,  # [B, k, V] q_j, target vocabulary
    target_probs: torch.Tensor,  # [B, k+1, V] p_j after the committed prefix and d_1..d_j
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling over a chain: accepted drafts [B] and the token after them [B] (correction or bonus)."""
    B, k = draft_tokens.shape
    p = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k] p_j(d_j)
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k] q_j(d_j) > 0
    u = torch.rand(B, k, generator=generator, device=p.device)
    # accept d_j with probability min(1, p/q)  <=>  u·q < p  (no division; q = p always accepts)
    num_accepted = (u * q < p).long().cumprod(dim=1).sum(1)  # [B]: accepted up to the first rejection
    # at the first rejection j resample from norm(max(p_j - q_j, 0)); after k accepts q_k := 0: the bonus from p_k
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, k+1, V]
    at = num_accepted[:, None, None].expand(B, 1, target_probs.shape[-1])
    residual = (target_probs.gather(1, at) - q_pad.gather(1, at)).clamp_min(0)[:, 0]  # [B, V]
    return num_accepted, torch.multinomial(residual, 1, generator=generator)[:, 0]


def accept_tree(
    tokens: torch.Tensor,  # [N] target id of each node; node 0 is the root (the last committed token)
    parents: Sequence[int],  # [N] parent node of each node (parents[0] = -1, parents[i] < i)
    target_probs: torch.Tensor,  # [B, N, V] p after each node
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling down a tree of point-mass drafts: accepted drafts [B], nodes [B, depth] (-1), next [B]."""
    B, N, V = target_probs.shape
    device = target_probs.device
    children = [[c for c in range(1, N) if parents[c] == i] for i in range(N)]  # in order
    depth = [0] * N
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
    width = max(len(c) for c in children)
    table = torch.full((N, max(width, 1)), -1, dtype=torch.long, device=device)  # children in order, -1 = none
    for i, c in enumerate(children):
        table[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    rows, tokens = torch.arange(B, device=device), tokens.to(device)

    node = torch.zeros(B, dtype=torch.long, device=device)  # current node: the root
    residual = target_probs[:, 0].clone()  # [B, V] what is left of p at the current node
    live = torch.ones(B, dtype=torch.bool, device=device)  # still walking down
    path = torch.full((B, max(depth)), -1, dtype=torch.long, device=device)
    for d in range(max(depth)):
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
    return (path >= 0).sum(1), path, torch.multinomial(residual, 1, generator=generator)[:, 0]


@dataclass
class AcceptanceStats:
    """``accept_histogram[m]``: verification rounds that accepted m drafts (before truncation at EOS / length)."""

    num_steps: int
    draft_tokens_per_round: int
    accept_histogram: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0  # new tokens, the one sampled after the prompt included
    num_requests: int = 0

    def __post_init__(self) -> None:
        self.accept_histogram = list(self.accept_histogram) or [0] * (self.num_steps + 1)

    @property
    def num_rounds(self) -> int:  # verification steps (vLLM: ``num_drafts``)
        return sum(self.accept_histogram)

    @property
    def num_draft_tokens(self) -> int:
        return self.num_rounds * self.draft_tokens_per_round

    @property
    def num_accepted_tokens(self) -> int:
        return sum(m * n for m, n in enumerate(self.accept_histogram))

    @property
    def mean_accept_length(self) -> float:  # tokens per round, the bonus/correction token included
        return (self.num_accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:  # the share of rounds accepting a draft at depth j + 1
        rounds = self.num_rounds
        return [sum(self.accept_histogram[j + 1 :]) / rounds if rounds else float("nan") for j in range(self.num_steps)]

    @property
    def draft_tokens_per_generated_token(self) -> float:
        return self.num_draft_tokens / self.num_generated_tokens if self.num_generated_tokens else float("nan")

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        if (self.num_steps, self.draft_tokens_per_round) != (other.num_steps, other.draft_tokens_per_round):
            raise ValueError("cannot add statistics of runs with different drafting settings")
        histogram = [a + b for a, b in zip(self.accept_histogram, other.accept_histogram)]
        counts = (self.num_generated_tokens + other.num_generated_tokens, self.num_requests + other.num_requests)
        return AcceptanceStats(self.num_steps, self.draft_tokens_per_round, histogram, *counts)

    def to_dict(self) -> dict[str, Any]:
        names = ("num_requests", "num_steps", "draft_tokens_per_round", "num_rounds", "num_draft_tokens")
        names += ("num_accepted_tokens", "num_generated_tokens", "mean_accept_length", "acceptance_rate_per_position")
        names += ("accept_histogram", "draft_tokens_per_generated_token")
        return {name: getattr(self, name) for name in names} | {"accept_histogram": list(self.accept_histogram)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceStats:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def table(self) -> str:
        rounds = self.num_rounds
        lines = [
            f"requests {self.num_requests}, generated tokens {self.num_generated_tokens}, verification rounds "
            f"{rounds}, {self.draft_tokens_per_round} draft tokens per round ({self.num_steps} steps)",
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
    """``finish_reason``: "stop" (an EOS) or "length" (``max_new_tokens``, or the limit: ``context_limited``)."""

    tokens: list[int]
    stats: AcceptanceStats
    accepted_per_round: list[int]
    finish_reason: str = "length"
    context_limited: bool = False


@dataclass(frozen=True)
class _Settings:  # one call's settings, checked by check_settings: what every request of a run shares
    num_steps: int
    topk: int
    num_nodes: int  # tokens verified per round, the root included
    temperature: float
    top_p: float
    tree: bool
    max_new_tokens: int
    backend: str


# ---- Drafting: the round as verification sees it, node 0 the root (the last committed token): nodes [1, N],
# positions [1, N], a tree mask [1, 1, N, L+N] (bool, True = attend; None: causal), accept(p [1, N, V], generator)
# -> (accepted drafts m, the accepted nodes, the next token), and the drafter's cache.


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k along the last dim, ties to the lowest index (as argmax; torch.topk leaves ties unordered)."""
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], order[..., :k]


def _draft_chain(drafter, cache, ids, aux, root, committed, s: _Settings, generator):
    """``num_steps`` tokens sampled from the drafter's q, each step fed the previous one."""
    sampling = dict(temperature=s.temperature, top_p=s.top_p, generator=generator, sampling_backend=s.backend)
    d = drafter.draft(ids, aux, s.num_steps, past_key_values=cache, **sampling)
    drafts, q = d.tokens, d.probs  # [1, k] target ids, [1, k, Vd]
    if drafter.d2t is not None:  # a pruned vocabulary: q moved to the target ids
        to_target = drafter.draft_to_target_ids(torch.arange(q.shape[-1], device=q.device))
        q = q.new_zeros(*q.shape[:-1], drafter.config.vocab_size).index_copy(-1, to_target, q)  # [1, k, V]
    rule = accept_chain
    if s.backend == "flashinfer" and s.temperature > 0:  # greedy keeps the argmax rule (one-hot p and q)
        rule = flashinfer_backend().accept_chain

    def accept(p, generator):
        m, nxt = rule(drafts, q, p, generator)
        return int(m), list(range(1, int(m) + 1)), nxt

    nodes = torch.cat([drafts.new_tensor([[root]]), drafts], dim=1)  # [1, k+1]
    positions = torch.arange(committed, committed + s.num_steps + 1, device=drafts.device)[None]
    return nodes, positions, None, accept, d.past_key_values


def _draft_tree(drafter, cache, ids, aux, root, committed, s: _Settings, generator):
    """EAGLE's top-k tree of ``num_nodes`` nodes (root included); deterministic, nothing sampled."""
    out = drafter(ids, aux_hidden_states=aux, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache, device, topk = out.past_key_values, ids.device, s.topk
    context = cache.get_seq_length()  # the committed tokens; the root sits at position context - 1
    # the pool of candidates in generation order (a parent before its children): scores, draft ids, parents
    lp, top_ids = _top(torch.log_softmax(out.logits[0, -1].float(), -1), topk)  # the root's top-k children
    scores, draft_ids, parent_of = [lp], [top_ids], [-1] * topk
    frontier, frontier_scores = list(range(topk)), lp  # the pool indices expanded next, their scores
    states = out.hidden_states[0, -1:].expand(topk, -1)  # [k, H] the state each leaf is fed with
    branch: dict[int, list[int]] = {p: [] for p in frontier}  # pool index -> cache slots of its fed branch
    for step in range(1, s.num_steps):
        T, base = len(frontier), cache.get_seq_length()
        mask = torch.zeros(1, 1, T, base + T, dtype=torch.bool, device=device)
        mask[..., :context] = True  # the committed context
        for i, p in enumerate(frontier):
            branch[p] = branch[p] + [base + i]
            mask[0, 0, i, branch[p]] = True  # its own branch, itself included
        leaves = drafter.draft_to_target_ids(torch.cat(draft_ids)[frontier])[None]  # [1, T]
        positions = torch.full((1, T), context - 1 + step, dtype=torch.long, device=device)
        fed = drafter(
            leaves, hidden_states=states[None], past_key_values=cache, position_ids=positions, attention_mask=mask
        )
        lp, child = _top(torch.log_softmax(fed.logits[0].float(), -1), topk)  # [T, k] children of each leaf
        child_scores = (frontier_scores[:, None] + lp).flatten()  # [T·k] cumulative log-probabilities
        first = sum(x.numel() for x in scores)
        scores.append(child_scores)
        draft_ids.append(child.flatten())
        parent_of += [p for p in frontier for _ in range(topk)]
        best = _top(child_scores, topk)[1].tolist()  # the next leaves: the best k of the k·k children
        frontier = [first + b for b in best]
        for p in frontier:
            branch[p] = branch[parent_of[p]]
        frontier_scores, states = child_scores[best], fed.hidden_states[0][[b // topk for b in best]]

    # the tree: the best num_nodes - 1 candidates (stable: a parent ties before its children, so it is kept)
    chosen = sorted(_top(torch.cat(scores), s.num_nodes - 1)[1].tolist())
    node_of = {-1: 0} | {p: i + 1 for i, p in enumerate(chosen)}
    parents = [-1] + [node_of[parent_of[p]] for p in chosen]
    N = len(parents)
    depth, allow = [0] * N, torch.eye(N, dtype=torch.bool)  # allow[i, j]: node j is i or one of its ancestors
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
        allow[i] |= allow[parents[i]]
    mask = torch.cat([torch.ones(N, committed, dtype=torch.bool), allow], dim=1)[None, None]  # and the whole prefix
    tokens = torch.cat([torch.tensor([root], device=device), drafter.draft_to_target_ids(torch.cat(draft_ids)[chosen])])

    def accept(p, generator):
        m, path, nxt = accept_tree(tokens, parents, p, generator)
        return int(m), path[0, : int(m)].tolist(), nxt

    positions = (committed + torch.tensor(depth, device=device))[None]  # a node sits at the root's + its depth
    return tokens[None], positions, mask.to(device), accept, cache


# ---- Checks, once per call --------------------------------------------------------------------------------


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
    sampling_backend: str = "torch",
) -> _Settings:
    """The loop's settings, checked before any compute."""
    for name, value in (("num_steps", num_steps), ("topk", topk), ("max_new_tokens", max_new_tokens)):
        if not is_int(value) or not 1 <= value <= DRAFTING_LIMITS[name]:
            raise DraftInputError(f"`{name}` is {value!r}; expected an int in [1, {DRAFTING_LIMITS[name]}]")
    most = DRAFTING_LIMITS["num_draft_tokens"]
    if num_draft_tokens is not None and not (is_int(num_draft_tokens) and num_draft_tokens <= most):
        raise DraftInputError(f"`num_draft_tokens` is {num_draft_tokens!r}; expected None or an int <= {most}")
    if draft_vocab_size is not None and topk > draft_vocab_size:
        raise DraftInputError(f"topk must be in [1, draft_vocab_size={draft_vocab_size}], got {topk}")
    check_sampling_settings(temperature, top_p, sampling_backend)
    chain, tree = num_steps + 1, topk > 1 if tree is None else tree
    if not tree and topk != 1:
        raise DraftInputError(f"chain drafting has topk 1, got {topk}")
    if not tree and num_draft_tokens not in (None, chain):
        raise DraftInputError(
            f"chain drafting verifies num_steps + 1 = {chain} tokens, got num_draft_tokens {num_draft_tokens}"
        )
    most = max_tree_draft_tokens(topk, num_steps)  # num_steps + 1 for topk 1: a chain always fits
    if num_draft_tokens is None and topk > 1:
        raise DraftInputError(f"tree drafting (topk {topk}) needs num_draft_tokens (root included), at most {most}")
    nodes = chain if num_draft_tokens is None else num_draft_tokens  # a top-1 tree is a chain
    if not 2 <= nodes <= most:
        raise DraftInputError(
            f"num_draft_tokens (root included) must be in [2, {most}] for topk {topk} and {num_steps} steps, "
            f"got {nodes}"
        )
    return _Settings(num_steps, topk, nodes, temperature, top_p, tree, max_new_tokens, sampling_backend)


def context_limit(target, drafter) -> int:
    """The most tokens one sequence may hold: the smaller ``max_position_embeddings`` (an engine's max_model_len)."""
    ours = drafter.config.max_position_embeddings
    return min(ours, getattr(target.config.get_text_config(), "max_position_embeddings", None) or ours)


#: What a drafter records of the target it was built for: its config key -> the target's.
_BUILT_FOR = {
    "vocab_size": "vocab_size",
    "target_hidden_size": "hidden_size",
    "target_num_hidden_layers": "num_hidden_layers",
}


def _check_call(target, drafter, settings: tuple, backend: str) -> tuple[_Settings, int]:
    """What both entry points check before any compute; ``settings`` as :func:`check_settings` takes them."""
    if not isinstance(drafter, Eagle31MLAForCausalLM):
        raise DraftInputError(f"`drafter` is {shown(drafter)}; expected an Eagle31MLAForCausalLM")
    config = getattr(target, "config", None)
    if isinstance(target, Eagle31MLAForCausalLM) or not callable(getattr(config, "get_text_config", None)):
        raise DraftInputError(f"`target` is {shown(target)}; expected the Transformers causal LM it drafts for")
    s = check_settings(*settings, draft_vocab_size=drafter.config.draft_vocab_size, sampling_backend=backend)
    text = config.get_text_config()
    for ours, theirs in _BUILT_FOR.items():
        built_for, found = getattr(drafter.config, ours), getattr(text, theirs, None)
        if built_for is not None and found is not None and built_for != found:
            raise DraftInputError(
                f"the drafter's `{ours}` is {built_for} but the target's `{theirs}` is {found}; expected the "
                "target the drafter was trained for"
            )
    if backend == "flashinfer":
        for device in {next(model.parameters()).device for model in (target, drafter)}:
            flashinfer_backend().require(device)
    attention = getattr(text, "_attn_implementation", None)
    if s.tree and attention not in (None, "sdpa", "eager"):
        raise DraftInputError(
            f"tree verification passes a custom 4-D attention mask, which {attention!r} cannot take; load the "
            "target with attn_implementation='sdpa' (or 'eager')"
        )
    return s, text.vocab_size


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
    """Up to ``max_new_tokens`` after one prompt, stopping after an EOS or at :func:`context_limit` (a round runs
    only when all it can emit fits; the last few tokens come from the target alone). ``tree`` defaults to
    ``topk > 1``; ``num_draft_tokens`` counts the root, as SGLang's flag does."""
    settings = (num_steps, topk, num_draft_tokens, temperature, top_p, tree, max_new_tokens)
    s, vocab = _check_call(target, drafter, settings, sampling_backend)
    eos = set(eos_token_ids(eos_token_id, vocab_size=vocab, strict=True))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise DraftInputError(f"`generator` is {shown(generator)}; expected a torch.Generator or None")
    return _generate(target, drafter, prompt_tensor(input_ids, vocab), s, eos, generator)


def _generate(target, drafter, prompt: torch.Tensor, s: _Settings, eos: set[int], generator) -> SpeculativeOutput:
    """One request on checked settings: rounds of draft, verify, accept, roll back."""
    limit = context_limit(target, drafter)
    if prompt.shape[1] >= limit:
        raise DraftInputError(
            f"the prompt has {prompt.shape[1]} tokens; expected fewer than the context limit of {limit} positions "
            "(max_position_embeddings), leaving room for a new token"
        )
    device, weight = next(target.parameters()).device, drafter.fc.weight
    prompt, draft = prompt.to(device), _draft_tree if s.tree else _draft_chain

    def draw(logits):  # the target's next token from its last position
        return int(sample_from_logits(logits[:, -1], s.temperature, s.top_p, generator, s.backend)[0][0])

    stats, accepted_per_round = AcceptanceStats(s.num_steps, s.num_nodes - 1, num_requests=1), []
    with TargetAuxCapture(target, drafter.config.aux_layer_ids) as capture:
        verifier = CachedTarget(target, capture)
        logits, aux = verifier.forward(prompt, torch.arange(prompt.shape[1], device=device)[None], last_only=True)
        out = [draw(logits)]
        # EAGLE's shift: drafter position i gets token i+1's embedding and the target's state at position i
        pending_ids = torch.cat([prompt[:, 1:], prompt.new_tensor([out])], dim=1)  # [1, n]
        pending_aux, draft_cache = aux, None  # [1, n, n·Ht]
        while len(out) < s.max_new_tokens and out[-1] not in eos and verifier.length + 1 < limit:
            L, root = verifier.length, out[-1]  # committed tokens in the target cache; the root (position L) is not
            if L + 1 + s.num_steps + 1 > limit:  # a full round could emit past the limit: the target alone
                out.append(draw(verifier.forward(prompt.new_tensor([[root]]), torch.tensor([[L]], device=device))[0]))
                continue
            # 1. draft (the drafter first catches up on the committed tokens' true target states)
            ids, state = pending_ids.to(weight.device), pending_aux.to(weight.device, weight.dtype)
            nodes, positions, mask, accept, draft_cache = draft(drafter, draft_cache, ids, state, root, L, s, generator)
            draft_cache.crop(L)  # forget this round's draft steps; the accepted tokens are refilled next round
            # 2. verify: one target forward over the root and the drafts ([1, N, V], [1, N, n·Ht])
            logits, aux = verifier.forward(nodes.to(device), positions.to(device), mask)
            m, path, nxt = accept(sampling_probs(logits, s.temperature, s.top_p, s.backend), generator)  # 3. accept
            stats.accept_histogram[m] += 1
            accepted_per_round.append(m)
            # 4. roll back the target cache to the committed tokens (the root and the accepted nodes), commit
            keep = [0] + path
            if keep == list(range(m + 1)):  # already in place: a chain, or a tree's first branch
                verifier.crop(L + m + 1)
            else:
                verifier.keep(torch.cat([torch.arange(L), L + torch.tensor(keep)]))  # the path moves into place
            new = nodes[0, path].tolist() + [int(nxt)]
            pending_ids, pending_aux = prompt.new_tensor([new]), aux[:, keep]  # the drafter's refill: [1, m+1]
            for token in new:
                if len(out) == s.max_new_tokens or out[-1] in eos:
                    break
                out.append(token)
    stats.num_generated_tokens = len(out)
    stopped = out[-1] in eos
    limited = not stopped and len(out) < s.max_new_tokens  # it reached the context limit
    return SpeculativeOutput(out, stats, accepted_per_round, "stop" if stopped else "length", limited)


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
    """Every prompt through :func:`speculative_generate`'s loop: ``{"settings", "total", "requests"}``, JSON-ready.
    EOS defaults to the target's; ``ignore_eos`` generates ``max_new_tokens``."""
    from tqdm.auto import tqdm

    settings = (num_steps, topk, num_draft_tokens, temperature, top_p, None, max_new_tokens)
    s, vocab = _check_call(target, drafter, settings, sampling_backend)
    if isinstance(prompts, (str, bytes, Mapping, torch.Tensor)) or not isinstance(prompts, Iterable):
        raise DraftInputError(f"`prompts` is {shown(prompts)}; expected a list of prompts, each {PROMPT_SHAPES}")
    if not (prompts := list(prompts)):
        raise DraftInputError("`prompts` is empty; expected at least one prompt (no requests, no statistics)")
    eos = sorted(set(eos_token_ids(eos_token_id, vocab_size=vocab, strict=True)))
    for source in (getattr(target, "generation_config", None), target.config.get_text_config()):
        if eos_token_id is None and getattr(source, "eos_token_id", None) is not None:  # the target's own
            eos = list(eos_token_ids(source.eos_token_id))
            break
    eos = [] if ignore_eos else eos
    generator = torch.Generator(device=next(target.parameters()).device).manual_seed(seed)
    total, requests = AcceptanceStats(num_steps, s.num_nodes - 1), []
    bar = tqdm(prompts, desc="acceptance", unit="req", disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(bar):
        ids = prompt_token_ids(prompt, tokenizer, vocab, f"prompt {i}")
        result = _generate(target, drafter, torch.tensor([ids]), s, set(eos), generator)
        total += result.stats
        request = {"index": i, "num_prompt_tokens": len(ids), **result.stats.to_dict(), "output_ids": result.tokens}
        requests.append(request | {"finish_reason": result.finish_reason, "context_limited": result.context_limited})
        bar.set_postfix(accept_length=f"{total.mean_accept_length:.3f}")
    settings = dict(num_steps=num_steps, topk=topk, num_draft_tokens=s.num_nodes, temperature=temperature)
    settings |= dict(top_p=top_p, max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos)
    return {"settings": settings, "total": total.to_dict(), "requests": requests}
