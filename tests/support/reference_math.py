"""An independent, deliberately plain implementation of SPEC §3, for exactness tests.

Imports nothing from eagle31_mla and takes nothing from Transformers: YaRN follows DeepSeek's
reference formulas, RoPE is done with complex numbers over adjacent pairs (DeepSeek's inference
code), attention is an explicit masked softmax per head in fp32. It runs a whole sequence at once
with no cache, so cached multi-step drafting can be compared against recomputing from scratch.

``variant`` switches on one deliberate bug at a time (the silent failures the tests must catch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    normed = x32 / torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rope slice and the cos/sin magnitude (YaRN's mscale ratio)."""
    base = rope["rope_theta"]
    freq_extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope["rope_type"] != "yarn":
        return freq_extra.float(), 1.0
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    freq_inter = freq_extra / factor

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rope.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # 1 = keep the original frequency, 0 = interpolate by `factor`
    inv_freq = freq_inter * (1 - extrapolate) + freq_extra * extrapolate
    # DeepSeek: cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1 for K3's 1/1.
    magnitude = yarn_mscale(factor, rope.get("mscale", 1)) / yarn_mscale(factor, rope.get("mscale_all_dim", 0))
    return inv_freq.float(), magnitude


def rotate(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, magnitude: float, style: str
) -> torch.Tensor:
    """x: [B, S, heads, R]; positions: [B, S]."""
    if style == "none":
        return x
    angles = positions[..., None].double() * inv_freq.double()  # [B, S, R/2]
    rotor = torch.polar(torch.full_like(angles, magnitude), angles)[:, :, None, :]  # [B, S, 1, R/2]
    if style == "interleaved":  # pairs (x0, x1), (x2, x3), ...
        pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * rotor).flatten(-2).to(x.dtype)
    half = x.shape[-1] // 2  # neox: pairs (x_i, x_{i+R/2})
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    out = pairs * rotor
    return torch.cat([out.real, out.imag], dim=-1).to(x.dtype)


def combine(w: dict, cfg: dict, aux: torch.Tensor, variant: str = "exact") -> torch.Tensor:
    """EAGLE input projection: optional per-chunk fc_norm, then fc."""
    n = cfg["num_aux"]
    if cfg["fc_norm"] and variant != "skip_fc_norm":
        chunks = aux.chunk(n, dim=-1)
        aux = torch.cat([rms_norm(c, w[f"fc_norm.{i}.weight"], cfg["eps"]) for i, c in enumerate(chunks)], dim=-1)
    return aux @ w["fc.weight"].T


