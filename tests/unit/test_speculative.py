# ruff: noqa: E501 -- the tables keep one row per line (under `# fmt: off`)
"""The reference speculative-decoding loop (decoding/speculative.py) against the target's own decoding, on the tiny
targets of tests/support/decoding.py. Greedy output equals a plain argmax loop token for token; every round sees what
a from-scratch recompute gives; sampling reproduces the target distribution (chi-square on 1e5 draws) and deliberately
broken samplers do not. Then the statistics and the CLI (the bad calls users make: tests/unit/test_bad_inputs.py)."""

import functools
import json
import math
import shutil

import pytest
import torch

from eagle31_mla import AuxLayerIds
from eagle31_mla.decoding import speculative as spec, target as target_module
from eagle31_mla.decoding.speculative import AcceptanceStats, accept_chain, accept_tree, speculative_generate
from eagle31_mla.decoding.target import TargetAuxCapture
from eagle31_mla.model.modeling_eagle31_mla import DraftInputError, sample_from_logits, sampling_probs
from eagle31_mla.prompts import eos_token_ids
from tests.support.decoding import (
    AUX_IDS,
    FAMILIES,
    HIDDEN,
    LAYERS,
    SAMPLES,
    chi_square_p_value,
    drafter,
    prompt,
    small_vocab_round,
    tiny_target,
)

pytestmark = pytest.mark.transformers


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # tiny models run many times faster on one thread on shared cores (idle OpenMP threads spin)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def echo_drafter(target, leak: float = 0.0):
    """A drafter whose logits are the target's at the previous position: it reads the pre-norm last layer (aux id 4)
    through fc_norm = the target's final norm, and everything else passes it through. Greedy, it drafts the current
    token again (right whenever the target repeats it); its runner-up is the target's runner-up: partial acceptance
    of every length, from a deterministic construction. ``leak`` keeps that much of its attention and MLP."""
    model = drafter(vocab=target.config.vocab_size, rms_norm_eps=target.config.rms_norm_eps)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:HIDDEN, 2 * HIDDEN :] = torch.eye(HIDDEN)  # h = the normed last-layer state (first 48 dims)
        model.fc_norm[2].weight.copy_(target.model.norm.weight)
        model.layers[0].self_attn.o_proj.weight.mul_(leak)  # h2 = h when leak = 0
        model.layers[0].mlp.down_proj.weight.mul_(leak)
        model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :HIDDEN] = target.lm_head.weight
    return model


