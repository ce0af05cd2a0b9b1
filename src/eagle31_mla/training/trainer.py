"""Train the drafter against a Transformers target with test-time training (TTT), as TorchSpec does.

For a sequence x of S tokens the target gives, at every position t, its aux states A[t] and its next-token
distribution P[t] (over x[t+1]). The drafter is unrolled ``depth`` steps over all positions at once:

* depth 0: position t is fed embed(x[t+1]) and fc(A[t]) at rope position t; it predicts x[t+2], trained towards
  P[t+1] (forward KL);
* depth k >= 1: position t is fed embed(x[t+1+k]) and its own depth-(k-1) output state at rope position t+k,
  trained towards P[t+1+k]. It attends to the depth-0 keys of positions <= t and to its own keys of depths
  1..k ("diagonal extension"): exactly what it sees when drafting k tokens after t at serving time.

The loss mask (``loss_mask[j]`` about token x[j]) gates each prediction by the token it is fed: depth k at t counts
where x[t+1+k] is trained-on text (TorchSpec gates by mask[t+k]: the same loss given its mask shifted left by one).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..decoding.target import capture_target_states
from ..locations import atomic_write
from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM, LatentKVCache
from ..prompts import eos_token_ids

logger = logging.getLogger(__name__)


class ConcatKVCache(LatentKVCache):
    """Appends by concatenation, so autograd sees no in-place writes; a LatentKVCache for the drafter's checks."""

    def __init__(self, batch_size: int):
        self.latent = torch.empty(batch_size, 0, 0)  # its width and dtype: the first update's
        self.owner = None  # bound by the drafter's forward

    def get_seq_length(self) -> int:
        return self.latent.shape[1]

    def update(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        new = torch.cat([c_kv, k_pe], dim=-1)  # [B, T, C+R]
        self.latent = torch.cat([self.latent, new], dim=1) if self.latent.shape[1] else new
        return self.latent


class TTTAttention:
    """The attention of a TTT unroll, in memory linear in the sequence; one object for every depth (the drafter's
    attention hands it q, its latent cache and how to decompress it, ``attend``, instead of applying a
    [T, S + k·T] mask). At depth k each query row (a position t, or an anchor) sees the depth-0 keys at positions
    <= t and its own keys at depths 1..k (the "diagonal"), one softmax over both. Each depth's latents are
    decompressed through kv_b_proj once and kept (the drafter's cache keeps latents: decompressing all of them at
    every depth cost 1 + 2 + ... + k sequence-lengths of rows).

    Depth 0 is plain causal attention: PyTorch's scaled-dot-product attention with ``is_causal`` (its flash
    kernels, CPU's too, where the device has them; they need the value padded to the key's width). Deeper, the
    query rows go in blocks of :data:`BLOCK_ROWS` (fewer where a block would pass :data:`CHUNK_SCORES` scores): a
    block's rows against the keys up to its last row (the causal triangle, a block wide), plus each row's k own
    keys, by :class:`_DiagonalAttention`; when the scores of all blocks pass :data:`CHUNK_SCORES`, each block is
    recomputed in the backward pass (checkpointed), so no block's scores outlive it. The dense mask
    (tests/support/reference_math.py) stays as the test oracle."""

    #: scores kept for the backward pass (batch x heads x rows x keys): 2^26 fp32 scores, 256 MB
    CHUNK_SCORES = 2**26
    #: query rows per block: the keys past a block's last row are not computed (at 2k tokens, 5/8 of the square)
    BLOCK_ROWS = 512

    def __init__(self, S: int, anchors: torch.Tensor | None):
        self.S, self.anchors = S, anchors  # anchors [B, N]: depth >= 1's query rows (None: every position)
        self.keys: list[torch.Tensor] = []  # per depth: [B, h, S or T, D]
        self.values: list[torch.Tensor] = []  # per depth: [B, h, S or T, V]
        self.decompressed = 0  # latent rows

    def attend(self, q: torch.Tensor, latent: torch.Tensor, keys_values, scale: float) -> torch.Tensor:
        """q [B, h, T, D], latent [B, S + depth·T, C+R], ``keys_values``: latents -> keys, values -> [B, h, T, V]."""
        k_new, v_new = keys_values(latent[:, self.decompressed :])
        self.keys.append(k_new)
        self.values.append(v_new)
        self.decompressed = latent.shape[1]
        if len(self.keys) == 1:  # depth 0; flash kernels want the value as wide as the key: zeros added, then cut off
            width = v_new.shape[-1]
            v = F.pad(v_new, (0, q.shape[-1] - width))
            return F.scaled_dot_product_attention(q, k_new, v, is_causal=True, scale=scale)[..., :width]
        (k, *own_k), (v, *own_v) = self.keys, self.values
        own_k, own_v = torch.stack(own_k, dim=2), torch.stack(own_v, dim=2)  # [B, h, d, T, .]
        B, h, T, _ = q.shape
        S, d = self.S, own_k.shape[2]
        rows = torch.arange(T, device=q.device) if self.anchors is None else self.anchors.clamp(min=0)
        step = max(1, min(self.BLOCK_ROWS, self.CHUNK_SCORES // (B * h * (S + d))))
        checkpointed = B * h * T * (S + d) > self.CHUNK_SCORES and torch.is_grad_enabled()
        # one dtype for the hand-made backward: autocast's (bf16 compute) where it is on, as the matmuls would get
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        q, k, v, own_k, own_v = (q * scale).to(dtype), k.to(dtype), v.to(dtype), own_k.to(dtype), own_v.to(dtype)
        blocks = []
        for start in range(0, T, step):
            part = slice(start, start + step)
            # the keys the block's latest row sees (every position's rows are in order: no device sync)
            reach = min(start + step, T) if self.anchors is None else int(rows[..., part].max()) + 1
            hidden = torch.arange(reach, device=q.device) > rows[..., part, None]  # [(B,) C, L]
            args = (q[:, :, part], k[:, :, :reach], v[:, :, :reach], own_k[:, :, :, part], own_v[:, :, :, part])
            args += (hidden[:, None] if hidden.dim() == 3 else hidden,)
            if checkpointed:
                blocks.append(torch.utils.checkpoint.checkpoint(_DiagonalAttention.apply, *args, use_reentrant=False))
            else:
                blocks.append(_DiagonalAttention.apply(*args))
        return torch.cat(blocks, dim=2)


class _DiagonalAttention(torch.autograd.Function):
    """Softmax attention of query rows q [B, h, C, D] (scaled) over context keys [B, h, L, D] (those ``hidden``
    [(B, 1,) C, L] masked out) and their own keys [B, h, k, C, D], one softmax over both, in fp32. Written by hand
    because PyTorch's fused attention takes no per-row keys, and autograd through the concatenated scores
    allocates a fresh [C, L + k] tensor at each step (concatenation, softmax, slicing, and each of their
    backwards); here the context's scores are made once and then worked on in place, as flash attention does."""

    @staticmethod
    def forward(ctx, q, k, v, own_k, own_v, hidden):
        scores = torch.matmul(q, k.transpose(-1, -2)).float().masked_fill_(hidden, float("-inf"))  # [B, h, C, L]
        own = torch.einsum("bhcd,bhkcd->bhck", q, own_k).float()  # [B, h, C, k]
        top = torch.maximum(scores.amax(-1), own.amax(-1))[..., None]
        p, p_own = scores.sub_(top).exp_(), (own - top).exp()
        total = p.sum(-1, keepdim=True) + p_own.sum(-1, keepdim=True)
        p, p_own = p.div_(total).to(q.dtype), p_own.div_(total).to(q.dtype)  # the probabilities
        out = torch.matmul(p, v) + torch.einsum("bhck,bhkcv->bhcv", p_own, own_v)  # [B, h, C, V]
        ctx.save_for_backward(q, k, v, own_k, own_v, p, p_own, out)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, own_k, own_v, p, p_own, out = ctx.saved_tensors
        d_out = d_out.to(q.dtype)
        # d score_j = p_j (d_out . v_j - d_out . out): the softmax's backward over both parts
        centre = (d_out.float() * out.float()).sum(-1, keepdim=True)  # [B, h, C, 1]
        d_scores = torch.matmul(d_out, v.transpose(-1, -2)).float().sub_(centre).mul_(p).to(q.dtype)  # [B, h, C, L]
        d_own = torch.einsum("bhcv,bhkcv->bhck", d_out, own_v).float().sub_(centre).mul_(p_own).to(q.dtype)
        d_q = torch.matmul(d_scores, k) + torch.einsum("bhck,bhkcd->bhcd", d_own, own_k)
        d_k = torch.matmul(d_scores.transpose(-1, -2), q)
        d_v = torch.matmul(p.transpose(-1, -2), d_out)
        d_own_k = torch.einsum("bhck,bhcd->bhkcd", d_own, q)
        d_own_v = torch.einsum("bhck,bhcv->bhkcv", p_own, d_out)
        return d_q, d_k, d_v, d_own_k, d_own_v, None


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, S, ...] at positions ``index``: [T] (the same for every sequence) or [B, T] (per sequence)."""
    if index.dim() == 1:
        return values[:, index]
    return values[torch.arange(values.shape[0], device=values.device)[:, None], index]


def depth_rows(S: int, anchors: torch.Tensor | None, device) -> torch.Tensor:
    """The query positions: every position [S], or the anchors [B, N] (an empty slot, -1, reads position 0)."""
    return torch.arange(S, device=device) if anchors is None else anchors.clamp(min=0)


def fed_positions(S: int, k: int, anchors: torch.Tensor | None, device) -> torch.Tensor:
    """The fed token's index t+1+k per query row ([S], or [B, N]; an empty slot gets S, which weighs nothing)."""
    fed = depth_rows(S, anchors, device) + 1 + k
    return fed if anchors is None else torch.where(anchors >= 0, fed, S)


def _loss_weight(drafter, target_top: torch.Tensor, loss_mask, fed: torch.Tensor) -> torch.Tensor:
    """[B, T]: rows whose fed token is trained-on text in the sequence and whose target argmax (``target_top``
    [B, S], the target's vocabulary) has a draft token."""
    S = target_top.shape[1]
    index = fed.clamp(max=S - 1)
    weight = (fed < S).float().expand(target_top.shape[0], -1)
    if loss_mask is not None:
        weight = weight * _at(loss_mask, index)
    if drafter.d2t is not None:
        weight = weight * drafter.t2d[_at(target_top, index)]
    return weight


def loss_weight_sums(drafter, target_probs, depth: int, loss_mask=None, anchors=None) -> torch.Tensor:
    """[depth]: the loss weights summed per depth, without running the drafter (for data-parallel ranks)."""
    S, device, top = target_probs.shape[1], target_probs.device, target_probs.argmax(-1)
    fed = [fed_positions(S, k, anchors, device) for k in range(depth)]
    return torch.stack([_loss_weight(drafter, top, loss_mask, f).sum() for f in fed])


def sample_anchors(
    weights: torch.Tensor,  # [B, S]: the depth-0 loss weight of each position (_loss_weight at t+1)
    num_anchors: int,
    depth: int,
    seeds: list[int],
    max_gap: int | None = None,
) -> torch.Tensor:
    """[B, num_anchors] anchor positions per sequence (-1: an empty slot), by TorchSpec's sampler
    (``torchspec/models/ops/anchors.py``; the rule in docs/training.md). Candidates need their first two
    predictions trained: an isolated trained token gives no gradient past depth 0. ``seeds`` (one per
    sequence) fix the phase, so a sequence gets the same anchors whichever rank or micro-batch holds it."""
    B, S = weights.shape
    max_gap = depth if max_gap is None else max_gap
    anchors = torch.full((B, num_anchors), -1, dtype=torch.long)
    num_candidates = min(S - depth + 1, S - 1)
    if num_candidates <= 0:
        logger.warning("sequences of %d tokens are too short for anchors at depth %d: no loss", S, depth)
        return anchors.to(weights.device)
    trained = weights.detach().cpu() > 0
    valid = trained[:, :num_candidates] & trained[:, 1 : num_candidates + 1]
    slot = torch.arange(num_anchors)
    for b in range(B):
        candidates = valid[b].nonzero().flatten()
        count = candidates.numel()
        if count == 0:
            continue
        stride = min(max(count // num_anchors, 1), max_gap + 1)
        phase = int(torch.rand((), generator=torch.Generator().manual_seed(seeds[b])) * count)
        kept = slot < count
        anchors[b, kept] = candidates[(phase + slot[kept] * stride) % count]
    return anchors.to(weights.device)


def step_anchors(drafter, target_probs, loss_mask, config: TrainingConfig, step: int, sequence_indices):
    """The anchors of one step's sequences (None without ``config.num_anchors``), seeded by (seed, step, index)."""
    if config.num_anchors is None:
        return None
    S = target_probs.shape[1]
    fed = fed_positions(S, 0, None, target_probs.device)
    weights = _loss_weight(drafter, target_probs.argmax(-1), loss_mask, fed)
    seeds = [((config.seed * 1_000_003 + step) * 1_000_003 + int(i)) % 2**63 for i in sequence_indices]
    return sample_anchors(weights, config.num_anchors, config.depth, seeds, config.anchor_max_gap)


def ttt_forward(
    drafter: Eagle31MLAForCausalLM,
    input_ids: torch.Tensor,  # [B, S]
    aux: torch.Tensor,  # [B, S, n·Ht]
    depth: int,
    anchors: torch.Tensor | None = None,  # [B, N] or [N]: anchored TTT (sample_anchors), -1 = empty slot
):
    """Unroll the drafter ``depth`` steps; yields per depth k (query positions [S] or [B, N], the states ``lm_head``
    reads [B, T, H] (its logits are left to the loss, a chunk at a time), :func:`fed_positions`). With anchors,
    depth 0 still runs dense (its keys are every depth's context) and yields the anchors' rows; depths >= 1 run at
    the anchors alone."""
    B, S = input_ids.shape
    device = input_ids.device
    if anchors is not None and anchors.dim() == 1:
        anchors = anchors.expand(B, -1)
    cache, state = ConcatKVCache(B), None
    attention = TTTAttention(S, anchors)
    for k in range(depth):
        rows = depth_rows(S, None if k == 0 else anchors, device)  # depth 0 runs dense
        if k == 1 and anchors is not None:
            state = _at(state, rows)
        token_at = (rows + 1 + k).clamp(max=S - 1)  # x[t+1+k] is fed; past the end it is masked out
        out = drafter(
            _at(input_ids, token_at),
            aux_hidden_states=aux if k == 0 else None,
            hidden_states=state if k else None,
            position_ids=(rows + k).expand(B, -1),
            past_key_values=cache,
            attention_mask=attention,
            use_cache=True,
            absorb=False,
            logits_to_keep=NO_LOGITS,
        )
        state = out.hidden_states
        head = state if drafter.config.norm_output else drafter.norm(state)  # what lm_head reads
        if k == 0 and anchors is not None:
            head = _at(head, depth_rows(S, anchors, device))
        yield depth_rows(S, anchors, device), head, fed_positions(S, k, anchors, device)


def ttt_loss_terms(
    drafter: Eagle31MLAForCausalLM,
    input_ids: torch.Tensor,  # [B, S]
    aux: torch.Tensor,  # [B, S, n·Ht]
    target_probs: torch.Tensor,  # [B, S, V] next-token distributions of the target
    depth: int,
    loss_mask: torch.Tensor | None = None,  # [B, S] 1 where the token is trained-on text (gates the fed token)
    anchors: torch.Tensor | None = None,  # [B, N] (sample_anchors)
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per depth k, summed over the batch (data-parallel ranks add theirs before dividing): weighted forward KL,
    weights, weighted top-1 agreement. A pruned vocabulary renormalises the target's mass over the draft's."""
    S, device = input_ids.shape[1], input_ids.device
    target_top = target_probs.argmax(-1)  # [B, S]: once per step, read by every depth
    weights = [_loss_weight(drafter, target_top, loss_mask, fed_positions(S, k, anchors, device)) for k in range(depth)]
    probs = target_probs
    if drafter.d2t is not None:  # pruned vocabulary: the target's mass over the draft vocabulary
        probs = probs[..., drafter.draft_to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=device))]
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
        target_top = probs.argmax(-1)  # in the draft vocabulary, as the drafter's argmax is
    # forward KL(P || Q) = sum P log P - sum P log Q. The first term, a constant that only makes the value readable,
    # is taken once per position (each depth reads it shifted), not per depth.
    neg_entropy = torch.special.xlogy(probs, probs).sum(-1)  # [B, S]
    terms = []
    unrolled = ttt_forward(drafter, input_ids, aux, depth, anchors)
    for k, ((_, head, fed), weight) in enumerate(zip(unrolled, weights)):
        index = fed.clamp(max=S - 1)  # P[t+1+k]: the target's distribution of x[t+2+k] (an empty slot weighs 0)
        if anchors is None:  # rows t < S-1-k (the rest are fed past the end, weight 0): the target's rows are a view
            n = S - 1 - k
            rows = head[:, :n], probs[:, 1 + k :], weight[:, :n], target_top[:, 1 + k :]
        else:
            rows = head, _at(probs, index), weight, _at(target_top, index)
        cross, agree = _cross_entropy(drafter.lm_head, *rows)
        kl = cross + (_at(neg_entropy, index) * weight).sum()
        terms.append((kl, weight.sum(), agree.detach()))
    return terms


#: logits per loss chunk (rows x vocabulary): 2^26 fp32 values, 256 MB (Kimi-K3's vocabulary: 409 rows)
LOSS_CHUNK = 2**26
#: ``logits_to_keep`` that keeps none: TTT's loss takes the logits from the states, a chunk at a time
NO_LOGITS = torch.zeros(0, dtype=torch.long)


def _cross_entropy(lm_head, states, probs, weights, top) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i w_i (logsumexp(z_i) - P_i . z_i) with z_i = lm_head(states_i) (the KL to P_i up to P_i's entropy), and
    sum_i w_i [argmax z_i = top_i], over the rows of states [B, n, H], probs [B, n, V], weights and top [B, n]; the
    logits a chunk of :data:`LOSS_CHUNK` at a time, recomputed in the backward pass when there is more than one
    chunk: no [rows, vocabulary] tensor outlives its chunk. The chunks run over the B·n rows, so data-parallel
    ranks with the same shapes call ``lm_head`` equally often (FSDP gathers it per call)."""
    B, n = weights.shape
    step = max(1, LOSS_CHUNK // probs.shape[-1])
    checkpointed = B * n > step and torch.is_grad_enabled()

    def chunk(start: int, stop: int, x):
        logits = lm_head(x).float()  # [c, V]: lm_head called as a module, its hooks (FSDP's gather) run
        p, w, t = (_flat_rows(v, start, stop) for v in (probs, weights, top))
        return SoftCrossEntropy.apply(logits, p, w, t)

    total = torch.zeros((), device=states.device), torch.zeros((), device=states.device)
    for start in range(0, B * n, step):
        stop = min(start + step, B * n)
        x = _flat_rows(states, start, stop)
        if checkpointed:
            part = torch.utils.checkpoint.checkpoint(chunk, start, stop, x, use_reentrant=False)
        else:
            part = chunk(start, stop, x)
        total = (total[0] + part[0], total[1] + part[1])
    return total


def _flat_rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of x [B, n, ...] as if flattened to [B·n, ...]: a view when they lie in one sequence."""
    n = x.shape[1]
    pieces = [x[b, max(start - b * n, 0) : stop - b * n] for b in range(start // n, (stop - 1) // n + 1)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class SoftCrossEntropy(torch.autograd.Function):
    """(sum_i w_i (logsumexp(z_i) - P_i . z_i), sum_i w_i [argmax z_i = top_i]) of logits z [c, V], fp32, which
    nothing else reads (``lm_head``'s fresh output: it is overwritten). Written by hand because autograd's version of
    this formula allocates a new [c, V] tensor at each of its elementwise steps (about ten, forward and backward):
    on CPU those cost more than the attention of every depth. Here the gradient w_i (softmax(z_i) - P_i) is made
    in z's own buffer in seven passes, and only the [c] row statistics are new."""

    @staticmethod
    def forward(ctx, logits, p, w, top):
        with torch.autocast(logits.device.type, enabled=False):  # under bf16 autocast the dot would be bf16
            p = p.to(logits.dtype)
            best, choice = logits.max(-1)
            dot = torch.einsum("cv,cv->c", p, logits)  # P_i . z_i, a batched dot: no [c, V] product
            e = logits.sub_(best[:, None]).exp_()  # exp(z_i - max z_i)
            total = e.sum(-1)
            cross = total.log() + best - dot
        ctx.save_for_backward(e, p, w, total)
        ctx.used = False
        return (cross * w).sum(), ((choice == top) * w).sum()

    @staticmethod
    def backward(ctx, grad_cross, _grad_agree):
        if ctx.used:  # the gradient is written over the saved exponentials
            raise RuntimeError("SoftCrossEntropy's backward runs once: do not retain the graph")
        ctx.used = True
        e, p, w, total = ctx.saved_tensors
        scale = (grad_cross * w)[:, None]
        return e.mul_(scale / total[:, None]).addcmul_(p, scale, value=-1), None, None, None


def combine_depth_losses(
    terms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], depth_decay: float | None = None
) -> tuple[torch.Tensor, list[float]]:
    """Per depth the weighted mean KL of :func:`ttt_loss_terms`; then their mean (``depth_decay`` None) or
    TorchSpec's sum of d^k x loss_k (0.8 in its recipes: depth 0 matters most for accept length)."""
    losses = torch.stack([kl / weight.clamp_min(1) for kl, weight, _ in terms])
    accuracy = [float(agree / weight.clamp_min(1)) for _, weight, agree in terms]
    if depth_decay is None:
        return losses.mean(), accuracy
    weights = depth_decay ** torch.arange(len(losses), device=losses.device, dtype=losses.dtype)
    return (weights * losses).sum(), accuracy


def ttt_loss(*args, depth_decay: float | None = None, **kwargs) -> tuple[torch.Tensor, list[float]]:
    """(the loss, the top-1 agreement per depth): :func:`ttt_loss_terms` (its arguments) combined by
    :func:`combine_depth_losses`."""
    return combine_depth_losses(ttt_loss_terms(*args, **kwargs), depth_decay)


@dataclass
class TrainingConfig:
    """Defaults train a small drafter from scratch; :meth:`finetune` is the published drafter's recipe."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    depth: int = 4  # TTT unroll length
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 50
    num_anchors: int | None = None  # anchored TTT: train at this many anchors per sequence (sample_anchors)
    anchor_max_gap: int | None = None  # trained positions between neighbouring anchors at most (None: depth)
    seed: int = 0
    save_every: int = 250
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    depth_decay: float | None = None  # None: mean over depths; d: sum of d^k x loss_k (TorchSpec: 0.8)
    compute_dtype: str | None = None  # "bfloat16": autocast compute, float32 master weights and optimizer
    export_dtype: str | None = None  # the published export's dtype; then checkpoints go to OUT/checkpoint
    log: list = field(default_factory=list)

    @classmethod
    def finetune(cls, steps: int = 1000, **overrides) -> TrainingConfig:
        """TorchSpec's recipe for the published drafter, to fine-tune it (``train --init``): AdamW (0.9, 0.999) at
        2e-5, 1.5% linear warmup then cosine, clip 1.0, 7 unroll steps weighted 0.8^k and summed, bf16 compute on
        float32 master weights, the export in bf16 as published."""
        recipe = dict(steps=steps, lr=2e-5, betas=(0.9, 0.999), warmup=max(1, round(0.015 * steps)), depth=7)
        recipe.update(depth_decay=0.8, compute_dtype="bfloat16", export_dtype="bfloat16")
        return cls(**{**recipe, **overrides})


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The one-based aux ids a new drafter for a ``num_layers``-deep target reads: the engines' default
    ``(2, n // 2, n - 3)`` where those ascend (n >= 7); below that ``(1, n // 2, n - 1)`` (4 layers: the demo
    drafter's ``[1, 2, 3]``), or every layer of a target under 4 layers."""
    from ..model.aux_layers import engine_default_one_based_ids

    if num_layers >= 7:
        return engine_default_one_based_ids(num_layers)
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    return list(range(1, num_layers + 1))


#: The settings of a drafter's own layer (not the target's sizes): what ``train --draft-config`` copies from another
#: drafter's config.json; without it a new drafter has the published drafter's.
LAYER_SETTINGS = (
    "intermediate_size num_attention_heads q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "max_position_embeddings rms_norm_eps hidden_act rope_parameters"
).split()


def layer_settings(config_json: dict) -> dict:
    """:data:`LAYER_SETTINGS` of a drafter's config.json, read and checked as the drafter reads it."""
    from ..model.configuration_eagle31_mla import Eagle31MLAConfig

    config = Eagle31MLAConfig.from_dict(config_json)
    return {key: copy.deepcopy(getattr(config, key)) for key in LAYER_SETTINGS}


def drafter_for_target(target, **config_overrides) -> Eagle31MLAForCausalLM:
    """A drafter sized for ``target``, starting as EAGLE drafters do: the target's embeddings (frozen) and lm_head."""
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    return _new_drafter(target.config.get_text_config(), embed, head, **config_overrides)


def _new_drafter(tc, embed: torch.Tensor, head: torch.Tensor, **config_overrides) -> Eagle31MLAForCausalLM:
    from ..model.configuration_eagle31_mla import Eagle31MLAConfig

    if config_overrides.get("eagle_aux_hidden_state_layer_ids") is None:
        config_overrides["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(tc.num_hidden_layers)
    sizes = dict(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size)
    ids = dict(bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
    kwargs = dict(**sizes, **ids, target_num_hidden_layers=tc.num_hidden_layers, dtype=torch.float32)
    drafter = Eagle31MLAForCausalLM(Eagle31MLAConfig(**{**kwargs, **config_overrides}))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
        drafter.lm_head.weight.copy_(head)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def target_embeddings(target_path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embeddings and ``lm_head`` [V, H] from its checkpoint alone (a Kimi-K3 does not fit here)."""
    from safetensors import safe_open

    from ..locations import model_folder, safetensors_files

    folder = model_folder(target_path)
    found: dict[str, tuple[str, torch.Tensor]] = {}
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                key = next((k for k in ("embed_tokens.weight", "lm_head.weight") if name.endswith(k)), None)
                if key is None or "vision" in name or "mtp" in name:
                    continue
                if key in found:
                    raise ValueError(f"{folder}: two tensors end with {key} ({found[key][0]}, {name})")
                found[key] = (name, f.get_tensor(name))
    if "embed_tokens.weight" not in found:
        raise ValueError(f"{folder}: no `embed_tokens.weight` tensor; expected a causal LM checkpoint")
    embed = found["embed_tokens.weight"][1]
    return embed, found.get("lm_head.weight", (None, embed))[1]  # tie_word_embeddings


def drafter_from_files(target_path: str | Path, **config_overrides) -> Eagle31MLAForCausalLM:
    """:func:`drafter_for_target` from the target's config and two of its tensors, without loading it."""
    from transformers import AutoConfig

    embed, head = target_embeddings(target_path)
    return _new_drafter(AutoConfig.from_pretrained(target_path).get_text_config(), embed, head, **config_overrides)


def drafter_to_finetune(path: str | Path, embed: torch.Tensor) -> Eagle31MLAForCausalLM:
    """A trained drafter to fine-tune as TorchSpec does: float32 master weights, the target's embedding, frozen."""
    drafter = Eagle31MLAForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tuple(embed.shape) != tuple(drafter.embed_tokens.weight.shape):
        raise ValueError(
            f"the drafter's embedding is {list(drafter.embed_tokens.weight.shape)} but the target's is "
            f"{list(embed.shape)}: fine-tune a drafter against the target it was trained for"
        )
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


class _Batches:
    """What the training loops ask of their data besides batches: each step's sequences, and the hooks a stream
    through a spool needs (:class:`eagle31_mla.training.spool.FollowTarget`)."""

    def step_indices(self, step: int, config: TrainingConfig) -> torch.Tensor:
        """A function of (seed, step): a resumed run sees the uninterrupted run's batches."""
        epoch, index = divmod(step, max(1, len(self) // config.batch_size))
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch))
        return order[index * config.batch_size : (index + 1) * config.batch_size]

    def stalled(self, step: int, config: TrainingConfig) -> bool:
        """Whether a checkpoint now would let the data for ``step`` arrive (it frees the spool)."""
        return False

    def checkpointed(self, step: int, config: TrainingConfig, remove: bool = True) -> None:
        """A checkpoint after ``step`` steps is complete on every rank; ``remove`` (one rank): free what it covers."""


def _padded(rows: list[torch.Tensor], length: int = 0) -> torch.Tensor:
    """[B, S, ...]: the rows [S_b, ...] zero-padded at the end to the longest, or to ``length``."""
    batch = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return F.pad(batch, (0, 0) * (batch.dim() - 2) + (0, max(length - batch.shape[1], 0)))


class LiveTarget(_Batches):
    """Batches from a target run on each, padded at the end and masked (causal: padding changes no state before it)."""

    def __init__(self, target, sequences, loss_masks=None):
        self.target, self.sequences, self.loss_masks = target.eval(), sequences, loss_masks
        self.device = target.device

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, indices: torch.Tensor, aux_layer_ids):
        """(input ids [B, S], aux states [B, S, n·H], target distributions [B, S, V], loss mask [B, S])."""
        rows = [torch.as_tensor(self.sequences[int(i)]).long() for i in indices]
        masks = [
            torch.ones(len(r)) if self.loss_masks is None else self.loss_masks[int(i)] for i, r in zip(indices, rows)
        ]
        batch = _padded(rows).to(self.device)
        mask = _padded([torch.as_tensor(m).float() for m in masks]).to(self.device)
        aux, probs = capture_target_states(self.target, batch, aux_layer_ids)
        return batch, aux, probs, mask


class CapturedTarget(_Batches):
    """Batches from a capture folder (``eagle31-mla capture``), padded and masked as :class:`LiveTarget`'s."""

    def __init__(self, data, vocab_size: int, device="cpu"):
        self.data, self.vocab_size, self.device = data, vocab_size, torch.device(device)

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices: torch.Tensor, aux_layer_ids, pad_to: int = 0):
        """As :meth:`LiveTarget.batch`; the drafter reads the capture's aux layers (checked where it is made)."""
        rows = [self.data.sequence(int(i)) for i in indices]
        columns = (
            [ids for ids, *_ in rows],
            [states.float() for _, states, *_ in rows],
            [self.data.target_probs(int(i), self.vocab_size) for i in indices],
            [self.data.loss_mask(int(i)) for i in indices],
        )
        return tuple(_padded(column, pad_to).to(self.device) for column in columns)


def train_drafter(
    target,
    drafter: Eagle31MLAForCausalLM,
    sequences,  # [N, seq_len] token ids, or a list of sequences (then with their loss masks)
    out_dir: str | Path,
    config: TrainingConfig,
    progress: bool = True,
    stop_at: int | None = None,
    loss_masks=None,
) -> Eagle31MLAForCausalLM:
    return train_on(LiveTarget(target, sequences, loss_masks), drafter, out_dir, config, progress, stop_at)


def _optimizer(params, config: TrainingConfig):
    """AdamW with a linear warmup then cosine decay over ``config.steps``."""
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=tuple(config.betas))
    warmup = max(1, config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / config.steps)))
    )
    return optimizer, schedule


def _apply_step(optimizer, schedule, config: TrainingConfig, step: int, loss: float, acc, norm) -> None:
    """Step and log; a non-finite loss or gradient skips the step (logged), the schedule still advances."""
    entry = {"step": step + 1, "loss": round(loss, 5), "acc": [round(a, 4) for a in acc], "grad_norm": float(norm)}
    if math.isfinite(loss) and torch.isfinite(norm):
        optimizer.step()
    else:
        entry["skipped"] = "non-finite loss or gradient"
        logger.warning("step %d skipped: non-finite loss or gradient", step + 1)
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    config.log.append(entry)


def train_on(
    states,
    drafter: Eagle31MLAForCausalLM,
    out_dir: str | Path,
    config: TrainingConfig,
    progress: bool = True,
    stop_at: int | None = None,
) -> Eagle31MLAForCausalLM:
    """Train with TTT, checkpointing to and resuming from ``out_dir``; ``stop_at`` stops as an interruption would."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    # with a separate export dtype the float32 master weights are checkpointed apart from the export
    work_dir = out_dir / "checkpoint" if config.export_dtype else out_dir
    state_path = work_dir / "trainer_state.pt"
    drafter.to(states.device)  # one device for both (a GPU when the target is on one), before the optimizer
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer, schedule = _optimizer(params, config)
    start = 0
    if state_path.is_file():  # its weights are the step's (the published files may be a later, interrupted save)
        saved = torch.load(state_path, map_location="cpu", weights_only=True)
        drafter.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        start, config.log = saved["step"], json.loads(saved["log"])
        logger.info("resuming from step %d in %s", start, work_dir)
        states.checkpointed(start, config)
    drafter.train()
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    bar = tqdm(range(start, end), desc="train drafter", disable=not progress, initial=start, total=config.steps)
    for step in bar:
        if states.stalled(step, config):
            save_checkpoint(drafter, optimizer, schedule, step, config, work_dir)
            states.checkpointed(step, config)
        indices = states.step_indices(step, config)
        batch, aux, probs, loss_mask = states.batch(indices, drafter.config.aux_layer_ids)
        anchors = step_anchors(drafter, probs, loss_mask, config, step, indices)
        with _compute(config.compute_dtype, states.device):
            loss, acc = ttt_loss(
                drafter, batch, aux, probs, config.depth, loss_mask, anchors, depth_decay=config.depth_decay
            )
        loss.backward()
        norm = clip_gradients(params, config.grad_clip)
        _apply_step(optimizer, schedule, config, step, loss.item(), acc, norm)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=" ".join(f"{a:.2f}" for a in acc))
        if (step + 1) % config.save_every == 0 or step + 1 == end:
            save_checkpoint(drafter, optimizer, schedule, step + 1, config, work_dir)
            states.checkpointed(step + 1, config)
    if config.export_dtype and end == config.steps:
        export_drafter(drafter, out_dir, getattr(torch, config.export_dtype), config)
    drafter.eval()
    return drafter


def clip_gradients(params, max_norm: float, reduce=None) -> torch.Tensor:
    """Scale the gradients to a total norm <= ``max_norm``; return the norm before. Squares summed in float64 over
    each local gradient (an FSDP shard: ``reduce`` adds the ranks'), so 1 and N ranks clip alike (torch's
    ``clip_grad_norm_`` over FSDP2's sharded gradients was 1e-4 off on gloo with 2 ranks)."""
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            squares += local.double().pow(2).sum()
    if reduce is not None:
        reduce(squares)
    norm = squares.sqrt().float()
    if torch.isfinite(norm):
        scale = min(1.0, max_norm / (float(norm) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _compute(dtype: str | None, device):
    """bf16 compute for the drafter's forward and loss, float32 master weights (torch autocast)."""
    if dtype in (None, "float32"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=getattr(torch, dtype))


def export_drafter(drafter: Eagle31MLAForCausalLM, out_dir: Path, dtype: torch.dtype, config: TrainingConfig) -> None:
    """The published layout in ``dtype`` (bf16 as published), beside the float32 checkpoint."""
    exported = copy.deepcopy(drafter).to(dtype)
    exported.config.dtype = dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    exported.save_pretrained(out_dir)
    write_recipe(out_dir, config)


def save_checkpoint(drafter, optimizer, schedule, step, config, out_dir: Path) -> None:
    """The published layout, then the trainer state written atomically: a killed save resumes the previous step."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(out_dir)
    state = {
        "model": drafter.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "step": step,
        "log": json.dumps(config.log),
    }
    atomic_write(out_dir / "trainer_state.pt", lambda tmp: torch.save(state, tmp))
    write_recipe(out_dir, config)


def write_recipe(out_dir: Path, config: TrainingConfig) -> None:
    """``training.json``: the settings a drafter was trained with (the log stays in the trainer state)."""
    (out_dir / "training.json").write_text(json.dumps({k: v for k, v in asdict(config).items() if k != "log"}))


def tokenize_corpus(tokenizer, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """Concatenate the texts (EOS between them) and cut into [N, seq_len] training sequences."""
    separator = eos_token_ids(tokenizer.eos_token_id)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.extend(separator)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)
