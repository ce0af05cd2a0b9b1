"""The drafter's argument checks, kept apart from the model so that the model file reads as the model.

Every check runs before any compute and before a cache is touched, and raises :class:`DraftInputError` naming the
argument and what was expected: ``forward``'s inputs and cache (:func:`check_forward_inputs`), ``draft``'s count,
sampling settings and generator (:func:`check_draft_arguments`), and the one rule for sampling settings that
``draft``, the reference loop and the CLI share (:func:`check_sampling_settings`). Remote code: torch and the
standard library only, besides this package's configuration.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers

import torch
from torch import nn

from .configuration_eagle31_mla import ConfigError, not_a_regular_file, read_config_file, resolve_dtype

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DraftInputError",
    "SAMPLING_BACKENDS",
    "check_cache",
    "check_cache_arguments",
    "check_cache_owner",
    "check_config_file",
    "check_draft_arguments",
    "check_forward_inputs",
    "check_loading_arguments",
    "check_sampling_backend",
    "check_sampling_settings",
    "config_differences",
    "describe_value",
]


class DraftInputError(ValueError, TypeError):
    """A call argument this library refuses, raised before any compute: the message names the argument
    and what was expected. Both a ValueError and a TypeError, so either ``except`` catches it."""


def _type_name(value) -> str:
    """``list``, ``numpy.ndarray``, ``torch.Tensor``, ``transformers.DynamicCache``: the type as users know it."""
    kind = type(value)
    return (
        kind.__qualname__ if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "." + kind.__qualname__
    )


def describe_value(value) -> str:
    """A refused value for a message: its type, and its repr when short."""
    kind = _type_name(value)
    if isinstance(value, torch.Tensor):
        return f"a {kind} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{text} ({kind})" if len(text) <= 40 else f"a {kind}"


def _expect_tensor(name: str, value, expected: str) -> None:
    if not isinstance(value, torch.Tensor):
        hint = (
            " (convert it with torch.as_tensor, on the drafter's device)"
            if isinstance(value, (list, tuple)) or hasattr(value, "__array__")
            else ""
        )
        raise DraftInputError(f"`{name}` is {describe_value(value)}; expected {expected} as a torch.Tensor{hint}")
    kind = _unusual_tensor(value)
    if kind:
        raise DraftInputError(
            f"`{name}` is {kind}; expected {expected} as a dense (strided) torch.Tensor "
            "(convert it with `.to_dense()` / `.dequantize()` first)"
        )


def _unusual_tensor(value: torch.Tensor) -> str | None:
    """What a tensor is when it is not a plain dense one (sparse or another non-strided layout, nested,
    quantized, a tensor subclass); None for a plain strided tensor. The checks read values and shapes of
    plain tensors only: anything else would raise a raw NotImplementedError from them."""
    if value.layout != torch.strided:
        return f"a tensor of layout {value.layout} (not dense)"
    if getattr(value, "is_nested", False):
        return "a nested tensor"
    if value.is_quantized:
        return f"a quantized tensor (dtype {value.dtype})"
    if type(value) not in (torch.Tensor, nn.Parameter):
        return f"a {_type_name(value)} (a torch.Tensor subclass)"
    return None


def _expect_index_dtype(name: str, value: torch.Tensor, what: str) -> None:
    """Token ids and positions: int64 or int32 (what the embedding takes). Narrower ones (bool, uint8,
    int8, int16) are refused: they wrap inside range checks, or cannot hold a 163,840-token vocabulary."""
    if value.dtype not in (torch.int64, torch.int32):
        raise DraftInputError(
            f"`{name}` has dtype {value.dtype}; expected int64 (or int32) {what} (cast with `.long()`; "
            "bool and narrower integers are refused: they wrap or cannot hold every id)"
        )


# ---- forward ---------------------------------------------------------------------------------------------------------


def check_forward_inputs(
    model,
    input_ids,
    aux_hidden_states,
    hidden_states,
    position_ids,
    values: bool = True,
    *,
    past_key_values=None,
    attention_mask=None,
    use_cache=None,
    absorb=None,
    logits_to_keep=0,
    extra=None,
) -> None:
    """Refuse, with an :class:`DraftInputError` (ValueError and TypeError) naming the argument and what
    was expected, before any compute and before the cache is touched: a non-tensor (a numpy array or
    a list is refused, never converted), the wrong shape, dtype (floats must be the drafter's dtype:
    no silent cast; ids and positions int64 or int32) or device; no tokens; a cache of another kind,
    batch size, drafter (kv_lora_rank, rope dims), dtype or device, or a cache with use_cache=False;
    switches that are not bools; ``logits_to_keep`` not an int in [0, T]; unknown keywords. Then the
    values, in one pass and one host sync: token ids outside the vocabulary; positions outside
    [0, max_position_embeddings); NaN or inf in the states (they would spread into every draft); a
    2-D mask holding anything but 0/1. Value checks are skipped with ``values=False`` and while
    torch.compile traces (they need a host sync)."""
    config = model.config
    dtype, device = model.fc.weight.dtype, model.fc.weight.device
    for key, value in (extra or {}).items():
        if key not in model.IGNORED_KEYWORDS:
            hint = " (pass `position_ids`)" if key == "cache_position" else ""
            raise DraftInputError(
                f"`{key}` is not an argument of this drafter's forward{hint}; expected one of "
                f"{[n for n in inspect.signature(model.forward).parameters if n != 'kwargs']}"
            )
        if not any(value is ok for ok in model.IGNORED_KEYWORDS[key]):
            raise DraftInputError(
                f"`{key}` is {value!r}; expected one of {model.IGNORED_KEYWORDS[key]} (not supported)"
            )
    for name, (optional, what) in model.FLAG_ARGUMENTS.items():
        value = {"use_cache": use_cache, "absorb": absorb, "check_values": values}[name]
        if not (isinstance(value, bool) or (optional and value is None)):
            raise DraftInputError(f"`{name}` is {describe_value(value)}; expected {what}")
    if (aux_hidden_states is None) == (hidden_states is None):
        raise DraftInputError(
            "pass exactly one of `aux_hidden_states` (first draft step: [B, T, n·Ht] captured target states) "
            "or `hidden_states` (later steps: [B, T, H] from the previous step); expected one, got "
            + ("neither" if aux_hidden_states is None else "both")
        )
    _expect_tensor("input_ids", input_ids, "a [B, T] tensor of token ids")
    if input_ids.dim() != 2:
        raise DraftInputError(
            f"`input_ids` must be a [B, T] tensor of token ids, got shape {tuple(input_ids.shape)}; expected 2 dims"
        )
    _expect_index_dtype("input_ids", input_ids, "token ids")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise DraftInputError(
            f"`input_ids` has shape {(B, T)}; expected at least one sequence and one token (B, T >= 1)"
        )
    if aux_hidden_states is not None:
        name, given, width = (
            "aux_hidden_states",
            aux_hidden_states,
            config.num_aux_hidden_states * config.target_hidden_size,
        )
        what = f"{config.num_aux_hidden_states} aux states × target_hidden_size {config.target_hidden_size}"
    else:
        name, given, width, what = "hidden_states", hidden_states, config.hidden_size, "hidden_size"
    _expect_tensor(name, given, f"a [B, T, {width}] tensor ({what})")
    if given.shape != (B, T, width):
        raise DraftInputError(f"`{name}` has shape {tuple(given.shape)}; expected {(B, T, width)} ({what})")
    if not given.is_floating_point():
        raise DraftInputError(f"`{name}` has dtype {given.dtype}; expected a floating-point tensor ({dtype})")
    if given.dtype != dtype:
        raise DraftInputError(
            f"`{name}` has dtype {given.dtype}; expected {dtype}, the drafter's dtype (cast with `.to({dtype})`)"
        )
    if position_ids is not None:
        _expect_tensor("position_ids", position_ids, f"a [B, T] = [{B}, {T}] (or [1, {T}]) tensor of positions")
        if position_ids.dim() != 2 or position_ids.shape[-1] != T or position_ids.shape[0] not in (1, B):
            raise DraftInputError(
                f"`position_ids` has shape {tuple(position_ids.shape)}; expected {(B, T)} or {(1, T)}"
            )
        _expect_index_dtype("position_ids", position_ids, "positions")

    if past_key_values is not None:
        check_cache(model, past_key_values, B, use_cache)
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    S = past + T
    if position_ids is None and S > config.max_position_embeddings:
        raise DraftInputError(
            f"`input_ids`: the cache holds {past} tokens, so these {T} new token(s) take "
            f"positions up to {S - 1}, beyond "
            f"max_position_embeddings {config.max_position_embeddings}; expected at most "
            f"{config.max_position_embeddings - past} new token(s)"
        )
    if attention_mask is not None:
        _expect_tensor(
            "attention_mask", attention_mask, f"a [B, S] = {(B, S)} tensor of 0/1 or a [B, 1, T, S] bool tensor"
        )
        if attention_mask.dim() == 2:
            if attention_mask.shape != (B, S):
                raise DraftInputError(
                    f"`attention_mask` has shape {tuple(attention_mask.shape)}; expected {(B, S)} "
                    f"([B, cached + new tokens], 1 = real token)"
                )
            if attention_mask.is_floating_point() or attention_mask.is_complex():
                raise DraftInputError(
                    f"`attention_mask` has dtype {attention_mask.dtype}; expected bool or integer 0/1 "
                    "(1 = real token; an additive float mask would be read the wrong way round)"
                )
        elif attention_mask.shape != (B, 1, T, S) or attention_mask.dtype != torch.bool:
            raise DraftInputError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}; "
                f"expected a 2-D {(B, S)} 0/1 mask or a 4-D bool mask of shape {(B, 1, T, S)} (True = attend)"
            )
    if (
        not isinstance(logits_to_keep, numbers.Integral)
        or isinstance(logits_to_keep, bool)
        or not 0 <= logits_to_keep <= T
    ):
        raise DraftInputError(
            f"`logits_to_keep` is {describe_value(logits_to_keep)}; expected an int in [0, {T}] "
            "(0 = logits at every position, N = the last N)"
        )
    for arg, value in (
        ("input_ids", input_ids),
        (name, given),
        ("position_ids", position_ids),
        ("attention_mask", attention_mask),
    ):
        if value is not None and value.device != device:
            raise DraftInputError(f"`{arg}` is on {value.device}; expected the drafter's device {device}")
    if not values or torch.compiler.is_compiling():
        return  # value checks need a host sync, which would break a compiled graph / CUDA graph
    # Values: one pass over each input, one device sync for all of them.
    checks = [torch.isfinite(given).all(), ((input_ids >= 0) & (input_ids < config.vocab_size)).all()]
    if position_ids is not None:
        checks.append(((position_ids >= 0) & (position_ids < config.max_position_embeddings)).all())
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.dtype != torch.bool:
        checks.append(((attention_mask == 0) | (attention_mask == 1)).all())
    finite, ids_ok, *rest = torch.stack(checks).tolist()
    if not finite:
        source = "the target's captured layers" if name == "aux_hidden_states" else "the previous draft step"
        raise DraftInputError(
            f"`{name}` holds {int((~torch.isfinite(given)).sum())} non-finite value(s) (NaN or inf); expected "
            f"finite values (they come from {source}: look for an overflow there, e.g. in fp16)"
        )
    if not ids_ok:
        raise DraftInputError(
            f"`input_ids` hold ids in [{int(input_ids.min())}, {int(input_ids.max())}]; expected ids in "
            f"[0, {config.vocab_size}) (vocab_size, the target's vocabulary)"
        )
    if position_ids is not None and not rest.pop(0):
        low, high = int(position_ids.min()), int(position_ids.max())
        raise DraftInputError(
            f"`position_ids` reach {high if high >= config.max_position_embeddings else low}, "
            + (
                f"beyond max_position_embeddings {config.max_position_embeddings}"
                if high >= config.max_position_embeddings
                else "below 0"
            )
            + f" (expected positions in [0, {config.max_position_embeddings}))"
        )
    if rest and not rest.pop(0):
        raise DraftInputError(
            "`attention_mask` holds values other than 0 and 1 (e.g. "
            f"{sorted(set(attention_mask.unique().tolist()))[:5]}); "
            "expected 1 = real token, 0 = padding"
        )


def check_cache(model, cache, batch_size: int, use_cache) -> None:
    """A cache must be this drafter's kind, for this batch and drafter, in its dtype and on its
    device: a cache of another batch size would have its rows overwritten or misread silently."""
    config = model.config
    if not isinstance(cache, model.cache_class):
        raise DraftInputError(
            f"`past_key_values` is a {_type_name(cache)}; expected this drafter's LatentKVCache "
            "(from a previous call's "
            "`past_key_values`, or `LatentKVCache.for_model`), or None"
        )
    if use_cache is False:
        raise DraftInputError(
            "`past_key_values` was given with use_cache=False; expected use_cache=True or None to read "
            "and extend the cache, or no cache"
        )
    latent = cache.latent
    if latent is None:  # an empty cache that allocates on first use (training's ConcatKVCache)
        check_cache_owner(model, cache)
        return
    length, capacity = cache.get_seq_length(), latent.shape[1] if latent.dim() == 3 else 0
    if not isinstance(length, numbers.Integral) or isinstance(length, bool) or not 0 <= length <= capacity:
        raise DraftInputError(
            "`past_key_values` has length "
            f"{describe_value(length) if not isinstance(length, numbers.Integral) else length}, "
            f"outside [0, {capacity}] (its capacity); expected a cache whose length only the drafter's calls and "
            "`crop` changed (a cache edited by hand would be read wrongly)"
        )
    rank = cache.kv_lora_rank if cache.kv_lora_rank is not None else latent.shape[-1] - config.qk_rope_head_dim
    rope = latent.shape[-1] - rank
    problems = []
    if latent.shape[0] != batch_size:
        problems.append(
            f"batch size {latent.shape[0]} (these inputs have batch size {batch_size}: a cache holds one row "
            "per sequence)"
        )
    if (rank, rope) != (config.kv_lora_rank, config.qk_rope_head_dim):
        problems.append(
            f"kv_lora_rank {rank} + rope dim {rope} per token (this drafter: kv_lora_rank "
            f"{config.kv_lora_rank} + qk_rope_head_dim {config.qk_rope_head_dim}; a cache of another drafter)"
        )
    if latent.dtype != model.fc.weight.dtype:
        problems.append(f"dtype {latent.dtype} (this drafter: {model.fc.weight.dtype})")
    if latent.device != model.fc.weight.device:
        problems.append(f"device {latent.device} (this drafter: {model.fc.weight.device})")
    if problems:
        raise DraftInputError(
            "`past_key_values` does not fit: it has " + "; ".join(problems) + "; expected a cache built "
            "for these inputs by this drafter (or None)"
        )
    check_cache_owner(model, cache)


def check_cache_owner(model, cache) -> None:
    """A cache is bound to the drafter that wrote it first (:meth:`LatentKVCache.bind`): another drafter, even
    of the same dims, would read keys normalised with other weights and rotated under another rope schedule."""
    config = model.config
    bound = cache.bound_to() if hasattr(cache, "bound_to") else None
    if bound is not None and bound[0] is not model:
        owner, owner_config = bound
        differs = config_differences(owner_config, config) if owner_config is not None else []
        what = "another drafter (since deleted)" if owner is None else "another drafter instance"
        raise DraftInputError(
            f"`past_key_values` was written by {what}"
            + (f" whose config differs: {'; '.join(differs)}" if differs else " (same config, other weights)")
            + "; expected a cache written by this drafter (its c_kv is normalised with the "
            "writer's weights and its "
            "k_pe rotated under the writer's rope schedule), or a fresh one (None, or LatentKVCache.for_model)"
        )


def config_differences(a, b, limit: int = 6) -> list[str]:
    """The settings in which configs ``a`` and ``b`` differ, as ``key a -> b`` (at most ``limit``)."""
    try:
        da, db = a.to_dict(), b.to_dict()
        relevant = {f.name for f in dataclasses.fields(a)}  # every setting: the config's dataclass fields
    except Exception:  # pragma: no cover - a config that cannot be written out: say nothing
        return []
    keys = [k for k in sorted(relevant) if da.get(k) != db.get(k)]
    shown = [f"`{k}` {str(da.get(k))[:80]} (writer) vs {str(db.get(k))[:80]} (this drafter)" for k in keys[:limit]]
    return shown + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def check_cache_arguments(batch_size, kv_lora_rank, rope_dim, capacity, dtype, device, max_size: int) -> torch.device:
    """``LatentKVCache``'s sizes (ints in [1, max_size]), dtype (floating) and device; returns the device."""
    for name, value in (
        ("batch_size", batch_size),
        ("kv_lora_rank", kv_lora_rank),
        ("rope_dim", rope_dim),
        ("capacity", capacity),
    ):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 1 <= value <= max_size:
            raise DraftInputError(
                f"LatentKVCache `{name}` is {describe_value(value)}; expected an int >= 1 and <= {max_size}"
            )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DraftInputError(
            f"LatentKVCache `dtype` is {describe_value(dtype)}; expected a floating-point torch.dtype "
            "(the drafter's, e.g. torch.bfloat16)"
        )
    try:
        device = torch.device(device)
    except (TypeError, ValueError, RuntimeError):
        raise DraftInputError(
            f"LatentKVCache `device` is {describe_value(device)}; expected a torch.device or a device "
            "name such as 'cpu' or 'cuda:0' (the drafter's)"
        ) from None
    return device


