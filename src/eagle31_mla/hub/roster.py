"""The published checkpoint's tensor roster (SPEC §2): what `lightseekorg/kimi-k3-eagle3.1-mla` holds.

Source: a third-party engine that pins the checkpoint by SHA-256 and rejects any other header; the
byte count (6,031,253,592 = 2 × 3,015,625,728 + 8 + 2,128-byte header) confirms it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PUBLISHED_ROSTER: dict[str, tuple[int, ...]] = {
    "embed_tokens.weight": (163840, 7168),
    "fc.weight": (7168, 21504),
    "fc_norm.0.weight": (7168,),
    "fc_norm.1.weight": (7168,),
    "fc_norm.2.weight": (7168,),
    "layers.0.hidden_norm.weight": (7168,),
    "layers.0.input_layernorm.weight": (7168,),
    "layers.0.post_attention_layernorm.weight": (7168,),
    "layers.0.self_attn.q_a_proj.weight": (1536, 14336),
    "layers.0.self_attn.q_a_layernorm.weight": (1536,),
    "layers.0.self_attn.q_b_proj.weight": (12288, 1536),
    "layers.0.self_attn.kv_a_proj_with_mqa.weight": (576, 14336),
    "layers.0.self_attn.kv_a_layernorm.weight": (512,),
    "layers.0.self_attn.kv_b_proj.weight": (16384, 512),
    "layers.0.self_attn.o_proj.weight": (7168, 8192),
    "layers.0.mlp.gate_proj.weight": (18432, 7168),
    "layers.0.mlp.up_proj.weight": (18432, 7168),
    "layers.0.mlp.down_proj.weight": (7168, 18432),
    "norm.weight": (7168,),
    "lm_head.weight": (163840, 7168),
}
PUBLISHED_DTYPE = "bfloat16"
PUBLISHED_NUM_PARAMETERS = 3_015_625_728


def meta_roster(config) -> tuple[dict[str, tuple[int, ...]], set[str], int]:
    """(name -> shape, dtype names, parameter count) of the drafter ``config`` describes, built on the meta device."""
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    model = Eagle31MLAForCausalLM.on_meta_device(config)
    state = model.state_dict()
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    return shapes, {dtype_name(t.dtype) for t in state.values()}, sum(p.numel() for p in model.parameters())


def roster_differences(shapes: Mapping[str, Sequence[int]], *, dtypes=None, num_parameters=None) -> list[str]:
    """Every way ``shapes`` (name -> shape), and when given ``dtypes`` (torch or safetensors spelling) and
    ``num_parameters``, depart from the published checkpoint; empty when identical."""
    problems = [f"missing {name} {list(shape)}" for name, shape in PUBLISHED_ROSTER.items() if name not in shapes]
    problems += [f"extra {name} {list(shapes[name])}" for name in shapes if name not in PUBLISHED_ROSTER]
    misshaped = [name for name, shape in PUBLISHED_ROSTER.items() if tuple(shapes.get(name, shape)) != shape]
    problems += [f"{name}: shape {list(shapes[name])}, published {list(PUBLISHED_ROSTER[name])}" for name in misshaped]
    if num_parameters is not None and num_parameters != PUBLISHED_NUM_PARAMETERS:
        problems.append(f"{num_parameters:,} parameters, published {PUBLISHED_NUM_PARAMETERS:,}")
    if dtypes is not None and (names := sorted({dtype_name(d) for d in dtypes})) != [PUBLISHED_DTYPE]:
        problems.append(f"dtypes {names}, published {PUBLISHED_DTYPE}")
    return problems


def dtype_name(dtype) -> str:
    """A dtype's torch name, given a torch dtype, a torch name or a safetensors name (``BF16`` -> ``bfloat16``)."""
    from safetensors.torch import _TYPES  # safetensors' own table: "BF16" -> torch.bfloat16

    name = str(dtype).removeprefix("torch.")
    return str(_TYPES[name]).removeprefix("torch.") if name in _TYPES else name