def forward(
    w: dict, cfg: dict, input_ids: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, variant: str = "exact"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter layer over a whole sequence, causal, no cache. Returns (logits, next-step state)."""
    eps, heads = cfg["eps"], cfg["heads"]
    nope, rope_dim, v_dim, C = cfg["nope"], cfg["rope"], cfg["v"], cfg["kv_lora"]
    B, S = input_ids.shape
    p = "layers.0."
    emb = w["embed_tokens.weight"][input_ids]
    parts = [rms_norm(emb, w[p + "input_layernorm.weight"], eps), rms_norm(h, w[p + "hidden_norm.weight"], eps)]
    x = torch.cat(parts[::-1] if variant == "hidden_first" else parts, dim=-1)  # [B, S, 2H]

    q = rms_norm(x @ w[p + "self_attn.q_a_proj.weight"].T, w[p + "self_attn.q_a_layernorm.weight"], eps)
    q = (q @ w[p + "self_attn.q_b_proj.weight"].T).view(B, S, heads, nope + rope_dim)
    kv_a = x @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(kv_a[..., :C], w[p + "self_attn.kv_a_layernorm.weight"], eps)
    k_pe = kv_a[..., C:].view(B, S, 1, rope_dim)
    kv = (c_kv @ w[p + "self_attn.kv_b_proj.weight"].T).view(B, S, heads, nope + v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]

    rope = cfg["rope_parameters"]
    inv_freq, magnitude = rope_inv_freq(rope, rope_dim)
    style = {"neox_rope": "neox", "no_rope": "none"}.get(variant, "interleaved")
    q_pe = rotate(q[..., nope:], positions, inv_freq, magnitude, style)
    k_pe = rotate(k_pe, positions, inv_freq, magnitude, style)
    query = torch.cat([q[..., :nope], q_pe], dim=-1)  # [B, S, heads, nope+rope]
    key = torch.cat([k_nope, k_pe.expand(B, S, heads, rope_dim)], dim=-1)

    scale = (nope + rope_dim) ** -0.5
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim") and variant != "no_mscale":
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    scores = torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    attn = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, heads * v_dim)
    h1 = h + attn @ w[p + "self_attn.o_proj.weight"].T

    m = rms_norm(h1, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    h2 = h1 + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    normed = rms_norm(h2, w["norm.weight"], eps)
    logits = normed @ w["lm_head.weight"].T
    post_norm = cfg["norm_output"] != (variant == "wrong_state")
    return logits, (normed if post_norm else h2)


def config_dict(folder) -> dict:
    """The numbers the reference needs, read from a drafter folder's raw ``config.json`` by the file rules of SPEC §2,
    independently of the library's config class (sharing its parsing would hide its mistakes): absent ``fc_norm`` /
    ``norm_output`` mean off, ``rope_parameters`` or else ``rope_scaling`` plus the top-level ``rope_theta``, absent
    rope settings mean plain RoPE, aux ids at the top level or in ``eagle_config``."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    nested = raw.get("eagle_config") or {}
    ids = (
        raw.get("eagle_aux_hidden_state_layer_ids")
        or nested.get("eagle_aux_hidden_state_layer_ids")
        or raw.get("target_layer_ids")
    )
    if raw.get("rope_parameters"):
        rope = dict(raw["rope_parameters"])
    elif raw.get("rope_scaling"):
        rope = dict(raw["rope_scaling"])
        rope["rope_type"] = rope.pop("rope_type", None) or rope.pop("type")
        rope.pop("type", None)
    else:
        rope = {"rope_type": "default"}
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return {
        "eps": raw["rms_norm_eps"],  # no default: the reference reads only what the file says
        "heads": raw["num_attention_heads"],
        "nope": raw["qk_nope_head_dim"],
        "rope": raw["qk_rope_head_dim"],
        "v": raw["v_head_dim"],
        "kv_lora": raw["kv_lora_rank"],
        "num_aux": len(ids),
        "fc_norm": bool(raw.get("fc_norm", False)),
        "norm_output": bool(raw.get("norm_output", False)),
        "rope_parameters": rope,
    }


def diagonal_mask(S: int, depth: int, anchors: torch.Tensor | None, device) -> torch.Tensor:
    """[(B,) T, S + depth·T] bool for the queries (every position, or the anchors [(B,) T]): depth-0 keys at
    positions <= the query's, plus the query's own keys at depths 1..depth (the dense TTT pattern)."""
    queries = torch.arange(S, device=device) if anchors is None else anchors
    T = queries.shape[-1]
    context = torch.arange(S, device=device) <= queries[..., None]  # [(B,) T, S]
    own = torch.eye(T, dtype=torch.bool, device=device).repeat(1, depth)  # [T, depth·T]
    return torch.cat([context, own.expand(*context.shape[:-1], -1)], dim=-1)


class DenseTTTAttention:
    """The test oracle of the trainer's TTTAttention: the same pattern as a dense [T, S + k·T] mask, attended by
    scaled-dot-product attention over all of it (memory quadratic in the sequence)."""

    def __init__(self, S: int, anchors: torch.Tensor | None):
        self.S, self.anchors = S, anchors

    def attend(self, q, latent, keys_values, scale):
        k, v = keys_values(latent)  # every cached latent, at every depth
        depth = (latent.shape[1] - self.S) // q.shape[2]
        anchors = None if self.anchors is None or depth == 0 else self.anchors.clamp(min=0)
        mask = diagonal_mask(self.S, depth, anchors, q.device)
        mask = mask[:, None] if mask.dim() == 3 else mask[None, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class SoftCrossEntropyByAutograd:
    """The test oracle of the trainer's SoftCrossEntropy (which makes its gradient by hand, in place): the same
    formula, sum_i w_i (logsumexp(z_i) - P_i . z_i) and the weighted top-1 agreement, differentiated by autograd."""

    @staticmethod
    def apply(logits, p, w, top):
        cross = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
        return (cross * w).sum(), ((logits.argmax(-1) == top) * w).sum()
