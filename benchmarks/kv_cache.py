#!/usr/bin/env python3
"""KV-cache bytes per token at Kimi-K3 drafter dims, measured from the tensors actually allocated.

    python benchmarks/kv_cache.py [--tokens 256]

Three caches for one attention layer, bf16, after a real forward over the same tokens:
- this library's latent cache (normalised c_kv 512 + rotated k_pe 64);
- Transformers' DeepseekV3 attention (same MLA dims): recent Transformers (5.19 measured) also keep
  the compressed latent; releases that cached decompressed K and V held 64 x (192 + 128) x 2 = 40,960 B;
- an MHA EAGLE-3 drafter (Llama layer, 64 heads x 128, K and V).
"""

from __future__ import annotations

import argparse

import torch

K3 = dict(
    hidden_size=7168,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


def cache_bytes(cache) -> tuple[int, str]:
    """Bytes held by a Transformers cache object (every tensor reachable from its layers), and shapes."""
    total, seen, shapes = 0, set(), []
    for layer in getattr(cache, "layers", []):
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
                shapes.append(f"{name} {list(value.shape)}")
    return total, ", ".join(shapes)


def ours(tokens: int) -> int:
    from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM, LatentKVCache

    config = Eagle31MLAConfig(vocab_size=1024, intermediate_size=256, eagle_aux_hidden_state_layer_ids=[2, 46, 90])
    torch.manual_seed(0)
    model = Eagle31MLAForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, tokens))
    aux = torch.randn(1, tokens, 3 * 7168, dtype=torch.bfloat16)
    # sized for the tokens, as a caller who knows the length does (the default grows by doubling)
    cache = LatentKVCache.for_model(config, 1, dtype=torch.bfloat16, device="cpu", capacity=tokens)
    with torch.inference_mode():
        model(ids, aux_hidden_states=aux, past_key_values=cache)
    assert cache.get_seq_length() == tokens
    return cache.nbytes_allocated(), f"latent {list(cache.latent.shape)}"  # the whole allocated buffer


def transformers_deepseek_v3(tokens: int) -> int:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=1024,
        intermediate_size=256,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
        **K3,
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.inference_mode():
        out = model(torch.randint(0, 1024, (1, tokens)), use_cache=True)
    return cache_bytes(out.past_key_values)


def mha_eagle3(tokens: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=7168,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.inference_mode():
        out = model(torch.randint(0, 1024, (1, tokens)), use_cache=True)
    return cache_bytes(out.past_key_values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    import transformers

    rows = [
        ("eagle31-mla latent cache (c_kv 512 + k_pe 64)", *ours(args.tokens)),
        (
            f"Transformers {transformers.__version__} DeepseekV3 attention, same MLA dims",
            *transformers_deepseek_v3(args.tokens),
        ),
        ("MHA EAGLE-3 drafter (Llama layer), 64 heads x 128", *mha_eagle3(args.tokens)),
    ]
    base = rows[0][1] / args.tokens
    print(f"# KV cache per token per layer, bf16, measured after a forward over {args.tokens} tokens\n")
    print("| cache | tensors held | bytes / token | vs latent |")
    print("|---|---|--:|--:|")
    for name, nbytes, shapes in rows:
        print(f"| {name} | {shapes} | {nbytes / args.tokens:,.0f} | {nbytes / args.tokens / base:.1f}x |")


if __name__ == "__main__":
    main()