@torch.no_grad()
def target_greedy(target, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain argmax loop, no cache (HF `generate(min_new_tokens=...)` would suppress EOS)."""
    out = []
    while len(out) < n and (not out or out[-1] != eos):
        out.append(int(target(torch.tensor([list(ids) + out])).logits[0, -1].argmax()))
    return out


# The loop's cached k+1-token forwards and the plain loop's recompute are other kernel shapes: fp32 logits differ by
# rounding (~1e-6 of their scale), so a near-tie may break the other way on another CPU. Equal lists pass at once;
# else each token is the argmax wherever the top-2 margin exceeds GREEDY_TOL, and within GREEDY_TOL of it otherwise.
GREEDY_TOL = 1e-4


@torch.no_grad()
def assert_target_greedy(target, ids: list[int], tokens: list[int], n: int, eos: int | None = None) -> None:
    expected = target_greedy(target, ids, n, eos)
    if tokens == expected:
        return
    assert len(tokens) == n or (eos is not None and tokens[-1] == eos), (tokens, expected)
    assert eos is None or eos not in tokens[:-1], tokens
    logits = target(torch.tensor([list(ids) + tokens])).logits[0, len(ids) - 1 : len(ids) - 1 + len(tokens)]  # [n, V]
    tol = GREEDY_TOL * max(1.0, logits.abs().max().item())
    top2 = logits.topk(2, dim=-1).values
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert (chosen >= top2[:, 0] - tol).all(), (tokens, expected)
    clear = top2[:, 0] - top2[:, 1] > tol
    assert torch.equal(torch.tensor(tokens)[clear], logits.argmax(-1)[clear]), (tokens, expected)


# ---- Aux states and greedy decoding: token for token the target's own ---------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_aux_capture_reads_canonical_ids_pre_norm_and_removes_its_hook(family):
    target = tiny_target(family)
    ids = torch.tensor([prompt()])
    with torch.no_grad():
        target(ids, output_hidden_states=True)  # Transformers installs its own hooks once
    before = dict(target.model.layers[-1]._forward_hooks)
    with torch.no_grad(), TargetAuxCapture(target, AuxLayerIds(tuple(AUX_IDS))) as capture:
        out = target(ids, output_hidden_states=True)
        aux = capture(out.hidden_states)
    hs, pre_norm = out.hidden_states, aux[..., 2 * HIDDEN :]
    assert torch.equal(aux[..., :HIDDEN], hs[1]) and torch.equal(aux[..., HIDDEN : 2 * HIDDEN], hs[2])
    # Transformers' hidden_states[depth] is after the final norm; the capture is the stream before it
    assert (pre_norm - hs[LAYERS]).abs().max() > 0.1
    assert torch.allclose(target.model.norm(pre_norm), hs[LAYERS], atol=1e-6)
    speculative_generate(target, drafter(), prompt(), max_new_tokens=3)
    assert dict(target.model.layers[-1]._forward_hooks) == before


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_training_reads_a_long_sequence_through_the_cache_as_one_forward(family, monkeypatch):
    """capture_target_states over more than PREFILL_CHUNK tokens runs chunks through the KV cache (chunked prefill);
    its aux states (the pre-norm last layer among them) and distributions are the one forward's. Other kernel
    shapes: fp32 rounding, within 1e-5 of the states' scale."""
    target, ids = tiny_target(family), torch.tensor([prompt()] * 2)  # a batch of 2
    whole_aux, whole_probs = target_module.capture_target_states(target, ids, AuxLayerIds(tuple(AUX_IDS)))
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 5)
    calls = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: calls.append(args[0].shape), with_kwargs=True)
    aux, probs = target_module.capture_target_states(target, ids, AuxLayerIds(tuple(AUX_IDS)))
    hook.remove()
    assert calls == [(2, 5)] * (ids.shape[1] // 5) + [(2, ids.shape[1] % 5)] * bool(ids.shape[1] % 5)
    assert aux.shape == whole_aux.shape and probs.shape == whole_probs.shape
    torch.testing.assert_close(aux, whole_aux, rtol=1e-5, atol=1e-5 * whole_aux.abs().max().item())
    torch.testing.assert_close(probs, whole_probs, rtol=1e-5, atol=1e-6)


CHAIN = dict(num_steps=3)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=7)


@pytest.mark.parametrize("family, attn", [(f, "sdpa") for f in FAMILIES] + [("deepseek_v3", "eager")])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_equals_target_greedy(family, attn, mode):
    """The echo drafter against a target that repeats tokens in runs of varied length: rounds accept 0..3 drafts
    (tree: also through the runner-up branch), so every kind of rollback runs. eager attention adds the mask to the
    scores: the tree mask must be additive, not boolean. Then a random drafter with a pruned vocabulary (d2t)."""
    target, ids, settings = tiny_target(family, attn=attn), prompt(), TREE if mode == "tree" else CHAIN
    out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=40, **settings)
    assert_target_greedy(target, ids, out.tokens, 40)
    assert len(set(out.accepted_per_round)) >= 3  # partial acceptance really happened
    draft = drafter(seed=4, draft_vocab_size=20)
    out = speculative_generate(target, draft, ids, max_new_tokens=20, **settings)
    assert_target_greedy(target, ids, out.tokens, 20)
    assert out.stats.mean_accept_length < 1.2  # it accepts almost nothing
    sampled = speculative_generate(target, draft, ids, max_new_tokens=12, temperature=1.0, generator=torch.Generator())
    assert len(sampled.tokens) == 12  # its q, moved to target ids, in the acceptance rule


