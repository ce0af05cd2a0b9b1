"""The EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`) in PyTorch/Transformers.

One DeepSeek-style Multi-head Latent Attention decoder layer drafts tokens for Kimi-K3 from three of
its residual-stream states. EAGLE-3.1 adds two switches to EAGLE-3: ``fc_norm`` (an RMSNorm per
captured state before ``fc``) and ``norm_output`` (the next draft step is fed ``norm(h)``, not ``h``).
MLA keeps the draft KV cache small: per token only the normalised latent ``c_kv`` (512) and the
rotated shared rope key ``k_pe`` (64) are stored, 1,152 bytes in bf16.

Module names are the published tensor names, so the checkpoint loads with no renaming; other
layouts (``midlayer.*``, a ``model.`` prefix, pruned vocabularies) are read by
:mod:`checkpoint_eagle31_mla`, which finds, checks and loads the files.

Symbols in shape comments: B batch, T new tokens, S cached + new tokens, H hidden, Ht target hidden,
n aux states, h heads, C kv_lora_rank (512), R qk_rope_head_dim (64), N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from .checkpoint_eagle31_mla import load_checkpoint_state, resolve_model_folder
from .configuration_eagle31_mla import Eagle31MLAConfig, resolve_dtype, rope_frequencies
from .sampling_eagle31_mla import flashinfer_backend, sample_from_logits
from .validation_eagle31_mla import (
    SAMPLING_BACKENDS,
    DraftInputError,
    check_cache_arguments,
    check_config_file,
    check_draft_arguments,
    check_forward_inputs,
    check_loading_arguments,
    check_sampling_backend,
    check_sampling_settings,
    describe_value,
)

__all__ = [
    "Eagle31MLAForCausalLM",
    "Eagle31MLAOutput",
    "DraftOutput",
    "LatentKVCache",
    "DraftInputError",
    "SAMPLING_BACKENDS",
    "check_sampling_backend",
    "check_sampling_settings",
    "cpu_has_native_bf16",
    "latent_attention_dtype",
    "normalise_aux_chunks",
]

logger = logging.getLogger(__name__)


# ---- Building blocks --------------------------------------------------------------------------


class Eagle31MLALinear(nn.Linear):
    """nn.Linear whose one-token product on CPU uses the matrix-vector kernel, which streams the
    weight 1.3-1.7x faster there than the matrix-matrix path (a draft step is such products)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and self.bias is None and x.numel() == x.shape[-1]:
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


