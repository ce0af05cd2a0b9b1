#!/usr/bin/env python3
"""Build a small longer-context pair to measure acceptance at 2,048+ tokens of context.

    OMP_NUM_THREADS=1 python benchmarks/long_pair.py --work /work/longpair

Deterministic (seeded draws) and resumable: each part is skipped when it is already in WORK.

* a corpus of chat conversations in three domains (story: ``eagle31_mla.testing.demo_story``; math: short
  arithmetic chains; code: small Python functions), rendered with the target's chat template (TEMPLATE below) and
  packed back to back into 2,048-token sequences; a fifth of the answers also as raw text (no template);
* WORK/target: a tiny DeepSeek-V3 (4 dense layers, hidden 128, MLA kv_lora 512 + rope 64, 4,096 positions) and its
  512-token byte-level BPE, trained on those sequences, bf16;
* WORK/draft-eagle31 and WORK/draft-eagle3: drafters (the demo drafter's layer, 4,096 positions) trained against it
  with the identical recipe, data (the target's sequences, cut in 1,024-token halves) and seed; only fc_norm /
  norm_output differ (on: EAGLE-3.1, off: EAGLE-3); bf16;
* WORK/prompts.jsonl and WORK/long_prompts.jsonl: held-out conversations (user turn only), 8 short and 4 long (over
  2,100 tokens rendered) per domain; WORK/other_template.jinja: a ChatML template the drafters never saw.

Built in 29 minutes on one CPU thread (target 11, each drafter 9; TARGET_STEPS / DRAFT_STEPS below).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch

TEMPLATE = (  # template A: the target's (tokenizer.chat_template), the one the drafters train on
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OTHER_TEMPLATE = (  # ChatML: never seen in training
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SEQ_LEN, TARGET_STEPS, DRAFT_STEPS, DRAFT_SEQ_LEN = 2048, 330, 360, 1024  # 11 and 9 min on one thread
NAMES = "total count result value acc best items values numbers data xs row".split()
OPS = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]


def story(r: random.Random) -> tuple[str, str]:
    from eagle31_mla.testing import demo_story

    text, (name, animal, color) = demo_story(r)
    return f"Tell me a story about {name} and the {color} {animal}.", text


def math(r: random.Random) -> tuple[str, str]:
    x, steps = r.randrange(2, 50), []
    for _ in range(r.randint(2, 5)):
        sym, op = r.choice(OPS[:2] if steps and abs(x) > 100 else OPS)
        y = r.randrange(2, 10) if sym == "*" else r.randrange(1, 50)
        steps.append((x, sym, y, op(x, y)))
        x = op(x, y)
    problem = f"{steps[0][0]} " + " ".join(f"{s} {y}" for _, s, y, _ in steps)
    work = " ".join(f"{a} {s} {y} = {z}." for a, s, y, z in steps)
    return f"Solve: {problem} = ?", f"Q: {problem} = ? A: {work} The answer is {x}."


def code(r: random.Random) -> tuple[str, str]:
    out, arg, item = r.sample(NAMES, 3)
    k, sym = r.randrange(2, 10), r.choice("+-")
    kind = r.choice(["sum", "count", "max"])
    test = r.choice([f"{item} % {k} == 0", f"{item} > {k}", f"{item} < {k}", f"{item} != {k}"])
    init = {"sum": "0", "count": "0", "max": "None"}[kind]
    update = {
        "sum": f"{out} = {out} {sym} {item}",
        "count": f"{out} += 1",
        "max": f"if {out} is None or {item} > {out}:\n                {out} = {item}",
    }[kind]
    name = f"{kind}_{arg}_{r.choice(['where', 'if', 'when'])}_{k}"
    body = f"def {name}({arg}):\n    {out} = {init}\n    for {item} in {arg}:\n        if {test}:\n"
    body += f"            {update}\n    return {out}"
    return f"Write a function {name}({arg}) that takes the {kind} of the items where {test}.", body


DOMAINS = {"story": story, "math": math, "code": code}


def conversations(seed: int, n: int) -> list[tuple[str, str, str]]:
    """``n`` (domain, request, answer) per domain, interleaved (deterministic for ``seed``)."""
    r = random.Random(seed)
    return [(d, *f(r)) for _ in range(n) for d, f in DOMAINS.items()]


def render(messages: list[dict]) -> str:
    """TEMPLATE rendered as Transformers renders chat templates (before the tokenizer exists, to train it)."""
    from jinja2 import Environment

    return Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(messages=messages)


def chat(user: str, answer: str | None = None) -> list[dict]:
    return [{"role": "user", "content": user}] + ([{"role": "assistant", "content": answer}] if answer else [])


def build_target(tokenizer, sequences: torch.Tensor, folder: Path) -> None:
    """As scripts/build_demo_pair.py's build_target, at 2,048 tokens, batch 2."""
    from transformers import DeepseekV3ForCausalLM

    from eagle31_mla.testing import cpu_servable_target_config, train_tiny_target

    sizes = dict(vocab_size=512, hidden_size=128, intermediate_size=384)
    config = cpu_servable_target_config(tokenizer, num_layers=4, dense_layers=4, max_positions=4096, **sizes)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    print(f"target: final loss {train_tiny_target(model, sequences, TARGET_STEPS, batch_size=2):.3f}")
    model.eval().to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_drafter(target, sequences: torch.Tensor, folder: Path, eagle31: bool) -> None:
    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.training.trainer import TrainingConfig, drafter_for_target, layer_settings, train_drafter

    torch.manual_seed(2)
    shipped = json.loads((DEMO_DIR / "draft" / "config.json").read_text())  # the demo drafter's own layer
    layer = layer_settings(shipped) | dict(max_position_embeddings=4096)
    ids = shipped["eagle_aux_hidden_state_layer_ids"]
    drafter = drafter_for_target(
        target, fc_norm=eagle31, norm_output=eagle31, eagle_aux_hidden_state_layer_ids=ids, **layer
    )
    work = folder.with_name(folder.name + "-training")
    config = TrainingConfig(
        steps=DRAFT_STEPS, batch_size=2, seq_len=DRAFT_SEQ_LEN, depth=4, lr=3e-3, warmup=20, save_every=60, seed=0
    )
    train_drafter(target, drafter, sequences.view(-1, DRAFT_SEQ_LEN), work, config)  # resumes
    print(f"{folder.name}: final loss {config.log[-1]['loss']:.3f}, top-1 agreement {config.log[-1]['acc']}")
    drafter.to(torch.bfloat16).save_pretrained(folder)
    shutil.copy(work / "training.json", folder / "training.json")
    shutil.rmtree(work)