def test_tree_with_topk_1_equals_chain():
    target, ids = tiny_target("llama", seed=2), prompt(seed=6)
    for draft in (echo_drafter(target), drafter(seed=7)):
        chain = speculative_generate(target, draft, ids, max_new_tokens=20, num_steps=4)
        tree = speculative_generate(target, draft, ids, max_new_tokens=20, num_steps=4, topk=1, tree=True)
        # both verify on the target, the tree under a 4-D mask (another kernel): equal unless a near-tie broke
        if tree.tokens != chain.tokens:
            assert_target_greedy(target, ids, tree.tokens, 20)
            assert_target_greedy(target, ids, chain.tokens, 20)
        else:
            assert tree.accepted_per_round == chain.accepted_per_round


@pytest.mark.parametrize(
    "settings", [CHAIN, dict(topk=2, num_draft_tokens=8), dict(temperature=0.7)], ids=["chain", "tree", "sampled"]
)
def test_agreeing_drafter_reaches_the_ceiling(settings):
    """Target and drafter both with a zeroed lm_head: p == q (token 0 when greedy, uniform when sampling), so
    min(1, p/q) = 1 and every draft is accepted."""
    target, draft, g = tiny_target("deepseek_v3", lm_head="zero"), drafter(), torch.Generator()
    draft.lm_head.weight.data.zero_()
    out = speculative_generate(target, draft, prompt(), max_new_tokens=21, generator=g, **settings)
    assert out.accepted_per_round == [3] * 5 and out.stats.acceptance_rate_per_position == [1.0, 1.0, 1.0]
    assert len(set(out.tokens)) > 5 if "temperature" in settings else out.tokens == [0] * 21  # really sampled


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_generation_stops_after_eos_and_at_the_context_limit_with_exact_statistics(settings):
    """After an EOS token; like an engine at max_model_len, exactly at the limit (finish reason "length"); the output
    is still the target's greedy stream, and the statistics count full rounds only."""
    target, ids = tiny_target("llama"), prompt()
    eos = target_greedy(target, ids, 30)[12]
    out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=30, eos_token_id=[eos], **settings)
    assert_target_greedy(target, ids, out.tokens, 30, eos=eos)
    assert out.finish_reason == "stop" and len(out.tokens) <= 13 and out.stats.num_generated_tokens == len(out.tokens)
    target.config.max_position_embeddings = 40
    out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=1000, **settings)
    assert len(ids) + len(out.tokens) == 40 and out.finish_reason == "length" and out.context_limited
    assert_target_greedy(target, ids, out.tokens, 40 - len(ids))
    stats = out.stats
    assert stats.num_generated_tokens == len(out.tokens) and stats.num_rounds == len(out.accepted_per_round)
    assert stats.num_accepted_tokens + stats.num_rounds <= len(out.tokens)  # the last few came from the target alone
    short = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=5, **settings)
    assert short.finish_reason == "length" and not short.context_limited
    with pytest.raises(DraftInputError, match="the prompt has 40 tokens; expected fewer than the context limit of 40"):
        speculative_generate(target, echo_drafter(target), prompt(40), max_new_tokens=5, **settings)


# ---- No recompute: one target forward per round, and each round sees what a recompute gives -------------------


