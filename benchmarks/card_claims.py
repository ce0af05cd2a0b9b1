#!/usr/bin/env python3
"""The model card's claims, in miniature, on the embedded pair (greedy, chain drafting).

    python benchmarks/card_claims.py [--work /tmp/card-claims] [--prompts 24]

1. EAGLE-3.1 vs EAGLE-3 trained with the same budget: the shipped EAGLE-3.1 drafter against an
   EAGLE-3 drafter (no fc_norm, no norm_output) trained here with the identical recipe
   (draft/training.json), corpus and seed; accept length overall, by chain depth (6 draft steps) and
   by context length (the held-out prompt after 0, 2, 5 other stories).
2. The cost of serving with aux ids off by one: the EAGLE-3.1 drafter fed the target's states one
   layer late (what an engine does with one-based ids it takes for zero-based ones) and one layer
   early (zero-based ids taken for one-based: the trap vLLM sets for the training framework's form).
3. Out of distribution: the same prompts wrapped in a chat template the drafter never saw.

Both drafters and the target run in fp32; accept length = tokens per verification round (bonus
included, ceiling steps + 1). Compare rows of one run: this machine is shared and noisy, but these
numbers are deterministic (greedy), only the seconds vary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

CHAT = (
    "<|im_start|>system\nYou are a storyteller.<|im_end|>\n"
    "<|im_start|>user\nContinue: {prompt}<|im_end|>\n<|im_start|>assistant\n{prompt}"
)


def eagle3_drafter(target, sequences, work: Path):
    """The EAGLE-3 control, trained like the shipped drafter (cached in `work`)."""
    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.training.trainer import TrainingConfig, drafter_for_target, layer_settings, train_drafter

    folder = work / "eagle3"
    recipe = json.loads((DEMO_DIR / "draft" / "training.json").read_text())
    shipped = json.loads((DEMO_DIR / "draft" / "config.json").read_text())
    torch.manual_seed(2)  # as scripts/build_demo_pair.py
    ids = shipped["eagle_aux_hidden_state_layer_ids"]
    plain = dict(fc_norm=False, norm_output=False, eagle_aux_hidden_state_layer_ids=ids)  # EAGLE-3, same ids
    layer = layer_settings(shipped)  # the shipped drafter's own layer
    drafter = drafter_for_target(target, **plain, **layer)
    train_drafter(target, drafter, sequences, folder, TrainingConfig(**recipe))  # resumes: a no-op once trained
    return Eagle31MLAForCausalLM.from_pretrained(folder, dtype=torch.float32)


@contextlib.contextmanager
def aux_states_one_layer_early():
    """Every capture reads the hidden state one layer before the drafter's ids, as an engine that takes
    zero-based ids for one-based ones does; the first may be hidden_states[0] (the embeddings), which
    no valid one-based id names, hence a patch rather than a config."""
    from eagle31_mla.decoding.target import TargetAuxCapture

    original = TargetAuxCapture.__init__

    def early(self, target, aux_layer_ids):
        original(self, target, aux_layer_ids)
        self.indices = tuple(i - 1 for i in self.indices)

    TargetAuxCapture.__init__ = early
    try:
        yield
    finally:
        TargetAuxCapture.__init__ = original


def measure(target, drafter, prompts, tokenizer, steps=3, new_tokens=48) -> dict:
    from eagle31_mla.decoding.speculative import measure_acceptance

    total = measure_acceptance(
        target, drafter, prompts, num_steps=steps, max_new_tokens=new_tokens, tokenizer=tokenizer, ignore_eos=True
    )["total"]
    return {"accept_length": total["mean_accept_length"], "per_position": total["acceptance_rate_per_position"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle31-card-claims"))
    parser.add_argument("--prompts", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread avoids spin-waiting on a shared machine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.demo import DEMO_DIR, demo_prompts
    from eagle31_mla.testing import demo_corpus
    from eagle31_mla.training.trainer import tokenize_corpus

    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    texts, _ = demo_corpus(seed=0, n=6000)
    sequences = tokenize_corpus(tokenizer, texts, 128)
    drafters = {
        "EAGLE-3.1": Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32),
        "EAGLE-3": eagle3_drafter(target, sequences, args.work),
    }
    prompts = demo_prompts(args.prompts)
    filler, _ = demo_corpus(seed=7, n=8)  # other stories, placed before the prompt
    by_context = {n: [" ".join(filler[:n] + [p]) for p in prompts] for n in (0, 2, 5)}
    chat = [CHAT.format(prompt=p) for p in prompts]

    rows = {}
    for name, drafter in drafters.items():
        rows[name] = {
            "held_out": measure(target, drafter, prompts, tokenizer),
            "depth6": measure(target, drafter, prompts, tokenizer, steps=6),
            "context": {n: measure(target, drafter, ps, tokenizer) for n, ps in by_context.items()},
            "chat_template": measure(target, drafter, chat, tokenizer),
        }
    drafter = drafters["EAGLE-3.1"]
    trained_ids = list(drafter.config.aux_layer_ids.one_based)
    off_by_one = {}
    drafter.config.eagle_aux_hidden_state_layer_ids = [i + 1 for i in trained_ids]  # valid ids, one layer late
    off_by_one[1] = measure(target, drafter, prompts, tokenizer)
    drafter.config.eagle_aux_hidden_state_layer_ids = trained_ids
    with aux_states_one_layer_early():
        off_by_one[-1] = measure(target, drafter, prompts, tokenizer)

    lengths = {n: len(tokenizer(ps[0])["input_ids"]) for n, ps in by_context.items()}
    print(
        f"# Model card claims in miniature ({time.strftime('%Y-%m-%d')}; {len(prompts)} held-out prompts, "
        f"48 new tokens each, greedy; {time.time() - start:.0f} s)\n"
    )
    print("## 1. EAGLE-3.1 vs EAGLE-3, same training budget\n")
    print(
        "| drafter | accept length (3 steps) | per position (3 steps) "
        "| accept length (6 steps) | per position (6 steps) |"
    )
    print("|---|--:|---|--:|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['held_out']['accept_length']:.2f} | {fmt(r['held_out']['per_position'])} | "
            f"{r['depth6']['accept_length']:.2f} | {fmt(r['depth6']['per_position'])} |"
        )
    print("\nBy context length (held-out prompt after n other stories; 3 steps):\n")
    print("| drafter | " + " | ".join(f"n={n} (~{lengths[n]} tokens)" for n in by_context) + " |")
    print("|---|" + "--:|" * len(by_context))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r['context'][n]['accept_length']:.2f}" for n in by_context) + " |")
    print("\n## 2. Serving with aux ids off by one (EAGLE-3.1, 3 steps)\n")
    print("| aux layers fed | accept length | per position |")
    print("|---|--:|---|")
    print(
        f"| trained: one-based {trained_ids} | {rows['EAGLE-3.1']['held_out']['accept_length']:.2f} | "
        f"{fmt(rows['EAGLE-3.1']['held_out']['per_position'])} |"
    )
    for shift, label in ((1, "one layer late"), (-1, "one layer early")):
        r = off_by_one[shift]
        print(f"| {label}: {[i + shift for i in trained_ids]} | {r['accept_length']:.2f} | {fmt(r['per_position'])} |")
    print("\n## 3. Out of distribution: a chat template the drafters never saw (3 steps)\n")
    print("| drafter | plain prompts | chat template | ratio |")
    print("|---|--:|--:|--:|")
    for name, r in rows.items():
        a, b = r["held_out"]["accept_length"], r["chat_template"]["accept_length"]
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |")


def fmt(rates) -> str:
    return " ".join(f"{r:.2f}" for r in rates)


if __name__ == "__main__":
    main()
