"""``eagle31-mla roster``: the default drafter against the published checkpoint's tensor roster."""

from __future__ import annotations

from types import SimpleNamespace

from .common import subcommand


@subcommand("roster", "check the default (Kimi-K3) drafter against the published checkpoint's tensor roster")
def roster(args: SimpleNamespace) -> int:
    """Build the default (Kimi-K3) drafter without allocating it and check it against the published roster."""
    from ..hub.roster import PUBLISHED_ROSTER, meta_roster, roster_differences
    from ..model.configuration_eagle31_mla import Eagle31MLAConfig, describe_rope

    config = Eagle31MLAConfig()
    shapes, dtypes, num_params = meta_roster(config)
    print("EAGLE-3.1 MLA drafter for Kimi-K3 (default config, built on the meta device: nothing allocated)")
    print(
        f"  hidden {config.hidden_size}, {config.num_attention_heads} heads, q_lora {config.q_lora_rank}, "
        f"kv_lora {config.kv_lora_rank} + rope {config.qk_rope_head_dim}, nope {config.qk_nope_head_dim}, "
        f"v {config.v_head_dim}, MLP {config.intermediate_size}"
    )
    print(
        f"  aux layers: {config.aux_layer_ids.describe()}; fc_norm {config.fc_norm}, norm_output {config.norm_output}"
    )
    print(f"  rope: {describe_rope(config)}")
    kv_bytes = config.kv_cache_values_per_token * config.dtype.itemsize
    print(f"  KV cache: {config.kv_cache_values_per_token} values = {kv_bytes} bytes per token ({config.dtype})")
    print(f"\n  {'tensor':<46} {'shape':>16}")
    for name, shape in shapes.items():
        print(f"  {name:<46} {str(list(shape)):>16}")
    print(f"\n  {len(shapes)} tensors, {num_params:,} parameters, dtype {', '.join(sorted(dtypes))}")

    problems = roster_differences(shapes, dtypes=dtypes, num_parameters=num_params)
    if problems:
        print(f"roster: MISMATCH with lightseekorg/kimi-k3-eagle3.1-mla ({len(problems)}):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly ({len(PUBLISHED_ROSTER)} tensors)")
    return 0