def count_calls(obj, name: str, cache_of) -> list[tuple[int, int | None]]:
    """Records (tokens, cached length) of each call of ``obj.<name>``: the target's forward, or every draft step
    (the drafter's ``_step``: forward's, and the unchecked later steps of ``draft``)."""
    calls, real = [], getattr(obj, name)

    @functools.wraps(real)  # keeps the signature the loop inspects
    def counting(input_ids=None, *args, **kwargs):
        cache = cache_of(args, kwargs)
        calls.append((input_ids.shape[1], cache.get_seq_length() if cache is not None else None))
        return real(input_ids, *args, **kwargs)

    setattr(obj, name, counting)
    return calls


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_one_target_forward_per_round_and_no_prefix_recompute(settings):
    target = tiny_target("llama")
    draft = echo_drafter(target)
    target_calls = count_calls(target, "forward", lambda args, kw: kw.get("past_key_values", kw.get("cache")))
    draft_calls, ids = count_calls(draft, "_step", lambda args, kw: args[3]), prompt()
    rounds = speculative_generate(target, draft, ids, max_new_tokens=30, **settings).accepted_per_round
    assert len(target_calls) == 1 + len(rounds) and target_calls[0] == (len(ids), 0)  # the prefill, then rounds
    committed = len(ids)  # what the cache holds before each round: every committed token but the newest
    for (length, cached), m in zip(target_calls[1:], rounds):
        assert (length, cached) == (settings.get("num_draft_tokens", settings["num_steps"] + 1), committed)
        committed += m + 1
    # the drafter: per round one refill over the committed tokens, then num_steps - 1 draft steps
    assert len(draft_calls) == settings["num_steps"] * len(rounds) and draft_calls[0] == (len(ids), 0)
    assert [n for n, _ in draft_calls[:: settings["num_steps"]][1:]] == [m + 1 for m in rounds[:-1]]


@torch.no_grad()
def drafter_from_scratch(target, draft, capture, committed: list[int], branch: list[int]) -> list[torch.Tensor]:
    """The drafter's logits at the root and after each token of ``branch``, with nothing reused: token i+1 with the
    target's state at i over all committed tokens, then a chain along the branch."""
    aux = capture(target(torch.tensor([committed]), output_hidden_states=True).hidden_states)[:, :-1]
    step = draft(torch.tensor([committed[1:]]), aux_hidden_states=aux)
    logits, state = [step.logits[0, -1]], step.hidden_states[:, -1:]
    for token in branch:
        step = draft(torch.tensor([[token]]), hidden_states=state, past_key_values=step.past_key_values)
        logits.append(step.logits[0, -1])
        state = step.hidden_states
    return logits


RECOMPUTE_CASES = {  # settings, echo drafter leak
    "chain": (CHAIN, 0.1),  # mostly agrees, and its tokens, positions and cache matter
    "tree": (TREE, 0.1),
    "full_tree": (dict(num_steps=3, topk=3, num_draft_tokens=22), 1.0),  # every candidate kept; a wilder drafter
}


