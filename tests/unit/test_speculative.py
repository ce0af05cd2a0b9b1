"""The reference speculative-decoding loop (speculative.py) against the target's own decoding.

Targets are tiny Transformers models of four families built here (Llama, Qwen2, Qwen3, DeepSeek-V3);
the drafter reads aux ids [1, 2, 4] of a 4-layer target, so the last one goes through the pre-norm
hook. Greedy output must equal a plain argmax loop token for token; sampling must reproduce the
target distribution (chi-square on 1e5 vectorised draws), and deliberately broken samplers must not.
"""

import functools
import json
import math
import shutil

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle31_mla import AuxLayerIdError, AuxLayerIds
from eagle31_mla.decoding import speculative as spec
from eagle31_mla.decoding.speculative import (
    AcceptanceStats,
    accept_chain,
    accept_tree,
    measure_acceptance,
    speculative_generate,
)
from eagle31_mla.decoding.target import TargetAuxCapture
from eagle31_mla.model.modeling_eagle31_mla import (
    sample_from_logits,
    sampling_probs as target_probs,  # the reference loop's rule too
)
from eagle31_mla.prompts import PromptError, eos_token_ids, prompt_token_ids, read_prompts
from tests.support.tiny import tiny_drafter

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

VOCAB, HIDDEN, LAYERS = 64, 48, 4
AUX_IDS = [1, 2, 4]  # 4 = the target's depth: read pre-norm through the hook
FAMILIES = ("llama", "qwen2", "qwen3", "deepseek_v3")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run faster on one thread, and many times faster when other jobs share the cores
    (idle OpenMP threads spin)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_target(
    family: str = "llama", *, seed: int = 0, vocab: int = VOCAB, lm_head: str = "repeats", attn: str = "sdpa"
):
    """Unit-variance weights with strong attention / MLP outputs, so the greedy stream wanders instead
    of settling into a loop. ``lm_head``: "repeats" (half the embedding plus noise: runs of repeated
    tokens of varied length), "random", or "zero" (always token 0)."""
    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "llama":
        model_cls, config = LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **common)
    elif family == "qwen2":
        model_cls, config = Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=2, **common)
    elif family == "qwen3":
        model_cls, config = Qwen3ForCausalLM, Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
    else:
        model_cls = DeepseekV3ForCausalLM
        config = DeepseekV3Config(
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    config._attn_implementation = attn
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.startswith(("lm_head", "model.embed_tokens")):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
                if "o_proj" in name or "down_proj" in name:
                    p.mul_(16.0)
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=g))
        noise = torch.randn(embed.shape, generator=g)
        model.lm_head.weight.copy_({"repeats": 0.5 * embed + noise, "random": noise, "zero": 0 * noise}[lm_head])
    return model


def drafter(seed: int = 1, *, vocab: int = VOCAB, zero_lm_head: bool = False, **overrides):
    kwargs = dict(vocab_size=vocab, target_hidden_size=HIDDEN, eagle_aux_hidden_state_layer_ids=AUX_IDS)
    model = tiny_drafter(seed, **{**kwargs, **overrides})
    if zero_lm_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return model


def echo_drafter(target, leak: float = 0.0):
    """A drafter whose logits are the target's at the previous position: it reads the pre-norm last
    layer (aux id 4) through fc_norm = the target's final norm, and everything else passes it through.
    Greedy, it drafts the current token again (right whenever the target repeats it); its runner-up is
    the target's runner-up. Partial acceptance of every length, from a deterministic construction.
    ``leak`` keeps that much of its (random) attention and MLP, so tokens and cache matter too."""
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


