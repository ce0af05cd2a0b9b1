"""Sampling: the distribution decoding draws from, and the draw, shared by the drafter's ``draft`` and the
reference speculative loop. Under ``backend="flashinfer"``, FlashInfer's top-p and draws on CUDA
(:mod:`eagle31_mla.model.flashinfer_backend`, loaded on first use by :func:`flashinfer_backend`: the installed library
carries it, the Hub remote code does not).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .validation_eagle31_mla import check_sampling_backend, check_sampling_settings

__all__ = ["flashinfer_backend", "sample_from_logits", "sampling_probs"]


def flashinfer_backend():
    """:mod:`eagle31_mla.model.flashinfer_backend`, imported on first use: it belongs to the installed library, and
    the Hub remote code (this file copied next to a checkpoint, torch + transformers only) does not carry it."""
    try:
        return importlib.import_module(".flashinfer_backend", __package__)
    except ImportError:
        raise RuntimeError(
            "the FlashInfer path (attn_implementation='flashinfer', sampling_backend='flashinfer') is part of the "
            'eagle31-mla library (pip install "eagle31-mla[gpu]"), not of this copy of the modeling code '
            f"({__name__}); load the drafter with eagle31_mla.Eagle31MLAForCausalLM"
        ) from None


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float, backend: str = "torch") -> torch.Tensor:
    """The distribution decoding samples from: [.., V] logits -> [.., V] fp32 probabilities. One-hot
    argmax for temperature 0 (ties to the lowest id); otherwise temperature softmax truncated to the
    smallest prefix reaching ``top_p``, renormalised. The drafter and the reference loop share it.
    Settings follow :func:`check_sampling_settings`. ``backend="flashinfer"`` truncates with FlashInfer's
    ``top_p_renorm_probs`` (CUDA) instead of the sort below: the same rule, up to ties at the threshold."""
    temperature, top_p = check_sampling_settings(temperature, top_p)
    check_sampling_backend(backend)
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
        keep[..., 0] = True  # never empty (a top_p below fp32's smallest value compares as 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a token per row of ``logits`` [B, V]; returns the ids [B] and the distribution used [B, V].
    Greedy (temperature 0) is the argmax under either backend: there is nothing to sample."""
    probs = sampling_probs(logits, temperature, top_p, backend)
    if temperature == 0:
        return probs.argmax(-1), probs
    if backend == "flashinfer":
        return flashinfer_backend().sample(probs, generator), probs
    return torch.multinomial(probs, 1, generator=generator)[:, 0], probs
