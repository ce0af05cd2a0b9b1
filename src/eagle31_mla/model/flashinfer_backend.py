"""FlashInfer glue for the GPU path: the ``[gpu]`` extra (``flashinfer-python>=0.7.2.post1,<0.8``), CUDA only.

Opt-in and not yet run on a GPU (no GPU was lent to the sessions that wrote it): the torch paths stay the
defaults. Two things go through FlashInfer, shaped here; the math stays where it was:

* **Drafter decode** (``attn_implementation="flashinfer"``): a one-token step per sequence over the whole
  latent cache runs ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on the query that
  :class:`~eagle31_mla.model.modeling_eagle31_mla.Eagle31MLAAttention` absorbed (q_nope times kv_b's key factor:
  C wide, then the rotated q_pe: R wide). The cache is read in place: ``LatentKVCache.latent`` [B, capacity,
  C+R] is FlashInfer's packed paged layout [num_pages, page_size, C+R] with one page per sequence and
  page_size = capacity, so no step copies it (FlashInfer splits it into the ckv [..., :C] and kpe [..., C:]
  views its FA2/FA3 kernels take with page and token strides). Multi-token steps (a prompt, a tree step, a
  chain's first step) and masked steps keep the torch path: the kernel takes no arbitrary mask.
* **Sampling** (``sampling_backend="flashinfer"``): top-p renormalisation (``top_p_renorm_probs``), draws
  (``sampling_from_probs``) and chain verification (``chain_speculative_sampling``). Trees keep the torch
  acceptance rule (FlashInfer has none for point-mass drafts); greedy is the argmax rule under either backend.

Read from flashinfer-python 0.7.2.post1 (its wheel's ``_build_meta``: git beabf5004585b03da60e927bbb803acbaa62fe36):
``flashinfer/mla/_batch_mla/_wrapper.py`` (``plan(metadata=MLAPlanMetadata.csr(...), num_heads, head_dim_ckv,
head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout)``;
``run(query=, kv_cache=)``; the flat ``plan(qo_indptr, ...)`` / ``run(q_nope, q_pe, ckv_cache, kpe_cache)`` forms are
deprecated there), ``_contracts.py`` (packed tensors are rank 3 with last dim C+R), ``_planning.py`` (int32
contiguous metadata on CPU or the device; pages per request = ceil(kv_len / page_size)),
``_backends/_fa_common.py`` (FA2/FA3 take fp16/bf16 queries only; head_dim_ckv a multiple of 128, head_dim_kpe of
64) and ``flashinfer/sampling.py``. Nothing here falls back: where FlashInfer cannot run,
:class:`FlashInferUnavailable` says what is missing and how to install it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FlashInferUnavailable",
    "INSTALL",
    "REQUIREMENT",
    "accept_chain",
    "latent_decode",
    "require",
    "sample",
    "top_p_renorm",
]

#: The extra's requirement (pyproject.toml ``[project.optional-dependencies] gpu``) and how to install it.
REQUIREMENT = "flashinfer-python>=0.7.2.post1,<0.8"
INSTALL = 'pip install "eagle31-mla[gpu]"'
#: Where FlashInfer runs. (The CPU tests add "cpu" to run the glue against a stand-in of FlashInfer's API.)
DEVICE_TYPES = ("cuda",)
#: FlashInfer's MLA kernels (FA2/FA3 on SM80/SM90) take these query / KV dtypes; fp32 has no kernel.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: The float workspace FlashInfer's wrapper keeps intermediate results in (its docs: 128 MiB to start with).
WORKSPACE_BYTES = 128 * 2**20


class FlashInferUnavailable(RuntimeError):
    """The FlashInfer path was asked for where it cannot run (no CUDA, the package missing, a dtype or dims
    its kernels do not take): the message names each problem and the install command."""


def _import_flashinfer():
    """``flashinfer`` with its ``mla`` and ``sampling`` modules (ImportError when missing or broken)."""
    import flashinfer
    from flashinfer import mla, sampling

    return flashinfer, mla, sampling


def require(device, dtype: torch.dtype | None = None, *, kv_lora_rank: int | None = None, rope_dim: int | None = None):
    """``flashinfer`` for tensors on ``device`` (and, for decode, in ``dtype`` with these cache widths), or
    :class:`FlashInferUnavailable` listing every reason it cannot run."""
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
        flashinfer = _import_flashinfer()[0]
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


# ---- decode over the latent cache ------------------------------------------------------------------------

_WRAPPERS: dict[torch.device, object] = {}  # one planned-MLA wrapper (and its workspace) per device


def _wrapper(flashinfer, device: torch.device):
    if device not in _WRAPPERS:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WRAPPERS[device] = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    return _WRAPPERS[device]


def latent_decode(query: torch.Tensor, cache, kv_lora_rank: int, sm_scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over everything ``cache`` holds (it was just appended).

    ``query`` [B, h, C+R]: q_nope absorbed to C, then the rotated q_pe; ``cache.latent`` [B, capacity, C+R]
    (normalised c_kv, then rotated k_pe); returns the per-head latent output [B, h, C] (the softmax-weighted
    c_kv, before kv_b's value factor), in ``query``'s dtype. Planned on every call (the length moves each step;
    FlashInfer's FA planning reads the int32 metadata on the host): no CUDA graph here."""
    flashinfer = require(query.device, query.dtype, kv_lora_rank=kv_lora_rank, rope_dim=query.shape[-1] - kv_lora_rank)
    buffer = cache.latent  # [B, cap, C+R]: as pages, [num_pages = B, page_size = cap, C+R]
    B, capacity, width = buffer.shape
    index = torch.arange(B + 1, dtype=torch.int32)  # one query token and one page per sequence
    metadata = flashinfer.mla.MLAPlanMetadata.csr(
        qo_indptr=index,  # [B+1] query rows of sequence b: [b, b+1)
        kv_indptr=index,  # [B+1] its pages in kv_indices: [b, b+1)
        kv_indices=index[:B],  # [B] sequence b's page is page b of the buffer
        kv_len_arr=torch.full((B,), cache.get_seq_length(), dtype=torch.int32),  # [B] tokens it attends to
    )
    wrapper = _wrapper(flashinfer, query.device)
    wrapper.plan(
        metadata=metadata,
        num_heads=query.shape[1],
        head_dim_ckv=kv_lora_rank,
        head_dim_kpe=width - kv_lora_rank,
        page_size=capacity,
        causal=False,  # one query token that sees every cached token (itself included)
        sm_scale=float(sm_scale),
        q_data_type=query.dtype,
        kv_data_type=buffer.dtype,
        query_layout="packed",
        kv_cache_layout="packed",
    )
    return wrapper.run(query=query, kv_cache=buffer)  # [B, h, C]