def prompt(n: int = 7, seed: int = 3, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def target_greedy(target, ids: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain argmax loop, no cache (HF `generate(min_new_tokens=...)` would suppress EOS)."""
    ids = list(ids)
    out = []
    while len(out) < n and (not out or out[-1] != eos):
        out.append(int(target(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


# Speculative decoding computes the target's logits with a cache, k+1 tokens at a time; the plain loop
# above recomputes everything: other kernel shapes, so fp32 logits differ by rounding (about 1e-6 of
# their scale here) and a near-tie may break the other way on another CPU. Equal token lists pass at
# once; otherwise every token must be the target's argmax wherever its top-2 margin exceeds
# GREEDY_TOL (fp32 eps 1.2e-7 times reductions of <= 64 terms over 4 layers: < 1e-4 of the scale),
# and within GREEDY_TOL of the maximum at a near-tie.
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


# ----------------------------------------------------------------------------------------------
# Aux states
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_aux_capture_reads_canonical_ids_pre_norm(family):
    target = tiny_target(family)
    ids = torch.tensor([prompt()])
    with torch.no_grad(), TargetAuxCapture(target, AuxLayerIds.from_one_based(AUX_IDS)) as capture:
        out = target(ids, output_hidden_states=True)
        aux = capture(out.hidden_states)
    hs = out.hidden_states
    pre_norm = aux[..., 2 * HIDDEN :]
    assert torch.equal(aux[..., :HIDDEN], hs[1]) and torch.equal(aux[..., HIDDEN : 2 * HIDDEN], hs[2])
    # Transformers' hidden_states[depth] is after the final norm; the capture is the stream before it
    assert (pre_norm - hs[LAYERS]).abs().max() > 0.1
    assert torch.allclose(target.model.norm(pre_norm), hs[LAYERS], atol=1e-6)
    with pytest.raises(AuxLayerIdError, match="beyond the target's depth of 4"):
        TargetAuxCapture(target, AuxLayerIds.from_one_based([1, 2, 5]))


def test_hook_is_removed_after_generation():
    target = tiny_target()
    with torch.no_grad():
        target(torch.tensor([prompt()]), output_hidden_states=True)  # Transformers installs its own hooks once
    before = dict(target.model.layers[-1]._forward_hooks)
    speculative_generate(target, drafter(), prompt(), max_new_tokens=3)
    assert dict(target.model.layers[-1]._forward_hooks) == before


# ----------------------------------------------------------------------------------------------
# Greedy: token for token the target's own decoding
# ----------------------------------------------------------------------------------------------

CHAIN = dict(num_steps=3)
TREE = dict(num_steps=3, topk=2, num_draft_tokens=7)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_equals_target_greedy(family, mode):
    """The echo drafter against a target that repeats tokens in runs of varied length: rounds accept
    0..3 drafts (tree: also through the runner-up branch), so every kind of rollback runs."""
    target = tiny_target(family)
    ids = prompt()
    out = speculative_generate(
        target, echo_drafter(target), ids, max_new_tokens=40, **(CHAIN if mode == "chain" else TREE)
    )
    assert_target_greedy(target, ids, out.tokens, 40)
    assert len(set(out.accepted_per_round)) >= 3  # partial acceptance really happened


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_random_drafter_accepts_almost_nothing_and_output_is_exact(family):
    target = tiny_target(family)
    ids = prompt(seed=5)
    for settings in (CHAIN, dict(num_steps=3, topk=3, num_draft_tokens=8)):
        out = speculative_generate(target, drafter(seed=4), ids, max_new_tokens=20, **settings)
        assert_target_greedy(target, ids, out.tokens, 20)
        assert out.stats.mean_accept_length < 1.2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_verify_with_eager_and_sdpa_attention(attn):
    """eager adds the mask to the scores: the tree mask must be additive, not boolean."""
    target = tiny_target("deepseek_v3", attn=attn)
    ids = prompt(seed=8)
    out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=24, **TREE)
    assert_target_greedy(target, ids, out.tokens, 24)
    assert max(out.accepted_per_round) > 0


def test_tree_with_topk_1_equals_chain():
    target = tiny_target("llama", seed=2)
    ids = prompt(seed=6)
    for draft in (echo_drafter(target), drafter(seed=7)):
        chain = speculative_generate(target, draft, ids, max_new_tokens=20, num_steps=4)
        tree = speculative_generate(target, draft, ids, max_new_tokens=20, num_steps=4, topk=1, tree=True)
        # both verify on the target, the tree under a 4-D mask (another kernel): equal unless a near-tie broke
        if tree.tokens != chain.tokens:
            assert_target_greedy(target, ids, tree.tokens, 20)
            assert_target_greedy(target, ids, chain.tokens, 20)
        else:
            assert tree.accepted_per_round == chain.accepted_per_round


@pytest.mark.parametrize("settings", [CHAIN, dict(num_steps=3, topk=2, num_draft_tokens=8)], ids=["chain", "tree"])
def test_agreeing_drafter_reaches_the_ceiling(settings):
    """Target and drafter both with a zeroed lm_head: both always say token 0."""
    target = tiny_target("deepseek_v3", lm_head="zero")
    out = speculative_generate(target, drafter(zero_lm_head=True), prompt(), max_new_tokens=21, **settings)
    assert out.tokens == [0] * 21
    assert out.accepted_per_round == [3] * 5
    assert out.stats.mean_accept_length == 4.0
    assert out.stats.acceptance_rate_per_position == [1.0, 1.0, 1.0]


def test_agreeing_drafter_reaches_the_ceiling_when_sampling():
    """q == p (both uniform): min(1, p/q) = 1, every draft is accepted at any temperature."""
    target = tiny_target("llama", lm_head="zero")
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target, drafter(zero_lm_head=True), prompt(), max_new_tokens=21, num_steps=3, temperature=0.7, generator=g
    )
    assert out.accepted_per_round == [3] * 5
    assert len(set(out.tokens)) > 5  # really sampled


def test_stops_after_eos():
    target = tiny_target("llama")
    ids = prompt()
    eos = target_greedy(target, ids, 30)[12]
    expected = target_greedy(target, ids, 30, eos=eos)
    assert expected[-1] == eos and len(expected) <= 13
    for settings in (CHAIN, TREE):
        out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=30, eos_token_id=[eos], **settings)
        assert_target_greedy(target, ids, out.tokens, 30, eos=eos)
        assert out.stats.num_generated_tokens == len(out.tokens)


def test_pruned_draft_vocabulary():
    target = tiny_target("qwen2")
    draft = drafter(seed=2, draft_vocab_size=20)
    ids = prompt()
    for settings in (CHAIN, TREE):
        out = speculative_generate(target, draft, ids, max_new_tokens=12, **settings)
        assert_target_greedy(target, ids, out.tokens, 12)
    g = torch.Generator().manual_seed(1)
    out = speculative_generate(target, draft, ids, max_new_tokens=12, temperature=1.0, generator=g)
    assert len(out.tokens) == 12


# ----------------------------------------------------------------------------------------------
# No recompute: one target forward per round over exactly the draft tokens
# ----------------------------------------------------------------------------------------------


def count_calls(model):
    calls = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the loop inspects
    def counting(input_ids=None, **kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        calls.append((input_ids.shape[1], cache.get_seq_length() if cache is not None else None))
        return forward(input_ids, **kwargs)

    model.forward = counting
    return calls


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_one_target_forward_per_round_and_no_prefix_recompute(settings):
    target = tiny_target("llama")
    draft = echo_drafter(target)
    target_calls, draft_calls = count_calls(target), count_calls(draft)
    ids = prompt()
    out = speculative_generate(target, draft, ids, max_new_tokens=30, **settings)
    rounds = out.accepted_per_round
    assert len(target_calls) == 1 + len(rounds)
    assert target_calls[0] == (len(ids), 0)  # the prefill
    committed = len(ids)  # what the cache holds before each round: every committed token but the newest
    verified = settings.get("num_draft_tokens", settings["num_steps"] + 1)
    for (length, cached), m in zip(target_calls[1:], rounds):
        assert (length, cached) == (verified, committed)
        committed += m + 1
    # the drafter: per round one refill over the committed tokens, then num_steps - 1 draft steps
    assert len(draft_calls) == settings["num_steps"] * len(rounds)
    assert draft_calls[0] == (len(ids), None)
    refills = draft_calls[:: settings["num_steps"]]
    assert [n for n, _ in refills[1:]] == [m + 1 for m in rounds[:-1]]


@torch.no_grad()
def drafter_from_scratch(target, draft, capture, committed: list[int], branch: list[int]) -> list[torch.Tensor]:
    """The drafter's logits at the root and after each token of ``branch``, with nothing reused:
    token i+1 with the target's state at i over all committed tokens, then a chain along the branch."""
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
    """Sampling. Each round, what reaches the sampler equals a from-scratch recompute over the
    committed tokens: the target's p (positions, tree mask, temperature, top-p, target cache), the
    chain's q and the tree's children (EAGLE shift, drafter cache rollback and refill, tree mask)."""
    settings, leak = RECOMPUTE_CASES[case]
    mode = "chain" if case == "chain" else "tree"
    target = tiny_target("deepseek_v3")
    draft = echo_drafter(target, leak=leak)
    seen = []
    name = "accept_chain" if mode == "chain" else "accept_tree"
    real = getattr(spec, name)

    def spy(*args):
        result = real(*args)
        seen.append((args, result))
        return result

    monkeypatch.setattr(spec, name, spy)
    ids, T, top_p = prompt(), 0.8, 0.9
    out = speculative_generate(
        target,
        draft,
        ids,
        max_new_tokens=16 if leak < 1 else 6,
        temperature=T,
        top_p=top_p,
        generator=torch.Generator().manual_seed(0),
        **settings,
    )
    assert len(seen) == len(out.accepted_per_round) and (leak == 1 or max(out.accepted_per_round) >= 1)
    committed = ids + out.tokens[:1]
    capture = TargetAuxCapture(target, draft.config.aux_layer_ids)
    with torch.no_grad():
        for (args, result), m in zip(seen, out.accepted_per_round):
            if mode == "chain":
                drafts, q, p, _ = args
                verified = committed + drafts[0].tolist()
                logits = drafter_from_scratch(target, draft, capture, committed, drafts[0, :-1].tolist())
                for j in range(settings["num_steps"]):
                    assert torch.allclose(q[0, j], sample_from_logits(logits[j][None], T, top_p, None)[1][0], atol=1e-5)
                rows = range(settings["num_steps"] + 1)
            else:
                tokens, parents, p, _ = args
                path = [0] + result[1][0, :m].tolist()  # the root and the accepted nodes
                verified, rows = committed + tokens[path[1:]].tolist(), path[: m + 1]
                for node in range(len(parents)):
                    children = [c for c in range(len(parents)) if parents[c] == node]
                    if not children:
                        continue
                    branch, up = [], node
                    while up > 0:
                        branch, up = [int(tokens[up])] + branch, parents[up]
                    ranked = drafter_from_scratch(target, draft, capture, committed, branch)[-1].argsort(
                        descending=True
                    )
                    assert tokens[children].tolist() == ranked[: len(children)].tolist()
            expected = target_probs(target(torch.tensor([verified])).logits[0, len(committed) - 1 :], T, top_p)
            assert torch.allclose(p[0, list(rows)], expected[: len(rows)], atol=1e-5)
            committed = ids + out.tokens[: len(committed) - len(ids) + m + 1]
    capture.close()


# ----------------------------------------------------------------------------------------------
# Sampling is lossless: 1e5 vectorised draws of the first tokens of a round
# ----------------------------------------------------------------------------------------------

SAMPLES = 100_000
SMALL_VOCAB = 16


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of draws against a distribution; cells expecting < 5 are pooled. A draw in a
    zero-probability cell fails outright."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    probs = probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * samples.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_p_value_is_calibrated():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, generator=g), 0)
    draws = torch.multinomial(probs, SAMPLES, replacement=True, generator=g)
    assert chi_square_p_value(draws, probs) > 0.01
    assert chi_square_p_value(draws, torch.softmax(torch.randn(16, generator=g) * 0.2 + probs.log(), 0)) < 1e-6
    # known value: statistic 10 with 3 degrees of freedom -> p = 0.018566
    q = torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64))
    assert math.isclose(float(q), 0.0185661354, rel_tol=1e-6)


