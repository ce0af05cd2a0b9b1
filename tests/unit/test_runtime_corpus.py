"""A generated corpus of bad runtime arguments: every argument of ``forward`` and ``draft`` (enumerated
with inspect.signature, so a new argument fails ``test_every_argument_has_bad_values`` until it gets
cases here) is given bad values of each class (wrong type, numpy array, Python list, wrong dtype,
narrow integers whose values would wrap, wrong shape, NaN/inf, out of range, empty, another kind of
cache, ...). Each must raise this project's :class:`DraftInputError` (a ValueError and TypeError, raised by
the argument checks before any compute: never a raw torch error), whose message names the argument
and says what was expected, and must leave a passed cache exactly as it was (no silent overwrite)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from eagle31_mla import Eagle31MLAForCausalLM, LatentKVCache
from eagle31_mla.model.modeling_eagle31_mla import DraftInputError, check_sampling_settings
from tests.support.tiny import aux_inputs, tiny_drafter

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

B, T = 2, 4
MAX_POS = 4096  # tiny_config's max_position_embeddings


@dataclass
class Ctx:
    model: Eagle31MLAForCausalLM
    ids: torch.Tensor  # [2, 4] int64
    aux: torch.Tensor  # [2, 4, 144] fp32
    cache: LatentKVCache  # batch 2, 4 tokens
    state: torch.Tensor  # [2, 1, 64], the state after the context


@pytest.fixture(scope="module")
def ctx() -> Ctx:
    model = tiny_drafter(seed=21)
    ids, aux = aux_inputs(model.config, B, T)
    with torch.no_grad():
        out = model(ids, aux_hidden_states=aux)
    return Ctx(model, ids, aux, out.past_key_values, out.hidden_states[:, -1:])


def copy_cache(cache: LatentKVCache) -> LatentKVCache:
    new = LatentKVCache(
        cache.latent.shape[0],
        cache.kv_lora_rank,
        cache.rope_dim,
        dtype=cache.latent.dtype,
        device=cache.latent.device,
        capacity=cache.latent.shape[1],
    )
    new.latent.copy_(cache.latent)
    new.length = cache.length
    return new


def first(c: Ctx, **over) -> dict:
    """A valid first step over the context; ``over`` replaces arguments."""
    return {"input_ids": c.ids, "aux_hidden_states": c.aux, **over}


def decode(c: Ctx, **over) -> dict:
    """A valid decode step after the context, on a copy of its cache."""
    return {"input_ids": c.ids[:, :1], "hidden_states": c.state, "past_key_values": copy_cache(c.cache), **over}


def drafting(c: Ctx, **over) -> dict:
    return {"input_ids": c.ids, "aux_hidden_states": c.aux, "num_tokens": 2, **over}


@dataclass
class Case:
    argument: str  # the argument whose bad value this is
    kind: str  # the class of bad value
    label: str
    call: Callable[[Ctx], dict]  # the keyword arguments of the call
    names: tuple[str, ...] = ()  # arguments the message may name instead (default: the argument itself)


def ids_like(c, dtype, values):
    """[B, T] ids of a given dtype, each row ``values``."""
    return torch.tensor(values, dtype=dtype).expand(B, T)


def other_cache(c: Ctx, **config) -> LatentKVCache:
    model = tiny_drafter(seed=1, **config)
    with torch.no_grad():
        return model(c.ids, aux_hidden_states=c.aux).past_key_values


def batch1_cache(c: Ctx) -> LatentKVCache:
    with torch.no_grad():
        return c.model(c.ids[:1], aux_hidden_states=c.aux[:1]).past_key_values


#: Cache lengths no drafter call or crop can produce: below 0, beyond the cache's capacity (256 here), not an int.
LENGTHS = [
    ("-2", -2),
    ("-1", -1),
    ("capacity + 1", 257),
    ("10**6", 10**6),
    ("2.0", 2.0),
    ("True", True),
    ("None", None),
]


# -- forward ---------------------------------------------------------------------------------------

FORWARD_CASES = [
    # input_ids
    Case("input_ids", "type", "None", lambda c: first(c, input_ids=None)),
    Case("input_ids", "type", "str", lambda c: first(c, input_ids="hello")),
    Case("input_ids", "numpy", "int64 array", lambda c: first(c, input_ids=c.ids.numpy())),
    Case("input_ids", "list", "nested list", lambda c: first(c, input_ids=c.ids.tolist())),
    Case("input_ids", "dtype", "float32", lambda c: first(c, input_ids=c.ids.float())),
    Case("input_ids", "dtype", "float64", lambda c: first(c, input_ids=c.ids.double())),
    Case("input_ids", "dtype", "bool", lambda c: first(c, input_ids=c.ids > 100)),
    Case(
        "input_ids",
        "wrap",
        "uint8 299 (wraps to 43)",
        lambda c: first(c, input_ids=ids_like(c, torch.uint8, [299 % 256] * T)),
    ),
    Case("input_ids", "wrap", "int8", lambda c: first(c, input_ids=ids_like(c, torch.int8, [-128, 5, 6, 127]))),
    Case("input_ids", "wrap", "int16 32767", lambda c: first(c, input_ids=ids_like(c, torch.int16, [32767, 1, 2, 3]))),
    Case("input_ids", "shape", "1-D", lambda c: first(c, input_ids=c.ids[0])),
    Case("input_ids", "shape", "3-D", lambda c: first(c, input_ids=c.ids[..., None])),
    Case(
        "input_ids",
        "shape",
        "T differs from the states",
        lambda c: first(c, input_ids=c.ids[:, :3]),
        ("aux_hidden_states",),
    ),
    Case("input_ids", "empty", "no tokens", lambda c: first(c, input_ids=c.ids[:, :0], aux_hidden_states=c.aux[:, :0])),
    Case("input_ids", "empty", "no sequences", lambda c: first(c, input_ids=c.ids[:0], aux_hidden_states=c.aux[:0])),
    Case(
        "input_ids",
        "range",
        "id = vocab_size",
        lambda c: first(c, input_ids=torch.where(c.ids == c.ids[1, 2], 300, c.ids)),
    ),
    Case("input_ids", "range", "negative id", lambda c: first(c, input_ids=-c.ids - 1)),
    Case(
        "input_ids",
        "range",
        "int32 id = vocab_size",
        lambda c: first(c, input_ids=ids_like(c, torch.int32, [1, 2, 300, 3])),
    ),
    Case("input_ids", "device", "meta", lambda c: first(c, input_ids=c.ids.to("meta"))),
    # aux_hidden_states
    Case("aux_hidden_states", "type", "float", lambda c: first(c, aux_hidden_states=1.0)),
    Case("aux_hidden_states", "numpy", "float32 array", lambda c: first(c, aux_hidden_states=c.aux.numpy())),
    Case("aux_hidden_states", "list", "nested list", lambda c: first(c, aux_hidden_states=c.aux.tolist())),
    Case("aux_hidden_states", "dtype", "bfloat16", lambda c: first(c, aux_hidden_states=c.aux.bfloat16())),
    Case("aux_hidden_states", "dtype", "float64", lambda c: first(c, aux_hidden_states=c.aux.double())),
    Case("aux_hidden_states", "dtype", "int64", lambda c: first(c, aux_hidden_states=c.aux.long())),
    Case("aux_hidden_states", "shape", "width of 2 states", lambda c: first(c, aux_hidden_states=c.aux[..., :96])),
    Case("aux_hidden_states", "shape", "2-D", lambda c: first(c, aux_hidden_states=c.aux[0])),
    Case("aux_hidden_states", "shape", "batch 1", lambda c: first(c, aux_hidden_states=c.aux[:1])),
    Case(
        "aux_hidden_states",
        "nonfinite",
        "NaN",
        lambda c: first(c, aux_hidden_states=c.aux.index_fill(2, torch.tensor([3]), float("nan"))),
    ),
    Case(
        "aux_hidden_states",
        "nonfinite",
        "inf",
        lambda c: first(c, aux_hidden_states=c.aux.index_fill(1, torch.tensor([0]), float("inf"))),
    ),
    Case(
        "aux_hidden_states",
        "both",
        "with hidden_states too",
        lambda c: first(c, hidden_states=c.state.expand(B, T, -1)),
    ),
    Case("aux_hidden_states", "missing", "neither state", lambda c: {"input_ids": c.ids}),
    Case("aux_hidden_states", "device", "meta", lambda c: first(c, aux_hidden_states=c.aux.to("meta"))),
    # hidden_states
    Case("hidden_states", "type", "str", lambda c: decode(c, hidden_states="state")),
    Case("hidden_states", "numpy", "float32 array", lambda c: decode(c, hidden_states=c.state.numpy())),
    Case("hidden_states", "list", "nested list", lambda c: decode(c, hidden_states=c.state.tolist())),
    Case("hidden_states", "dtype", "bfloat16", lambda c: decode(c, hidden_states=c.state.bfloat16())),
    Case("hidden_states", "dtype", "int32", lambda c: decode(c, hidden_states=c.state.int())),
    Case("hidden_states", "shape", "target width", lambda c: decode(c, hidden_states=torch.zeros(B, 1, 48))),
    Case("hidden_states", "shape", "T = 2 for 1 token", lambda c: decode(c, hidden_states=c.state.expand(B, 2, -1))),
    Case(
        "hidden_states", "nonfinite", "NaN", lambda c: decode(c, hidden_states=torch.full_like(c.state, float("nan")))
    ),
    Case(
        "hidden_states",
        "nonfinite",
        "-inf",
        lambda c: decode(c, hidden_states=c.state.index_fill(2, torch.tensor([5]), -float("inf"))),
    ),
    # position_ids
    Case("position_ids", "type", "int", lambda c: first(c, position_ids=3)),
    Case("position_ids", "type", "range", lambda c: first(c, position_ids=range(T))),
    Case("position_ids", "numpy", "int64 array", lambda c: first(c, position_ids=np.arange(T)[None])),
    Case("position_ids", "list", "nested list", lambda c: first(c, position_ids=[list(range(T))] * B)),
    Case(
        "position_ids",
        "dtype",
        "float positions",
        lambda c: first(c, position_ids=torch.arange(T, dtype=torch.float32)[None] + 0.5),
    ),
    Case("position_ids", "dtype", "bool", lambda c: first(c, position_ids=torch.ones(B, T, dtype=torch.bool))),
    Case(
        "position_ids",
        "wrap",
        "uint8 4100 % 256",
        lambda c: first(c, position_ids=torch.tensor([[4, 5, 6, 7]], dtype=torch.uint8)),
    ),
    Case(
        "position_ids",
        "wrap",
        "int16 near 32767",
        lambda c: first(c, position_ids=torch.tensor([[32764, 32765, 32766, 32767]], dtype=torch.int16)),
    ),
    Case("position_ids", "shape", "1-D", lambda c: first(c, position_ids=torch.arange(T))),
    Case("position_ids", "shape", "T - 1 positions", lambda c: first(c, position_ids=torch.arange(T - 1)[None])),
    Case("position_ids", "shape", "batch 3", lambda c: first(c, position_ids=torch.arange(T).expand(3, T))),
    Case("position_ids", "empty", "no positions", lambda c: first(c, position_ids=torch.zeros(B, 0, dtype=torch.long))),
    Case("position_ids", "range", "negative", lambda c: first(c, position_ids=torch.arange(-1, T - 1)[None])),
    Case(
        "position_ids",
        "range",
        "= max_position_embeddings",
        lambda c: first(c, position_ids=torch.arange(MAX_POS - 3, MAX_POS + 1)[None]),
    ),
    Case("position_ids", "device", "meta", lambda c: first(c, position_ids=torch.arange(T, device="meta")[None])),
    # past_key_values
    Case("past_key_values", "kind", "transformers DynamicCache", lambda c: decode(c, past_key_values=DynamicCache())),
    Case(
        "past_key_values", "kind", "legacy tuple", lambda c: decode(c, past_key_values=((c.cache.c_kv, c.cache.k_pe),))
    ),
    Case("past_key_values", "kind", "the latent tensor", lambda c: decode(c, past_key_values=c.cache.latent)),
    Case("past_key_values", "numpy", "latent as numpy", lambda c: decode(c, past_key_values=c.cache.latent.numpy())),
    Case(
        "past_key_values", "list", "list of tensors", lambda c: decode(c, past_key_values=[c.cache.c_kv, c.cache.k_pe])
    ),
    Case(
        "past_key_values",
        "batch",
        "batch-2 cache, batch-1 step",
        lambda c: decode(c, input_ids=c.ids[:1, :1], hidden_states=c.state[:1]),
    ),
    Case(
        "past_key_values", "batch", "batch-1 cache, batch-2 step", lambda c: decode(c, past_key_values=batch1_cache(c))
    ),
    Case(
        "past_key_values",
        "drafter",
        "kv_lora_rank 16",
        lambda c: decode(c, past_key_values=other_cache(c, kv_lora_rank=16)),
    ),
    Case(
        "past_key_values",
        "drafter",
        "rope dim 8",
        lambda c: decode(c, past_key_values=other_cache(c, qk_rope_head_dim=8)),
    ),
    # same dims, another drafter: its k_pe was rotated under another rope schedule / its c_kv normalised with
    # other weights
    Case(
        "past_key_values",
        "drafter",
        "same dims, plain rope (YaRN-rotated k_pe)",
        lambda c: decode(c, past_key_values=other_cache(c, rope_parameters={"rope_type": "default"})),
    ),
    Case(
        "past_key_values", "drafter", "same config, other weights", lambda c: decode(c, past_key_values=other_cache(c))
    ),
    Case(
        "past_key_values",
        "dtype",
        "bfloat16 cache",
        lambda c: decode(
            c, past_key_values=LatentKVCache.for_model(c.model.config, B, dtype=torch.bfloat16, device="cpu")
        ),
    ),
    Case(
        "past_key_values",
        "device",
        "meta cache",
        lambda c: decode(
            c, past_key_values=LatentKVCache.for_model(c.model.config, B, dtype=torch.float32, device="meta")
        ),
    ),
    Case("past_key_values", "use_cache", "with use_cache=False", lambda c: decode(c, use_cache=False)),
    Case(
        "past_key_values",
        "range",
        "full cache, implicit positions",
        lambda c: decode(c, past_key_values=full_cache(c)),
        ("input_ids",),
    ),
    *[
        Case(
            "past_key_values",
            "length",
            f"length {label} (set by hand)",
            lambda c, n=n: decode(c, past_key_values=cache_of_length(c, n)),
        )
        for label, n in LENGTHS
    ],
    # attention_mask
    Case("attention_mask", "type", "int", lambda c: first(c, attention_mask=1)),
    Case("attention_mask", "numpy", "int array", lambda c: first(c, attention_mask=np.ones((B, T), dtype=np.int64))),
    Case("attention_mask", "list", "nested list", lambda c: first(c, attention_mask=[[1] * T] * B)),
    Case("attention_mask", "dtype", "additive float mask", lambda c: first(c, attention_mask=torch.zeros(B, T))),
    Case("attention_mask", "dtype", "float 0/1", lambda c: first(c, attention_mask=torch.ones(B, T))),
    Case(
        "attention_mask",
        "dtype",
        "4-D int",
        lambda c: first(c, attention_mask=torch.ones(B, 1, T, T, dtype=torch.long)),
    ),
    Case(
        "attention_mask",
        "shape",
        "S without the cache",
        lambda c: decode(c, attention_mask=torch.ones(B, 1, dtype=torch.long)),
    ),
    Case(
        "attention_mask",
        "shape",
        "[B, T, S] 3-D",
        lambda c: first(c, attention_mask=torch.ones(B, T, T, dtype=torch.bool)),
    ),
    Case(
        "attention_mask",
        "shape",
        "4-D wrong T",
        lambda c: first(c, attention_mask=torch.ones(B, 1, 1, T, dtype=torch.bool)),
    ),
    Case("attention_mask", "empty", "[B, 0]", lambda c: first(c, attention_mask=torch.ones(B, 0, dtype=torch.long))),
    Case("attention_mask", "range", "value 2", lambda c: first(c, attention_mask=torch.full((B, T), 2))),
    Case("attention_mask", "range", "value -1", lambda c: first(c, attention_mask=torch.full((B, T), -1))),
    Case(
        "attention_mask",
        "wrap",
        "uint8 256 -> 0 is fine, 255 is not 0/1",
        lambda c: first(c, attention_mask=torch.full((B, T), 255, dtype=torch.uint8)),
    ),
    Case(
        "attention_mask",
        "device",
        "meta",
        lambda c: first(c, attention_mask=torch.ones(B, T, dtype=torch.long, device="meta")),
    ),
    # switches
    Case("use_cache", "type", "str", lambda c: first(c, use_cache="yes")),
    Case("use_cache", "type", "int 1", lambda c: first(c, use_cache=1)),
    Case("use_cache", "type", "tensor", lambda c: first(c, use_cache=torch.tensor(True))),
    Case("absorb", "type", "str", lambda c: decode(c, absorb="true")),
    Case("absorb", "type", "int 0", lambda c: decode(c, absorb=0)),
    Case("absorb", "numpy", "numpy bool", lambda c: decode(c, absorb=np.bool_(True))),
    Case("check_values", "type", "None", lambda c: first(c, check_values=None)),
    Case("check_values", "type", "int 1", lambda c: first(c, check_values=1)),
    # logits_to_keep
    Case("logits_to_keep", "range", "negative", lambda c: first(c, logits_to_keep=-1)),
    Case("logits_to_keep", "range", "more than T", lambda c: first(c, logits_to_keep=T + 1)),
    Case("logits_to_keep", "type", "float", lambda c: first(c, logits_to_keep=1.0)),
    Case("logits_to_keep", "type", "bool", lambda c: first(c, logits_to_keep=True)),
    Case("logits_to_keep", "type", "str", lambda c: first(c, logits_to_keep="1")),
    Case("logits_to_keep", "type", "None", lambda c: first(c, logits_to_keep=None)),
    Case("logits_to_keep", "list", "index list", lambda c: first(c, logits_to_keep=[0, 3])),
    Case("logits_to_keep", "numpy", "index array", lambda c: first(c, logits_to_keep=np.array([1]))),
    Case("logits_to_keep", "tensor", "index tensor", lambda c: first(c, logits_to_keep=torch.tensor([0, 3]))),
    # **kwargs: unknown keywords, and known ones with values this drafter cannot honour
    Case(
        "kwargs", "unknown", "cache_position", lambda c: first(c, cache_position=torch.arange(T)), ("cache_position",)
    ),
    Case(
        "kwargs",
        "unknown",
        "inputs_embeds",
        lambda c: first(c, inputs_embeds=torch.zeros(B, T, 64)),
        ("inputs_embeds",),
    ),
    Case(
        "kwargs",
        "unknown",
        "typo attention_masks",
        lambda c: first(c, attention_masks=torch.ones(B, T)),
        ("attention_masks",),
    ),
    Case(
        "kwargs",
        "unsupported",
        "output_hidden_states=True",
        lambda c: first(c, output_hidden_states=True),
        ("output_hidden_states",),
    ),
    Case("kwargs", "unsupported", "return_dict=False", lambda c: first(c, return_dict=False), ("return_dict",)),
]


def cache_of_length(c: Ctx, length) -> LatentKVCache:
    cache = copy_cache(c.cache)
    cache.length = length
    return cache


def full_cache(c: Ctx) -> LatentKVCache:
    cache = copy_cache(c.cache)
    cache.length = MAX_POS  # as if the context had filled every position (contents are never read: refused first)
    cache.latent = cache.latent.new_zeros(B, MAX_POS, cache.latent.shape[-1])
    return cache


# -- draft -----------------------------------------------------------------------------------------

DRAFT_CASES = [
    Case("input_ids", "numpy", "int64 array", lambda c: drafting(c, input_ids=c.ids.numpy())),
    Case("input_ids", "list", "nested list", lambda c: drafting(c, input_ids=c.ids.tolist())),
    Case("input_ids", "dtype", "bool", lambda c: drafting(c, input_ids=c.ids > 3)),
    Case("input_ids", "wrap", "int16", lambda c: drafting(c, input_ids=c.ids.to(torch.int16))),
    Case(
        "input_ids",
        "empty",
        "empty context",
        lambda c: drafting(c, input_ids=c.ids[:, :0], aux_hidden_states=c.aux[:, :0]),
    ),
    Case(
        "input_ids",
        "empty",
        "empty context after a cache",
        lambda c: drafting(
            c, input_ids=c.ids[:, :0], aux_hidden_states=c.aux[:, :0], past_key_values=copy_cache(c.cache)
        ),
    ),
    Case("input_ids", "range", "id = vocab_size", lambda c: drafting(c, input_ids=torch.full_like(c.ids, 300))),
    Case("input_ids", "shape", "1-D context", lambda c: drafting(c, input_ids=c.ids[0])),
    Case("aux_hidden_states", "missing", "None", lambda c: drafting(c, aux_hidden_states=None)),
    Case("aux_hidden_states", "numpy", "float32 array", lambda c: drafting(c, aux_hidden_states=c.aux.numpy())),
    Case("aux_hidden_states", "list", "nested list", lambda c: drafting(c, aux_hidden_states=c.aux.tolist())),
    Case("aux_hidden_states", "dtype", "float16", lambda c: drafting(c, aux_hidden_states=c.aux.half())),
    Case("aux_hidden_states", "shape", "one state short", lambda c: drafting(c, aux_hidden_states=c.aux[..., :96])),
    Case(
        "aux_hidden_states",
        "nonfinite",
        "NaN",
        lambda c: drafting(c, aux_hidden_states=torch.full_like(c.aux, float("nan"))),
    ),
    Case("num_tokens", "range", "0", lambda c: drafting(c, num_tokens=0)),
    Case("num_tokens", "range", "-1", lambda c: drafting(c, num_tokens=-1)),
    Case("num_tokens", "type", "float 2.0", lambda c: drafting(c, num_tokens=2.0)),
    Case("num_tokens", "type", "float 2.5", lambda c: drafting(c, num_tokens=2.5)),
    Case("num_tokens", "type", "bool", lambda c: drafting(c, num_tokens=True)),
    Case("num_tokens", "type", "str", lambda c: drafting(c, num_tokens="3")),
    Case("num_tokens", "type", "None", lambda c: drafting(c, num_tokens=None)),
    Case("num_tokens", "tensor", "tensor", lambda c: drafting(c, num_tokens=torch.tensor(2))),
    Case("num_tokens", "numpy", "numpy float", lambda c: drafting(c, num_tokens=np.float64(2))),
    Case("temperature", "range", "negative", lambda c: drafting(c, temperature=-0.5)),
    Case("temperature", "range", "-0.0 is 0, but -1e-9 is negative", lambda c: drafting(c, temperature=-1e-9)),
    Case("temperature", "nonfinite", "NaN", lambda c: drafting(c, temperature=float("nan"))),
    Case("temperature", "nonfinite", "inf", lambda c: drafting(c, temperature=float("inf"))),
    Case("temperature", "type", "str", lambda c: drafting(c, temperature="0.7")),
    Case("temperature", "type", "None", lambda c: drafting(c, temperature=None)),
    Case("temperature", "type", "bool", lambda c: drafting(c, temperature=True)),
    Case("temperature", "tensor", "tensor", lambda c: drafting(c, temperature=torch.tensor(0.7))),
    Case("top_p", "range", "0", lambda c: drafting(c, temperature=0.7, top_p=0.0)),
    Case("top_p", "range", "1.5", lambda c: drafting(c, temperature=0.7, top_p=1.5)),
    Case("top_p", "range", "negative, even when greedy", lambda c: drafting(c, top_p=-0.1)),
    Case("top_p", "nonfinite", "NaN", lambda c: drafting(c, temperature=0.7, top_p=float("nan"))),
    Case("top_p", "type", "str", lambda c: drafting(c, top_p="0.9")),
    Case("top_p", "type", "None", lambda c: drafting(c, top_p=None)),
    Case("sampling_backend", "type", "a device name", lambda c: drafting(c, sampling_backend="cuda")),
    Case("sampling_backend", "type", "None", lambda c: drafting(c, sampling_backend=None)),
    Case("sampling_backend", "type", "upper case", lambda c: drafting(c, sampling_backend="FlashInfer")),
    Case("generator", "type", "int seed", lambda c: drafting(c, temperature=0.7, generator=0)),
    Case(
        "generator",
        "numpy",
        "numpy Generator",
        lambda c: drafting(c, temperature=0.7, generator=np.random.default_rng(0)),
    ),
    Case("past_key_values", "kind", "DynamicCache", lambda c: drafting(c, past_key_values=DynamicCache())),
    Case("past_key_values", "batch", "batch-1 cache", lambda c: drafting(c, past_key_values=batch1_cache(c))),
    Case(
        "past_key_values",
        "batch",
        "batch-2 cache, batch-1 context",
        lambda c: drafting(c, input_ids=c.ids[:1], aux_hidden_states=c.aux[:1], past_key_values=copy_cache(c.cache)),
    ),
    Case(
        "past_key_values",
        "drafter",
        "kv_lora_rank 16",
        lambda c: drafting(c, past_key_values=other_cache(c, kv_lora_rank=16)),
    ),
    Case(
        "past_key_values",
        "drafter",
        "same dims, plain rope",
        lambda c: drafting(c, past_key_values=other_cache(c, rope_parameters={"rope_type": "default"})),
    ),
    Case("position_ids", "numpy", "int64 array", lambda c: drafting(c, position_ids=np.arange(T)[None])),
    Case("position_ids", "list", "list", lambda c: drafting(c, position_ids=[list(range(T))])),
    Case(
        "position_ids", "dtype", "float", lambda c: drafting(c, position_ids=torch.arange(T, dtype=torch.float64)[None])
    ),
    Case("position_ids", "shape", "one position short", lambda c: drafting(c, position_ids=torch.arange(T - 1)[None])),
    Case(
        "position_ids",
        "range",
        "drafting past the last position",
        lambda c: drafting(c, position_ids=torch.arange(MAX_POS - T, MAX_POS)[None]),
    ),
    Case(
        "position_ids",
        "range",
        "implicit, cache nearly full",
        lambda c: drafting(c, past_key_values=nearly_full_cache(c)),
        ("position_ids", "input_ids"),
    ),
    *[
        Case(
            "past_key_values",
            "length",
            f"length {label} (set by hand)",
            lambda c, n=n: drafting(c, past_key_values=cache_of_length(c, n)),
        )
        for label, n in LENGTHS
    ],
]


def layout_cases(method: str, call: Callable, arguments: dict[str, Callable[[Ctx], torch.Tensor]]) -> list[Case]:
    """Kind ``layout``, generated for every tensor argument: the right values in a sparse COO tensor (and CSR
    for 2-D ones), a quantized tensor for the float states. Refused by name (not a raw NotImplementedError
    from the value checks)."""
    cases = []
    for argument, good in arguments.items():
        makers = [("sparse COO", lambda t: t.to_sparse())]
        if argument in ("input_ids", "position_ids", "attention_mask"):
            makers.append(("sparse CSR", lambda t: t.to_sparse_csr()))
        if argument in ("aux_hidden_states", "hidden_states"):
            makers.append(("quantized qint8", lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8)))
        for label, make in makers:
            cases.append(
                Case(
                    argument,
                    "layout",
                    f"{label} ({method})",
                    lambda c, a=argument, g=good, m=make: call(c, **{a: m(g(c))}),
                )
            )
    return cases


FORWARD_CASES += layout_cases(
    "forward",
    first,
    {
        "input_ids": lambda c: c.ids,
        "aux_hidden_states": lambda c: c.aux,
        "position_ids": lambda c: torch.arange(T).expand(B, T).contiguous(),
        "attention_mask": lambda c: torch.ones(B, T, dtype=torch.long),
    },
)
FORWARD_CASES += layout_cases("forward", decode, {"hidden_states": lambda c: c.state})
DRAFT_CASES += layout_cases(
    "draft",
    drafting,
    {
        "input_ids": lambda c: c.ids,
        "aux_hidden_states": lambda c: c.aux,
        "position_ids": lambda c: torch.arange(T).expand(B, T).contiguous(),
    },
)


def nearly_full_cache(c: Ctx) -> LatentKVCache:
    cache = full_cache(c)
    cache.length = MAX_POS - T  # the context fits (positions up to 4095); the second drafted token would not
    return cache


# The classes of bad values each argument must be tried with (an argument not listed here, e.g. a new
# one, needs at least one case of any class).
REQUIRED = {
    "forward": {
        "input_ids": {"type", "numpy", "list", "dtype", "wrap", "shape", "empty", "range", "device", "layout"},
        "aux_hidden_states": {"type", "numpy", "list", "dtype", "shape", "nonfinite", "device", "layout"},
        "hidden_states": {"type", "numpy", "list", "dtype", "shape", "nonfinite", "layout"},
        "position_ids": {"type", "numpy", "list", "dtype", "wrap", "shape", "empty", "range", "device", "layout"},
        "past_key_values": {"kind", "numpy", "list", "batch", "drafter", "dtype", "device", "use_cache", "length"},
        "attention_mask": {"type", "numpy", "list", "dtype", "shape", "empty", "range", "device", "layout"},
        "use_cache": {"type"},
        "absorb": {"type", "numpy"},
        "check_values": {"type"},
        "logits_to_keep": {"type", "range", "list", "numpy", "tensor"},
        "kwargs": {"unknown", "unsupported"},
    },
    "draft": {
        "input_ids": {"numpy", "list", "dtype", "wrap", "shape", "empty", "range", "layout"},
        "aux_hidden_states": {"missing", "numpy", "list", "dtype", "shape", "nonfinite", "layout"},
        "num_tokens": {"type", "range", "tensor", "numpy"},
        "temperature": {"type", "range", "nonfinite", "tensor"},
        "top_p": {"type", "range", "nonfinite"},
        "generator": {"type", "numpy"},
        "sampling_backend": {"type"},
        "past_key_values": {"kind", "batch", "drafter"},
        "position_ids": {"numpy", "list", "dtype", "shape", "range", "layout"},
    },
}


def case_id(case: Case) -> str:
    return f"{case.argument}-{case.kind}-{case.label}"


def arguments(method) -> list[str]:
    params = inspect.signature(method).parameters.values()
    return [p.name for p in params if p.name != "self"]


def coverage_gaps(method: str, names: list[str], cases: list[Case]) -> list[str]:
    """What the corpus lacks for a method with these argument names (empty: fully covered)."""
    covered: dict[str, set[str]] = {}
    for case in cases:
        covered.setdefault(case.argument, set()).add(case.kind)
    gaps = [f"{name}: no bad-value cases" for name in names if name not in covered]
    gaps += [f"{name}: cases for an argument {method} does not have" for name in set(covered) - set(names)]
    for name in set(names) & set(covered):
        untried = REQUIRED[method].get(name, set()) - covered[name]
        gaps += [f"{name}: classes {sorted(untried)} untried"] if untried else []
    return gaps


@pytest.mark.parametrize("method, cases", [("forward", FORWARD_CASES), ("draft", DRAFT_CASES)])
def test_every_argument_has_bad_values(method, cases):
    """A new argument of forward/draft fails here until this corpus tries bad values for it."""
    assert not coverage_gaps(method, arguments(getattr(Eagle31MLAForCausalLM, method)), cases)


def test_a_new_argument_without_cases_is_caught():
    def forward(self, input_ids, new_switch=False, **kwargs): ...

    gaps = coverage_gaps("forward", arguments(forward), FORWARD_CASES)
    assert "new_switch: no bad-value cases" in gaps


def check_refusal(err: DraftInputError, case: Case) -> None:
    message = str(err)
    names = case.names or (case.argument,)
    assert any(f"`{n}`" in message for n in names), f"message names none of {names}: {message}"
    assert "expected" in message, f"message does not say what was expected: {message}"
    same = re.search(r"has shape (\(.*?\)); expected (\(.*?\))", message)
    assert not same or same.group(1) != same.group(2), f"the message contradicts itself: {message}"


def snapshot(kwargs: dict):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, LatentKVCache) and cache.latent is not None and cache.latent.device.type != "meta":
        return cache, cache.length, cache.latent.clone().view(torch.uint8)
    return None


def assert_untouched(snap) -> None:
    if snap is not None:
        cache, length, latent = snap
        assert cache.length == length
        assert torch.equal(
            cache.latent.view(torch.uint8), latent
        )  # a refused call wrote nothing (bytes compared: NaN-safe)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
def test_forward_refuses(ctx, case):
    kwargs = case.call(ctx)
    snap = snapshot(kwargs)
    with pytest.raises(DraftInputError) as err:
        ctx.model(**kwargs)
    assert type(err.value) is DraftInputError  # this project's check, not a raw torch error
    check_refusal(err.value, case)
    assert_untouched(snap)


@pytest.mark.parametrize("case", DRAFT_CASES, ids=case_id)
def test_draft_refuses(ctx, case):
    kwargs = case.call(ctx)
    snap = snapshot(kwargs)
    with pytest.raises(DraftInputError) as err:
        ctx.model.draft(**kwargs)
    assert type(err.value) is DraftInputError
    check_refusal(err.value, case)
    assert_untouched(snap)


def test_the_valid_base_calls_run(ctx):
    """Each corpus case changes one thing of these calls, which succeed as they are."""
    for kwargs in (
        first(ctx),
        decode(ctx),
        first(ctx, position_ids=torch.arange(T, dtype=torch.int32)[None]),
        first(ctx, input_ids=ctx.ids.int(), attention_mask=torch.ones(B, T, dtype=torch.uint8)),
        first(ctx, return_dict=True, output_attentions=False),
        first(ctx, logits_to_keep=np.int64(2)),
    ):
        assert ctx.model(**kwargs).logits.shape[0] == B
    assert ctx.model.draft(**drafting(ctx, temperature=-0.0, num_tokens=np.int64(2))).tokens.shape == (B, 2)
    out = ctx.model.draft(
        **drafting(ctx, past_key_values=copy_cache(ctx.cache), position_ids=torch.arange(T, 2 * T)[None])
    )
    assert out.past_key_values.get_seq_length() == 2 * T + 1


def test_int32_ids_and_positions_give_the_int64_result(ctx):
    """int32 is accepted (the embedding takes it): same kernels, same shapes, so the same bits."""
    a = ctx.model(ctx.ids, aux_hidden_states=ctx.aux, position_ids=torch.arange(T)[None])
    b = ctx.model(ctx.ids.int(), aux_hidden_states=ctx.aux, position_ids=torch.arange(T, dtype=torch.int32)[None])
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize(
    "temperature, top_p, name",
    [
        (-1.0, 1.0, "temperature"),
        (float("nan"), 1.0, "temperature"),
        (float("-inf"), 1.0, "temperature"),
        ("0.5", 1.0, "temperature"),
        (None, 1.0, "temperature"),
        (0.5, 0.0, "top_p"),
        (0.5, 1.01, "top_p"),
        (0.5, float("nan"), "top_p"),
        (0.0, -1.0, "top_p"),
        (0.5, None, "top_p"),
    ],
)
def test_check_sampling_settings(temperature, top_p, name):
    with pytest.raises(DraftInputError, match=f"`{name}` is .*; expected"):
        check_sampling_settings(temperature, top_p)


def test_check_sampling_settings_accepts_and_normalises():
    assert check_sampling_settings(0, 1) == (0.0, 1.0)
    assert check_sampling_settings(np.float32(0.5), 0.25) == (0.5, 0.25)
    assert isinstance(DraftInputError("x"), ValueError) and isinstance(DraftInputError("x"), TypeError)


# -- LatentKVCache's own constructor arguments ------------------------------------------------------

CACHE_GOOD = {
    "batch_size": 2,
    "kv_lora_rank": 32,
    "rope_dim": 16,
    "dtype": torch.float32,
    "device": "cpu",
    "capacity": 8,
}
CACHE_BAD = [
    *[
        (name, label, value)
        for name in ("batch_size", "kv_lora_rank", "rope_dim", "capacity")
        for label, value in (
            ("0", 0),
            ("-1", -1),
            ("2.5", 2.5),
            ("True", True),
            ("None", None),
            ("str", "2"),
            ("2**31", 2**31),
        )
    ],
    ("dtype", "int64", torch.int64),
    ("dtype", "bool", torch.bool),
    ("dtype", "str", "float32"),
    ("dtype", "None", None),
    ("device", "int list", [0]),
    ("device", "unknown name", "gpu9"),
    ("device", "None", None),
]


@pytest.mark.parametrize("name,label,value", CACHE_BAD, ids=[f"{n}-{label}" for n, label, _ in CACHE_BAD])
def test_cache_constructor_refuses_bad_arguments(name, label, value):
    args = {**CACHE_GOOD, name: value}
    with pytest.raises(DraftInputError, match=f"`{name}`"):
        LatentKVCache(args.pop("batch_size"), args.pop("kv_lora_rank"), args.pop("rope_dim"), **args)


def test_cache_binds_to_its_first_drafter(ctx):
    """A fresh cache binds on first use; a cache another drafter wrote is refused, naming the config difference."""
    fresh = LatentKVCache.for_model(ctx.model.config, B, dtype=torch.float32, device="cpu")
    assert fresh.bound_to() is None
    with torch.no_grad():
        ctx.model(ctx.ids, aux_hidden_states=ctx.aux, past_key_values=fresh)
    assert fresh.bound_to()[0] is ctx.model
    plain = tiny_drafter(seed=21, rope_parameters={"rope_type": "default"})
    with pytest.raises(DraftInputError, match=r"another drafter instance whose config differs: `rope_parameters`"):
        plain(ctx.ids[:, :1], hidden_states=ctx.state, past_key_values=fresh)
    assert LatentKVCache.for_model(ctx.model, B, dtype=torch.float32, device="cpu").bound_to()[0] is ctx.model