# ---- sampling --------------------------------------------------------------------------------------------


def top_p_renorm(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] probabilities -> the smallest set of most likely tokens reaching ``top_p``, renormalised
    (FlashInfer: tokens below the threshold whose mass above it is ``top_p`` are dropped). ``top_p`` < 1."""
    sampling = _sampling(probs.device)
    shape = probs.shape
    return sampling.top_p_renorm_probs(probs.reshape(-1, shape[-1]).float().contiguous(), float(top_p)).view(shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of [N, V] probabilities (a CUDA generator, or None for the device's default): ids [N]."""
    sampling = _sampling(probs.device)
    return sampling.sampling_from_probs(probs.float().contiguous(), generator=generator).long()


def accept_chain(
    draft_tokens: torch.Tensor,  # [B, k] d_j ~ q_j
    draft_probs: torch.Tensor,  # [B, k, V] q_j
    target_probs: torch.Tensor,  # [B, k+1, V] p_j
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain speculative sampling by ``flashinfer.sampling.chain_speculative_sampling`` (accept d_j with
    probability min(1, p/q), resample the first rejection from norm(max(p - q, 0)), a bonus token from p_k
    after k accepts): the number of accepted drafts [B] and the token after them [B], as
    :func:`eagle31_mla.decoding.speculative.accept_chain` returns them."""
    sampling = _sampling(draft_probs.device)
    out, _, emitted = sampling.chain_speculative_sampling(
        draft_probs.float().contiguous(),
        draft_tokens.to(torch.int32).contiguous(),
        target_probs.float().contiguous(),
        generator=generator,
    )  # out [B, k+1]: the accepted drafts, then the correction / bonus token, then -1
    num_accepted = emitted.long()  # [B] drafts emitted, the bonus not counted
    return num_accepted, out.gather(1, num_accepted[:, None])[:, 0].long()


def _sampling(device):
    return require(device).sampling