@pytest.fixture(scope="module")
def small_vocab_round():
    """A small-vocabulary target and drafter on one context: p_j of the target at 4 positions, the
    drafter's q_j at 3 (temperature 1 and temperature 0.7 / top-p 0.8)."""
    target = tiny_target("llama", vocab=SMALL_VOCAB, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # p spread over the vocabulary
    draft = drafter(seed=12, vocab=SMALL_VOCAB)
    ids = torch.tensor([prompt(10, seed=13, vocab=SMALL_VOCAB)])
    with torch.no_grad(), TargetAuxCapture(target, draft.config.aux_layer_ids) as capture:
        res = target(ids, output_hidden_states=True)
        draft_logits = draft(ids[:, 1:], aux_hidden_states=capture(res.hidden_states)[:, :-1]).logits[0]
    rounds = {}
    for T, top_p in ((1.0, 1.0), (0.7, 0.8)):
        p = target_probs(res.logits[0, -4:], T, top_p)  # [4, V]
        q = torch.stack([sample_from_logits(draft_logits[i][None], T, top_p, None)[1][0] for i in (-1, -2, -3)])
        assert 0.2 < 0.5 * (p[:3] - q).abs().sum(-1).min()  # the drafter really disagrees
        rounds[(T, top_p)] = p, q
    return rounds


def chain_first_two(sampler, p, q, seed=0):
    """B independent rounds through ``sampler``: the first token of each, and the second where the
    first draft was accepted (then the second comes from p_1's step)."""
    g = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[j], SAMPLES, replacement=True, generator=g) for j in range(k)], 1)
    n, nxt = sampler(drafts, q.expand(SAMPLES, -1, -1), p.expand(SAMPLES, -1, -1), g)
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    second = torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1]
    return first, second


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


