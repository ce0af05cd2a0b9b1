"""FlashInfer glue for the opt-in GPU path (the ``[gpu]`` extra, CUDA only; what runs through it: docs/gpu.md).

Written against flashinfer-python 0.7.2.post1 (git beabf5004585b03da60e927bbb803acbaa62fe36):
``plan(metadata=MLAPlanMetadata.csr(...), ...)`` / ``run(query=, kv_cache=)``; FA2/FA3 take fp16/bf16 only, a
latent width a multiple of 128 and a rope width a multiple of 64. Nothing falls back: where FlashInfer cannot
run, :class:`FlashInferUnavailable` says what is missing and how to install it.
"""

from __future__ import annotations

import torch

#: The extra's requirement (pyproject.toml ``[project.optional-dependencies] gpu``) and how to install it.
REQUIREMENT = "flashinfer-python>=0.7.2.post1,<0.8"
INSTALL = 'pip install "eagle31-mla[gpu]"'
DEVICE_TYPES = ("cuda",)  # where FlashInfer runs (the CPU tests add "cpu" to run the glue against a stand-in)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # FA2/FA3 MLA kernels: no fp32 variant
WORKSPACE_BYTES = 128 * 2**20  # the wrapper's float workspace (FlashInfer's docs: 128 MiB to start with)


class FlashInferUnavailable(RuntimeError):
    """The FlashInfer path was asked for where it cannot run: the message names each problem and the install."""


def require(device, dtype: torch.dtype | None = None, *, kv_lora_rank: int | None = None, rope_dim: int | None = None):
    """``flashinfer``, or :class:`FlashInferUnavailable` listing every reason it cannot run here."""
    device = torch.device(device)
    problems = []
    if device.type not in DEVICE_TYPES:
        here = (
            f"CUDA is available here, so load the drafter on cuda (it is on {device})"
            if torch.cuda.is_available()
            else f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False)"
        )
        problems.append(f"FlashInfer runs on CUDA only: {here}")
    try:
        import flashinfer
        from flashinfer import mla, sampling  # noqa: F401 -- a broken install lacks one: refused here
    except ImportError as err:
        flashinfer = None
        problems.append(f"flashinfer-python is not installed ({type(err).__name__}: {err})")
    if dtype is not None and dtype not in KERNEL_DTYPES:
        problems.append(
            f"its MLA kernels take float16 or bfloat16, the drafter is {dtype} (load it with dtype=torch.bfloat16)"
        )
    if kv_lora_rank is not None and (kv_lora_rank % 128 or (rope_dim or 0) % 64):
        problems.append(
            f"its MLA kernels take a latent width that is a multiple of 128 and a rope width that is a multiple "
            f"of 64; this drafter has kv_lora_rank {kv_lora_rank} and qk_rope_head_dim {rope_dim} (Kimi-K3's: 512, 64)"
        )
    if problems:
        raise FlashInferUnavailable(
            "the FlashInfer path cannot run: "
            + "; ".join(problems)
            + f". It needs a CUDA GPU, a CUDA build of torch and {REQUIREMENT} ({INSTALL}); or keep the torch path "
            '(attn_implementation None or "eager", sampling_backend "torch")'
        )
    return flashinfer


_WRAPPERS: dict[torch.device, object] = {}  # one planned-MLA wrapper (and its workspace) per device


def latent_decode(query: torch.Tensor, cache, kv_lora_rank: int, sm_scale: float) -> torch.Tensor:
    """One new token's attention (``query`` [B, h, C+R]) over all ``cache`` holds: [B, h, C]. Planned on every
    call (the length moves each step; FA planning reads the int32 metadata on the host)."""
    flashinfer = require(query.device, query.dtype, kv_lora_rank=kv_lora_rank, rope_dim=query.shape[-1] - kv_lora_rank)
    buffer = cache.latent  # [B, cap, C+R] as pages: [num_pages = B, page_size = cap, C+R]
    B, capacity, width = buffer.shape
    if query.device not in _WRAPPERS:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        _WRAPPERS[query.device] = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    wrapper = _WRAPPERS[query.device]
    index = torch.arange(B + 1, dtype=torch.int32)  # one query row and one page per sequence: [b, b+1)
    metadata = flashinfer.mla.MLAPlanMetadata.csr(
        qo_indptr=index,
        kv_indptr=index,
        kv_indices=index[:B],  # sequence b's page is page b of the buffer
        kv_len_arr=torch.full((B,), cache.get_seq_length(), dtype=torch.int32),
    )
    wrapper.plan(
        metadata=metadata,
        num_heads=query.shape[1],
        head_dim_ckv=kv_lora_rank,
        head_dim_kpe=width - kv_lora_rank,
        page_size=capacity,
        causal=False,  # one query token that sees every cached token
        sm_scale=float(sm_scale),
        q_data_type=query.dtype,
        kv_data_type=buffer.dtype,
        query_layout="packed",
        kv_cache_layout="packed",
    )
    return wrapper.run(query=query, kv_cache=buffer)  # [B, h, C]


def top_p_renorm(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] probabilities -> the smallest set of most likely tokens reaching ``top_p`` (< 1), renormalised."""
    shape = probs.shape
    flat = probs.reshape(-1, shape[-1]).float().contiguous()
    return require(probs.device).sampling.top_p_renorm_probs(flat, float(top_p)).view(shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of [N, V] probabilities (a CUDA generator, or None for the device's default): ids [N]."""
    return require(probs.device).sampling.sampling_from_probs(probs.float().contiguous(), generator=generator).long()


def accept_chain(draft_tokens, draft_probs, target_probs, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`eagle31_mla.decoding.speculative.accept_chain` by FlashInfer's ``chain_speculative_sampling``."""
    out, _, emitted = require(draft_probs.device).sampling.chain_speculative_sampling(
        draft_probs.float().contiguous(),
        draft_tokens.to(torch.int32).contiguous(),
        target_probs.float().contiguous(),
        generator=generator,
    )  # out [B, k+1]: the accepted drafts, then the correction / bonus token, then -1
    num_accepted = emitted.long()  # [B] drafts emitted, the bonus not counted
    return num_accepted, out.gather(1, num_accepted[:, None])[:, 0].long()