@pytest.mark.parametrize("case", RECOMPUTE_CASES)
def test_each_round_sees_what_a_recompute_gives(monkeypatch, case):
    """Sampling. Each round, what reaches the sampler equals a from-scratch recompute over the committed tokens: the
    target's p (positions, tree mask, temperature, top-p, target cache rollback), the chain's q and the tree's
    children (EAGLE shift, drafter cache rollback and refill, tree mask)."""
    settings, leak = RECOMPUTE_CASES[case]
    mode = "chain" if case == "chain" else "tree"
    target = tiny_target("deepseek_v3")
    draft = echo_drafter(target, leak=leak)
    seen, name = [], f"accept_{mode}"
    real = getattr(spec, name)
    monkeypatch.setattr(spec, name, lambda *args: seen.append((args, real(*args))) or seen[-1][1])
    ids, T, top_p, g = prompt(), 0.8, 0.9, torch.Generator().manual_seed(0)
    sampling = dict(temperature=T, top_p=top_p, generator=g, max_new_tokens=16 if leak < 1 else 6)
    out = speculative_generate(target, draft, ids, **sampling, **settings)
    assert len(seen) == len(out.accepted_per_round) and (leak == 1 or max(out.accepted_per_round) >= 1)
    committed = ids + out.tokens[:1]
    with torch.no_grad(), TargetAuxCapture(target, draft.config.aux_layer_ids) as capture:
        for (args, result), m in zip(seen, out.accepted_per_round):
            if mode == "chain":
                drafts, q, p, _ = args
                verified, rows = committed + drafts[0].tolist(), range(settings["num_steps"] + 1)
                logits = drafter_from_scratch(target, draft, capture, committed, drafts[0, :-1].tolist())
                for j in range(settings["num_steps"]):
                    assert torch.allclose(q[0, j], sample_from_logits(logits[j][None], T, top_p, None)[1][0], atol=1e-5)
            else:
                tokens, parents, p, _ = args
                path = [0] + result[1][0, :m].tolist()  # the root and the accepted nodes
                verified, rows = committed + tokens[path[1:]].tolist(), path[: m + 1]
                for node in range(len(parents)):
                    children = [c for c in range(len(parents)) if parents[c] == node]
                    branch, up = [], node
                    while up > 0:
                        branch, up = [int(tokens[up])] + branch, parents[up]
                    if children:  # the drafter's top-k after the branch, best first
                        ranked = drafter_from_scratch(target, draft, capture, committed, branch)[-1].argsort(-1, True)
                        assert tokens[children].tolist() == ranked[: len(children)].tolist()
            expected = sampling_probs(target(torch.tensor([verified])).logits[0, len(committed) - 1 :], T, top_p)
            assert torch.allclose(p[0, list(rows)], expected[: len(rows)], atol=1e-5)
            committed = ids + out.tokens[: len(committed) - len(ids) + m + 1]


# ---- Sampling is lossless: 1e5 vectorised draws of the first tokens of a round ------------------------------


def chain_first_two(sampler, p, q, seed=0):
    """B independent rounds through ``sampler``: the first token of each, and the second where the first draft was
    accepted (then the second comes from p_1's step)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[j], SAMPLES, replacement=True, generator=g) for j in range(len(q))], 1)
    n, nxt = sampler(drafts, q.expand(SAMPLES, -1, -1), p.expand(SAMPLES, -1, -1), g)
    return torch.where(n >= 1, drafts[:, 0], nxt), torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1]


def always_accept(drafts, q, p, g):
    k = drafts.shape[1]
    return torch.full((drafts.shape[0],), k), torch.multinomial(p[:, k], 1, generator=g)[:, 0]


def accept_with_p_only(drafts, q, p, g):
    """Accepts with probability p(x), ignoring q (the point-mass rule applied to sampled drafts)."""
    B, k = drafts.shape
    n = (torch.rand(B, k, generator=g) < p[:, :k].gather(-1, drafts[..., None])[..., 0]).long().cumprod(1).sum(1)
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    return n, torch.multinomial((p.gather(1, at) - q_pad.gather(1, at)).clamp_min(0)[:, 0], 1, generator=g)[:, 0]


def resample_from_p(drafts, q, p, g):
    """Right acceptance, but the correction drawn from p instead of norm(max(p - q, 0))."""
    n, _ = accept_chain(drafts, q, p, g)
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    return n, torch.multinomial(p.gather(1, at)[:, 0], 1, generator=g)[:, 0]


SAMPLINGS = {"T1": (1.0, 1.0), "T0.7_top_p0.8": (0.7, 0.8)}


@pytest.mark.parametrize("sampler", [accept_chain, always_accept, accept_with_p_only, resample_from_p])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chain_sampling_is_lossless_and_broken_samplers_fail_the_same_test(sampling, sampler):
    p, q = small_vocab_round()[SAMPLINGS[sampling]]
    first, second = chain_first_two(sampler, p, q)
    if sampler is not accept_chain:
        assert chi_square_p_value(first, p[0]) < 0.01
        return
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.numel() > 10_000 and chi_square_p_value(second, p[1]) > 0.01


# The tree: root -> 3 children (the drafter's top 3), the first with 2 children, the second with 1.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2]


def tree_first_two(sampler, p, q, seed=0):
    g = torch.Generator().manual_seed(seed)
    kids = q[0].argsort(descending=True)
    tokens = torch.stack([torch.tensor(0), kids[0], kids[1], kids[2], kids[0], kids[3], kids[1]])
    probs = torch.stack([p[0], p[1], p[2], p[3], p[1], p[2], p[3]])  # p after each node (any fixed choice)
    n, path, nxt = sampler(tokens, TREE_PARENTS, probs.expand(SAMPLES, -1, -1), g)
    first = torch.where(n >= 1, tokens[path[:, 0].clamp_min(0)], nxt)
    if path.shape[1] < 2:
        return first, None, probs
    # the token after root child c (c = 1 or 2, whichever was accepted more often) follows p at c
    c = 1 if (path[:, 0] == 1).sum() >= (path[:, 0] == 2).sum() else 2
    second = torch.where(n >= 2, tokens[path[:, 1].clamp_min(0)], nxt)[path[:, 0] == c]
    return first, second, probs[c]


def broken_tree_sampler(tokens, parents, probs, g, *, q=None):
    """Point-mass acceptance at the root's children done wrong: p not updated after a rejection (``q`` None), or the
    deterministic children treated as if sampled from the drafter's ``q``: min(1, p/q), residual norm(max(p - q, 0))."""
    B = probs.shape[0]
    residual, done, out = probs[:, 0].clone(), torch.zeros(B, dtype=torch.bool), torch.zeros(B, dtype=torch.long)
    for child in (1, 2, 3):
        x = tokens[child]
        accept = ~done & (torch.rand(B, generator=g) < (residual[:, x] / (1 if q is None else q[x])).clamp(max=1))
        out = torch.where(accept, x, out)
        if q is not None:
            new = (residual - q).clamp_min(0)
            residual = torch.where((~done & ~accept)[:, None], new / new.sum(-1, keepdim=True), residual)
        done |= accept
    out = torch.where(done, out, torch.multinomial(residual, 1, generator=g)[:, 0])
    return done.long(), torch.where(done, 1, -1)[:, None], out


