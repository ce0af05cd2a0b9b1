"""Tiny drafters for tests (small dims, weights large enough that every norm and rotation shows), and the
tolerances the exactness tests share."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM, LatentKVCache

YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_config(**overrides) -> Eagle31MLAConfig:
    kwargs = dict(
        vocab_size=300,
        hidden_size=64,
        target_hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=20,
        max_position_embeddings=4096,
        rope_parameters=dict(YARN),
        eagle_aux_hidden_state_layer_ids=[2, 5, 9],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=torch.float32,
    )
    kwargs.update(overrides)
    return Eagle31MLAConfig(**kwargs)


def tiny_drafter(seed: int = 0, **overrides) -> Eagle31MLAForCausalLM:
    """Unit-variance projections and norm weights away from 1, so a skipped norm or a wrong rotation changes the
    output by O(1), not by rounding."""
    model, g = Eagle31MLAForCausalLM(tiny_config(**overrides)), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        if model.d2t is not None:  # a permuted subset of the target vocabulary, as offsets
            vocab, draft_vocab = model.config.vocab_size, model.config.draft_vocab_size
            targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
            model.d2t.copy_(targets - torch.arange(draft_vocab))
            model.t2d.zero_()
            model.t2d[targets] = True
    return model.eval()


def aux_inputs(config: Eagle31MLAConfig, batch: int, length: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=g)
    aux = 3 * torch.randn(batch, length, config.num_aux_hidden_states * config.target_hidden_size, generator=g)
    return ids, aux


def same_logits(loaded: Eagle31MLAForCausalLM, model: Eagle31MLAForCausalLM) -> bool:
    """Exact on purpose: the same weights (copied through a file), kernels and shapes in one process: any difference
    is a loading difference, not rounding (a tolerance would hide a wrong copy of a few rows)."""
    ids, aux = aux_inputs(model.config, 2, 6)
    return torch.equal(loaded(ids, aux_hidden_states=aux).logits, model(ids, aux_hidden_states=aux).logits)


# fp32 over one drafter layer of width <= 96: two paths that reduce over other lengths or orders (unrolled or cached,
# absorbed or naive) differ by rounding of about 1e-7 relative per operation; 1e-5 leaves two orders of magnitude.
TOL = 1e-5


def bf16_tolerance(reference: torch.Tensor) -> float:
    """bf16 holds 8 significant bits (an ulp is at most 2^-7 of a value). Two bf16 paths that differ only in roundings
    inside the attention (products in fp32 or in bf16, another summation order), each under half an ulp and passed on
    by later bf16 roundings: 4 ulps at the output's scale bound them with margin (measured: about 1), while a real bug
    (a lost scale, mask or rotation, a wrong query, page or length) moves outputs by O(1)."""
    return 4 * 2**-7 * reference.float().abs().max().item()


@torch.no_grad()
def draft_step_by_step(model: Eagle31MLAForCausalLM, ids, aux, t: int, depth: int) -> list[torch.Tensor]:
    """Depth k's logits at position t as serving drafts them, with a cache: the context ending at t, then k steps fed
    the true tokens x[t+1+k] at rope positions t+k (as far as the sequence goes). ``ids``, ``aux``: one sequence."""
    cache = LatentKVCache.for_model(model.config, 1, dtype=torch.float32, device="cpu")
    out = model(ids[:, 1 : t + 2], aux_hidden_states=aux[:, : t + 1], past_key_values=cache)
    logits, state = [out.logits[:, -1]], out.hidden_states[:, -1:]
    for k in range(1, min(depth, ids.shape[1] - 1 - t)):
        position = torch.tensor([[t + k]])
        out = model(ids[:, t + 1 + k : t + 2 + k], hidden_states=state, past_key_values=cache, position_ids=position)
        logits.append(out.logits[:, 0])
        state = out.hidden_states
    return logits


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A drafter folder written by hand: exactly these tensor names and this config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def add_to_hub_cache(repo_id: str, commit: str, files: list[Path], ref: str = "main") -> None:
    """``files`` as huggingface_hub caches a repo (the suite's HF_HUB_CACHE): blobs, the snapshot's links to them
    (outside the snapshot folder, and fine), and ``ref`` naming ``commit``."""
    repo = Path(os.environ["HF_HUB_CACHE"]) / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files:
        shutil.copy(file, repo / "blobs" / f"{commit}-{file.name}")
        (repo / "snapshots" / commit / file.name).symlink_to(Path("../../blobs") / f"{commit}-{file.name}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


def published_style_config(model: Eagle31MLAForCausalLM, ids_form: str = "published") -> dict:
    """config.json as the training framework exports it: kimi_k2, rope_scaling, and the aux ids as
    published   nested one-based (the released checkpoint)
    training    nested zero-based (the training framework's own config)
    top_level   top-level one-based only (vLLM's own key)
    both        top-level one-based and nested zero-based"""
    c = model.config
    one_based = list(c.aux_layer_ids.one_based)
    rope = dict(c.rope_parameters)
    theta = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    out = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": theta,
        "mla_use_nope": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    zero_based = [i - 1 for i in one_based]
    nested = {"published": one_based, "training": zero_based, "top_level": None, "both": zero_based}[ids_form]
    if nested is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested, "use_aux_hidden_state": True}
    if ids_form in ("top_level", "both"):
        out["eagle_aux_hidden_state_layer_ids"] = one_based
    if rope_type != "default":
        out["rope_scaling"] = {"type": rope_type, **rope}
    return out | {flag: True for flag in ("fc_norm", "norm_output") if getattr(c, flag)}


def demo_layer() -> dict:
    """The embedded demo drafter's own layer (2 heads, q_lora 64, kv_lora 512 + rope 64, MLP 384): what a test
    gives a drafter it trains for the demo target (`train --draft-config`), instead of the published drafter's
    layer (64 heads, MLP 18432: 36M parameters on the demo's hidden size of 128, checkpoints of 430 MB)."""
    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.training.trainer import layer_settings

    return layer_settings(json.loads((DEMO_DIR / "draft" / "config.json").read_text()))
