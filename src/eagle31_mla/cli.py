"""The ``eagle31-mla`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    """Build the default (Kimi-K3) drafter without allocating it and check it against the published roster."""
    import torch

    from .configuration_eagle31_mla import Eagle31MLAConfig
    from .modeling_eagle31_mla import Eagle31MLAForCausalLM
    from .roster import PUBLISHED_DTYPE, PUBLISHED_NUM_PARAMETERS, PUBLISHED_ROSTER, roster_differences

    config = Eagle31MLAConfig()
    model = Eagle31MLAForCausalLM.on_meta_device(config)
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    num_params = sum(t.numel() for t in state.values())
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values()}
    rope = config.rope_parameters

    print("EAGLE-3.1 MLA drafter for Kimi-K3 (default config, built on the meta device: nothing allocated)")
    print(f"  hidden {config.hidden_size}, {config.num_attention_heads} heads, q_lora {config.q_lora_rank}, "
          f"kv_lora {config.kv_lora_rank} + rope {config.qk_rope_head_dim}, nope {config.qk_nope_head_dim}, "
          f"v {config.v_head_dim}, MLP {config.intermediate_size}")  # fmt: skip
    print(f"  aux layers: {config.aux_layer_ids.describe()}; fc_norm {config.fc_norm}, norm_output {config.norm_output}")
    print(f"  rope: {rope['rope_type']} theta {rope['rope_theta']:g}"
          + (f", factor {rope['factor']:g} over {rope['original_max_position_embeddings']}" if rope["rope_type"] == "yarn" else ""))  # fmt: skip
    kv_bytes = config.kv_cache_values_per_token * torch.finfo(config.dtype).bits // 8
    print(f"  KV cache: {config.kv_cache_values_per_token} values = {kv_bytes} bytes per token ({config.dtype})")
    print(f"\n  {'tensor':<46} {'shape':>16}")
    for name, shape in shapes.items():
        print(f"  {name:<46} {str(list(shape)):>16}")
    print(f"\n  {len(shapes)} tensors, {num_params:,} parameters, dtype {', '.join(sorted(dtypes))}")

    problems = roster_differences(shapes)
    if num_params != PUBLISHED_NUM_PARAMETERS:
        problems.append(f"{num_params:,} parameters, published {PUBLISHED_NUM_PARAMETERS:,}")
    if dtypes != {PUBLISHED_DTYPE}:
        problems.append(f"dtype {dtypes}, published {PUBLISHED_DTYPE}")
    if problems:
        print(f"roster: MISMATCH with lightseekorg/kimi-k3-eagle3.1-mla ({len(problems)}):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"roster: matches lightseekorg/kimi-k3-eagle3.1-mla exactly ({len(PUBLISHED_ROSTER)} tensors)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle31-mla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help=_demo.__doc__, description=_demo.__doc__)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