@pytest.mark.parametrize("sampler", ["accept_tree", "broken_no_residual", "broken_draft_ratio"])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_tree_sampling_is_lossless_and_broken_samplers_fail_the_same_test(sampling, sampler):
    p, q = small_vocab_round()[SAMPLINGS[sampling]]
    if sampler != "accept_tree":
        broken = functools.partial(broken_tree_sampler, q=None if sampler == "broken_no_residual" else q[0])
        assert chi_square_p_value(tree_first_two(broken, p, q)[0], p[0]) < 0.01
        return
    first, second, p_second = tree_first_two(accept_tree, p, q)
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.numel() > 5_000 and chi_square_p_value(second, p_second) > 0.01


# fmt: off
SAMPLING_BY_HAND = {  # (temperature, top_p) -> p for the logits log [0.5, 0.3, 0.2]: softmax(logits / T), then the most
    # likely tokens while the mass before each is < top_p, renormalised; T = 0: the argmax's one-hot
    (1.0, 1.0): [0.5, 0.3, 0.2], (1.0, 0.6): [0.625, 0.375, 0.0], (1.0, 0.5): [1.0, 0.0, 0.0],
    (0.5, 1.0): [25 / 38, 9 / 38, 4 / 38], (0.5, 0.7): [25 / 34, 9 / 34, 0.0], (0.0, 1.0): [1.0, 0.0, 0.0],
    # at the edge of fp32: logits / 1e-300 overflows, a top_p below fp32's smallest value compares as 0 (NaN, unless handled)
    (1e-3, 1.0): [1.0, 0.0, 0.0], (1e-300, 1.0): [1.0, 0.0, 0.0], (5e-324, 1.0): [1.0, 0.0, 0.0], (1.0, 1e-300): [1.0, 0.0, 0.0],
}
# fmt: on


