"""The EAGLE-3.1 MLA drafter for Kimi-K3 (`lightseekorg/kimi-k3-eagle3.1-mla`) in PyTorch/Transformers.

One DeepSeek-style Multi-head Latent Attention decoder layer drafts tokens for Kimi-K3 from three of its
residual-stream states. EAGLE-3.1 adds two switches to EAGLE-3: ``fc_norm`` (an RMSNorm per captured state before
``fc``) and ``norm_output`` (the next draft step is fed ``norm(h)``, not ``h``). MLA keeps the draft KV cache
small: per token only the normalised latent ``c_kv`` (512) and the rotated shared rope key ``k_pe`` (64).

Module names are the published tensor names; other layouts load through :data:`KEY_MAPPING`.

Symbols in shape comments: B batch, T new tokens, S cached + new tokens, H hidden, Ht target hidden, n aux
states, h heads, C kv_lora_rank (512), R qk_rope_head_dim (64), N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from .configuration_eagle31_mla import Eagle31MLAConfig, rope_frequencies

#: Other layouts of the same tensors, as Transformers' ``key_mapping`` (checkpoint-name regex -> published name):
#: NeMo's ``model.`` prefix on everything but ``lm_head``, training's ``midlayer.`` for ``layers.0.``.
KEY_MAPPING = {r"^model\.": "", r"^midlayer\.": "layers.0."}


def canonical_tensor_name(name: str) -> str:
    """The published name of a tensor named in any layout of :data:`KEY_MAPPING` (the engine plugins' loaders)."""
    for pattern, replacement in KEY_MAPPING.items():
        name = re.sub(pattern, replacement, name)
    return name


class DraftInputError(ValueError, TypeError):
    """A refused call argument, named in the message; both a ValueError and a TypeError, so either ``except`` works."""


class Eagle31MLALinear(nn.Linear):
    """nn.Linear whose one-token product on CPU uses the matrix-vector kernel, which streams the weight
    1.3-1.7x faster there than the matrix-matrix path (a draft step is such products)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and self.bias is None and x.numel() == x.shape[-1] and x.dtype == self.weight.dtype:
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


class Eagle31MLARMSNorm(nn.Module):
    """RMSNorm with the variance in fp32, cast back to the input dtype before the weight."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Eagle31MLARotaryEmbedding(nn.Module):
    """RoPE angles for the rope slice; frequencies computed once per device, off the state dict (nothing to load)."""

    def __init__(self, config: Eagle31MLAConfig):
        super().__init__()
        self.config = config
        self._frequencies: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        if device not in self._frequencies:
            self._frequencies[device] = rope_frequencies(self.config, device)
        inv_freq, scaling = self._frequencies[device]
        angles = position_ids[..., None].float() * inv_freq.float()  # [B, T, R/2]
        return angles.cos() * scaling, angles.sin() * scaling


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary on adjacent pairs (x0, x1), (x2, x3), ...; x: [B, heads, T, R], cos/sin: [B, T, R/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, heads, T, R/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


#: Whether this CPU computes bf16 natively; None: detected on first use. Set it (tests, benchmarks), or
#: ``EAGLE31_CPU_NATIVE_BF16=0`` / ``=1`` for a whole process, to force a path.
CPU_NATIVE_BF16: bool | None = None


def _detect_cpu_native_bf16() -> bool:
    env = os.environ.get("EAGLE31_CPU_NATIVE_BF16")
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"EAGLE31_CPU_NATIVE_BF16={env!r}; expected 0 (no native bf16) or 1 (native bf16)")
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
    global CPU_NATIVE_BF16
    if CPU_NATIVE_BF16 is None:
        CPU_NATIVE_BF16 = _detect_cpu_native_bf16()
    return CPU_NATIVE_BF16


def latent_attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The absorbed attention's dtype: the model's, except bf16 on a CPU without native bf16, whose bf16 matrix
    kernels run several times slower than fp32: there the cache (1,152 bytes a token: under 5 MB at 4k) is converted
    to fp32 each step, which costs far less. Weights are never converted: their reads stay streaming in bf16."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return dtype


class LatentKVCache:
    """Per token normalised c_kv [C] and rotated k_pe [R] in one buffer [B, capacity, C+R]: keys and values are
    views. Grows by doubling; ``crop`` rolls back rejected drafts. Bound to the drafter that writes it first."""

    def __init__(self, model_or_config, batch_size: int, *, dtype, device, capacity: int = 256):
        config = getattr(model_or_config, "config", model_or_config)
        self.kv_lora_rank, width = config.kv_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim
        self.latent = torch.empty(batch_size, max(capacity, 1), width, dtype=dtype, device=device)
        self.length = 0
        self.owner = None  # weakref to the drafter that wrote it first (forward binds it)

    for_model = classmethod(type.__call__)  # LatentKVCache.for_model(model or config, batch_size, ...)

    @property
    def c_kv(self) -> torch.Tensor:
        return self.latent[..., : self.kv_lora_rank]  # [B, cap, C]

    @property
    def k_pe(self) -> torch.Tensor:
        return self.latent[..., self.kv_lora_rank :]  # [B, cap, R]

    def get_seq_length(self) -> int:
        return self.length

    def update(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Append T tokens; returns the whole cached latent [B, S, C+R] (a view)."""
        start, end = self.length, self.length + c_kv.shape[1]
        if end > self.latent.shape[1]:
            capacity = self.latent.shape[1]
            while capacity < end:
                capacity *= 2
            grown = self.latent.new_empty(self.latent.shape[0], capacity, self.latent.shape[2])
            grown[:, :start] = self.latent[:, :start]
            self.latent = grown
        self.latent[:, start:end, : self.kv_lora_rank] = c_kv
        self.latent[:, start:end, self.kv_lora_rank :] = k_pe
        self.length = end
        return self.latent[:, :end]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise DraftInputError(f"`length` is {length}; expected an int in [0, {self.length}] (the cached tokens)")
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
        q = torch.cat([q_nope, q_pe], dim=-1)  # [B, h, T, N+R]
        if hasattr(mask, "attend"):  # a pattern that attends itself (the trainer's linear-memory TTT attention),
            return mask.attend(q, latent, self.keys_values, self.scale)  # decompressing each latent once
        k, v = self.keys_values(latent)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, h, T, V]

    def keys_values(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [B, S, C+R] decompressed: keys [B, h, S, N+R] (the rope part shared by all heads), values
        [B, h, S, V]."""
        B, S, _ = latent.shape
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [B, S, C], [B, S, R]
        kv = self.kv_b_proj(c_kv).view(B, S, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B, h, S, N], [B, h, S, V]
        return torch.cat([k_nope, k_pe[:, None].expand(-1, self.num_heads, -1, -1)], dim=-1), v

    def _absorbed(self, q_nope, q_pe, latent, mask, cache=None) -> torch.Tensor:
        """Fold kv_b_proj into the query and the output, so attention reads only the latent cache. Every head shares
        the one latent key, so the heads become extra query rows of a single-head attention: the cache is read once
        per step, never expanded per head. An unmasked one-token step may run FlashInfer's kernel instead."""
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
        """kv_b_proj split per head into [h, N, C] and [h, C, V], made contiguous once per weight version."""
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
    """EAGLE-3.1 ``fc_norm``: each captured state its own RMSNorm before ``fc`` (the engines pass their norms)."""
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


# ---- Sampling: the distribution decoding draws from, shared by ``draft`` and the reference loop ----------------

#: Who samples: "torch" (the rule below and ``torch.multinomial``) or "flashinfer" (FlashInfer's top-p and draws
#: on CUDA: ``eagle31_mla.model.flashinfer_backend``, the library's ``[gpu]`` extra, not in the Hub remote code).
SAMPLING_BACKENDS = ("torch", "flashinfer")


def check_sampling_settings(temperature, top_p, backend: str = "torch") -> tuple[float, float]:
    """The one rule for sampling settings, checked once at each public entry (``draft``, the loop, the CLI)."""
    real = (int, float)
    if not isinstance(temperature, real) or isinstance(temperature, bool) or not 0 <= temperature < math.inf:
        raise DraftInputError(f"`temperature` is {temperature!r}; expected a finite number >= 0 (0 = greedy decoding)")
    if not isinstance(top_p, real) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise DraftInputError(f"`top_p` is {top_p!r}; expected a number in (0, 1] (1 = no truncation)")
    if backend not in SAMPLING_BACKENDS:
        raise DraftInputError(f"`sampling_backend` is {backend!r}; expected one of {SAMPLING_BACKENDS}")
    return float(temperature), float(top_p)


def flashinfer_backend():
    """``eagle31_mla.model.flashinfer_backend``, imported on first use: the Hub remote code does not carry it."""
    try:
        return importlib.import_module(".flashinfer_backend", __package__)
    except ImportError:
        raise RuntimeError(
            'the FlashInfer path is part of the eagle31-mla library (pip install "eagle31-mla[gpu]"), not of this '
            f"copy of the modeling code ({__name__}); load the drafter with eagle31_mla.Eagle31MLAForCausalLM"
        ) from None


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float, backend: str = "torch") -> torch.Tensor:
    """[.., V] logits -> [.., V] fp32 probabilities: one-hot argmax for temperature 0 (ties to the lowest id);
    else temperature softmax truncated to the smallest prefix reaching ``top_p``, renormalised."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    if temperature >= 1e-3:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
    else:  # logits / temperature could overflow fp32 (inf - inf = NaN): shift by the max, divide in fp64
        shifted = logits.double() - logits.double().amax(dim=-1, keepdim=True)
        probs = torch.softmax(shifted / temperature, dim=-1).float()
    if top_p < 1 and backend == "flashinfer":
        return flashinfer_backend().top_p_renorm(probs, top_p)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # smallest prefix reaching top_p
        keep[..., 0] = True  # never empty
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_logits(logits, temperature: float, top_p: float, generator, backend: str = "torch"):
    """A token per row of ``logits`` [B, V] and the distribution it was drawn from: ([B], [B, V])."""
    probs = sampling_probs(logits, temperature, top_p, backend)
    if temperature == 0:
        return probs.argmax(-1), probs
    if backend == "flashinfer":
        return flashinfer_backend().sample(probs, generator), probs
    return torch.multinomial(probs, 1, generator=generator)[:, 0], probs


@dataclass
class Eagle31MLAOutput:
    """``hidden_states``: what the next draft step is fed (post-norm under ``norm_output``). A plain dataclass:
    Transformers' ``ModelOutput`` renames ``past_key_values`` from 5.2x on."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    past_key_values: LatentKVCache | None = None


@dataclass
class DraftOutput:
    """``tokens`` [B, k] target ids drawn from ``probs`` [B, k, draft_vocab]; ``past_key_values`` holds the context
    and the first k-1 drafts (crop it to the accepted length after verification)."""

    tokens: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    past_key_values: LatentKVCache | None = None
    hidden_states: torch.Tensor | None = None


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The [vocab_size] bool mask of the target ids ``d2t`` maps to (target_id = draft_id + d2t[draft_id])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[torch.arange(d2t.numel(), device=d2t.device) + d2t] = True
    return t2d


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config: every offending tensor is named."""


class Eagle31MLAPreTrainedModel(PreTrainedModel):
    config_class = Eagle31MLAConfig
    config: Eagle31MLAConfig
    base_model_prefix = ""
    _no_split_modules = ["Eagle31MLADecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Eagle31MLARMSNorm):
            module.weight.fill_(1.0)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Transformers' ``from_pretrained``, every keyword passed through. Added: :data:`KEY_MAPPING`; safetensors
        only unless ``use_safetensors=False`` (pickle can run code); a missing, unexpected or misshaped tensor, a NaN or
        inf weight, or a ``d2t`` beyond the vocabulary is a :class:`CheckpointError` naming it, never a random or
        poisoned weight; ``t2d`` derived from ``d2t`` when the file omits it; ``attn_implementation="flashinfer"``."""
        kwargs.setdefault("key_mapping", KEY_MAPPING)
        kwargs.setdefault("use_safetensors", True)  # pickle can run code: opt in with use_safetensors=False
        kwargs.setdefault("ignore_mismatched_sizes", True)  # then refused below, by name (Transformers' error is not)
        flashinfer = kwargs.get("attn_implementation") == "flashinfer"
        if flashinfer:  # refused before minutes of loading where it cannot run
            kwargs.pop("attn_implementation")
            device = kwargs.get("device_map")
            flashinfer_backend().require(torch.device(device if isinstance(device, (str, torch.device)) else "cuda"))
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing, vocab = set(info.get("missing_keys") or ()), model.config.vocab_size
        problems = [  # (name, shape in the file, shape expected) from Transformers 5.19 on, the name before
            f"tensor {m[0]!r} has shape {list(m[1])}, expected {list(m[2])}"
            if isinstance(m, tuple) and len(m) == 3
            else f"tensor {m[0] if isinstance(m, tuple) else m!r} has the wrong shape"
            for m in info.get("mismatched_keys") or ()
        ]
        if model.d2t is not None and not problems and "d2t" not in missing:
            targets = torch.arange(model.d2t.numel(), device=model.d2t.device) + model.d2t
            if not 0 <= int(targets.min()) <= int(targets.max()) < vocab:
                problems.append(f"tensor 'd2t' maps draft ids outside [0, {vocab}) (vocab_size)")
            elif "t2d" in missing:
                model.t2d, missing = t2d_from_d2t(model.d2t, vocab), missing - {"t2d"}
        problems += [f"missing tensor {name!r}" for name in sorted(missing)]
        problems += [f"unexpected tensor {name!r}" for name in sorted(info.get("unexpected_keys") or ())]
        if not problems:  # one fused min/max pass per weight (3.4 s for the whole 6 GB load on 2 CPUs, RESULTS.md)
            weights = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
            probes = torch.stack([torch.stack(torch.aminmax(p.detach())).float().cpu() for _, p in weights])
            problems += [
                f"tensor {n!r} holds NaN or inf" for (n, _), ok in zip(weights, probes.isfinite().all(1)) if not ok
            ]
        if problems:
            name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            raise CheckpointError(f"{name}: the checkpoint does not match its config: " + "; ".join(problems))
        if flashinfer:
            rank, rope = model.config.kv_lora_rank, model.config.qk_rope_head_dim
            flashinfer_backend().require(model.fc.weight.device, model.dtype, kv_lora_rank=rank, rope_dim=rope)
            model.config._attn_implementation = "flashinfer"
        return (model, info) if wants_info else model


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

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[.., n·Ht] captured target states (ascending layer order) -> [.., H] drafter state."""
        if self.config.fc_norm:
            aux_hidden_states = normalise_aux_chunks(aux_hidden_states, self.fc_norm)
        return self.fc(aux_hidden_states)  # [.., H]

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

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
        logits_to_keep: int | torch.Tensor = 0,  # Transformers': the last N positions (0: all), or their indices
        **kwargs,  # Transformers' own keywords (return_dict, ...): nothing to change here
    ) -> Eagle31MLAOutput:
        """One draft step over T tokens (``absorb``: the weight-absorbed attention; default when tokens are cached).
        Checked here is only what would be silently wrong and costs no host sync: the state's shape, the cache's."""
        if input_ids.dim() != 2:
            raise DraftInputError(f"`input_ids` has shape {tuple(input_ids.shape)}; expected [B, T]")
        B, T = input_ids.shape
        if (aux_hidden_states is None) == (hidden_states is None):
            raise DraftInputError("pass exactly one of `aux_hidden_states` (first step) or `hidden_states` (later)")
        config = self.config
        name, state, width = ("hidden_states", hidden_states, config.hidden_size)
        if hidden_states is None:
            name, state = "aux_hidden_states", aux_hidden_states
            width = config.num_aux_hidden_states * config.target_hidden_size
        if tuple(state.shape) != (B, T, width):
            raise DraftInputError(f"`{name}` has shape {tuple(state.shape)}; expected {(B, T, width)}")
        if past_key_values is not None:
            if not isinstance(past_key_values, LatentKVCache) or use_cache is False:
                raise DraftInputError(
                    f"`past_key_values` is a {type(past_key_values).__name__} with use_cache={use_cache}; expected "
                    "this drafter's LatentKVCache with use_cache True or None (or no cache)"
                )
            owner = past_key_values.owner and past_key_values.owner()
            if owner is not None and owner is not self:
                raise DraftInputError("`past_key_values` was written by another drafter; expected this drafter's")
            if past_key_values.latent.shape[0] != B:
                raise DraftInputError(
                    f"`past_key_values` holds {past_key_values.latent.shape[0]} sequences; expected {B} (the batch)"
                )
        if use_cache is None:
            use_cache = True if past_key_values is not None else config.use_cache
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if use_cache and past_key_values is None:
            dtype, device = self.fc.weight.dtype, input_ids.device
            past_key_values = LatentKVCache(self, B, dtype=dtype, device=device, capacity=max(256, T))
        if use_cache and past_key_values.owner is None:
            past_key_values.owner = weakref.ref(self)  # a fresh cache binds to the first drafter using it
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        h = self.combine_hidden_states(aux_hidden_states) if aux_hidden_states is not None else hidden_states
        mask = self._attention_mask(attention_mask, B, T, past, input_ids.device)
        cache = past_key_values if use_cache else None
        return self._step(
            input_ids, h, position_ids, mask, cache, past > 0 if absorb is None else absorb, logits_to_keep
        )

    def _step(self, input_ids, h, position_ids, mask, cache, absorb, logits_to_keep=0) -> Eagle31MLAOutput:
        """The step on checked inputs: ``forward`` after its checks, and ``draft``'s later steps."""
        cos, sin = self.rotary_emb(position_ids)  # [B, T, R/2]
        h = self.layers[0](self.embed_tokens(input_ids), h, cos, sin, mask, cache, absorb)
        normed = self.norm(h)  # [B, T, H]
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return Eagle31MLAOutput(
            logits=self.lm_head(normed[:, kept]),  # [B, T or the kept positions, draft_vocab]
            hidden_states=normed if self.config.norm_output else h,
            past_key_values=cache,
        )

    @staticmethod
    def _attention_mask(attention_mask, B, T, past, device) -> torch.Tensor | None:
        """[B, 1, T, S] bool (True = attend); None for an unpadded one-token step (the unmasked fast path)."""
        S = past + T
        if (attention_mask is None and T == 1) or hasattr(attention_mask, "attend"):  # attend: _naive's
            return attention_mask
        causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past)  # [T, S]
        if attention_mask is None:
            return causal[None, None].expand(B, 1, T, S)
        if attention_mask.dim() == 2:
            if attention_mask.shape != (B, S):
                raise DraftInputError(f"`attention_mask` has shape {tuple(attention_mask.shape)}; expected {(B, S)}")
            return causal[None, None] & attention_mask.bool()[:, None, None, :]
        if attention_mask.shape != (B, 1, T, S) or attention_mask.dtype != torch.bool:
            raise DraftInputError(
                f"`attention_mask` has shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}; expected "
                f"a 2-D {(B, S)} 0/1 mask or a 4-D bool mask of shape {(B, 1, T, S)} (True = attend)"
            )
        return attention_mask

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
        """Draft ``num_tokens`` chained tokens after the context; arguments checked before anything is cached."""
        temperature, top_p = check_sampling_settings(temperature, top_p, sampling_backend)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise DraftInputError(f"`num_tokens` is {num_tokens!r}; expected an int >= 1")
        if sampling_backend == "flashinfer":
            flashinfer_backend().require(self.fc.weight.device)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is not None:
            position = position_ids[:, -1:]
            last = int(position.max()) + num_tokens - 1
        else:
            position = torch.full_like(input_ids[:, -1:], past + input_ids.shape[1] - 1, dtype=torch.long)
            last = past + input_ids.shape[1] - 1 + num_tokens - 1
        if last >= self.config.max_position_embeddings:
            raise DraftInputError(
                f"`position_ids` reach {last}, beyond max_position_embeddings {self.config.max_position_embeddings} "
                f"(drafting {num_tokens} tokens after the context); expected a shorter context or fewer tokens"
            )
        out = self(
            input_ids,
            aux_hidden_states=aux_hidden_states,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        logits, state = out.logits, out.hidden_states[:, -1:]  # [B, 1, V], [B, 1, H]
        tokens, probs = [], []
        for step in range(num_tokens):  # checked above: the later steps run unchecked
            draft_id, p = sample_from_logits(logits[:, 0], temperature, top_p, generator, sampling_backend)
            tokens.append(self.draft_to_target_ids(draft_id))
            probs.append(p)
            if step < num_tokens - 1:
                position = position + 1
                out = self._step(tokens[-1][:, None], state, position, None, cache, absorb=True)
                logits, state = out.logits, out.hidden_states
        return DraftOutput(
            tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1), past_key_values=cache, hidden_states=state
        )

    @classmethod
    def on_meta_device(cls, config: Eagle31MLAConfig, dtype: torch.dtype | None = None) -> Eagle31MLAForCausalLM:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype or config.dtype or torch.float32)
        try:
            with torch.device("meta"):
                return cls(config)
        finally:
            torch.set_default_dtype(previous)


# Folders written by save_pretrained carry auto_map and these files, so they load with only
# torch + transformers installed (`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`).
Eagle31MLAConfig.register_for_auto_class()
Eagle31MLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