class Eagle31MLARMSNorm(nn.Module):
    """RMSNorm with the variance in fp32, cast back to the input dtype before the weight."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Eagle31MLARotaryEmbedding(nn.Module):
    """RoPE frequencies for the rope slice: plain, or YaRN through Transformers' helper."""

    def __init__(self, config: Eagle31MLAConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self._inv_freq(config, device=None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def _inv_freq(config: Eagle31MLAConfig, device) -> tuple[torch.Tensor, float]:
        return rope_frequencies(config, device)  # the computation the config checked at construction

    def reset_inv_freq(self, device: torch.device | str) -> None:
        """Recompute the frequencies after the module was built on the meta device."""
        self.inv_freq = self._inv_freq(self.config, torch.device(device))[0]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, R/2]
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary on adjacent pairs (x0, x1), (x2, x3), ...; x: [B, heads, T, R], cos/sin: [B, T, R/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, heads, T, R/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


#: Whether this CPU computes bf16 natively (AVX-512 BF16, AMX-BF16, Arm BF16). None: detected once, on
#: first use, by :func:`cpu_has_native_bf16`. Set it (tests, benchmarks) to force a path; the
#: environment variable ``EAGLE31_CPU_NATIVE_BF16=0`` / ``=1`` does the same for a whole process.
CPU_NATIVE_BF16: bool | None = None


def _detect_cpu_native_bf16() -> bool:
    env = os.environ.get("EAGLE31_CPU_NATIVE_BF16")
    if env is not None:
        if env not in ("0", "1"):
            raise DraftInputError(f"EAGLE31_CPU_NATIVE_BF16={env!r}; expected 0 (no native bf16) or 1 (native bf16)")
        return env == "1"
    bf16_flags = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")  # x86 AVX-512 / AMX; Arm FEAT_BF16 / SVE
    get_capabilities = getattr(getattr(torch, "cpu", None), "get_capabilities", None)  # torch >= 2.8
    if get_capabilities is not None:
        try:
            capabilities = get_capabilities()
            return any(bool(capabilities.get(flag)) for flag in bf16_flags)
        except Exception:  # pragma: no cover - a cpuinfo failure: fall through to /proc/cpuinfo
            pass
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # pragma: no cover - unknown CPU: keep the model's dtype (the fast path where bf16 is native)
        return True
    return any(flag in flags for flag in bf16_flags)


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has native bf16 arithmetic, decided once per process (see :data:`CPU_NATIVE_BF16`)."""
    global CPU_NATIVE_BF16
    if CPU_NATIVE_BF16 is None:
        CPU_NATIVE_BF16 = _detect_cpu_native_bf16()
    return CPU_NATIVE_BF16


def latent_attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the absorbed attention computes in over the latent cache: the model's, except bf16 on
    a CPU without native bf16 (e.g. AVX2-only), where torch's bf16 matrix kernels run several times
    slower than fp32 ones: there the cache (1,152 bytes a token: under 5 MB at 4k) is converted to fp32
    each step, which costs far less. Weights are never converted: their reads stay streaming in bf16."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return dtype


class LatentKVCache:
    """The drafter's KV cache: per token only normalised c_kv [C] and rotated k_pe [R].

    Both live side by side in one buffer [B, capacity, C+R], so the absorbed attention reads its keys
    ([c_kv | k_pe]) and values (c_kv) as views, with no per-step copy. Storage is preallocated and
    grows by doubling; ``crop`` rolls back rejected draft tokens.
    """

    #: The largest size a constructor argument may give (a batch, a width, a capacity in tokens).
    MAX_SIZE = 2**31 - 1

    def __init__(self, batch_size: int, kv_lora_rank: int, rope_dim: int, *, dtype, device, capacity: int = 256):
        device = check_cache_arguments(batch_size, kv_lora_rank, rope_dim, capacity, dtype, device, self.MAX_SIZE)
        self.kv_lora_rank = int(kv_lora_rank)
        self.rope_dim = int(rope_dim)
        self.latent = torch.empty(
            int(batch_size), int(capacity), self.kv_lora_rank + self.rope_dim, dtype=dtype, device=device
        )  # [B, cap, C+R]
        self.length = 0
        self._owner = None  # weakref to the drafter that wrote it first (see bind)
        self._owner_config = None

    @classmethod
    def for_model(cls, model_or_config, batch_size: int, *, dtype, device, capacity: int = 256):
        """A cache for a drafter's config; given the drafter itself, the cache is bound to it (see :meth:`bind`)."""
        model = model_or_config if isinstance(model_or_config, nn.Module) else None
        config = model.config if model is not None else model_or_config
        if not all(isinstance(getattr(config, k, None), int) for k in ("kv_lora_rank", "qk_rope_head_dim")):
            raise DraftInputError(
                f"LatentKVCache.for_model takes an Eagle31MLAConfig or drafter, got {describe_value(model_or_config)}"
            )
        cache = cls(
            batch_size, config.kv_lora_rank, config.qk_rope_head_dim, dtype=dtype, device=device, capacity=capacity
        )
        if model is not None:
            cache.bind(model)
        return cache

    def bind(self, model: nn.Module) -> None:
        """Tie this cache to ``model``, the drafter whose keys it holds: its c_kv was normalised with that
        drafter's weights and its k_pe rotated under that drafter's rope schedule, so no other drafter may
        read or extend it (even one of the same dims). A fresh cache binds to the first drafter that uses it."""
        import weakref

        self._owner = weakref.ref(model)
        self._owner_config = model.config

    def bound_to(self) -> tuple[object, object] | None:
        """``(drafter or None if it is gone, its config)`` when bound, None for a fresh cache."""
        owner = getattr(self, "_owner", None)
        return None if owner is None else (owner(), getattr(self, "_owner_config", None))

    @property
    def c_kv(self) -> torch.Tensor:
        return self.latent[..., : self.kv_lora_rank]  # [B, cap, C]

    @property
    def k_pe(self) -> torch.Tensor:
        return self.latent[..., self.kv_lora_rank :]  # [B, cap, R]

    def get_seq_length(self) -> int:
        return self.length

    def _grow(self, needed: int) -> None:
        capacity = self.latent.shape[1]
        if needed <= capacity:
            return
        capacity = max(capacity, 1)  # doubling from 0 would never end
        while capacity < needed:
            capacity *= 2
        grown = self.latent.new_empty(self.latent.shape[0], capacity, self.latent.shape[2])
        grown[:, : self.length] = self.latent[:, : self.length]
        self.latent = grown

    def update(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Append T tokens; returns the whole cached latent [B, S, C+R] (a view)."""
        start, end = self.length, self.length + c_kv.shape[1]
        self._grow(end)
        self.latent[:, start:end, : self.kv_lora_rank] = c_kv
        self.latent[:, start:end, self.kv_lora_rank :] = k_pe
        self.length = end
        return self.latent[:, :end]

    def crop(self, length: int) -> None:
        if not isinstance(length, numbers.Integral) or isinstance(length, bool):
            raise DraftInputError(f"`length` is a {type(length).__name__}; expected an int number of tokens to keep")
        if not 0 <= length <= self.length:
            raise DraftInputError(
                f"`length` is {length}; expected an int in [0, {self.length}] (the cache holds {self.length} tokens; "
                "crop keeps the first `length` of them and cannot add any)"
            )
        self.length = length

    def nbytes_per_token(self) -> int:
        return self.latent.shape[-1] * self.latent.element_size()

    def nbytes_allocated(self) -> int:
        return self.latent.numel() * self.latent.element_size()


class Eagle31MLAAttention(nn.Module):
    """DeepSeek MLA over the drafter's 2H-wide input, with a latent cache and an absorbed decode path."""

    def __init__(self, config: Eagle31MLAConfig):
        super().__init__()
        self.config = config  # `_attn_implementation` is read at each step: "flashinfer" decodes through FlashInfer
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        in_width = 2 * config.hidden_size  # EAGLE: [embeddings | hidden]
        self.q_a_proj = Eagle31MLALinear(in_width, config.q_lora_rank, bias=False)
        self.q_a_layernorm = Eagle31MLARMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Eagle31MLALinear(config.q_lora_rank, self.num_heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Eagle31MLALinear(in_width, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = Eagle31MLARMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Eagle31MLALinear(
            config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Eagle31MLALinear(self.num_heads * self.v_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2H]
        cos: torch.Tensor,  # [B, T, R/2]
        sin: torch.Tensor,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = attend; None = all visible
        cache: LatentKVCache | None,
        absorb: bool,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, T, h·(N+R)]
        q = q.view(B, T, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)  # [B, h, T, N+R]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [B, h, T, N], [B, h, T, R]
        q_pe = apply_interleaved_rope(q_pe, cos, sin)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, C]
        k_pe = apply_interleaved_rope(k_pe[:, None], cos, sin)[:, 0]  # [B, T, R], one head shared by all
        if cache is not None:
            latent = cache.update(c_kv, k_pe)  # [B, S, C+R]
        else:
            latent = torch.cat([c_kv, k_pe], dim=-1)  # [B, T, C+R]

        if absorb:
            out = self._absorbed(q_nope, q_pe, latent, mask, cache)
        else:
            out = self._naive(q_nope, q_pe, latent, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim))  # [B, T, H]

    def _naive(self, q_nope, q_pe, latent, mask) -> torch.Tensor:
        """Decompress every cached token through kv_b_proj: simple, and fastest for a prompt."""
        B, S, _ = latent.shape
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [B, S, C], [B, S, R]
        kv = self.kv_b_proj(c_kv).view(B, S, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B, h, S, N], [B, h, S, V]
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1, -1)], dim=-1)  # [B, h, S, N+R]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [B, h, T, N+R]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, h, T, V]

    def _absorbed(self, q_nope, q_pe, latent, mask, cache=None) -> torch.Tensor:
        """Fold kv_b_proj into the query and the output, so attention reads only the latent cache.

        Every head shares the one latent key, so the heads become extra query rows of a single-head
        attention (multi-query form): the cache is read once per step, never expanded per head.

        With ``config._attn_implementation == "flashinfer"`` a one-token step per sequence over the
        whole cache (decode: T == 1, no mask) runs FlashInfer's MLA kernel on the same absorbed query
        (:func:`eagle31_mla.model.flashinfer_backend.latent_decode`, CUDA, fp16/bf16). Multi-token steps (a
        prompt, a tree step, a chain's first step) and masked steps (padding, trees) take the torch path
        below: FlashInfer's paged MLA kernel has no arbitrary mask."""
        B, h, T, _ = q_nope.shape
        w_k, w_v_t = self._absorbed_weights()  # [h, N, C], [h, C, V]
        q_latent = torch.matmul(q_nope.transpose(0, 1).reshape(h, B * T, -1), w_k)  # [h, B·T, C]
        q_latent = q_latent.view(h, B, T, -1).transpose(0, 1)  # [B, h, T, C]
        q = torch.cat([q_latent, q_pe], dim=-1).reshape(B, h * T, -1)  # [B, h·T, C+R]
        if T == 1 and mask is None and cache is not None and self.config._attn_implementation == "flashinfer":
            out = flashinfer_backend().latent_decode(q, cache, self.kv_lora_rank, self.scale)  # [B, h, C]
            out = out.to(w_v_t.dtype).transpose(0, 1)  # [h, B, C]
            return torch.matmul(out, w_v_t).view(h, B, T, -1).transpose(0, 1)  # [B, h, T, V]
        # Products read the cache in the model's dtype (bf16: accumulated in fp32, scores rounded once
        # to bf16); scaling and softmax in fp32; an fp32 model is fp32 throughout. Where the CPU has no
        # native bf16 the products run in fp32 over an fp32 copy of the cache (latent_attention_dtype).
        compute = latent_attention_dtype(latent.dtype, latent.device)
        q = q.to(compute)
        out = q.new_empty(B, h * T, self.kv_lora_rank)
        for b in range(B):  # 2-D products: CPU BLAS runs them far faster than the batched form
            keys = latent[b].to(compute)  # [S, C+R]: the latent is the key, its first C values the value
            scores = (q[b] @ keys.t()).float() * self.scale  # [h·T, S]
            if mask is not None:  # rows in the same (head, token) order as q
                scores = scores.masked_fill(~mask[b, 0].repeat(h, 1), float("-inf"))
            values = keys[:, : self.kv_lora_rank]  # [S, C]
            if values.dtype == torch.float32:
                values = values.contiguous()  # fp32 BLAS is slow on the strided view
            out[b] = scores.softmax(dim=-1).to(values.dtype) @ values  # [h·T, C]
        out = out.to(w_v_t.dtype).view(B, h, T, -1).transpose(0, 1).reshape(h, B * T, -1)  # [h, B·T, C]
        return torch.matmul(out, w_v_t).view(h, B, T, -1).transpose(0, 1)  # [B, h, T, V]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into the query-side [h, N, C] and output-side [h, C, V] factors,
        laid out contiguously once (re-derived if the weight changes), so a decode step does not
        copy them."""
        weight = self.kv_b_proj.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if getattr(self, "_absorbed_key", None) != key:
            w = weight.detach().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            w_k, w_v = w.split([self.nope_dim, self.v_dim], dim=1)
            self._absorbed_cache = (w_k.contiguous(), w_v.transpose(1, 2).contiguous())
            self._absorbed_key = key
        return self._absorbed_cache


class Eagle31MLAMLP(nn.Module):
    def __init__(self, config: Eagle31MLAConfig):
        super().__init__()
        self.gate_proj = Eagle31MLALinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Eagle31MLALinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Eagle31MLALinear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def normalise_aux_chunks(aux_hidden_states: torch.Tensor, norms) -> torch.Tensor:
    """EAGLE-3.1 ``fc_norm``: each captured state gets its own RMSNorm before ``fc``.
    [.., n·Ht] -> [.., n·Ht]; ``norms`` is any sequence of n norm modules (the engines pass theirs)."""
    chunks = aux_hidden_states.chunk(len(norms), dim=-1)  # n × [.., Ht]
    return torch.cat([norm(chunk) for norm, chunk in zip(norms, chunks)], dim=-1)


class Eagle31MLADecoderLayer(nn.Module):
    """The one EAGLE layer: attention reads [input_layernorm(embed) | hidden_norm(h)] (2H wide)."""

    def __init__(self, config: Eagle31MLAConfig):
        super().__init__()
        self.input_layernorm = Eagle31MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = Eagle31MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle31MLAAttention(config)
        self.post_attention_layernorm = Eagle31MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle31MLAMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, mask, cache, absorb) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)  # [B, T, H]
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [B, T, 2H], embeddings first
        residual = normed_hidden if self.norm_before_residual else hidden
        h = residual + self.self_attn(x, cos, sin, mask, cache, absorb)
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


# ---- The drafter ------------------------------------------------------------------------------


@dataclass
class Eagle31MLAOutput:
    """``logits`` [B, T, draft_vocab]; ``hidden_states`` [B, T, H] is the state the next draft step is
    fed (post-norm under ``norm_output``, else pre-norm); ``past_key_values`` the latent cache.

    A plain dataclass on purpose: Transformers' ``ModelOutput`` renames ``past_key_values`` to
    ``cache`` from 5.2x on, and this class must behave the same on every supported version."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    past_key_values: LatentKVCache | None = None