@pytest.mark.parametrize("sampling", [(1.0, 1.0), (0.7, 0.8)], ids=["T1", "T0.7_top_p0.8"])
def test_chain_sampling_is_lossless(small_vocab_round, sampling):
    p, q = small_vocab_round[sampling]
    first, second = chain_first_two(accept_chain, p, q)
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.numel() > 10_000 and chi_square_p_value(second, p[1]) > 0.01


@pytest.mark.parametrize("broken", [always_accept, accept_with_p_only, resample_from_p])
def test_broken_chain_samplers_fail_the_same_test(small_vocab_round, broken):
    p, q = small_vocab_round[(1.0, 1.0)]
    first, _ = chain_first_two(broken, p, q)
    assert chi_square_p_value(first, p[0]) < 0.01


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


def tree_no_residual(tokens, parents, probs, g):
    """Point-mass acceptance at the root's children, but after a rejection p is not updated."""
    B = probs.shape[0]
    done = torch.zeros(B, dtype=torch.bool)
    out = torch.multinomial(probs[:, 0], 1, generator=g)[:, 0]
    for child in (1, 2, 3):
        accept = ~done & (torch.rand(B, generator=g) < probs[:, 0, tokens[child]])
        out = torch.where(accept, tokens[child], out)
        done |= accept
    return done.long(), torch.where(done, torch.tensor(1), torch.tensor(-1))[:, None], out


