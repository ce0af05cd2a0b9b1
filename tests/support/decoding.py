# ruff: noqa: E501 -- FAMILIES keeps one family per line (under `# fmt: off`)
"""Tiny Transformers targets of four families, drafters that fit them (aux ids [1, 2, 4] of 4 layers: the last read
through the pre-norm hook), and the chi-square test the sampling tests share."""

import functools

import torch
import transformers

from eagle31_mla.decoding.target import TargetAuxCapture
from eagle31_mla.model.modeling_eagle31_mla import sample_from_logits, sampling_probs
from tests.support.tiny import tiny_drafter

VOCAB, HIDDEN, LAYERS = 64, 48, 4
AUX_IDS = [1, 2, 4]  # 4 = the target's depth: read pre-norm through the hook
# fmt: off
COMMON = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
FAMILIES = {  # the Transformers class prefix, what its config adds
    "llama": ("Llama", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3", dict(num_key_value_heads=2, head_dim=16)),
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
}
# fmt: on


def tiny_target(family="llama", *, seed=0, vocab=VOCAB, lm_head="repeats", attn="sdpa"):
    """Unit-variance weights with strong attention / MLP outputs, so the greedy stream wanders instead of settling
    into a loop. ``lm_head``: "repeats" (half the embedding plus noise: runs of repeated tokens of varied length),
    "random", or "zero" (always token 0)."""
    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(vocab_size=vocab, **COMMON, **extra)
    config._attn_implementation = attn
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
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


def drafter(seed: int = 1, *, vocab: int = VOCAB, **overrides):
    kwargs = dict(vocab_size=vocab, target_hidden_size=HIDDEN, eagle_aux_hidden_state_layer_ids=AUX_IDS)
    return tiny_drafter(seed, **{**kwargs, **overrides})


def prompt(n: int = 7, seed: int = 3, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SAMPLES = 100_000


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of draws against a distribution; cells expecting < 5 are pooled. A draw in a zero-probability
    cell fails outright."""
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
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))


@functools.cache
def small_vocab_round() -> dict:
    """A 16-token target and drafter on one context: {(temperature, top_p): (p, q)}, p_j of the target at 4
    positions, the drafter's q_j at 3 (temperature 1 and temperature 0.7 / top-p 0.8)."""
    target = tiny_target("llama", vocab=16, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # p spread over the vocabulary
    draft = drafter(seed=12, vocab=16)
    ids = torch.tensor([prompt(10, seed=13, vocab=16)])
    with torch.no_grad(), TargetAuxCapture(target, draft.config.aux_layer_ids) as capture:
        res = target(ids, output_hidden_states=True)
        draft_logits = draft(ids[:, 1:], aux_hidden_states=capture(res.hidden_states)[:, :-1]).logits[0]
    rounds = {}
    for T, top_p in ((1.0, 1.0), (0.7, 0.8)):
        p = sampling_probs(res.logits[0, -4:], T, top_p)  # [4, V]
        q = torch.stack([sample_from_logits(draft_logits[i][None], T, top_p, None)[1][0] for i in (-1, -2, -3)])
        assert 0.2 < 0.5 * (p[:3] - q).abs().sum(-1).min()  # the drafter really disagrees
        rounds[(T, top_p)] = p, q
    return rounds