@dataclass
class DraftOutput:
    """``tokens`` [B, k] drafted target-vocabulary ids; ``probs`` [B, k, draft_vocab] the distribution
    each was drawn from (one-hot when greedy); ``past_key_values`` the cache, holding the context plus
    the first k-1 drafted tokens (crop it to the accepted length after verification)."""

    tokens: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    past_key_values: LatentKVCache | None = None
    hidden_states: torch.Tensor | None = None


class Eagle31MLAPreTrainedModel(PreTrainedModel):
    config_class = Eagle31MLAConfig
    config: Eagle31MLAConfig
    base_model_prefix = ""
    _no_split_modules = ["Eagle31MLADecoderLayer"]
    # No `_supports_sdpa` / flash claims: MLA attention here is the drafter's own (naive for a prompt, absorbed
    # over the latent cache for decode, picked by `absorb`), so Transformers' `attn_implementation` switch has
    # nothing to choose; it reports "eager" (the model's own code). `from_pretrained` also takes "flashinfer"
    # (decode steps through FlashInfer, stored as `config._attn_implementation`) and refuses anything else.

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Eagle31MLARMSNorm):
            module.weight.fill_(1.0)


class Eagle31MLAForCausalLM(Eagle31MLAPreTrainedModel):
    def __init__(self, config: Eagle31MLAConfig):
        super().__init__(config)
        H, Ht, n = config.hidden_size, config.target_hidden_size, config.num_aux_hidden_states
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.fc = Eagle31MLALinear(n * Ht, H, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(Eagle31MLARMSNorm(Ht, config.rms_norm_eps) for _ in range(n))
        self.layers = nn.ModuleList([Eagle31MLADecoderLayer(config)])
        self.norm = Eagle31MLARMSNorm(H, config.rms_norm_eps)
        self.lm_head = Eagle31MLALinear(H, config.draft_vocab_size, bias=False)
        self.rotary_emb = Eagle31MLARotaryEmbedding(config)
        if config.draft_vocab_size != config.vocab_size:
            # Pruned vocabulary: target_id = draft_id + d2t[draft_id]; t2d marks target ids that exist.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
        self.post_init()

    # -- EAGLE inputs -------------------------------------------------------------------------------

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., n·Ht] captured target states (ascending layer order) -> [.., H] drafter state."""
        if self.config.fc_norm:
            aux_hidden_states = normalise_aux_chunks(aux_hidden_states, self.fc_norm)
        return self.fc(aux_hidden_states)  # [.., H]

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    # -- argument checks (validation_eagle31_mla) ---------------------------------------------------
    cache_class = LatentKVCache  # the only cache forward reads and extends
    #: forward's switches: name -> (accepts None, what is expected). A new switch goes here and into
    #: tests/unit/test_runtime_corpus.py, which fails for a forward argument with no bad values.
    FLAG_ARGUMENTS = {
        "use_cache": (True, "None or a bool (None: the config's use_cache, or True when a cache is passed)"),
        "absorb": (True, "None or a bool (None: absorbed attention when earlier tokens are cached)"),
        "check_values": (False, "a bool"),
    }
    #: keywords Transformers callers may pass that change nothing here: name -> the values accepted.
    IGNORED_KEYWORDS = {
        "return_dict": (None, True),
        "output_attentions": (None, False),
        "output_hidden_states": (None, False),
    }

    # -- forward ------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor,  # [B, T] tokens whose embeddings enter the drafter
        aux_hidden_states: torch.Tensor | None = None,  # [B, T, n·Ht] first step
        hidden_states: torch.Tensor | None = None,  # [B, T, H] later steps
        position_ids: torch.LongTensor | None = None,  # [B, T]
        past_key_values: LatentKVCache | None = None,
        attention_mask: torch.Tensor | None = None,  # [B, S] 1 = real token, or [B, 1, T, S] bool
        use_cache: bool | None = None,
        absorb: bool | None = None,
        logits_to_keep: int = 0,
        check_values: bool = True,
        **kwargs,
    ) -> Eagle31MLAOutput:
        """One draft step over T tokens. ``absorb`` picks the latent (weight-absorbed) attention; by
        default it is used when earlier tokens are cached (decode), the naive path for a prompt.
        ``logits_to_keep`` = N > 0 computes logits for the last N positions only (drafting needs the
        last one; the 163,840-row lm_head dominates a prompt's compute); 0 keeps all (training).
        ``check_values=False`` skips the value checks (one host sync), for steps a drafting loop feeds
        with the drafter's own outputs; types, shapes, dtypes, devices and the cache are always checked
        (see ``check_forward_inputs``). Tensors only: numpy arrays and lists are refused, not converted."""
        check_forward_inputs(
            self,
            input_ids,
            aux_hidden_states,
            hidden_states,
            position_ids,
            values=check_values,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            use_cache=use_cache,
            absorb=absorb,
            logits_to_keep=logits_to_keep,
            extra=kwargs,
        )
        B, T = input_ids.shape
        if use_cache is None:
            use_cache = True if past_key_values is not None else self.config.use_cache
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if use_cache and past_key_values is None:
            past_key_values = LatentKVCache.for_model(
                self, B, dtype=self.fc.weight.dtype, device=input_ids.device, capacity=max(256, T)
            )
        elif past_key_values is not None and hasattr(past_key_values, "bind") and past_key_values.bound_to() is None:
            past_key_values.bind(self)  # a fresh (user-built) cache binds to the first drafter that uses it
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        if absorb is None:
            absorb = past > 0

        h = self.combine_hidden_states(aux_hidden_states) if aux_hidden_states is not None else hidden_states
        embeds = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(position_ids)  # [B, T, R/2]
        mask = self._attention_mask(attention_mask, B, T, past, input_ids.device)
        h = self.layers[0](embeds, h, cos, sin, mask, past_key_values if use_cache else None, absorb)
        normed = self.norm(h)  # [B, T, H]
        return Eagle31MLAOutput(
            logits=self.lm_head(normed[:, -logits_to_keep:]),  # [B, T or logits_to_keep, draft_vocab]
            hidden_states=normed if self.config.norm_output else h,
            past_key_values=past_key_values if use_cache else None,
        )

    @staticmethod
    def _attention_mask(attention_mask, B, T, past, device) -> torch.Tensor | None:
        """[B, 1, T, S] bool (True = attend), or None when every token sees everything cached (a
        one-token step with no padding), which lets attention take its unmasked fast path. The mask's
        shape and dtype were checked by ``check_forward_inputs``."""
        S = past + T
        if attention_mask is None and T == 1:
            return None
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past)  # [T, S]
        if attention_mask is None:
            return causal[None, None].expand(B, 1, T, S)
        if attention_mask.dim() == 2:
            return causal[None, None] & attention_mask.bool()[:, None, None, :]
        return attention_mask

    # -- drafting -----------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self,
        input_ids: torch.LongTensor,  # [B, T] context tokens entering the drafter
        aux_hidden_states: torch.Tensor,  # [B, T, n·Ht]
        num_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        past_key_values: LatentKVCache | None = None,
        position_ids: torch.LongTensor | None = None,
        sampling_backend: str = "torch",
    ) -> DraftOutput:
        """Draft ``num_tokens`` chained tokens after the context: the first from the context's last
        position, each later one from the previous token's embedding and the previous step's state,
        one position further, attending to everything cached. Every argument is checked before
        anything is computed or cached (sampling settings by :func:`check_sampling_settings`).
        ``sampling_backend`` "flashinfer" draws with FlashInfer on CUDA (:func:`sample_from_logits`)."""
        check_draft_arguments(self, num_tokens, temperature, top_p, generator, aux_hidden_states, sampling_backend)
        if sampling_backend == "flashinfer":
            flashinfer_backend().require(self.fc.weight.device)
        check_forward_inputs(
            self,
            input_ids,
            aux_hidden_states,
            None,
            position_ids,
            past_key_values=past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        # Later steps are fed the drafter's own outputs and skip forward's value checks; only their
        # positions can still go wrong, so check the furthest one here, before anything is cached.
        if position_ids is not None:
            position = position_ids[:, -1:]
            last = int(position.max()) + num_tokens - 1
        else:
            position = torch.full_like(input_ids[:, -1:], past + input_ids.shape[1] - 1, dtype=torch.long)
            last = past + input_ids.shape[1] - 1 + num_tokens - 1
        if last >= self.config.max_position_embeddings:
            raise DraftInputError(
                f"`position_ids` reach {last}, beyond max_position_embeddings "
                f"{self.config.max_position_embeddings} (drafting {num_tokens} tokens after the context); "
                "expected a shorter context or fewer tokens"
            )
        out = self(
            input_ids,
            aux_hidden_states=aux_hidden_states,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=True,
            logits_to_keep=1,
            check_values=False,
        )
        cache = out.past_key_values
        logits, state = out.logits, out.hidden_states[:, -1:]  # [B, 1, V], [B, 1, H]
        tokens, probs = [], []
        for step in range(num_tokens):
            # [B], [B, V]: the token and the distribution it was drawn from
            draft_id, p = sample_from_logits(logits[:, 0], temperature, top_p, generator, sampling_backend)
            tokens.append(self.draft_to_target_ids(draft_id))
            probs.append(p)
            if step == num_tokens - 1:
                break
            position = position + 1
            out = self(
                tokens[-1][:, None],
                hidden_states=state,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
                check_values=False,
            )
            logits, state = out.logits, out.hidden_states
        return DraftOutput(
            tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1), past_key_values=cache, hidden_states=state
        )

    # -- loading ------------------------------------------------------------------------------------

    @classmethod
    def on_meta_device(cls, config: Eagle31MLAConfig, dtype: torch.dtype | None = None) -> Eagle31MLAForCausalLM:
        """The model's structure with no storage: for rosters and for loading without a second copy."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype or config.dtype or torch.float32)
        try:
            with torch.device("meta"):
                return cls(config)
        finally:
            torch.set_default_dtype(previous)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args,
        config: Eagle31MLAConfig | None = None,
        revision: str | None = None,
        dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool | None = None,
        token: str | bool | None = None,
        allow_pickle: bool = False,
        **kwargs,
    ) -> Eagle31MLAForCausalLM:
        """Load from a local folder or a Hub repo id (through huggingface_hub: its cache, ``revision``,
        offline mode). Every tensor is checked against the config before anything is loaded; a missing,
        unexpected or misshaped tensor is an error, never a random weight.

        Safetensors only by default: pickle (``.bin``/``.pt``) can run arbitrary code when loaded.
        ``allow_pickle=True`` reads a local folder's pickle weights with ``torch.load(weights_only=True)``
        (tensors only; anything else in the file is refused), converts them to safetensors in a temporary
        folder, and loads that through the same checks."""
        attn_implementation, device, wanted = check_loading_arguments(
            cls.__name__, model_args, kwargs, device, dtype, torch_dtype
        )
        folder = resolve_model_folder(
            pretrained_model_name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            allow_pickle=allow_pickle,
        )
        if config is None:
            check_config_file(folder)
            config = Eagle31MLAConfig.from_pretrained(folder)
        chosen = wanted["dtype"] if dtype is not None else wanted["torch_dtype"]
        dtype = chosen or resolve_dtype(config.dtype, "config dtype") or torch.float32
        device = torch.device(device or "cpu")
        if attn_implementation == "flashinfer":  # refused here, before minutes of loading, if it cannot run
            flashinfer_backend().require(
                device, dtype, kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim
            )

        model = cls.on_meta_device(config, dtype)
        state = load_checkpoint_state(folder, model, dtype=dtype, device=device, allow_pickle=allow_pickle)
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary_emb.reset_inv_freq(device)
        if attn_implementation == "flashinfer":
            model.config._attn_implementation = "flashinfer"  # where Transformers keeps it; not written to config.json
        model.config.name_or_path = str(pretrained_model_name_or_path)
        model.eval()
        return model


# Folders written by save_pretrained carry auto_map and these files, so they load with only
# torch + transformers installed (`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`).
Eagle31MLAConfig.register_for_auto_class()
Eagle31MLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