def tree_with_draft_ratio(tokens, parents, probs, g, *, q):
    """Treats the deterministic top-k children as if sampled: min(1, p/q) with the drafter's q."""
    B = probs.shape[0]
    residual = probs[:, 0].clone()
    done = torch.zeros(B, dtype=torch.bool)
    out = torch.zeros(B, dtype=torch.long)
    for child in (1, 2, 3):
        x = tokens[child]
        ratio = (residual[:, x] / q[x]).clamp(max=1)
        accept = ~done & (torch.rand(B, generator=g) < ratio)
        out = torch.where(accept, x, out)
        reject = ~done & ~accept
        new = (residual - q).clamp_min(0)
        residual = torch.where(reject[:, None], new / new.sum(-1, keepdim=True), residual)
        done |= accept
    out = torch.where(done, out, torch.multinomial(residual, 1, generator=g)[:, 0])
    return done.long(), torch.where(done, torch.tensor(1), torch.tensor(-1))[:, None], out


@pytest.mark.parametrize("sampling", [(1.0, 1.0), (0.7, 0.8)], ids=["T1", "T0.7_top_p0.8"])
def test_tree_sampling_is_lossless(small_vocab_round, sampling):
    p, q = small_vocab_round[sampling]
    first, second, p_second = tree_first_two(accept_tree, p, q)
    assert chi_square_p_value(first, p[0]) > 0.01
    assert second.numel() > 5_000 and chi_square_p_value(second, p_second) > 0.01


@pytest.mark.parametrize("broken", ["no_residual", "draft_ratio"])
def test_broken_tree_samplers_fail_the_same_test(small_vocab_round, broken):
    p, q = small_vocab_round[(1.0, 1.0)]
    sampler = tree_no_residual if broken == "no_residual" else functools.partial(tree_with_draft_ratio, q=q[0])
    first, _, _ = tree_first_two(sampler, p, q)
    assert chi_square_p_value(first, p[0]) < 0.01


def test_greedy_is_the_same_rule_with_one_hot_distributions():
    logits = torch.randn(5, 4, SMALL_VOCAB, generator=torch.Generator().manual_seed(0))
    p = target_probs(logits, 0.0, 1.0)  # [5, 4, V] one-hot
    drafts = logits[:, :3].argmax(-1)
    drafts[1, 0] += 1  # row 1 disagrees at once, row 2 at the third draft
    drafts[2, 2] += 1
    drafts %= SMALL_VOCAB
    n, nxt = accept_chain(drafts, torch.nn.functional.one_hot(drafts, SMALL_VOCAB).float(), p)
    assert n.tolist() == [3, 0, 2, 3, 3]
    assert nxt.tolist() == [int(logits[i, n[i]].argmax()) for i in range(5)]


def explicit_sampling_rule(row: list[float], T: float, top_p: float) -> list[float]:
    """Written out by hand: argmax one-hot at T = 0; else softmax(logits / T), keep the most likely
    tokens while the mass before each is < top_p, renormalise."""
    import math

    if T == 0:
        best = max(range(len(row)), key=lambda i: (row[i], -i))
        return [float(i == best) for i in range(len(row))]
    weights = [math.exp((x - max(row)) / T) for x in row]
    probs = [w / sum(weights) for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(row)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(row))]


def test_target_probs_matches_the_drafter_sampler():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    for T, top_p in ((1.0, 1.0), (0.6, 0.9), (1.3, 0.5), (0.0, 1.0)):
        assert torch.allclose(target_probs(logits, T, top_p), sample_from_logits(logits, T, top_p, None)[1], atol=1e-7)
        expected = torch.tensor([explicit_sampling_rule(row, T, top_p) for row in logits.tolist()])
        assert torch.allclose(target_probs(logits, T, top_p), expected, atol=1e-6), (T, top_p)


# ----------------------------------------------------------------------------------------------
# Statistics, the Python API and the command-line logic
# ----------------------------------------------------------------------------------------------


def test_statistics():
    s = AcceptanceStats(3, 3, accept_histogram=[2, 1, 0, 1], num_generated_tokens=10, num_requests=1)
    assert (s.num_rounds, s.num_accepted_tokens, s.num_draft_tokens) == (4, 4, 12)
    assert s.mean_accept_length == 2.0  # (4 accepted + 4 bonus) / 4 rounds
    assert s.acceptance_rate_per_position == [0.5, 0.25, 0.25]
    assert s.draft_tokens_per_generated_token == 1.2
    total = s + AcceptanceStats(3, 3, [0, 0, 0, 2], 9, 1)
    assert total.accept_histogram == [2, 1, 0, 3] and total.num_requests == 2 and total.num_generated_tokens == 19
    assert AcceptanceStats.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    table = s.table()
    assert "mean accept length          2.000" in table and "ceiling 4" in table
    assert table.splitlines()[-1].split()[:3] == ["3", "1", "0.250"]


def test_measure_acceptance_api():
    target = tiny_target("qwen3")
    prompts = [prompt(seed=s) for s in (1, 2)] + [{"input_ids": prompt(seed=3)}]
    result = measure_acceptance(target, echo_drafter(target), prompts, num_steps=3, max_new_tokens=12)
    assert len(result["requests"]) == 3
    total = AcceptanceStats.from_dict(result["total"])
    assert total.num_requests == 3 and total.num_generated_tokens == 36
    assert sum(r["num_rounds"] for r in result["requests"]) == total.num_rounds
    for r, ids in zip(result["requests"], [prompt(seed=s) for s in (1, 2, 3)]):
        assert_target_greedy(target, ids, r["output_ids"], 12)
    assert result["settings"]["num_draft_tokens"] == 4
    json.dumps(result)