# ---- loading ---------------------------------------------------------------------------------------------------------

#: The ``attn_implementation`` values ``from_pretrained`` accepts: none given, "eager" (the model's own
#: attention code, what Transformers reports for a model that claims no other), or "flashinfer" (decode steps
#: through FlashInfer's MLA kernel on CUDA: the library's ``[gpu]`` extra, not in the Hub remote code).
ATTN_IMPLEMENTATIONS = (None, "eager", "flashinfer")


def check_loading_arguments(class_name, model_args, kwargs, device, dtype, torch_dtype):
    """``from_pretrained``'s arguments, checked before any download: Transformers' keywords that change nothing
    here, ``attn_implementation``, ``device_map`` as a device, and the dtype (a floating dtype by a known name,
    or "auto", the config's). Returns the attention implementation, the device and the dtypes asked for."""
    if model_args:
        raise TypeError(f"unexpected positional arguments {model_args!r}")
    ignored = {
        "trust_remote_code",
        "code_revision",
        "_from_auto",
        "_commit_hash",
        "adapter_kwargs",
        "_from_pipeline",
        "subfolder",
        "use_safetensors",
        "low_cpu_mem_usage",
        "attn_implementation",
    }
    unknown = set(kwargs) - ignored
    attn_implementation = kwargs.get("attn_implementation")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"`attn_implementation` is {attn_implementation!r}; expected one of {ATTN_IMPLEMENTATIONS} "
            "(this drafter's MLA attention is its own code: naive for a prompt, absorbed over the latent cache "
            "for decode, whose one-token steps 'flashinfer' runs through FlashInfer on CUDA; there is no sdpa "
            "or flash-attention variant to switch to)"
        )
    if (
        kwargs.get("device_map") is not None
        and device is None
        and isinstance(kwargs["device_map"], (str, torch.device))
    ):
        device = kwargs["device_map"]
        unknown.discard("device_map")
    if unknown:
        raise TypeError(f"{class_name}.from_pretrained got unsupported arguments {sorted(unknown)}")
    # checked before any download: a floating dtype by a known name, or "auto" (the config's)
    wanted = {
        "dtype": resolve_dtype(dtype, "dtype", allow_auto=True),
        "torch_dtype": resolve_dtype(torch_dtype, "torch_dtype", allow_auto=True),
    }
    if dtype is not None and torch_dtype is not None and wanted["dtype"] != wanted["torch_dtype"]:
        shown = {k: str(v).removeprefix("torch.") if v is not None else "auto" for k, v in wanted.items()}
        raise ConfigError(
            f"from_pretrained got two dtypes: `dtype` {shown['dtype']!r} and `torch_dtype` "
            f"{shown['torch_dtype']!r}; "
            "they must agree (keep one: `dtype`, the Transformers-5 name)"
        )
    return attn_implementation, device, wanted