@pytest.mark.parametrize("temperature, top_p", SAMPLING_BY_HAND)
def test_target_and_drafter_sample_from_p_after_temperature_then_top_p(temperature, top_p):
    logits, expected = torch.tensor([[0.5, 0.3, 0.2]]).log(), torch.tensor([SAMPLING_BY_HAND[temperature, top_p]])
    assert torch.allclose(sampling_probs(logits, temperature, top_p), expected, atol=1e-6)
    assert torch.allclose(sample_from_logits(logits, temperature, top_p, None)[1], expected, atol=1e-6)
    assert sampling_probs(torch.tensor([1.0, 3.0, 3.0]), 0.0, 1.0).tolist() == [0.0, 1.0, 0.0]  # ties: the lowest id


# ---- Statistics ------------------------------------------------------------------------------------------------


def test_statistics():
    s = AcceptanceStats(3, 3, accept_histogram=[2, 1, 0, 1], num_generated_tokens=10, num_requests=1)
    assert (s.num_rounds, s.num_accepted_tokens, s.num_draft_tokens) == (4, 4, 12)
    assert s.mean_accept_length == 2.0  # (4 accepted + 4 bonus) / 4 rounds
    assert s.acceptance_rate_per_position == [0.5, 0.25, 0.25] and s.draft_tokens_per_generated_token == 1.2
    total = s + AcceptanceStats(3, 3, [0, 0, 0, 2], 9, 1)
    assert total.accept_histogram == [2, 1, 0, 3] and total.num_requests == 2 and total.num_generated_tokens == 19
    assert AcceptanceStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    table = s.table()
    assert "mean accept length          2.000" in table and "ceiling 4" in table
    assert table.splitlines()[-1].split()[:3] == ["3", "1", "0.250"]


def test_chi_square_p_value_of_a_known_statistic():  # the lossless tests' check, on a value worked by hand
    draws = torch.tensor([0] * 15 + [1] * 5 + [2] * 15 + [3] * 5)  # 40 uniform draws: statistic 10, 3 degrees
    assert math.isclose(chi_square_p_value(draws, torch.full((4,), 0.25)), 0.0185661354, rel_tol=1e-6)


def test_measure_acceptance_api_stops_each_request_at_eos_as_the_target_does():
    target = tiny_target("qwen3")
    prompts = [prompt(seed=s) for s in (1, 2)] + [{"input_ids": prompt(seed=3)}]
    result = spec.measure_acceptance(
        target, echo_drafter(target), prompts, max_new_tokens=12, eos_token_id=torch.tensor([2])
    )
    assert AcceptanceStats.from_dict(result["total"]).num_requests == 3 and result["settings"]["eos_token_id"] == [2]
    for r, s in zip(result["requests"], (1, 2, 3)):
        assert_target_greedy(target, prompt(seed=s), r["output_ids"], 12, eos=2)


def test_eos_ids_have_one_reading_strict_for_arguments_lenient_for_configs():  # strict: test_bad_inputs.py's eos rows
    assert eos_token_ids(None) == () and eos_token_ids(7) == (7,) and eos_token_ids(torch.tensor([3, 2])) == (3, 2)
    assert eos_token_ids([1, "2", None, True, 4]) == (1, 4) and eos_token_ids("2") == ()  # a config's value


# ---- The command line ----------------------------------------------------------------------------------------