def test_one_rule_for_sampling_settings():
    """Negative, NaN or infinite temperature and top_p outside (0, 1] are refused by the same function
    (check_sampling_settings) in draft, speculative_generate and measure_acceptance, before any compute;
    so are non-integer counts and prompts that are not integer ids."""
    from eagle31_mla.model.modeling_eagle31_mla import DraftInputError

    target, draft = tiny_target(), drafter()
    ids = prompt()
    context = torch.tensor([ids]), torch.zeros(1, len(ids), 3 * HIDDEN)
    for temperature, top_p, name in (
        (-0.5, 1.0, "temperature"),
        (float("nan"), 1.0, "temperature"),
        (float("inf"), 0.9, "temperature"),
        (0.7, 0.0, "top_p"),
        (0.7, 1.5, "top_p"),
    ):
        message = f"`{name}` is .*; expected"
        with pytest.raises(DraftInputError, match=message):
            draft.draft(*context, 2, temperature=temperature, top_p=top_p)
        with pytest.raises(DraftInputError, match=message):
            speculative_generate(target, draft, ids, temperature=temperature, top_p=top_p)
        with pytest.raises(DraftInputError, match=message):
            measure_acceptance(target, draft, [ids], temperature=temperature, top_p=top_p)
    for kwargs, name in (
        ({"num_steps": 2.0}, "num_steps"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"num_steps": True}, "num_steps"),
        ({"topk": "2"}, "topk"),
    ):
        with pytest.raises(DraftInputError, match=f"`{name}` is .*; expected an int"):
            speculative_generate(target, draft, ids, **kwargs)
    for bad, message in (
        ([], "empty"),
        ([1.5, 2.0], "holds 1.5"),
        (torch.tensor(ids).float(), "dtype torch.float32"),
        (torch.tensor(ids) > 3, "dtype torch.bool"),
        ([3, VOCAB], rf"ids in \[3, {VOCAB}\]"),
        ("hello", "holds 'h'"),
    ):
        with pytest.raises(DraftInputError, match=f"`input_ids` .*{message}"):
            speculative_generate(target, draft, bad)


def test_bad_settings_are_refused():
    target, draft = tiny_target(), drafter()
    with pytest.raises(ValueError, match="needs num_draft_tokens"):
        speculative_generate(target, draft, prompt(), topk=2)
    with pytest.raises(ValueError, match=r"must be in \[2, 11\]"):
        speculative_generate(target, draft, prompt(), topk=2, num_draft_tokens=12)
    with pytest.raises(ValueError, match="chain drafting verifies num_steps \\+ 1 = 4"):
        speculative_generate(target, draft, prompt(), num_draft_tokens=6)
    with pytest.raises(ValueError, match=r"`target_hidden_size` is 32 but the target's `hidden_size` is 48"):
        speculative_generate(target, drafter(target_hidden_size=32), prompt())
    with pytest.raises(AuxLayerIdError, match="beyond the target's depth"):
        speculative_generate(target, drafter(eagle_aux_hidden_state_layer_ids=[1, 2, 6]), prompt())
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="custom 4-D attention mask"):
        speculative_generate(target, draft, prompt(), **TREE)


