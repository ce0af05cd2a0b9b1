"""TTT's loss as TorchSpec trains it, dense and anchored, TorchSpec's anchor sampler, and the loss mask's index.

The sampler is checked against its rule written out here (TorchSpec's ``torchspec/models/ops/anchors.py``), the loss
against an independent reference (reference_anchored_loss: what serving drafts, weighted as TorchSpec does)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle31_mla.training.trainer import (
    TrainingConfig,
    loss_weight_sums,
    sample_anchors,
    step_anchors,
    ttt_forward,
    ttt_loss,
)
from tests.support.tiny import TOL, aux_inputs, draft_step_by_step, tiny_drafter

pytestmark = pytest.mark.transformers


def candidates_of(weights: torch.Tensor, depth: int) -> list[int]:
    """TorchSpec's candidates, written out: a < min(S - depth + 1, S - 1), trained at a and a + 1."""
    S = weights.shape[-1]
    return [a for a in range(min(S - depth + 1, S - 1)) if weights[a] > 0 and weights[a + 1] > 0]


@pytest.mark.parametrize("max_gap", [None, 0, 2, 50])
def test_anchors_follow_torchspecs_rule_literally(max_gap):
    """Of a sequence's c candidates, slot s takes candidate (phase + s * stride) mod c: the phase drawn from its
    seed, the stride c // N clamped to [1, max_gap + 1]; the slots beyond c stay empty."""
    g = torch.Generator().manual_seed(7)
    B, S, depth, N = 6, 40, 4, 5
    weights = (torch.rand(B, S, generator=g) < 0.7).float()
    weights[0] = 0  # a sequence with nothing trained: every slot empty
    weights[1, :] = 0
    weights[1, 10:13] = 1  # two candidates only: three slots stay empty
    anchors = sample_anchors(weights, N, depth, list(range(B)), max_gap)
    assert anchors.shape == (B, N) and anchors.dtype == torch.long
    gap = depth if max_gap is None else max_gap
    for b in range(B):
        candidates = candidates_of(weights[b], depth)
        c = len(candidates)
        kept = [a for a in anchors[b].tolist() if a >= 0]
        assert len(kept) == min(N, c) and anchors[b, len(kept) :].eq(-1).all()
        if c == 0:
            continue
        stride = min(max(c // N, 1), gap + 1)
        phase = int(torch.rand((), generator=torch.Generator().manual_seed(b)) * c)
        assert kept == [candidates[(phase + s * stride) % c] for s in range(len(kept))]
        assert len(set(kept)) == len(kept)  # the wrap never lands on a slot twice
    assert anchors[0].eq(-1).all() and sorted(anchors[1, :2].tolist()) == [10, 11]


def test_every_candidate_is_drawn_as_often_as_uniform_sampling_would():
    """Each candidate's inclusion probability is num_anchors / candidates (the phase is drawn over all of
    them, wrapping): over 4000 seeds, each count within 5 standard deviations of the binomial mean."""
    S, depth, N, draws = 30, 3, 4, 4000
    weights = torch.ones(1, S)
    weights[0, 12:15] = 0  # a gap in the trained positions
    candidates = candidates_of(weights[0], depth)
    counts = torch.zeros(S)
    for seed in range(draws):
        for a in sample_anchors(weights, N, depth, [seed])[0].tolist():
            counts[a] += 1
    p = N / len(candidates)
    mean, sd = draws * p, math.sqrt(draws * p * (1 - p))
    assert counts[[a for a in range(S) if a not in candidates]].eq(0).all()
    assert (counts[candidates] - mean).abs().max() < 5 * sd, counts[candidates]
    # control: the middle-heavy draw TorchSpec's comment warns of (the phase over the slack only) fails it
    slack = torch.zeros(S)
    stride = min(len(candidates) // N, depth + 1)  # 24 // 4 = 6, clamped to 4: a window of 16 of the 24
    for seed in range(draws):
        phase = int(
            torch.rand((), generator=torch.Generator().manual_seed(seed)) * (len(candidates) - (N - 1) * stride)
        )
        for s in range(N):
            slack[candidates[phase + s * stride]] += 1
    assert (slack[candidates] - mean).abs().max() >= 5 * sd


def reference_anchored_loss(drafter, ids, aux, probs, depth, anchors, torchspec_mask, decay):
    """TorchSpec's anchored loss, independently: anchor a at depth d is fed x[a+1+d] at rope position a+d
    after drafting d steps from a context ending at a (computed here with a cache, step by step), trained
    towards P[a+1+d], weighted by its mask at a+d (TorchSpec's index) and by the slot being used; per
    depth the weighted mean, then sum_d decay^d x loss_d."""
    sums, counts = torch.zeros(depth), torch.zeros(depth)
    for b in range(ids.shape[0]):
        for a in [a for a in anchors[b].tolist() if a >= 0]:
            # depths past the sequence's end (a + 1 + d >= S) are not drafted: they weigh 0
            for d, logits in enumerate(draft_step_by_step(drafter, ids[b : b + 1], aux[b : b + 1], a, depth)):
                p, gate = probs[b, a + 1 + d], torchspec_mask[b, a + d]
                sums[d] += gate * (torch.special.xlogy(p, p) - p * F.log_softmax(logits[0], -1)).sum()
                counts[d] += gate
    return sum(decay**d * sums[d] / counts[d].clamp_min(1) for d in range(depth))


@pytest.mark.parametrize("anchored", [True, False])
def test_the_loss_is_torchspecs_with_its_mask_one_token_earlier(anchored):
    """Dense (every position an anchor) or anchored, weighted over depths 0.8^k as TorchSpec's recipe does."""
    drafter = tiny_drafter(seed=11)
    B, S, depth = 2, 14, 3
    ids, aux = aux_inputs(drafter.config, B, S, seed=3)
    probs = torch.softmax(torch.randn(B, S, drafter.config.vocab_size, generator=torch.Generator().manual_seed(5)), -1)
    mask = torch.ones(B, S)
    mask[0, :4] = 0  # a prompt
    mask[1, 9:] = 0  # the end of the assistant turn
    config = TrainingConfig(num_anchors=4 if anchored else None, depth=depth, seed=3)
    with torch.no_grad():
        anchors = step_anchors(drafter, probs, mask, config, step=0, sequence_indices=[0, 1])
        ours, _ = ttt_loss(drafter, ids, aux, probs, depth, loss_mask=mask, anchors=anchors, depth_decay=0.8)
        torchspec_mask = torch.cat([mask[:, 1:], torch.zeros(B, 1)], dim=1)  # mask_ts[t] = mask[t + 1]
        every = anchors if anchored else torch.arange(S - 1).expand(B, -1)  # (S - 1 predicts nothing)
        expected = reference_anchored_loss(drafter, ids, aux, probs, depth, every, torchspec_mask, 0.8)
    assert not anchored or (anchors >= 0).sum() >= 5
    assert torch.allclose(ours, expected, rtol=TOL), (ours, expected)
    # control: TorchSpec's index applied to the unshifted mask is another objective, and the check sees it
    with torch.no_grad():
        unshifted = reference_anchored_loss(drafter, ids, aux, probs, depth, every, mask, 0.8)
    assert not torch.allclose(unshifted, expected, rtol=1e-3)


def test_the_mask_gates_the_fed_token():
    """Depth k at position t counts where x[t+1+k] is trained on: marking one token j trains exactly the
    predictions fed x[j], one per depth (at t = j-1-k)."""
    drafter = tiny_drafter(seed=2)
    S, depth, j = 10, 3, 6
    ids, aux = aux_inputs(drafter.config, 1, S)
    probs = torch.softmax(torch.randn(1, S, drafter.config.vocab_size), -1)
    mask = torch.zeros(1, S)
    mask[0, j] = 1
    assert loss_weight_sums(drafter, probs, depth, mask).tolist() == [1.0] * depth
    with torch.no_grad():
        for k, (rows, _, fed) in enumerate(ttt_forward(drafter, ids, aux, depth)):
            assert rows[fed == j].tolist() == [j - 1 - k]


def test_anchors_do_not_depend_on_which_batch_holds_a_sequence():
    """A sequence's anchors come from (seed, step, its index): the same alone or with others, as data-parallel
    ranks and micro-batches need."""
    drafter = tiny_drafter(seed=1)
    probs = torch.softmax(torch.randn(3, 20, drafter.config.vocab_size), -1)
    config = TrainingConfig(num_anchors=3, depth=3, seed=9)
    together = step_anchors(drafter, probs, None, config, 4, [7, 8, 9])
    alone = step_anchors(drafter, probs[1:2], None, config, 4, [8])
    assert torch.equal(together[1:2], alone)
    assert not torch.equal(step_anchors(drafter, probs, None, config, 5, [7, 8, 9]), together)