def acceptance(capsys, target, draft, prompts, *extra) -> tuple[int, str, str]:
    from eagle31_mla.cli import main

    argv = ["acceptance", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    return main(argv + ["--device", "cpu", "--no-progress", *extra]), *capsys.readouterr()


def test_acceptance_command_reports_the_target_greedy_stream(tmp_path, capsys):
    from tests.support.vllm_harness import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "target")
    target = tiny_target("llama", vocab=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    drafter(vocab=len(tokenizer), seed=5).save_pretrained(tmp_path / "draft")
    lines = [{"prompt": "The quick brown fox"}, {"input_ids": [5, 6, 7, 8]}, "Hello world"]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "prompts.txt").write_text("The quick brown fox\n\nover the lazy dog\n")
    for prompts, n in (("prompts.jsonl", 3), ("prompts.txt", 2)):
        report = tmp_path / f"{prompts}.report.json"
        options = ("--max-new-tokens", "10", "--ignore-eos", "--dtype", "float32", "--json", str(report))
        code, out, _ = acceptance(capsys, tmp_path / "target", tmp_path / "draft", tmp_path / prompts, *options)
        assert code == 0 and "mean accept length" in out and "acceptance rate" in out
        assert f"report written to {report}" in out
        result = json.loads(report.read_text())
        total = AcceptanceStats.from_dict(result["total"])  # measure_acceptance's report, through JSON
        assert total.num_requests == n and total.num_generated_tokens == 10 * n
        assert sum(r["num_rounds"] for r in result["requests"]) == total.num_rounds
        assert result["settings"]["num_draft_tokens"] == 4 and result["settings"]["eos_token_id"] == []
        first = tokenizer("The quick brown fox")["input_ids"]
        assert_target_greedy(target, first, result["requests"][0]["output_ids"], 10)
    from eagle31_mla.demo import DEMO_DIR  # past the context limit: it stops there, with a note

    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    options = ("--ignore-eos", "--max-new-tokens", "600", "--json", str(tmp_path / "r.json"))
    code, _, err = acceptance(capsys, DEMO_DIR / "target", DEMO_DIR / "draft", tmp_path / "p.jsonl", *options)
    assert code == 0 and "note: 1 request(s) stopped at the context limit of 512 positions" in err
    (request,) = json.loads((tmp_path / "r.json").read_text())["requests"]
    assert request["num_prompt_tokens"] + request["num_generated_tokens"] == 512 and request["context_limited"]


def test_acceptance_refuses_bad_inputs_in_one_line_before_loading(tmp_path, capsys):
    """A bad prompts line (its file and line named; each line's exact message: the "prompts:" rows of
    tests/unit/test_bad_inputs.py), missing files, no chat template, a drafter given as --target, a target given as
    --draft: one line, exit 2, before any model loads (no progress bars, no transformers output on stderr)."""
    from eagle31_mla.demo import DEMO_DIR

    T, D, P = DEMO_DIR / "target", DEMO_DIR / "draft", tmp_path / "prompts.jsonl"
    bare = tmp_path / "target-without-chat-template"  # the demo target ships one (for chat completions)
    shutil.copytree(T, bare)
    (bare / "chat_template.jinja").unlink()
    cases = [  # (prompts file, target, draft, prompts path, what the message says)
        ('{"prompt": "fine"}\n{"input_ids": [1.9, 2.7, 3.5]}', T, D, P, "1.9 (float) at index 0"),
        ('{"prompt": "fine"}\n{"input_ids": [1, 2, 999999]}', T, D, P, "outside the target's vocabulary [0, 512)"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', bare, D, P, "has no chat template"),
        ('{"prompt": "hi"}', D, D, P, "argument --target: "),
        ('{"input_ids": [5, 6]}', T, T, P, "argument --draft: "),
        ('{"prompt": "hi"}', tmp_path / "missing-target", D, P, "missing-target"),
        ('{"prompt": "hi"}', T, tmp_path / "missing-draft", P, "missing-draft"),
    ]
    for text, target, draft, prompts, message in cases:
        P.write_text(text + "\n")
        code, _, err = acceptance(capsys, target, draft, prompts)
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (text, err)
        assert err.startswith("eagle31-mla: error:") and "Loading" not in err and "%" not in err, err
        assert f"{P}:2: " in err or "\n" not in text, err  # a prompts file's line is named