def test_acceptance_command(tmp_path, capsys):
    from tests.support.vllm_harness import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "target")
    vocab = len(tokenizer)
    target = tiny_target("llama", vocab=vocab)
    target.save_pretrained(tmp_path / "target")
    drafter(vocab=vocab, seed=5).save_pretrained(tmp_path / "draft")
    lines = [{"prompt": "The quick brown fox"}, {"input_ids": [5, 6, 7, 8]}, "Hello world"]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "prompts.txt").write_text("The quick brown fox\n\nover the lazy dog\n")

    from eagle31_mla.cli import main

    for prompts, n in (("prompts.jsonl", 3), ("prompts.txt", 2)):
        report = tmp_path / f"{prompts}.report.json"
        assert (
            main(
                [
                    "acceptance",
                    "--target",
                    str(tmp_path / "target"),
                    "--draft",
                    str(tmp_path / "draft"),
                    "--prompts",
                    str(tmp_path / prompts),
                    "--max-new-tokens",
                    "10",
                    "--ignore-eos",
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                    "--json",
                    str(report),
                    "--no-progress",
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "mean accept length" in out and "acceptance rate" in out and f"report written to {report}" in out
        result = json.loads(report.read_text())
        assert result["total"]["num_requests"] == n and result["total"]["num_generated_tokens"] == 10 * n
        first = tokenizer("The quick brown fox")["input_ids"]
        assert_target_greedy(target, first, result["requests"][0]["output_ids"], 10)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--prompts": "missing.jsonl"}, "missing.jsonl"),
        ({"--target": "missing-target"}, "missing-target"),
        ({"--draft": "missing-draft"}, "missing-draft"),
    ],
)
def test_acceptance_command_input_errors_exit_2(tmp_path, capsys, change, message):
    """A name that does not exist is a usage error (exit 2) with a one-line message, never a traceback."""
    from eagle31_mla.demo import DEMO_DIR
    from tests.support.engine_configs import usage_error_line

    (tmp_path / "prompts.txt").write_text("Ann has\n")
    args = {
        "--target": str(DEMO_DIR / "target"),
        "--draft": str(DEMO_DIR / "draft"),
        "--prompts": str(tmp_path / "prompts.txt"),
    }
    args.update({k: str(tmp_path / v) for k, v in change.items()})
    argv = ["acceptance", "--no-progress", "--device", "cpu"] + [x for kv in args.items() for x in kv]
    assert message in usage_error_line(argv, capsys)


# ---- bad prompts, drafting bounds and the context limit (the hardening battery's classes) -------------


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"input_ids": [1.9, 2.7, 3.5]}', "1.9 (float) at index 0"),
        ('{"input_ids": ["12", "3"]}', "'12' (str) at index 0"),
        ('{"input_ids": [true, false, true]}', "True (bool) at index 0"),
        ('{"input_ids": []}', "an empty list"),
        ('{"input_ids": 5}', '"input_ids" is a int'),
        ('{"prompt": 5}', '"prompt" is 5'),
        ('{"prompt": null}', '"prompt" is null'),
        ('{"prompt": ""}', '"prompt" is ""'),
        ('{"messages": "hi"}', '"messages" is "hi"'),
        ('{"messages": [{"role": "user"}]}', '"messages"[0]'),
        ('{"prompt": "a", "input_ids": [1]}', "both"),
        ('{"other": "hello"}', "an object with keys ['other']"),
        ("5", "5"),
        ("null", "null"),
        ("[1, 2.5]", "2.5 (float) at index 1"),
    ],
)
def test_every_prompt_line_is_checked_naming_file_and_line(tmp_path, line, expected):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptError) as info:
        read_prompts(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and expected in message and "expected" in message and "\n" not in message


def test_prompt_ids_are_checked_against_the_vocabulary_and_the_chat_template():
    assert prompt_token_ids({"input_ids": [1, 2]}, None, 8) == [1, 2]
    with pytest.raises(PromptError, match=r"p:3: .*token id 9 at index 1, outside the target's vocabulary \[0, 8\)"):
        prompt_token_ids([1, 9], None, 8, "p:3")

    class NoTemplate:
        chat_template = None

    with pytest.raises(PromptError, match="has no chat template; give `prompt` or `input_ids`"):
        prompt_token_ids({"messages": [{"role": "user", "content": "hi"}]}, NoTemplate(), 8)


def test_eos_ids_have_one_reading_strict_for_arguments_lenient_for_configs():
    assert eos_token_ids(None) == () and eos_token_ids(7) == (7,) and eos_token_ids([3, 2, 3]) == (3, 2, 3)
    assert eos_token_ids(torch.tensor([2, 3]), vocab_size=8, strict=True) == (2, 3)
    assert eos_token_ids([1, "2", None, True, 4]) == (1, 4) and eos_token_ids("2") == ()  # a config's value
    for bad in ("2", [1, "2"], True, 2.0, 8, torch.tensor([2.0])):
        with pytest.raises(
            spec.DraftInputError, match="`eos_token_id` .*; expected None, an int token id in \\[0, 8\\)"
        ):
            eos_token_ids(bad, vocab_size=8, strict=True)


def test_drafting_counts_have_upper_bounds():
    target = tiny_target("llama")
    for name, value in (("num_steps", 99999999999), ("topk", 10**6), ("max_new_tokens", 10**12)):
        with pytest.raises(spec.DraftInputError, match=rf"`{name}` is {value}; expected an int in \[1, "):
            speculative_generate(target, drafter(), prompt(), **{"num_steps": 3, "max_new_tokens": 4, name: value})
    with pytest.raises(spec.DraftInputError, match="`num_draft_tokens`"):
        speculative_generate(target, drafter(), prompt(), topk=2, num_draft_tokens=10**9)


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_generation_stops_at_the_context_limit_with_exact_statistics(settings):
    """Like an engine at max_model_len: the sequence ends exactly at the limit (finish reason "length"),
    the output is still the target's greedy stream, and the statistics count full rounds only."""
    target = tiny_target("llama")
    target.config.max_position_embeddings = 40
    ids = prompt()
    out = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=1000, **settings)
    assert len(ids) + len(out.tokens) == 40 and out.finish_reason == "length" and out.context_limited
    assert_target_greedy(target, ids, out.tokens, 40 - len(ids))
    stats = out.stats
    assert stats.num_generated_tokens == len(out.tokens) and stats.num_rounds == len(out.accepted_per_round)
    assert stats.num_accepted_tokens + stats.num_rounds <= len(out.tokens)  # the last few came from the target alone
    short = speculative_generate(target, echo_drafter(target), ids, max_new_tokens=5, **settings)
    assert short.finish_reason == "length" and not short.context_limited
    with pytest.raises(
        spec.DraftInputError, match="the prompt has 40 tokens; expected fewer than the context limit of 40"
    ):
        speculative_generate(target, echo_drafter(target), prompt(40), max_new_tokens=5, **settings)