def prompt_length(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids)


def held_out(tokenizer, seen: set[str]) -> tuple[list[dict], list[dict]]:
    """8 short and 4 long conversations per domain whose requests are not in the training corpus; a long one's user
    message holds answers of other (seed 2) conversations of its domain, then the request."""
    requests, material = conversations(seed=1, n=600), conversations(seed=2, n=600)
    short, long = [], []
    for domain in DOMAINS:
        fresh = iter([request for d, request, _ in requests if d == domain and request not in seen])
        examples = iter([answer for d, _, answer in material if d == domain])
        short += [{"domain": domain, "conversation": chat(next(fresh))} for _ in range(8)]
        for _ in range(4):
            text = "Here are some examples:"
            while prompt_length(tokenizer, chat(text)) < 2150:
                text += "\n\n" + next(examples)
            long.append({"domain": domain, "conversation": chat(text + "\n\nNow: " + next(fresh))})
    return short, long


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle31-long-pair"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models on a shared machine
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from eagle31_mla.testing import train_byte_level_bpe
    from eagle31_mla.training.trainer import tokenize_corpus

    t0, work = time.time(), args.work
    corpus = conversations(seed=0, n=4000)
    texts = [render(chat(r, a)) for _, r, a in corpus]
    texts += [corpus[i][2] for i in random.Random(3).sample(range(len(corpus)), k=len(corpus) // 5)]  # raw text
    random.Random(4).shuffle(texts)
    if not (work / "target" / "config.json").is_file():
        tokenizer = train_byte_level_bpe(texts, 512, work / "target")
        tokenizer.chat_template = TEMPLATE  # saved with the target
    else:
        tokenizer = AutoTokenizer.from_pretrained(work / "target")
    assert tokenizer.apply_chat_template(chat("a", "b"), tokenize=False) == render(chat("a", "b"))
    sequences = tokenize_corpus(tokenizer, texts, SEQ_LEN)
    print(f"corpus: {len(texts)} texts, {sequences.numel():,} tokens, {sequences.shape[0]} sequences of {SEQ_LEN}")
    parts = {
        "target": lambda folder: build_target(tokenizer, sequences, folder),
        "draft-eagle31": lambda folder: build_drafter(target, sequences, folder, eagle31=True),
        "draft-eagle3": lambda folder: build_drafter(target, sequences, folder, eagle31=False),
    }
    for name, build in parts.items():
        if not (work / name / "config.json").is_file():
            t = time.time()
            build(work / name)
            print(f"{name}: built in {time.time() - t:.0f} s")
        if name == "target":  # what users load: the bf16 weights
            target = DeepseekV3ForCausalLM.from_pretrained(work / "target", dtype=torch.float32).eval()
    if not (work / "long_prompts.jsonl").is_file():
        for name, rows in zip(("prompts", "long_prompts"), held_out(tokenizer, {r for _, r, _ in corpus})):
            lengths = [prompt_length(tokenizer, row["conversation"]) for row in rows]
            print(f"{name} lengths:", {d: [n for n, r in zip(lengths, rows) if r["domain"] == d] for d in DOMAINS})
            (work / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (work / "other_template.jinja").write_text(OTHER_TEMPLATE)
    print(f"done in {time.time() - t0:.0f} s -> {work}")


if __name__ == "__main__":
    main()
