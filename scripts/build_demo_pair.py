#!/usr/bin/env python3
"""Rebuild the embedded demo pair from scratch: corpus, tokenizer, target, drafter.

    python scripts/build_demo_pair.py [--out src/eagle31_mla/demo_pair] [--quick]

Deterministic (every random draw is seeded). The corpus is generated (``eagle31_mla.testing``, where the
tests and benchmarks draw the same stories), so it ships under the project's licence. The target is a
tiny DeepSeek-V3 (MLA with kv_lora 512 + rope 64, the only MLA head size vLLM's CPU kernels take; dense
MLP, no MoE); the drafter is this library's EAGLE-3.1 model, trained against it with
`eagle31_mla.training.trainer` (test-time training, depth 4). Both are stored in bf16. Held-out prompts (never
in the training corpus) are written beside them. The target's tokenizer gets a minimal chat template
(``eagle31_mla.testing.DEMO_CHAT_TEMPLATE``: the messages' texts, roles dropped) so that chat clients can
talk to the served demo.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_target(tokenizer, sequences: torch.Tensor, steps: int, folder: Path) -> None:
    from tqdm.auto import tqdm
    from transformers import DeepseekV3ForCausalLM

    from eagle31_mla.testing import cpu_servable_target_config

    config = cpu_servable_target_config(
        tokenizer, vocab_size=512, hidden_size=128, num_layers=4, dense_layers=4, intermediate_size=384
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=steps, pct_start=max(0.05, 2 / steps)
    )
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in (bar := tqdm(range(steps), desc="train target")):
        batch = sequences[torch.randint(0, sequences.shape[0], (16,), generator=g)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def strip_remote_code(folder: Path) -> None:
    """The package itself is the code: keep no second copy of the modeling files in package data."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("auto_map", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in folder.glob("*.py"):
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "src" / "eagle31_mla" / "demo_pair")
    parser.add_argument("--quick", action="store_true", help="tiny step counts, to check the script runs")
    args = parser.parse_args()
    from transformers import DeepseekV3ForCausalLM

    from eagle31_mla.testing import DEMO_CHAT_TEMPLATE, demo_corpus, held_out_prompts, train_byte_level_bpe
    from eagle31_mla.training.trainer import TrainingConfig, drafter_for_target, tokenize_corpus, train_drafter

    t0 = time.time()
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "target").mkdir(parents=True)
    texts, seen = demo_corpus(seed=0, n=300 if args.quick else 6000)
    prompts = held_out_prompts(seed=1, n=24, seen=seen)
    tokenizer = train_byte_level_bpe(texts, 512, out / "target")
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE  # saved with the target (chat_template.jinja)
    sequences = tokenize_corpus(tokenizer, texts, seq_len=128)
    print(f"corpus: {len(texts)} stories, {sequences.numel():,} tokens, vocab {len(tokenizer)}")
    build_target(tokenizer, sequences, 20 if args.quick else 2000, out / "target")
    target = DeepseekV3ForCausalLM.from_pretrained(
        out / "target", dtype=torch.float32
    ).eval()  # what users load: bf16 weights

    torch.manual_seed(2)
    drafter = drafter_for_target(
        target,
        intermediate_size=384,
        num_attention_heads=2,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        max_position_embeddings=512,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    work = out / "draft-training"
    config = TrainingConfig(
        steps=10 if args.quick else 800, batch_size=12, seq_len=128, depth=4, lr=3e-3, warmup=50, save_every=500, seed=0
    )
    train_drafter(target, drafter, sequences, work, config)
    drafter.to(torch.bfloat16).save_pretrained(out / "draft")
    strip_remote_code(out / "draft")
    shutil.copy(work / "training.json", out / "draft" / "training.json")
    shutil.rmtree(work)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (out / "README.md").write_text(
        "Embedded demo pair built by scripts/build_demo_pair.py (deterministic; corpus generated by the script).\n"
        "target/: tiny DeepSeek-V3 (4 layers, hidden 128, MLA kv_lora 512 + rope 64), bf16, with its tokenizer.\n"
        "draft/: EAGLE-3.1 MLA drafter trained against it (aux layers one-based [1, 2, 3]), bf16.\n"
        "prompts.jsonl: held-out story openings (their name/animal/colour never occur in the corpus).\n"
    )
    print(f"built in {time.time() - t0:.0f} s -> {out}")


if __name__ == "__main__":
    main()