def test_acceptance_refuses_bad_prompts_and_swapped_models_before_loading(tmp_path, capsys):
    """Bad ids, a bad prompt shape, a drafter given as --target, a target given as --draft: one line, exit 2,
    before any model loads (no progress bars, no transformers output on stderr)."""
    from eagle31_mla.cli import main
    from eagle31_mla.demo import DEMO_DIR

    T, D = str(DEMO_DIR / "target"), str(DEMO_DIR / "draft")
    bare = tmp_path / "target-without-chat-template"  # the demo target ships one (for chat completions)
    shutil.copytree(DEMO_DIR / "target", bare)
    (bare / "chat_template.jinja").unlink()
    cases = {
        '{"input_ids": [1.9, 2.7]}': (T, D, "prompts.jsonl:1: "),
        '{"input_ids": [1, 2, 999999]}': (T, D, "outside the target's vocabulary [0, 512)"),
        '{"prompt": null}': (T, D, "prompts.jsonl:1: "),
        '{"messages": [{"role": "user", "content": "hi"}]}': (str(bare), D, "has no chat template"),
        '{"prompt": "hi"}': (D, D, "argument --target: "),
        '{"input_ids": [5, 6]}': (T, T, "argument --draft: "),
    }
    for line, (target, draft_, message) in cases.items():
        (tmp_path / "prompts.jsonl").write_text(line + "\n")
        code = main(
            [
                "acceptance",
                "--target",
                target,
                "--draft",
                draft_,
                "--prompts",
                str(tmp_path / "prompts.jsonl"),
                "--device",
                "cpu",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, (line, err)
        assert "Loading" not in err and "%" not in err, err


def test_acceptance_past_the_context_limit_stops_there_with_a_note(tmp_path, capsys):
    from eagle31_mla.cli import main
    from eagle31_mla.demo import DEMO_DIR

    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    report = tmp_path / "r.json"
    assert (
        main(
            [
                "acceptance",
                "--target",
                str(DEMO_DIR / "target"),
                "--draft",
                str(DEMO_DIR / "draft"),
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--ignore-eos",
                "--max-new-tokens",
                "600",
                "--no-progress",
                "--device",
                "cpu",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "note: 1 request(s) stopped at the context limit of 512 positions" in err
    (request,) = json.loads(report.read_text())["requests"]
    assert request["num_prompt_tokens"] + request["num_generated_tokens"] == 512 and request["context_limited"]


@pytest.mark.parametrize(
    "temperature, top_p", [(1e-300, 1.0), (5e-324, 1.0), (1e-3, 1.0), (1.0, 1e-300), (1e-300, 1e-300)]
)
def test_tiny_temperatures_and_top_p_give_a_distribution(temperature, top_p):
    """Valid settings at the edge of fp32: logits / 1e-300 overflows and a top_p below fp32's smallest
    value compares as 0; either would give NaN. Both must give the argmax's one-hot (within fp32)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [0.5, -1.0, 0.25, 0.4]])
    probs = target_probs(logits, temperature, top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and (probs.max(-1).values > 0.999).all()
    drafter = tiny_drafter(seed=1)
    ids = torch.randint(0, drafter.config.vocab_size, (1, 4))
    aux = torch.randn(1, 4, drafter.config.num_aux_hidden_states * drafter.config.target_hidden_size)
    drafted = drafter.draft(
        ids, aux, 2, temperature=temperature, top_p=top_p, generator=torch.Generator().manual_seed(0)
    )
    assert torch.isfinite(drafted.probs).all()


def test_settings_and_pairs_are_refused_with_the_library_error():
    """Every refusal of the reference loop's settings is a DraftInputError, as the README says."""
    from eagle31_mla.model.modeling_eagle31_mla import DraftInputError

    drafter = tiny_drafter(seed=1)
    for bad in (
        dict(num_steps=3, num_draft_tokens=2),
        dict(topk=4, num_steps=2, num_draft_tokens=100),
        dict(topk=4, tree=False),
        dict(topk=10_000 if drafter.config.draft_vocab_size < 10_000 else 64),
    ):
        settings = dict(num_steps=3, topk=1, num_draft_tokens=None, temperature=0.0, top_p=1.0, tree=None) | bad
        with pytest.raises(DraftInputError):
            spec.check_settings(**settings, draft_vocab_size=drafter.config.draft_vocab_size)
