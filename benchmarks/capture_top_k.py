#!/usr/bin/env python3
"""What keeping only the target's top-k log-probabilities (``eagle31-mla capture --top-k``) changes in the
training loss, on the embedded demo pair, and what it costs on disk at Kimi-K3 sizes.

    python benchmarks/capture_top_k.py [--sequences 32]

For held-out demo-style sequences: the probability mass the top-k holds, and the demo drafter's TTT loss
(forward KL per depth, the trainer's own ``ttt_loss``) against the full distribution and against the top-k
renormalised one, with the relative difference. All in one run, on the same sequences.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.decoding.target import capture_target_states
    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.testing import demo_corpus
    from eagle31_mla.training.captured import bytes_per_token
    from eagle31_mla.training.trainer import tokenize_corpus, ttt_loss

    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    drafter = Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32).eval()
    texts, _ = demo_corpus(seed=12345, n=4 * args.sequences)  # not the demo's training seed
    ids = tokenize_corpus(AutoTokenizer.from_pretrained(DEMO_DIR / "target"), texts, args.seq_len)[: args.sequences]
    with torch.no_grad():
        aux, probs = capture_target_states(target, ids, drafter.config.aux_layer_ids)
        full, _ = ttt_loss(drafter, ids, aux, probs, depth=3)
        rows = []
        for k in (1, 4, 16, 64, probs.shape[-1]):
            values, index = probs.topk(k, dim=-1)
            kept = torch.zeros_like(probs).scatter_(-1, index, values)
            mass = float(kept.sum(-1).mean())
            loss, _ = ttt_loss(drafter, ids, aux, kept / kept.sum(-1, keepdim=True), depth=3)
            rows.append((k, mass, float(loss), float((loss - full) / full)))
    print(f"demo pair, {ids.shape[0]} held-out sequences of {ids.shape[1]} tokens, vocabulary {probs.shape[-1]}")
    print(f"{'top-k':>7} {'mass kept':>10} {'TTT loss':>10} {'vs full':>9}")
    for k, mass, loss, rel in rows:
        print(f"{k:>7} {mass:>10.4f} {loss:>10.4f} {rel:>+9.2%}")
    print(f"full distribution: TTT loss {float(full):.4f}")
    print("\nKimi-K3 capture, bytes per token (3 aux states x 7168, bf16, + top-k log-probabilities and ids):")
    for k in (16, 64, 256):
        per_token = bytes_per_token(3, 7168, torch.bfloat16, k)
        sizes = ", ".join(
            f"{n} tokens {per_token * t / 1e12:.2f} TB" for n, t in (("10M", 1e7), ("100M", 1e8), ("1B", 1e9))
        )
        print(f"  top-{k}: {per_token:,} B; {sizes}")


if __name__ == "__main__":
    main()