def check_config_file(folder) -> None:
    """The drafter's ``config.json`` next to its weights: a regular file (never opened otherwise: a FIFO would
    block, a device would never end), present, and readable JSON (null, not JSON, too deep, a dangling link:
    refused by name)."""
    config_file = folder / "config.json"
    kind = not_a_regular_file(config_file)
    if kind:
        raise ConfigError(f"{config_file} is {kind}; expected a regular file (the drafter's config.json)")
    if not config_file.is_file() and not config_file.is_symlink():
        raise ConfigError(f"{folder} has no config.json (the drafter's settings; expected next to the weights)")
    read_config_file(config_file)


# ---- draft and sampling ----------------------------------------------------------------------------------------------


def check_draft_arguments(
    model, num_tokens, temperature, top_p, generator, aux_hidden_states, sampling_backend
) -> None:
    """What ``draft`` checks before ``forward``'s checks of the context: the count, sampling settings and generator."""
    if not isinstance(num_tokens, numbers.Integral) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise DraftInputError(f"`num_tokens` is {describe_value(num_tokens)}; expected an int >= 1 (tokens to draft)")
    check_sampling_settings(temperature, top_p)
    check_sampling_backend(sampling_backend)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise DraftInputError(f"`generator` is {describe_value(generator)}; expected a torch.Generator or None")
        if generator.device.type != model.fc.weight.device.type:
            raise DraftInputError(
                f"`generator` is on {generator.device}; expected one on the drafter's device "
                f"({model.fc.weight.device.type})"
            )
    if aux_hidden_states is None:
        raise DraftInputError(
            "`aux_hidden_states` is None; expected the [B, T, n·Ht] captured target states of the context"
        )


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling_settings(temperature, top_p) -> tuple[float, float]:
    """The one rule for sampling settings, shared by ``draft``, ``speculative_generate``,
    ``measure_acceptance`` and the CLI: ``temperature`` a finite number >= 0 (0 = greedy, the argmax;
    a negative temperature is refused, never read as greedy), ``top_p`` a number in (0, 1]. Returns
    both as floats; raises :class:`DraftInputError` (a ValueError) naming the argument and what was expected."""
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise DraftInputError(f"`temperature` is {temperature!r}; expected a finite number >= 0 (0 = greedy decoding)")
    if not _is_real(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise DraftInputError(f"`top_p` is {top_p!r}; expected a number in (0, 1] (1 = no truncation)")
    return float(temperature), float(top_p)


#: Who samples: "torch" (this file's rule and ``torch.multinomial``) or "flashinfer" (FlashInfer's top-p
#: renormalisation and draws on CUDA: :mod:`eagle31_mla.model.flashinfer_backend`, the ``[gpu]`` extra).
SAMPLING_BACKENDS = ("torch", "flashinfer")


def check_sampling_backend(backend) -> str:
    """``backend`` one of :data:`SAMPLING_BACKENDS`, else :class:`DraftInputError` naming ``sampling_backend``."""
    if not isinstance(backend, str) or backend not in SAMPLING_BACKENDS:
        raise DraftInputError(f"`sampling_backend` is {describe_value(backend)}; expected one of {SAMPLING_BACKENDS}")
    return backend
